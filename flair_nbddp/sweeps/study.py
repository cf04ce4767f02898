"""A sweep's Optuna study: named, kept beside the run ledger in Optuna's own journal file, continued across kernels.

``$FLAIR_NBDDP_HOME/studies/<name>.journal`` (default ``~/.flair_nbddp/studies/``) is an Optuna
``JournalFileBackend``: ``optuna.load_study(study_name=name, storage=journal_storage(name))`` opens it outside the
kit too. The parameters a trial gets come from ``space``: Optuna's define-by-run function (``lambda trial: {"lr":
trial.suggest_float("lr", 1e-5, 1e-3, log=True)}``) or a dict of Optuna distributions.

Example::

    study = open_study("lr-search", "maximize")
    trial, params = ask(study, lambda t: {"lr": t.suggest_float("lr", 1e-4, 1e-2, log=True)})
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from ..errors import ConfigurationError, MissingDependencyError
from ..ledger.store import Ledger, kit_home

STUDIES = "studies"
DIRECTIONS = ("maximize", "minimize")
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")


def optuna() -> Any:
    """The ``optuna`` module, or a clear error naming how to install it."""
    try:
        import optuna as module
    except ImportError:
        raise MissingDependencyError(
            "sweep() searches with Optuna, which is not installed here: pip install 'flair_nbddp[sweep]' "
            "(or pip install optuna)"
        ) from None
    return module


@contextlib.contextmanager
def quiet_optuna() -> Iterator[Any]:
    """Optuna's log at warnings only, for a while (a sweep's view tells of each trial); yields the module."""
    module = optuna()
    verbosity = module.logging.get_verbosity()
    module.logging.set_verbosity(module.logging.WARNING)
    try:
        yield module
    finally:
        module.logging.set_verbosity(verbosity)


def study_file(name: str) -> Path:
    """Where study ``name`` is kept (``$FLAIR_NBDDP_HOME/studies/<name>.journal``).

    Example:
        >>> study_file("lr search/2").name
        'lr_search_2.journal'
    """
    return kit_home() / STUDIES / f"{_UNSAFE.sub('_', name).strip('_.') or 'study'}.journal"


def journal_storage(name: str) -> Any:
    """Optuna's journal storage of study ``name`` (the directory made, private, if missing)."""
    path = study_file(name)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    return JournalStorage(JournalFileBackend(str(path)))


def new_study_name(fn_name: str) -> str:
    """A name for a study the user did not name: the function's and the time (``train-20261205-193012``)."""
    return f"{_UNSAFE.sub('_', fn_name).strip('_') or 'sweep'}-{time.strftime('%Y%m%d-%H%M%S')}"


def open_study(study: Any, direction: str, pruner: Any = None, fn_name: str = "sweep") -> Any:
    """The ``optuna.Study`` a sweep adds trials to: ``study`` itself when it is one, else the named study (created,
    or continued when it exists; a new name when None).

    Raises:
        ConfigurationError: an unknown ``direction``, one that is not the existing study's, or a ``pruner`` beside
            a given ``optuna.Study`` (it has its own).
        MissingDependencyError: Optuna is not installed.
    """
    module = optuna()
    if direction not in DIRECTIONS:
        raise ConfigurationError(f"direction={direction!r}: use 'maximize' (a score) or 'minimize' (a loss)")
    if isinstance(study, module.Study):
        if pruner is not None:
            raise ConfigurationError(
                "pruner= goes with a study's name; a given optuna.Study has its pruner already: create it with "
                "optuna.create_study(..., pruner=...), or pass its name instead"
            )
        opened = study
    else:
        if study is not None and not isinstance(study, str):
            raise ConfigurationError(f"study={study!r}: pass a name (a string), an optuna.Study, or None for a new one")
        name = study or new_study_name(fn_name)
        opened = module.create_study(
            storage=journal_storage(name), study_name=name, direction=direction, pruner=pruner, load_if_exists=True
        )
    wanted = module.study.StudyDirection.MAXIMIZE if direction == "maximize" else module.study.StudyDirection.MINIMIZE
    if opened.direction != wanted:
        raise ConfigurationError(
            f"study {opened.study_name!r} {opened.direction.name.lower()}s its metric, and direction={direction!r} "
            "was asked: pass its direction, or name a new study"
        )
    return opened


def fail_lost_trials(study: Any, ledger: Ledger | None) -> list[int]:
    """Mark failed the trials left running by a kernel that died (the ledger marks its runs ``"lost"``); return their
    numbers. Trials another live kernel runs are left alone, and so are trials without a record (the ledger off)."""
    module = optuna()
    failed = []
    for trial in study.get_trials(deepcopy=False, states=(module.trial.TrialState.RUNNING,)):
        record_id = trial.user_attrs.get("record_id")
        record = ledger.get(record_id) if ledger is not None and record_id is not None else None
        if record is None or record.status != "lost":
            continue
        study.tell(trial.number, state=module.trial.TrialState.FAIL, skip_if_finished=True)
        failed.append(trial.number)
    return failed


def check_space(space: Any) -> None:
    """Refuse a ``space`` that is neither a function of a trial nor a dict of Optuna distributions.

    Raises:
        ConfigurationError: naming what to pass instead.
    """
    module = optuna()
    if isinstance(space, Mapping):
        wrong = [name for name, value in space.items() if not isinstance(value, module.distributions.BaseDistribution)]
        if wrong or not space:
            raise ConfigurationError(
                f"space[{wrong[0]!r}] is not an Optuna distribution: " if wrong else "space is an empty dict: "
                "use e.g. {'lr': optuna.distributions.FloatDistribution(1e-5, 1e-3, log=True)}, or a function of the "
                "trial"
            )
    elif not callable(space):
        raise ConfigurationError(
            f"space must be a function of an Optuna trial or a dict of Optuna distributions, not {type(space).__name__}"
        )


def ask(study: Any, space: Callable[[Any], Mapping] | Mapping) -> tuple[Any, dict[str, Any]]:
    """A new trial of ``study`` and the keyword arguments ``space`` gives it.

    Raises:
        ConfigurationError: the function returned no dict of parameter names (the trial is told failed).
    """
    if isinstance(space, Mapping):
        trial = study.ask(fixed_distributions=dict(space))
        return trial, {name: trial.params[name] for name in space}
    trial = study.ask()
    try:
        params = space(trial)
        if not isinstance(params, Mapping) or not all(isinstance(name, str) for name in params):
            raise ConfigurationError(
                f"space(trial) returned {type(params).__name__}: return a dict of keyword arguments for fn, e.g. "
                "{'lr': trial.suggest_float('lr', 1e-5, 1e-3, log=True)}"
            )
    except BaseException:
        study.tell(trial, state=optuna().trial.TrialState.FAIL)
        raise
    return trial, dict(params)


def space_names(space: Callable[[Any], Mapping] | Mapping) -> list[str]:
    """The parameter names ``space`` gives (a function is asked once, by a throwaway in-memory study).

    Example:
        >>> space_names(lambda trial: {"lr": trial.suggest_float("lr", 1e-4, 1e-2), "epochs": 2})
        ['lr', 'epochs']
    """
    check_space(space)
    if isinstance(space, Mapping):
        return list(space)
    with quiet_optuna() as module:
        return list(ask(module.create_study(), space)[1])

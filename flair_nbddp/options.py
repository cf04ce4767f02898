"""The run options: one frozen :class:`RunOptions`, the only place an option is defined.

:func:`flair_nbddp.launch`, :func:`flair_nbddp.start`, :meth:`flair_nbddp.WorkerPool.launch` and
:meth:`~flair_nbddp.WorkerPool.exec` take them as keyword arguments (or whole, as ``options=``);
:class:`flair_nbddp.TrainingPanel` passes them to every run it starts; ``%%ddp_train`` and ``%%ddp_exec`` make
their flags from them (``--stop-timeout``, ``--no-lazy-corpus``...). Each field's documentation is used by all
of them: the functions' docstrings and the magics' ``--help`` are written from it. Adding an option is a field
here (and the code that uses it).

Example:
    >>> options = RunOptions.of({"processes": 2, "seed": 7})
    >>> options.processes, options.seed, options.lazy_corpus
    (2, 7, None)
    >>> RunOptions.of({"proceses": 2})
    Traceback (most recent call last):
    ...
    flair_nbddp.errors.UnknownOptionError: 'proceses' is not a run option (did you mean 'processes'?); the run options are: processes, device, gpus, share_gpus, wait_for_devices, cluster, timeout, stop_timeout, hang_timeout, seed, dashboard, output, run_dir, distributed_eval, lazy_corpus, fast_inputs, direct_embeddings, skip_clean_tokens, precision, compile_model, resume, checkpoint_every, max_restarts, restart_timeout, on_oom, resume_force
"""

from __future__ import annotations

import argparse
import difflib
import inspect
import re
import textwrap
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from .errors import ConfigurationError, UnknownOptionError
from .worker.compiled import unknown_name
from .worker.precision import PRECISIONS

DEFAULT_STOP_TIMEOUT = 30.0
DEFAULT_HANG_TIMEOUT = 300.0
DEFAULT_RESTART_TIMEOUT = 120.0
OUTPUT_MODES = ("rank0", "all")
DEVICES = ("cpu", "cuda")
_ROLE = re.compile(r":[a-z]+:`~?([\w.]+)`")


ON_OOM = ("fail", "halve_chunk")


def _option(default: Any, doc: str, *, flag: dict | None = None, ddp_exec: bool = False) -> Any:
    """A field of :class:`RunOptions`: its default, its documentation, and how a magic's flag spells it
    (``flag``: argparse's keywords; absent for options no magic takes); ``ddp_exec``: ``%%ddp_exec`` takes it."""
    return field(default=default, metadata={"doc": doc, "flag": flag, "ddp_exec": ddp_exec})


def numbers(flag: str, kind: str) -> Callable[[str], tuple[int, ...]]:
    """A magic flag's parser of number lists: ``"0,2"`` → ``(0, 2)``; a bad list names ``kind`` and the fix.

    Example:
        >>> numbers("--ranks", "rank")("0, 2")
        (0, 2)
    """

    def parse(text: str) -> tuple[int, ...]:
        try:
            return tuple(int(part) for part in text.split(","))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text} is not a list of {kind} numbers: write e.g. {flag} 0,2") from None

    return parse


def compile_setting(text: str) -> bool | str:
    """A magic's ``--compile-model``: ``on``/``off`` (also ``true``/``false``, ``yes``/``no``, ``1``/``0``), or an
    inductor mode or torch.compile backend by name.

    Example:
        >>> compile_setting("off"), compile_setting("On"), compile_setting("1"), compile_setting("reduce-overhead")
        (False, True, True, 'reduce-overhead')
    """
    words = {"on": True, "true": True, "yes": True, "1": True, "off": False, "false": False, "no": False, "0": False}
    return words.get(text.lower(), text)


def _seconds_or_off(text: str) -> float | None:
    """A magic's ``--hang-timeout``: seconds, 0 for off."""
    return float(text) or None


@dataclass(frozen=True)
class RunOptions:
    """How a run runs: where (devices, a cluster), its limits, its seed, what the cell shows, what the workers do.

    Every field has a default; give only what you change. ``RunOptions.of(kwargs)`` checks the names.

    Example::

        options = RunOptions(processes=2, seed=0, timeout=600)
        launch(train, (corpus,), options=options)     # the same as launch(train, (corpus,), processes=2, ...)
        launch(train, (corpus,), options=options, seed=1)   # keywords given beside options= win
    """

    processes: int | None = _option(
        None, "number of processes; default every free GPU (one no other run holds and no other program uses), else "
        "2 CPU processes (or ``$FLAIR_NBDDP_PROCESSES``; fewer when other runs hold CPU slots).",
        flag={"type": int, "metavar": "N"},
    )  # fmt: skip
    device: str | None = _option(
        None, '``"cuda"`` (NCCL), ``"cpu"`` (gloo), or None for CUDA when GPUs are visible (or '
        "``$FLAIR_NBDDP_DEVICE``).",
        flag={"choices": DEVICES},
    )  # fmt: skip
    gpus: tuple[int, ...] | None = _option(
        None, "run on these GPUs only, one process each, e.g. ``[0, 2]`` (numbered as torch numbers them in this "
        "kernel); works after the kernel has initialised CUDA, unlike setting ``CUDA_VISIBLE_DEVICES``.",
        flag={"metavar": "0,2", "type": numbers("--gpus", "GPU")},
    )  # fmt: skip
    share_gpus: bool = _option(
        False, "with more CUDA processes than GPUs (``processes=4`` on one GPU), run them anyway, the GPUs taken in "
        "turn, over gloo (NCCL takes one rank per GPU): a rehearsal of a multi-GPU run, correct but not fast; the run "
        "says so and the ledger records its devices. Also: run on GPUs another run (of any kernel or user) holds, or "
        "another program uses, sharing them on purpose; the run says with whom.",
        flag={"name": "--share-gpus", "const": True},
    )  # fmt: skip
    wait_for_devices: float | None = _option(
        None, "seconds to wait for devices another run holds (of this kernel, another kernel or another user of the "
        "machine): the run waits in the machine's queue, says where it stands and who holds what, and starts when "
        "they are free, runs that asked earlier first; an interrupt leaves the queue. None: refuse at once with "
        ":class:`~flair_nbddp.RunActiveError`, naming the holder.",
        flag={"type": float, "metavar": "S"},
    )  # fmt: skip
    cluster: Any = _option(
        None, "run on a Dask cluster instead of this machine: a ``distributed.Client`` (``LocalCluster``, "
        "dask-jobqueue's ``SLURMCluster``/``PBSCluster``, dask-kubernetes, a Gateway, Coiled) or a scheduler address "
        "(in a magic: the address, or the name of a Client in the notebook). One rank per Dask worker with a GPU "
        "(NCCL), else per CPU worker (gloo); ``processes`` picks how many (:mod:`flair_nbddp.cluster`).",
        flag={"metavar": "ADDRESS_OR_NAME"},
    )  # fmt: skip
    timeout: float | None = _option(
        None, "seconds after which the run is ended and :class:`~flair_nbddp.RunTimeoutError` raised.",
        flag={"type": float, "metavar": "S"}, ddp_exec=True,
    )  # fmt: skip
    stop_timeout: float = _option(
        DEFAULT_STOP_TIMEOUT, "seconds a graceful stop (or an interrupted ``%%ddp_exec`` cell) may take before the "
        "workers are ended.", flag={"type": float, "metavar": "S"}, ddp_exec=True,
    )  # fmt: skip
    hang_timeout: float | None = _option(
        DEFAULT_HANG_TIMEOUT, "seconds without progress on any rank (no training step, an unchanged call stack) after "
        "which the run is ended with :class:`~flair_nbddp.RunHangError` showing every rank's stack; None (0 in a "
        "magic): off. A rank that loops through different Python functions looks busy to it: ``timeout`` bounds those.",
        flag={"type": _seconds_or_off, "metavar": "S"}, ddp_exec=True,
    )  # fmt: skip
    seed: int | None = _option(
        None, "the seed given to every rank (``flair.set_seed``); None: ``$FLAIR_NBDDP_SEED``, else a random one. Kept "
        "in the result.", flag={"type": int},
    )  # fmt: skip
    dashboard: bool | None = _option(
        None, "None shows the live widget dashboard in a notebook (plain progress lines elsewhere); True insists on "
        "the widget; False shows nothing but the output lines.", flag={"name": "--no-dashboard", "const": False},
    )  # fmt: skip
    output: str = _option(
        "rank0", '``"rank0"``: rank 0\'s output, and every other rank\'s stderr lines and warnings as they come, '
        'prefixed ``[rank r]``; ``"all"``: every line of every rank, prefixed. Each rank\'s full output is in its '
        "log either way (``RunResult.logs``).", flag={"choices": OUTPUT_MODES},
    )  # fmt: skip
    run_dir: str | Path | None = _option(
        None, "the run's directory (logs, payload, result); default a new private one under ``$FLAIR_NBDDP_RUNS`` or "
        "the temporary directory. On a pool too: each run has its own.", flag={"metavar": "PATH"},
    )  # fmt: skip
    distributed_eval: bool = _option(
        True, "with several processes, each rank evaluates only its share of every split flair (or ``fn``) "
        "evaluates, and every rank gets the result one process would (:mod:`flair_nbddp.worker.distributed_eval`); "
        "False: every rank evaluates the whole split, as flair does.",
        flag={"name": "--no-distributed-eval", "const": False},
    )  # fmt: skip
    lazy_corpus: bool | None = _option(
        None, "True: a flair corpus (or dataset) among the arguments stays in its compact shipped form in each "
        "worker, and each sentence is built when flair reads it (:mod:`flair_nbddp.wire.lazy_corpus`): worker memory "
        "and start-up do not grow with the corpus. False: every sentence is built before ``fn`` starts, as flair's "
        "own script has them (no sentence built again in every epoch: a GPU trains faster). None: lazy for a corpus "
        "that, built, would take more than 1 GiB of a worker's memory (about 9,000 IMDB-length reviews), built below.",
        flag={"name": "--no-lazy-corpus", "const": False},
    )  # fmt: skip
    fast_inputs: bool = _option(
        True, "flair's transformer embeddings get each sentence's tokenizer output from what the worker kept the "
        "first time it saw the sentence, instead of tokenizing it again in every batch of every epoch "
        "(:mod:`flair_nbddp.worker.fast_inputs`): the same inputs, the tokenizer's work done once. False: flair's own "
        "way.", flag={"name": "--no-fast-inputs", "const": False},
    )  # fmt: skip
    direct_embeddings: bool = _option(
        True, "a SequenceTagger on one transformer's word embeddings takes the embeddings' batch tensor as it is made, "
        "instead of flair storing a vector on each token and gathering them back token by token "
        "(:mod:`flair_nbddp.worker.direct_embeddings`), and transformer word embeddings are picked from the model's "
        "output in one operation, not sentence by sentence (:mod:`flair_nbddp.worker.token_gathers`): the same "
        "tensors, the same training. False: flair's own way.",
        flag={"name": "--no-direct-embeddings", "const": False},
    )  # fmt: skip
    skip_clean_tokens: bool = _option(
        True, "flair's clearing of a batch's embeddings after each batch leaves alone the tokens of a sentence that "
        "hold none since its last clearing (a document classifier's, or a tagger's with ``direct_embeddings``), and "
        "a classifier's removal of its old labels before it predicts leaves alone tokens that carry none, instead of "
        "walking every token (:mod:`flair_nbddp.worker.clean_tokens`): the same end state. False: flair's own way.",
        flag={"name": "--no-skip-clean-tokens", "const": False},
    )  # fmt: skip
    precision: str = _option(
        "fp32", '``"fp32"``: flair\'s default, unchanged; ``"bf16"``: the forward passes of training and evaluation '
        "under "
        "bfloat16 autocast, no gradient scaler (GPUs with bfloat16, and CPU); ``\"fp16\"``: flair's own mixed "
        "precision (``use_amp=True``). bf16 and fp16 give scores close to fp32's, not the same "
        "(:mod:`flair_nbddp.worker.precision`).", flag={"choices": PRECISIONS},
    )  # fmt: skip

    compile_model: bool | str = _option(
        False, "compile flair's transformer with ``torch.compile`` while it trains: True (``on`` in a magic) with "
        "torch's default, or an inductor mode (``\"reduce-overhead\"``: CUDA graphs, 1.06-1.23 times the eager bf16 "
        "rate over an epoch on an H100, after tens of seconds of compiling, which a short run does not earn back) or a "
        "backend's name (``\"aot_eager\"``); False (``off``): flair's eager model. Compiled arithmetic is not flair's "
        "bit for bit (:mod:`flair_nbddp.worker.compiled`).",
        flag={"metavar": "on|off|MODE", "nargs": "?", "const": True, "type": compile_setting},
    )  # fmt: skip
    resume: Any = _option(
        None, "continue from the last full checkpoint of an earlier run of the same function (every epoch's end "
        "is one): its :class:`~flair_nbddp.RunResult`, its ledger record or id, or ``\"last\"`` (this function's "
        "last run that wrote one); flair's trainer goes on from the epoch after it, with the saved model, optimizer, "
        "schedule and random generators, so the curves are those of an uninterrupted run. Refused "
        "(:class:`~flair_nbddp.ResumeError`) for another function, corpus or number of processes.",
        flag={"metavar": "ID", "nargs": "?", "const": "last"},
    )  # fmt: skip
    checkpoint_every: int | None = _option(
        None, "besides the full checkpoint at every epoch's end (and at a stop), write one every N optimizer steps, "
        "so that a restart or a resume loses at most N steps; None: at epochs' ends only. A resume from one goes on "
        "from that batch, with the curves of an uninterrupted run.", flag={"type": int, "metavar": "N"},
    )  # fmt: skip
    max_restarts: int = _option(
        0, "when a rank fails (an error, a signal, out of memory, a lost Dask worker, a hang past ``hang_timeout``), "
        "end every rank and start the run again from its last full checkpoint, up to this many times (``launch``, "
        "``start``, ``WorkerPool.launch``, ``%%ddp_train`` and the panel); an interrupt or a stop is never restarted, "
        "nor a ``timeout``. "
        ":attr:`RunResult.attempts <flair_nbddp.RunResult.attempts>` lists every attempt.",
        flag={"type": int, "metavar": "N"},
    )  # fmt: skip
    restart_timeout: float = _option(
        DEFAULT_RESTART_TIMEOUT, "on a Dask cluster, how many seconds a restart (``max_restarts``, ``on_oom``) waits "
        "for enough Dask workers to take the ranks again (those still there, or new ones that join: a lost node's "
        "replacement), before it gives up with the cluster's error.", flag={"type": float, "metavar": "S"},
    )  # fmt: skip
    on_oom: str = _option(
        "fail", '``"fail"``: a rank out of memory ends the run with :class:`~flair_nbddp.OutOfMemoryError`; '
        '``"halve_chunk"``: start it again from its last full checkpoint with flair\'s ``mini_batch_chunk_size`` '
        "halved (the same effective batch, so the same schedule, in smaller pieces), down to 1; these restarts do "
        "not count against ``max_restarts``.",
        flag={"choices": ON_OOM},
    )  # fmt: skip
    resume_force: bool = _option(
        False, "resume even though the function's source or the corpus changed since the run resumed from.",
        flag={"name": "--resume-force", "const": True},
    )  # fmt: skip

    def __post_init__(self) -> None:
        if self.gpus is not None:
            object.__setattr__(self, "gpus", tuple(self.gpus))
        if self.precision not in PRECISIONS:
            raise ConfigurationError(
                f"precision={self.precision!r} is not one of {', '.join(map(repr, PRECISIONS))}: fp32 is flair's "
                "default, bf16 bfloat16 autocast, fp16 flair's use_amp"
            )
        if not (isinstance(self.compile_model, bool) or (isinstance(self.compile_model, str) and self.compile_model)):
            raise ConfigurationError(
                f"compile_model={self.compile_model!r} is not a setting: give False (flair's eager model), True, or "
                "an inductor mode or torch.compile backend by name, such as 'reduce-overhead'"
            )
        if isinstance(self.compile_model, str) and (unknown := unknown_name(self.compile_model)):
            raise ConfigurationError(f"compile_model={self.compile_model!r}: {unknown}")
        if self.on_oom not in ON_OOM:
            raise ConfigurationError(
                f"on_oom={self.on_oom!r} is not one of {', '.join(map(repr, ON_OOM))}: 'fail' ends the run with "
                "OutOfMemoryError, 'halve_chunk' starts it again with a halved mini_batch_chunk_size"
            )
        if self.checkpoint_every is not None and (
            isinstance(self.checkpoint_every, bool) or not isinstance(self.checkpoint_every, int)
            or self.checkpoint_every < 1
        ):  # fmt: skip
            raise ConfigurationError(
                f"checkpoint_every={self.checkpoint_every!r} is not a number of steps: give e.g. 500, or None for a "
                "checkpoint at every epoch's end only"
            )
        if self.wait_for_devices is not None and (
            isinstance(self.wait_for_devices, bool) or not isinstance(self.wait_for_devices, (int, float))
            or not self.wait_for_devices >= 0
        ):  # fmt: skip
            raise ConfigurationError(
                f"wait_for_devices={self.wait_for_devices!r} is not a number of seconds: give e.g. 600 to wait up to "
                "ten minutes for busy devices, or None to be refused at once"
            )
        if not isinstance(self.max_restarts, int) or self.max_restarts < 0:
            raise ConfigurationError(f"max_restarts={self.max_restarts!r} is not a count: give 0 (the default) or more")
        if self.output not in OUTPUT_MODES:
            raise ConfigurationError(
                f"output={self.output!r} is not a mode: 'rank0' (rank 0's output, and every rank's warnings and "
                "stderr) or 'all' (every line of every rank)"
            )

    @classmethod
    def of(
        cls, given: Mapping[str, Any], base: RunOptions | None = None, *, where: str = "",
        not_here: Mapping[str, str] | None = None,
    ) -> RunOptions:  # fmt: skip
        """``base`` (default: every default) with the options in ``given`` changed.

        Raises:
            UnknownOptionError: a name in ``given`` is not a run option (the message suggests the closest;
                ``where`` names what was called), or one of ``not_here`` (an option this caller decides itself,
                with the reason).
        """
        names = option_names()
        for name, reason in (not_here or {}).items():
            if name in given:
                raise UnknownOptionError(f"{where}{name}= is not taken here: {reason}")
        for name in given:
            if name not in names:
                close = difflib.get_close_matches(name, names, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise UnknownOptionError(
                    f"{where}{name!r} is not a run option{hint}; the run options are: {', '.join(names)}"
                )
        return replace(base or cls(), **given)

    def ledger_view(self) -> dict[str, Any]:
        """The options the run ledger records with a run (where it ran is recorded apart, as its devices)."""
        return {name: getattr(self, name) for name in option_names() if name not in _RECORDED_APART}


_RECORDED_APART = ("processes", "device", "gpus", "share_gpus", "wait_for_devices", "cluster", "dashboard", "run_dir", "seed", "resume", "resume_force")  # noqa: E501
# ...as its devices, directory, seed and the run it resumed from


def option_names() -> tuple[str, ...]:
    """Every run option, in :class:`RunOptions`' order."""
    return tuple(spec.name for spec in fields(RunOptions))


@dataclass(frozen=True)
class Flag:
    """One run option as a magic's flag: ``argparse``'s ``add_argument(name, **keywords)``."""

    option: str
    name: str
    keywords: dict


def magic_flags(ddp_exec: bool = False) -> list[Flag]:
    """The flags of ``%%ddp_train`` (every option a magic can spell), or of ``%%ddp_exec``, made from the fields.

    Example:
        >>> [flag.name for flag in magic_flags(ddp_exec=True)]
        ['--timeout', '--stop-timeout', '--hang-timeout']
    """
    flags = []
    for spec in fields(RunOptions):
        flag = spec.metadata["flag"]
        if flag is None or (ddp_exec and not spec.metadata["ddp_exec"]):
            continue
        keywords = {key: value for key, value in flag.items() if key != "name"}
        seconds = f" (default {spec.default:g})" if isinstance(spec.default, float) else ""
        keywords["help"] = _plain(spec.metadata["doc"]) + seconds
        if "const" in flag and "nargs" not in flag:  # a switch that turns a default off (or on)
            keywords.update(action="store_const", default=spec.default)
        else:
            keywords["default"] = spec.default
        keywords["dest"] = spec.name
        flags.append(Flag(spec.name, flag.get("name", "--" + spec.name.replace("_", "-")), keywords))
    return flags


def from_flags(parsed: Any, ddp_exec: bool = False) -> dict[str, Any]:
    """The run options a magic's parsed line gives (each flag's value under its option's name)."""
    return {flag.option: getattr(parsed, flag.option) for flag in magic_flags(ddp_exec)}


def _plain(doc: str) -> str:
    """A field's documentation as a flag's help: without reStructuredText markup.

    Example:
        >>> _plain("ends with :class:`~flair_nbddp.RunHangError` (``None``: off)")
        'ends with RunHangError (None: off)'
    """
    return _ROLE.sub(lambda match: match.group(1).rsplit(".", 1)[-1], doc).replace("``", "")


def documented(*exclude: str) -> Callable[[Callable], Callable]:
    """Give a function that takes ``**run_options`` its full signature and the options' documentation.

    The signature (``help()``, a notebook's Shift-Tab) lists each option as a keyword argument with its default;
    ``{run_options}`` in the docstring becomes one ``name: doc`` entry per option (minus ``exclude``).
    """

    def decorate(fn: Callable) -> Callable:
        signature = inspect.signature(fn)
        kept = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
        options = [
            inspect.Parameter(spec.name, inspect.Parameter.KEYWORD_ONLY, default=spec.default, annotation=spec.type)
            for spec in fields(RunOptions) if spec.name not in exclude
        ]  # fmt: skip
        fn.__signature__ = signature.replace(parameters=[*kept, *options])
        doc = fn.__doc__ or ""
        placeholder = re.search(r"^( *)\{run_options\}", doc, re.MULTILINE)
        indent = placeholder.group(1) if placeholder else ""
        entries = "\n".join(
            textwrap.fill(f"{spec.name}: {spec.metadata['doc']}", 112, initial_indent=indent,
                          subsequent_indent=indent + "    ", break_long_words=False, break_on_hyphens=False)
            for spec in fields(RunOptions) if spec.name not in exclude
        )  # fmt: skip
        fn.__doc__ = doc.replace("{run_options}", entries.strip())
        return fn

    return decorate

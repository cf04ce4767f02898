"""IPython magics: ``%%ddp_train`` runs a cell on every device, ``%%ddp_sweep`` sweeps it with Optuna, ``%ddp_pool``
keeps warm workers for it (and corpora in them: ``%ddp_pool put corpus``), ``%ddp_info`` shows devices and runs,
``%ddp_devices`` every claim on the machine, ``%ddp_runs`` the run ledger.

Load them with ``%load_ext flair_nbddp``.

Example (in a notebook)::

    %load_ext flair_nbddp

    %%ddp_train --processes 2 --out scores
    trainer = ModelTrainer(make_classifier(corpus), corpus)   # corpus, make_classifier: earlier cells
    trainer.fine_tune("out", max_epochs=2, multi_gpu=True)
"""

from __future__ import annotations

import ast
import contextlib
from collections.abc import Callable, Collection, Iterator

from IPython.core.error import UsageError
from IPython.core.magic import (
    Magics,
    cell_magic,
    line_cell_magic,
    line_magic,
    magics_class,
    no_var_expand,
)
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from ..api import launch
from ..engine.devices import gpu_names, resolve_devices
from ..engine.in_use import devices_in_use
from ..errors import (
    ClusterError,
    ConfigurationError,
    DeviceError,
    LedgerError,
    RunActiveError,
    ShippingError,
    UnknownOptionError,
    UnsupportedPlatformError,
)
from ..ledger.provenance import Provenance
from ..ledger.store import ENDED, history, ledger_path
from ..ledger.versions import versions
from ..options import DEVICES, from_flags, magic_flags, numbers
from ..pool import WorkerPool, check_ranks, current_pool, set_current_pool
from ..engine.run import runs
from ..wire.payload import describe_unpicklable
from ..worker.cell_code import run_ddp_sweep_cell, run_ddp_train_cell
from ..worker.ddp_exec import PREDEFINED, RankResult
from .cell_names import names_to_ship
from .run_table import runs_html

# A magic reports a mistake in its options or cell as IPython's own UsageError, the one exception outside the
# kit's FlairNbddpError family: IPython shows it as a single line only when `etype is UsageError`, not for a
# subclass (InteractiveShell.showtraceback).

def run_option_flags(ddp_exec: bool = False) -> Callable[[Callable], Callable]:
    """A magic's flags for the run options (:func:`flair_nbddp.options.magic_flags`), in the options' order."""

    def decorate(magic: Callable) -> Callable:
        for flag in reversed(magic_flags(ddp_exec)):
            magic = argument(flag.name, **flag.keywords)(magic)
        return magic

    return decorate


def cluster_option(text: str | None, namespace: dict) -> object:
    """What ``--cluster`` names: a notebook variable (a ``distributed.Client`` or a Dask cluster object) if
    ``text`` is the name of one, else a scheduler address.

    Example:
        >>> cluster_option("client", {"client": "<the Client>"})
        '<the Client>'
        >>> cluster_option("tcp://10.0.0.7:8786", {})
        'tcp://10.0.0.7:8786'
        >>> cluster_option("clinet", {"client": 1})
        Traceback (most recent call last):
        ...
        IPython.core.error.UsageError: --cluster clinet: no notebook variable has that name and it is not a scheduler address: pass the name of a distributed.Client (or cluster) you made, or an address such as tcp://scheduler:8786
    """
    if text is None:
        return None
    if text.isidentifier():
        if text in namespace:
            return namespace[text]
        raise UsageError(
            f"--cluster {text}: no notebook variable has that name and it is not a scheduler address: pass the name "
            "of a distributed.Client (or cluster) you made, or an address such as tcp://scheduler:8786"
        )
    return text


def plain_python(cell: str, transform) -> str:
    """The cell as the workers run it: ``transform`` (IPython's ``shell.transform_cell``) applied, which strips
    prompts and common indentation; a magic or shell command (``%time``, ``!nvidia-smi``) is refused, naming
    its line, since the workers run plain Python.

    Example:
        >>> from IPython.core.inputtransformer2 import TransformerManager
        >>> plain_python(">>> x = 1", TransformerManager().transform_cell)
        'x = 1\\n'
        >>> plain_python("x = 1\\n!ls", TransformerManager().transform_cell)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        IPython.core.error.UsageError: line 2 of the cell, `!ls`, is IPython syntax (a magic or a shell ...
    """
    source = transform(cell)
    try:
        module = ast.parse(source)
    except SyntaxError:
        return source  # a plain mistake in the Python: the run reports it as the SyntaxError it is
    for node in ast.walk(module):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "get_ipython":
            lines = cell.splitlines() or [""]
            text = lines[min(node.lineno, len(lines)) - 1].strip()
            raise UsageError(
                f"line {node.lineno} of the cell, `{text}`, is IPython syntax (a magic or a shell command) that the "
                "workers cannot run: they run plain Python. Move it to a cell of its own, or write it in Python "
                "(e.g. subprocess.run([...]) for !cmd, time.perf_counter() for %time)."
            )
    return source


def _check_names(cell: str, namespace: dict, held: Collection[str] = ()) -> dict:
    shipped, missing = names_to_ship(cell, namespace, held)
    if missing:
        listed = ", ".join(f"{name!r}" for name in missing)
        raise UsageError(
            f"the cell uses {listed}, not defined in the notebook: run the cell that defines "
            f"{'it' if len(missing) == 1 else 'them'} first, or define {'it' if len(missing) == 1 else 'them'} "
            "in this cell."
        )
    return shipped


def _ship(cell: str, namespace: dict, pool: WorkerPool | None, held: Collection[str] = ()) -> dict:
    """The notebook variables a cell ships (:func:`_check_names`), the pool's copies in place of those put on it,
    saying which (:func:`use_pool_copies`)."""
    shipped = _check_names(cell, namespace, held)
    if pool is None:
        return shipped
    shipped, notes = use_pool_copies(shipped, pool)
    for note in notes:
        print(f"flair_nbddp: {note}", flush=True)
    return shipped


def use_pool_copies(shipped: dict, pool: WorkerPool) -> tuple[dict, list[str]]:
    """Replace each shipped variable put with ``%ddp_pool put`` by the pool's copy, where it is still the object
    put with the same splits; say what was used and what was packed again.

    Example:
        >>> from flair_nbddp.synthetic import sentiment_corpus
        >>> pool, corpus = WorkerPool(2, "cpu"), sentiment_corpus(n_train=10, n_dev=2, n_test=2)
        >>> pool.named["corpus"] = pool.put(corpus)
        >>> shipped, notes = use_pool_copies({"corpus": corpus, "lr": 0.1}, pool)
        >>> type(shipped["corpus"]).__name__, shipped["lr"], notes[0][:44]
        ('PoolRef', 0.1, "corpus: the pool's copy (PoolRef Corpus, 0.0")
        >>> _ = corpus.downsample(0.5)                       # new splits: the copy is out of date
        >>> use_pool_copies({"corpus": corpus}, pool)[1][0][:57]
        'corpus changed since it was put on the pool (another obje'
        >>> pool.close()
    """
    shipped, notes = dict(shipped), []
    for name, value in shipped.items():
        ref = pool.named.get(name)
        if ref is None:
            continue
        if ref.matches(value):
            shipped[name] = ref
            notes.append(
                f"{name}: the pool's copy ({ref.describe()}); changes made inside it since do not reach the "
                f"workers: '%ddp_pool put {name}' again after such changes"
            )
        else:
            notes.append(
                f"{name} changed since it was put on the pool (another object, or other splits): packing it for "
                f"this cell; '%ddp_pool put {name}' shares the new one"
            )
    return shipped, notes


def show_rank_results(results: list[RankResult]) -> None:
    """What a ``%%ddp_exec`` cell shows after its ranks' own output: each rank's value as ``[rank r] Out: ...``,
    each failed rank's traceback. Then the cell fails as its ranks did: ``KeyboardInterrupt`` after an interrupt,
    else the first failed rank's :class:`~flair_nbddp.WorkerError`.

    Example:
        >>> from flair_nbddp.worker.ddp_exec import RankResult
        >>> show_rank_results([RankResult(0, True, 42), RankResult(1, True, None), RankResult(2, False)])
        [rank 0] Out: 42
    """
    failed = [result for result in results if result.error is not None]
    interrupted = any(result.interrupted for result in results)
    for result in results:
        if result.ok and result.value is not None:
            first, *rest = repr(result.value).splitlines() or [""]
            print("\n".join([f"[rank {result.rank}] Out: {first}", *(f"[rank {result.rank}]      {line}" for line in rest)]))
        elif result.error is not None and (interrupted or result is not failed[0]):
            where = result.error.remote_traceback.rstrip().splitlines()
            if interrupted:  # where each rank was: its innermost frame and its line, then the exception
                last_frame = max((i for i, text in enumerate(where) if text.lstrip().startswith("File ")), default=0)
                where = [*where[last_frame : last_frame + 2], where[-1]]
            print("\n".join(f"[rank {result.rank}] {line}" for line in where), flush=True)
    if interrupted:
        raise KeyboardInterrupt("the cell was interrupted on every rank; the namespaces are kept")
    if failed:
        raise failed[0].error


def _check_out(name: str | None) -> None:
    """A magic's ``--out NAME``: a variable name, or absent."""
    if name is not None and not name.isidentifier():
        raise UsageError(f"--out {name!r} is not a valid variable name")


@contextlib.contextmanager
def _usage_errors(shipped: dict, *mistakes: type[Exception]) -> Iterator[None]:
    """A magic's mistakes as IPython's one-line ``UsageError``: a variable of ``shipped`` that cannot be sent
    (named with its path), and any of ``mistakes`` (impossible devices, options...)."""
    try:
        yield
    except ShippingError as error:
        raise UsageError(_unshippable(shipped) or str(error)) from None
    except mistakes as error:
        raise UsageError(str(error)) from None


def _unshippable(shipped: dict) -> str | None:
    for name, value in shipped.items():
        message = describe_unpicklable(f"variable {name!r} ({type(value).__name__})", name, value, where="this cell")
        if message:
            return message
    return None


@magics_class
class DdpMagics(Magics):
    """``%%ddp_train``, ``%%ddp_sweep``, ``%%ddp_exec``, ``%ddp_pool``, ``%ddp_info`` and ``%ddp_runs``."""

    @no_var_expand
    @magic_arguments()
    @argument("--out", default=None, metavar="NAME", help="also store rank 0's value in this notebook variable")
    @run_option_flags()
    @cell_magic
    def ddp_train(self, line: str, cell: str):
        """Run the cell on every rank (flair's ``multi_gpu=True`` works in it); rank 0's last value is the output.

        Names the cell reads from the notebook (a corpus, a label type, helpers from earlier cells) are
        shipped to the workers; nothing else is. While ``%ddp_pool start`` holds warm workers, the cell
        runs on them (``--processes``/``--device`` must then match the pool or be left out), and a variable
        put on the pool (``%ddp_pool put corpus``) goes as the workers' copy while it is the object put.
        ``--cluster tcp://scheduler:8786`` (or ``--cluster client``, a Client in the notebook) runs it on a
        Dask cluster, one rank per Dask worker.
        """
        options = parse_argstring(self.ddp_train, line)
        _check_out(options.out)
        source = plain_python(cell, self.shell.transform_cell)
        pool = current_pool()
        shipped = _ship(source, self.shell.user_ns, pool)
        with _usage_errors(shipped, ConfigurationError, ClusterError, UnsupportedPlatformError):  # impossible devices...
            run_options = from_flags(options)
            run_options["cluster"] = cluster_option(options.cluster, self.shell.user_ns)
            result = launch(
                run_ddp_train_cell, args=(source, shipped), pool=pool, **run_options,
                provenance=Provenance(
                    "%%ddp_train", name="%%ddp_train", source=cell, params={"variables": shipped},
                    options={"line": line.strip()},
                ),
            )  # fmt: skip
        if options.out:
            self.shell.user_ns[options.out] = result.value
        return result.value

    @no_var_expand
    @magic_arguments()
    @argument("--space", required=True, metavar="NAME",
              help="the notebook variable holding the search space: a function of an Optuna trial, or a dict of Optuna "
                   "distributions; its parameters become the cell's variables")  # fmt: skip
    @argument("--trials", type=int, required=True, metavar="N", help="how many trials to run")
    @argument("--trial-processes", type=int, default=1, metavar="K", help="processes (GPUs) per trial (default 1)")
    @argument("--metric", default="dev/score", help="what Optuna optimises (default dev/score)")
    @argument("--direction", choices=["maximize", "minimize"], default="maximize")
    @argument("--study", default=None, metavar="NAME", help="the study's name: an existing one is continued")
    @argument("--out", default=None, metavar="NAME", help="store the Sweep in this notebook variable")
    @run_option_flags()
    @cell_magic
    def ddp_sweep(self, line: str, cell: str):
        """Sweep the cell: each trial runs it on its own devices (as ``%%ddp_train`` does), the parameters Optuna
        suggests from ``--space`` as variables; several trials at once, pruned by epoch (:func:`flair_nbddp.sweep`).
        The cell's last value is each trial's result; the cell's output is the :class:`~flair_nbddp.Sweep`.

        Example::

            space = lambda trial: {"lr": trial.suggest_float("lr", 1e-4, 1e-1, log=True)}

            %%ddp_sweep --space space --trials 8 --study lr-search
            trainer = ModelTrainer(make_classifier(corpus), corpus)
            trainer.train("out", learning_rate=lr, max_epochs=4, multi_gpu=True)
        """
        from ..sweeps.runner import SWEEP_DECIDES, sweep
        from ..sweeps.study import space_names

        options = parse_argstring(self.ddp_sweep, line)
        _check_out(options.out)
        if options.space not in self.shell.user_ns:
            raise UsageError(f"--space {options.space}: no such notebook variable; define the search space first")
        space = self.shell.user_ns[options.space]
        source = plain_python(cell, self.shell.transform_cell)
        pool = current_pool()
        with _usage_errors({}, ConfigurationError):  # a space that is none
            shipped = _ship(source, self.shell.user_ns, pool, held=space_names(space))
        with _usage_errors(shipped, ConfigurationError, ClusterError, UnsupportedPlatformError, UnknownOptionError):
            run_options = {name: value for name, value in from_flags(options).items()  # a sweep decides these
                           if not (name in SWEEP_DECIDES and value in (None, False))}  # fmt: skip
            run_options["cluster"] = cluster_option(options.cluster, self.shell.user_ns)
            result = sweep(
                run_ddp_sweep_cell, (source, shipped), space=space, n_trials=options.trials,
                trial_processes=options.trial_processes, metric=options.metric, direction=options.direction,
                study=options.study, pool=pool, **run_options,
                provenance=Provenance("sweep", name="%%ddp_sweep", source=cell, params={"variables": shipped},
                                      options={"line": line.strip()}),
            )  # fmt: skip
        if options.out:
            self.shell.user_ns[options.out] = result
        return result

    @no_var_expand
    @magic_arguments()
    @argument("--rank", type=int, default=None, metavar="R", help="run the cell on rank R only")
    @argument(
        "--ranks", type=numbers("--ranks", "rank"), default=None, metavar="0,2", help="run the cell on these ranks only"
    )
    @argument("--out", default=None, metavar="NAME", help="store every rank's value in this variable, as a list")
    @argument("--reset", action="store_true", help="empty every rank's namespace first (%%ddp_exec --reset: only that)")
    @run_option_flags(ddp_exec=True)
    @line_cell_magic
    def ddp_exec(self, line: str, cell: str | None = None):
        """Run the cell on every rank of the warm pool (started on first use), in a namespace each rank keeps.

        ``rank``, ``world_size`` and ``device`` are defined and the process group is up; names the cell reads
        from the notebook are shipped as ``%%ddp_train`` ships them, except those every rank's namespace already
        holds (bound by earlier ``%%ddp_exec`` cells: the ranks' own are used). Each rank's output shows as it comes, prefixed ``[rank r]``, and each
        rank's last value as ``[rank r] Out: ...``. An exception on a rank shows its traceback and leaves the
        namespaces as they are; an interrupt raises ``KeyboardInterrupt`` in every rank's cell.
        ``%ddp_exec --reset`` empties the namespaces; so does ``%ddp_pool restart``.
        """
        options = parse_argstring(self.ddp_exec, line)
        if cell is None and not options.reset:
            raise UsageError("%ddp_exec on a line takes --reset (empty every rank's namespace); %%ddp_exec runs a cell")
        _check_out(options.out)
        if options.rank is not None and options.ranks is not None:
            raise UsageError("give --rank R or --ranks 0,2, not both")
        if cell is None and current_pool() is None:
            print("no pool is started: there is no namespace to empty")
            return
        pool = current_pool() or self._new_pool(for_exec=True)
        chosen = [options.rank] if options.rank is not None else options.ranks
        try:
            ranks = check_ranks(chosen, pool.plan.world_size)
        except ConfigurationError as error:
            raise UsageError(str(error)) from None
        source = plain_python(cell or "", self.shell.transform_cell)
        held = {*PREDEFINED, *(() if options.reset else pool.exec_names)}
        shipped = _ship(source, self.shell.user_ns, pool, held)
        if ranks is not None and len(ranks) < pool.plan.world_size:
            print(f"flair_nbddp: the cell runs on rank(s) {', '.join(map(str, ranks))} only: a collective in it "
                  "would wait forever for the other ranks (interrupt to end it)", flush=True)  # fmt: skip
        with _usage_errors(shipped):
            results = pool.exec(
                source, ranks, variables=shipped, reset=options.reset, **from_flags(options, ddp_exec=True),
                provenance=Provenance("%%ddp_exec", name="%%ddp_exec", source=cell or "", params={"variables": shipped},
                                      options={"line": line.strip()}),
            )  # fmt: skip
        if options.out:
            self.shell.user_ns[options.out] = [result.value for result in results]
        show_rank_results(results)

    def _new_pool(
        self, processes: int | None = None, device: str | None = None, gpus: tuple[int, ...] | None = None,
        for_exec: bool = False, cluster: str | None = None, share_gpus: bool = False, job_processes: int | None = None,
    ) -> WorkerPool:  # fmt: skip
        """A new current pool (its workers start with its first job, or at ``warm_up``)."""
        try:
            pool = WorkerPool(processes, device, gpus=gpus, cluster=cluster_option(cluster, self.shell.user_ns),
                              share_gpus=share_gpus, job_processes=job_processes)  # fmt: skip
        except (ConfigurationError, ClusterError, UnsupportedPlatformError, RunActiveError) as error:
            raise UsageError(str(error)) from None
        set_current_pool(pool)
        if for_exec:
            print(f"flair_nbddp: started a warm pool for %%ddp_exec: {pool.status()}; '%ddp_pool stop' ends it, and "
                  "%%ddp_train cells run on it too (their --processes/--device must match it)")  # fmt: skip
        return pool

    @magic_arguments()
    @argument(
        "action", choices=["start", "stop", "restart", "status", "put", "release"],
        help="start warm workers, end them, replace them (emptying %%ddp_exec namespaces), describe them, put "
        "notebook variables in them, or release those",
    )  # fmt: skip
    @argument("targets", nargs="*", help="with start: number of workers; with put/release: variable names")
    @argument("--device", choices=DEVICES, default=None, help="with start: default cuda when available")
    @argument(
        "--gpus", type=numbers("--gpus", "GPU"), default=None, metavar="0,2",
        help="with start: these GPUs only, one worker each",
    )  # fmt: skip
    @argument(
        "--share-gpus", action="store_true",
        help="with start: more workers than GPUs share them, over gloo (a rehearsal of a multi-GPU run)",
    )  # fmt: skip
    @argument(
        "--cluster", default=None, metavar="ADDRESS_OR_NAME",
        help="with start: keep the workers on a Dask cluster (its scheduler's address, or a Client's name)",
    )  # fmt: skip
    @argument(
        "--job-processes", type=int, default=None, metavar="K",
        help="with start: lend the workers in slices of K to jobs side by side (%%%%ddp_sweep --trial-processes K)",
    )  # fmt: skip
    @line_magic
    def ddp_pool(self, line: str) -> WorkerPool | None:
        """``%ddp_pool start [N]`` keeps N warm workers for ``%%ddp_train`` and the panel; ``stop`` ends them.

        ``%ddp_pool put corpus`` packs the notebook variable ``corpus`` once into the workers: ``%%ddp_train``
        cells that use it get the workers' copy while ``corpus`` is that object with the same splits (changes
        inside it need another put); ``%ddp_pool release corpus`` drops it.
        """
        options = parse_argstring(self.ddp_pool, line)
        pool = current_pool()
        if options.action in ("put", "release"):
            self._put_or_release(pool, options.action, options.targets)
        elif options.action == "start":
            if pool is not None:
                raise UsageError(f"a pool is already started ({pool.status()}); '%ddp_pool stop' ends it")
            if len(options.targets) > 1 or not all(target.isdigit() for target in options.targets):
                raise UsageError(f"'%ddp_pool start' takes a number of workers, not {' '.join(options.targets)!r}")
            processes = int(options.targets[0]) if options.targets else None
            pool = self._new_pool(processes, options.device, options.gpus, cluster=options.cluster,
                                  share_gpus=options.share_gpus, job_processes=options.job_processes)  # fmt: skip
            pool.warm_up()
            print(pool.status())
        elif options.action == "restart":
            if pool is None:
                raise UsageError("no pool is started: '%ddp_pool start [N]' starts one")
            pool.restart()
            print("the pool's next job starts on fresh workers: every %%ddp_exec namespace is empty")
        elif options.action == "stop":
            if pool is None:
                print("no pool is started")
                return None
            pool.close()
            set_current_pool(None)
            print("pool stopped: its workers have exited")
        else:
            print(pool.status() if pool else "no pool is started: '%ddp_pool start [N]' starts one")
        return None

    def _put_or_release(self, pool: WorkerPool | None, action: str, names: list[str]) -> None:
        if pool is None:
            raise UsageError(f"no pool is started: '%ddp_pool start [N]' first ({action} keeps objects in its workers)")
        if not names:
            held = [f"  {name}: {ref.describe()}" for name, ref in pool.named.items()]
            print("\n".join(["put on the pool:", *held]) if held else "nothing is put on the pool")
            return
        for name in names:
            if action == "release":
                if name not in pool.named:
                    raise UsageError(f"{name!r} is not put on the pool (put: {', '.join(pool.named) or 'nothing'})")
                pool.drop(pool.named[name])
                print(f"released {name}: the workers drop their copy before their next job")
                continue
            if name not in self.shell.user_ns:
                raise UsageError(f"{name!r} is not defined in the notebook: run the cell that defines it first")
            try:
                ref = pool.put(self.shell.user_ns[name])
            except ShippingError as error:
                raise UsageError(str(error)) from None
            if not ref.trackable:
                ref.release()
                raise UsageError(
                    f"{name} ({ref.type_name}) cannot be put by name: the magic could not tell whether it changed (it "
                    f"cannot be referenced weakly). Wrap it in a flair dataset or Corpus, or use ref = pool.put({name}) "
                    "with launch(..., pool=pool) and pass the ref"
                )
            if name in pool.named:
                pool.drop(pool.named[name])
            pool.named[name] = ref
            print(
                f"put {name} on the pool ({ref.describe()}): cells that use {name} get the workers' copy while it "
                f"is this object with the same splits; after changing it in place, '%ddp_pool put {name}' again"
            )

    @magic_arguments()
    @argument("--limit", type=int, default=20, metavar="N", help="the N newest runs (default 20; 0: all)")
    @argument("--status", choices=["running", *ENDED], default=None, help="only runs with this status")
    @argument("--name", default=None, help="only runs of the function of this name ('%%%%ddp_train': the cells)")
    @line_magic
    def ddp_runs(self, line: str = "") -> None:
        """The runs in the run ledger, newest first, from this kernel and earlier ones: a table of their status,
        devices, time, parameters and scores. ``flair_nbddp.history()`` gives the same runs to code."""
        from IPython.display import HTML, display

        options = parse_argstring(self.ddp_runs, line)
        if options.limit < 0:
            raise UsageError(f"--limit {options.limit}: give a number of runs, or 0 for all of them")
        try:
            records = history(options.limit or None, options.status, options.name)
        except LedgerError as error:
            raise UsageError(str(error)) from None
        which = "that match " if options.status or options.name else ""
        display(HTML(runs_html(records, empty=f"no runs {which}recorded in {ledger_path()} yet")))

    @line_magic
    def ddp_devices(self, line: str = "") -> None:
        """Every claim on this machine, from every kernel and user of the kit: runs, warm pools and runs waiting
        for devices, with their holder (user, process, notebook), age and, for GPUs, memory and utilisation; and the
        GPUs other programs use. ``flair_nbddp.devices_in_use()`` gives the same list to code."""
        from IPython.display import display

        if line.strip():
            raise UsageError(f"%ddp_devices takes no arguments, not {line.strip()!r}")
        display(devices_in_use())

    @line_magic
    def ddp_info(self, line: str = "") -> None:
        """Devices, the backend and processes a run would use, versions, how many hold devices on the machine, and
        this kernel's runs."""
        names = gpu_names()
        lines = [f"GPUs visible: {len(names)}"] + [f"  {name}" for name in names]
        try:
            lines.append(f"a run would use: {resolve_devices()}")
        except (DeviceError, UnsupportedPlatformError) as error:
            lines.append(f"a run would fail: {error}")
        lines.append("versions: " + ", ".join(f"{name} {version}" for name, version in versions().items()))
        in_use = devices_in_use()
        lines.append(f"devices in use on this machine: {len(in_use)} holder{'s' * (len(in_use) != 1)} "
                     "(%ddp_devices lists them)")  # fmt: skip
        pool = current_pool()
        lines.append(pool.status() if pool else "no warm pool (%ddp_pool start [N] starts one)")
        ledger = ledger_path()
        lines.append(f"run ledger: {ledger} (%ddp_runs lists it)" if ledger else "run ledger: off (FLAIR_NBDDP_LEDGER=0)")
        kernel_runs = runs()
        lines.append(f"runs in this kernel: {len(kernel_runs)}")
        for number, run in enumerate(kernel_runs, 1):
            snapshot = run.state.snapshot()
            recorded = "" if run.record_id is None else f" (ledger #{run.record_id})"
            lines.append(
                f"  {number}. {run.name}{recorded}: {snapshot.status}, {run.plan}, "
                f"{snapshot.elapsed:.1f} s, logs {run.run_dir}"
            )
        print("\n".join(lines))

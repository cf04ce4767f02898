"""Training throughput and launch latency: flair_nbddp's launcher vs flair's own vs accelerate's, same job.

    python benchmarks/throughput.py --launcher kit        --device cuda --size distilbert --docs 4000
    python benchmarks/throughput.py --launcher flair      --device cuda --size distilbert --docs 4000
    python benchmarks/throughput.py --launcher accelerate --device cuda --size distilbert --docs 4000

On CPU (``--device cpu``) flair's and accelerate's launchers get the same CPU bend as the kit's workers
(gloo, CPU DDP); everything else is identical. The kit's launchers run with every default (inputs built once
included); ``--no-fast-inputs`` gives them flair's own input building, ``--precision bf16`` bfloat16 autocast,
``--compile-model reduce-overhead`` the transformer compiled (``compile_model``),
``--lazy-corpus yes|no`` forces a lazy corpus or one built in the workers up front (as flair's script has them);
by default the kit decides (``lazy_corpus=None``: built, for corpora of this size). ``--no-ddp`` (a kit launcher,
one process) trains with ``multi_gpu=False``, flair's trainer without its DDP wrapper: DDP's share of a step.
``--epochs 3`` shows what building the inputs once saves after the first epoch.

* ``kit`` runs the job the notebook way: a training function defined in a file-less ``__main__``
  (``python -c``), the corpus built once in the parent and shipped by flair_nbddp.
* ``kit-pool`` does the same on a :class:`~flair_nbddp.WorkerPool` started and warmed up before the launch
  (what a second run in a notebook gets after ``%ddp_pool start``).
* ``flair`` runs it the script way: ``flair.distributed_utils.launch_distributed(main)`` from this file,
  every rank building the corpus itself.
* ``accelerate`` runs it the way Hugging Face's notebook peer does: ``accelerate.notebook_launcher`` from a
  file-less ``__main__`` with the corpus built once in the parent; it forks its ranks (so the corpus is
  inherited, not shipped), the function sets up the process group with ``PartialState`` and writes rank 0's
  figures to a file, since ``notebook_launcher`` returns nothing. With one device, ``notebook_launcher`` runs
  the function in the calling process without a process group, so the job trains with ``multi_gpu=False``.

All time the end of the first training batch from the start of the program (``T0``) and from the launch
call, and count samples/s after the first batch (overall and per epoch), summed over ranks, and each rank's CPU
milliseconds per sample. On CUDA the GPU's busy share while it trains is sampled from ``nvidia-smi`` every
0.2 s. ``BENCH_PROFILE=FILE`` profiles rank 0's training (cProfile) and writes its costliest functions there;
``BENCH_TRACE=DIR`` records batches 10-19 of rank 0's last epoch with ``torch.profiler`` and a sampler of every
thread's Python stack, and writes them there for ``trace_gaps.py``; ``BENCH_SYNCS=FILE`` (CUDA) writes every call of
rank 0's training that made the CPU wait for the GPU (``torch.cuda.set_sync_debug_mode``), by the code that made
it, with how many times a batch. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

LAUNCHERS = ("flair", "kit", "kit-pool", "accelerate")
T0_ENV = "FLAIR_NBDDP_BENCH_T0"
PROFILE_ENV = "BENCH_PROFILE"  # a file: rank 0's training is profiled (cProfile) and its top functions written there
TRACE_ENV = "BENCH_TRACE"  # a folder: batches of rank 0's last epoch are traced (torch.profiler) and written there
TRACED_BATCHES = range(10, 20)
SYNCS_ENV = "BENCH_SYNCS"  # a file: rank 0's synchronizing CUDA calls, by call site, written there
IMDB_WORDS = (200, 260)  # words a generated review has by default: IMDB's length
T0 = float(os.environ.get(T0_ENV) or time.time())
HERE = Path(__file__).resolve().parent


def make_corpus(docs: int, words: tuple[int, int] = IMDB_WORDS, task: str = "classify"):
    """Generated reviews of ``words`` words (by default IMDB-length, 200-260), small dev/test splits; for
    ``task="tag"``, generated sentences with names of people and places, of at least ``words[0]`` words each."""
    from flair_nbddp.synthetic import ner_corpus, sentiment_corpus

    splits = dict(n_train=docs, n_dev=max(32, docs // 20), n_test=max(32, docs // 20))
    if task == "tag":
        return ner_corpus(**splits, words=words[0])
    return sentiment_corpus(**splits, words=words)


def make_model(task: str, model_path: str, corpus):
    """What the job fine-tunes: a TextClassifier on the transformer's first sub-token, or (``task="tag"``) a
    SequenceTagger on each word's first sub-token, without CRF or RNN, as flair fine-tunes taggers."""
    from flair.embeddings import TransformerDocumentEmbeddings, TransformerWordEmbeddings
    from flair.models import SequenceTagger, TextClassifier

    if task == "tag":
        return SequenceTagger(
            TransformerWordEmbeddings(model_path, fine_tune=True, layers="-1", subtoken_pooling="first"),
            tag_dictionary=corpus.make_label_dictionary("ner", add_unk=False), tag_type="ner", use_crf=False,
            use_rnn=False, reproject_embeddings=False,
        )  # fmt: skip
    return TextClassifier(
        TransformerDocumentEmbeddings(model_path, fine_tune=True),
        label_type="sentiment",
        label_dictionary=corpus.make_label_dictionary("sentiment", add_unk=False),
    )


def timed_fine_tune(
    corpus, docs: int, model_path: str, base_path: str, batch: int, chunk: int | None, epochs: int,
    launched_at: float, multi_gpu: bool = True, words: tuple[int, int] = IMDB_WORDS, task: str = "classify",
):
    """Fine-tune ``task``'s model (:func:`make_model`), timing the first batch (since ``T0`` and ``launched_at``), the
    throughput after it, and each epoch's batches and the pauses between epochs."""
    import flair.distributed_utils
    import numpy as np
    from flair.distributed_utils import aggregate
    from flair.trainers import ModelTrainer
    from flair.trainers.plugins import TrainerPlugin

    class Timer(TrainerPlugin):
        """First batch's end (since T0); samples, seconds and this process's CPU seconds of the batches after it."""

        first_batch_at: float | None = None
        last_batch_at: float | None = None
        cpu_at_first = cpu_at_last = 0.0
        samples = 0
        epochs: list[list[float]] = []  # per epoch: samples after the first batch, their first and last batch's end
        batch_ends: list[list[float]] = []  # per epoch: each batch's end

        @TrainerPlugin.hook
        def after_training_batch(self, batch, **_):
            self.last_batch_at, self.cpu_at_last = time.time(), time.process_time()
            self.batch_ends[-1].append(self.last_batch_at)
            if self.first_batch_at is None:
                self.first_batch_at, self.cpu_at_first = self.last_batch_at, self.cpu_at_last
                self.epochs.append([0, self.last_batch_at, self.last_batch_at])
            else:
                self.samples += len(batch)
                epoch = self.epochs[-1]
                epoch[0], epoch[2] = epoch[0] + len(batch), self.last_batch_at

        @TrainerPlugin.hook
        def before_training_epoch(self, **_):
            self.batch_ends.append([])
            if self.first_batch_at is not None:  # a later epoch counts from its start (the first, from its first batch)
                self.epochs.append([0, time.time(), time.time()])

    if corpus is None:  # the script way: every rank builds it, and must seed alike for flair's corpus check
        import flair

        flair.set_seed(42)
        corpus = make_corpus(docs, words, task)
    timer = Timer()
    plugins = [timer]
    if os.environ.get(TRACE_ENV) and flair.distributed_utils.is_main_process():
        plugins.append(traced_batches(TrainerPlugin, epochs, Path(os.environ[TRACE_ENV])))
    model = make_model(task, model_path, corpus)

    def train():
        return ModelTrainer(model, corpus).fine_tune(
            base_path, max_epochs=epochs, mini_batch_size=batch, mini_batch_chunk_size=chunk, learning_rate=5e-5,
            multi_gpu=multi_gpu, plugins=plugins, save_final_model=False,
        )

    main = flair.distributed_utils.is_main_process()
    if os.environ.get(PROFILE_ENV) and main:
        scores = profiled(train)
    elif os.environ.get(SYNCS_ENV) and main:
        scores = synchronizing_calls(train, lambda: timer.samples // batch + 1, Path(os.environ[SYNCS_ENV]))
    else:
        scores = train()
    rate = timer.samples / max(1e-9, timer.last_batch_at - timer.first_batch_at)
    epoch_rates = [samples / max(1e-9, last - first) for samples, first, last in timer.epochs if samples]
    cpu_ms = 1000 * (timer.cpu_at_last - timer.cpu_at_first) / max(1, timer.samples)
    steps = [np.diff(ends) * 1000 for ends in timer.batch_ends]
    return {
        "first_batch_s": timer.first_batch_at - T0,
        "launch_to_first_batch_s": timer.first_batch_at - launched_at,
        "samples_per_s": float(aggregate(rate, np.sum)),
        "epoch_samples_per_s": [float(aggregate(r, np.sum)) for r in epoch_rates],
        "first_batch_at": timer.first_batch_at,
        "last_batch_at": timer.last_batch_at,
        # CPU time a rank spends per sample, every thread of it included: what the kit's own threads and
        # per-batch agreement add, without the wall-clock noise of a shared machine
        "cpu_ms_per_sample": float(aggregate(cpu_ms, np.mean)),
        "test_score": scores["test_score"],
        # rank 0's pace within each epoch (the median batch, end to end) and between epochs (from an epoch's last
        # batch to the next epoch's first, less a median batch: evaluation, checkpoint, the kit's epoch's end)
        "epoch_batch_ms_median": [float(np.median(ms)) for ms in steps if len(ms)],
        "between_epochs_s": [
            float(after[0] - before[-1] - np.median(ms) / 1000)
            for before, after, ms in zip(timer.batch_ends, timer.batch_ends[1:], steps[1:]) if before and after
        ],
    }


def profiled(train):
    """Run ``train`` under cProfile and write its 30 costliest functions (own time) to ``$BENCH_PROFILE``, and the
    whole profile beside it (``$BENCH_PROFILE.pstats``, for ``pstats``: callers, cumulative times)."""
    import cProfile
    import io
    import pstats

    profile = cProfile.Profile()
    value = profile.runcall(train)
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(30)
    Path(os.environ[PROFILE_ENV]).write_text(text.getvalue())
    profile.dump_stats(f"{os.environ[PROFILE_ENV]}.pstats")
    return value


def synchronizing_calls(train, batches, path: Path):
    """Run ``train`` with torch's sync debug mode on, and write each call site (the innermost frames outside torch)
    that made the CPU wait for the GPU to ``path``: the times it did so per training batch (``batches()`` after
    training), the costliest first."""
    import traceback
    import warnings
    from collections import Counter

    import torch

    sites: Counter = Counter()

    def note(message, category, filename, lineno, file=None, line=None):
        frames = [frame for frame in traceback.extract_stack()[:-2] if "/torch/" not in frame.filename]
        sites[" <- ".join(f"{Path(frame.filename).name}:{frame.lineno} {frame.name}" for frame in frames[:-5:-1])] += 1

    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():  # restores the filters and showwarning on the way out
            warnings.simplefilter("always")
            warnings.showwarning = note
            value = train()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    path.write_text("".join(f"{count / batches():8.2f}  {site}\n" for site, count in sites.most_common()))
    return value


def traced_batches(plugin_type: type, last_epoch: int, folder: Path):
    """A trainer plugin recording ``TRACED_BATCHES`` of ``last_epoch`` with a :class:`BatchTracer`."""

    class Traced(plugin_type):
        epoch = 0
        tracer = BatchTracer(folder)

        @plugin_type.hook
        def before_training_epoch(self, epoch, **_):
            self.epoch = epoch

        @plugin_type.hook
        def before_training_batch(self, batch_no, **_):
            if self.epoch == last_epoch:
                self.tracer.before(batch_no)

        @plugin_type.hook
        def after_training_batch(self, batch_no, **_):
            if self.epoch == last_epoch:
                self.tracer.after(batch_no)

    return Traced()


class BatchTracer:
    """Records batches ``TRACED_BATCHES`` with ``torch.profiler`` (CPU and CUDA operators, each batch a
    ``batch#N`` range) while a :class:`StackSampler` samples every thread's Python stack each millisecond. Writes
    ``trace.json.gz``, ``stacks.txt`` (collapsed stacks with their sample counts, per thread) and ``operators.txt``
    (the operators' costliest, by own CPU and own device time) to ``folder`` for ``trace_gaps.py``. Call
    ``before(n)`` and ``after(n)`` around every batch ``n`` of the epoch to trace."""

    def __init__(self, folder: Path) -> None:
        import torch
        from torch import profiler

        self.folder, self._torch_profiler, self._cuda = folder, profiler, torch.cuda.is_available()
        self.profiler = self.batch = self.sampler = None

    def before(self, batch_no: int) -> None:
        if batch_no == TRACED_BATCHES.start:
            activity = self._torch_profiler.ProfilerActivity
            activities = [activity.CPU, *([activity.CUDA] if self._cuda else [])]
            self.profiler = self._torch_profiler.profile(activities=activities)
            self.profiler.__enter__()
            self.sampler = StackSampler()
        if self.profiler is not None:
            self.batch = self._torch_profiler.record_function(f"batch#{batch_no}")
            self.batch.__enter__()

    def after(self, batch_no: int) -> None:
        if self.profiler is None:
            return
        self.batch.__exit__(None, None, None)
        if batch_no + 1 == TRACED_BATCHES.stop:
            profiler, self.profiler = self.profiler, None
            profiler.__exit__(None, None, None)
            self.folder.mkdir(parents=True, exist_ok=True)
            (self.folder / "stacks.txt").write_text(self.sampler.collapsed())
            profiler.export_chrome_trace(str(self.folder / "trace.json.gz"))
            averages = profiler.key_averages()
            device_key = "self_cuda_time_total" if self._cuda else "self_cpu_time_total"
            (self.folder / "operators.txt").write_text(
                averages.table(sort_by="self_cpu_time_total", row_limit=40) + "\n"
                + averages.table(sort_by=device_key, row_limit=40)
            )


class StackSampler:
    """Samples every other thread's Python stack each millisecond, in a thread, until ``collapsed()``."""

    def __init__(self) -> None:
        import collections
        import threading

        self.counts: collections.Counter = collections.Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        import threading

        me = threading.get_ident()
        while not self._stop.wait(0.001):
            names = {thread.ident: thread.name for thread in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                stack = []
                while frame is not None:
                    code = frame.f_code
                    stack.append(f"{code.co_filename.rsplit('site-packages/', 1)[-1]}:{code.co_name}")
                    frame = frame.f_back
                self.counts[(names.get(ident, str(ident)), ";".join(reversed(stack)))] += 1

    def collapsed(self) -> str:
        """``thread<TAB>frame;frame;...<TAB>samples`` lines, outermost frame first."""
        self._stop.set()
        self._thread.join()
        return "".join(f"{thread}\t{stack}\t{count}\n" for (thread, stack), count in self.counts.most_common())


class GpuBusy:
    """Samples ``nvidia-smi``'s GPU utilisation every 0.2 s in a thread; ``between(a, b)`` averages a window."""

    def __init__(self) -> None:
        import threading

        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        query = ["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits"]
        while not self._stop.wait(0.2):
            out = subprocess.run(query, capture_output=True, text=True).stdout.split()
            if out:
                self.samples.append((time.time(), sum(map(float, out)) / len(out)))

    def between(self, start: float, end: float) -> float | None:
        self._stop.set()
        self._thread.join()
        window = [busy for at, busy in self.samples if start <= at <= end]
        return sum(window) / len(window) if window else None


KIT_PROGRAM = """
import json, sys, time
sys.path.insert(0, {here!r})
import flair_nbddp
from first_batch import BETWEEN_CELLS_S
from throughput import make_corpus, timed_fine_tune
corpus = make_corpus({docs}, {words}, {task!r})     # built once, here, like in a notebook cell

def main(corpus, launched_at):                     # a notebook-style function in a file-less __main__
    return timed_fine_tune(corpus, {docs}, {model!r}, {base!r}, {batch}, {chunk}, {epochs}, launched_at, {multi_gpu},
                           task={task!r})

# kit-pool: workers started and warmed up before, as by `%ddp_pool start` in an earlier cell
pool = flair_nbddp.WorkerPool({processes}, {device!r}).warm_up() if {warm} else None
time.sleep(BETWEEN_CELLS_S if {warm} else 0.0)    # ...and this cell run a moment later
result = flair_nbddp.launch(
    main, args=(corpus, time.time()), device={device!r}, processes={processes}, dashboard=False, pool=pool,
    fast_inputs={fast_inputs}, precision={precision!r}, lazy_corpus={lazy_corpus}, compile_model={compile_model!r},
    direct_embeddings={direct_embeddings}, skip_clean_tokens={skip_clean_tokens},
)
if pool is not None:
    pool.close()
print("RESULT " + json.dumps(result.value))
"""


FLAIR_PROGRAM = """
import json, sys, time
sys.path.insert(0, {here!r})
from flair.distributed_utils import launch_distributed
from flair_nbddp.worker.flair_compat import bend_flair_launcher_for_cpu
from throughput import processes_for, timed_fine_tune

if {device!r} == "cpu":
    bend_flair_launcher_for_cpu(processes_for("cpu", {processes}))  # at import: spawned ranks re-import this script

if __name__ == "__main__":                         # the script way: every rank builds its own corpus
    value = launch_distributed(
        timed_fine_tune, None, {docs}, {model!r}, {base!r}, {batch}, {chunk}, {epochs}, time.time(), words={words},
        task={task!r},
    )
    print("RESULT " + json.dumps(value))
"""


ACCELERATE_PROGRAM = """
import json, sys, time
from pathlib import Path
sys.path.insert(0, {here!r})
from accelerate import notebook_launcher
from throughput import make_corpus, processes_for, timed_fine_tune
corpus = make_corpus({docs}, {words}, {task!r})     # built once, here, like in a notebook cell
processes = processes_for({device!r}, {processes})

def main(corpus, launched_at):                     # a notebook-style function in a file-less __main__
    import flair, torch
    from accelerate import PartialState
    state = PartialState(cpu={device!r} == "cpu")  # joins the process group notebook_launcher set up
    flair.device = state.device
    flair.set_seed(42)                             # ranks must sample flair's corpus check alike
    if {device!r} == "cpu":                        # the CPU bend the other launchers get
        from flair_nbddp.worker.flair_compat import allow_cpu_ddp
        allow_cpu_ddp()
        flair.device = torch.device("cpu")         # PartialState says cpu:0, which DDP takes for a device id
    figures = timed_fine_tune(corpus, {docs}, {model!r}, {base!r}, {batch}, {chunk}, {epochs}, launched_at,
                              multi_gpu=state.num_processes > 1, words={words}, task={task!r})
    if state.is_main_process:                      # notebook_launcher returns nothing: leave rank 0's figures
        Path({base!r}, "figures.json").write_text(json.dumps(figures))

Path({base!r}, "figures.json").unlink(missing_ok=True)
notebook_launcher(main, args=(corpus, time.time()), num_processes=processes)
print("RESULT " + Path({base!r}, "figures.json").read_text())
"""


def processes_for(device: str, processes: int | None) -> int:
    """The number of ranks each launcher starts when none is given: every GPU, or 2 CPU processes."""
    if processes:
        return processes
    import torch

    return torch.cuda.device_count() if device == "cuda" else 2


def run_job(args) -> dict:
    """Start the job in a fresh interpreter, with T0 set just before, and read its figures."""
    fields = dict(
        here=str(HERE), task=args.task, docs=args.docs, words=args.words, model=args.model, base=args.base,
        batch=args.batch,
        chunk=args.chunk, epochs=args.epochs, device=args.device, processes=args.processes, warm=args.launcher == "kit-pool",
        fast_inputs=not args.no_fast_inputs, precision=args.precision, direct_embeddings=not args.no_direct_embeddings,
        skip_clean_tokens=not args.no_skip_clean_tokens, compile_model=args.compile_model,
        lazy_corpus={"auto": None, "yes": True, "no": False}[args.lazy_corpus], multi_gpu=not args.no_ddp,
    )
    if args.launcher in ("kit", "kit-pool"):
        command = [sys.executable, "-c", KIT_PROGRAM.format(**fields)]
    elif args.launcher == "accelerate":
        command = [sys.executable, "-c", ACCELERATE_PROGRAM.format(**fields)]
    else:
        script = Path(args.workdir) / "flair_script.py"
        script.write_text(FLAIR_PROGRAM.format(**fields))
        command = [sys.executable, str(script)]
    env = {**os.environ, T0_ENV: repr(time.time())}
    if args.device == "cpu":  # the kit gives each CPU rank its share of the cores: so must the script
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // processes_for("cpu", args.processes))))
    busy = GpuBusy() if args.device == "cuda" else None
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not lines:
        sys.exit(f"{args.launcher} run failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    figures = json.loads(lines[-1][len("RESULT "):])
    if busy is not None:  # the GPU's busy share while it trained, from the first batch's end to the last's
        figures["gpu_busy_percent"] = busy.between(figures["first_batch_at"], figures["last_batch_at"])
    return figures


def word_range(text: str) -> tuple[int, int]:
    low, _, high = text.partition("-")
    return int(low), int(high or low)


def main() -> None:
    from flair_nbddp.options import compile_setting

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--launcher", choices=LAUNCHERS, required=True)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    parser.add_argument("--processes", type=int, default=None)
    parser.add_argument("--task", choices=["classify", "tag"], default="classify",
                        help="a TextClassifier on reviews, or a SequenceTagger on sentences with names (make_model)")
    parser.add_argument("--size", choices=["tiny", "distilbert"], default="distilbert")
    parser.add_argument("--docs", type=int, default=4000)
    parser.add_argument(
        "--words", type=word_range, default=IMDB_WORDS, help="words a review: N, or a range A-B (200-260)"
    )  # fmt: skip
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--chunk", type=int, default=None)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--no-fast-inputs", action="store_true", help="kit launchers: flair's own input building")
    parser.add_argument("--no-direct-embeddings", action="store_true",
                        help="kit launchers: a tagger gathers its embeddings token by token, as flair does")
    parser.add_argument("--no-skip-clean-tokens", action="store_true",
                        help="kit launchers: flair clears every token of every batch")
    parser.add_argument(
        "--lazy-corpus", choices=["auto", "yes", "no"], default="auto",
        help="kit launchers: lazy_corpus=None (the kit's default), True or False",
    )  # fmt: skip
    parser.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="fp32", help="kit launchers only")
    parser.add_argument(
        "--compile-model", type=compile_setting, default=False, metavar="on|off|MODE",
        help="kit launchers: compile_model (default off: flair's eager model)",
    )  # fmt: skip
    parser.add_argument(
        "--no-ddp", action="store_true",
        help="kit launchers, one process: flair's trainer with multi_gpu=False (no DDP wrapper), for DDP's share",
    )  # fmt: skip
    parser.add_argument("--workdir", default="/tmp/flair_nbddp-bench")
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    args = parser.parse_args()
    if args.no_ddp and (args.launcher not in ("kit", "kit-pool") or processes_for(args.device, args.processes) != 1):
        parser.error("--no-ddp needs a kit launcher and one process (--processes 1, or one GPU)")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from flair_nbddp.synthetic import tiny_transformer

    args.model = tiny_transformer(Path(args.workdir) / f"model-{args.size}", size=args.size)
    args.base = str(Path(args.workdir) / f"train-{args.launcher}")
    figures = run_job(args)
    figures.update(
        launcher=args.launcher, task=args.task, device=args.device, size=args.size, docs=args.docs, words=args.words,
        batch=args.batch,
        precision=args.precision, fast_inputs=not args.no_fast_inputs, lazy_corpus=args.lazy_corpus,
        direct_embeddings=not args.no_direct_embeddings, skip_clean_tokens=not args.no_skip_clean_tokens,
        compile_model=args.compile_model, ddp=not args.no_ddp,
    )  # fmt: skip
    print(json.dumps(figures))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()

"""The documentation's Performance page, rendered from the result files in ``benchmarks/results/``.

    python benchmarks/report.py --out DIR      # writes DIR/performance.md and DIR/performance/*.svg

The site's build calls :func:`performance_page` (``docs/hooks/site.py``), so the page cannot drift from the files:
every number on it is read from a result file, and each table names the machine, the software versions and the
command that measured it. The prose here frames the tables and holds no figures. Needs matplotlib, not torch or
flair.
"""

from __future__ import annotations

import argparse
import io
import json
import re
import statistics
from pathlib import Path
from typing import Callable, Iterable

RESULTS = Path(__file__).resolve().parent / "results"
PAGE = "performance.md"
IMAGES = "performance"
DATA = "benchmarks/results"

COLORS = {"flair": "#9e9e9e", "fp32": "#3f51b5", "bf16": "#e65100", "plain": "#2e7d32", "other": "#7986cb",
          "cold": "#9e9e9e", "warm": "#3f51b5", "lazy": "#3f51b5", "built": "#e65100"}


# ------------------------------------------------------------------------------------------------- formatting


def number(value: float, digits: int = 1) -> str:
    """``value`` with thousands separators and ``digits`` decimals."""
    return f"{value:,.{digits}f}"


def seconds(value: float) -> str:
    """A duration: milliseconds below 0.01 s, else seconds with two decimals (one from 10 s on)."""
    if value < 0.01:
        return f"{number(value * 1000, 1)} ms"
    return f"{number(value, 2 if value < 10 else 1)} s"


def ratio(value: float) -> str:
    return f"{value:.2f}×"


def percent(value: float) -> str:
    return f"{value:.{2 if value < 1 else 1}f} %"


def each(values: Iterable[float], fmt: Callable[[float], str]) -> str:
    return " / ".join(fmt(value) for value in values)


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------- the result files


class Results:
    """The result files, read once each; every table's caption is made from the files it used."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self._cache: dict[str, dict] = {}

    def __call__(self, name: str) -> dict:
        if name not in self._cache:
            path = self.folder / name
            if not path.exists():
                raise FileNotFoundError(f"the Performance page needs {path}, which is missing")
            self._cache[name] = json.loads(path.read_text())
        return self._cache[name]

    def machine(self, name: str) -> str:
        return self(name)["machine"]["description"]

    def short(self, name: str) -> str:
        """The machine in a word or two: its GPU's name, or its cores."""
        machine = self(name)["machine"]
        if machine.get("gpu"):
            return machine["gpu"].replace("NVIDIA ", "").replace(" 80GB HBM3", "")
        return f"{machine['cpu_cores']}-core CPU"

    def software(self, name: str) -> str:
        """The versions a file names, whatever the case of their keys; "none (...)" (a CPU build) left out."""
        versions = {key.lower(): value for key, value in self(name)["versions"].items()}
        parts = []
        for key, shown in (("python", "Python"), ("torch", "torch"), ("cuda", "CUDA"), ("nccl", "NCCL"),
                           ("flair", "flair"), ("transformers", "transformers")):
            value = versions.get(key)
            if value and not str(value).startswith("none"):
                parts.append(f"{shown} {value}")
        return ", ".join(parts)

    def commands(self, name: str) -> list[tuple[str, str]]:
        data = self(name)
        if "command" in data:
            return [("", data["command"])]
        commands = data["commands"]
        if isinstance(commands, dict):
            return list(commands.items())
        return [("", command) for command in commands]

    def caption(self, *names: str) -> str:
        """Machine, software, the data files and the commands that reproduce them, for the tables above it."""
        groups: dict[tuple[str, str], list[str]] = {}
        for name in names:
            groups.setdefault((self.machine(name), self.software(name)), []).append(name)
        lines = []
        for (machine, software), files in groups.items():
            data = ", ".join(f"`{DATA}/{name}`" for name in files)
            lines.append(f"*Machine:* {machine}. *Software:* {software}. *Data:* {data}.")
        commands = [(label, command) for name in names for label, command in self.commands(name)]
        block = ['??? note "Commands that reproduce these figures"', ""]
        seen = set()
        for label, command in commands:
            if command in seen:
                continue
            seen.add(command)
            label = display(label.replace("_", " ")) if label else ""
            block.append(f"    - {label + ': ' if label else ''}`{command}`")
        return "\n\n".join(lines) + "\n\n" + "\n".join(block)

    def notes(self, name: str) -> str:
        data = self(name)
        note = data.get("note")
        return f'!!! note "{self.short(name)}"\n    {note}' if note else ""


def model_name(description: str) -> str:
    """A model's description in a result file, in a few words."""
    if "DistilBERT" in description:
        return "DistilBERT-shaped transformer"
    if "tiny transformer" in description:
        return "tiny transformer"
    return description


def job_text(job: dict, short: bool = False) -> str:
    """A training job, from a result file's ``job``; ``short``: the model named in a few words, not the training."""
    words = job.get("words_per_doc")
    words = "" if not words else f" of {words[0]}" + ("" if words[0] == words[1] else f"-{words[1]}") + " words"
    if short:
        parts = [model_name(job["model"])]
    else:
        parts = [f"{job['training']}" if job.get("training") else "", f"model: {job['model']}"]
    corpus = f"{number(job['train_docs'], 0)} generated reviews{words}"
    if job.get("batch"):
        corpus += f", batch {job['batch']}"
    if job.get("epochs"):
        corpus += f", {job['epochs']} epoch{'s' if job['epochs'] > 1 else ''}"
    if job.get("ranks"):
        corpus += f", {job['ranks']} rank{'s' if job['ranks'] > 1 else ''}"
    return "; ".join(part for part in parts + [corpus] if part)


# ------------------------------------------------------------------------------------------------- plots


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"svg.hashsalt": "flair_nbddp", "svg.fonttype": "none", "font.size": 9,
                         "axes.spines.top": False, "axes.spines.right": False})
    return plt


def svg(figure) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="svg", bbox_inches="tight", metadata={"Date": None})
    _pyplot().close(figure)
    return buffer.getvalue()


# ------------------------------------------------------------------------------------------------- sections


def display(label: str) -> str:
    """A run's label in a result file, as the page shows it."""
    if label.startswith("kit"):
        return "flair_nbddp" + label[3:]
    if label.startswith("flair"):
        return "flair's script" + label[5:]
    return label


def color(label: str) -> str:
    if label.startswith("flair"):
        return COLORS["flair"]
    if label.startswith("plain"):
        return COLORS["plain"]
    if "flair's input" in label:
        return COLORS["other"]
    return COLORS["bf16"] if "bf16" in label else COLORS["fp32"]


def order(label: str) -> int:
    """Where a run kind goes in a table and a plot: flair's script, the kit in fp32, in bf16, the plain loop."""
    if label.startswith("flair"):
        return 0
    if label.startswith("plain"):
        return 4
    if "bf16" in label:
        return 3
    return 2 if "flair's input" in label else 1


def grouped(runs: list[dict]) -> dict[str, list[dict]]:
    """A throughput file's runs by kind (its ``run`` label), in the page's order."""
    kinds: dict[str, list[dict]] = {}
    for run in runs:
        kinds.setdefault(run["run"], []).append(run)
    return dict(sorted(kinds.items(), key=lambda item: order(item[0])))


def baseline(kinds: dict[str, list[dict]]) -> float:
    flair = next(runs for label, runs in kinds.items() if label.startswith("flair"))
    return statistics.median(run["samples_per_s"] for run in flair)


THROUGHPUT = ("throughput-h100.json", "throughput-h200.json", "throughput-cpu.json")


def throughput_section(r: Results, images: dict[str, bytes]) -> str:
    out = [
        "## Training throughput",
        "The same fine-tuning job through flair's own launcher (`launch_distributed`, started from a script, every "
        "rank building its corpus) and through [launch][flair_nbddp.launch] from a notebook-like file-less "
        "program (the corpus built once in the parent and shipped). Samples per second count every rank's samples "
        "after the first batch; each machine's runs ran one after another on that machine. GPU figures come from "
        "one GPU per machine, so they compare a rank's pace, not scaling. The last column is each run kind's "
        "median over the median of flair's script in fp32 on the same machine. Compare rows within a table, "
        "not across machines: the host's CPU paces flair's per-batch Python, and hosts of the same GPU differ.",
    ]
    for name in THROUGHPUT:
        data = r(name)
        kinds = grouped(data["runs"])
        base = baseline(kinds)
        gpu = data["machine"]["gpus"] > 0
        header = ["run", "runs", "samples/s (median)", "each run"]
        header += ["GPU busy (median)"] if gpu else []
        header += ["CPU ms a sample (median)", "× flair's script"]
        rows = []
        for label, runs in kinds.items():
            rates = [run["samples_per_s"] for run in runs]
            row = [display(label), str(len(runs)), f"**{number(statistics.median(rates))}**",
                   each(rates, lambda v: number(v))]
            if gpu:
                row.append(percent(statistics.median(run["gpu_busy_percent"] for run in runs)))
            cpu = [run["cpu_ms_per_sample"] for run in runs if "cpu_ms_per_sample" in run]
            row.append(number(statistics.median(cpu), 2) if cpu else "–")
            row.append(ratio(statistics.median(rates) / base))
            rows.append(row)
        out += [f"### {r.short(name)}", f"*Job:* {job_text(data['job'])}.", table(header, rows), r.caption(name)]
        if r.notes(name):
            out.append(r.notes(name))
    images[f"{IMAGES}/throughput.svg"] = throughput_plot(r)
    out.insert(2, f"![Samples per second per run kind, one panel per machine]({IMAGES}/throughput.svg)")
    return "\n\n".join(out)


def throughput_plot(r: Results) -> bytes:
    plt = _pyplot()
    figure, axes = plt.subplots(1, len(THROUGHPUT), figsize=(10, 3.4))
    for axis, name in zip(axes, THROUGHPUT):
        kinds = grouped(r(name)["runs"])
        labels = list(kinds)
        for index, label in enumerate(labels):
            rates = [run["samples_per_s"] for run in kinds[label]]
            axis.bar(index, statistics.median(rates), color=color(label), width=0.7)
            axis.scatter([index] * len(rates), rates, s=8, color="black", zorder=3)
        axis.set_xticks(range(len(labels)), [display(label).replace(", ", ",\n") for label in labels], rotation=60,
                        ha="right", fontsize=7)
        axis.set_title(r.short(name))
        axis.set_ylabel("samples/s")
    figure.suptitle("Training throughput: medians (bars) and each run (dots)")
    figure.tight_layout()
    return svg(figure)


def first_batch_rows(r: Results) -> list[tuple[str, str, str, list[float], str]]:
    """(machine, how the ranks start, job, seconds of each run, data file) for each first-batch measurement."""
    cpu = r("first-batch-cpu.json")
    first = [launch["first_batch_s"] for run in cpu["first_launch"]["rounds"] for launch in run["launches"]
             if launch["launch"] == 0 and launch["job"] == "training"]
    later = [launch["first_batch_s"] for run in cpu["later_launches"]["rounds"] for launch in run["launches"]
             if launch["job"] == "training"]
    restart_cpu, restart_gpu = r("restart-latency-cpu.json"), r("restart-latency-h100.json")
    h200 = r("first-batch-h200.json")["cold_vs_warm"]
    cpu_job = job_text(cpu["job"], short=True)
    restart_job = job_text(restart_cpu["job"], short=True)
    h200_job = f"{number(h200['docs'], 0)} generated IMDB-length reviews, {h200['world_size']} rank"
    return [
        (r.short("first-batch-cpu.json"), "cold: a program's first launch (fresh ranks; the fork server starts "
         "beside them)", cpu_job, first, "first-batch-cpu.json"),
        (r.short("first-batch-cpu.json"), "cold: a later launch (ranks forked from the fork server)", cpu_job, later,
         "first-batch-cpu.json"),
        (r.short("restart-latency-cpu.json"), "warm `WorkerPool`", restart_job,
         [restart_cpu["pool"]["first_attempt_launch_to_first_batch_s"]], "restart-latency-cpu.json"),
        (r.short("restart-latency-h100.json"), "cold (ranks sharing the GPU)", restart_job,
         [restart_gpu["cold"]["first_attempt_launch_to_first_batch_s"]], "restart-latency-h100.json"),
        (r.short("restart-latency-h100.json"), "warm `WorkerPool` (ranks sharing the GPU)", restart_job,
         [restart_gpu["pool"]["first_attempt_launch_to_first_batch_s"]], "restart-latency-h100.json"),
        (r.short("first-batch-h200.json"), "cold", f"DistilBERT-shaped model; {h200_job}",
         [h200["cold_first_batch_s"]], "first-batch-h200.json"),
        (r.short("first-batch-h200.json"), "warm `WorkerPool`", f"DistilBERT-shaped model; {h200_job}",
         [h200["warm_first_batch_s"]], "first-batch-h200.json"),
    ]


def first_batch_section(r: Results, images: dict[str, bytes]) -> str:
    rows = first_batch_rows(r)
    out = [
        "## Time to the first batch",
        "Seconds from the launch call to the end of the first training batch. A cold launch starts new ranks and "
        "ships the corpus; on CPU the ranks of every launch after a program's first are forked from a server that "
        "imported torch and flair once. A warm [WorkerPool][flair_nbddp.WorkerPool] keeps its ranks between "
        "jobs, so a notebook's next cell skips the start-up ([warm pools](guide/pools.md)).",
        f"![Launch call to first batch, cold and warm]({IMAGES}/first-batch.svg)",
        table(["machine", "how the ranks start", "job", "launch call → first batch (median)", "each run"],
              [[machine, how, job, f"**{seconds(statistics.median(values))}**", each(values, seconds)]
               for machine, how, job, values, _ in rows]),
        r.caption(*dict.fromkeys(name for *_, name in rows)),
    ]
    h200 = r("first-batch-h200.json")
    cold_warm = h200["cold_vs_warm"]
    out += [
        "### A warm pool's next job, taken apart",
        "What a warm pool's launch spends before the first batch: packing the call and its corpus in the notebook, "
        "unpacking it in a rank, and the rest (dispatch, the health check, building the model and flair's "
        "trainer). The round trip of a trivial job shows the launch's own cost.",
        table(["run", "launch call → first batch (median)", "each warm job", "pack", "unpack", "the rest",
               "payload"],
              [[str(index + 1), seconds(run["warm_first_batch_s"]), each(run["warm_first_batch_runs_s"], seconds),
                seconds(run["pack_s"]), seconds(run["unpack_s"]), seconds(run["rest_s"]),
                f"{number(run['payload_mb'], 1)} MB"] for index, run in enumerate(h200["warm_path"]["runs"])]),
        table(["a trivial job, launch call → result", "cold", "warm `WorkerPool`", "warm / cold"],
              [[f"{r.short('first-batch-h200.json')}, {cold_warm['world_size']} rank",
                seconds(cold_warm["trivial_job_cold_s"]), seconds(cold_warm["trivial_job_warm_s"]),
                f"{cold_warm['warm_vs_cold_trivial_job']:.4f}"]]),
        f"*Job:* a DistilBERT-shaped model, {number(h200['warm_path']['runs'][0]['docs'], 0)} generated "
        f"IMDB-length reviews, {h200['warm_path']['runs'][0]['world_size']} rank.",
        r.caption("first-batch-h200.json"),
    ]
    images[f"{IMAGES}/first-batch.svg"] = first_batch_plot(rows)
    return "\n\n".join(out)


def first_batch_plot(rows) -> bytes:
    plt = _pyplot()
    figure, axis = plt.subplots(figsize=(8, 0.45 * len(rows) + 0.8))
    labels, values, colors = [], [], []
    for machine, how, _, runs, _ in rows[::-1]:
        short = re.sub(r" \(.*", "", how).replace("`", "")
        labels.append(f"{machine}: {short}")
        values.append(statistics.median(runs))
        colors.append(COLORS["warm"] if "warm" in how else COLORS["cold"])
    axis.barh(range(len(rows)), values, color=colors)
    for index, value in enumerate(values):
        axis.text(value * 1.08, index, seconds(value), va="center", fontsize=7)
    axis.set_yticks(range(len(rows)), labels, fontsize=7)
    axis.set_xscale("log")
    axis.xaxis.set_major_formatter(_pyplot().FuncFormatter(lambda value, _: f"{value:g} s"))
    axis.legend(handles=[_pyplot().Rectangle((0, 0), 1, 1, color=COLORS[kind]) for kind in ("cold", "warm")],
                labels=["cold launch", "warm pool"], fontsize=7, frameon=False, loc="lower right")
    axis.set_xlabel("seconds from the launch call to the first batch (log scale)")
    axis.set_xlim(min(values) / 2, max(values) * 3)
    figure.tight_layout()
    return svg(figure)


def checkpoint_section(r: Results) -> str:
    cost = r("checkpoint-cost-h100.json")
    rows = []
    for run in cost["runs"]:
        epochs = run["epochs"]
        waits = [epoch["checkpoint_wait_s"] for epoch in epochs]
        rows.append([
            run["precision"], each((epoch["train_s"] for epoch in epochs), lambda v: number(v, 2)),
            f"{number(run['checkpoint_mb'], 0)} MB", f"**{seconds(waits[0])}**", each(waits[1:], seconds),
            str(sum(epoch["pinned_blocks_made"] or 0 for epoch in epochs)),
            each((epoch["write_s"] for epoch in epochs), lambda v: number(v, 2)),
            percent(100 * max(epoch["cost"] for epoch in epochs)),
        ])
    writer = r("checkpoint-writer-cpu.json")
    stop = r("stop-h100.json")
    stop_rows = []
    for ranks, figures in stop["ranks"].items():
        stop_rows.append([
            ranks, f"**{seconds(figures['cell_freed_s'])}**", f"`{figures['status']}`",
            "yes" if figures["model_saved"] else "no", ", ".join(map(str, figures["full_checkpoints"])),
            str(len(figures["workers_left"])), str(len(figures["gpu_contexts_left"])),
        ])
    one_gpu = r("stop-time-h100.json")
    one_gpu_rows = []
    for way, runs in one_gpu["workers_leave"].items():
        for run in runs:
            at = run["seconds_after_interrupt"]
            one_gpu_rows.append([
                way.replace("_", " "), number(run["docs"], 0), seconds(at["checkpoint_written"]),
                seconds(run["rank0_parts_s"]["checkpoint_write_s"]), seconds(at["rank0_exited"]),
                f"**{seconds(at['result_returned'])}**", run.get("resumed", {}).get("status", "—"),
            ])
    return "\n\n".join([
        "## Checkpoints",
        "A run writes a full checkpoint at each epoch's end and at a stop, so that it can resume or restart "
        "([runs that survive](guide/surviving-runs.md)): rank 0 writes the model's and the optimizer's states, "
        "flair's schedulers and every rank's random generators. The training waits only while the states are "
        "copied into pinned host memory, made ahead while the first epoch trains; a writer thread saves, hashes "
        "and renames the file while the next epoch trains. Here one process fine-tunes with the kit's checkpoint "
        "plugin, as every rank of a run has it. The last column is the largest wait over its epoch.",
        f"*Job:* {job_text(cost['job'])}.",
        table(["precision", "epochs trained (s)", "checkpoint", "training's wait: first checkpoint",
               "later checkpoints", "pinned blocks made while waiting", "writer thread (s)", "largest wait / epoch"],
              rows),
        r.caption("checkpoint-cost-h100.json"),
        "The writer thread holds the interpreter's lock as little as it can: here a second thread counts while a "
        "checkpoint is written, and every gap in its counting is time the writer took from it.",
        table(["checkpoint written", "writer's time", f"gaps over {writer['gap_threshold_ms']} ms in the other "
               "thread", "their sum", "longest gap"],
              [[f"{number(writer['megabytes'], 0)} MB", seconds(writer["write_s"]), str(writer["stalls_over_4ms"]),
                seconds(writer["stalled_s"]), seconds(writer["longest_gap_s"])]]),
        r.caption("checkpoint-writer-cpu.json"),
        "A stop: the kernel's interrupt stops every rank after the same batch; the run saves the model and returns "
        "a stopped result, with no worker process or GPU context left behind. The time runs from the interrupt "
        "to the launch call's return.",
        f"*Job:* {job_text(stop['job'])}, the ranks sharing one GPU.",
        table(["ranks", "interrupt → result returned", "status", "model saved", "full checkpoints (epochs)",
               "worker processes left", "GPU contexts left"], stop_rows),
        r.caption("stop-h100.json"),
        "The same on one GPU with a DistilBERT-sized model, whose full checkpoint (the model and AdamW's two "
        "states) is 516 MB: most of a stop is writing it. A worker leaves at once when its job is done; left to the "
        "interpreter's teardown, it would free every object the job made one by one first, while the cell waits.",
        f"*Job:* {job_text(one_gpu['job'])}; interrupted once rank 0 had trained 10 batches.",
        table(["worker leaves", "reviews", "interrupt → checkpoint written", "writing it (rank 0)",
               "→ rank 0's process gone", "→ result returned", "resumed from it"], one_gpu_rows),
        r.caption("stop-time-h100.json"),
    ])


def evaluation_section(r: Results) -> str:
    rows = []
    for name, key in (("eval-speedup-cpu.json", "eval_speedup"), ("eval-one-rank-h200.json", "world_size_1_ratio")):
        data = r(name)
        rows.append([r.short(name), str(data["processes"]), number(data["docs"], 0), seconds(data["whole_split_s"]),
                     seconds(data["shared_out_s"]), f"**{ratio(data[key])}**",
                     "yes" if data["identical_scores"] else "no"])
    return "\n\n".join([
        "## Evaluation shared out between ranks",
        "flair evaluates the whole dev split on every rank. The kit has each rank predict its share of the "
        "batches, then every rank replays flair's own `evaluate` over the whole split with the gathered "
        "predictions, so the scores are flair's ([evaluation](guide/evaluation.md)). Times are the slowest "
        "rank's; on one rank nothing is shared out and the ratio checks that the kit's path costs nothing.",
        table(["machine", "ranks", "dev documents", "whole split on every rank", "shared out",
               "whole / shared", "identical scores"], rows),
        r.caption("eval-speedup-cpu.json", "eval-one-rank-h200.json"),
    ])


def shipping_section(r: Results) -> str:
    rows = []
    names = ("corpus-shipping-cpu.json", "corpus-shipping-h200-host.json")
    for name in names:
        data = r(name)
        for method, figures in data["methods"].items():
            rows.append([r.short(name), f"{number(data['docs'], 0)} ({number(data['tokens'], 0)} tokens)", method,
                         f"{number(figures['bytes'] / 1e6, 1)} MB", seconds(figures["pack_s"]),
                         seconds(figures["unpack_s"]), f"{number(figures['pack_extra_mb'], 0)} MB",
                         f"{number(figures['worker_peak_mb'], 0)} MB"])
        ratios = data["ratios"]
        rows.append([r.short(name), "", "**cloudpickle / codec**", f"**{ratio(ratios['size_ratio_vs_cloudpickle'])}**",
                     f"**{ratio(ratios['pack_speedup_vs_cloudpickle'])}**",
                     f"**{ratio(ratios['unpack_speedup_vs_cloudpickle'])}**",
                     f"**{ratio(ratios['parent_peak_memory_ratio'])}**",
                     f"**{ratio(ratios['worker_peak_memory_ratio'])}**"])
    return "\n\n".join([
        "## Shipping a corpus",
        "The corpus is built once in the notebook and shipped to every rank. The kit's codec stores its content "
        "column-wise (token texts as indices into a vocabulary, labels and spans as integer streams) instead of "
        "pickling millions of small objects, and rebuilds an equal corpus. Each way: a fresh process builds and "
        "packs the corpus, a fresh worker process reads and unpacks it.",
        table(["machine", "generated IMDB-length reviews", "method", "shipped", "pack", "unpack",
               "notebook's extra peak memory while packing", "worker's peak memory"], rows),
        r.caption(*names),
    ])


def big_corpus_section(r: Results, images: dict[str, bytes]) -> str:
    names = ("big-corpus-cpu.json", "big-corpus-h200.json")

    def sizes(data: dict, kind: str) -> tuple[int, int]:
        found = sorted(int(match.group(1)) for key in data if (match := re.fullmatch(rf"{kind}_(\d+)_s", key)))
        return found[0], found[-1]

    def peaks(data: dict, kind: str) -> str:
        peak = data[f"{kind}_peak_mb"]
        small, large = sorted(peak, key=int)
        return (f"**{number(data[f'{kind}_growth_mb_per_1000_docs'], 2)} MB** ({number(peak[small], 0)} → "
                f"{number(peak[large], 0)} MB from {number(int(small), 0)} to {number(int(large), 0)} documents)")

    def first(data: dict, kind: str) -> str:
        small, large = sizes(data, kind)
        return (f"{seconds(data[f'{kind}_{small}_s'])} → {seconds(data[f'{kind}_{large}_s'])} "
                f"(**{ratio(data[f'{kind}_first_batch_ratio'])}**) from {number(small, 0)} to {number(large, 0)} "
                "documents")

    def throughput(data: dict) -> str:
        lazy, built = data["lazy_samples_per_s"], data["built_samples_per_s"]
        return (f"**{ratio(data['lazy_vs_built_throughput'])}** ({number(statistics.median(lazy))} / "
                f"{number(statistics.median(built))} samples/s)")

    datas = [r(name) for name in names]
    rows = [
        ["worker's peak memory growth per 1,000 documents, lazy"] + [peaks(data, "lazy") for data in datas],
        ["the same, built"] + [peaks(data, "built") for data in datas],
        ["first batch, cold launch"] + [first(data, "cold") for data in datas],
        ["first batch, warm pool with `pool.put`"] + [first(data, "warm") for data in datas],
        ["`pool.put` of the largest corpus"] + [seconds(data[f"put_{sizes(data, 'warm')[1]}_s"]) for data in datas],
        ["training throughput, lazy / built"] + [throughput(data) for data in datas],
    ]
    images[f"{IMAGES}/big-corpus-memory.svg"] = big_corpus_plot(r, names)
    header = ["", *(f"{r.short(name)}, {r(name)['ranks']} rank{'s' if r(name)['ranks'] > 1 else ''}"
                    for name in names)]
    return "\n\n".join([
        "## Big corpora",
        "A corpus too big to build in every worker stays compact there (a lazy corpus) and is built a sentence at a "
        "time as flair reads it; `pool.put` ships a corpus to a warm pool once, for every later job "
        "([big corpora](guide/big-corpora.md)). Memory is each worker's peak resident memory after reading every "
        "training sentence twice. A cold launch packs the corpus in the notebook while the new ranks start, which "
        "hides the packing where there are enough cores.",
        f"![Worker peak memory against corpus size, lazy and built]({IMAGES}/big-corpus-memory.svg)",
        table(header, rows),
        r.caption(*names),
    ])


def big_corpus_plot(r: Results, names) -> bytes:
    plt = _pyplot()
    figure, axis = plt.subplots(figsize=(6, 3.2))
    for name, style in zip(names, ("-", "--")):
        data = r(name)
        for kind in ("lazy", "built"):
            points = sorted((int(docs), mb) for docs, mb in data[f"{kind}_peak_mb"].items())
            axis.plot([docs for docs, _ in points], [mb for _, mb in points], style, marker="o",
                      color=COLORS[kind], label=f"{r.short(name)}, {kind}")
    axis.xaxis.set_major_formatter(_pyplot().FuncFormatter(lambda value, _: f"{value:,.0f}"))
    axis.set_xlabel("training documents")
    axis.set_ylabel("worker's peak memory (MB)")
    axis.legend(fontsize=7, frameon=False)
    figure.tight_layout()
    return svg(figure)


def restart_section(r: Results) -> str:
    rows = []
    names = ("restart-latency-cpu.json", "restart-latency-h100.json")
    for name in names:
        data = r(name)
        for way in ("cold", "pool", "cluster"):
            if way not in data:
                continue
            figures = data[way]
            label = {"cold": "cold", "pool": "warm `WorkerPool`", "cluster": "Dask cluster on 127.0.0.1"}[way]
            rows.append([r.short(name), label, seconds(figures["death_to_failure_s"]),
                         seconds(figures["death_to_restart_s"]), f"**{seconds(figures['death_to_first_batch_s'])}**",
                         seconds(figures["first_attempt_launch_to_first_batch_s"])])
    return "\n\n".join([
        "## Restarts",
        "With `max_restarts`, a run whose rank dies starts again from its last full checkpoint. A restart replaces "
        "every rank (a dead rank may have left the process group in any state), so it costs what a cold start "
        "costs, on a pool too.",
        f"*Job:* {job_text(r(names[0])['job'])}; rank 1 kills itself in epoch 2.",
        table(["machine", "way of running", "death → failure known", "death → restart begins",
               "death → first batch after the restart", "for comparison: first launch → first batch"], rows),
        r.caption(*names),
    ])


def sweep_section(r: Results) -> str:
    cpu, gpu = r("sweep-cpu.json"), r("sweep-h100.json")
    trials = gpu["trials"]
    rates = [trial["samples_per_second"] for trial in trials]
    firsts = [trial["time_to_first_batch_s"] for trial in trials]
    return "\n\n".join([
        "## Sweeps",
        "A sweep runs its trials side by side on the machine's process slots (or GPUs), each trial a small run of "
        "its own ([sweeps](guide/sweeps.md)). Side by side against one at a time, on the same cores:",
        table(["trials", "how they run", "wall time"], [
            [str(cpu["trials"]), "one at a time, each with a slot's share of the cores", seconds(cpu["sequential_s"])],
            [str(cpu["trials"]), "one at a time, each with every core", seconds(cpu["sequential_whole_cpu_s"])],
            [str(cpu["trials"]), "side by side, one a process slot", f"**{seconds(cpu['side_by_side_s'])}**"],
            [str(cpu["trials"]), "side by side on a warm `WorkerPool`'s slices", seconds(cpu["on_pool_slices_s"])],
        ]),
        table(["side by side: speed-up", "against every core each", "a trial's first batch, cold",
               "on a warm pool's slice"],
              [[f"**{ratio(cpu['side_by_side_speedup'])}**", ratio(cpu["side_by_side_vs_whole_cpu"]),
                seconds(cpu["first_batch_cold_s"]), seconds(cpu["first_batch_pool_slice_s"])]]),
        r.caption("sweep-cpu.json"),
        table(["trials", "wall time", "states", "devices", "samples/s per trial", "start → first batch per trial"],
              [[str(len(trials)), seconds(gpu["wall_s"]), ", ".join(sorted({t["state"] for t in trials})),
                ", ".join(sorted({t["devices"] for t in trials})), f"{number(min(rates))}–{number(max(rates))}",
                f"{seconds(min(firsts))} – {seconds(max(firsts))}"]]),
        r.caption("sweep-h100.json"),
    ])


def predict_section(r: Results) -> str:
    """flair_nbddp.predict against flair's model.predict, the N-GPU expectation from one GPU's figures, memory."""
    speeds = sorted(path.name for path in r.folder.glob("predict-speed-*.json"))
    rows, gpu_rows = [], []
    for name in speeds:
        data = r(name)
        for mode, figures in data["modes"].items():
            rounds = figures["rounds"]
            same = figures.get("same_labels_as_flair")
            busy = [round_["gpu_busy_percent"] for round_ in rounds]
            rows.append([
                r.short(name), mode, "1" if mode.startswith("flair") else str(data["processes"]),
                " · ".join(number(round_["texts_per_second"], 0) for round_ in rounds),
                " · ".join(f"**{ratio(round_['vs_flair'])}**" if i == 0 else ratio(round_["vs_flair"])
                           for i, round_ in enumerate(rounds)) if "vs_flair" in rounds[0] else "—",
                "—" if all(value is None for value in busy) else " · ".join(
                    "?" if value is None else percent(value) for value in busy),
                "—" if same is None else "yes" if same else f"no (largest score difference "
                f"{figures['largest_score_difference']:.1e})",
            ])  # fmt: skip
            costs = [round_.get("notebook_cpu_ms_per_1000_texts") for round_ in rounds]
            costs = [cost for cost in costs if cost]
            if data["machine"].get("gpu") and mode.startswith("kit") and costs:
                ceiling = 1e6 / statistics.mean(costs)
                rate = rounds[0]["texts_per_second"]
                gpu_rows.append([r.short(name), mode, *(number(min(n * rate, ceiling), 0) for n in (1, 2, 4, 8)),
                                 number(ceiling, 0)])  # fmt: skip
    memory = r("predict-memory-cpu.json")
    parts = [
        "## Predicting on every device",
        "`predict` against flair's own `model.predict` in one process, on the same generated reviews as `Sentence` "
        "objects, with a `TextClassifier` on a transformer built from a config ([predicting](guide/predicting.md)). "
        "The kit runs on a warm pool that holds the model already. Each figure is given by round, and the ratio "
        "compares the same round of each: the first round (in bold) is the fair one, since from the second on the "
        "pool's workers find the reviews' encodings kept from the first. *same labels* compares every label with "
        "flair's.",
        table(["machine", "mode", "ranks", "texts/s by round", "against flair", "GPU busy", "same labels"], rows),
        r.caption(*speeds),
        *filter(None, (r.notes(name) for name in speeds)),
    ]
    if gpu_rows:
        parts += [
            "What more GPUs should give, until a machine with several measures it: each GPU predicts at the rate of "
            "the first round on one, and the notebook's own work (dealing, shipping, putting labels back: its CPU "
            "time per text, measured in the same calls) sets a ceiling that no number of GPUs passes. Expected "
            "texts/s:",
            table(["measured on", "mode", "1 GPU", "2 GPUs", "4 GPUs", "8 GPUs", "the notebook's ceiling"], gpu_rows),
        ]
    parts += [
        "A call from a text file to a JSON Lines file keeps neither the texts nor the predictions in the notebook:",
        table(["texts", "input", "output", "kernel memory growth at its peak", "rows in input order"],
              [[number(memory["texts"], 0), f"{memory['input_mb']} MB", f"{memory['output_mb']} MB",
                f"**{memory['rss_growth_at_peak_mb']} MB**", "yes" if memory["rows_in_input_order"] else "no"]]),
        r.caption("predict-memory-cpu.json"),
    ]  # fmt: skip
    return "\n\n".join(parts)


def _median(runs: list[dict], *keys: str) -> list[float | None]:
    """For each key, the median over ``runs`` of the values they have (None where none has one)."""
    values = [[run[key] for run in runs if run.get(key) is not None] for key in keys]
    return [statistics.median(found) if found else None for found in values]


def _by_epoch(runs: list[dict], key: str) -> list[float]:
    """The median over ``runs`` of each epoch's value of a per-epoch figure."""
    return [statistics.median(values) for values in zip(*(run.get(key) or [] for run in runs))]


def bookkeeping_section(r: Results) -> str:
    """flair's per-token bookkeeping: the kit with its paths on and off, against flair's script and the plain loop."""
    names = sorted(path.name for path in r.folder.glob("bookkeeping-*.json"))
    parts = [
        "## flair's per-token bookkeeping",
        "Two fine-tuning jobs, a classifier on document embeddings and a tagger on word embeddings (each word's first "
        "sub-token, no CRF), through flair's script and the kit, with the kit's per-token paths on (the default) and "
        "off ([Precision and inputs](guide/precision-and-inputs.md#flairs-per-token-bookkeeping)). On a GPU, a plain "
        "PyTorch loop on the same model and batches, tokenized before the loop, gives the device's pace without "
        "flair. *Batch* is the median batch of each epoch, end to end; *between epochs* is the pause from an "
        "epoch's last batch to the next epoch's first (evaluation, the epoch's checkpoint), less a batch. Figures "
        "are medians over the rounds.",
    ]
    for name in names:
        data = r(name)
        gpu = data["machine"]["gpus"] > 0
        for job in data["jobs"]:
            kinds = grouped([run for run in data["runs"] if run["job"] == job and "samples_per_s" in run])
            if not kinds:
                continue
            flair, flair_cpu = _median(kinds.get("flair fp32", []), "samples_per_s", "cpu_ms_per_sample")
            plain = _median(kinds.get("plain loop bf16", []), "samples_per_s")[0]
            header = ["run", "samples/s", "× flair's script", *(["× plain loop bf16"] if plain else []),
                      "batch ms, by epoch", "between epochs, s", *(["GPU busy"] if gpu else []), "CPU ms a sample",
                      "CPU × flair's script"]
            rows = []
            for label, runs in kinds.items():
                rate, cpu, busy = _median(runs, "samples_per_s", "cpu_ms_per_sample", "gpu_busy_percent")
                rows.append([
                    display(label), f"**{number(rate)}**", ratio(rate / flair) if flair else "—",
                    *([ratio(rate / plain)] if plain else []),
                    " · ".join(number(value) for value in _by_epoch(runs, "epoch_batch_ms_median")) or "—",
                    " · ".join(number(value, 2) for value in _by_epoch(runs, "between_epochs_s")) or "—",
                    *([percent(busy) if busy is not None else "—"] if gpu else []),
                    number(cpu, 2) if cpu else "—",
                    number(cpu / flair_cpu, 2) if cpu and flair_cpu else "—",
                ])  # fmt: skip
            parts += [f"### {r.short(name)}: {'the classifier' if job == 'classify' else 'the tagger'}",
                      f"*Job:* `{data['jobs'][job]}`, 3 epochs{' (the plain loop: 2)' if plain else ''}.",
                      table(header, rows)]
        parts += [r.caption(name), *filter(None, [r.notes(name)])]
    return "\n\n".join(parts)


def overhead_section(r: Results) -> str:
    def row(what: str, name: str, with_: float, without: float, value: float) -> list[str]:
        return [what, r.short(name), number(with_), number(without), f"**{ratio(value)}**"]

    rows = []
    for name in ("dashboard-cost-cpu.json", "dashboard-cost-h200.json"):
        data = r(name)
        rows.append(row("live dashboard (on / off)", name, data["dashboard_on_samples_per_s"],
                        data["dashboard_off_samples_per_s"], data["dashboard_throughput_ratio"]))
    for name in ("ledger-cost-cpu.json", "ledger-cost-h200.json"):
        data = r(name)
        rows.append(row("run ledger (recorded / not)", name, statistics.median(data["recorded_samples_per_s"]),
                        statistics.median(data["unrecorded_samples_per_s"]), data["ledger_throughput_ratio"]))
    chatty = r("chatty-rank-cpu.json")
    rows.append(row(f"a rank printing {number(chatty['lines_per_second'], 0)} lines a second, shown in the cell "
                    "(printing / quiet)", "chatty-rank-cpu.json", chatty["chatty_samples_per_s"],
                    chatty["quiet_samples_per_s"], chatty["chatty_rank_throughput_ratio"]))
    for name in ("cluster-cpu.json", "cluster-h200.json"):
        data = r(name)
        rows.append(row("through a Dask cluster (cluster / local pool)", name,
                        statistics.median(data["cluster_samples_per_s"]),
                        statistics.median(data["local_samples_per_s"]), data["cluster_vs_local_throughput"]))
    ledgers = [r(name) for name in ("ledger-cost-cpu.json", "ledger-cost-h200.json")]
    cluster = r("cluster-h200.json")
    names = ("dashboard-cost-cpu.json", "dashboard-cost-h200.json", "ledger-cost-cpu.json", "ledger-cost-h200.json",
             "chatty-rank-cpu.json", "cluster-cpu.json", "cluster-h200.json")
    return "\n\n".join([
        "## What the kit's own machinery costs",
        "Samples per second of the same job with a feature and without it, alternating jobs on one machine "
        "(medians). A ratio near one means the cost is within the runs' spread: the recorder, the dashboard and "
        "the relay of a rank's output run in the notebook's process, not on the ranks "
        "([run ledger](guide/ledger.md), [Dask clusters](guide/dask.md)).",
        table(["what", "machine", "samples/s with", "without", "ratio"], rows),
        table(["machine", "metric rows written", "a transaction per", "seconds", "in one transaction"],
              [[r.short(name), number(data["rows_written"], 0), f"{number(data['rows_per_transaction'], 0)} rows",
                seconds(data["ledger_100k_rows_s"]), seconds(data["ledger_100k_rows_one_transaction_s"])]
               for name, data in zip(("ledger-cost-cpu.json", "ledger-cost-h200.json"), ledgers)]),
        table(["through a Dask cluster", "cold `launch(..., cluster=)`", "warm `WorkerPool(cluster=)`",
               "cold local launch, for comparison"],
              [[r.short("cluster-h200.json"), seconds(cluster["cluster_cold_first_batch_s"]),
                f"**{seconds(cluster['cluster_warm_first_batch_s'])}**",
                seconds(cluster["local_cold_first_batch_s"])]]),
        r.caption(*names),
    ])


def parity_section(r: Results) -> str:
    rows = []
    names = ("parity-cpu.json", "parity-h200.json")
    for name in names:
        data = r(name)
        for kind, figures in data["kinds"].items():
            largest = max(value for key, value in figures.items() if isinstance(value, float))
            rows.append([r.short(name), data["ranks"], kind, "0.0 (bit for bit)" if largest == 0 else f"{largest:.2g}",
                         "yes" if figures["weights_identical"] else "no"])
    return "\n\n".join([
        "## The same numbers as flair's own launcher",
        "Speed does not change the arithmetic: with the same seed, the kit in a real kernel with every default and "
        "flair's own launcher from a script give the same losses, scores, learning rates and weights, epoch by "
        "epoch.",
        table(["machine", "ranks", "job", "largest difference (losses, scores, learning rate)", "weights identical"],
              rows),
        r.caption(*names),
    ])


def tokenizing_section(r: Results) -> str:
    data = r("tokenizing-cpu.json")
    rows = []
    for run in data["runs"]:
        words = run["review_words"]
        rows.append([f"`{run['tokenizer']}`", number(run["docs"], 0), f"{words[0]}-{words[1]}",
                     each(run["cpu_s"]["tokenizer"], lambda v: number(v, 3)),
                     each(run["cpu_s"]["words"], lambda v: number(v, 3)),
                     f"**{run['words_vs_tokenizer_cpu']:.3f}**", "yes" if run["same_ids"] else "no"])
    return "\n\n".join([
        "## Inputs built once",
        "flair tokenizes every sentence at every batch of every epoch. The kit's ranks build each sentence's "
        "sub-token ids once, put together from its words' ids, and share them between ranks "
        "([precision and inputs built once](guide/precision-and-inputs.md)). CPU seconds to build the same "
        "reviews' ids both ways:",
        table(["tokenizer", "reviews", "words a review", "tokenizer, CPU s (rounds)", "from words' ids, CPU s",
               "from words / tokenizer (medians)", "same ids"], rows),
        r.caption("tokenizing-cpu.json"),
    ])


def at_a_glance(r: Results) -> str:
    rows = []
    for name in THROUGHPUT:
        kinds = grouped(r(name)["runs"])
        base = baseline(kinds)
        for label in ("kit fp32", "kit bf16", "kit"):
            if label in kinds:
                median = statistics.median(run["samples_per_s"] for run in kinds[label])
                rows.append([f"training throughput, {display(label)} / flair's script", r.short(name),
                             f"**{ratio(median / base)}**"])
    cold_warm = r("first-batch-h200.json")["cold_vs_warm"]
    rows.append(["first batch, warm pool / cold launch", r.short("first-batch-h200.json"),
                 f"**{seconds(cold_warm['warm_first_batch_s'])}** against {seconds(cold_warm['cold_first_batch_s'])}"])
    evaluation = r("eval-speedup-cpu.json")
    rows.append([f"evaluation shared out over {evaluation['processes']} ranks", r.short("eval-speedup-cpu.json"),
                 f"**{ratio(evaluation['eval_speedup'])}** faster"])
    cost = r("checkpoint-cost-h100.json")
    largest = max(epoch["cost"] for run in cost["runs"] for epoch in run["epochs"])
    rows.append(["a full checkpoint each epoch: the training's largest wait", r.short("checkpoint-cost-h100.json"),
                 f"**{percent(100 * largest)}** of its epoch"])
    return "\n\n".join([
        "## At a glance",
        "Each figure is taken from a section below, where its machine, software and command are named.",
        table(["what", "machine", "measured"], rows),
    ])


def performance_page(results: Path) -> tuple[str, dict[str, bytes]]:
    """The Performance page's Markdown and its images (``{"performance/throughput.svg": b"<svg..."}``), which the
    Markdown references by those paths relative to the page."""
    r = Results(results)
    images: dict[str, bytes] = {}
    sections = [
        "# Performance",
        "What flair_nbddp costs and saves, measured against flair's own multi-GPU launcher and against itself. "
        "Every number on this page is read from a result file in `benchmarks/results/` when the site is built, "
        "and every table names the machine, the software and the command that reproduce it. Ratios compare runs "
        "made on the same machine; the benchmarks' own documentation is `benchmarks/README.md` in the "
        "repository.",
        at_a_glance(r),
        throughput_section(r, images),
        first_batch_section(r, images),
        checkpoint_section(r),
        evaluation_section(r),
        shipping_section(r),
        big_corpus_section(r, images),
        restart_section(r),
        sweep_section(r),
        predict_section(r),
        bookkeeping_section(r),
        overhead_section(r),
        tokenizing_section(r),
        parity_section(r),
    ]
    return "\n\n".join(sections) + "\n", images


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder for performance.md and its images")
    parser.add_argument("--results", type=Path, default=RESULTS, help="the result files (benchmarks/results/)")
    args = parser.parse_args()
    page, images = performance_page(args.results)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / PAGE).write_text(page)
    for path, content in images.items():
        (args.out / path).parent.mkdir(parents=True, exist_ok=True)
        (args.out / path).write_bytes(content)
    print(f"wrote {args.out / PAGE} and {len(images)} images")


if __name__ == "__main__":
    main()

"""Parity on this machine's devices: flair's own launcher from a script against the kit in a kernel, same seed.

    python benchmarks/parity.py --device cuda --json results/gpu-parity.json   # one NCCL rank per GPU
    python benchmarks/parity.py --device cpu                                   # 2 gloo ranks, as the CI test

flair's side is ``tests/flair_own_launcher.py``: flair's ``launch_distributed`` as it is on GPUs (bent only to
gloo on CPU), each rank seeding and building its corpus. The kit's side is a notebook run by nbclient in a real
kernel: the corpus built in a cell, then ``launch(kit_train, ..., seed=42)`` with every default (device,
processes, dashboard, shared evaluation, lazy corpus). Both train the four jobs of ``tests/parity_jobs.py``
(an RNN ``TextClassifier`` with ``train``, the tiny transformer with ``fine_tune``, a BiLSTM-CRF ``SequenceTagger``,
a ``SequenceTagger`` fine-tuning the tiny transformer; 4 epochs each). Prints one JSON line: per kind, each
figure's largest difference (0.0 is bit for bit), whether the weights are identical, and the evaluation batches
each kit rank computed in shared-out evaluations.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent / "tests"

CELLS = [
    """
import json, sys
sys.path.insert(0, {tests!r})
import flair_nbddp
from parity_jobs import KINDS, SEED, build_corpus, kit_train
""",
    """
figures = {{}}
for kind in KINDS:
    corpus = build_corpus(kind)
    figures[kind] = flair_nbddp.launch(kit_train, args=(corpus, kind, {model!r}, {workdir!r} + "/kit/" + kind),
                                       seed=SEED, device={device!r}, processes={processes}).value
print("RESULT " + json.dumps(figures))
""",
]


def the_kits(device: str, model: str, workdir: str) -> dict:
    import nbformat
    from nbclient import NotebookClient

    processes = 2 if device == "cpu" else None
    fields = dict(tests=str(TESTS), model=model, workdir=workdir, device=device, processes=processes)
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c.format(**fields)) for c in CELLS])
    NotebookClient(notebook, timeout=3600, kernel_name="python3").execute()
    text = "".join(o.get("text", "") for o in notebook.cells[-1].outputs if o.output_type == "stream")
    return json.loads(text.split("RESULT ", 1)[1].splitlines()[0])


def largest_difference(flair: float | list, kit: float | list) -> float:
    pairs = zip(flair, kit, strict=True) if isinstance(flair, list) else [(flair, kit)]
    return max((abs(a - b) for a, b in pairs), default=0.0)


def compare(flair: dict, kit: dict) -> dict:
    figures = {}
    for kind, theirs in flair.items():
        ours = kit[kind]["figures"]
        figures[kind] = {
            **{name: largest_difference(value, ours[name]) for name, value in theirs.items() if name != "weights"},
            "weights_identical": theirs["weights"] == ours["weights"],
            "dev_scores": {"flair": theirs["dev/score"], "kit": ours["dev/score"]},
            "kit_batches_computed": kit[kind]["batches_computed"],
            "kit_corpus_lazy": kit[kind]["lazy"],
        }
    identical = all(
        entry["weights_identical"] and not any(value for value in entry.values() if isinstance(value, float))
        for entry in figures.values()
    )
    return {"bit_for_bit": identical, "kinds": figures}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from flair_nbddp.ledger.versions import versions
    from flair_nbddp.synthetic import tiny_transformer

    workdir = tempfile.mkdtemp(prefix="parity-")
    model = tiny_transformer(Path(workdir, "model"))
    sys.path.insert(0, str(TESTS))
    from flair_own_launcher import figures
    from parity_jobs import KINDS

    flair = figures(args.device, model, f"{workdir}/flair", list(KINDS))
    kit = the_kits(args.device, model, workdir)
    report = {"device": args.device, **compare(flair, kit), "versions": versions()}
    print(json.dumps(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

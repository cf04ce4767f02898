"""What the live dashboard costs training: samples/s with the dashboard on vs off, in a real kernel.

    python benchmarks/dashboard_cost.py --docs 1000 --epochs 2 --repeats 2

Runs one notebook (with nbclient) that builds a corpus once and then alternates launches with the
widget dashboard (``dashboard=None`` in a kernel) and without (``dashboard=False``). Prints one JSON
line with the median samples/s of each and ``dashboard_throughput_ratio`` (on / off).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path

CELLS = [
    """
import json, os
import flair_nbddp
from flair_nbddp.demo import train_classifier
from flair_nbddp.synthetic import sentiment_corpus, tiny_transformer
corpus = sentiment_corpus(n_train={docs}, n_dev=32, n_test=32, seed=0)
model = tiny_transformer({workdir!r} + "/model")
rates = {{"on": [], "off": []}}
""",
    """
for _ in range({repeats}):
    for mode, dashboard in (("on", None), ("off", False)):
        result = flair_nbddp.launch(train_classifier, args=(corpus, model, {workdir!r} + "/training"),
                                    kwargs={{"max_epochs": {epochs}, "return_model": False}}, dashboard=dashboard)
        rates[mode].append(result.samples_per_second)
print("RESULT " + json.dumps(rates))
""",
]


def measure(docs: int, epochs: int, repeats: int) -> dict:
    import nbformat
    from nbclient import NotebookClient

    workdir = tempfile.mkdtemp(prefix="dashboard-cost-")
    fields = dict(docs=docs, epochs=epochs, repeats=repeats, workdir=workdir)
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c.format(**fields)) for c in CELLS])
    NotebookClient(notebook, timeout=3600, kernel_name="python3").execute()
    text = "".join(o.get("text", "") for o in notebook.cells[-1].outputs if o.output_type == "stream")
    rates = json.loads(text.split("RESULT ", 1)[1].splitlines()[0])
    on, off = statistics.median(rates["on"]), statistics.median(rates["off"])
    return {
        "dashboard_on_samples_per_s": on,
        "dashboard_off_samples_per_s": off,
        "dashboard_throughput_ratio": on / off,
        "dashboard_runs": rates,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=int, default=1000)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    figures = measure(args.docs, args.epochs, args.repeats)
    print(json.dumps(figures))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()

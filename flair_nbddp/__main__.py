"""Command line: ``python -m flair_nbddp demo [--processes N] [--device cpu|cuda] [--epochs E] [--real]``."""

from __future__ import annotations

import argparse
import os
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flair_nbddp", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="train a text classifier on every device and print its test score")
    demo.add_argument("--processes", type=int, default=None, help="default: every GPU, else 2 CPU processes")
    demo.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda if available")
    demo.add_argument("--epochs", type=int, default=4)
    demo.add_argument("--documents", type=int, default=400, help="generated training documents")
    demo.add_argument("--real", action="store_true", help="IMDB + distilbert-base-uncased (downloads; online only)")
    options = parser.parse_args(argv)
    if not options.real:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from .demo import run_demo

    result = run_demo(options.processes, options.device, options.epochs, options.documents, options.real)
    return 0 if result.status == "finished" else 1


if __name__ == "__main__":
    sys.exit(main())

"""Shipping a flair corpus to a worker process: cloudpickle vs flair_nbddp's codec.

    python benchmarks/corpus_shipping.py                 # 50,000 IMDB-length reviews
    python benchmarks/corpus_shipping.py --docs 5000 --json shipping.json

For each method, a fresh "parent" process builds the generated sentiment corpus (200-260 words a
review) and packs it; a fresh "worker" process then reads the file and unpacks it. Measured:

* bytes: the size of what is shipped;
* pack_s: parent time to turn the corpus into bytes (for the codec, ``encode`` and the sha256 that
  flair_nbddp's payload sends along);
* pack_extra_mb: the parent's peak resident memory while packing minus its resident memory before.
  The peak is the kernel's high-water mark (VmHWM), reset just before packing through
  ``/proc/self/clear_refs`` so that building the corpus does not hide it; where that reset is not
  allowed, ``ru_maxrss`` is used and the figure is a lower bound (``peak_source`` says which);
* unpack_s: worker time to read the file and rebuild the corpus, flair already imported;
  verify_s: for the codec, the check each flair_nbddp worker makes: the sha256 of the bytes it read;
  gc_after_s: a full garbage collection right after, the cost the rebuilt objects add to the
  collector (the codec pauses the collector while it decodes, cloudpickle does not);
* worker_peak_mb: the worker's peak resident memory (``ru_maxrss``).

Ratios are cloudpickle's figure divided by the codec's, so above 1 means the codec does better.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

METHODS = ("cloudpickle", "codec")
REPO = Path(__file__).resolve().parent.parent
MB = 1024 * 1024


def build_corpus(docs: int):
    """``docs`` training reviews of 200-260 words, and dev/test splits of 1% each."""
    from flair_nbddp.synthetic import sentiment_corpus

    small = max(1, docs // 100)
    return sentiment_corpus(n_train=docs, n_dev=small, n_test=small, words=(200, 260), seed=0)


def pack(method: str, corpus) -> tuple[bytes, str]:
    """The bytes a parent ships, and their sha256 where the method sends one."""
    if method == "cloudpickle":
        import cloudpickle

        return cloudpickle.dumps(corpus, protocol=5), ""
    from flair_nbddp.wire import codec

    data = codec.encode(corpus)
    return data, hashlib.sha256(data).hexdigest()


def unpack(method: str, data: bytes):
    if method == "cloudpickle":
        import cloudpickle

        return cloudpickle.loads(data)
    from flair_nbddp.wire import codec

    return codec.decode(data)


def memory_mb(field: str) -> float:
    """A memory figure of this process from /proc/self/status (VmRSS, VmHWM), in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"{field} is not in /proc/self/status")


def reset_peak_memory() -> str:
    """Reset the kernel's high-water mark of resident memory; returns where the peak will be read from."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return "VmHWM"
    except OSError:
        return "ru_maxrss"


def peak_memory_mb(source: str) -> float:
    if source == "VmHWM":
        return memory_mb("VmHWM")
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def run_parent(method: str, docs: int, path: Path) -> dict:
    """Build the corpus, then time and measure packing it; write what is shipped to ``path``."""
    started = time.perf_counter()
    corpus = build_corpus(docs)
    build_s = time.perf_counter() - started
    gc.collect()
    rss_before = memory_mb("VmRSS")
    source = reset_peak_memory()
    started = time.perf_counter()
    data, digest = pack(method, corpus)
    pack_s = time.perf_counter() - started
    peak = peak_memory_mb(source)
    path.write_bytes(data)
    return {
        "tokens": sum(len(sentence) for split in (corpus.train, corpus.dev, corpus.test) for sentence in split),
        "build_s": build_s,
        "bytes": len(data),
        "sha256": digest,
        "pack_s": pack_s,
        "rss_before_pack_mb": rss_before,
        "peak_rss_pack_mb": peak,
        "pack_extra_mb": max(0.0, peak - rss_before),
        "peak_source": source,
    }


def run_worker(method: str, docs: int, path: Path, digest: str) -> dict:
    """Read and rebuild the corpus as a fresh worker would, then check it."""
    started = time.perf_counter()
    import flair.datasets  # noqa: F401 - a worker has flair imported before the payload arrives

    from flair_nbddp.wire import codec  # noqa: F401 - and the codec

    import_s = time.perf_counter() - started
    started = time.perf_counter()
    data = path.read_bytes()
    corpus = unpack(method, data)
    unpack_s = time.perf_counter() - started
    started = time.perf_counter()
    verified = hashlib.sha256(data).hexdigest() == digest if digest else None
    verify_s = time.perf_counter() - started if digest else 0.0
    started = time.perf_counter()
    gc.collect()
    gc_after_s = time.perf_counter() - started
    if len(corpus.train) != docs:
        raise RuntimeError(f"{method} rebuilt {len(corpus.train)} training documents, not {docs}")
    return {
        "import_s": import_s,
        "unpack_s": unpack_s,
        "verify_s": verify_s,
        "verified": verified,
        "gc_after_s": gc_after_s,
        "worker_peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def in_subprocess(role: str, method: str, docs: int, path: Path, digest: str = "") -> dict:
    """Run one role of this script in a fresh interpreter and return the JSON it prints last."""
    command = [sys.executable, __file__, "--role", role, "--method", method, "--docs", str(docs), "--path", str(path)]
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(command + ["--digest", digest], capture_output=True, text=True, env=environment)
    if done.returncode != 0:
        raise RuntimeError(f"the {role} process for {method} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(docs: int) -> dict:
    results = {}
    with tempfile.TemporaryDirectory(prefix="corpus-shipping-") as tmp:
        for method in METHODS:
            path = Path(tmp) / f"{method}.bin"
            print(f"{method}: building {docs} documents and packing them...", file=sys.stderr, flush=True)
            parent = in_subprocess("parent", method, docs, path)
            print(f"{method}: unpacking in a fresh worker...", file=sys.stderr, flush=True)
            worker = in_subprocess("worker", method, docs, path, parent.pop("sha256"))
            results[method] = parent | worker
            path.unlink()
    cloud, codec = results["cloudpickle"], results["codec"]
    ratios = {
        "pack_speedup_vs_cloudpickle": cloud["pack_s"] / codec["pack_s"],
        "size_ratio_vs_cloudpickle": cloud["bytes"] / codec["bytes"],
        "unpack_speedup_vs_cloudpickle": cloud["unpack_s"] / codec["unpack_s"],
        "unpack_and_verify_speedup_vs_cloudpickle": cloud["unpack_s"] / (codec["unpack_s"] + codec["verify_s"]),
        "parent_peak_memory_ratio": cloud["pack_extra_mb"] / max(codec["pack_extra_mb"], 1.0),
        "worker_peak_memory_ratio": cloud["worker_peak_mb"] / codec["worker_peak_mb"],
    }
    return {
        "docs": docs,
        "tokens": codec["tokens"],
        "methods": results,
        "ratios": ratios,
        "ratios_note": "cloudpickle's figure / the codec's: above 1 means the codec does better",
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "platform": platform.platform()},
    }


def print_report(report: dict) -> None:
    columns = [
        ("bytes", "MB", lambda r: r["bytes"] / MB),
        ("pack_s", "pack s", lambda r: r["pack_s"]),
        ("pack_extra_mb", "pack +MB", lambda r: r["pack_extra_mb"]),
        ("unpack_s", "unpack s", lambda r: r["unpack_s"]),
        ("verify_s", "verify s", lambda r: r["verify_s"]),
        ("gc_after_s", "gc after s", lambda r: r["gc_after_s"]),
        ("worker_peak_mb", "worker MB", lambda r: r["worker_peak_mb"]),
    ]
    print(f"{report['docs']} documents, {report['tokens']} tokens")
    print(f"{'method':<12}" + "".join(f"{title:>12}" for _, title, _ in columns))
    for method, row in report["methods"].items():
        print(f"{method:<12}" + "".join(f"{value(row):>12.2f}" for _, _, value in columns))
    for name, value in report["ratios"].items():
        print(f"{name}: {value:.1f}")
    print(f"({report['ratios_note']})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=50_000, help="training documents (default 50000)")
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    parser.add_argument("--role", choices=("parent", "worker"), help=argparse.SUPPRESS)
    parser.add_argument("--method", choices=METHODS, help=argparse.SUPPRESS)
    parser.add_argument("--path", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--digest", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "parent":
        print(json.dumps(run_parent(args.method, args.docs, args.path)))
    elif args.role == "worker":
        print(json.dumps(run_worker(args.method, args.docs, args.path, args.digest)))
    else:
        report = measure(args.docs)
        print_report(report)
        if args.json:
            args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()

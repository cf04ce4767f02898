"""The same ranks through a Dask cluster and through this machine's launcher, in one run.

    python benchmarks/cluster.py --quick --json cluster.json                     # 2 CPU ranks, tiny model
    python benchmarks/cluster.py --device cuda --processes 1 --size distilbert --json gpu-cluster.json

A ``LocalCluster`` on 127.0.0.1 with one Dask worker per rank (declaring the cores a local rank gets; with
``resources={"GPU": 1}`` on CUDA) stands for the cluster: the kit's path through it is a remote cluster's (placement, files stored per
node, every event and log line through the scheduler), only the wire is short. Measured:

* throughput: samples/s of the same fine-tuning job on a warm ``WorkerPool(cluster=client)`` and on a warm
  local ``WorkerPool``, the same number of ranks on the same devices, interleaved rounds; the ratio
  ``cluster_vs_local_throughput`` (target >= 0.95) is the cluster's median over the local one's;
* time to the first batch: a cold ``launch(..., cluster=client)`` (ranks started for the run, the corpus
  shipped) against a warm cluster pool (the corpus put on it once), and a cold local launch for reference;
* shipping: a trivial job whose argument is a corpus of 1,000 to 20,000 reviews (50,000 without ``--quick``),
  on a warm pool of each kind: the seconds from the launch call to its end, the packed payload's size, and
  what the cluster adds per MB.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from big_corpus import (  # this script's folder is on sys.path: it runs as a script
    build,
    train_briefly,
)


@contextlib.contextmanager
def restored(environment: dict[str, str]) -> Iterator[None]:
    """This process's environment as it was before Dask's nanny set its workers' variables in it
    (``MALLOC_TRIM_THRESHOLD_``, one BLAS thread): the local pool's workers must not inherit them."""
    os.environ.clear()
    os.environ.update(environment)
    yield


def nothing(corpus) -> int:
    return len(corpus.train)


def throughput(model, labels, ref_of, pools, batches, repeats, workdir) -> dict:
    """Interleaved rounds on the two warm pools (each with the corpus put once); every other round reversed."""
    rates: dict[str, list[float]] = {name: [] for name in pools}
    job = dict(kwargs={"batches": batches, "batch_size": 16}, dashboard=False)
    for name, pool in pools.items():  # warm-up: each pool's ranks read the corpus and build the model once
        pool.launch(train_briefly, (ref_of[name], model, labels, str(workdir / name)), **{**job, "kwargs": {
            "batches": 2, "batch_size": 16}})  # fmt: skip
    for round_ in range(repeats):
        for name in list(pools)[:: -1 if round_ % 2 else 1]:
            result = pools[name].launch(train_briefly, (ref_of[name], model, labels, str(workdir / name)), **job)
            rates[name].append(result.samples_per_second)
    return {
        "cluster_samples_per_s": rates["cluster"], "local_samples_per_s": rates["local"],
        "cluster_vs_local_throughput": statistics.median(rates["cluster"]) / statistics.median(rates["local"]),
        "throughput_batches": batches, "throughput_rounds": repeats,
    }  # fmt: skip


def first_batch(client, device, processes, corpus, model, labels, pools, ref_of, workdir, repeats) -> dict:
    from flair_nbddp import launch

    times: dict[str, list[float]] = {"cluster_cold": [], "cluster_warm": [], "local_cold": []}
    job = dict(kwargs={"batches": 3, "batch_size": 16}, dashboard=False)
    for _ in range(repeats):
        args = (corpus, model, labels, str(workdir / "cold"))
        times["cluster_cold"].append(
            launch(train_briefly, args, cluster=client, device=device, processes=processes, **job).time_to_first_batch
        )
        times["local_cold"].append(
            launch(train_briefly, args, device=device, processes=processes, **job).time_to_first_batch
        )
        warm = pools["cluster"].launch(train_briefly, (ref_of["cluster"], model, labels, str(workdir / "warm")), **job)
        times["cluster_warm"].append(warm.time_to_first_batch)
    figures = {f"{name}_first_batch_s": statistics.median(runs) for name, runs in times.items()}
    figures["cluster_warm_vs_cold_first_batch"] = figures["cluster_warm_first_batch_s"] / figures[
        "cluster_cold_first_batch_s"]  # fmt: skip
    return figures | {f"{name}_first_batch_runs_s": runs for name, runs in times.items()}


def shipping(pools, sizes: list[int]) -> dict:
    """Seconds from the launch call to the end of a trivial job that takes a corpus of each size as its argument
    (packed anew for each job), on each warm pool; and the packed corpus's size (the codec's, which the payload
    holds)."""
    from flair_nbddp.wire.codec import encode

    for pool in pools.values():  # warm: a pool's first job would also pay for starting its workers
        assert pool.launch(nothing, (build(10),), dashboard=False).value == 10
    rows = []
    for docs in sizes:
        corpus = build(docs)
        row: dict = {"docs": docs, "packed_mb": len(encode(corpus)) / 1e6}
        for name, pool in pools.items():
            began = time.perf_counter()
            assert pool.launch(nothing, (corpus,), dashboard=False).value == docs
            row[f"{name}_s"] = time.perf_counter() - began
        rows.append(row)
    first, last = rows[0], rows[-1]
    added = (last["cluster_s"] - last["local_s"]) - (first["cluster_s"] - first["local_s"])
    return {"shipping": rows, "cluster_added_s_per_mb": added / (last["packed_mb"] - first["packed_mb"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--size", choices=["tiny", "distilbert"], default="tiny")
    parser.add_argument("--quick", action="store_true", help="smaller corpora and fewer rounds (a 2-core CPU machine)")
    parser.add_argument("--parts", default="throughput,first_batch,shipping", help="which measurements, in order")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    parts = args.parts.split(",")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from distributed import LocalCluster

    from flair_nbddp import WorkerPool
    from flair_nbddp.synthetic import tiny_transformer

    workdir = Path(tempfile.mkdtemp())
    model = str(tiny_transformer(workdir / f"model-{args.size}", size=args.size))
    docs, batches, repeats = (2000, 40, 5) if args.quick else (8000, 150, 5)
    corpus = build(docs)
    labels = corpus.make_label_dictionary("sentiment", add_unk=False)
    resources = {"GPU": 1} if args.device == "cuda" else None
    environment = dict(os.environ)
    # each Dask worker declares the cores a local rank would get: a CPU rank runs that many BLAS threads
    threads = max(1, (os.cpu_count() or 1) // args.processes)
    with LocalCluster(
        n_workers=args.processes, threads_per_worker=threads, host="127.0.0.1", dashboard_address=None,
        resources=resources,
    ) as cluster, restored(environment), cluster.get_client() as client, WorkerPool(
        cluster=client, device=args.device, processes=args.processes
    ) as on_cluster, WorkerPool(args.processes, args.device) as local:  # fmt: skip
        pools = {"cluster": on_cluster, "local": local}
        ref_of = {name: pool.put(corpus) for name, pool in pools.items()}
        figures: dict = {"device": args.device, "processes": args.processes, "size": args.size, "docs": docs,
                         "placement": on_cluster.status(), "backend": on_cluster.plan.backend}  # fmt: skip

        def save() -> None:  # after each part: a run cut short keeps what it measured
            if args.json:
                Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")

        if "throughput" in parts:
            figures |= throughput(model, labels, ref_of, pools, batches, repeats, workdir)
            save()
        if "first_batch" in parts:
            figures |= first_batch(client, args.device, args.processes, corpus, model, labels, pools, ref_of, workdir,
                                   2 if args.quick else 3)  # fmt: skip
            save()
        if "shipping" in parts:
            figures |= shipping(pools, [1000, 5000, 20000] if args.quick else [1000, 10000, 50000])
            save()
    print(json.dumps(figures))


if __name__ == "__main__":
    main()

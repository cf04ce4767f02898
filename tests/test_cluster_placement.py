"""Where ranks go on a Dask cluster, and what reaches each node, without a cluster: a client that answers as
one would (the cluster tier runs the real thing, test_cluster.py)."""

import hashlib
import stat
import time
from multiprocessing import Pipe
from pathlib import Path
from types import SimpleNamespace

import pytest

from flair_nbddp import ClusterError, ConfigurationError, WorkerPool, launch
from flair_nbddp.cluster.client import connect, place
from flair_nbddp.cluster.rank_host import _check_file, rank_environment, store_file
from flair_nbddp.cluster.ranks import ClusterGroup
from flair_nbddp.engine.rundir import RunDir


@pytest.fixture(autouse=True)
def _automatic_devices(monkeypatch):
    """The test tiers' FLAIR_NBDDP_DEVICE=cpu / FLAIR_NBDDP_PROCESSES=2 would pick for place(): these tests pick."""
    monkeypatch.delenv("FLAIR_NBDDP_DEVICE", raising=False)
    monkeypatch.delenv("FLAIR_NBDDP_PROCESSES", raising=False)


def _probe(hostname: str, gpus: int = 0, visible: str = "", runs: str = "/tmp/runs") -> dict:
    return {"hostname": hostname, "node": f"{hostname}/boot/{runs}", "gpus": gpus, "visible": visible}


class FakeFuture(SimpleNamespace):
    """A ``distributed.Future`` whose task finished."""

    released = False

    def done(self):
        return True

    def release(self):
        self.released = True


class FakeClient:
    """What place() and the group's file shipping ask of a ``distributed.Client``."""

    status = "running"

    def __init__(self, workers: dict[str, tuple[dict, dict]], run_error: Exception | None = None) -> None:
        self.workers, self.run_error = workers, run_error
        self.scheduler = SimpleNamespace(address="tcp://10.0.0.1:8786", identity=self._identity)
        self.scattered: list[tuple[int, tuple[str, ...]]] = []
        self.submitted: list[tuple[str, tuple]] = []
        self.futures: list[FakeFuture] = []  # every one scatter and submit made
        self.cancelled: list[FakeFuture] = []

    def _identity(self, n_workers: int = 0) -> dict:
        return {"workers": {address: info for address, (info, _) in self.workers.items()} if n_workers else {}}

    def sync(self, function, *args, **kwargs):
        return function(*args, **kwargs)

    def run(self, function):
        if self.run_error is not None:
            raise self.run_error
        return {address: probe for address, (_, probe) in self.workers.items()}

    def scatter(self, data, workers=(), hash=True):
        self.scattered.append((len(data), tuple(workers)))
        self.futures.append(FakeFuture(data=data))
        return self.futures[-1]

    def submit(self, function, *args, workers=(), **kwargs):
        self.submitted.append((function.__name__, tuple(workers)))
        self.futures.append(FakeFuture(args=args))
        return self.futures[-1]

    def gather(self, futures):
        return [None for _ in futures]

    def cancel(self, futures):
        self.cancelled.extend(futures)


def _gpu_cluster() -> FakeClient:
    """Two GPU nodes of two workers each (one GPU per worker, as dask-cuda starts them), and a CPU-only worker."""
    workers = {}
    for node in ("gpu-a", "gpu-b"):
        for index in range(2):
            workers[f"tcp://{node}:{4000 + index}"] = ({"resources": {"GPU": 1}}, _probe(node, 1, str(index)))
    workers["tcp://cpu-c:4000"] = ({"resources": {}}, _probe("cpu-c"))
    return FakeClient(workers)


def test_ranks_go_one_per_gpu_worker_node_by_node_with_nccl():
    placement = place(_gpu_cluster())
    assert (placement.plan.device_type, placement.plan.world_size, placement.plan.backend) == ("cuda", 4, "nccl")
    assert [site.worker for site in placement.sites] == [
        "tcp://gpu-a:4000", "tcp://gpu-a:4001", "tcp://gpu-b:4000", "tcp://gpu-b:4001"
    ]  # fmt: skip
    # each worker sees its own GPU as cuda:0; ranks of one node count 0, 1 there; rank 0's store binds its host
    assert [site.device for site in placement.sites] == ["cuda:0"] * 4
    assert [(site.local_rank, site.local_world_size) for site in placement.sites] == [(0, 2), (1, 2)] * 2
    assert placement.sites[0].host == "gpu-a"
    assert str(placement) == "4 × cuda (nccl) on 4 Dask workers of 2 nodes"


def test_workers_that_share_a_nodes_gpus_take_one_each_and_more_than_there_are_is_an_error():
    shared = {f"tcp://box:{port}": ({"resources": {}}, _probe("box", 2, "")) for port in (1, 2)}
    assert [site.device for site in place(FakeClient(shared)).sites] == ["cuda:0", "cuda:1"]
    shared["tcp://box:3"] = ({"resources": {}}, _probe("box", 2, ""))
    with pytest.raises(ClusterError, match="3 Dask workers on box see the same 2 GPU"):
        place(FakeClient(shared))


def test_cpu_workers_run_gloo_and_processes_picks_how_many():
    client = _gpu_cluster()
    placement = place(client, processes=2, device="cpu")
    assert (placement.plan.device_type, placement.plan.backend) == ("cpu", "gloo")
    assert [site.worker for site in placement.sites] == ["tcp://cpu-c:4000", "tcp://gpu-a:4000"]
    assert [site.device for site in placement.sites] == ["cpu", "cpu"]


def test_too_few_workers_is_an_error_naming_what_the_cluster_has():
    with pytest.raises(ClusterError) as caught:
        place(_gpu_cluster(), processes=8)
    message = str(caught.value)
    assert message.startswith("8 rank(s) on cuda need as many Dask workers with a GPU, and the cluster has 4:")
    assert "tcp://cpu-c:4000 (cpu-c, 0 GPU)" in message and "Scale the cluster" in message
    with pytest.raises(ClusterError, match="has no workers yet: scale it"):
        place(FakeClient({}))


def test_workers_without_the_kit_and_impossible_requests_are_clear_errors():
    broken = FakeClient({"tcp://a:1": ({}, _probe("a"))}, run_error=ModuleNotFoundError("No module named 'flair_nbddp'"))
    with pytest.raises(ClusterError, match="could not run flair_nbddp .*No module named 'flair_nbddp'.*install"):
        place(broken)
    with pytest.raises(ConfigurationError, match="device='tpu' is not understood"):
        place(_gpu_cluster(), device="tpu")
    with pytest.raises(ConfigurationError, match="at least one rank"):
        place(_gpu_cluster(), processes=0)


def test_cluster_takes_a_client_a_cluster_object_or_an_address(monkeypatch):
    client = _gpu_cluster()
    assert connect(client) is client
    assert connect(SimpleNamespace(get_client=lambda: client, scheduler_address="tcp://10.0.0.1:8786")) is client
    client.status = "closed"
    with pytest.raises(ClusterError, match="the Dask client given as cluster= is closed: make a new one"):
        connect(client)
    monkeypatch.setattr("flair_nbddp.cluster.client.CONNECT_TIMEOUT_SECONDS", 1)
    with pytest.raises(ClusterError, match=r"no Dask scheduler answers at 'tcp://127.0.0.1:9'.*dask scheduler"):
        connect("tcp://127.0.0.1:9")


def test_cluster_conflicts_with_gpus_and_with_a_pool_before_anything_starts():
    with pytest.raises(ConfigurationError, match="gpus= picks GPUs of this machine"):
        launch(print, cluster=_gpu_cluster(), gpus=[0], dashboard=False)
    with pytest.raises(ConfigurationError, match="share_gpus=True rehearses several ranks on this machine's GPUs"):
        launch(print, cluster=_gpu_cluster(), share_gpus=True, dashboard=False)
    with WorkerPool(2, "cpu") as pool:
        with pytest.raises(ConfigurationError, match="pool= and cluster= both say where to run"):
            launch(print, pool=pool, cluster=_gpu_cluster(), dashboard=False)


def test_a_payload_goes_once_to_each_node_not_to_each_rank(tmp_path):
    client = _gpu_cluster()
    group = ClusterGroup(client, place(client), RunDir.create(tmp_path / "run"))
    payload = tmp_path / "payload.pkl"
    payload.write_bytes(b"x" * 1000)
    name, digest = group._store(payload, "payload-k.pkl")
    assert (name, digest) == ("payload-k.pkl", hashlib.sha256(b"x" * 1000).hexdigest())
    assert client.scattered == [(1000, ("tcp://gpu-a:4000",)), (1000, ("tcp://gpu-b:4000",))]
    assert client.submitted == [("store_file", ("tcp://gpu-a:4000",)), ("store_file", ("tcp://gpu-b:4000",))]
    # finished, each is released, not cancelled (a cancel goes to every client: cluster/ranks.py, let_go)
    assert all(future.released for future in client.futures) and not client.cancelled


def test_a_rank_is_lost_with_its_dask_worker_or_its_silence_while_the_notebook_listens(tmp_path):
    client = _gpu_cluster()
    group = ClusterGroup(client, place(client), RunDir.create(tmp_path / "run"))
    group._tasks = [SimpleNamespace(status="pending") for _ in group.placement.sites]
    group.connections, group._feeds = map(list, zip(*(Pipe() for _ in group.placement.sites)))
    # membership is asked of the scheduler: the client's own refresh leaves its shared copy without workers,
    # and a check that read it counted every idle rank of a warm pool as lost
    group._check_ranks(silence=True)
    assert group.dead_ranks() == {}
    # the notebook held the relay up for 25 s (a garbage collection of a big corpus): nobody was silent
    began = time.monotonic()
    group._heard = [began] * group.plan.world_size
    group._listening(began)
    group._listening(began + 25.0)
    group._check_ranks(silence=True)
    assert group.dead_ranks() == {}
    # a worker that left loses its rank at once; a task silent for 20 s while the relay listened loses its own
    del client.workers["tcp://gpu-b:4001"]
    group._heard[2] = time.monotonic() - 21.0
    group._check_ranks(silence=True)
    assert group.dead_ranks() == {2: -9, 3: -9}
    assert "left the cluster" in group.describe_exit(3, -9) and "stopped answering for 20 s" in group.describe_exit(2, -9)
    for connection in group.connections + group._feeds:
        connection.close()


def test_a_stored_file_is_private_and_checked_against_the_notebooks_hash(tmp_path, monkeypatch):
    monkeypatch.setenv("FLAIR_NBDDP_RUNS", str(tmp_path))
    data = b"the packed corpus"
    path = Path(store_file("g1", "payload-k.pkl", data, hashlib.sha256(data).hexdigest()))
    assert path.read_bytes() == data and stat.S_IMODE(path.stat().st_mode) == 0o600
    _check_file(path, hashlib.sha256(data).hexdigest())
    path.write_bytes(b"the packed corpuS")
    with pytest.raises(ClusterError, match="differs from the file packed in the notebook"):
        _check_file(path, hashlib.sha256(data).hexdigest())
    with pytest.raises(ClusterError, match="arrived damaged"):
        store_file("g1", "payload-j.pkl", data, "0" * 64)
    with pytest.raises(ClusterError, match="is not on .*: it was not stored there"):
        _check_file(path.with_name("missing.pkl"), "0" * 64)


def test_a_ranks_process_group_stays_on_its_dask_workers_interface(monkeypatch):
    from flair_nbddp.cluster.rank_host import Site

    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        monkeypatch.delenv(name, raising=False)
    # what Dask's nanny sets in its worker processes: the rank is a training process, not a Dask task thread
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "65536")
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "1")
    site = Site(1, "tcp://127.0.0.1:4000", "box", "127.0.0.1", "box/b/r", "cpu", 1, 2)
    env = rank_environment(site, 2, ("127.0.0.1", 29500), threads=4)
    assert env["GLOO_SOCKET_IFNAME"] == env["NCCL_SOCKET_IFNAME"] == "lo"
    assert (env["MASTER_ADDR"], env["MASTER_PORT"], env["RANK"], env["LOCAL_RANK"]) == ("127.0.0.1", "29500", "1", "1")
    assert env["MALLOC_TRIM_THRESHOLD_"] is None and env["OPENBLAS_NUM_THREADS"] is None  # unset for the rank
    assert env["OMP_NUM_THREADS"] == "4"  # the cores its Dask worker was given
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "0")  # the cluster's own choice stays
    assert "MALLOC_TRIM_THRESHOLD_" not in rank_environment(site, 2, ("127.0.0.1", 29500), threads=4)


def test_a_rank_host_waiting_for_its_fork_server_goes_on_and_sends_the_pid_once_the_rank_is_forked():
    import pickle
    import threading

    from flair_nbddp.cluster.rank_host import Site, _RankHost
    from flair_nbddp.engine.pending_worker import PendingWorker

    ready = threading.Event()
    server = SimpleNamespace(ready=True, wait_ready=lambda timeout: ready.wait(timeout))  # still importing
    forked = SimpleNamespace(pid=4242)
    pending = PendingWorker(server, fork=lambda: forked, fresh=lambda: None, note=print, release=lambda: None)
    sent = []
    host = object.__new__(_RankHost)  # the relay's state, without a Dask worker around it
    host.site = Site(1, "tcp://127.0.0.1:4000", "box", "127.0.0.1", "box/b/r", "cpu", 1, 2)
    host.up = SimpleNamespace(put=lambda data: sent.append(pickle.loads(data)))
    host.processes = [pending]
    host.lock, host.tails, host.pending, host.stacks, host.job_key = threading.Lock(), {}, [], None, None
    host.last_sent, host.pid_sent = 0.0, False
    asking = threading.Thread(target=lambda: sent.append(host._new_pid()), daemon=True)  # what start() sends
    asking.start()
    asking.join(timeout=10)
    assert not asking.is_alive() and sent == [None]  # answered at once: the relay is not held up meanwhile
    host.last_sent = time.monotonic()
    host._send(final=False)  # nothing new: nothing sent
    ready.set()
    assert pending.pid == 4242  # forked now
    host._send(final=False)
    host._send(final=False)
    assert [batch.pid for batch in sent[1:]] == [4242]  # sent once

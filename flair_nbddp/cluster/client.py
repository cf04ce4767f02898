"""Where a run's ranks go on a Dask cluster: the client, and one rank per Dask worker.

``cluster=`` takes a ``distributed.Client`` (a ``LocalCluster``'s, ``SLURMCluster(...).get_client()``, a
Gateway's, Coiled's; its ``Security``, TLS included, is used as given), a cluster object (its ``get_client()``)
or a scheduler address, for which one client per address is made and kept. :func:`place` asks every Dask
worker what it has (one ``client.run``) and puts one rank on each: on the workers with a GPU (a ``GPU``
resource, or CUDA devices the worker sees) with NCCL, else on CPU workers with gloo. Ranks of one node come
one after another; rank 0 is the first worker of the first node, and its store binds that worker's own address.

Example::

    from distributed import Client
    client = Client("tcp://scheduler:8786")
    placement = place(client, processes=2)
    str(placement)        # '2 × cuda (nccl) on 2 Dask workers of 2 nodes'
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

from ..engine.devices import DEVICE_TYPES, DevicePlan, env_device, env_processes
from ..errors import ClusterError, ConfigurationError, MissingDependencyError
from . import rank_host
from .rank_host import Site

CONNECT_TIMEOUT_SECONDS = 10
_CLIENTS: dict[str, Any] = {}  # the clients made for scheduler addresses, by address


def require_distributed() -> Any:
    """The ``distributed`` package, or a clear error naming the extra that brings it."""
    try:
        import distributed
    except ImportError:
        raise MissingDependencyError(
            "cluster= runs on Dask: install the cluster extra in the notebook's and the workers' environment "
            "(pip install 'flair_nbddp[cluster]', which brings distributed)"
        ) from None
    return distributed


def connect(cluster: Any) -> Any:
    """The ``distributed.Client`` for ``cluster``: the client itself, a cluster object's (``LocalCluster``,
    ``SLURMCluster``: its ``get_client()``), or one for a scheduler address (made once per address, then reused).

    Raises:
        ConfigurationError: ``cluster`` is neither a client nor an address.
        ClusterError: no scheduler answers at the address.
        MissingDependencyError: ``distributed`` is not installed.

    Example:
        >>> connect(42)
        Traceback (most recent call last):
        ...
        flair_nbddp.errors.ConfigurationError: cluster= takes a distributed.Client or a scheduler address such as 'tcp://scheduler:8786', not int
    """
    if not isinstance(cluster, str):
        if hasattr(cluster, "get_client") and hasattr(cluster, "scheduler_address"):  # LocalCluster, SLURMCluster...
            cluster = cluster.get_client()
        if hasattr(cluster, "submit") and hasattr(cluster, "sync"):  # a distributed.Client
            if cluster.status not in ("running", "connecting", "newly-created"):
                raise ClusterError(
                    f"the Dask client given as cluster= is {cluster.status}: make a new one (Client(address)) and pass it"
                )
            return cluster
        raise ConfigurationError(
            "cluster= takes a distributed.Client or a scheduler address such as 'tcp://scheduler:8786', not "
            f"{type(cluster).__name__}"
        )
    distributed = require_distributed()
    address = cluster.strip()
    client = _CLIENTS.get(address)
    if client is not None and client.status == "running":
        return client
    try:
        client = distributed.Client(address, timeout=CONNECT_TIMEOUT_SECONDS, set_as_default=False)
    except (OSError, TimeoutError, ValueError) as error:
        raise ClusterError(
            f"no Dask scheduler answers at {address!r} ({type(error).__name__}: {error}). Check the address (the "
            "scheduler prints it: 'Scheduler at: tcp://...'), start one (dask scheduler), or pass a Client; for TLS "
            "pass Client(address, security=Security(...))"
        ) from None
    _CLIENTS[address] = client
    return client


@dataclass(frozen=True)
class Placement:
    """A run's ranks on a cluster: the plan (device type, world size, backend) and where each rank runs."""

    plan: DevicePlan
    sites: tuple[Site, ...]

    @property
    def nodes(self) -> tuple[str, ...]:
        """The machines, each once, in rank order."""
        return tuple(dict.fromkeys(site.node for site in self.sites))

    def describe(self) -> str:
        """``on 2 Dask workers of 1 node``."""
        workers, nodes = len(self.sites), len(self.nodes)
        return f"on {workers} Dask worker{'s' * (workers != 1)} of {nodes} node{'s' * (nodes != 1)}"

    def __str__(self) -> str:
        return f"{self.plan} {self.describe()}"


def workers_of(client: Any) -> dict[str, dict]:
    """The cluster's Dask workers now, by address, each with what the scheduler knows of it (its host, its
    resources), asked of the scheduler itself.

    Not ``client.scheduler_info()``: that returns the client's shared copy of the scheduler's identity, which
    the client's own refresh every few seconds overwrites with one that lists no worker, so a worker list read
    from it can come back empty while every worker is there.
    """
    return client.sync(client.scheduler.identity, n_workers=-1)["workers"]


def departed(client: Any, addresses: Collection[str]) -> list[str]:
    """Which of these Dask workers (their addresses) are no longer in ``client``'s cluster, sorted."""
    return sorted(set(addresses) - set(workers_of(client)))


def _gpus(info: dict, probe: dict) -> int:
    return int(info.get("resources", {}).get("GPU", 0) or 0) or int(probe.get("gpus", 0))


def place(
    client: Any, processes: int | None = None, device: str | None = None, held: Collection[str] = frozenset()
) -> Placement:
    """One rank per Dask worker of ``client``'s cluster: ``processes`` of them (default all that fit ``device``),
    leaving out the workers other runs of this kernel hold (``held``, their addresses: runs side by side).

    ``device`` ``"cuda"`` takes the workers with a GPU (NCCL), ``"cpu"`` any worker (gloo); None takes the GPU
    workers if there are any. ``$FLAIR_NBDDP_DEVICE`` and ``$FLAIR_NBDDP_PROCESSES`` apply as on one machine.

    Raises:
        ClusterError: the cluster has no (or too few) such workers, or they cannot run the kit; the message
            lists what it has.
        DeviceError: a device other than cpu/cuda, or a process count below 1.
    """
    from distributed.comm import get_address_host

    device = device if device is not None else env_device()
    processes = processes if processes is not None else env_processes()
    if device is not None and device not in DEVICE_TYPES:
        raise ConfigurationError(f"device={device!r} is not understood: use 'cuda', 'cpu', or None (automatic)")
    if processes is not None and (isinstance(processes, bool) or int(processes) < 1):
        raise ConfigurationError(f"processes={processes!r}: ask for at least one rank, or None for every worker")
    workers = workers_of(client)
    if not workers:
        raise ClusterError(
            f"the Dask cluster at {client.scheduler.address} has no workers yet: scale it (cluster.scale(2), "
            "SLURMCluster(...).scale(jobs=2)) or wait for them (client.wait_for_workers(2)), then launch again"
        )
    try:
        probes = client.run(rank_host.probe)
    except Exception as error:  # noqa: BLE001 - whatever the workers lack, it is said the same way
        raise ClusterError(
            f"the Dask workers could not run flair_nbddp ({type(error).__name__}: {error}): install flair_nbddp, "
            "flair and torch in the workers' environment, the same versions as the notebook's"
        ) from None
    addresses = [address for address in workers if address in probes]
    with_gpu = [address for address in addresses if _gpus(workers[address], probes[address]) > 0]
    device = device or ("cuda" if with_gpu else "cpu")
    candidates = sorted(with_gpu if device == "cuda" else addresses, key=lambda a: (probes[a]["node"], a))
    taken = [address for address in candidates if address in held]
    candidates = [address for address in candidates if address not in held]
    wanted = int(processes) if processes is not None else len(candidates)
    if not candidates or wanted > len(candidates):
        kind = " with a GPU" if device == "cuda" else ""
        have = ", ".join(
            f"{address} ({probes[address]['hostname']}, {_gpus(workers[address], probes[address])} GPU)"
            for address in addresses
        )
        raise ClusterError(
            f"{wanted or 1} rank(s) on {device} need as many Dask workers{kind}, and the cluster has "
            f"{len(candidates)}{f' free ({len(taken)} held by other runs of this kernel)' if taken else ''}: {have}. "
            "Scale the cluster, ask for fewer processes"
            + (", or run on CPU (device='cpu')" if device == "cuda" else "")
        )
    return Placement(DevicePlan(device, wanted, "nccl" if device == "cuda" else "gloo"), _sites(
        candidates[:wanted], workers, probes, device, get_address_host))  # fmt: skip


def _sites(chosen: Sequence[str], workers: dict, probes: dict, device: str, host_of: Any) -> tuple[Site, ...]:
    """Each chosen worker's site: its node, its place there, and its GPU (the k-th rank of a node on workers
    that see the same GPUs takes the k-th of them)."""
    per_node: dict[str, list[str]] = {}
    for address in chosen:
        per_node.setdefault(probes[address]["node"], []).append(address)
    sites = []
    for rank, address in enumerate(chosen):
        probe, node = probes[address], probes[address]["node"]
        peers = per_node[node]
        index = 0
        if device == "cuda":
            sharing = [peer for peer in peers if probes[peer]["visible"] == probe["visible"]]
            index = sharing.index(address)
            if index >= max(1, probe["gpus"]):
                raise ClusterError(
                    f"{len(sharing)} Dask workers on {probe['hostname']} see the same {probe['gpus']} GPU(s) "
                    f"(CUDA_VISIBLE_DEVICES={probe['visible'] or 'unset'}): start one worker per GPU (dask-cuda's "
                    "dask cuda worker does), or ask for fewer processes"
                )
        sites.append(Site(
            rank, address, probe["hostname"], host_of(address), node, f"cuda:{index}" if device == "cuda" else "cpu",
            peers.index(address), len(peers),
        ))  # fmt: skip
    return tuple(sites)

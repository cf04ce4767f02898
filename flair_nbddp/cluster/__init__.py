"""The Dask backend: a run's ranks on a Dask cluster (Slurm or PBS through dask-jobqueue, Kubernetes, Gateway).

``client`` connects to the cluster for ``cluster=`` and places one rank per Dask worker; ``ranks`` is the
:class:`~flair_nbddp.engine.worker_source.RankGroup` the notebook drives; ``rank_host`` is the Dask task that keeps one
rank's worker process on its Dask worker and relays its channel through Dask.

Imported only when ``cluster=`` is used (``distributed`` is an optional dependency); the docs' page on Dask
clusters (``docs/guide/dask.md``) shows each kind of cluster.
"""

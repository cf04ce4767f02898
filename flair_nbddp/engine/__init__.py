"""The run engine: what happens between a call in the notebook and its result, out of a user's sight.

A :class:`~flair_nbddp.engine.run.Run` packs the call, takes ranks from a worker source (this machine's processes,
a warm pool, or a Dask cluster), watches them with a supervisor and records the run in the ledger. Users reach it
through :func:`flair_nbddp.launch`, :func:`flair_nbddp.start` and :class:`flair_nbddp.WorkerPool`; nothing here needs
importing by hand.
"""

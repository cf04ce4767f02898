"""The run ledger: every run's call, options, versions, metrics and outcome, in one SQLite file per user.

``store`` reads and writes the file (:class:`~flair_nbddp.ledger.store.RunRecord`, ``history()``);
``provenance`` describes a call as the ledger keeps it (corpora by size and hash, secrets masked);
``versions`` names what a run depends on; ``tensorboard_export`` writes runs as TensorBoard files. A running
run is recorded by :mod:`flair_nbddp.engine.recorder`.
"""

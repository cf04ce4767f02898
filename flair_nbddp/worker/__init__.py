"""The code that runs inside a worker process (one per rank), started at :func:`flair_nbddp.worker.main.main`.

``main`` is a worker's life (set-up, the job loop, heartbeats); ``flair_compat`` bends flair inside it (CPU DDP,
the streaming plugin, the graceful stop), with ``distributed_eval`` (each rank evaluates its share),
``random_streams`` (flair's random draws kept in its order), ``one_rank`` (one rank trains without DDP's
wrapper) and ``rank_zero_loggers`` (flair's loggers log from rank 0 only); ``fast_inputs`` builds transformer
inputs once (``kept_inputs``, ``input_thread``, ``shared_inputs``) and ``no_waits`` answers flair's questions to
the GPU from the host; ``counters`` measures throughput; ``process_name`` names the process for ``ps`` and ``top``;
``ddp_exec`` and ``cell_code`` run a notebook cell's code on the rank (``%%ddp_exec``, ``%%ddp_train``).

It never imports notebook code (IPython, ipywidgets, :mod:`flair_nbddp.notebook`): import-linter holds that.
"""

"""What a user sees and drives in a notebook: a run's views (the widget dashboard, or text lines outside a
kernel), the Train/Stop panel, the magics, and the ledger's runs as tables and figures.

Importing it makes :func:`flair_nbddp.engine.watch.watch` show runs with
:func:`~flair_nbddp.notebook.dashboard.open_view`, :func:`flair_nbddp.sweep` its sweeps with
:func:`~flair_nbddp.notebook.sweep_view.open_sweep_view`, and :func:`flair_nbddp.predict` its calls with
:func:`~flair_nbddp.notebook.predict_view.open_predict_view` (the package's root imports it, so every launch has its
views);
nothing below it imports notebook code.
"""

from ..sweeps.runner import show_sweeps_with
from ..engine.watch import show_runs_with
from ..predicting.runner import show_predictions_with
from .dashboard import open_view
from .predict_view import open_predict_view
from .sweep_view import open_sweep_view

show_runs_with(open_view)
show_sweeps_with(open_sweep_view)
show_predictions_with(open_predict_view)

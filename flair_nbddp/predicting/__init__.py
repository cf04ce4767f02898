"""Predicting on every device: :func:`predict` (:mod:`.runner`), the inputs cut into chunks (:mod:`.dealing`),
their predictions put back in input order (:mod:`.collector`), and what a call returns (:mod:`.result`).
The ranks' side is :mod:`flair_nbddp.worker.predict_rank`."""

from .result import Predictions
from .runner import PredictCall, predict

__all__ = ["PredictCall", "Predictions", "predict"]

"""Sweeps: Optuna trials of a training, several at once on disjoint devices (:func:`sweep`)."""

from .runner import Sweep, SweepState, TrialRow, sweep

__all__ = ["Sweep", "SweepState", "TrialRow", "sweep"]

"""The kit's version, the one place it is written (pyproject.toml reads it; so does the run ledger)."""

__version__ = "0.1.0"

"""A notebook cell's code run on a rank: ``%%ddp_train``'s cell in a fresh namespace, and the step every cell
run shares (the value of the last expression comes back, as in a notebook).

Example:
    >>> run_ddp_train_cell("y = x * 2\\ny + 1", {"x": 20})
    41
"""

from __future__ import annotations

import ast
from typing import Any


def run_ddp_train_cell(source: str, namespace: dict[str, Any]) -> Any:
    """Execute ``source`` in a copy of ``namespace``; return the value of its last expression (else None)."""
    return run_source(source, {"__name__": "__main__", **namespace}, "<ddp_train cell>")


def run_ddp_sweep_cell(source: str, namespace: dict[str, Any], **params: Any) -> Any:
    """``%%ddp_sweep``'s trial: the cell with the trial's parameters as variables (over the notebook's of the same
    name); the value of its last expression.

    Example:
        >>> run_ddp_sweep_cell("lr * 10", {"lr": 1.0}, lr=0.5)
        5.0
    """
    return run_ddp_train_cell(source, {**namespace, **params})


def run_source(source: str, scope: dict[str, Any], filename: str) -> Any:
    """Execute ``source`` in ``scope`` itself (its frames named ``filename``); return the value of its last
    expression (else None)."""
    module = ast.parse(source, filename=filename, mode="exec")
    last = module.body.pop() if module.body and isinstance(module.body[-1], ast.Expr) else None
    exec(compile(module, filename, "exec"), scope)
    if last is None:
        return None
    return eval(compile(ast.Expression(last.value), filename, "eval"), scope)

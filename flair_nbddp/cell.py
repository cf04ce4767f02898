"""Running a notebook cell's source on every rank, and finding the notebook names it needs.

Used by the ``%%ddp_train`` magic; importable without IPython (workers never import it).

Example:
    >>> execute_cell("y = x * 2\\ny + 1", {"x": 20})
    41
    >>> sorted(free_names("import math\\nz = math.pi * radius\\nprint(z)"))
    ['print', 'radius']
"""

from __future__ import annotations

import ast
import builtins
from typing import Any


def execute_cell(source: str, namespace: dict[str, Any]) -> Any:
    """Execute ``source`` in a copy of ``namespace``; return the value of its last expression (else None)."""
    module = ast.parse(source, filename="<ddp_train cell>", mode="exec")
    scope = {"__name__": "__main__", **namespace}
    last = module.body.pop() if module.body and isinstance(module.body[-1], ast.Expr) else None
    exec(compile(module, "<ddp_train cell>", "exec"), scope)
    if last is None:
        return None
    return eval(compile(ast.Expression(last.value), "<ddp_train cell>", "eval"), scope)


class _Names(ast.NodeVisitor):
    """Collects every name a cell reads and every name it binds, at any depth."""

    def __init__(self) -> None:
        self.read: dict[str, None] = {}
        self.bound: set[str] = set()

    def visit_Name(self, node: ast.Name) -> None:
        if isinstance(node.ctx, ast.Load):
            self.read.setdefault(node.id)
        else:
            self.bound.add(node.id)

    def _bind_definition(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> None:
        self.bound.add(node.name)
        self.generic_visit(node)

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _bind_definition

    def visit_arg(self, node: ast.arg) -> None:
        self.bound.add(node.arg)
        self.generic_visit(node)

    def visit_alias(self, node: ast.alias) -> None:
        self.bound.add((node.asname or node.name).partition(".")[0])

    def visit_ExceptHandler(self, node: ast.ExceptHandler) -> None:
        if node.name:
            self.bound.add(node.name)
        self.generic_visit(node)


def free_names(source: str) -> list[str]:
    """Names the cell reads but never binds itself, in order of first use (builtins included)."""
    names = _Names()
    names.visit(ast.parse(source))
    return [name for name in names.read if name not in names.bound]


def names_to_ship(source: str, namespace: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Split the cell's free names into ``(values found in namespace, names defined nowhere)``.

    Builtins are neither shipped nor missing; IPython's own ``In``/``Out``/``get_ipython`` are never shipped.
    """
    shipped, missing = {}, []
    for name in free_names(source):
        if name in namespace and name not in ("In", "Out", "get_ipython", "exit", "quit"):
            shipped[name] = namespace[name]
        elif not hasattr(builtins, name):
            missing.append(name)
    return shipped, missing

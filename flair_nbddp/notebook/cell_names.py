"""The notebook names a cell's code needs: what ``%%ddp_train`` and ``%%ddp_exec`` ship to the ranks.

Example:
    >>> sorted(free_names("import math\\nz = math.pi * radius\\nprint(z)"))
    ['print', 'radius']
"""

from __future__ import annotations

import ast
import builtins
import symtable
from collections.abc import Collection, Iterator
from typing import Any


class _TopLevel(ast.NodeVisitor):
    """The cell's top level in evaluation order: names read before the cell binds them, and what it binds.

    Function, lambda and class bodies are scopes of their own (see :func:`_read_from_inner_scopes`); a
    comprehension's own variables stay inside it.
    """

    def __init__(self) -> None:
        self.read_first: dict[str, None] = {}
        self.bound: set[str] = set()

    def _load(self, name: str) -> None:
        if name not in self.bound:
            self.read_first.setdefault(name)

    def visit_Name(self, node: ast.Name) -> None:
        if isinstance(node.ctx, ast.Load):
            self._load(node.id)
        else:
            self.bound.add(node.id)

    def visit_Assign(self, node: ast.Assign) -> None:
        self.visit(node.value)
        for target in node.targets:
            self.visit(target)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        if node.value is not None:
            self.visit(node.value)
            self.visit(node.target)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        self.visit(node.value)
        if isinstance(node.target, ast.Name):  # x += 1 reads x first
            self._load(node.target.id)
        self.visit(node.target)

    def visit_NamedExpr(self, node: ast.NamedExpr) -> None:
        self.visit(node.value)
        self.visit(node.target)

    def visit_For(self, node: ast.For | ast.AsyncFor) -> None:
        self.visit(node.iter)
        self.visit(node.target)
        for statement in node.body + node.orelse:
            self.visit(statement)

    visit_AsyncFor = visit_For

    def visit_alias(self, node: ast.alias) -> None:
        self.bound.add((node.asname or node.name).partition(".")[0])

    def visit_ExceptHandler(self, node: ast.ExceptHandler) -> None:
        if node.type is not None:
            self.visit(node.type)
        if node.name:
            self.bound.add(node.name)
        for statement in node.body:
            self.visit(statement)

    def _definition(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> None:
        # the header runs here (decorators, defaults, bases); the body is a scope of its own
        for expression in node.decorator_list:
            self.visit(expression)
        if isinstance(node, ast.ClassDef):
            for expression in node.bases + [keyword.value for keyword in node.keywords]:
                self.visit(expression)
        else:
            self.visit(node.args)
        self.bound.add(node.name)

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _definition

    def visit_arguments(self, node: ast.arguments) -> None:
        for default in node.defaults + [d for d in node.kw_defaults if d is not None]:
            self.visit(default)

    def visit_Lambda(self, node: ast.Lambda) -> None:
        self.visit(node.args)

    def _comprehension(self, node: ast.ListComp | ast.SetComp | ast.GeneratorExp | ast.DictComp) -> None:
        self.visit(node.generators[0].iter)  # evaluated out here; the rest runs in the comprehension
        own = {
            name.id
            for generator in node.generators
            for name in ast.walk(generator.target)
            if isinstance(name, ast.Name)
        }
        inner = [node.elt] if not isinstance(node, ast.DictComp) else [node.key, node.value]
        inner += [part for i, g in enumerate(node.generators) for part in ([g.iter] if i else []) + g.ifs]
        for part in inner:
            for name in ast.walk(part):
                if isinstance(name, ast.Name) and isinstance(name.ctx, ast.Load) and name.id not in own:
                    self._load(name.id)

    visit_ListComp = visit_SetComp = visit_GeneratorExp = visit_DictComp = _comprehension


def _read_from_inner_scopes(table: symtable.SymbolTable) -> Iterator[str]:
    """Global names read inside the functions, lambdas and classes a cell defines, at any depth."""
    for child in table.get_children():
        for symbol in child.get_symbols():
            if symbol.is_global() and symbol.is_referenced():
                yield symbol.get_name()
        yield from _read_from_inner_scopes(child)


def free_names(source: str) -> list[str]:
    """Names the cell needs from outside, in order of first use (builtins included).

    A name counts when the cell reads it before binding it (``x = x + 1``, ``def f(corpus): ...`` then
    ``f(corpus)``), or when a function or class of the cell reads a global the cell never binds.
    """
    top = _TopLevel()
    for statement in ast.parse(source).body:
        top.visit(statement)
    needed = dict(top.read_first)
    for name in _read_from_inner_scopes(symtable.symtable(source, "<ddp_train cell>", "exec")):
        if name not in top.bound:
            needed.setdefault(name)
    return list(needed)


def names_to_ship(
    source: str, namespace: dict[str, Any], held: Collection[str] = ()
) -> tuple[dict[str, Any], list[str]]:
    """Split the cell's free names into ``(values found in namespace, names defined nowhere)``.

    Builtins are neither shipped nor missing; IPython's own ``In``/``Out``/``get_ipython`` are never shipped;
    nor are the names in ``held``, which the ranks have already (bound by earlier ``%%ddp_exec`` cells).
    """
    shipped, missing = {}, []
    for name in free_names(source):
        if name in held:
            continue
        if name in namespace and name not in ("In", "Out", "get_ipython", "exit", "quit"):
            shipped[name] = namespace[name]
        elif not hasattr(builtins, name):
            missing.append(name)
    return shipped, missing

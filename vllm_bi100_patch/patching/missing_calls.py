"""Calls to names a module lacks: the code check that finds ``X.name(...)`` where the module
``X`` has no ``name`` (doctor's audit of vLLM's ops module runs it over every ops function, the
``kv_blocks`` row as its code check).  Reads source through ``source``; stdlib only, never
imports vLLM.
"""

from __future__ import annotations

import ast
import types
from typing import Any, Callable, Dict, FrozenSet, List, Optional, Sequence, Set, Tuple

from .source import source_tree

__all__ = ["missing_calls"]


def missing_calls(func: Callable[..., Any]) -> List[str]:
    """Every ``"module.name"`` that ``func`` calls as ``X.name(...)`` where ``X`` is one of
    its module globals bound to a module without ``name`` (in source order, once each);
    empty when there is none or the source cannot be read.  A call guarded by
    ``hasattr(X, "name")`` (in an ``if``/conditional expression, after ``if not
    hasattr(...)`` that leaves the block, or after ``assert hasattr(...)``) is not judged,
    nor is ``X`` where a local name (a parameter, an assignment) shadows the global.  A name
    whose lookup raises something other than ``AttributeError`` is listed with what its lookup
    raises."""
    parsed = source_tree(func)
    globals_ = getattr(parsed[1], "__globals__", None) if parsed else None
    if parsed is None or globals_ is None:
        return []
    finder = _CallFinder(globals_)
    finder.block(parsed[0].body, frozenset(), ())
    return finder.out


def _lookup(module: types.ModuleType, name: str) -> Optional[str]:
    """None when ``module`` has ``name``; else why not (``hasattr`` would let anything but
    AttributeError through, which crashed doctor)."""
    if name in vars(module):
        return None
    try:
        getattr(module, name)
    except AttributeError:
        return ""
    except Exception as exc:
        return f"looking it up raises {type(exc).__name__}: {exc}"
    return None


_EXITS = (ast.Return, ast.Raise, ast.Continue, ast.Break)
_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ListComp, ast.SetComp,
           ast.DictComp, ast.GeneratorExp)
Guard = Tuple[str, str]


def _hasattr_guards(test: ast.expr) -> Tuple[List[Guard], List[Guard]]:
    """The ``(name, attr)`` pairs ``test`` proves present when true, and when false."""
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And):
        return [g for value in test.values for g in _hasattr_guards(value)[0]], []
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        when_true, when_false = _hasattr_guards(test.operand)
        return when_false, when_true
    if isinstance(test, ast.Call) and isinstance(test.func, ast.Name) \
            and test.func.id == "hasattr" and len(test.args) == 2 \
            and isinstance(test.args[0], ast.Name) and isinstance(test.args[1], ast.Constant) \
            and isinstance(test.args[1].value, str):
        return [(test.args[0].id, test.args[1].value)], []
    return [], []


def _bound_names(node: ast.AST) -> Set[str]:
    """The names a function, lambda or comprehension binds in its own scope (its parameters
    and every name it assigns, imports or defines; ``global`` names left out)."""
    names: Set[str] = set()
    declared_global: Set[str] = set()
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
        a = node.args
        names.update(p.arg for p in a.posonlyargs + a.args + a.kwonlyargs)
        names.update(p.arg for p in (a.vararg, a.kwarg) if p is not None)
        todo: List[ast.AST] = list(node.body) if isinstance(node.body, list) else [node.body]
    else:  # a comprehension: its targets
        todo = [gen.target for gen in node.generators]  # type: ignore[attr-defined]
    while todo:
        n = todo.pop()
        if isinstance(n, ast.Name) and isinstance(n.ctx, (ast.Store, ast.Del)):
            names.add(n.id)
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in n.names)
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(n.name)
            continue  # its own scope
        elif isinstance(n, ast.ExceptHandler) and n.name:
            names.add(n.name)
        elif isinstance(n, ast.Global):
            declared_global.update(n.names)
        if isinstance(n, _SCOPES):
            continue
        todo.extend(ast.iter_child_nodes(n))
    return names - declared_global


class _CallFinder:
    """Walks a function's source with the names each scope binds and the ``hasattr`` guards
    in force, collecting calls on module globals that lack the attribute."""

    def __init__(self, globals_: Dict[str, Any]) -> None:
        self.globals = globals_
        self.out: List[str] = []

    def block(self, stmts: Sequence[ast.AST], local: FrozenSet[str],
              guards: Tuple[Guard, ...]) -> None:
        for stmt in stmts:
            self.visit(stmt, local, guards)
            if isinstance(stmt, ast.Assert):  # past `assert hasattr(...)`
                guards += tuple(_hasattr_guards(stmt.test)[0])
            elif isinstance(stmt, ast.If):
                when_true, when_false = _hasattr_guards(stmt.test)
                if stmt.body and isinstance(stmt.body[-1], _EXITS):
                    guards += tuple(when_false)  # past `if not hasattr(...): return`
                if stmt.orelse and isinstance(stmt.orelse[-1], _EXITS):
                    guards += tuple(when_true)

    def visit(self, node: ast.AST, local: FrozenSet[str], guards: Tuple[Guard, ...]) -> None:
        if isinstance(node, _SCOPES):
            local = local | _bound_names(node)
        if isinstance(node, (ast.If, ast.IfExp)):
            when_true, when_false = _hasattr_guards(node.test)
            self.visit(node.test, local, guards)
            for branch, more in ((node.body, when_true), (node.orelse, when_false)):
                stmts = branch if isinstance(branch, list) else [branch]
                self.block(stmts, local, guards + tuple(more))
            return
        if isinstance(node, ast.Call):
            self._call(node, local, guards)
        for _field, value in ast.iter_fields(node):
            if isinstance(value, list) and value and isinstance(value[0], ast.stmt):
                self.block(value, local, guards)
            elif isinstance(value, list):
                for item in value:
                    if isinstance(item, ast.AST):
                        self.visit(item, local, guards)
            elif isinstance(value, ast.AST):
                self.visit(value, local, guards)

    def _call(self, node: ast.Call, local: FrozenSet[str], guards: Tuple[Guard, ...]) -> None:
        func = node.func
        if not (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name)):
            return
        owner, attr = func.value.id, func.attr
        if owner in local or (owner, attr) in guards:
            return
        target = self.globals.get(owner)
        if not isinstance(target, types.ModuleType):
            return
        why = _lookup(target, attr)
        if why is None:
            return
        name = f"{target.__name__}.{attr}" + (f" ({why})" if why else "")
        if name not in self.out:
            self.out.append(name)

"""What the rows' code checks share (the engine rows ``tp_empty_logits``, ``stream_delta``,
``mrope_positions`` and the serving rows): the method a row targets, found in a module as vLLM
defines it, and the row's code check against the exact code shapes it was checked against.

A code shape is ``fingerprint``: 16 hex digits of the method's parameters and
body (docstring, comments and formatting left out, independent of the Python version).  Each
row keeps its ``KNOWN`` shapes with the releases they were read in.  Never imports vLLM.
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import types
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

from .source import body_without_docstring, function_def


def _canonical(node: Any) -> str:
    """The node as text, independent of the Python version's AST extras (``ctx``,
    ``type_params``, ``type_comment``, omitted empty fields) and of comments/formatting."""
    if isinstance(node, ast.AST):
        parts = []
        for name, value in ast.iter_fields(node):
            if name in ("ctx", "type_params", "type_comment", "kind") or value in (None, []):
                continue
            parts.append(f"{name}={_canonical(value)}")
        return f"{type(node).__name__}({','.join(parts)})"
    if isinstance(node, list):
        return "[" + ",".join(_canonical(n) for n in node) + "]"
    return repr(node)


def fingerprint(func: Callable[..., Any]) -> Optional[str]:
    """16 hex digits of the function's code shape (docstring left out); None when its
    source cannot be read."""
    fn = function_def(func)
    if fn is None:
        return None
    text = _canonical(fn.args) + _canonical(body_without_docstring(fn))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def class_shape(cls: type, names: Sequence[str], look_through: str = "__func__") -> Optional[str]:
    """The code shapes of the methods ``names`` of ``cls`` (each as ``cls`` defines it, looked
    through ``look_through``: a classmethod's ``__func__``, or ``__wrapped__`` for one the shim
    wrapped), joined with ``-``; None when one is absent or its source cannot be read."""
    parts = []
    for name in names:
        desc = vars(cls).get(name)
        func = getattr(desc, look_through, desc)
        shape = fingerprint(func) if func is not None else None
        if shape is None:
            return None
        parts.append(shape)
    return "-".join(parts)


def method_of(module: types.ModuleType, owner: str, attr: str) -> Optional[Callable[..., Any]]:
    """``owner.attr`` of ``module`` as vLLM defined it (along the MRO; the shim's own wrapper
    is looked through), or None when the class or the method is absent."""
    cls = vars(module).get(owner)
    if not isinstance(cls, type):
        return None
    for klass in cls.__mro__:
        if attr in vars(klass):
            desc = vars(klass)[attr]
            return getattr(desc, "__wrapped__", desc)
    return None


def definition(module: types.ModuleType, owner: str, attr: str
               ) -> Tuple[Optional[ast.FunctionDef], Optional[str]]:
    """The parsed ``owner.attr`` of ``module``, or None and why the row is not needed (the
    method is absent, or its source cannot be read)."""
    method = method_of(module, owner, attr)
    if method is None:
        return None, f"{module.__name__} has no {owner}.{attr} (the code this fixes is absent)"
    fn = function_def(method)
    if fn is None:
        return None, f"the source of {owner}.{attr} cannot be read; nothing to fix"
    return fn, None


def shape_check(func: Callable[..., Any], where: str, params: Sequence[str],
                known: Dict[str, str]) -> Optional[str]:
    """None when ``func`` has exactly ``params`` and one of the ``known`` code shapes, else
    what differs."""
    try:
        got = tuple(inspect.signature(func).parameters)
    except (TypeError, ValueError) as exc:
        return f"{where} has no readable signature ({exc})"
    if got != tuple(params):
        return f"{where} parameters {list(got)} differ from {list(params)}"
    shape = fingerprint(func)
    if shape is None:
        return f"the source of {where} cannot be read"
    return unknown_shape(where, shape, known)


def unknown_shape(where: str, shape: str, known: Dict[str, str]) -> Optional[str]:
    """None when ``shape`` is one of the ``known`` code shapes, else the code check's
    sentence naming it and the known ones."""
    if shape not in known:
        return (f"{where} has a code shape this fix was not checked against (fingerprint "
                f"{shape}; known: " + ", ".join(f"{k} = {v}" for k, v in known.items()) + ")")
    return None

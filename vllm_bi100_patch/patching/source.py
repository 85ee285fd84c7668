"""A function's source as a syntax tree: the one parse the code checks share.

The patch rows' checks (``code_shapes``, ``missing_calls``, the rows in ``attention/``,
``engine/``, ``serving/``), doctor's audit of the ops module (``ops/audit.py``) and the native
kernels' stub check (``attention/native/probe.py``) all read vLLM's or a build's code this way.
Patching layer, stdlib only (no torch, no vLLM).
"""

from __future__ import annotations

import ast
import inspect
import textwrap
import threading
from typing import Any, Callable, List, Optional, Tuple

__all__ = ["body_without_docstring", "function_def", "parse", "source_tree"]

#: CPython 3.11 (before 3.11.8) and 3.12.0 keep the AST converter's recursion depth per
#: interpreter, not per thread: two threads parsing at once can fail with ``SystemError: AST
#: constructor recursion depth mismatch`` (python/cpython#106905).  Every parse of the shim's
#: goes through this lock.
_PARSE_LOCK = threading.Lock()


def parse(source: str) -> ast.Module:
    """``ast.parse(source)``, one thread at a time (``_PARSE_LOCK``)."""
    with _PARSE_LOCK:
        return ast.parse(source)


def source_tree(func: Callable[..., Any]) -> Optional[Tuple[ast.Module, Callable[..., Any]]]:
    """The parsed source of ``func`` and the function it was read from, looking through
    ``functools.wraps`` wrappers; None when the source cannot be read (builtins, C ops)."""
    try:
        inner = inspect.unwrap(func)
        return parse(textwrap.dedent(inspect.getsource(inner))), inner
    except (OSError, TypeError, SyntaxError, ValueError):
        return None


def function_def(func: Callable[..., Any]) -> Optional[ast.FunctionDef]:
    """The one function definition in ``func``'s source (``source_tree``), or None when the
    source cannot be read or does not hold exactly one (async definitions count)."""
    parsed = source_tree(func)
    if parsed is None:
        return None
    defs = [n for n in parsed[0].body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    return defs[0] if len(defs) == 1 else None  # type: ignore[return-value]


def body_without_docstring(fn: ast.FunctionDef) -> List[ast.stmt]:
    """``fn``'s statements, a leading docstring left out."""
    body: List[ast.stmt] = list(fn.body)
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        body = body[1:]
    return body

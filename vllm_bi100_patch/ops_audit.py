"""doctor's audit of the installed ``vllm._custom_ops``, and its engine-timeout warning.

Iluvatar's CoreX 3.2.3 build routes its ops through ``ixformer.functions`` names that its
ixformer does not define (``docs/corex-3.2.3.md``): the first call crashes the engine with an
``AttributeError``.  ``audit`` reads the source of every function the ops module defines and
lists those whose body calls ``<module>.<name>(...)`` on a module global that has no such
name (calls guarded by ``hasattr`` and names a local shadows are not judged; a lookup that
raises is reported, never raised), each with the vLLM feature that calls it: ``ok`` where a
patch row applied in this process replaces every caller (the swap/copy/write rows), ``FAIL``
where nothing does (the feature will crash).  Calls into ``torch.ops`` are never judged
(stock wheels on a CPU torch have no kernels behind them; on their own hardware they do).
``timeout_check`` warns where vLLM's engine-iteration timeout is too short for long prompts on
the pure-PyTorch paths.

Imported by doctor only, after vLLM's ops were imported; never imports vLLM itself.
"""

from __future__ import annotations

import ast
import inspect
import os
import types
from typing import Any, Callable, Dict, FrozenSet, List, Optional, Sequence, Set, Tuple

from .source import source_tree

#: (state, name, detail), as doctor's sections hold them.
Check = Tuple[str, str, str]

_MOE = "MoE models (FusedMoE)"
#: What in vLLM calls each ops function (names not listed: "whatever calls it").
FEATURES: Dict[str, str] = {
    "swap_blocks": "preemption by swapping KV blocks to CPU (n > 1, beam search under memory "
                   "pressure)",
    "copy_blocks": "copy-on-write of shared KV blocks (parallel sampling, beam search)",
    "reshape_and_cache": "every KV cache write (PagedAttention backends)",
    "reshape_and_cache_flash": "KV cache writes of the FlashAttention backend",
    "paged_attention_v1": "decode (PagedAttention V1)",
    "paged_attention_v2": "decode (PagedAttention V2)",
    "moe_align_block_size": _MOE + ": expert alignment",
    "topk_softmax": _MOE + ": top-k gating",
    "invoke_fused_moe_kernel": _MOE + ": expert GEMMs",
}
#: The patch rows that replace every caller of an ops function (any one applied suffices).
REPLACED_BY: Dict[str, Tuple[str, ...]] = {
    "swap_blocks": ("swap_blocks",), "copy_blocks": ("copy_blocks",),
    "reshape_and_cache": ("kv_write",), "paged_attention_v1": ("decode",),
    "paged_attention_v2": ("decode",),
}
_MOE_OPS = ("moe_align_block_size", "topk_softmax", "invoke_fused_moe_kernel")

#: vLLM's own default of ``VLLM_ENGINE_ITERATION_TIMEOUT_S`` (``vllm/envs.py``).
ENGINE_TIMEOUT = "VLLM_ENGINE_ITERATION_TIMEOUT_S"
VLLM_DEFAULT_TIMEOUT_S = 60
#: What the field ran long-context servers on the pure-PyTorch paths with.
FIELD_TIMEOUT_S = 3600


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


def broken_ops(ops: types.ModuleType) -> Dict[str, List[str]]:
    """The functions ``ops`` defines that call a missing function: name -> what they call."""
    out: Dict[str, List[str]] = {}
    for name, func in vars(ops).items():
        if inspect.isfunction(func) and func.__module__ == ops.__name__:
            missing = missing_calls(func)
            if missing:
                out[name] = missing
    return out


def audit(ops: types.ModuleType, applied: Sequence[str]) -> List[Check]:
    """doctor's checks for ``ops`` given the patch rows ``applied`` in this process."""
    checks: List[Check] = []
    broken = broken_ops(ops)
    for name, missing in broken.items():
        feature = FEATURES.get(name, f"whatever calls {ops.__name__}.{name}")
        calls = ", ".join(missing)
        rows = [r for r in REPLACED_BY.get(name, ()) if r in applied]
        if rows:
            checks.append(("ok", name, f"calls {calls} (absent); replaced by the shim's row "
                           f"{rows[0]}: {feature} works"))
        else:
            checks.append(("FAIL", name, f"calls {calls}, which does not exist: {feature} "
                           "will crash (no patch row replaces it)"))
    moe_broken = [n for n in _MOE_OPS if n in broken]
    if vars(ops).get("supports_moe_ops") is True and moe_broken:
        checks.append(("FAIL", "supports_moe_ops", f"True, but {', '.join(moe_broken)} call "
                       f"missing functions: {_MOE} will crash; serve dense models only"))
    if not broken:
        checks.append(("ok", ops.__name__, "every function calls only functions that exist"))
    return checks


def timeout_check(pure_paths: Sequence[str], environ: Any = None) -> Check:
    """Warn when vLLM's engine-iteration timeout is below what long prompts on the shim's
    pure-PyTorch paths (``pure_paths``: what runs there) need."""
    env = os.environ if environ is None else environ
    raw = env.get(ENGINE_TIMEOUT)
    where = ", ".join(pure_paths)
    try:
        value = VLLM_DEFAULT_TIMEOUT_S if raw is None else int(raw)
    except ValueError:
        return ("FAIL", ENGINE_TIMEOUT, f"{raw!r} is not an integer: vLLM fails at start-up")
    given = f"{value} s" + (" (vLLM's default)" if raw is None else "")
    if value < FIELD_TIMEOUT_S:
        return ("WARN", ENGINE_TIMEOUT, f"{given}: a long-context prompt on the pure-PyTorch "
                f"paths ({where}) can take minutes per engine step, and vLLM's API server "
                f"aborts the engine after this many seconds; set it far higher (the field ran "
                f"{FIELD_TIMEOUT_S}) for long-context serving")
    return ("ok", ENGINE_TIMEOUT, f"{given}: room for long prompts on the pure-PyTorch paths "
            f"({where})")


def doctor_checks(applied: Sequence[str]) -> List[Check]:
    """The audit of the ops module vLLM imported in this process, plus the timeout check
    where the shim patched something that runs in pure PyTorch (``applied``: the rows the
    registry applied in this process)."""
    import sys

    ops = sys.modules.get("vllm._custom_ops")
    checks = audit(ops, applied) if ops is not None else [
        ("info", "vllm._custom_ops", "not imported in this process: not audited")]
    pure = [what for row, what in (("prefix", "chunked prefill and prefix caching"),
                                   ("decode", "decode above the native V1 limit"),
                                   ("dense_prefill", "prompts above the dense head-size limit"))
            if row in applied]
    if pure:
        checks.append(timeout_check(pure))
    return checks

"""Keeps vLLM's Triton ``context_attention_fwd`` out of the process.

Its catalogue entry (why, how, vLLM versions, upstream, removal) is the ``import_guard`` row of
``vllm_bi100_patch.patching.table``.  Mechanism: a ``sys.meta_path`` finder, installed first by the
bootstrap, serves a substitute ``vllm.attention.ops.prefix_prefill`` whose
``context_attention_fwd`` raises ``TritonPrefixBlocked`` naming the caller; names already bound
in vLLM's modules (``BINDERS``) are re-pointed at it, and restored on uninstall.
"""

from __future__ import annotations

import _thread
import sys

from ..activation.log import log

TYPE_CHECKING = False  # imported at interpreter start when active: no typing, no logging
if TYPE_CHECKING:
    import importlib.machinery
    import types
    from typing import Any, Dict, List, Optional, Sequence, Tuple

TARGET = "vllm.attention.ops.prefix_prefill"
#: Modules that bind ``context_attention_fwd`` at import time.
BINDERS = ("vllm.attention.ops.paged_attn", "vllm.attention.ops.chunked_prefill_paged_decode")
MARKER = "__vllm_bi100_substitute__"


class TritonPrefixBlocked(RuntimeError):
    """vLLM tried to launch the Triton prefix kernel while the shim keeps it out."""


def _caller(depth: int = 2) -> str:
    try:
        frame = sys._getframe(depth)
    except ValueError:  # pragma: no cover - shallow stack
        return "<unknown caller>"
    code = frame.f_code
    module = frame.f_globals.get("__name__", "?")
    return f"{module}.{code.co_name} ({code.co_filename}:{frame.f_lineno})"


def context_attention_fwd(*args: Any, **kwargs: Any) -> None:
    """Substitute for vLLM's Triton kernel: refuses loudly instead of hanging the card."""
    raise TritonPrefixBlocked(
        "vllm-bi100-patch blocked vLLM's Triton context_attention_fwd (it hangs Iluvatar "
        f"BI-V100 cards), called from {_caller()}. The shim's PagedAttention.forward_prefix "
        "replacement does not need it: check that the 'prefix' patch is applied "
        "(python -m vllm_bi100_patch doctor) and not listed in VLLM_BI100_PATCH_DISABLE; on "
        "hardware where Triton works, run with VLLM_BI100_PATCH=0.")


def _module_getattr(name: str) -> Any:
    raise AttributeError(
        f"module {TARGET!r} is vllm-bi100-patch's substitute for vLLM's Triton prefix kernel "
        f"and has no attribute {name!r} (set VLLM_BI100_PATCH=0 for the real module)")


class _SubstituteLoader:
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Optional[types.ModuleType]:
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        module.context_attention_fwd = context_attention_fwd  # type: ignore[attr-defined]
        module.TritonPrefixBlocked = TritonPrefixBlocked  # type: ignore[attr-defined]
        setattr(module, MARKER, True)
        module.__getattr__ = _module_getattr  # type: ignore[attr-defined,method-assign]
        log.debug("served the substitute for %s", TARGET)


class PrefixPrefillGuard:
    """Answers only for ``vllm.attention.ops.prefix_prefill``; every other import passes."""

    def find_spec(self, fullname: str, path: Optional[Sequence[str]] = None,
                  target: Optional[types.ModuleType] = None
                  ) -> Optional[importlib.machinery.ModuleSpec]:
        if fullname != TARGET:
            return None
        import importlib.util

        return importlib.util.spec_from_loader(
            fullname, _SubstituteLoader(),  # type: ignore[arg-type]
            origin="vllm_bi100_patch.attention.import_guard")


_lock = _thread.RLock()
_finder: Optional[PrefixPrefillGuard] = None
_rebound: List[Tuple[types.ModuleType, Any]] = []


def is_substitute(module: Optional[types.ModuleType]) -> bool:
    return module is not None and getattr(module, MARKER, False) is True


def installed() -> bool:
    return _finder is not None and _finder in sys.meta_path


def install() -> None:
    """Install the finder first on sys.meta_path (idempotent) and neutralise a real module
    that was imported before the shim activated."""
    global _finder
    with _lock:
        if _finder is None:
            _finder = PrefixPrefillGuard()
        if _finder not in sys.meta_path:
            sys.meta_path.insert(0, _finder)
        real = sys.modules.get(TARGET)
        if real is not None and not is_substitute(real):
            log.warning("%s (Triton) was imported before vllm-bi100-patch activated; it stays "
                        "loaded but every reference vLLM holds to context_attention_fwd now "
                        "points at the blocking substitute", TARGET)
            _rebind_existing(real)


def _rebind_existing(real: types.ModuleType) -> None:
    real_fn = getattr(real, "context_attention_fwd", None)
    for name in BINDERS:
        mod = sys.modules.get(name)
        if mod is None or real_fn is None:
            continue
        if vars(mod).get("context_attention_fwd") is real_fn:
            _rebound.append((mod, real_fn))
            mod.context_attention_fwd = context_attention_fwd  # type: ignore[attr-defined]


def uninstall() -> None:
    """Take the guard out completely:

    - the finder leaves ``sys.meta_path``;
    - references to the real ``context_attention_fwd`` that ``install()`` re-pointed at the
      substitute get the real function back;
    - where vLLM imported the substitute itself (``from ...prefix_prefill import
      context_attention_fwd`` while the guard was on), that name is removed from the binding
      modules, and the substitute module leaves ``sys.modules`` and its parent package, so the
      next import of ``vllm.attention.ops.prefix_prefill`` loads the real module. A stock
      ``forward_prefix`` of such an already-imported ``paged_attn`` then fails with
      ``NameError`` (as vLLM's own code does where Triton is absent), never reaching Triton.
    """
    global _finder
    with _lock:
        if _finder is not None:
            while _finder in sys.meta_path:
                sys.meta_path.remove(_finder)
        for mod, real_fn in reversed(_rebound):
            if vars(mod).get("context_attention_fwd") is context_attention_fwd:
                mod.context_attention_fwd = real_fn  # type: ignore[attr-defined]
        _rebound.clear()
        for name in BINDERS:
            mod = sys.modules.get(name)
            if mod is not None and vars(mod).get("context_attention_fwd") is context_attention_fwd:
                delattr(mod, "context_attention_fwd")
        module = sys.modules.get(TARGET)
        if is_substitute(module):
            del sys.modules[TARGET]
            parent_name, _, child = TARGET.rpartition(".")
            parent = sys.modules.get(parent_name)
            if parent is not None and vars(parent).get(child) is module:
                delattr(parent, child)


def state() -> Dict[str, Any]:
    module = sys.modules.get(TARGET)
    return {
        "installed": installed(),
        "prefix_prefill": ("absent" if module is None
                           else "substitute" if is_substitute(module) else "real (Triton)"),
    }

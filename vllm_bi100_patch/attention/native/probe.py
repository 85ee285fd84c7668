"""What an ops module's native decode kernels are, learned once: the probe.

For each of ``paged_attention_v1/v2`` the probe finds the calling convention its signature
matches (``calls.CONVENTIONS``: stock vLLM, vLLM 0.5.0-0.5.2's ``kv_scale``, Iluvatar CoreX
3.2.3's ``head_mapping``; facts and sources in ``docs/corex-3.2.3.md``), how many of the
convention's trailing optional parameters the kernel takes, and whether the kernel is really
there.  A kernel is absent, with the reason ``doctor`` shows, when it is not defined, when its
body only raises ``NotImplementedError`` (CoreX 3.2.3's V2, both kernels of CoreX 4.3), when
its signature cannot be called safely (``**kwargs`` only, a required parameter no convention
supplies, parameters that match no convention), or when it raised ``NotImplementedError`` at
its first call (``OpsProfile.mark_absent``; once per process, the call is re-routed).
``vllm._custom_ops`` without compiled kernels behind its Python wrappers (official CUDA wheels
on a CPU torch) has no native kernels at all (``compiled_kernels_missing``).
"""

from __future__ import annotations

import ast
import inspect
import threading
from typing import Any, Callable, Dict, Optional, Tuple

from ...activation.log import log
from ...patching.source import body_without_docstring, function_def
from .calls import CONVENTIONS, Convention

__all__ = ["KernelProfile", "OpsProfile", "compiled_kernels_missing", "only_raises_not_implemented"]

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


class KernelProfile:
    """One native kernel as this ops object defines it: its convention (None: signature not
    readable, called positionally in the stock order), how many positional arguments it
    takes, and whether it is present."""

    def __init__(self, name: str, func: Optional[Callable[..., Any]],
                 convention: Optional[Convention], nargs: int,
                 absent_reason: Optional[str]) -> None:
        self.name = name
        self.func = func
        self.convention = convention
        self.nargs = nargs
        self.absent_reason = absent_reason
        takes = (convention.takes(nargs) if convention is not None else
                 dict.fromkeys(("scales", "kv_cache_dtype", "blocksparse"), True))
        self.takes_head_mapping = bool(convention and convention.head_mapping)
        self.takes_scales = takes["scales"]
        self.takes_kv_cache_dtype = takes["kv_cache_dtype"]
        self.takes_blocksparse = takes["blocksparse"]

    @property
    def present(self) -> bool:
        return self.absent_reason is None

    def describe(self) -> str:
        if not self.present:
            return f"absent ({self.absent_reason})"
        if self.convention is None:
            return "present (signature not readable: stock argument order)"
        return f"present ({self.convention.name} convention, {self.nargs} arguments)"


def _match(func: Callable[..., Any], which: str
           ) -> Tuple[Optional[Convention], int, Optional[str]]:
    """(convention, positional arguments to pass, why it cannot be called safely)."""
    try:
        sig = inspect.signature(func)
    except (TypeError, ValueError):
        return None, 0, None  # a builtin: positional, stock order
    params = list(sig.parameters.values())
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return None, 0, None  # ``*args``: nothing to read names from; stock order
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None, 0, ("it takes **kwargs, so the parameters it needs cannot be read from "
                         "its signature")
    names = [p.name for p in params if p.kind in _POSITIONAL]
    for conv in CONVENTIONS[which]:
        n = conv.match(names)
        if n is None:
            continue
        rest = [p.name for p in params[n:] if p.default is p.empty]
        if rest:
            return conv, n, f"required parameters the dispatch cannot supply: {rest}"
        return conv, n, None
    return None, 0, (f"its parameters {[p.name for p in params]} match no known calling "
                     f"convention ({', '.join(c.name for c in CONVENTIONS[which])})")


def _profile(ops: Any, name: str, which: str) -> KernelProfile:
    func = getattr(ops, name, None)
    if func is None or not callable(func):
        return KernelProfile(name, None, None, 0, "not defined by the ops module")
    conv, nargs, reason = _match(func, which)
    if only_raises_not_implemented(func):
        reason = "its body only raises NotImplementedError"
    return KernelProfile(name, func, conv, nargs, reason)


class OpsProfile:
    """The two native decode kernels of one ops object (``ops``, kept referenced)."""

    def __init__(self, ops: Any) -> None:
        self.ops = ops
        self.v1 = _profile(ops, "paged_attention_v1", "v1")
        self.v2 = _profile(ops, "paged_attention_v2", "v2")
        self._lock = threading.Lock()

    @property
    def build(self) -> str:
        """Whose kernels these are: ``"vendor"`` when a kernel takes ``head_mapping`` (Iluvatar
        CoreX 3.x), else ``"stock"`` (each kernel's calling convention is its own)."""
        return "vendor" if self.v1.takes_head_mapping or self.v2.takes_head_mapping else "stock"

    @property
    def needs_head_mapping(self) -> bool:
        return any(k.present and k.takes_head_mapping for k in (self.v1, self.v2))

    def mark_absent(self, kernel: KernelProfile, reason: str) -> None:
        with self._lock:
            if kernel.absent_reason is not None:
                return
            kernel.absent_reason = reason
        log.warning("vllm-bi100-patch: native %s is unavailable in this build: %s; decode "
                    "no longer routes to it in this process", kernel.name, reason)

    def describe(self) -> Dict[str, str]:
        # "convention": the key status() and doctor have always shown the build under.
        return {"convention": self.build, "paged_attention_v1": self.v1.describe(),
                "paged_attention_v2": self.v2.describe()}


def compiled_kernels_missing(ops: Any, ixformer: bool) -> Optional[str]:
    """Why ``ops`` has no native kernels at all (None when it may have them): vLLM's
    ``_custom_ops`` exposes ``paged_attention_v1/v2`` as Python wrappers even where the
    compiled kernels are missing (official CUDA wheels on a CPU torch).  Iluvatar's
    ixformer-backed ops (``ixformer``) and ops handed in on purpose are taken as they are."""
    if not all(hasattr(ops, n) for n in ("paged_attention_v1", "paged_attention_v2")):
        return "the ops module lacks paged_attention_v1 or paged_attention_v2"
    if getattr(ops, "__name__", "") != "vllm._custom_ops" or ixformer:
        return None
    import torch

    try:
        namespace = torch.ops._C
        if hasattr(namespace, "paged_attention_v1") and hasattr(namespace, "paged_attention_v2"):
            return None
    except (AttributeError, RuntimeError):
        pass
    return "vllm._custom_ops has no compiled kernels behind it (torch.ops._C lacks them)"


def only_raises_not_implemented(func: Callable[..., Any]) -> bool:
    """True when the function's body (after any docstring) is one ``raise
    NotImplementedError[(...)]``.  Wrappers (``functools.wraps``) are looked through; a
    function whose source cannot be read is assumed to be real."""
    fn = function_def(func)
    if fn is None:
        return False
    body = body_without_docstring(fn)
    if len(body) != 1 or not isinstance(body[0], ast.Raise) or body[0].exc is None:
        return False
    exc = body[0].exc
    if isinstance(exc, ast.Call):
        exc = exc.func
    return isinstance(exc, ast.Name) and exc.id == "NotImplementedError"

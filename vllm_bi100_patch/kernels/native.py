"""What a native ops module can do, learned once per ops object: the native-ops adapter.

The decode dispatch must call vLLM's native ``paged_attention_v1/v2`` as the *installed*
build defines them, not as stock vLLM does.  Builds disagree (facts and sources in
``docs/corex-3.2.3.md``):

- stock vLLM: ``paged_attention_v1(out, query, key_cache, value_cache, num_kv_heads, scale,
  block_tables, seq_lens, block_size, max_seq_len, alibi_slopes, kv_cache_dtype, k_scale,
  v_scale, tp_rank, blocksparse_*x4)`` (``kv_scale`` instead of ``k_scale, v_scale`` in
  0.5.0-0.5.2); ``paged_attention_v2`` takes ``exp_sum, max_logits, tmp_out`` after ``out``;
- Iluvatar CoreX 3.2.3 (vLLM ``0.6.3+corex.3.2.3``): ``paged_attention_v1(output, query,
  key_cache, value_cache, head_mapping, scale, block_tables, context_lens, block_size,
  max_context_len, alibi_slopes=None, kv_cache_dtype=None)`` (no scales, ``kv_cache_dtype``
  ignored) and a ``paged_attention_v2`` whose body is only ``raise NotImplementedError()``;
- Iluvatar CoreX 4.3 (vLLM ``0.8.3+corex``): both kernels only raise NotImplementedError.

``NativeOps.of(ops)`` reads each kernel's parameter names once per ops object and maps the
dispatch's values onto them by name (``output``/``out``, ``head_mapping``/``num_kv_heads``,
``context_lens``/``seq_lens``, ``max_context_len``/``max_seq_len``, ``kv_scale`` or
``k_scale``/``v_scale``),
passing exactly what each kernel accepts.  A kernel whose body only raises
``NotImplementedError`` is absent from the start; one that raises it when first called is
marked absent then (once per process; the call is re-routed, so no wrong result and no
second failure).  Nothing here imports vLLM.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
import threading
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from .._log import log

__all__ = [
    "KernelProfile",
    "NativeOps",
    "STOCK_V1_PARAMS",
    "STOCK_V2_PARAMS",
    "head_mapping_for",
    "kv_heads_of",
]


_TAIL = ("alibi_slopes", "kv_cache_dtype", "k_scale", "v_scale", "tp_rank",
         "blocksparse_local_blocks", "blocksparse_vert_stride", "blocksparse_block_size",
         "blocksparse_head_sliding_step")
#: Stock vLLM's parameter order (0.5.3+), used when a kernel's signature cannot be read.
STOCK_V1_PARAMS: Tuple[str, ...] = ("out", "query", "key_cache", "value_cache", "num_kv_heads",
                                    "scale", "block_tables", "seq_lens", "block_size",
                                    "max_seq_len") + _TAIL
STOCK_V2_PARAMS: Tuple[str, ...] = (STOCK_V1_PARAMS[:1] + ("exp_sum", "max_logits", "tmp_out")
                                    + STOCK_V1_PARAMS[1:])


def kv_scale_order(order: Tuple[str, ...]) -> Tuple[str, ...]:
    """vLLM 0.5.0 - 0.5.2's order: one ``kv_scale`` where later releases have two scales."""
    at = order.index("k_scale")
    return order[:at] + ("kv_scale",) + order[at + 2:]

#: Parameter names used by some build -> the dispatch's name for the same value.
ALIASES: Dict[str, str] = {
    "output": "out",
    "exp_sums": "exp_sum",
    "context_lens": "seq_lens",
    "max_context_len": "max_seq_len",
}
_SCALES = ("k_scale", "v_scale")
_BLOCKSPARSE = ("blocksparse_local_blocks", "blocksparse_vert_stride", "blocksparse_block_size",
                "blocksparse_head_sliding_step")


class KernelProfile:
    """One native kernel as this ops object defines it."""

    def __init__(self, name: str, func: Optional[Callable[..., Any]],
                 sig: Optional["Signature"], absent_reason: Optional[str]) -> None:
        self.name = name
        self.func = func
        #: Parameter names in order; None when the signature cannot be read (stock order used).
        self.params = sig.params if sig is not None else None
        self.kinds: Dict[str, Any] = dict(sig.kinds) if sig is not None else {}
        self.default_values: Dict[str, Any] = dict(sig.defaults) if sig is not None else {}
        self.defaults = frozenset(self.default_values)
        self.absent_reason = absent_reason
        names = {ALIASES.get(p, p) for p in (self.params or ())}
        self.takes_head_mapping = "head_mapping" in names
        self.takes_scales = (self.params is None or all(s in names for s in _SCALES)
                             or "kv_scale" in names)
        self.takes_kv_cache_dtype = self.params is None or "kv_cache_dtype" in names
        self.takes_blocksparse = self.params is None or all(b in names for b in _BLOCKSPARSE)

    @property
    def present(self) -> bool:
        return self.absent_reason is None

    def build_args(self, values: Dict[str, Any], stock_order: Tuple[str, ...]
                   ) -> Tuple[List[Any], Dict[str, Any]]:
        """Positional arguments, and keywords for keyword-only parameters and for those
        after a defaulted parameter left at its default.  A positional-only parameter after
        such a gap gets the skipped defaults passed positionally before it (it cannot be
        passed by keyword)."""
        args: List[Any] = []
        kwargs: Dict[str, Any] = {}
        if self.params is None:  # e.g. a builtin or *args: positional only, stock order
            if "kv_scale" in values:
                stock_order = kv_scale_order(stock_order)
            for param in stock_order:
                if param not in values:
                    break
                args.append(values[param])
            return args, kwargs
        gap: List[Any] = []  # defaults of the parameters skipped since the last positional
        for param in self.params:
            key = ALIASES.get(param, param)
            kind = self.kinds[param]
            if key == "kv_cache_dtype" and not self.takes_scales and param in self.defaults:
                # A kernel without scales only ever sees "auto" caches (see _usable in
                # dispatch); its kv_cache_dtype stays at its default, as its own build
                # passes it (CoreX 3.2.3's V1 gets 11 arguments).
                gap.append(self.default_values[param])
                continue
            if key not in values:
                if param in self.defaults:
                    gap.append(self.default_values[param])  # left at its default
                    continue
                raise TypeError(f"{self.name}: no value for required parameter {param!r}")
            if kind is inspect.Parameter.KEYWORD_ONLY:
                kwargs[param] = values[key]
            elif kind is inspect.Parameter.POSITIONAL_ONLY:
                args.extend(gap)  # cannot go by keyword: fill the gap with the defaults
                gap = []
                args.append(values[key])
            elif gap or kwargs:
                kwargs[param] = values[key]
            else:
                args.append(values[key])
        return args, kwargs

    def describe(self) -> str:
        if not self.present:
            return f"absent ({self.absent_reason})"
        if self.params is None:
            return "present (signature not readable: stock argument order)"
        return f"present ({len(self.params)} parameters)"


class Signature:
    """What ``inspect.signature`` says about a kernel, kept whole: parameter names in order
    with their kinds and defaults, and whether it takes ``*args`` / ``**kwargs``."""

    def __init__(self, func: Callable[..., Any]) -> None:
        self.readable = True
        self.var_positional = self.var_keyword = False
        self.kinds: Dict[str, Any] = {}
        self.defaults: Dict[str, Any] = {}
        try:
            sig = inspect.signature(func)
        except (TypeError, ValueError):
            self.readable = False
            return
        for name, p in sig.parameters.items():
            if p.kind is p.VAR_POSITIONAL:
                self.var_positional = True
            elif p.kind is p.VAR_KEYWORD:
                self.var_keyword = True
            else:
                self.kinds[name] = p.kind
                if p.default is not p.empty:
                    self.defaults[name] = p.default

    @property
    def params(self) -> Optional[Tuple[str, ...]]:
        """Named parameters in order; None when there are none to read (unreadable, or
        ``*args``): the stock order is then used."""
        if not self.readable or self.var_positional:
            return None
        return tuple(self.kinds)


def source_tree(func: Callable[..., Any]) -> Optional[Tuple[ast.Module, Callable[..., Any]]]:
    """The parsed source of ``func`` and the function it was read from, looking through
    ``functools.wraps`` wrappers; None when the source cannot be read (builtins, C ops)."""
    try:
        inner = inspect.unwrap(func)
        return ast.parse(textwrap.dedent(inspect.getsource(inner))), inner
    except (OSError, TypeError, SyntaxError, ValueError):
        return None


def only_raises_not_implemented(func: Callable[..., Any]) -> bool:
    """True when the function's body (after any docstring) is one ``raise
    NotImplementedError[(...)]``.  Wrappers (``functools.wraps``) are looked through; a
    function whose source cannot be read is assumed to be real."""
    parsed = source_tree(func)
    if parsed is None:
        return False
    tree = parsed[0]
    defs = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    if len(defs) != 1:
        return False
    body = list(defs[0].body)
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        body = body[1:]
    if len(body) != 1 or not isinstance(body[0], ast.Raise) or body[0].exc is None:
        return False
    exc = body[0].exc
    if isinstance(exc, ast.Call):
        exc = exc.func
    return isinstance(exc, ast.Name) and exc.id == "NotImplementedError"


def _profile(ops: Any, name: str, stock: Tuple[str, ...]) -> KernelProfile:
    func = getattr(ops, name, None)
    if func is None or not callable(func):
        return KernelProfile(name, None, None, "not defined by the ops module")
    sig = Signature(func)
    reason = None
    if only_raises_not_implemented(func):
        reason = "its body only raises NotImplementedError"
    elif sig.readable and sig.var_keyword and not sig.var_positional:
        # e.g. ``def v1(**kw)``: its parameters cannot be read, so whatever it forwards to
        # would get nothing (or the wrong thing): never called.
        reason = ("it takes **kwargs, so the parameters it needs cannot be read from its "
                  "signature")
    elif sig.params is not None:
        known = set(stock) | set(ALIASES) | {"head_mapping", "kv_scale"}
        unknown = [p for p in sig.params if p not in known and p not in sig.defaults]
        if unknown:
            reason = f"required parameters the dispatch cannot supply: {unknown}"
    return KernelProfile(name, func, sig, reason)


class NativeOps:
    """The native decode kernels of one ops object, profiled once (``NativeOps.of``)."""

    _cache: Dict[int, Tuple[Any, "NativeOps"]] = {}
    _cache_lock = threading.Lock()

    def __init__(self, ops: Any) -> None:
        self.ops = ops
        self.v1 = _profile(ops, "paged_attention_v1", STOCK_V1_PARAMS)
        self.v2 = _profile(ops, "paged_attention_v2", STOCK_V2_PARAMS)
        self._lock = threading.Lock()

    @classmethod
    def of(cls, ops: Any) -> "NativeOps":
        """The profile of ``ops``, built on first use and kept for the process."""
        entry = cls._cache.get(id(ops))
        if entry is not None and entry[0] is ops:
            return entry[1]
        with cls._cache_lock:
            entry = cls._cache.get(id(ops))
            if entry is None or entry[0] is not ops:
                entry = (ops, cls(ops))
                cls._cache[id(ops)] = entry
        return entry[1]

    @classmethod
    def forget_all(cls) -> None:
        """Drop every profile (tests)."""
        with cls._cache_lock:
            cls._cache.clear()

    @property
    def convention(self) -> str:
        """``"vendor"`` when a kernel takes ``head_mapping`` (Iluvatar CoreX 3.x), else
        ``"stock"``."""
        if self.v1.takes_head_mapping or self.v2.takes_head_mapping:
            return "vendor"
        return "stock"

    def kernel(self, which: str) -> KernelProfile:
        return self.v1 if which == "v1" else self.v2

    def call(self, which: str, values: Dict[str, Any]) -> bool:
        """Run kernel ``which`` (``"v1"``/``"v2"``) with the values it accepts.  Returns
        False, and marks the kernel absent for the rest of the process, when it raises
        NotImplementedError (nothing was computed; the caller re-routes)."""
        prof = self.kernel(which)
        stock = STOCK_V1_PARAMS if which == "v1" else STOCK_V2_PARAMS
        args, kwargs = prof.build_args(values, stock)
        assert prof.func is not None
        try:
            prof.func(*args, **kwargs)
        except NotImplementedError as exc:
            self.mark_absent(which, f"raised NotImplementedError when called ({exc or 'no message'})")
            return False
        return True

    def mark_absent(self, which: str, reason: str) -> None:
        prof = self.kernel(which)
        with self._lock:
            if prof.absent_reason is not None:
                return
            prof.absent_reason = reason
        log.warning("vllm-bi100-patch: native %s is unavailable in this build: %s; decode "
                       "no longer routes to it in this process", prof.name, reason)

    def describe(self) -> Dict[str, str]:
        return {"convention": self.convention, "paged_attention_v1": self.v1.describe(),
                "paged_attention_v2": self.v2.describe()}


# --- head_mapping versus num_kv_heads -----------------------------------------------------

_mappings: Dict[Tuple[str, int, int], torch.Tensor] = {}


def kv_heads_of(num_kv_heads: Any, key_cache: torch.Tensor) -> int:
    """The KV head count as an int: ``num_kv_heads`` itself, or, when vLLM passed a
    ``head_mapping`` tensor in its place, the cache's KV head dimension (no device read)."""
    if isinstance(num_kv_heads, torch.Tensor):
        return int(key_cache.shape[1])
    return int(num_kv_heads)


def head_mapping_for(num_kv_heads: Any, num_heads: int, device: torch.device) -> torch.Tensor:
    """The ``head_mapping`` tensor a vendor kernel takes (int32, one entry per query head, on
    the query's device): the one vLLM passed (an int64 one converted to int32 on its device:
    no host read), or ``repeat_interleave(arange(num_kv_heads), num_heads // num_kv_heads)``
    as int32 on ``device`` (built once per device and shape)."""
    if isinstance(num_kv_heads, torch.Tensor):
        if num_kv_heads.dtype != torch.int32:
            return num_kv_heads.to(torch.int32)  # a device kernel, no sync
        return num_kv_heads
    kv = int(num_kv_heads)
    key = (str(device), num_heads, kv)
    mapping = _mappings.get(key)
    if mapping is None:
        mapping = torch.arange(kv, dtype=torch.int32, device=device).repeat_interleave(
            num_heads // kv)  # built on the device: no host-to-device copy
        _mappings[key] = mapping
    return mapping


def check_head_mapping(num_kv_heads: Any, num_heads: int, kv_heads: int,
                       device: Optional[torch.device] = None) -> None:
    """A ``head_mapping`` tensor must have one integer entry per query head and live on the
    query's ``device``, and an int ``num_kv_heads`` must match the cache; checked from
    metadata only (no device read)."""
    if isinstance(num_kv_heads, torch.Tensor):
        if num_kv_heads.dim() != 1 or num_kv_heads.shape[0] != num_heads or \
                num_kv_heads.dtype not in (torch.int32, torch.int64):
            raise ValueError(
                "num_kv_heads was passed as a head_mapping tensor, which must be 1-D int32/int64 "
                f"with one entry per query head ({num_heads}); got shape "
                f"{tuple(num_kv_heads.shape)}, dtype {num_kv_heads.dtype}")
        if device is not None and num_kv_heads.device != device:
            raise ValueError(
                f"num_kv_heads was passed as a head_mapping tensor on {num_kv_heads.device}, "
                f"but the query is on {device}: a kernel cannot read it there (moving it "
                "would copy between devices on every call; build it on the query's device)")
        return
    if isinstance(num_kv_heads, bool) or not isinstance(num_kv_heads, int):
        raise ValueError(f"num_kv_heads must be an int or a head_mapping tensor, got "
                         f"{type(num_kv_heads).__name__} {num_kv_heads!r}")
    if num_kv_heads != kv_heads:
        raise ValueError(f"num_kv_heads={num_kv_heads} does not match the cache's "
                         f"{kv_heads} KV heads")

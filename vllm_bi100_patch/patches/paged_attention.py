"""Replacements for ``PagedAttention.forward_decode`` and ``forward_prefix``.

This module is imported only when ``vllm.attention.ops.paged_attn`` has been imported (torch is
then loaded too). It adapts each signature family's arguments to the kernels' one internal
signature; it never imports vLLM itself (the target module is handed in).

Catalogue entry — ``vllm.attention.ops.paged_attn.PagedAttention.forward_decode``
    Why:     vLLM's native ``paged_attention_v1`` keeps a whole sequence's logits in shared
             memory and fails on long contexts on BI-V100; stock vLLM's V1/V2 rule is tuned for
             NVIDIA SM counts.
    How:     a wrapt ``FunctionWrapper`` (re-wrapped in ``staticmethod``) that reads the
             family's arguments and calls ``kernels.dispatch.decode``: native v1/v2 through the
             module's ``ops`` (ixformer-backed on Iluvatar builds) where safe — V1 only while
             ``max_seq_len`` fits V1's shared memory, the V1/V2 choice from the BI-V100
             occupancy rule — else the pure-PyTorch ``paged_decode``.
    vLLM:    0.5.0 – 0.11.2, families in ``versions.FAMILIES`` (kv_scale vs k_scale/v_scale,
             float vs Tensor scales).
    Upstream: none; the method is gone in 0.12.0 (V0 engine removed).
    Removal: when Iluvatar's vLLM build fixes long-context V1 and its dispatch, or when the
             deployed vLLM is >= 0.12 (the registry already skips it there).

Catalogue entry — ``vllm.attention.ops.paged_attn.PagedAttention.forward_prefix``
    Why:     the stock method launches Triton ``context_attention_fwd``, which hangs BI-V100.
    How:     same wrapper technique; always calls the pure-PyTorch ``paged_prefix`` (tiled under
             ``VLLM_BI100_PREFIX_BUDGET_MB``). Families without ``context_lens`` (0.8.0+) get it
             derived as ``seq_lens - query lengths``; families without ``kv_cache_dtype`` /
             scales (0.5.0 – 0.5.4) use ``"auto"`` and 1.0.
    vLLM:    0.5.0 – 0.11.2.
    Upstream: none; gone in 0.12.0.
    Removal: when a Triton that runs ``context_attention_fwd`` ships on CoreX.
"""

from __future__ import annotations

import atexit
import inspect
import os
import sys
import threading
import types
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from .. import config, hardware
from .._log import log
from ..kernels import paged_prefix
from ..kernels import dispatch  # a submodule, not in kernels.__all__
from ..versions import Family


Wrapper = Callable[[Callable[..., Any], Any, Tuple[Any, ...], Dict[str, Any]], Any]

CALL_COUNTS: Dict[str, int] = {"forward_decode": 0, "forward_prefix": 0, "swap_blocks": 0,
                               "copy_blocks": 0}
_counts_lock = threading.Lock()


def call_counts() -> Dict[str, int]:
    """Calls of each patched method plus the decode routes taken, in this process (each
    group copied under its lock)."""
    with _counts_lock:
        counts = dict(CALL_COUNTS)
    counts.update({f"decode_{k}": v for k, v in dispatch.route_counts().items()})
    return counts


def reset_call_counts() -> None:
    """Zero the call counters and the decode route counters."""
    with _counts_lock:
        for key in CALL_COUNTS:
            CALL_COUNTS[key] = 0
    dispatch.reset_route_counts()


def log_counts() -> None:
    """Log the call and route counters at INFO (at exit, and on request)."""
    counts = call_counts()
    if any(counts.values()):
        log.info("vllm-bi100-patch counters (pid %d): %s", os.getpid(),
                 ", ".join(f"{k}={v}" for k, v in counts.items()))


atexit.register(log_counts)


def _count(name: str) -> None:
    with _counts_lock:
        CALL_COUNTS[name] += 1


class ArgReader:
    """Reads one family's arguments (positional or keyword) into parameter order, cheaply."""

    def __init__(self, params: Sequence[str], defaults: Mapping[str, Any], what: str) -> None:
        self.params = tuple(params)
        self.defaults = dict(defaults)
        self.what = what
        self._names = frozenset(self.params)

    @classmethod
    def for_function(cls, func: Callable[..., Any], params: Sequence[str],
                     what: str) -> "ArgReader":
        sig = inspect.signature(func)
        defaults = {n: p.default for n, p in sig.parameters.items()
                    if p.default is not inspect.Parameter.empty}
        return cls(params, defaults, what)

    def read(self, args: Tuple[Any, ...], kwargs: Mapping[str, Any]) -> List[Any]:
        if len(args) > len(self.params):
            raise TypeError(f"{self.what}() takes {len(self.params)} positional arguments "
                            f"but {len(args)} were given")
        values = list(args)
        for name in self.params[len(args):]:
            if name in kwargs:
                values.append(kwargs[name])
            elif name in self.defaults:
                values.append(self.defaults[name])
            else:
                raise TypeError(f"{self.what}() missing required argument: {name!r}")
        if kwargs:
            extra = set(kwargs) - self._names
            if extra:
                raise TypeError(f"{self.what}() got unexpected keyword arguments: "
                                f"{sorted(extra)}")
            dup = set(kwargs) & set(self.params[:len(args)])
            if dup:
                raise TypeError(f"{self.what}() got multiple values for {sorted(dup)}")
        return values


_native_checked: Dict[int, bool] = {}


def _native_ops(module: types.ModuleType) -> Optional[Any]:
    """The ops module stock vLLM would use for native decode, or None when its kernels are
    not really there (official CUDA wheels on a CPU torch expose the Python wrappers only).
    The answer is cached per ops object; the module's ``ops`` is re-read on every call."""
    ops = vars(module).get("ops")
    if ops is None:
        ops = sys.modules.get("vllm._custom_ops")
    if ops is None:
        return None
    ok = _native_checked.get(id(ops))
    if ok is None:
        ok = _native_checked[id(ops)] = _has_native_kernels(ops)
    return ops if ok else None


def _has_native_kernels(ops: Any) -> bool:
    if not all(hasattr(ops, n) for n in ("paged_attention_v1", "paged_attention_v2")):
        return False
    if getattr(ops, "__name__", "") != "vllm._custom_ops" or hardware.ixformer_present():
        return True  # Iluvatar's ixformer-backed ops, or an ops module handed in on purpose
    try:
        namespace = torch.ops._C
        return (hasattr(namespace, "paged_attention_v1")
                and hasattr(namespace, "paged_attention_v2"))
    except (AttributeError, RuntimeError):
        return False


class _Routing:
    """DecodeRouting built on first use, in the process that decodes (a device query in
    vLLM's front end before it forks workers would break CUDA in the children)."""

    def __init__(self, settings: config.Settings) -> None:
        self.settings = settings
        self._value: Optional[dispatch.DecodeRouting] = None

    def get(self) -> dispatch.DecodeRouting:
        if self._value is None:
            s = self.settings
            self._value = dispatch.DecodeRouting(
                fallback_above=s.decode_fallback_above, sm_count=hardware.sm_count(s.sm_count),
                sm_occupancy=s.sm_occupancy, subscription=s.subscription,
                v1_max_seq_len=v1_max_seq_len(s))
        return self._value


def v1_max_seq_len(settings: config.Settings) -> Optional[int]:
    """V1's length limit: the configured one; Iluvatar's 32,768 when this is an Iluvatar
    machine (ixformer, a CoreX torch, or an Iluvatar device); else None, which lets the
    dispatch decide by the ops convention (vendor 32,768, stock 8,192)."""
    if settings.v1_max_seq_len is not None:
        return settings.v1_max_seq_len
    if hardware.looks_like_iluvatar() or hardware.device_facts().get("iluvatar"):
        return dispatch.ILUVATAR_V1_MAX_SEQ_LEN
    return None


#: The module and routing of the last decode patch, for ``native_profile()``.
_profiled: Dict[str, Any] = {}


def describe_native(module: types.ModuleType, settings: config.Settings) -> Dict[str, Any]:
    """``dispatch.describe`` for ``module``'s ops under ``settings`` (doctor)."""
    return dispatch.describe(_native_ops(module), _Routing(settings).get())


def native_profile() -> Optional[Dict[str, Any]]:
    """The native-ops profile of the patched module and the route each length band takes
    (None before the decode patch was applied)."""
    module, routing = _profiled.get("module"), _profiled.get("routing")
    if module is None or routing is None:
        return None
    return dispatch.describe(_native_ops(module), routing.get())


def make_decode_wrapper(family: Family, original: Callable[..., Any],
                        module: types.ModuleType, settings: config.Settings) -> Wrapper:
    reader = ArgReader.for_function(original, family.decode_params, "forward_decode")
    names = reader.params
    routing = _Routing(settings)
    _profiled.update(module=module, routing=routing)

    def forward_decode(wrapped: Callable[..., Any], instance: Any,
                       args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        values = dict(zip(names, reader.read(args, kwargs)))  # by name: every family
        _count("forward_decode")
        return dispatch.decode(**values, ops=_native_ops(module), routing=routing.get())

    return forward_decode


def make_prefix_wrapper(family: Family, original: Callable[..., Any],
                        module: types.ModuleType, settings: config.Settings) -> Wrapper:
    reader = ArgReader.for_function(original, family.prefix_params, "forward_prefix")
    index = {name: i for i, name in enumerate(family.prefix_params)}
    budget = settings.prefix_budget_mb

    def forward_prefix(wrapped: Callable[..., Any], instance: Any,
                       args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        v = reader.read(args, kwargs)
        _count("forward_prefix")
        query_start_loc = v[index["query_start_loc"]]
        seq_lens = v[index["seq_lens_tensor"]]
        if "context_lens" in index:
            context_lens = v[index["context_lens"]]
        else:
            context_lens = seq_lens - (query_start_loc[1:] - query_start_loc[:-1])
        window = v[index["sliding_window"]]
        if window is not None and window <= 0:
            window = None
        return paged_prefix(
            v[index["query"]], v[index["key"]], v[index["value"]], v[index["key_cache"]],
            v[index["value_cache"]], v[index["block_tables"]], query_start_loc, seq_lens,
            context_lens, alibi_slopes=v[index["alibi_slopes"]], sliding_window=window,
            kv_cache_dtype=v[index["kv_cache_dtype"]] if "kv_cache_dtype" in index else "auto",
            k_scale=v[index["k_scale"]] if "k_scale" in index else 1.0,
            v_scale=v[index["v_scale"]] if "v_scale" in index else 1.0,
            budget_mb=budget)

    return forward_prefix

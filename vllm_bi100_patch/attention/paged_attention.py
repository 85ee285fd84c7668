"""Replacements for ``PagedAttention.forward_decode`` and ``forward_prefix``.

Their catalogue entries (why, how, vLLM versions, upstream, removal) are the ``decode`` and
``prefix`` rows of ``vllm_bi100_patch.patching.table``.  This module is imported only when
``vllm.attention.ops.paged_attn`` has been imported (torch is then loaded too) and never
imports vLLM itself (the target module is handed in).  Each wrapper reads its family's
arguments once: decode turns them into one ``native.DecodeCall`` for the ``NativeDecoder``
built at patch time; prefix calls ``kernels.paged_prefix``.
"""

from __future__ import annotations

import types
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

from ..activation import config
from ..patching import hardware
from ..patching.counting import metrics
from . import native
from .native.settings import routing_for
from .kernels import paged_prefix
from .kernels.prefill.prefix import PrefixStats
from .native import DecodeCall, NativeDecoder
from ..patching.versions import Family
from ..patching.factories import ArgReader, Wrapper, counter

DECODE_CALLS = counter("forward_decode")
PREFIX_CALLS = counter("forward_prefix")


def decoder_for(module: types.ModuleType, settings: config.Settings) -> NativeDecoder:
    """The native decoder for the ops ``module`` uses (see ``native.for_module``)."""
    return native.for_module(module, lambda: routing_for(settings), hardware.ixformer_present(),
                             settings.prefix_budget_mb)


#: The decoder of the last decode patch and its module, for ``native_profile()``.
_patched: Dict[str, Any] = {}


def describe_native(module: types.ModuleType, settings: config.Settings) -> Dict[str, Any]:
    """What ``module``'s decode does under ``settings`` (doctor): the patched decoder's own
    description when this process patched ``module``, else a decoder built as the patch
    would build it."""
    if _patched.get("module") is module:
        return native_profile() or {}
    return decoder_for(module, settings).describe()


def native_profile() -> Optional[Dict[str, Any]]:
    """The patched decoder's probe and the route each case takes (None before the decode
    patch was applied)."""
    decoder = _patched.get("decoder")
    return decoder.describe() if decoder is not None else None


def decode_call(v: Mapping[str, Any]) -> DecodeCall:
    """vLLM's ``forward_decode`` arguments, by name (any family), as one checked
    ``DecodeCall`` (``DecodeCall.checked``: ValueError names a bad argument): ``kv_scale``
    (vLLM 0.5.0 - 0.5.2) used for K and V, the blocksparse parameters at their defaults where
    the family lacks them."""
    kv_scale = v.get("kv_scale")
    k_scale, v_scale = ((kv_scale, kv_scale) if kv_scale is not None else
                        (v.get("k_scale", 1.0), v.get("v_scale", 1.0)))
    return DecodeCall.checked(v["query"], v["key_cache"], v["value_cache"], v["block_tables"],
                              v["seq_lens"], v["max_seq_len"], v["kv_cache_dtype"],
                              v["num_kv_heads"], v["scale"], v["alibi_slopes"], k_scale, v_scale,
                              kv_scale, v.get("tp_rank", 0),
                              (v.get("blocksparse_local_blocks", 0),
                               v.get("blocksparse_vert_stride", 0),
                               v.get("blocksparse_block_size", 64),
                               v.get("blocksparse_head_sliding_step", 0)))


def make_decode_wrapper(family: Family, original: Callable[..., Any],
                        module: types.ModuleType, settings: config.Settings) -> Wrapper:
    reader = ArgReader.for_function(original, family.decode_params, "forward_decode",
                                    DECODE_CALLS)
    names = reader.params
    decoder = decoder_for(module, settings)
    if settings.metrics_interval_s:  # metrics (issue 23): route, reason, max_seq_len per call
        decoder.observer = metrics.TALLY.decode_observer()
    _patched.update(module=module, decoder=decoder)

    def forward_decode(wrapped: Callable[..., Any], instance: Any,
                       args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        try:
            values = dict(zip(names, reader.read(args, kwargs)))  # by name: every family
            return decoder.decode(decode_call(values))
        except Exception as exc:  # metrics (issue 23): refusals counted here, no extra frame
            metrics.TALLY.refused("decode", exc)
            raise

    return metrics.counts_own_refusals(forward_decode)


def make_prefix_wrapper(family: Family, original: Callable[..., Any],
                        module: types.ModuleType, settings: config.Settings) -> Wrapper:
    reader = ArgReader.for_function(original, family.prefix_params, "forward_prefix",
                                    PREFIX_CALLS)
    index = {name: i for i, name in enumerate(family.prefix_params)}
    budget = settings.prefix_budget_mb

    def forward_prefix(wrapped: Callable[..., Any], instance: Any,
                       args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        v = reader.read(args, kwargs)
        query_start_loc = v[index["query_start_loc"]]
        seq_lens = v[index["seq_lens_tensor"]]
        if "context_lens" in index:
            context_lens = v[index["context_lens"]]
        else:
            context_lens = seq_lens - (query_start_loc[1:] - query_start_loc[:-1])
        window = v[index["sliding_window"]]
        if window is not None and window <= 0:
            window = None
        stats = PrefixStats()  # metrics (issue 23): what the kernel did, counted below
        out = paged_prefix(
            v[index["query"]], v[index["key"]], v[index["value"]], v[index["key_cache"]],
            v[index["value_cache"]], v[index["block_tables"]], query_start_loc, seq_lens,
            context_lens, alibi_slopes=v[index["alibi_slopes"]], sliding_window=window,
            kv_cache_dtype=v[index["kv_cache_dtype"]] if "kv_cache_dtype" in index else "auto",
            k_scale=v[index["k_scale"]] if "k_scale" in index else 1.0,
            v_scale=v[index["v_scale"]] if "v_scale" in index else 1.0,
            budget_mb=budget, stats=stats)
        metrics.TALLY.prefix(stats)
        return out

    return forward_prefix

"""Pure-PyTorch prefix (chunked-prefill) attention over a paged KV cache.

Replaces vLLM's Triton ``context_attention_fwd``, which hangs Iluvatar BI-V100 cards.  For
each sequence, its new tokens attend causally to the sequence's cached context (read from
the paged cache) and to the new tokens up to themselves (read from ``key``/``value``).

This module validates the call; ``prefill._attend`` runs it, on the same code as the dense prompt
attention (``dense.varlen_attention``): every query row's output is bit-identical however
the prompt was sliced (one chunk, chunked prefill at any size, a prefix-cache hit of any
length, any batch mates), and equal to the dense kernel's for the same prompt (see
``prefill._plan`` for the tiling that makes it so).  Paths, per row:

- the SDPA path (``prefill._sdpa``): CPU only, on a torch whose CPU flash kernel was
  verified, float32/bfloat16, no ALiBi: absolute query tiles over contiguous K/V;
- the tiled path (``prefill._tiled``): everything else, and every GPU: plain matrix
  products, one softmax per absolute query tile and elementwise ops, peak memory under the
  budget (down to tiles of one query row: a row's scores over its whole context).
"""

from __future__ import annotations

from typing import List, Optional

import torch

from ....activation.log import log
from ..cache import (
    ScaleLike,
    ceil_div,
    check_alibi,
    check_cache,
    check_heads,
    check_int_tensor,
    scale_factor,
)
from ..forced import forcing
from ._attend import PrefixStats, attend
from ._plan import PrefixInputs, SeqSpan, sdpa_path_ok

__all__ = ["DEFAULT_BUDGET_MB", "PrefixStats", "alibi_window", "paged_prefix", "sdpa_path_ok"]

#: Peak extra memory per call when the caller passes no budget (the shim passes its
#: ``VLLM_BI100_PREFIX_BUDGET_MB`` setting, whose default is the same).
DEFAULT_BUDGET_MB = 256


def paged_prefix(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    context_lens: torch.Tensor,
    *,
    scale: Optional[float] = None,
    alibi_slopes: Optional[torch.Tensor] = None,
    sliding_window: Optional[int] = None,
    kv_cache_dtype: str = "auto",
    k_scale: ScaleLike = 1.0,
    v_scale: ScaleLike = 1.0,
    budget_mb: Optional[int] = None,
    stats: Optional[PrefixStats] = None,
) -> torch.Tensor:
    """Causal attention of new tokens over their cached context plus themselves.

    Args:
        query: ``[num_tokens, num_heads, head_size]`` new tokens of all sequences, packed.
        key, value: ``[num_tokens, num_kv_heads, head_size]`` the new tokens' K/V (not
            read back from the cache).
        key_cache, value_cache: the paged caches in vLLM's layout.
        block_tables: ``[batch, max_blocks]`` physical block ids per sequence.
        query_start_loc: ``[batch + 1]`` offsets of each sequence's tokens in ``query``.
        seq_lens: ``[batch]`` context + new tokens per sequence.
        context_lens: ``[batch]`` tokens already in the cache per sequence.
        scale: softmax scale; ``None`` means ``head_size ** -0.5``.
        alibi_slopes: optional ``[num_heads]``; bias ``slope * (key_pos - query_pos)``.
        sliding_window: a query at position ``p`` sees keys at positions ``> p - window``;
            ignored with ALiBi, as vLLM's own ALiBi kernels do (``alibi_window``).
        kv_cache_dtype, k_scale, v_scale: as in ``paged_decode``; with an fp8 cache the
            new tokens' K/V are rounded through fp8 exactly as the cache write stores them
            (``kv_write.quantize_fp8``), so that a token reads the same new or cached.
        budget_mb: peak extra memory per call in MiB; ``None`` means
            ``DEFAULT_BUDGET_MB`` (256).  The kernel never reads the environment: the shim
            passes its ``VLLM_BI100_PREFIX_BUDGET_MB`` setting.
        stats: a ``PrefixStats`` to fill in with what this call did (paths, tokens, float32
            re-runs); ``None``: nothing is recorded.

    Returns:
        ``[num_tokens, num_heads, head_size]`` in the query's dtype.  Rows not covered by
        ``query_start_loc`` are zeros.  Cache slots past a sequence's context and blocks
        behind padding entries of its block-table row are never read into the result.

    Raises:
        ValueError: disagreeing shapes/dtypes, ``seq_lens != context_lens + new tokens``,
            a block table too short for a context, block ids out of range (CPU only).
    """
    if not isinstance(query, torch.Tensor) or query.dim() != 3:
        raise ValueError("query must be 3-D [num_tokens, num_heads, head_size], got shape "
                         f"{tuple(getattr(query, 'shape', ()))}")
    num_tokens, num_heads, head_size = query.shape
    spec = check_cache(key_cache, value_cache, query.dtype, kv_cache_dtype)
    group = check_heads(num_heads, head_size, spec)
    kv_shape = (num_tokens, spec.num_kv_heads, head_size)
    for name, t in (("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != kv_shape:
            raise ValueError(f"{name} must have shape {kv_shape} [num_tokens, num_kv_heads, "
                             f"head_size], got {tuple(getattr(t, 'shape', ()))}")
        if t.dtype != query.dtype:
            raise ValueError(f"{name} dtype {t.dtype} != query dtype {query.dtype}")
        if t.device != query.device:
            raise ValueError(f"{name} is on {t.device} but query is on {query.device}")
    check_int_tensor(query_start_loc, "query_start_loc", (None,))
    batch = query_start_loc.shape[0] - 1
    if batch < 0:
        raise ValueError("query_start_loc must have batch + 1 >= 1 entries, got shape "
                         f"{tuple(query_start_loc.shape)}")
    check_int_tensor(block_tables, "block_tables", (batch, None))
    check_int_tensor(seq_lens, "seq_lens", (batch,))
    check_int_tensor(context_lens, "context_lens", (batch,))
    check_alibi(alibi_slopes, num_heads)
    if sliding_window is not None and int(sliding_window) < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
    window = None if sliding_window is None else int(sliding_window)
    q_scale = scale_factor(head_size ** -0.5 if scale is None else scale, "scale")
    budget = DEFAULT_BUDGET_MB if budget_mb is None else int(budget_mb)
    if budget < 1:
        raise ValueError(f"budget_mb must be >= 1, got {budget_mb}")

    # One host read of the small index tensors per call (needed to slice per sequence).
    starts: List[int] = query_start_loc.tolist()
    contexts: List[int] = context_lens.tolist()
    _check_lengths(starts, contexts, seq_lens.tolist(), num_tokens, block_tables.shape[1],
                   spec.block_size)
    if query.device.type == "cpu" and batch > 0:
        _check_block_ids(block_tables, contexts, spec.block_size, spec.num_blocks)

    fp8 = kv_cache_dtype if spec.fp8 else None
    slopes = None if alibi_slopes is None else alibi_slopes.to(
        device=query.device, dtype=torch.float32).view(spec.num_kv_heads, group)
    inp = PrefixInputs(
        query, key, value, key_cache, value_cache, spec, q_scale,
        alibi_window(window, slopes is not None), slopes,
        k_mult=scale_factor(k_scale, "k_scale") if fp8 else None,
        v_mult=scale_factor(v_scale, "v_scale") if fp8 else None, fp8=fp8)
    # Block ids index the caches as they are (int32 or int64: no conversion op).
    tables = block_tables if block_tables.dtype in (torch.int32, torch.int64) else \
        block_tables.to(torch.int64)
    out = torch.empty_like(query)
    # Every sequence's rows are written; rows outside ``query_start_loc`` are zeros.
    if starts[0] > 0:
        out[:starts[0]].zero_()
    if starts[-1] < num_tokens:
        out[starts[-1]:].zero_()
    seqs = [SeqSpan(starts[i], starts[i + 1] - starts[i], contexts[i], tables[i])
            for i in range(batch)]
    attend(inp, seqs, budget << 20, out, forcing().path, stats=stats)
    return out


def alibi_window(window: Optional[int], alibi: bool) -> Optional[int]:
    """The sliding window to apply: none with ALiBi, as vLLM's own ALiBi prompt and prefix
    kernels do (``_make_alibi_bias`` in ``vllm/attention/backends/xformers.py`` builds no
    local mask, ``_fwd_kernel_alibi`` in ``vllm/attention/ops/prefix_prefill.py`` takes no
    window; vLLM 0.6.3), logged once."""
    if window is None or not alibi:
        return window
    if not _ALIBI_WINDOW_LOGGED:
        _ALIBI_WINDOW_LOGGED.append(True)
        log.warning("prefix/dense attention: ALiBi with a sliding window of %d: the window "
                    "is ignored, as vLLM's own ALiBi kernels do", window)
    return None


_ALIBI_WINDOW_LOGGED: List[bool] = []


def _check_lengths(starts: List[int], contexts: List[int], totals: List[int], num_tokens: int,
                   table_width: int, block_size: int) -> None:
    """``query_start_loc``, ``context_lens`` and ``seq_lens`` agree with each other and
    the block table's width."""
    if any(a < 0 or b < a or b > num_tokens for a, b in zip(starts, starts[1:])):
        raise ValueError(f"query_start_loc must be non-decreasing within [0, {num_tokens}], "
                         f"got {starts}")
    for i in range(len(contexts)):
        q_len = starts[i + 1] - starts[i]
        if contexts[i] < 0 or totals[i] != contexts[i] + q_len:
            raise ValueError(
                f"seq_lens[{i}]={totals[i]} must equal context_lens[{i}]={contexts[i]} + "
                f"new tokens {q_len} (from query_start_loc)")
        if contexts[i] > table_width * block_size:
            raise ValueError(
                f"block_tables too short: context_lens[{i}]={contexts[i]} needs "
                f"{ceil_div(contexts[i], block_size)} blocks of {block_size}, block_tables "
                f"has {table_width} columns (vLLM 0.5.4 - 0.6.3 give a chunk past a cached "
                "prefix only the cached blocks, vLLM pull request #9532; the shim's "
                "prefix_block_table row fixes that metadata: see `vllm-bi100-patch doctor`, "
                "and VLLM_BI100_PATCH_DISABLE must not name it)")


def _check_block_ids(block_tables: torch.Tensor, contexts: List[int], block_size: int,
                     num_blocks: int) -> None:
    """Block ids a context uses must exist in the cache (CPU tensors: read as lists, free to
    check)."""
    for i, ctx in enumerate(contexts):
        ids = block_tables[i, :ceil_div(ctx, block_size)].tolist()
        if not ids:
            continue
        lo, hi = min(ids), max(ids)
        if lo < 0 or hi >= num_blocks:
            bad = lo if lo < 0 else hi
            raise ValueError(f"block_tables[{i}, {ids.index(bad)}] = {bad} is out of range for "
                             f"a cache of {num_blocks} blocks")

"""Staging a sequence's keys and values for one absolute key range, from the cache and from
the new tokens alike.

``stage_keys``/``stage_values`` fill K ``[kv, n, D]`` and V ``[kv, n, cols]`` (work dtype; the
extra columns start with a one, see ``prefill._plan.value_columns``) for positions
``[a, b)``; ``key_parts`` gives the keys of a range without copying the cached ones:
positions before the sequence's cached context end come from the paged cache (whole blocks,
``a`` is block-aligned), positions from there to the sequence's end from ``key``/``value``
(written after the cache part, so a block that straddles the boundary is assembled from
both), and positions past the end are zeros.  There is one code path whatever the split
between cached and new tokens: the staged operands of a position are the same numbers in
every slicing.  fp8 caches: the new tokens' K/V are rounded through fp8 exactly as the cache
write does (``kv_write.quantize_fp8``) and dequantised like the cached ones, so a token
reads the same whether it is new in this call or cached by an earlier one.

``new_tokens`` gives the new tokens' K/V in a dtype with that same treatment (the SDPA path
uses it).  Inputs are never written.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from ..cache import ceil_div, fp8_dtype
from .._gather import gather_keys, gather_values
from ._plan import PrefixInputs, SeqSpan
from ..kv_write import quantize_fp8

__all__ = ["key_parts", "new_tokens", "stage_keys", "stage_values"]


def new_tokens(inp: PrefixInputs, seq: SeqSpan, p0: int, p1: int, dtype: torch.dtype
               ) -> Tuple[torch.Tensor, torch.Tensor]:
    """K and V ``[p1 - p0, kv, D]`` in ``dtype`` of the sequence's new-token positions
    ``[p0, p1)``, rounded through the fp8 cache format when the cache is fp8."""
    a = seq.key_start + p0 - seq.ctx
    k, v = inp.key[a:a + p1 - p0], inp.value[a:a + p1 - p0]
    if inp.fp8 is None:
        return k.to(dtype), v.to(dtype)
    f8 = fp8_dtype(inp.fp8)
    assert inp.k_mult is not None and inp.v_mult is not None
    kq = quantize_fp8(k, inp.k_mult, inp.fp8).view(f8).to(dtype).mul_(inp.k_mult)
    vq = quantize_fp8(v, inp.v_mult, inp.fp8).view(f8).to(dtype).mul_(inp.v_mult)
    return kq, vq


def _cached_keys(inp: PrefixInputs, seq: SeqSpan, a: int, end: int, dtype: torch.dtype,
                 out: Optional[torch.Tensor]) -> torch.Tensor:
    """The cached keys of whole blocks from ``a`` (block-aligned) through position
    ``end - 1``, ``[kv, blocks * block_size, D]`` in ``dtype`` (into ``out`` when given),
    fp8 dequantised.  Slots past ``end`` in the last block are whatever the cache holds."""
    assert inp.spec is not None and inp.key_cache is not None and seq.table is not None
    spec = inp.spec
    bs, kv, d = spec.block_size, spec.num_kv_heads, spec.head_size
    b0, b1 = a // bs, ceil_div(end, bs)
    ids = seq.table[b0:b1]
    n = (b1 - b0) * bs
    keys = gather_keys(inp.key_cache, ids, 1, b1 - b0, spec, dtype,
                       out=None if out is None else out.view(kv, 1, n, d)).view(kv, n, d)
    if inp.k_mult is not None:
        keys[:, :end - a].mul_(inp.k_mult)
    return keys


def stage_values(inp: PrefixInputs, seq: SeqSpan, a: int, b: int, values: torch.Tensor,
                 hidden_before: Optional[int] = None) -> None:
    """Fill ``values`` ``[kv, b - a, cols]`` (a view in the work dtype) for positions
    ``[a, b)``: the ones column, the cached values, the new tokens' (written after the
    cached ones: a block straddling the boundary is assembled from both), zeros past the
    sequence's end; value slots before ``hidden_before`` (no query of the call sees them:
    the sliding window) are zeroed, so that nothing read there (a NaN) reaches ``P.V``."""
    d = inp.head_size
    dtype = values.dtype
    values[:, :, d].fill_(1)
    ctx_end = min(b, seq.ctx)
    if ctx_end > a:
        assert inp.spec is not None and inp.value_cache is not None and seq.table is not None
        spec = inp.spec
        bs = spec.block_size
        b0, b1 = a // bs, ceil_div(ctx_end, bs)
        gather_values(inp.value_cache, seq.table[b0:b1], 1, b1 - b0, spec, dtype,
                      out=values[:, :(b1 - b0) * bs, :d].unsqueeze(1))
        if inp.v_mult is not None:
            values[:, :ctx_end - a, :d].mul_(inp.v_mult)
    n0, n1 = max(a, seq.ctx), min(b, seq.end)
    if n1 > n0:
        _, v = new_tokens(inp, seq, n0, n1, dtype) if inp.fp8 else (None, inp.value[
            seq.key_start + n0 - seq.ctx:seq.key_start + n1 - seq.ctx])
        values[:, n0 - a:n1 - a, :d].copy_(v.transpose(0, 1))
    pad = max(a, seq.end)
    if pad < b:
        values[:, pad - a:, :d].zero_()
    if hidden_before is not None and hidden_before > a:
        values[:, :min(b, hidden_before) - a, :d].zero_()


def stage_keys(inp: PrefixInputs, seq: SeqSpan, a: int, b: int, keys: torch.Tensor) -> None:
    """Fill ``keys`` ``[kv, b - a, D]`` (a view in the work dtype) for positions ``[a, b)`` as
    ``stage_values`` does."""
    d = inp.head_size
    dtype = keys.dtype
    ctx_end = min(b, seq.ctx)
    if ctx_end > a:
        assert inp.spec is not None
        bs = inp.spec.block_size
        n = (ceil_div(ctx_end, bs) - a // bs) * bs
        _cached_keys(inp, seq, a, ctx_end, dtype, keys[:, :n, :d])
    n0, n1 = max(a, seq.ctx), min(b, seq.end)
    if n1 > n0:
        k, _ = new_tokens(inp, seq, n0, n1, dtype) if inp.fp8 else (inp.key[
            seq.key_start + n0 - seq.ctx:seq.key_start + n1 - seq.ctx], None)
        keys[:, n0 - a:n1 - a, :d].copy_(k.transpose(0, 1))
    pad = max(a, seq.end)
    if pad < b:
        keys[:, pad - a:, :d].zero_()


def key_parts(inp: PrefixInputs, seq: SeqSpan, a: int, b: int, dtype: torch.dtype
              ) -> List[Tuple[int, torch.Tensor]]:
    """The keys of ``[a, b)`` without a staging copy, as ``(first position, [kv, n, D])``
    parts: the cached blocks as gathered, then the new tokens (a view of ``key`` where its
    layout allows, else one copy).  Positions past the sequence's end are in no part; a
    straddling block's new slots are in both (the later part wins)."""
    parts: List[Tuple[int, torch.Tensor]] = []
    ctx_end = min(b, seq.ctx)
    if ctx_end > a:
        parts.append((a, _cached_keys(inp, seq, a, ctx_end, dtype, None)))
    n0, n1 = max(a, seq.ctx), min(b, seq.end)
    if n1 > n0:
        k, _ = new_tokens(inp, seq, n0, n1, dtype)
        part = k.transpose(0, 1)
        if not (k.shape[1] == 1 and k.is_contiguous()):
            part = part.contiguous()
        parts.append((n0, part))
    return parts

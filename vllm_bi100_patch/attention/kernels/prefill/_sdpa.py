"""The SDPA path of the prefix and dense kernels (CPU only, see
``prefill._plan.sdpa_path_ok``).

A sequence's keys and values are gathered into one head-major ``[kv_heads, positions,
head_size]`` buffer in the query's dtype (its head stride the SDPA path's capacity, a
function of the budget) (the cached context from the paged cache, fp8
caches dequantised; then the new tokens, rounded through fp8 like the cache write when the
cache is fp8; zeros past the sequence's end).  Queries run in absolute tiles of
``SDPA_QUERY_TILE`` positions: one ``scaled_dot_product_attention`` per tile (``enable_gqa``),
its rows padded with zeros where the call has no query, its keys ``[lo, tile end)`` with
``lo`` 0 (or the window's start for the tile's first position) and a boolean
causal/sliding-window mask.  So every call that contains a position gives the flash kernel
the same shapes, strides and buffer alignment for it (its blocking depends on them) and the
same operands: the position's output row is the same however the prompt was sliced (the
query tile is always a copy into one zero-padded buffer, the mask made per tile, the keys
and values a slice of buffers whose strides do not depend on the call's length).  Only the
first ``context`` cached slots are copied: nothing past a sequence's end is read into the
buffer.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

from ..cache import CacheSpec, ScaleLike, ceil_div, to_float
from ._plan import SDPA_QUERY_TILE, PrefixInputs, SeqSpan
from ._stage import new_tokens

__all__ = ["sdpa_rows"]

#: Test hook: called with ``("sdpa", tile, first key, end key)`` before each tile's call.
TRACE: Optional[Callable[[tuple], None]] = None


def sdpa_rows(inp: PrefixInputs, seq: SeqSpan, rows: int, out: torch.Tensor,
              capacity: Optional[int] = None) -> None:
    """Attend the sequence's first ``rows`` query rows; writes their rows of ``out``.
    ``capacity``: the positions the SDPA path may reach (``prefill._plan.sdpa_max_end``),
    the K/V buffers' head stride; ``None`` (the path forced beyond the budget) takes the
    call's own length."""
    query, qt = inp.query, SDPA_QUERY_TILE
    kv, d, dtype = inp.kv_heads, inp.head_size, query.dtype
    start, ctx = seq.start, seq.ctx
    assert isinstance(inp.q_scale, float) and seq.causal
    t0, t1 = ctx // qt, ceil_div(ctx + rows, qt)
    tokens = t1 * qt
    # Head-major [kv, capacity, D], each head's keys contiguous (what the flash kernel reads
    # fastest), the head stride a function of the budget only: a tile's K/V slice has the
    # same strides (its offset depends on the tile only) whatever the call's length.  Only
    # the positions below ``tokens`` are ever written.
    cap = max(tokens, capacity or 0)
    keys = torch.empty((kv, cap, d), dtype=dtype, device=query.device)[:, :tokens]
    values = torch.empty((kv, cap, d), dtype=dtype, device=query.device)[:, :tokens]
    if ctx > 0:
        assert inp.spec is not None and seq.table is not None
        ids = seq.table[:ceil_div(ctx, inp.spec.block_size)]
        _gather_context_keys(keys, inp.key_cache, ids, ctx, inp.spec, inp.k_mult)
        _gather_context_values(values, inp.value_cache, ids, ctx, inp.spec, inp.v_mult)
    end = min(seq.end, tokens)
    k_new, v_new = new_tokens(inp, seq, ctx, end, dtype)
    keys[:, ctx:end].copy_(k_new.transpose(0, 1))
    values[:, ctx:end].copy_(v_new.transpose(0, 1))
    keys[:, end:].zero_()
    values[:, end:].zero_()
    del k_new, v_new
    window = inp.window
    if window is not None and ctx - window + 1 > 0:
        # Slots before the first query's window: no query of the call sees them; zeroed so
        # that nothing read there (a NaN) reaches the scores or the weighted sums (a mask
        # adds -inf, and -inf + NaN is NaN).
        keys[:, :ctx - window + 1].zero_()
        values[:, :ctx - window + 1].zero_()
    heads = query.shape[1]
    pad: Optional[torch.Tensor] = None
    for t in range(t0, t1):
        p0 = t * qt
        r0, r1 = max(p0, ctx) - ctx, min(p0 + qt, ctx + rows) - ctx  # the call's rows
        # Always the same buffer (strides, alignment), zeros for the positions this call
        # has no query for.
        if pad is None:
            pad = torch.zeros((1, heads, qt, d), dtype=dtype, device=query.device)
        elif r1 - r0 < qt:
            pad.zero_()
        q = pad
        q[0, :, ctx + r0 - p0:ctx + r1 - p0].copy_(query[start + r0:start + r1].transpose(0, 1))
        lo = 0 if window is None else max(0, p0 - window + 1)
        # Row i sees key lo + j iff p0 - lo - window + 1 <= j - i <= p0 - lo (made per tile:
        # its layout is the tile's in every call).
        mask = torch.ones((qt, p0 + qt - lo), dtype=torch.bool, device=query.device)
        mask.tril_(p0 - lo)
        if window is not None:
            mask.triu_(p0 - lo - window + 1)
        if TRACE is not None:
            TRACE(("sdpa", t, lo, p0 + qt))
        res = F.scaled_dot_product_attention(
            q, keys[:, lo:p0 + qt].unsqueeze(0), values[:, lo:p0 + qt].unsqueeze(0),
            attn_mask=mask, scale=inp.q_scale, enable_gqa=True)
        out[start + r0:start + r1] = res[0, :, ctx + r0 - p0:ctx + r1 - p0].transpose(0, 1)


def _gather_context_keys(dest: torch.Tensor, key_cache: Optional[torch.Tensor],
                         ids: torch.Tensor, ctx: int, spec: CacheSpec,
                         mult: Optional[ScaleLike]) -> None:
    """Copy the first ``ctx`` cached keys into ``dest[:, :ctx]`` (``[kv, tokens, D]``).

    Each ``x`` group is 16 bytes, so the ``[D // x, block_size]`` transpose moves them as
    complex128 units (bit-exact, 16-byte inner loop) straight into ``dest`` when no
    dequantisation is needed; fp8 caches are staged, converted and scaled.
    """
    assert key_cache is not None
    kv, bs, chunks = spec.num_kv_heads, spec.block_size, spec.head_size // spec.x
    n = ids.shape[0]
    raw = key_cache.index_select(0, ids).view(torch.complex128).view(n, kv, chunks, bs)
    if not spec.fp8:
        target = dest.view(torch.complex128)  # [kv, tokens, chunks]
    else:
        target = torch.empty((kv, ctx, chunks), dtype=torch.complex128, device=dest.device)
    _copy_blocks(target, raw.permute(1, 0, 3, 2), ctx, bs)
    del raw
    if spec.fp8:
        staged = to_float(target.view(spec.storage_dtype), spec).view(kv, ctx, spec.head_size)
        dest[:, :ctx].copy_(staged)
        del staged, target
        assert mult is not None
        dest[:, :ctx].mul_(mult)


def _gather_context_values(dest: torch.Tensor, value_cache: Optional[torch.Tensor],
                           ids: torch.Tensor, ctx: int, spec: CacheSpec,
                           mult: Optional[ScaleLike]) -> None:
    """Copy the first ``ctx`` cached values into ``dest[:, :ctx]`` (a ``[D, bs]`` transpose
    per block, converting fp8 on the way) and apply the fp8 scale."""
    assert value_cache is not None
    raw = to_float(value_cache.index_select(0, ids), spec)  # [n, kv, D, bs]
    _copy_blocks(dest, raw.permute(1, 0, 3, 2), ctx, spec.block_size)
    del raw
    if spec.fp8:
        assert mult is not None
        dest[:, :ctx].mul_(mult)


def _copy_blocks(dest: torch.Tensor, src: torch.Tensor, ctx: int, bs: int) -> None:
    """``dest[:, :ctx] = src`` flattened over (block, slot): ``src`` is ``[kv, n, bs, E]``
    (not mergeable into a view), ``dest`` ``[kv, >= ctx, E]``; the last block may be partial."""
    kv, e = dest.shape[0], dest.shape[2]
    full = ctx // bs
    if full:
        dest[:, :full * bs].view(kv, full, bs, e).copy_(src[:, :full])
    rem = ctx - full * bs
    if rem:
        dest[:, full * bs:ctx].copy_(src[:, full, :rem])

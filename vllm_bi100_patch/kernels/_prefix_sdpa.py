"""The SDPA path of ``paged_prefix`` (CPU only, see ``_prefix_plan.sdpa_path_ok``).

The sequence's context K/V are gathered from the paged cache into one contiguous
``[kv_heads, context + new, head_size]`` buffer (fp8 caches dequantised into the query's
dtype), followed by the new tokens' K/V, and ``scaled_dot_product_attention`` runs once
per query chunk with ``enable_gqa=True`` (or K/V repeated per query head on a torch
without it) and a boolean causal/sliding-window mask ``[chunk, keys]`` (query ``i`` at
position ``context + i`` sees keys ``<= context + i`` and ``> pos - window``; a query
always sees itself, so no row is fully masked).  Only the first ``context`` cached slots
are copied: nothing past a sequence's end is read into the buffer.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ._common import CacheSpec, ScaleLike, ceil_div, to_float
from ._prefix_plan import _TORCH_RELEASE, PrefixInputs, SeqSpan

__all__ = ["sdpa_sequence"]

#: torch < 2.5 has no ``enable_gqa``: K/V heads are then repeated for each query head.
_HAS_GQA = _TORCH_RELEASE >= (2, 5)


def sdpa_sequence(inp: PrefixInputs, seq: SeqSpan, q_chunk: int, out: torch.Tensor) -> None:
    """Attend one sequence; writes ``out[seq.start:seq.start + seq.q_len]``."""
    spec, query = inp.spec, inp.query
    kv, d, dtype = spec.num_kv_heads, spec.head_size, query.dtype
    start, q_len, ctx = seq.start, seq.q_len, seq.ctx
    assert isinstance(inp.q_scale, float)
    tokens = ctx + q_len
    keys = torch.empty((kv, tokens, d), dtype=dtype, device=query.device)
    values = torch.empty_like(keys)
    keys[:, ctx:].copy_(inp.key[start:start + q_len].transpose(0, 1))
    values[:, ctx:].copy_(inp.value[start:start + q_len].transpose(0, 1))
    if ctx > 0:
        ids = seq.table[:ceil_div(ctx, spec.block_size)]
        _gather_context_keys(keys, inp.key_cache, ids, ctx, spec, inp.k_mult)
        _gather_context_values(values, inp.value_cache, ids, ctx, spec, inp.v_mult)
    if not _HAS_GQA and inp.group > 1:
        keys = keys.repeat_interleave(inp.group, dim=0)
        values = values.repeat_interleave(inp.group, dim=0)
    window = inp.window
    for c0 in range(0, q_len, q_chunk):
        c1 = min(q_len, c0 + q_chunk)
        # Keys past the chunk's last query are never visible; before the window neither.
        k_hi = ctx + c1
        k_lo = 0 if window is None else max(0, ctx + c0 - window + 1)
        # mask[i, j]: query at ctx + c0 + i sees key at k_lo + j iff
        #   k_lo + j <= ctx + c0 + i  and  k_lo + j > ctx + c0 + i - window.
        diag = ctx + c0 - k_lo
        mask = torch.ones((c1 - c0, k_hi - k_lo), dtype=torch.bool, device=query.device)
        mask.tril_(diag)
        if window is not None:
            mask.triu_(diag - window + 1)
        q = query[start + c0:start + c1].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        extra = {"enable_gqa": True} if _HAS_GQA else {}
        res = F.scaled_dot_product_attention(
            q, keys[:, k_lo:k_hi].unsqueeze(0), values[:, k_lo:k_hi].unsqueeze(0),
            attn_mask=mask, scale=inp.q_scale, **extra)
        del mask
        out[start + c0:start + c1] = res[0].transpose(0, 1)


def _gather_context_keys(dest: torch.Tensor, key_cache: torch.Tensor, ids: torch.Tensor,
                         ctx: int, spec: CacheSpec, mult: Optional[ScaleLike]) -> None:
    """Copy the first ``ctx`` cached keys into ``dest[:, :ctx]`` (``[kv, tokens, D]``).

    Each ``x`` group is 16 bytes, so the ``[D // x, block_size]`` transpose moves them as
    complex128 units (bit-exact, 16-byte inner loop) straight into ``dest`` when no
    dequantisation is needed; fp8 caches are staged, converted and scaled.
    """
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


def _gather_context_values(dest: torch.Tensor, value_cache: torch.Tensor, ids: torch.Tensor,
                           ctx: int, spec: CacheSpec, mult: Optional[ScaleLike]) -> None:
    """Copy the first ``ctx`` cached values into ``dest[:, :ctx]`` (a ``[D, bs]`` transpose
    per block, converting fp8 on the way) and apply the fp8 scale."""
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

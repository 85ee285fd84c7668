"""Decode on devices (the GPU compute mode, ``compute.compute_mode == "native"``): a fixed
number of launches, scores at float32 precision, and matrix products of one fixed shape.

A GPU in eager mode pays host time for every op (CoreX forces eager mode), so the op sequence
does not loop over tiles or sequences: positions are cut into ``DEVICE_TILE_TOKENS``-token
tiles at absolute positions (``decode._tiles``), and a *pair* is one tile of one sequence
(its ``kv`` heads are ``kv`` batch elements of each product).  A group of sequences' pairs,
tile-major, go through the products in *chunks* of ``TilePlan.chunk`` pairs
(``chunk_pairs``: a function of the model's shape and the work dtype alone, never of the
batch, the memory budget or the block table; the last chunk padded).  So every matrix
product and every reduction that touches a sequence's row has the same shape, batch count,
strides and dtype whatever else is in the call (``tests/attention/kernels/test_call_shapes.py`` records
them): a library that picks its kernel or splits a reduction by the whole shape sees the same
call.  Steps:

1. token indices: a hidden position (past the sequence's end, padding) reads the sequence's
   position 0 instead (any visible token: its value is finite, its weight exactly 0), so no
   value is ever zeroed and no garbage slot is ever read; block ids are clamped into the
   cache (an empty sequence's table row may hold anything);
2. the query over a power of two above its L1 norm, in the work dtype, for every pair
   (``compute.bounded_query``: no product can overflow; the norm in float64, exact for
   float16 queries, so no summation order changes it);
3. per chunk: keys gathered token by token into the chunk's buffer, ``s = q'.k`` (the half
   dtype, float32 accumulation) and, in a half dtype, ``r = q'.k - s``: ``baddbmm(s, q',
   k^T, beta=-1)`` forms it in the float32 accumulator and rounds it at its own magnitude,
   so ``s + r`` is ``q'.k`` to about float32 precision.  ``s`` alone is rounded at the score's
   magnitude (a logit of 100 off by up to 0.03 in float16, 0.25 in bfloat16, issue 34);
4. float32 scores ``x = factor * s + factor * r`` (``factor``: the power of two times the
   softmax scale), ALiBi added (float32), hidden positions ``-inf``, minus the sequence's
   maximum (exact), ``p = exp(x)``: every ``p`` at most 1, the maximum key's exactly 1;
5. per chunk, each pair's ``sum(p)`` into its partial; probabilities divided by twice the
   smallest power of two above it (exact) and rounded to the half dtype (they sum to less
   than 1/2: ``P . V``, at most half a weighted mean of values, cannot overflow; the maximum
   key's probability, 1, stays exact);
6. per chunk: values gathered like keys, ``P . V``; multiplied back by the divisor into the
   partials (float32), merged by a pairwise tree and divided (``decode._tiles``).

No host read, no data-dependent shape: CUDA-graph capturable for a given ``max_seq_len``.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional, Set

import torch

from ....activation.log import log
from ..cache import CacheSpec, ScaleLike, ceil_div
from ..compute import bounded_query
from ._tiles import Calls, TilePlan, finish, merge
from .._gather import gather_token_keys, gather_token_values

__all__ = ["CHUNK_BYTES", "CHUNK_PAIRS", "DEVICE_TILE_TOKENS", "attend_device", "chunk_pairs",
           "plan_device", "working_set"]

#: Tokens per tile on devices (rounded up to a multiple of the block size).  Fixed, so that
#: a sequence is cut the same way in every batch; 1,024 keeps the merge tree at 7 levels for
#: 128K tokens and wastes at most one tile per sequence.
DEVICE_TILE_TOKENS = 1024
#: Gathered K (or V) of one product's chunk, at most: the chunk's pairs are the largest
#: power of two whose tiles fit it, at most ``CHUNK_PAIRS``.  At the field's shape (4 query /
#: 1 KV heads of 256, float16) 64 pairs (32 MiB): a 131,072-token sequence in two chunks.
CHUNK_BYTES = 32 << 20
CHUNK_PAIRS = 64

_warned: Set[tuple] = set()


class TokenIndex(NamedTuple):
    """Where each position of each pair is read from (pairs tile-major, contiguous in that
    order: advanced indexing lays its result out like its index tensors)."""

    positions: torch.Tensor  # [tokens] int64 (0 .. tiles * tile)
    hidden: torch.Tensor     # [tiles, S, tile] bool: past the sequence's end
    blocks: torch.Tensor     # [pairs, tile // bs] block ids (hidden blocks: column 0's)
    slots: torch.Tensor      # [pairs, tile // bs, bs] slots (hidden positions: 0)
    heads: Optional[torch.Tensor]  # [kv, 1, 1] for kv > 1, else None


def chunk_pairs(spec: CacheSpec, work: torch.dtype, tile: int) -> int:
    """Pairs per product: the largest power of two (at most ``CHUNK_PAIRS``) whose gathered
    K takes at most ``CHUNK_BYTES``."""
    elem = torch.empty((), dtype=work).element_size()
    per_pair = spec.num_kv_heads * tile * spec.head_size * elem
    pairs = max(1, CHUNK_BYTES // per_pair)
    return min(CHUNK_PAIRS, 1 << (pairs.bit_length() - 1))


def working_set(seqs: int, heads: int, spec: CacheSpec, width_tokens: int,
                work: torch.dtype, alibi: bool = False) -> int:
    """Bytes a group of ``seqs`` sequences over ``width_tokens`` positions holds at most on
    the device path: the chunk's buffers (gathered K or V, the raw gather of a converted
    cache), the positions, and per pair (padded chunk included) its scores and residuals,
    float32 scores, expanded query, ``P.V``, partial and token indices, per sequence the
    merge tree and the output's float32 temporaries; with ``alibi``, the float32 positions
    and, per pair, its float32 key-to-query distances.  ``working_set(1, ...)`` is the
    minimum working set: a smaller budget is run over (one WARNING per setting)."""
    tile = ceil_div(DEVICE_TILE_TOKENS, spec.block_size) * spec.block_size
    tiles = max(1, ceil_div(width_tokens, tile))
    leaves = 1 << (tiles - 1).bit_length()
    chunk = chunk_pairs(spec, work, tile)
    half = torch.empty((), dtype=work).element_size()
    d, kv = spec.head_size, spec.num_kv_heads
    converted = spec.fp8 or spec.storage_dtype != work
    raw = torch.empty((), dtype=spec.storage_dtype).element_size() if converted else 0
    fixed = chunk * kv * tile * d * (half + raw) + tiles * tile * (12 if alibi else 8)
    per_pair = heads * (tile * (2 * half + 4) + 2 * d * half + (d + 1) * 4) + tile * (
        22 if alibi else 18)
    per_seq = heads * ((d + 1) * 4 * 2 * leaves + d * 16)
    return fixed + ceil_div(seqs * tiles, chunk) * chunk * per_pair + seqs * per_seq


def plan_device(num_seqs: int, heads: int, spec: CacheSpec, width_tokens: int,
                work: torch.dtype, budget_bytes: int, alibi: bool = False) -> TilePlan:
    """The device path's tiles, chunk and groups of sequences under ``budget_bytes``
    (``working_set``; a budget below one sequence's is run over, with one WARNING per
    setting)."""
    tile = ceil_div(DEVICE_TILE_TOKENS, spec.block_size) * spec.block_size
    tiles = max(1, ceil_div(width_tokens, tile))
    leaves = 1 << (tiles - 1).bit_length()

    def cost(seqs: int) -> int:
        return working_set(seqs, heads, spec, width_tokens, work, alibi)

    group = max(1, num_seqs)
    while cost(group) > budget_bytes and group > 1:
        group = ceil_div(group, 2)
    if cost(1) > budget_bytes:
        key = (budget_bytes, heads, spec.num_kv_heads, spec.head_size, work, tiles, alibi)
        if key not in _warned:
            _warned.add(key)
            log.warning("decode: budget %d MiB is below the minimum working set (%.1f MiB: "
                        "products over %d tiles of %d tokens at once, one sequence of %d "
                        "tiles); running over it", budget_bytes >> 20, cost(1) / 2**20,
                        chunk_pairs(spec, work, tile), tile, tiles)
    return TilePlan(tile, tiles, leaves, chunk_pairs(spec, work, tile), group)


def attend_device(calls: Calls, key_cache: torch.Tensor, value_cache: torch.Tensor,
                  spec: CacheSpec, plan: TilePlan, work: torch.dtype, q_scale: ScaleLike,
                  v_scale: Optional[ScaleLike]) -> None:
    """Decode one group of sequences into ``calls.out`` (see the module docstring)."""
    index = token_index(calls.block_tables, calls.seq_lens, plan, spec)
    num_seqs, heads, d = calls.query.shape
    kv, tile, n = spec.num_kv_heads, plan.tile, plan.chunk
    group = heads // kv
    pairs = plan.tiles * num_seqs
    chunks = [(c0, min(n, pairs - c0)) for c0 in range(0, pairs, n)]
    rows = len(chunks) * n * kv  # batch elements, the last chunk padded
    dev = calls.query.device

    def buf(shape, dtype):
        return torch.empty(shape, dtype=dtype, device=dev)

    expanded = buf((rows, group, d), work)
    q = calls.query.view(1, num_seqs, kv, group, d)
    _, step = bounded_query(q, work, out=expanded[:pairs * kv].view(plan.tiles, num_seqs, kv,
                                                                   group, d))
    keys = buf((n * kv, tile, d), work)  # the chunk's K, then its V
    raw = None if work == spec.storage_dtype else buf((n * kv, tile, d), key_cache.dtype)
    scores = buf((rows, group, tile), work)
    resid = buf((rows, group, tile), work) if work != torch.float32 else None
    for c0, m in chunks:
        k = gather_token_keys(key_cache, index.blocks, index.slots, index.heads, c0, m, spec,
                              keys, raw)
        r0, r1 = c0 * kv, (c0 + n) * kv
        torch.bmm(expanded[r0:r1], keys.transpose(1, 2), out=scores[r0:r1])
        if resid is not None:
            torch.baddbmm(scores[r0:r1], expanded[r0:r1], keys.transpose(1, 2), beta=-1,
                          out=resid[r0:r1])
        del k
    probs = _probabilities(scores, resid, rows, index, step, q_scale, calls)
    del resid
    partials = _values(probs, scores, chunks, index, value_cache, spec, plan, keys, raw)
    finish(merge(partials), calls.out, v_scale, index.positions[:1])


def token_index(block_tables: torch.Tensor, seq_lens: torch.Tensor, plan: TilePlan,
                spec: CacheSpec) -> TokenIndex:
    """Block ids and slots for every position of every pair (``TokenIndex``)."""
    bs = spec.block_size
    num_seqs = seq_lens.shape[0]
    per_tile = plan.tile // bs
    positions = torch.arange(plan.tokens, dtype=torch.int64, device=seq_lens.device)
    hidden = positions.view(plan.tiles, 1, plan.tile) >= seq_lens.view(1, num_seqs, 1)
    by_block = hidden.view(plan.tiles, num_seqs, per_tile, bs)
    # positions[:n] is arange(n) and positions[:1] a zero: no other arange, no scalar tensor.
    zero = positions[:1]
    slots = torch.where(by_block, zero, positions[:bs])
    columns = torch.where(by_block[..., 0], zero, positions[:plan.tiles * per_tile].view(
        plan.tiles, 1, per_tile))
    table = block_tables.unsqueeze(0).expand(plan.tiles, -1, -1)
    blocks = table.gather(2, columns).clamp_(0, spec.num_blocks - 1)
    heads = None
    if spec.num_kv_heads > 1:
        heads = torch.arange(spec.num_kv_heads, device=seq_lens.device).view(-1, 1, 1)
    return TokenIndex(positions, hidden, blocks.view(-1, per_tile),
                      slots.view(-1, per_tile, bs), heads)


def _probabilities(scores: torch.Tensor, resid: Optional[torch.Tensor], rows: int,
                   index: TokenIndex, step: torch.Tensor, q_scale: ScaleLike,
                   calls: Calls) -> torch.Tensor:
    """float32 ``p = exp(x - max)`` (``[rows, group, tile]``; the first ``tiles * S * kv``
    rows are the pairs', ``[tiles, S, kv, group, tile]`` in that order)."""
    tiles, num_seqs, tile = index.hidden.shape
    _, kv, group, _ = calls.out.shape
    shape = (tiles, num_seqs, kv, group, tile)
    real = tiles * num_seqs * kv
    probs = torch.empty((rows, group, tile), dtype=torch.float32, device=scores.device)
    x = probs[:real].view(shape)
    factor = torch.mul(step, q_scale)  # [1, S, kv, group, 1]: exact products below
    torch.mul(scores[:real].view(shape), factor, out=x)
    if resid is not None:
        x.addcmul_(resid[:real].view(shape), factor)
    if calls.alibi_slopes is not None:
        _add_alibi(x, index, calls)
    x.masked_fill_(index.hidden.view(tiles, num_seqs, 1, 1, tile), -math.inf)
    x.sub_(x.amax(dim=(0, 4), keepdim=True))
    x.exp_()
    return probs


def _add_alibi(x: torch.Tensor, index: TokenIndex, calls: Calls) -> None:
    """``x += slope * (key position - query position)`` in place (float32, ``x``
    ``[tiles, S, kv, group, tile]``): the distances are one float32 per pair and position
    (``working_set`` counts them), every head's bias formed inside the ``addcmul``."""
    tiles, num_seqs, _, _, tile = x.shape
    _, kv, group, _ = calls.out.shape
    assert calls.alibi_slopes is not None
    slopes = calls.alibi_slopes.to(torch.float32).view(1, 1, kv, group, 1)
    last = calls.seq_lens.to(torch.float32).view(1, num_seqs, 1, 1, 1)
    positions = index.positions.to(torch.float32).view(tiles, 1, 1, 1, tile)
    # key - (len - 1), exact in float32 (positions below 2**24): key + 1 - len
    distance = torch.sub(positions, last).add_(1.0)
    x.addcmul_(slopes, distance)


def _values(probs: torch.Tensor, rounded: torch.Tensor, chunks, index: TokenIndex,
            value_cache: torch.Tensor, spec: CacheSpec, plan: TilePlan, values: torch.Tensor,
            raw: Optional[torch.Tensor]) -> torch.Tensor:
    """Each tile's partial ``[sum(p * v), sum(p)]`` (float32 ``[leaves, S, kv, group, D+1]``,
    leaves past the last tile zero).  ``rounded`` (the scores' buffer, free now) takes the
    half-precision probabilities."""
    rows, group, tile = probs.shape
    tiles, num_seqs = index.hidden.shape[:2]
    kv, d, n = spec.num_kv_heads, spec.head_size, plan.chunk
    real = tiles * num_seqs * kv
    # Room for the padded chunk's sums past the pairs' (overwritten below when they fall in
    # the leaves past the last tile, which must be zero).
    flat = torch.empty((max(plan.leaves * num_seqs * kv, rows), group, d + 1),
                       dtype=torch.float32, device=probs.device)
    for c0, _ in chunks:
        r0, r1 = c0 * kv, (c0 + n) * kv
        torch.sum(probs[r0:r1], dim=-1, keepdim=True, out=flat[r0:r1, :, d:])
    partials = flat[:plan.leaves * num_seqs * kv].view(plan.leaves, num_seqs, kv, group, d + 1)
    if plan.leaves > tiles:
        partials[tiles:].zero_()
    shape = (tiles, num_seqs, kv, group, tile)
    # Twice the smallest power of two above the sum (``sum = m * 2**e``, ``1/2 <= m < 1``;
    # 2 for a sum of 0): the probabilities sum to less than 1/2, and dividing by a power of
    # two is exact, so the maximum key's probability (exactly 1) stays exact in the half
    # dtype.
    twice = torch.pow(2.0, torch.frexp(partials[:tiles, ..., d:]).exponent).mul_(2.0)
    torch.div(probs[:real].view(shape), twice, out=rounded[:real].view(shape))
    pv = torch.empty((rows, group, d), dtype=rounded.dtype, device=rounded.device)
    for c0, m in chunks:
        gather_token_values(value_cache, index.blocks, index.slots, index.heads, c0, m, spec,
                            values, raw)
        r0, r1 = c0 * kv, (c0 + n) * kv
        torch.bmm(rounded[r0:r1], values, out=pv[r0:r1])
    torch.mul(pv[:real].view(tiles, num_seqs, kv, group, d), twice,
              out=partials[:tiles, ..., :d])
    return partials

"""Decode on devices (the GPU compute mode, ``_common.compute_mode == "native"``), in a
fixed number of launches: every tile of every sequence goes through the same few ops at once.

A GPU in eager mode pays host time for every op (CoreX forces eager mode), so the op sequence
does not loop over tiles: positions are cut into ``DEVICE_TILE_TOKENS``-token tiles at
absolute positions (``decode._tiles``) and each step below runs over all of them (over
``TilePlan.chunk`` tiles per pass when the memory budget asks for passes; then only the two
gathers and the two matrix products repeat per pass):

1. token indices: a hidden position (past the sequence's end, padding) reads the sequence's
   position 0 instead (any visible token: its value is finite, its weight exactly 0), so no
   value is ever zeroed and no garbage slot is ever read; block ids are clamped into the
   cache (an empty sequence's table row may hold anything);
2. keys gathered token by token in the tile layout ``[tiles, S, kv, tile, D]`` (one
   ``index``), scores ``q' . k`` in the half dtype (float32 accumulation; ``q'`` is the query
   over a power of two above its L1 norm, ``_common.bounded_query``: no score can overflow),
   hidden scores ``-inf``;
3. the sequence's maximum score (exact, and subtracted exactly: a float scale is rounded
   to a few significant bits so that the fused ``factor * s - factor * max`` is 0 at the
   maximum; a zero scale leaves the factor positive), ``p = exp(score - max)`` in float32,
   each tile's
   ``sum(p)``; probabilities divided by twice their tile sum and rounded to the half dtype
   (they sum to 1/2: ``P . V``, half a weighted mean of values, cannot overflow);
4. values gathered like keys, ``P . V`` per tile, multiplied back by twice the tile sum into
   the tile's partial (float32) next to its ``sum(p)``; the partials merged by a pairwise
   tree (``decode._tiles.merge``) and divided (``decode._tiles.finish``).

No host read, no data-dependent shape: CUDA-graph capturable for a given ``max_seq_len``.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch

from .._common import CacheSpec, ScaleLike, bounded_query, ceil_div
from ._tiles import Calls, TilePlan, finish, merge, plan_tiles
from .._gather import gather_token_keys, gather_token_values

__all__ = ["DEVICE_TILE_TOKENS", "attend_device", "plan_device"]

#: Tokens per tile on devices (rounded up to a multiple of the block size).  Fixed, so that
#: a sequence is cut the same way in every batch; 1,024 keeps the merge tree at 7 levels for
#: 128K tokens and wastes at most one tile per sequence.
DEVICE_TILE_TOKENS = 1024

_TINY = torch.finfo(torch.float32).tiny


class TokenIndex(NamedTuple):
    """Where each position of each tile is read from (``[tiles, S, ...]``, contiguous in
    that order: advanced indexing lays its result out like its index tensors)."""

    positions: torch.Tensor  # [tokens] int64 (0 .. tiles * tile)
    hidden: torch.Tensor     # [tiles, S, tile] bool: past the sequence's end
    blocks: torch.Tensor     # [tiles, S, tile // bs] block ids (hidden blocks: column 0's)
    slots: torch.Tensor      # [tiles, S, tile // bs, bs] slots (hidden positions: 0)
    heads: Optional[torch.Tensor]  # [kv, 1, 1] for kv > 1, else None


def plan_device(num_seqs: int, heads: int, spec: CacheSpec, width_tokens: int,
                work: torch.dtype, budget_bytes: int) -> TilePlan:
    """The device path's tiles and passes under ``budget_bytes``."""
    tile = ceil_div(DEVICE_TILE_TOKENS, spec.block_size) * spec.block_size
    half = torch.empty((), dtype=work).element_size()
    tiles = max(1, ceil_div(width_tokens, tile))
    leaves = 1 << (tiles - 1).bit_length()
    d, kv = spec.head_size, spec.num_kv_heads
    # A gather in the cache's dtype before converting (fp8 caches, or a float32 work dtype).
    converted = spec.fp8 or spec.storage_dtype != work
    raw = torch.empty((), dtype=spec.storage_dtype).element_size() if converted else 0
    # Per sequence, for the whole call: indices, scores (half, float32 with an ALiBi bias,
    # probabilities), partials and the tree's first level; per sequence and tile of a pass:
    # one gathered K or V tile, the expanded query and the tile's P.V.
    fixed = tiles * tile * (17 + heads * (half + 8 + half)) + leaves * heads * (d + 1) * 4 * 2
    per_tile = tile * kv * d * (half + raw) + 2 * heads * d * half

    def cost(seqs: int, chunk: int) -> int:
        return seqs * (fixed + chunk * per_tile)

    return plan_tiles(num_seqs, width_tokens, tile, budget_bytes, cost)


def attend_device(calls: Calls, key_cache: torch.Tensor, value_cache: torch.Tensor,
                  spec: CacheSpec, plan: TilePlan, work: torch.dtype, q_scale: ScaleLike,
                  v_scale: Optional[ScaleLike]) -> None:
    """Decode one group of sequences into ``calls.out`` (see the module docstring)."""
    index = token_index(calls.block_tables, calls.seq_lens, plan, spec)
    group = calls.query.shape[1] // spec.num_kv_heads
    num_seqs = calls.query.shape[0]
    kv, d = spec.num_kv_heads, spec.head_size
    q = calls.query.view(1, num_seqs, kv, group, d)
    expanded = torch.empty((plan.chunk, num_seqs, kv, group, d), dtype=work,
                           device=q.device)
    qb, step = bounded_query(q, work, out=expanded)
    scores = torch.empty((plan.tiles, num_seqs, kv, group, plan.tile), dtype=work,
                         device=q.device)
    for c0, n in plan.chunks():
        keys = gather_token_keys(key_cache, index.blocks, index.slots, index.heads, c0, n,
                                 spec, work)
        torch.bmm(qb[:n].view(-1, group, d), keys.transpose(1, 2),
                  out=scores[c0:c0 + n].view(-1, group, plan.tile))
        del keys
    probs = _probabilities(scores, index, step, q_scale, calls)
    del scores
    partials = _values(probs, index, value_cache, spec, plan, work)
    finish(merge(partials), calls.out, v_scale, index.positions[:1])


def token_index(block_tables: torch.Tensor, seq_lens: torch.Tensor, plan: TilePlan,
                spec: CacheSpec) -> TokenIndex:
    """Block ids and slots for every position of every tile (``TokenIndex``)."""
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
    return TokenIndex(positions, hidden, blocks, slots, heads)


def _probabilities(scores: torch.Tensor, index: TokenIndex, step: torch.Tensor,
                   q_scale: ScaleLike, calls: Calls) -> torch.Tensor:
    """float32 ``p = exp(score - max)`` per position (``[tiles, S, kv, group, tile]``).

    A score is ``scale * step * s`` (``s`` the half-precision product, ``step`` the power of
    two of ``bounded_query``); with ALiBi the bias is added in float32 first."""
    tiles, num_seqs = scores.shape[:2]
    hidden = index.hidden.view(tiles, num_seqs, 1, 1, -1)
    # The score factor ``step * scale``, at least the smallest normal float32: a zero softmax
    # scale (or fp8 k_scale) weighs every visible key alike instead of -inf * 0 = NaN.  A
    # float scale is rounded on the host to ``_FACTOR_BITS`` significant bits (relative
    # change <= 2**-14): times a power of two, times a half-precision maximum, the product
    # is exact in float32, so the fused ``factor * s - factor * top`` is exactly 0 at the
    # maximum key (defect 1: a rounded ``top * factor`` left a residual of up to 2,048).
    bits = _FACTOR_BITS.get(scores.dtype, 0)
    short = bits > 0 and not isinstance(q_scale, torch.Tensor)
    if short:  # negated: one op
        factor = torch.mul(step, -_short(max(float(q_scale), _TINY), bits))
    else:
        factor = torch.mul(step, q_scale).clamp_min_(_TINY)
    if calls.alibi_slopes is None:
        scores.masked_fill_(hidden, -math.inf)
        top = scores.amax(dim=(0, 4), keepdim=True)
        if short:  # (-factor * top) - (-factor) * s, both products exact
            probs = torch.addcmul(torch.mul(top, factor), scores, factor, value=-1.0)
        else:  # (s - top) in float32 (the maximum key gives exactly 0), then the factor
            probs = torch.sub(scores, top.float()).mul_(factor)
    else:
        if short:
            factor = factor.neg_()
        probs = torch.addcmul(_alibi_bias(index, calls, hidden), scores, factor)
        probs.sub_(probs.amax(dim=(0, 4), keepdim=True))
    return probs.exp_()


#: Significant bits a float score factor keeps, per half dtype: 24 minus the dtype's.
_FACTOR_BITS = {torch.float16: 13, torch.bfloat16: 16}


def _short(x: float, bits: int) -> float:
    """``x`` (> 0) rounded to ``bits`` significant bits."""
    mantissa, exponent = math.frexp(x)
    return math.ldexp(round(mantissa * (1 << bits)) / (1 << bits), exponent)


def _alibi_bias(index: TokenIndex, calls: Calls, hidden: torch.Tensor) -> torch.Tensor:
    """float32 ``slope * (key position - query position)``, ``-inf`` where hidden,
    ``[tiles, S, kv, group, tile]``."""
    tiles, num_seqs = hidden.shape[:2]
    _, kv, group, _ = calls.out.shape
    assert calls.alibi_slopes is not None
    slopes = calls.alibi_slopes.to(torch.float32).view(1, 1, kv, group, 1)
    last = calls.seq_lens.view(1, num_seqs, 1, 1, 1) - 1
    distance = (index.positions.view(tiles, 1, 1, 1, -1) - last).to(torch.float32)
    return (slopes * distance).masked_fill_(hidden, -math.inf)


def _values(probs: torch.Tensor, index: TokenIndex, value_cache: torch.Tensor,
            spec: CacheSpec, plan: TilePlan, work: torch.dtype) -> torch.Tensor:
    """Each tile's partial ``[sum(p * v), sum(p)]`` (float32 ``[leaves, S, kv, group, D+1]``,
    leaves past the last tile zero)."""
    _, num_seqs, kv, group, tile = probs.shape
    d = spec.head_size
    partials = torch.empty((plan.leaves, num_seqs, kv, group, d + 1), dtype=torch.float32,
                           device=probs.device)
    if plan.leaves > plan.tiles:
        partials[plan.tiles:].zero_()
    torch.sum(probs, dim=-1, keepdim=True, out=partials[:plan.tiles, ..., d:])
    twice = torch.clamp_min(partials[:plan.tiles, ..., d:], _TINY).mul_(2.0)
    rounded = torch.empty(probs.shape, dtype=work, device=probs.device)
    torch.div(probs, twice, out=rounded)
    del probs
    for c0, n in plan.chunks():
        values = gather_token_values(value_cache, index.blocks, index.slots, index.heads, c0,
                                     n, spec, work)
        pv = torch.bmm(rounded[c0:c0 + n].view(-1, group, tile), values)
        del values
        torch.mul(pv.view(n, num_seqs, kv, group, d), twice[c0:c0 + n],
                  out=partials[c0:c0 + n, ..., :d])
    return partials

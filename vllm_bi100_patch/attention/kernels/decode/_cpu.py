"""Decode on CPUs (the float32 compute mode with the CPU tile layouts, ``compute.fast_layout``).

The same absolute tiles, per-tile partials and merge tree as the device path
(``decode._tiles``), in CPU terms: tiles of ``CPU_TILE_TOKENS`` (short, since waste past a
sequence's end is what costs on a CPU, not the number of ops) gathered in passes of at most
about ``CPU_PASS_BYTES`` of float32 K or V (larger passes are slower: fresh allocations of
tens of MiB are page-faulted in on every call), all matrix products in float32:

1. keys of a pass gathered as whole blocks (``_gather.gather_keys``: 16-byte units), float32
   scores for every tile of every sequence (ALiBi added, hidden positions ``-inf``);
2. the sequence's maximum score (exact), ``p = exp(score - max)``, each tile's ``sum(p)``;
3. values of a pass gathered as whole blocks and used untransposed
   (``_gather.gather_values_blocks``: slots no query attends zeroed, only in passes that reach
   past the shortest sequence, which is known for free on CPU), ``P . V`` per block and
   summed over the tile's blocks into the tile's partial.

Block ids past a sequence's end read block 0 (their scores are masked, values zeroed).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from ..cache import CacheSpec, ScaleLike, ceil_div
from ._tiles import Calls, TilePlan, finish, merge, plan_tiles
from .._gather import gather_keys, gather_values_blocks

__all__ = ["CPU_PASS_BYTES", "CPU_TILE_TOKENS", "attend_cpu", "plan_cpu", "working_set"]

#: Tokens per tile on CPUs (rounded up to a multiple of the block size): short, because a
#: CPU pays for the positions gathered past a sequence's end, not for the number of ops
#: (measured on this project's 2-core machine: 64 beats 128 and 256 at 1x112 to 8x4096).
CPU_TILE_TOKENS = 64
#: float32 K (or V) gathered per pass on CPUs, at most (the memory budget may ask less).
CPU_PASS_BYTES = 4 << 20


def working_set(seqs: int, chunk: int, heads: int, spec: CacheSpec, width_tokens: int) -> int:
    """Bytes ``seqs`` sequences hold with ``chunk`` tiles per pass: per sequence for the
    whole call, scores (and an ALiBi bias), masks and block ids, partials and the tree's
    first level; per sequence and tile of a pass, float32 K or V with its raw and staged
    copies, the per-block P.V and the probabilities' copy.  ``working_set(1, 1, ...)`` is the
    minimum working set."""
    tile = ceil_div(CPU_TILE_TOKENS, spec.block_size) * spec.block_size
    tiles = max(1, ceil_div(width_tokens, tile))
    leaves = 1 << (tiles - 1).bit_length()
    d, kv = spec.head_size, spec.num_kv_heads
    raw = torch.empty((), dtype=spec.storage_dtype).element_size()
    fixed = tiles * tile * (heads * 8 + 2) + leaves * heads * (d + 1) * 4 * 2
    gathered = tile * kv * d * 4
    per_tile = gathered + tile * kv * d * 2 * raw + (tile // spec.block_size + 2) * heads * d * 4 \
        + heads * tile * 4
    return seqs * (fixed + chunk * per_tile)


def plan_cpu(num_seqs: int, heads: int, spec: CacheSpec, width_tokens: int,
             budget_bytes: int) -> TilePlan:
    """The CPU path's tiles and passes under ``budget_bytes``."""
    tile = ceil_div(CPU_TILE_TOKENS, spec.block_size) * spec.block_size
    gathered = tile * spec.num_kv_heads * spec.head_size * 4

    def cost(seqs: int, chunk: int) -> int:
        if chunk > 1 and seqs * chunk * gathered > CPU_PASS_BYTES:
            return budget_bytes + 1
        return working_set(seqs, chunk, heads, spec, width_tokens)

    return plan_tiles(num_seqs, width_tokens, tile, budget_bytes, cost)


def attend_cpu(calls: Calls, key_cache: torch.Tensor, value_cache: torch.Tensor,
               spec: CacheSpec, plan: TilePlan, q_scale: ScaleLike,
               v_scale: Optional[ScaleLike], shortest: int) -> None:
    """Decode one group of sequences into ``calls.out`` (see the module docstring)."""
    num_seqs, _, d = calls.query.shape
    kv, group = spec.num_kv_heads, calls.out.shape[2]
    positions = torch.arange(plan.tokens, dtype=torch.int64)
    hidden = positions.view(1, plan.tiles, plan.tile) >= calls.seq_lens.view(num_seqs, 1, 1)
    ids = _block_ids(calls.block_tables, hidden, plan, spec)
    q = (calls.query.to(torch.float32) * q_scale).view(num_seqs, kv, group, d)
    q_kv = q.permute(1, 0, 2, 3).unsqueeze(1)  # [kv, 1, S, group, D]
    scores = torch.empty((kv, plan.tiles, num_seqs, group, plan.tile), dtype=torch.float32)
    for c0, n in plan.chunks():
        keys = gather_keys(key_cache, _chunk_ids(ids, c0, n), n * num_seqs,
                           plan.tile // spec.block_size, spec, torch.float32)
        product = torch.bmm(q_kv.expand(kv, n, num_seqs, group, d).reshape(-1, group, d),
                            keys.view(-1, plan.tile, d).transpose(1, 2))
        scores[:, c0:c0 + n] = product.view(kv, n, num_seqs, group, plan.tile)
        del keys, product
    if calls.alibi_slopes is not None:
        last = calls.seq_lens.view(1, 1, num_seqs, 1, 1) - 1
        distance = positions.view(1, plan.tiles, 1, 1, plan.tile) - last
        scores.add_(calls.alibi_slopes.to(torch.float32).view(kv, 1, 1, group, 1) * distance)
    scores.masked_fill_(hidden.permute(1, 0, 2).view(1, plan.tiles, num_seqs, 1, plan.tile),
                        -math.inf)
    probs = scores.sub_(scores.amax(dim=(1, 4), keepdim=True)).exp_()
    partials = torch.empty((plan.leaves, num_seqs, kv, group, d + 1), dtype=torch.float32)
    partials[plan.tiles:].zero_()
    partials[:plan.tiles, ..., d:] = probs.sum(dim=-1, keepdim=True).permute(1, 2, 0, 3, 4)
    for c0, n in plan.chunks():
        _tile_values(partials, probs, value_cache, ids, hidden, c0, n, spec, plan, shortest)
    finish(merge(partials), calls.out, v_scale, positions[:1])


def _block_ids(block_tables: torch.Tensor, hidden: torch.Tensor, plan: TilePlan,
               spec: CacheSpec) -> torch.Tensor:
    """``[S, tiles, tile // bs]`` block ids: the table's where a block holds a visible
    position, block 0 elsewhere (padding columns, past the table)."""
    num_seqs = block_tables.shape[0]
    per_seq = plan.tokens // spec.block_size
    ids = torch.zeros((num_seqs, per_seq), dtype=torch.int64)
    cols = min(per_seq, block_tables.shape[1])
    ids[:, :cols] = block_tables[:, :cols]
    unused = hidden.view(num_seqs, per_seq, spec.block_size)[..., 0]
    return ids.masked_fill_(unused, 0).view(num_seqs, plan.tiles, -1)


def _chunk_ids(ids: torch.Tensor, first: int, count: int) -> torch.Tensor:
    """The block ids of tiles ``first .. first + count`` (``ids``: ``[S, tiles, blocks]``),
    ordered (tile, sequence, block) as the gathers' ``num_seqs * blocks``."""
    return ids[:, first:first + count].permute(1, 0, 2).reshape(-1)


def _tile_values(partials: torch.Tensor, probs: torch.Tensor, value_cache: torch.Tensor,
                 ids: torch.Tensor, hidden: torch.Tensor, c0: int, n: int, spec: CacheSpec,
                 plan: TilePlan, shortest: int) -> None:
    """``sum(p * v)`` of tiles ``c0 .. c0 + n`` into their partials."""
    kv, _, num_seqs, group, tile = probs.shape
    bs, d = spec.block_size, spec.head_size
    per_tile = tile // bs
    zero = None
    if (c0 + n) * tile > shortest:
        zero = hidden[:, c0:c0 + n].permute(1, 0, 2).reshape(n * num_seqs, tile)
    values = gather_values_blocks(value_cache, _chunk_ids(ids, c0, n), n * num_seqs, per_tile,
                                  spec, torch.float32, zero)
    p_blocks = probs[:, c0:c0 + n].view(kv, n, num_seqs, group, per_tile, bs).permute(
        1, 2, 4, 0, 3, 5)  # [n, S, blocks, kv, group, bs]
    pv = torch.matmul(p_blocks, values.view(n, num_seqs, per_tile, kv, d, bs).transpose(-1, -2))
    torch.sum(pv, dim=2, out=partials[c0:c0 + n, ..., :d])

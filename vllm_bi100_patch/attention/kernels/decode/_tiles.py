"""Absolute key tiles, passes under a memory budget, and the final merge of ``paged_decode``.

Both decode paths (``decode._device``, ``decode._cpu``) cut every sequence's positions into
tiles of one fixed size (a multiple of the block size that depends on the compute path only,
never on the batch), at absolute positions ``[t * tile, (t + 1) * tile)``, and keep each
tile's partial result: ``sum(p * v)`` and ``sum(p)`` of its keys, with ``p = exp(score - M)``
relative to the sequence's own maximum score ``M`` (exact whatever the tiling: a maximum has
no rounding).  The partials are merged by ``_softmax.tree_sum`` over a power-of-two number of
leaves.  A sequence's output therefore depends on its own keys only: batch mates, padding
columns and a wider block table add tiles past its end, whose partials are exact zeros, and
the tree gives the same sum with any number of zero leaves.  Every matrix product and every
reduction has the same shape per tile whatever the batch (the tile's), and ``TilePlan``'s
passes (groups of sequences, chunks of tiles) only decide which tiles are gathered together,
not how anything is added up.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple, Optional

import torch

from ..cache import ScaleLike, ceil_div
from .._softmax import tree_sum

__all__ = ["Calls", "TilePlan", "finish", "merge", "plan_tiles"]


class Calls(NamedTuple):
    """What one group of sequences needs besides the caches."""

    query: torch.Tensor          # [S, H, D]
    block_tables: torch.Tensor   # [S, width]
    seq_lens: torch.Tensor       # [S]
    alibi_slopes: Optional[torch.Tensor]
    out: torch.Tensor            # [S, kv, group, D] view of the output


@dataclasses.dataclass(frozen=True)
class TilePlan:
    """How one call is cut: ``tiles`` absolute tiles of ``tile`` tokens (``leaves``: the
    merge tree's, a power of two >= ``tiles``), ``chunk`` tiles gathered per pass (CPUs) or
    tiles of sequences per product (devices, ``decode._device``), sequences in groups of
    ``seq_group``."""

    tile: int
    tiles: int
    leaves: int
    chunk: int
    seq_group: int

    @property
    def tokens(self) -> int:
        return self.tiles * self.tile

    def chunks(self):
        """``(first tile, tile count)`` of each pass over the tiles, in order."""
        return [(c0, min(self.chunk, self.tiles - c0)) for c0 in range(0, self.tiles, self.chunk)]


def plan_tiles(num_seqs: int, width_tokens: int, tile: int, budget_bytes: int,
               cost: Callable[[int, int], int]) -> TilePlan:
    """Cut a call of ``num_seqs`` sequences over ``width_tokens`` positions into tiles of
    ``tile`` tokens and passes whose working set, ``cost(sequences, tiles per pass)`` bytes,
    fits ``budget_bytes``: one pass when it fits, else fewer tiles per pass, and only when a
    single tile of every sequence does not fit, groups of sequences (at least one tile of one
    sequence per pass, whatever the budget)."""
    tiles = max(1, ceil_div(width_tokens, tile))
    leaves = 1 << (tiles - 1).bit_length()
    group = max(1, num_seqs)
    while cost(group, 1) > budget_bytes and group > 1:
        group = ceil_div(group, 2)
    chunk = tiles
    while cost(group, chunk) > budget_bytes and chunk > 1:
        chunk = ceil_div(chunk, 2)
    return TilePlan(tile, tiles, leaves, chunk, group)


def merge(partials: torch.Tensor) -> torch.Tensor:
    """The sum over the leaves (dimension 0) of ``[leaves, ...]`` partials, as a tree."""
    return tree_sum(partials)[0]


def finish(root: torch.Tensor, out: torch.Tensor, v_scale: Optional[ScaleLike],
           zero: torch.Tensor) -> None:
    """Write ``out`` (``[S, kv, group, D]`` view of the output, query dtype) from the merged
    ``root`` (``[S, kv, group, D + 1]`` float32: ``sum(p * v)`` then ``sum(p)``); ``zero`` is
    any tensor holding one 0 (a number would cost a scalar tensor, an op).

    Sequences with no visible key (``sum(p)`` is 0, or NaN: their keys were never read
    meaningfully) get zeros.  Every output is a weighted mean of values finite in the cache's
    dtype, so a finite result past the dtype's largest value is rounding (float16: a mean of
    65,504s computed as 65,520 would round to inf): finite results are clamped to the
    dtype's range, infinities (a visible infinite value) are kept."""
    head_size = root.shape[-1] - 1
    norm = root[..., head_size:]
    result = torch.div(root[..., :head_size], norm)
    if v_scale is not None:
        result.mul_(v_scale)
    result = torch.where(norm > 0, result, zero)
    if out.dtype != torch.float32:
        top = torch.finfo(out.dtype).max
        result = torch.where(result.isinf(), result, result.clamp(-top, top))
    out.copy_(result)

"""The tiled path's bookkeeping: tiles, waves of tiles, a wave's per-tile buffers, and the map
between them and the call's position-major rows.

A wave's per-tile buffer (``Layout``) holds each tile's ``[kv, size * group, X]`` slice,
contiguous, at an offset aligned to 256 bytes: every tile's operand has the shape, strides
and alignment of its tile alone.  Consecutive tiles of one size form a *run*, viewed as
``[tiles, kv, size * group, X]``; the call's rows are ``[positions, kv * group, X]``.
``segments`` cuts a run's positions into at most three pieces (a partial first tile, whole
tiles, a partial last tile) that ``grid_rows`` pairs up as strided views of the same shape,
so that moving rows between the two layouts takes at most three ops per run, whatever the
number of tiles.
"""

from __future__ import annotations

from typing import Iterator, List, NamedTuple, Tuple

import torch

from ..cache import ceil_div
from ._plan import Tiling

__all__ = ["Layout", "Tile", "grid_rows", "segments", "waves"]

#: Alignment (elements) of every tile's slice of a shared buffer: 256 bytes or more.
ALIGN = 128


class Tile(NamedTuple):
    """One absolute query tile: positions ``[first, first + size)``, keys ``[lo, hi)``, key
    groups ``[g0, g1)``."""

    first: int
    size: int
    lo: int
    hi: int
    g0: int
    g1: int

    @property
    def spanning(self) -> bool:
        return self.g1 - self.g0 > 1

    @property
    def keys(self) -> int:
        return self.hi - self.lo


def waves(tiles: List[Tile], til: Tiling, row_bytes: int, limit: int) -> List[List[Tile]]:
    """Consecutive tiles of one kind (over one key group, or several) whose per-tile
    buffers (``row_bytes`` per query row) fit ``limit`` and, for tiles over several groups,
    whose score rows fit the score budget: every tile's scores are kept while K is staged
    group by group (twice in a half-precision work dtype), then each tile's probabilities
    replace its scores in place."""
    out: List[List[Tile]] = []
    cur: List[Tile] = []
    rows = scores = 0
    for t in tiles:
        s = t.size * t.keys * til.row_elem  # its scores
        if cur and (t.spanning != cur[0].spanning or rows + t.size * row_bytes > limit
                    or (t.spanning and scores + s > til.score_bytes)):
            out.append(cur)
            cur, rows, scores = [], 0, 0
        cur.append(t)
        rows += t.size * row_bytes
        scores += s
    if cur:
        out.append(cur)
    return out


class Layout:
    """Where each tile of a wave lives in a flat per-tile buffer of ``width`` columns."""

    def __init__(self, wave: List[Tile], kv: int, group: int, width: int) -> None:
        self.wave, self.kv, self.group, self.width = wave, kv, group, width
        self.offsets: List[int] = []
        self.numel = 0
        for t in wave:
            self.offsets.append(self.numel)
            self.numel += self.slot(t)

    def slot(self, t: Tile) -> int:
        return ceil_div(self.kv * t.size * self.group * self.width, ALIGN) * ALIGN

    def tile(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        """Tile ``i``'s ``[kv, size * group, width]``."""
        t, at = self.wave[i], self.offsets[i]
        return flat[at:at + self.kv * t.size * self.group * self.width].view(
            self.kv, t.size * self.group, self.width)

    def span(self, flat: torch.Tensor, i0: int, i1: int) -> torch.Tensor:
        """Tiles ``[i0, i1)`` (consecutive) as one flat range, for elementwise ops."""
        end = self.offsets[i1 - 1] + self.slot(self.wave[i1 - 1])
        return flat[self.offsets[i0]:end]

    def runs(self, flat: torch.Tensor) -> Iterator[Tuple[int, torch.Tensor]]:
        """Each run of same-size tiles: its first tile's index and the run as
        ``[tiles, kv, size * group, width]`` (tile stride: the aligned slot)."""
        i = 0
        while i < len(self.wave):
            j = i
            while j < len(self.wave) and self.wave[j].size == self.wave[i].size:
                j += 1
            t = self.wave[i]
            rows = t.size * self.group
            yield i, flat.as_strided((j - i, self.kv, rows, self.width),
                                     (self.slot(t), rows * self.width, self.width, 1),
                                     flat.storage_offset() + self.offsets[i])
            i = j


    def pairs(self, flat: torch.Tensor, a: int, b: int, rows: torch.Tensor
              ) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
        """The views of the buffer ``flat`` and of ``rows`` (``[b - a, kv * group, X']``, the
        call's positions ``[a, b)``) that hold the same positions, at most three per run."""
        for i, run in self.runs(flat):
            t = self.wave[i]
            r0, r1 = max(a, t.first), min(b, t.first + run.shape[0] * t.size)
            yield from grid_rows(run, segments(t.first, t.size, r0, r1), rows[r0 - a:r1 - a],
                                 self.kv, self.group)


def segments(first: int, size: int, a: int, b: int) -> List[Tuple[int, int, int, int]]:
    """Positions ``[a, b)`` of a run of tiles of ``size`` starting at ``first`` as
    ``(first tile, end tile, first row, end row)`` pieces: whole tiles together, a partial
    tile alone."""
    out = []
    pos = a
    while pos < b:
        t, r0 = divmod(pos - first, size)
        if r0 == 0 and b - pos >= size:
            n = (b - pos) // size
            out.append((t, t + n, 0, size))
            pos += n * size
        else:
            r1 = min(size, b - first - t * size)
            out.append((t, t + 1, r0, r1))
            pos = first + t * size + r1
    return out


def grid_rows(grid: torch.Tensor, pieces: List[Tuple[int, int, int, int]], rows: torch.Tensor,
              kv: int, group: int) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
    """For each piece, the views ``[tiles, rows, kv, group, X]`` of ``grid``
    (``[tiles, kv, size * group, X]``) and of ``rows`` (``[positions, kv * group, X']``, its
    row 0 the first piece's first position) that hold the same positions."""
    w, _, width, x = grid.shape
    size = width // group
    g5 = grid.unflatten(2, (size, group))
    at = 0
    for t0, t1, r0, r1 in pieces:
        n = (t1 - t0) * (r1 - r0)
        part = rows[at:at + n]
        yield (g5[t0:t1, :, r0:r1].permute(0, 2, 1, 3, 4),
               part.view(t1 - t0, r1 - r0, kv, group, part.shape[-1]))
        at += n

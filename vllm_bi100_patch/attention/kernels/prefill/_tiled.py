"""The tiled path of the prefix and dense kernels: plain matrix products, one softmax per
query tile, elementwise ops.

This is the path every GPU takes (fused attention kernels are the BI-V100 hang class).  A
query tile (``prefill._plan``: absolute positions, its size a function of the position)
goes through the same calls in every slicing (``prefill._scores``: the products, in a
half-precision work dtype each with its residual, so that the weights carry float32 scores;
the masks; the softmax in place; ``P.V`` against the staged values and their ones column: each row's
weighted sum of its values and the sum of its rounded weights, the row their quotient).  A
half-precision ``P.V`` is a weighted mean (halved in float16): it cannot leave its values'
range and keeps float16's precision at every value scale.  A row whose output is not finite
(its ``|q.k| * scale`` passed 65,504, an input is not finite, or a mean within 2**-10 of
65,504 was rounded past it) is recomputed alone in float32 (``recompute``, a per-row
decision).

Tiles are processed in *waves* (``prefill._grid``): their queries are staged in one buffer, K/V
once per key group, and the rows written back in at most three ops per run of same-size
tiles; tiles whose keys span several groups keep their score rows for the wave (K staged for
all of them, with the residual products, then V).  What a wave shares is never an
operand of a product or softmax beside another tile's rows: every such call has the shape,
strides and alignment of its tile and group alone (``tests/attention/kernels/test_call_shapes.py``).
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Tuple

import torch

from ....activation.log import log
from ..cache import ceil_div
from ._grid import Layout, Tile, waves
from ._plan import PrefixInputs, SeqSpan, Tiling, value_columns, wave_row_bytes
from ._scores import ScoreOps
from ._stage import stage_keys, stage_values

__all__ = ["TiledRunner"]


class TiledRunner:
    """The tiled path for one call (buffers reused across waves and sequences)."""

    def __init__(self, inp: PrefixInputs, til: Tiling, budget: int) -> None:
        self.inp, self.til, self.budget = inp, til, budget
        self.kv, self.group, self.d = inp.kv_heads, inp.group, inp.head_size
        self.cols = value_columns(self.d, torch.empty((), dtype=til.work).element_size())
        self.device = inp.query.device
        self.ops = ScoreOps(inp, til)
        self._bufs: Dict[str, torch.Tensor] = {}
        #: (sequence, first row, end row, a float32 total per row: finite iff the row is)
        self.checks: List[Tuple[SeqSpan, int, int, torch.Tensor]] = []
        self.check = til.work != torch.float32

    def _buf(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        buf = self._bufs.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype:
            buf = self._bufs[name] = torch.empty(numel, dtype=dtype, device=self.device)
        return buf[:numel]

    def tiles(self, seq: SeqSpan, p0: int, p1: int) -> List[Tile]:
        """The tiles of positions ``[p0, p1)`` with their key ranges: ``[lo, tile end)``
        (non-causal: every key), ``lo`` 0 or the window's start aligned to the key tile."""
        til, window, ks, kt = self.til, self.inp.window, self.til.group_keys, self.til.key_tile
        if seq.causal:
            spans = til.tiles(p0, p1)
        else:
            size = til.fixed_tile(seq.new_keys)
            spans = [(f, size) for f in range(p0 // size * size, p1, size)]
        out = []
        for first, size in spans:
            if not seq.causal:
                lo, hi = 0, seq.new_keys
            else:
                lo = 0 if window is None else max(0, first - window + 1) // kt * kt
                hi = first + size
            out.append(Tile(first, size, lo, hi, lo // ks, (hi - 1) // ks + 1))
        return out

    def run(self, seq: SeqSpan, out: torch.Tensor, i0: int = 0, i1: int = -1,
            dest: Optional[torch.Tensor] = None) -> None:
        """Attend query rows ``[i0, i1)`` of ``seq`` (all by default) into their rows of
        ``out`` (or into ``dest[0:i1 - i0]``)."""
        i1 = seq.q_len if i1 < 0 else i1
        base = seq.ctx if seq.causal else 0  # position of row 0
        p0, p1 = base + i0, base + i1
        hidden = None  # value slots before every row's window
        if self.inp.window is not None and seq.causal:
            hidden = p0 - self.inp.window + 1
        # The target and the position of its row 0.
        target, row0 = (out, base - seq.start) if dest is None else (dest, p0)
        elem = torch.empty((), dtype=self.til.work).element_size()
        per_row = wave_row_bytes(self.kv * self.group, self.d, elem,
                                 max(size for _, size in self.til.bands))
        for wave in waves(self.tiles(seq, p0, p1), self.til, per_row, self.budget // 4):
            self._wave(seq, wave, max(p0, wave[0].first),
                       min(p1, wave[-1].first + wave[-1].size), hidden, target, row0)

    def _wave(self, seq: SeqSpan, wave: List[Tile], a: int, b: int, hidden: Optional[int],
              target: torch.Tensor, row0: int) -> None:
        """One wave: rows ``[a, b)`` into ``target``, whose row ``i`` is position
        ``row0 + i``."""
        til, kv, g = self.til, self.kv, self.group
        q = self._queries(seq, wave, a, b)
        res = Layout(wave, kv, g, self.cols)
        o = self._buf("o", res.numel, til.work)
        groups = range(min(t.g0 for t in wave), max(t.g1 for t in wave))
        if wave[0].spanning:
            out = self._spanning(seq, wave, q, res, o, groups, hidden)
        else:  # every tile over one group: stage it, then each of its tiles' calls
            pair = 1 if self.ops.residual is None else 2  # scores, and their residuals
            s = self._buf("s", pair * max(kv * t.size * g * t.keys for t in wave), til.work)
            ops = self.ops
            for grp in groups:
                members = [i for i, t in enumerate(wave) if t.g0 == grp]
                if not members:
                    continue
                keys, values = self._stage(seq, [wave[i] for i in members], grp, hidden)
                for i in members:
                    t = wave[i]
                    shape = (pair, kv, t.size * g, t.keys)[2 - pair:]
                    row = s[:pair * kv * t.size * g * t.keys].view(shape)
                    ops.scores(t, q[i], keys, grp, row)
                    ops.values(t, ops.softmax(seq, t, row), values, grp, res.tile(o, i))
            out = o
        self._finish(seq, res, out, a, b, target, row0)

    def _spanning(self, seq: SeqSpan, wave: List[Tile], q: List[torch.Tensor], res: Layout,
                  o: torch.Tensor, groups: range, hidden: Optional[int]) -> torch.Tensor:
        """A wave of tiles over several key groups: every tile's score row is kept while K
        is staged group by group, then V; ``P.V`` per group added in group order (float32)."""
        til, kv, g, ops = self.til, self.kv, self.group, self.ops
        # One allocation per tile (its probabilities replace its scores in place; with its
        # residuals); the score buffer of tiles over one group goes first: the rows take the
        # whole score budget.
        self._bufs.pop("s", None)
        pair = () if ops.residual is None else (2,)
        rows = [torch.empty(pair + (kv, t.size * g, t.keys), dtype=til.work, device=self.device)
                for t in wave]
        for grp in groups:
            keys, _ = self._stage(seq, wave, grp, hidden, values=False)
            for i, t in enumerate(wave):
                if t.g0 <= grp < t.g1:
                    ops.scores(t, q[i], keys, grp, rows[i])
        probs = [ops.softmax(seq, t, rows[i]) for i, t in enumerate(wave)]
        acc = self._buf("acc", res.numel, torch.float32)
        for grp in groups:
            _, values = self._stage(seq, wave, grp, hidden, keys=False)
            for i, t in enumerate(wave):
                if t.g0 <= grp < t.g1:
                    ops.values(t, probs[i], values, grp, res.tile(o, i))
            # Tiles whose first group this is take the product, later ones add it: both
            # sets are runs of consecutive tiles (ranges only grow along a wave).
            firsts = [i for i, t in enumerate(wave) if t.g0 == grp]
            later = [i for i, t in enumerate(wave) if t.g0 < grp < t.g1]
            if firsts:
                res.span(acc, firsts[0], firsts[-1] + 1).copy_(
                    res.span(o, firsts[0], firsts[-1] + 1))
            if later:
                res.span(acc, later[0], later[-1] + 1).add_(res.span(o, later[0], later[-1] + 1))
        return acc

    def _stage(self, seq: SeqSpan, wave: List[Tile], grp: int, hidden: Optional[int],
               keys: bool = True, values: bool = True) -> Tuple[torch.Tensor, torch.Tensor]:
        """The tiles' positions of key group ``grp`` (whole blocks), at their offset in
        buffers of one group (a tile's operands have the same strides and alignment in every
        call): K ``[kv, KS, D]`` and V ``[kv, KS, cols]`` (each staged when asked)."""
        til, inp = self.til, self.inp
        ks = til.group_keys
        origin = grp * ks
        a = max(min(t.lo for t in wave), origin)
        b = min(origin + ks, max(t.hi for t in wave))
        if inp.spec is not None:  # whole blocks: the cached part is gathered by block
            b = min(origin + ks, ceil_div(b, inp.spec.block_size) * inp.spec.block_size)
        k_buf = self._buf("k", self.kv * ks * self.d, til.work).view(self.kv, ks, self.d)
        v_buf = self._buf("v", self.kv * ks * self.cols, til.work).view(self.kv, ks, self.cols)
        if keys:
            stage_keys(inp, seq, a, b, k_buf[:, a - origin:b - origin])
        if values:
            stage_values(inp, seq, a, b, v_buf[:, a - origin:b - origin], hidden)
        return k_buf, v_buf

    def _queries(self, seq: SeqSpan, wave: List[Tile], a: int, b: int) -> List[torch.Tensor]:
        """Each tile's queries ``[kv, size * group, D]`` (rows position-major, zeros where the
        call has no query), in one buffer (``Layout``)."""
        inp = self.inp
        lay = Layout(wave, self.kv, self.group, self.d)
        q = self._buf("q", lay.numel, self.til.work)
        if a > wave[0].first or b < wave[-1].first + wave[-1].size:
            q.zero_()
        base = seq.ctx if seq.causal else 0
        for grid, part in lay.pairs(q, a, b, inp.query[seq.start + a - base:seq.start + b - base]):
            grid.copy_(part)
        if not isinstance(inp.q_scale, float):
            q.mul_(inp.q_scale)
        return [lay.tile(q, i) for i in range(len(wave))]

    def _finish(self, seq: SeqSpan, res: Layout, flat: torch.Tensor, a: int, b: int,
                target: torch.Tensor, row0: int) -> None:
        """Rows ``[a, b)`` as weighted sums over weight sums (the ones column) into
        ``target`` (row ``i`` is position ``row0 + i``)."""
        d = self.d
        rows = target[a - row0:b - row0]
        for grid, part in res.pairs(flat, a, b, rows):
            torch.div(grid[..., :d], grid[..., d:d + 1], out=part)
        if self.check:
            # Not finite where a score overflowed (its softmax is NaN), an input is not
            # finite, or a float16 mean within 2**-10 of 65,504 was rounded past it (the
            # quotient of two rounded sums): those rows run again in float32 (``recompute``:
            # a finite mean stays finite there, an infinite value stays infinite).
            base = seq.ctx if seq.causal else 0
            self.checks.append((seq, a - base, b - base,
                                rows.sum(dim=(1, 2), dtype=torch.float32)))

    def recompute(self, out: torch.Tensor) -> int:
        """Rows whose output is not finite (scores past the work dtype's range, non-finite
        inputs, a float16 mean rounded past 65,504) run again, tile by tile, in float32 with
        the same tiles; only those rows are replaced.  One host read.  Returns how many
        sequences had such rows."""
        if not self.checks:
            return 0
        sums = (self.checks[0][3] if len(self.checks) == 1 else torch.cat(
            [per_row for *_, per_row in self.checks])).tolist()
        bad: List[Tuple[SeqSpan, int, int, List[int]]] = []
        at = 0
        for seq, c0, c1, _ in self.checks:
            flagged = [c0 + i for i in range(c1 - c0) if not math.isfinite(sums[at + i])]
            at += c1 - c0
            if flagged:
                bad.append((seq, c0, c1, flagged))
        self.checks = []
        if not bad:
            return 0
        inp, til = self.inp, self.til
        again = TiledRunner(inp, Tiling(til.key_tile, til.group_keys, torch.float32, til.bands,
                                        til.score_bytes, til.row_elem), self.budget)
        for seq, c0, c1, flagged in bad:
            log.warning("prefix/dense attention: %d rows past the range of %s (scores, or "
                        "non-finite inputs); recomputed in float32", len(flagged), til.work)
            base = seq.ctx if seq.causal else 0
            for t in again.tiles(seq, base + min(flagged), base + max(flagged) + 1):
                r0, r1 = max(c0, t.first - base), min(c1, t.first + t.size - base)
                if not any(r0 <= i < r1 for i in flagged):
                    continue
                tmp = torch.empty((r1 - r0,) + tuple(out.shape[1:]), dtype=out.dtype,
                                  device=out.device)
                again.run(seq, out, r0, r1, dest=tmp)
                for i in flagged:
                    if r0 <= i < r1:
                        out[seq.start + i].copy_(tmp[i - r0])
        return len(bad)


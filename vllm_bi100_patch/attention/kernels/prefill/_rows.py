"""A query tile's score row on the tiled path: its products, masks, shift, softmax and ``P.V``
(``prefill._tiled`` runs them per tile and key group).

A row buffer is ``[kv, size * group, keys]`` in the work dtype, rows position-major.  Per
tile:

1. ``Q.K^T`` into the row: one product per key group its key range touches (the softmax scale
   is its ``alpha``; a tensor scale multiplies the staged queries first), each writing its
   group's columns;
2. in a half-precision work dtype, the *shift* (issue 34): the causal / window / padding masks
   (``-inf``), each row's maximum ``m`` over its visible keys (``amax``: exact), then the
   products again as ``baddbmm(m, Q, K^T, beta=-1, alpha=scale)``: ``scale * q.k - m`` is
   formed in the product's float32 accumulator and rounded once, at the magnitude of the
   difference.  A half-precision score is otherwise rounded at its own magnitude (a score
   of 100 carries an error of up to 0.03 in float16, 0.25 in bfloat16, and the softmax
   turns it into the weights); only the differences to the row's maximum need precision,
   and the keys that carry the weight are within a few units of it.  Nothing overflows
   that did not before: a visible key's ``s - m`` is at most half an ulp of ``m`` above 0,
   and one far below ``-65,504`` rounds to ``-inf``, a weight of 0 (``exp(-70,000)`` is 0
   in float32 too);
3. ALiBi (float32 work only: the GPU compute mode runs ALiBi calls in float32, see
   ``prefill._attend``) and the masks, then the softmax over the whole row, written in place
   (its probabilities replace the scores: ``_softmax.out`` with the row as ``out``; every
   kernel reads an element before writing the same element);
4. ``P.V`` against the staged values and their ones column, one product per key group
   (float16: at ``alpha`` 1/2, half the weighted sums, so that weights rounded to a sum just
   over 1 cannot carry a mean of 65,504s past float16's range).

The masks are boolean ``triu``/``tril`` masks made once per call and shape.
"""

from __future__ import annotations

import math
from typing import Callable, Dict, Optional, Tuple

import torch

from ._grid import Tile
from ._plan import PrefixInputs, SeqSpan, Tiling

__all__ = ["ScoreRows"]

#: Test hook: called with ``("tiled", tile's first position, first key, end key, work dtype)``
#: before each product and softmax (``tests/attention/kernels/test_call_shapes.py`` attributes the
#: calls it records).
TRACE: Optional[Callable[[tuple], None]] = None


class ScoreRows:
    """The row operations of one call (its masks made once)."""

    def __init__(self, inp: PrefixInputs, til: Tiling) -> None:
        self.inp, self.til = inp, til
        self.kv, self.group = inp.kv_heads, inp.group
        self.device = inp.query.device
        #: Whether rows are computed twice, the second time shifted by their maximum.
        self.shifted = til.work != torch.float32
        self._masks: Dict[Tuple[str, int, int, int], torch.Tensor] = {}

    def _trace(self, t: Tile, a: int, b: int) -> None:
        if TRACE is not None:
            TRACE(("tiled", t.first, a, b, self.til.work))

    def _range(self, t: Tile, grp: int) -> Tuple[int, int]:
        ks = self.til.group_keys
        return max(t.lo, grp * ks), min(t.hi, (grp + 1) * ks)

    def scores(self, t: Tile, q: torch.Tensor, keys: torch.Tensor, grp: int,
               row: torch.Tensor, shift: Optional[torch.Tensor] = None) -> None:
        """``Q.K^T`` of tile ``t`` over its keys in group ``grp`` into their columns of the
        row ``[kv, size * group, hi - lo]``; minus ``shift`` (``[kv, size * group, 1]``,
        the row's maximum) inside the product when given."""
        ks = self.til.group_keys
        a, b = self._range(t, grp)
        self._trace(t, a, b)
        alpha = self.inp.q_scale if isinstance(self.inp.q_scale, float) else 1.0
        k = keys[:, a - grp * ks:b - grp * ks].transpose(1, 2)
        cols = row[:, :, a - t.lo:b - t.lo]
        if shift is None:
            cols.baddbmm_(q, k, beta=0, alpha=alpha)
        else:
            torch.baddbmm(shift, q, k, beta=-1, alpha=alpha, out=cols)

    def row_max(self, seq: SeqSpan, t: Tile, row: torch.Tensor) -> torch.Tensor:
        """The masks, then each row's maximum over its visible keys ``[kv, size * group, 1]``
        (the shift of the second products)."""
        self.mask(seq, t, row, bias=False)
        self._trace(t, t.lo, t.hi)
        return row.amax(dim=-1, keepdim=True)

    def softmax(self, seq: SeqSpan, t: Tile, row: torch.Tensor) -> torch.Tensor:
        """Bias, masks and the softmax of a whole row, in place: returns the row."""
        self.mask(seq, t, row, bias=True)
        self._trace(t, t.lo, t.hi)
        return torch.ops.aten._softmax.out(row, -1, False, out=row)

    def values(self, t: Tile, probs: torch.Tensor, values: torch.Tensor, grp: int,
               o: torch.Tensor) -> None:
        """``P.V`` of tile ``t`` over its keys in group ``grp`` into ``o`` (float16: half of
        it, see the module docstring)."""
        ks = self.til.group_keys
        a, b = self._range(t, grp)
        self._trace(t, a, b)
        o.baddbmm_(probs[:, :, a - t.lo:b - t.lo], values[:, a - grp * ks:b - grp * ks],
                   beta=0, alpha=0.5 if self.til.work == torch.float16 else 1.0)

    def mask(self, seq: SeqSpan, t: Tile, row: torch.Tensor, bias: bool) -> None:
        """ALiBi (with ``bias``; float32, added once) and the causal / window / padding
        masks (``-inf``) of tile ``t``'s row, for row ``r`` at position ``first + r`` and key
        ``lo + j``; masks only over the key columns that need one."""
        inp, first, a, n, tokens = self.inp, t.first, t.lo, t.keys, t.size
        s4 = row.view(self.kv, tokens, self.group, n)
        if not seq.causal:
            if seq.new_keys < a + n:
                s4[..., max(0, seq.new_keys - a):].fill_(-math.inf)
            return
        if bias and inp.slopes is not None:
            rel = torch.arange(a, a + n, device=self.device, dtype=torch.float32).view(1, n) - \
                torch.arange(first, first + tokens, device=self.device,
                             dtype=torch.float32).view(tokens, 1)
            s4.addcmul_(inp.slopes.view(self.kv, 1, self.group, 1), rel.view(1, tokens, 1, n))
        d0 = first - a  # key column of row 0's own position: hidden iff column - row > d0
        start = max(0, d0 + 1)
        if start < n:
            hide = self._mask("triu", tokens, n - start, d0 + 1 - start)
            s4[..., start:].masked_fill_(hide.view(1, tokens, 1, n - start), -math.inf)
        if inp.window is not None:  # hidden iff column - row <= first - window - a
            e0 = first - inp.window - a
            stop = min(n, e0 + tokens)
            if stop > 0:
                hide = self._mask("tril", tokens, stop, e0)
                s4[..., :stop].masked_fill_(hide.view(1, tokens, 1, stop), -math.inf)

    def _mask(self, kind: str, rows: int, cols: int, diagonal: int) -> torch.Tensor:
        """A boolean ``triu``/``tril`` mask.  A causal tile's is ``triu(size, size - 1, 0)``,
        the top-left corner of one made once per call at the tiling's largest tile size;
        window masks are made once per shape."""
        key = (kind, rows, cols, diagonal)
        if kind == "triu" and diagonal == 0:
            top = max(size for _, size in self.til.bands)
            key = (kind, max(rows, top), max(cols, top), 0)
        hide = self._masks.get(key)
        if hide is None:
            hide = torch.ones(key[1:3], dtype=torch.bool, device=self.device)
            hide = hide.triu_(diagonal) if kind == "triu" else hide.tril_(diagonal)
            self._masks[key] = hide
        return hide[:rows, :cols]

"""A query tile's score row on the tiled path: its products, residuals, masks, softmax and
``P.V`` (``prefill._tiled`` runs them per tile and key group).

A row buffer is ``[kv, size * group, keys]`` in the work dtype, rows position-major (in a
half-precision work dtype ``[2, kv, size * group, keys]``: the scores, then their
residuals).  Per tile:

1. ``Q.K^T`` into the row: one product per key group its key range touches (the softmax scale
   is its ``alpha``; a tensor scale multiplies the staged queries first), each writing its
   group's columns;
2. in a half-precision work dtype, the *residual* (issue 41, the construction decode keeps):
   while the group's keys are staged, ``r = baddbmm(s, Q, K^T, beta=-1, alpha=scale)``:
   ``scale * q.k - s`` formed in the product's float32 accumulator and rounded once at its
   own magnitude, into the second of the tile's two half rows.  ``s + r`` is the score to
   within ``u**2`` of its magnitude (``u``: the half dtype's unit roundoff) whatever the
   row's distribution (a half score, or a half ``s - m``, is rounded at its own magnitude:
   on a *diffuse* row, thousands of keys a few units below the maximum together carry most
   of the weight, each off by up to ``2**-6`` in bfloat16);
3. the masks (``-inf``) over both rows, then the weights, the probabilities replacing the
   scores in place (every kernel reads an element before writing the same element):
   bfloat16 (``"wide"``): ``x = s + r`` in float32 (one ``addcmul``), its softmax in
   float32, rounded once into the row (what vLLM's kernel rounds); float16 (``"expm1"``):
   the softmax of ``s`` (float32 inside: ``s - max`` is exact) times ``exp(r)``, as
   ``p + p * expm1(r)`` (``expm1(-inf)`` is -1: a hidden key's weight stays 0 whatever its
   slot holds).  A float32 work dtype (ALiBi calls, the CPU's mode) has neither: ALiBi
   (float32) and the masks on the row, the softmax in place.  Nothing overflows that did not
   before: ``s`` overflows where a score does (the row is recomputed, ``prefill._tiled``),
   and ``r`` is at most half an ulp of a finite ``s``.  The bound, per score and per weight,
   is ``docs/bi100-limits.md``'s;
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

__all__ = ["ScoreOps", "residual_mode"]

#: Test hook: called with ``("tiled", tile's first position, first key, end key, work dtype)``
#: before each product and softmax (``tests/attention/kernels/test_call_shapes.py`` attributes the
#: calls it records).
TRACE: Optional[Callable[[tuple], None]] = None


def residual_mode(work: torch.dtype) -> Optional[str]:
    """How a work dtype's scores reach float32 precision: ``None`` (float32: they are),
    ``"expm1"`` (float16) or ``"wide"`` (bfloat16)."""
    if work == torch.float32:
        return None
    return "expm1" if work == torch.float16 else "wide"


class ScoreOps:
    """The operations on a query tile's scores of one call (its masks made once)."""

    def __init__(self, inp: PrefixInputs, til: Tiling) -> None:
        self.inp, self.til = inp, til
        self.kv, self.group = inp.kv_heads, inp.group
        self.device = inp.query.device
        #: The half-precision constructions: ``"expm1"`` (float16) or ``"wide"``
        #: (bfloat16); ``None`` for a float32 work dtype.
        self.residual = residual_mode(til.work)
        self._one = torch.ones((1, 1, 1), dtype=torch.float32, device=self.device) \
            if self.residual == "wide" else None
        self._x: Optional[torch.Tensor] = None
        self._masks: Dict[Tuple[str, int, int, int], torch.Tensor] = {}

    def _trace(self, t: Tile, a: int, b: int) -> None:
        if TRACE is not None:
            TRACE(("tiled", t.first, a, b, self.til.work))

    def _range(self, t: Tile, grp: int) -> Tuple[int, int]:
        ks = self.til.group_keys
        return max(t.lo, grp * ks), min(t.hi, (grp + 1) * ks)

    def scores(self, t: Tile, q: torch.Tensor, keys: torch.Tensor, grp: int,
               rows: torch.Tensor) -> None:
        """``Q.K^T`` of tile ``t`` over its keys in group ``grp`` into their columns of the
        row ``[kv, size * group, hi - lo]``; with the residual (``rows`` ``[2, kv, size *
        group, hi - lo]``: the scores, then their residuals), ``scale * Q.K^T - s`` into
        the second row's columns too."""
        ks = self.til.group_keys
        a, b = self._range(t, grp)
        alpha = self.inp.q_scale if isinstance(self.inp.q_scale, float) else 1.0
        k = keys[:, a - grp * ks:b - grp * ks].transpose(1, 2)
        row = rows if self.residual is None else rows[0]
        cols = row[:, :, a - t.lo:b - t.lo]
        self._trace(t, a, b)
        cols.baddbmm_(q, k, beta=0, alpha=alpha)
        if self.residual is not None:
            self._trace(t, a, b)
            torch.baddbmm(cols, q, k, beta=-1, alpha=alpha, out=rows[1, :, :, a - t.lo:b - t.lo])

    def softmax(self, seq: SeqSpan, t: Tile, rows: torch.Tensor) -> torch.Tensor:
        """Bias, masks and the softmax of a whole row (``scores``' ``rows``): returns the
        probabilities, in place of the row's scores (see the module docstring for the two
        half-precision constructions)."""
        if self.residual is None:
            self.mask(seq, t, rows, bias=True)
            self._trace(t, t.lo, t.hi)
            return torch.ops.aten._softmax.out(rows, -1, False, out=rows)
        row, resid = rows[0], rows[1]
        if self.residual == "wide":
            x = self._wide(row)
            torch.addcmul(row, resid, self._one, out=x)
            self.mask(seq, t, x, bias=False)
            self._trace(t, t.lo, t.hi)
            torch.ops.aten._softmax.out(x, -1, False, out=x)
            return row.copy_(x)
        self.mask(seq, t, rows, bias=False)  # both rows: expm1(-inf) is -1, a weight of 0
        self._trace(t, t.lo, t.hi)
        torch.special.expm1(resid, out=resid)
        torch.ops.aten._softmax.out(row, -1, False, out=row)
        return row.addcmul_(row, resid)

    def _wide(self, row: torch.Tensor) -> torch.Tensor:
        """A float32 row of ``row``'s shape at the start of one buffer (kept for the call)."""
        if self._x is None or self._x.numel() < row.numel():
            self._x = torch.empty(row.numel(), dtype=torch.float32, device=self.device)
        return self._x[:row.numel()].view(row.shape)

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
        s4 = row.view(-1, tokens, self.group, n)  # with the residual: both rows
        if not seq.causal:
            if seq.new_keys < a + n:
                s4[..., max(0, seq.new_keys - a):].fill_(-math.inf)
            return
        if bias and inp.slopes is not None:
            # [rows, keys] float32 distances: counted by the tiling (``_plan.tile_bytes``).
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

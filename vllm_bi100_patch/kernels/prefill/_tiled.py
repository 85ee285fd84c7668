"""The tiled path of the prefix and dense kernels: plain matrix products and elementwise ops.

This is the path every GPU takes (fused attention kernels are the BI-V100 hang class).  A
"unit" is a chunk of one sequence's query rows (padded to the query tile) against the keys
of one absolute key group that those rows need (``prefill._plan``): one ``Q.K^T`` writes the
scores (the softmax scale is its ``alpha``; with the ``"self"`` shift the staged query and
key carry ``-q.k_self`` and a one, so the product is already shifted), ALiBi and the masks
are applied where needed (the ``"max"`` shift subtracts the running max), ``exp`` runs in
place, and one ``P.V`` gives the weighted sums and, through the staged values' ones column,
the row sums.  Groups merge in absolute order (``"max"``: with the running-max correction;
``"self"``: every group is on the same scale, they add up).

Float32 work (CPU): every chunk lies in one absolute query block of ``key_tile`` positions
and its keys are exactly that block's range, so each row's ``P.V`` has the same reduction
length in every slicing (float32 GEMMs change their summation with it).  Half-precision
work (GPU): a chunk's keys run to its last row's key tile; a row's extra keys are masked
(weights exactly 0).

Per row, nothing depends on the slicing: key ranges are aligned on absolute key tiles,
masked keys weigh exactly 0, a fully masked group adds exactly 0 and leaves its
correction at 1 (or 0 before anything was seen), and a position's operands are staged
identically whether cached or new (``prefill._stage``).  What a matrix product's other rows
do to a row: nothing, on CPU (``tests/kernels/test_slicing_invariance.py``); a GPU library that
picks its algorithm by shape might (``tests/kernels/device_checks.py`` shows it).

Range (``docs/bi100-limits.md``): float16 ``P.V`` runs at ``FP16_PV_ALPHA`` scale (its
``alpha``; the weights are at most 1); a query whose output row is not finite (its float16 scores
overflowed, its ``"self"``-shifted weights passed the dtype's range, or a visible input is
NaN/inf) is recomputed alone, in float32 with the ``"max"`` shift (``recompute``): a
per-row decision, so it does not depend on the slicing either.
"""

from __future__ import annotations

import math
from typing import Callable, Dict, List, Optional, Tuple

import torch

from ..._log import log
from .._common import ceil_div
from ._plan import PrefixInputs, SeqSpan, Tiling, tiling, value_columns
from ._stage import stage_keys, stage_values

__all__ = ["TiledRunner"]

#: Test hook: called with ``("tiled", tile, first key, end key, work dtype)`` before each
#: unit's products (``tests/kernels/test_call_shapes.py`` attributes the calls it records).
TRACE: Optional[Callable[[tuple], None]] = None


class TiledRunner:
    """The tiled path for one call (buffers reused across units and sequences)."""

    def __init__(self, inp: PrefixInputs, til: Tiling, budget: int) -> None:
        self.inp, self.til, self.budget = inp, til, budget
        self.kv, self.group, self.d = inp.kv_heads, inp.group, inp.head_size
        self.cols = value_columns(self.d, torch.empty((), dtype=til.work).element_size())
        self.device = inp.query.device
        self._bufs: Dict[str, torch.Tensor] = {}
        self._masks: Dict[Tuple[str, int, int, int], torch.Tensor] = {}
        #: (sequence, first row, last row, float32 sum of each row's weighted sums, row sums
        #: and clamped output) per unit that can overflow: finite iff the row's sums are and
        #: its weights are not all 0 (or huge: a spurious re-run).
        self.checks: List[Tuple[SeqSpan, int, int, torch.Tensor]] = []
        self.check = til.work != torch.float32 or til.shift == "self"

    def _buf(self, name: str, shape: Tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        numel = math.prod(shape)
        buf = self._bufs.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype:
            buf = self._bufs[name] = torch.empty(numel, dtype=dtype, device=self.device)
        return buf[:numel].view(shape)

    def tile_range(self, seq: SeqSpan, t: int) -> Tuple[int, int]:
        """The absolute, key-tile-aligned key range of query tile ``t`` (positions
        ``[t QT, (t + 1) QT)``): a function of the tile alone."""
        kt, qt, window = self.til.key_tile, self.til.query_tile, self.inp.window
        if not seq.causal:
            return 0, ceil_div(seq.new_keys, kt) * kt
        first = t * qt
        lo = 0 if window is None else max(0, first - window + 1) // kt * kt
        return lo, ceil_div(first + qt, kt) * kt

    def run(self, seq: SeqSpan, out: torch.Tensor, i0: int = 0, i1: int = -1,
            dest: Optional[torch.Tensor] = None) -> None:
        """Attend query rows ``[i0, i1)`` of ``seq`` (all by default) into their rows of
        ``out`` (or into ``dest[0:i1 - i0]``), one absolute query tile at a time."""
        til, inp = self.til, self.inp
        i1 = seq.q_len if i1 < 0 else i1
        qt, ks = til.query_tile, til.group_keys
        base = seq.ctx if seq.causal else 0  # position of row 0
        units = []
        for t in range((base + i0) // qt, ceil_div(base + i1, qt)):
            lo, hi = self.tile_range(seq, t)
            units.append(_Unit(t, max(i0, t * qt - base), min(i1, (t + 1) * qt - base),
                               lo, hi, list(range(lo // ks, (hi - 1) // ks + 1))))
        lo_all, hi_all = min(u.lo for u in units), max(u.hi for u in units)
        groups = list(range(lo_all // ks, (hi_all - 1) // ks + 1))
        hidden = None  # value slots before every row's window
        if inp.window is not None and seq.causal:
            hidden = seq.ctx + i0 - inp.window + 1
        acc_all = self.kv * self.group * len(units) * qt * (self.cols + 1) * 4
        if len(groups) == 1 or acc_all > self.budget // 4:
            # Tile by tile: each stages the groups it needs (all tiles share a single one).
            staged: Optional[_Staged] = None
            for u in units:
                state = _State(self, single=len(u.groups) == 1)
                for g in u.groups:
                    a, b = max(u.lo, g * ks), min(u.hi, (g + 1) * ks)
                    if staged is None or staged.g != g:
                        staged = self._stage(seq, g, max(lo_all, g * ks),
                                             min(hi_all, (g + 1) * ks), hidden)
                    self._unit(seq, u, a, b, staged, state)
                self._finish(seq, u, state, out, i0, dest)
            return
        # Group by group, every tile's state kept: each group staged once.
        states = [_State(self, single=len(u.groups) == 1) for u in units]
        for g in groups:
            staged = self._stage(seq, g, max(lo_all, g * ks), min(hi_all, (g + 1) * ks),
                                 hidden)
            for u, state in zip(units, states):
                a, b = max(u.lo, g * ks), min(u.hi, (g + 1) * ks)
                if a < b:
                    self._unit(seq, u, a, b, staged, state)
        for u, state in zip(units, states):
            self._finish(seq, u, state, out, i0, dest)

    def _stage(self, seq: SeqSpan, g: int, a: int, b: int, hidden: Optional[int]
               ) -> "_Staged":
        """Positions ``[a, b)`` of key group ``g``, at their offset in buffers of one group
        (so a unit's operands have the same strides and offset in every call)."""
        til, inp = self.til, self.inp
        origin, ks = g * til.group_keys, til.group_keys
        values = self._buf("v", (self.kv, ks, self.cols), til.work)
        stage_values(inp, seq, a, b, values[:, a - origin:b - origin], hidden)
        width = self.cols if til.shift == "self" else self.d
        keys = self._buf("k", (self.kv, ks, width), til.work)
        stage_keys(inp, seq, a, b, keys[:, a - origin:b - origin],
                   augmented=til.shift == "self")
        return _Staged(g, origin, keys, values)

    def _queries(self, seq: SeqSpan, u: "_Unit") -> torch.Tensor:
        """The tile's queries ``[kv, QT * group, D]`` (rows position-major, zeros where the
        call has no query); for the ``"self"`` shift with more columns: ``-q.k_self`` split
        into a high and a low part in the work dtype (then zeros), against the keys' two
        columns of ones."""
        inp, til = self.inp, self.til
        kv, group, d, qt = self.kv, self.group, self.d, til.query_tile
        base = seq.ctx if seq.causal else 0
        c0, c1 = u.r0, u.r1
        n = c1 - c0
        at = base + c0 - u.t * qt  # the first call row's place in the tile
        rows = inp.query[seq.start + c0:seq.start + c1]
        augmented = til.shift == "self"
        width = self.cols if augmented else d
        q = self._buf("q", (kv, qt * group, width), til.work)
        q4 = q.view(kv, qt, group, width)
        if n < qt:
            q4.zero_()
        q4[:, at:at + n, :, :d].copy_(rows.view(n, kv, group, d).permute(1, 0, 2, 3))
        if augmented:  # -q.k_self as two work-dtype columns (high and low part)
            own = inp.key[seq.key_start + c0:seq.key_start + c1].view(n, kv, 1, d)
            # Products in float32 (exact for half inputs), as the GEMM forms them.
            dots = torch.mul(rows.view(n, kv, group, d).float(), own).sum(-1)
            high = dots.neg_().to(til.work)
            q4[:, at:at + n, :, d].copy_(high.permute(1, 0, 2))
            q4[:, at:at + n, :, d + 1].copy_(dots.sub_(high).permute(1, 0, 2))
            if n == qt:
                q4[:, :, :, d + 2:].zero_()
        if not isinstance(inp.q_scale, float):
            q.mul_(inp.q_scale)
        return q

    def _unit(self, seq: SeqSpan, u: "_Unit", a: int, b: int, staged: "_Staged",
              state: "_State") -> None:
        til, inp = self.til, self.inp
        kv, group, qt = self.kv, self.group, til.query_tile
        q = self._queries(seq, u)
        if TRACE is not None:
            TRACE(("tiled", u.t, a, b, til.work))
        n = b - a
        alpha = inp.q_scale if isinstance(inp.q_scale, float) else 1.0
        s = self._buf("s", (kv, qt * group, n), til.work)
        keys = staged.keys[:, a - staged.origin:b - staged.origin]
        s.baddbmm_(q, keys.transpose(1, 2), beta=0, alpha=alpha)
        self._bias_and_mask(seq, u.t * qt, a, n, qt, s.view(kv, qt, group, n))
        if til.shift == "max":
            state.shift_max(s)
        probs = s.exp_()
        v_r = staged.values[:, a - staged.origin:b - staged.origin]
        if til.work == torch.float32 and til.shift == "self":
            state.acc.baddbmm_(probs, v_r)
        elif til.work == torch.float32:
            state.merge(torch.bmm(probs, v_r), 1.0)
        else:
            o = self._buf("o", (kv, qt * group, self.cols), til.work)
            o.baddbmm_(probs, v_r, beta=0, alpha=til.pv_alpha)
            state.merge(o, 1 / til.pv_alpha)

    def _bias_and_mask(self, seq: SeqSpan, first: int, a: int, n: int, tokens: int,
                       s4: torch.Tensor) -> None:
        """ALiBi (float32, rounded once into the scores) and the causal / window / padding
        masks (-inf), for row ``r`` at position ``first + r`` and key ``a + j``; masks
        only over the key columns that need one."""
        inp = self.inp
        device = s4.device
        if not seq.causal:
            if seq.new_keys < a + n:
                s4[..., max(0, seq.new_keys - a):].fill_(-math.inf)
            return
        if inp.slopes is not None:
            rel = torch.arange(a, a + n, device=device, dtype=torch.float32).view(1, n) - \
                torch.arange(first, first + tokens, device=device,
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
        """A boolean ``triu``/``tril`` mask, made once per call (tiles of the same shape
        share their diagonal's mask: two launches saved per tile)."""
        key = (kind, rows, cols, diagonal)
        hide = self._masks.get(key)
        if hide is None:
            hide = torch.ones((rows, cols), dtype=torch.bool, device=self.device)
            hide = hide.triu_(diagonal) if kind == "triu" else hide.tril_(diagonal)
            self._masks[key] = hide
        return hide

    def _finish(self, seq: SeqSpan, u: "_Unit", state: "_State", out: torch.Tensor,
                i0: int, dest: Optional[torch.Tensor]) -> None:
        """Normalised rows into ``out`` (the ones column holds the row sums).  A weighted
        mean cannot leave its values' range, but the rounded sums can make a float16 one
        round past 65,504: the result is clamped to the finite range (where the sums
        themselves overflowed, the row is recomputed: ``recompute``)."""
        kv, group, d, qt = self.kv, self.group, self.d, self.til.query_tile
        c0, c1 = u.r0, u.r1
        n = c1 - c0
        at = (seq.ctx if seq.causal else 0) + c0 - u.t * qt
        res = state.result().view(kv, qt, group, self.cols)[:, at:at + n]
        rows = out[seq.start + c0:seq.start + c1] if dest is None else dest[c0 - i0:c1 - i0]
        target = rows.view(n, kv, group, d).permute(1, 0, 2, 3)
        torch.div(res[..., :d], res[..., d:d + 1], out=target)
        if rows.dtype == torch.float16:
            top = torch.finfo(torch.float16).max
            rows.clamp_(-top, top)
        if not self.check:
            return
        # The sums (inf where they overflowed, NaN for a NaN input) and the rows: NaN from
        # 0/0 where every weight of a row is 0 (with either shift: every score below the
        # half-precision range over several key groups leaves the running max at -inf), and
        # with the "self" shift 0 where a row sum passed the range while its weighted sums
        # did not.
        total = res[..., :d + 1].sum(dim=(0, 2, 3), dtype=torch.float32)
        total.add_(rows.sum(dim=(1, 2), dtype=torch.float32))
        self.checks.append((seq, c0, c1, total))

    def recompute(self, out: torch.Tensor) -> int:
        """Rows whose weighted sums are not finite or whose weights are all 0 (scores or sums
        past the work dtype's range, or non-finite inputs) run again, one absolute query
        tile at a time, in float32 with the ``"max"`` shift; only those rows are replaced.
        One host read.  Returns how many sequences had such rows."""
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
        inp, qt = self.inp, self.til.query_tile
        base = tiling(inp.query.shape[1], self.kv, self.d, self.til.key_tile, torch.float32,
                      self.budget, causal=bad[0][0].causal, alibi=inp.slopes is not None)
        again = TiledRunner(inp, Tiling(base.key_tile, base.group_keys, qt, torch.float32,
                                        shift="max"), self.budget)
        again.check = False
        tmp = torch.empty((qt,) + tuple(out.shape[1:]), dtype=out.dtype, device=out.device)
        for seq, c0, c1, flagged in bad:
            log.warning("prefix/dense attention: %d rows past the range of %s (scores or "
                        "weighted sums, or non-finite inputs); recomputed in float32",
                        len(flagged), self.til.work)
            for t in sorted({(seq.ctx + i) // qt for i in flagged}):
                r0, r1 = max(c0, t * qt - seq.ctx), min(c1, (t + 1) * qt - seq.ctx)
                again.run(seq, tmp, r0, r1, dest=tmp)
                for i in flagged:
                    if r0 <= i < r1:
                        out[seq.start + i].copy_(tmp[i - r0])
        return len(bad)


class _Unit:
    """One absolute query tile ``t`` of a call: its rows ``[r0, r1)`` of the sequence, its key
    range ``[lo, hi)`` and the key groups that range touches."""

    __slots__ = ("t", "r0", "r1", "lo", "hi", "groups")

    def __init__(self, t: int, r0: int, r1: int, lo: int, hi: int, groups: List[int]) -> None:
        self.t, self.r0, self.r1, self.lo, self.hi, self.groups = t, r0, r1, lo, hi, groups


class _Staged:
    """Staged keys and values of key group ``g`` (buffers ``[kv, KS, cols]`` whose row ``i``
    is position ``origin + i``)."""

    def __init__(self, g: int, origin: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.g, self.origin, self.keys, self.values = g, origin, keys, values


class _State:
    """One tile's merge state: the float32 accumulator (with the row-sum column), made
    when a second group or float32 ``P.V`` needs it, and for the ``"max"`` shift the running
    max and the pending correction.  A tile whose keys are one group (``single``, a property
    of the tile) and whose ``P.V`` is half precision normalises that product directly."""

    def __init__(self, runner: TiledRunner, single: bool) -> None:
        self.runner = runner
        self.single = single
        self.tokens = runner.til.query_tile
        self.rows = (runner.kv, self.tokens * runner.group)
        self._acc: Optional[torch.Tensor] = None
        self.m: Optional[torch.Tensor] = None
        self.corr: Optional[torch.Tensor] = None
        self.direct: Optional[torch.Tensor] = None

    @property
    def acc(self) -> torch.Tensor:
        if self._acc is None:
            self._acc = torch.zeros(self.rows + (self.runner.cols,), dtype=torch.float32,
                                    device=self.runner.device)
        return self._acc

    def shift_max(self, s: torch.Tensor) -> None:
        """Shift the scores ``[kv, rows, keys]`` by the running row max, in place; keeps the
        accumulator's correction for ``merge``.  A row that saw no key yet has max
        ``finfo.min``: its weights are exactly 0, and its correction 0 once it sees one."""
        work = s.dtype
        low = torch.finfo(work).min
        m = s.amax(dim=-1, keepdim=True)
        if self.single:  # every row sees a key of its only group: its max is finite
            s.sub_(m)
            return
        if self.m is None:
            self.m = torch.full(self.rows + (1,), -math.inf, dtype=torch.float32,
                                device=self.runner.device)
        m_new = torch.maximum(self.m, m.float()).clamp_min_(low)
        self.corr = torch.exp(self.m - m_new)
        self.m = m_new
        s.sub_(m_new.to(work))  # exact: every value came from ``work``

    def merge(self, o: torch.Tensor, scale: float) -> None:
        """Fold one group's ``P.V`` (times ``scale``) into the accumulator."""
        if self.single and o.dtype != torch.float32:
            self.direct = o
            return
        if self.corr is not None:
            self.acc.mul_(self.corr)
            self.corr = None
        self.acc.add_(o, alpha=scale)

    def result(self) -> torch.Tensor:
        return self.direct if self.direct is not None else self.acc

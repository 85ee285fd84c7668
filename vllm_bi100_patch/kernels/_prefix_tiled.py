"""The tiled path of ``paged_prefix``: plain matrix products and elementwise ops only.

This is the path every GPU takes (fused attention kernels are the BI-V100 hang class).
Queries go in chunks of ``q_chunk`` tokens, keys in tiles of ``k_tile`` tokens (context
tiles start block-aligned and are gathered from the paged cache; then the new tokens'
own K/V), merged with the shared online softmax (``_softmax``) so that the peak extra
memory stays under the budget whatever the context length.

Per tile, the scores make these passes: the ``Q.K^T`` GEMM writes them (the softmax scale
is its ``alpha``), the row max reads them, the shift and ``exp`` run in place, and the
``P.V`` GEMM reads the probabilities.  The row sums come out of that same GEMM: every
value tile carries a ones column (``_prefix_plan.value_columns``).  Buffers for the query,
K and V tiles, scores and the softmax state are allocated once per sequence and reused by
every chunk and tile.  The causal/window mask is only built for tiles that need one, and
key tiles a chunk cannot see (outside its sliding window) are skipped.  Only the first
``context`` cached slots are read into a tile's visible part: slots past the end of the
cache never reach the output, nor do slots before the sliding window's start (zeroed in
the tile that straddles it).  In float16 no ``P.V`` product can overflow (value tiles are
scaled by a power of two), and a sequence whose scores overflowed is flagged for a float32
recompute (``TiledSequence.overflow``).
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from ._common import accumulate_bmm, ceil_div, pow2_at_least, work_dtype
from ._gather import gather_keys, gather_values
from ._prefix_plan import PrefixInputs, PrefixPlan, SeqSpan, value_columns
from ._softmax import OnlineSoftmax

__all__ = ["TiledSequence"]


class TiledSequence:
    """One sequence on the tiled path, with its buffers sized by the plan."""

    def __init__(self, inp: PrefixInputs, seq: SeqSpan, plan: PrefixPlan,
                 dtype: Optional[torch.dtype] = None) -> None:
        spec, device = inp.spec, inp.query.device
        self.inp, self.seq = inp, seq
        self.q_chunk = min(plan.q_chunk, max(1, seq.q_len))
        self.k_tile = plan.k_tile
        self.dtype = dtype or work_dtype(inp.query.dtype, device)
        kv, d = spec.num_kv_heads, spec.head_size
        self.cols = value_columns(d, torch.empty((), dtype=self.dtype).element_size())
        rows = inp.group * self.q_chunk
        self._q = torch.empty(kv * rows * d, dtype=self.dtype, device=device)
        self._k = torch.empty(kv * self.k_tile * d, dtype=self.dtype, device=device)
        self._v = torch.empty(kv * self.k_tile * self.cols, dtype=self.dtype, device=device)
        self._s = torch.empty(kv * rows * self.k_tile, dtype=self.dtype, device=device)
        self._state = OnlineSoftmax((kv, rows), self.cols, device, separate_sum=False)
        sum_column = torch.zeros(self.cols - d, dtype=self.dtype, device=device)
        sum_column[0] = 1
        self._sum_column = sum_column
        # A float scale is the GEMM's alpha (applied before the scores' one rounding); a
        # tensor scale multiplies the query instead.
        self._scale_in_gemm = isinstance(inp.q_scale, float)
        # float16 (range 65,504): each value tile is divided by a power of two >= its largest
        # magnitude, and the P.V columns multiplied back in float32 (``_value_scale``), so
        # that no P.V sum can overflow; scores cannot be bounded for free, so a sequence
        # whose float16 scores overflowed is flagged (``overflow``: a running max that is not
        # finite, where every query sees at least itself) and recomputed by the caller.
        self._half_range = self.dtype == torch.float16
        self.overflow: Optional[torch.Tensor] = None
        if self._half_range:
            self.overflow = torch.zeros((), dtype=torch.bool, device=device)
            self._col_scale = torch.ones(1, 1, self.cols, dtype=torch.float32, device=device)

    def run(self, out: torch.Tensor) -> None:
        """Attend every query of the sequence; writes its rows of ``out``."""
        for c0 in range(0, self.seq.q_len, self.q_chunk):
            self._chunk(c0, min(self.seq.q_len, c0 + self.q_chunk), out)

    def _chunk(self, c0: int, c1: int, out: torch.Tensor) -> None:
        inp, seq = self.inp, self.seq
        spec = inp.spec
        kv, group, d, bs = spec.num_kv_heads, inp.group, spec.head_size, spec.block_size
        n_q = c1 - c0
        q = self._q[:kv * group * n_q * d].view(kv, group, n_q, d)
        q.copy_(inp.query[seq.start + c0:seq.start + c1].view(n_q, kv, group, d)
                .permute(1, 2, 0, 3))
        if not self._scale_in_gemm:
            q.mul_(inp.q_scale)
        self._state.reset((kv, group * n_q))
        q_first, q_last = seq.ctx + c0, seq.ctx + c1 - 1  # absolute query positions
        lo = 0 if inp.window is None else max(0, q_first - inp.window + 1)
        hi = q_last + 1
        qm = q.view(kv, group * n_q, d)
        # Cached context: block-aligned tiles over [lo, ctx).
        ctx_end = min(seq.ctx, hi)
        for t0 in range(lo // bs * bs, ctx_end, self.k_tile):
            t1 = min(t0 + self.k_tile, ctx_end)
            keys, values = self._context_tile(t0, t1)
            if t0 < lo:  # slots before the window's start: no query of the chunk sees them
                values[:, :lo - t0, :d].zero_()
            self._attend(qm, keys, values, (t0, t1), (q_first, q_last))
        # New tokens: [max(lo, ctx), hi) from key/value.
        for t0 in range(max(lo, seq.ctx), hi, self.k_tile):
            t1 = min(t0 + self.k_tile, hi)
            keys, values = self._new_tile(t0, t1)
            self._attend(qm, keys, values, (t0, t1), (q_first, q_last))
        if self.overflow is not None:
            self.overflow |= ~self._state.m.isfinite().all()
        result = self._state.normalised(d).view(kv, group, n_q, d)
        out[seq.start + c0:seq.start + c1].view(n_q, kv, group, d).copy_(
            result.permute(2, 0, 1, 3))

    def _buffers(self, tokens: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """Contiguous K ``[kv, tokens, D]`` and V ``[kv, tokens, cols]`` views of the buffers,
        the V sum columns set."""
        kv, d = self.inp.spec.num_kv_heads, self.inp.spec.head_size
        keys = self._k[:kv * tokens * d].view(kv, tokens, d)
        values = self._v[:kv * tokens * self.cols].view(kv, tokens, self.cols)
        values[:, :, d:].copy_(self._sum_column)
        return keys, values

    def _context_tile(self, t0: int, t1: int) -> Tuple[torch.Tensor, torch.Tensor]:
        inp = self.inp
        spec = inp.spec
        bs, d = spec.block_size, spec.head_size
        b0, b1 = t0 // bs, ceil_div(t1, bs)
        n = b1 - b0
        ids = self.seq.table[b0:b1]
        keys, values = self._buffers(n * bs)
        gather_keys(inp.key_cache, ids, 1, n, spec, self.dtype, out=keys.view(
            spec.num_kv_heads, 1, n * bs, d))
        gather_values(inp.value_cache, ids, 1, n, spec, self.dtype,
                      out=values[:, :, :d].unsqueeze(1))
        # Tiles start on a block boundary; a partial last block's tail is sliced off.
        keys, values = keys[:, :t1 - t0], values[:, :t1 - t0]
        if inp.k_mult is not None:
            keys.mul_(inp.k_mult)
        if inp.v_mult is not None:
            values[:, :, :d].mul_(inp.v_mult)
        return keys, values

    def _new_tile(self, t0: int, t1: int) -> Tuple[torch.Tensor, torch.Tensor]:
        inp, seq = self.inp, self.seq
        d = inp.spec.head_size
        a, b = seq.start + t0 - seq.ctx, seq.start + t1 - seq.ctx
        keys, values = self._buffers(t1 - t0)
        keys.copy_(inp.key[a:b].transpose(0, 1))
        values[:, :, :d].copy_(inp.value[a:b].transpose(0, 1))
        return keys, values

    def _attend(self, qm: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                k_span: Tuple[int, int], q_span: Tuple[int, int]) -> None:
        """Online-softmax merge of key positions ``[k0, k1)`` into the chunk's state."""
        inp = self.inp
        kv, rows = qm.shape[0], qm.shape[1]
        (k0, k1), (q_first, q_last) = k_span, q_span
        tokens, n_q = k1 - k0, q_last - q_first + 1
        scores = self._scores(qm, keys, rows, tokens)
        view = scores.view(kv, inp.group, n_q, tokens)
        needs_causal = k1 - 1 > q_first
        needs_window = inp.window is not None and k0 <= q_last - inp.window
        if inp.slopes is not None or needs_causal or needs_window:
            device = scores.device
            k_pos = torch.arange(k0, k1, device=device, dtype=torch.int64)
            q_pos = torch.arange(q_first, q_last + 1, device=device, dtype=torch.int64)
            rel = k_pos.view(1, tokens) - q_pos.view(n_q, 1)  # key_pos - query_pos
            if inp.slopes is not None:
                # In float32 (distances past 65,504 are inf in float16, rounded in
                # bfloat16), rounded once into the scores.
                view.addcmul_(inp.slopes, rel.to(torch.float32).view(1, 1, n_q, tokens))
            if needs_causal or needs_window:
                hidden = rel > 0
                if inp.window is not None:
                    hidden |= rel <= -inp.window
                view.masked_fill_(hidden.view(1, 1, n_q, tokens), -math.inf)
        probs = self._state.step(scores)
        accumulate_bmm(self._state.acc, probs, values,
                       self._value_scale(values) if self._half_range else None)

    def _value_scale(self, values: torch.Tensor) -> torch.Tensor:
        """Divide the tile's values (in place) by a power of two >= their largest magnitude
        and >= 1 (exact); returns the float32 column factors that undo it (1 for the sum columns)."""
        d = self.inp.spec.head_size
        low, high = torch.aminmax(values[:, :, :d])
        # >= 1: values below 1 stay as they are (a tile's P.V is then below its token
        # count), and 1 / step (2**-16 at the least) is exact in float16.
        step = pow2_at_least(torch.maximum(torch.maximum(-low, high).float(),
                                           torch.ones((), device=values.device)))
        values[:, :, :d].mul_(1 / step)
        self._col_scale[..., :d] = step
        return self._col_scale

    def _scores(self, qm: torch.Tensor, keys: torch.Tensor, rows: int,
                tokens: int) -> torch.Tensor:
        """``scale * Q.K^T`` for the tile, ``[kv, rows, tokens]``, in the scores buffer."""
        alpha = self.inp.q_scale if self._scale_in_gemm else 1.0
        assert isinstance(alpha, float)
        buf = self._s[:qm.shape[0] * rows * tokens].view(qm.shape[0], rows, tokens)
        return buf.baddbmm_(qm, keys.transpose(1, 2), beta=0, alpha=alpha)

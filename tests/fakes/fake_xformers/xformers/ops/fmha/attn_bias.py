"""Attention biases of the CPU stand-in of ``xformers.ops.fmha.attn_bias`` (0.0.27.post2).

Semantics modelled (those of xformers; a mask entry is 0 where a query may attend a key and
-inf where it may not):

- ``LowerTriangularMask``: causal, aligned top-left (query ``i`` sees keys ``j <= i``);
- ``LowerTriangularMaskWithTensorBias(bias)``: that causal mask plus the additive ``bias``
  (``[B, H, M, N]``, or ``[B, G, H, M, N]`` for 5-D inputs);
- ``BlockDiagonalMask.from_seqlens(q_seqlen, kv_seqlen=None)``: sequences packed along one
  batch row; query block ``b`` sees only key block ``b``, all of it;
- ``BlockDiagonalCausalMask``: the same, causal top-left inside each block;
- ``BlockDiagonalCausalMask.make_local_attention(w)`` -> ``BlockDiagonalCausalLocalAttentionMask``:
  causal with a window of ``w`` keys ending at the query (``i - w < j <= i``).
"""

from __future__ import annotations

from typing import Iterator, List, Optional, Sequence, Tuple

import torch


class AttentionBias:
    """Base class of the structured biases (``attn_bias=`` of memory_efficient_attention)."""

    #: causal inside each block (top-left aligned)
    _causal = False
    #: sliding window in keys (``None``: unbounded)
    _window: Optional[int] = None

    def materialize(self, shape: Tuple[int, ...], dtype: torch.dtype = torch.float32,
                    device="cpu") -> torch.Tensor:
        raise NotImplementedError(type(self).__name__)

    def _allowed(self, rows: torch.Tensor, cols: torch.Tensor) -> Optional[torch.Tensor]:
        """Bool ``[len(rows), len(cols)]`` for positions inside one block; ``None``: all."""
        if not self._causal:
            return None
        allowed = cols[None, :] <= rows[:, None]
        if self._window is not None:
            allowed &= cols[None, :] > rows[:, None] - self._window
        return allowed


def _additive(allowed: Optional[torch.Tensor], rows: int, cols: int, dtype: torch.dtype,
              device) -> torch.Tensor:
    out = torch.zeros(rows, cols, dtype=dtype, device=device)
    if allowed is not None:
        out.masked_fill_(~allowed.to(device), float("-inf"))
    return out


class LowerTriangularMask(AttentionBias):
    """Causal mask, top-left aligned."""

    _causal = True

    def materialize(self, shape, dtype=torch.float32, device="cpu"):
        rows, cols = shape[-2], shape[-1]
        allowed = self._allowed(torch.arange(rows), torch.arange(cols))
        return _additive(allowed, rows, cols, dtype, device).expand(*shape).clone()

    def add_bias(self, bias: torch.Tensor) -> "LowerTriangularMaskWithTensorBias":
        return LowerTriangularMaskWithTensorBias(bias)


class LowerTriangularMaskWithTensorBias(LowerTriangularMask):
    """Causal mask plus an additive tensor bias."""

    def __init__(self, bias: torch.Tensor) -> None:
        if not isinstance(bias, torch.Tensor):
            raise TypeError(f"LowerTriangularMaskWithTensorBias needs a tensor, got {bias!r}")
        self._bias = bias

    def materialize(self, shape, dtype=torch.float32, device="cpu"):
        return super().materialize(shape, dtype, device) + self._bias.to(dtype)


class _SeqLenInfo:
    """Packed sequence lengths: ``seqstart_py`` holds the cumulative starts (``[0, l0, ...]``)."""

    def __init__(self, seqstart_py: List[int]) -> None:
        self.seqstart_py = list(seqstart_py)
        self.seqstart = torch.tensor(self.seqstart_py, dtype=torch.int32)
        lens = [b - a for a, b in self.intervals()]
        self.max_seqlen = max(lens) if lens else 0
        self.min_seqlen = min(lens) if lens else 0

    @classmethod
    def from_seqlens(cls, seqlens: Sequence[int]) -> "_SeqLenInfo":
        starts = [0]
        for n in seqlens:
            n = int(n)
            if n < 0:
                raise ValueError(f"negative sequence length {n}")
            starts.append(starts[-1] + n)
        return cls(starts)

    def intervals(self) -> Iterator[Tuple[int, int]]:
        yield from zip(self.seqstart_py, self.seqstart_py[1:])


class BlockDiagonalMask(AttentionBias):
    """Sequences packed in one batch row; each query block attends its own key block."""

    def __init__(self, q_seqinfo: _SeqLenInfo, k_seqinfo: _SeqLenInfo,
                 _batch_sizes: Optional[Sequence[int]] = None) -> None:
        if len(q_seqinfo.seqstart_py) != len(k_seqinfo.seqstart_py):
            raise ValueError("query and key sequence counts differ")
        self.q_seqinfo = q_seqinfo
        self.k_seqinfo = k_seqinfo
        self._batch_sizes = _batch_sizes

    @classmethod
    def from_seqlens(cls, q_seqlen: Sequence[int],
                     kv_seqlen: Optional[Sequence[int]] = None) -> "BlockDiagonalMask":
        q = _SeqLenInfo.from_seqlens(q_seqlen)
        k = q if kv_seqlen is None else _SeqLenInfo.from_seqlens(kv_seqlen)
        if kv_seqlen is not None and len(kv_seqlen) != len(q_seqlen):
            raise ValueError(f"{len(q_seqlen)} query sequences but {len(kv_seqlen)} key ones")
        return cls(q, k)

    def make_causal(self) -> "BlockDiagonalCausalMask":
        return BlockDiagonalCausalMask(self.q_seqinfo, self.k_seqinfo, self._batch_sizes)

    def blocks(self) -> Iterator[Tuple[int, int, int, int]]:
        """``(q_start, q_end, k_start, k_end)`` of each sequence."""
        for (q0, q1), (k0, k1) in zip(self.q_seqinfo.intervals(), self.k_seqinfo.intervals()):
            yield q0, q1, k0, k1

    def materialize(self, shape, dtype=torch.float32, device="cpu"):
        rows, cols = shape[-2], shape[-1]
        if rows != self.q_seqinfo.seqstart_py[-1] or cols != self.k_seqinfo.seqstart_py[-1]:
            raise ValueError(f"shape {tuple(shape)} does not match the packed lengths "
                             f"{self.q_seqinfo.seqstart_py[-1]} x "
                             f"{self.k_seqinfo.seqstart_py[-1]}")
        out = torch.full((rows, cols), float("-inf"), dtype=dtype, device=device)
        for q0, q1, k0, k1 in self.blocks():
            allowed = self._allowed(torch.arange(q1 - q0), torch.arange(k1 - k0))
            out[q0:q1, k0:k1] = _additive(allowed, q1 - q0, k1 - k0, dtype, device)
        return out.expand(*shape).clone()


class BlockDiagonalCausalMask(BlockDiagonalMask):
    """Block-diagonal, causal (top-left) inside each block."""

    _causal = True

    def make_local_attention(self, window_size: int) -> "BlockDiagonalCausalLocalAttentionMask":
        return BlockDiagonalCausalLocalAttentionMask(self.q_seqinfo, self.k_seqinfo,
                                                     self._batch_sizes, _window_size=window_size)


class BlockDiagonalCausalLocalAttentionMask(BlockDiagonalCausalMask):
    """Block-diagonal causal with a sliding window of ``_window_size`` keys."""

    def __init__(self, q_seqinfo, k_seqinfo, _batch_sizes=None, _window_size: int = 0) -> None:
        super().__init__(q_seqinfo, k_seqinfo, _batch_sizes)
        if isinstance(_window_size, bool) or not isinstance(_window_size, int) \
                or _window_size <= 0:
            raise ValueError(f"window_size must be a positive int, got {_window_size!r}")
        self._window_size = _window_size
        self._window = _window_size


__all__ = ["AttentionBias", "LowerTriangularMask", "LowerTriangularMaskWithTensorBias",
           "BlockDiagonalMask", "BlockDiagonalCausalMask",
           "BlockDiagonalCausalLocalAttentionMask"]

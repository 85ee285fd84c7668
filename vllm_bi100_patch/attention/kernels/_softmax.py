"""The online-softmax update shared by decode and the tiled prefix path.

The state is the float32 running max ``m`` (``[..., rows, 1]``) and a float32 accumulator
``acc`` (``[..., rows, width]``).  Each key tile's scores (``[..., rows, tokens]``, float32
or the work dtype) are turned into probabilities in place, relative to the new running
max, after the state has been rescaled by ``exp(m_old - m_new)``; the caller then adds
``P.V`` into ``acc``.  The row sum is either folded into that product (a ones column in
``V``, so ``acc[..., width - k]`` holds it: no separate pass over the probabilities) or
kept in ``l_sum``.

``tree_sum`` merges partial results of absolute key tiles in an order that depends only on
the tiles' indices (decode: ``decode._tiles``).
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

__all__ = ["OnlineSoftmax", "tree_sum"]


class OnlineSoftmax:
    """Running max, optional running sum and output accumulator, all float32.

    Sized for ``rows_shape`` at most; ``reset`` starts new rows, possibly fewer (views of
    the same storage: no allocation).
    """

    def __init__(self, rows_shape: Tuple[int, ...], width: int, device: torch.device,
                 separate_sum: bool) -> None:
        rows = math.prod(rows_shape)
        self.width = width
        self._m = torch.empty(rows, dtype=torch.float32, device=device)
        self._acc = torch.empty(rows * width, dtype=torch.float32, device=device)
        self._l = torch.empty(rows, dtype=torch.float32, device=device) if separate_sum else None
        self.m = self._m
        self.acc = self._acc
        self.l_sum: Optional[torch.Tensor] = self._l
        #: The last tile's row sums (float32, with ``separate_sum`` only).
        self.tile_sum: Optional[torch.Tensor] = None
        self.reset(rows_shape)

    def reset(self, rows_shape: Tuple[int, ...]) -> None:
        """Start new rows ``rows_shape`` (at most the constructed number of rows)."""
        rows = math.prod(rows_shape)
        self.m = self._m[:rows].view(rows_shape + (1,)).fill_(-math.inf)
        self.acc = self._acc[:rows * self.width].view(rows_shape + (self.width,)).zero_()
        if self._l is not None:
            self.l_sum = self._l[:rows].view(rows_shape + (1,)).zero_()

    def step(self, scores: torch.Tensor) -> torch.Tensor:
        """Merge one tile: rescale the state to the new max and return the tile's
        probabilities (``scores``, overwritten in place, same dtype).

        Masked scores must be ``-inf``; a row with no visible key so far keeps max
        ``-inf`` and gets probabilities 0 (never NaN).
        """
        tile_max = scores.amax(dim=-1, keepdim=True)
        m_new = torch.maximum(self.m, tile_max)
        m_safe = torch.where(m_new == -math.inf, torch.zeros_like(m_new), m_new)
        corr = torch.exp(self.m - m_safe)
        self.acc.mul_(corr)
        self.m.copy_(m_new)
        # The running max only ever holds values of ``scores``' dtype (or 0/-inf), so this
        # cast is exact, and same-dtype in-place ops take the fast (vectorised) path.
        probs = scores.sub_(m_safe.to(scores.dtype)).exp_()
        if self.l_sum is not None:
            self.tile_sum = probs.sum(dim=-1, keepdim=True, dtype=torch.float32)
            self.l_sum.mul_(corr).add_(self.tile_sum)
        return probs

    def normalised(self, head_size: int) -> torch.Tensor:
        """``acc[..., :head_size]`` divided, in place, by the row sums (0 rows stay 0)."""
        total = self.l_sum if self.l_sum is not None else self.acc[..., head_size:head_size + 1]
        out = self.acc[..., :head_size]
        return out.div_(total.clamp_min(1e-30))


def tree_sum(leaves: torch.Tensor) -> torch.Tensor:
    """The sum over dimension 0 (a power of two long) as a pairwise tree of adjacent pairs:
    ``(x0 + x1) + (x2 + x3)``, and so on up; returns ``[1, ...]``.

    The association depends only on the leaves' indices: an aligned power-of-two run of
    leaves is a complete subtree (partial sums of such runs, computed in separate passes,
    are exactly the tree's nodes), and leaves that are exactly zero change no bit of the
    result (``x + 0 == x``), so padding with zero leaves to any larger power of two gives
    the same sum.  Each level is one elementwise add (a launch on a GPU)."""
    length = leaves.shape[0]
    if length & (length - 1):
        raise ValueError(f"tree_sum needs a power-of-two number of leaves, got {length}")
    while leaves.shape[0] > 1:
        leaves = torch.add(leaves[0::2], leaves[1::2])
    return leaves

"""The numbers the decode routes are decided by: the head sizes vLLM's native kernels exist
for, V1's length limit (``v1_limit``) and the BI-V100 occupancy rule (``use_v1``), with the
routing parameters they read (``Routing``).  Decided here only; ``routes.py`` applies them.
Facts and sources: ``docs/bi100-limits.md``.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

from ..kernels.cache import ceil_div

__all__ = ["ILUVATAR_V1_MAX_SEQ_LEN", "NATIVE_HEAD_SIZES", "Routing", "STOCK_V1_MAX_SEQ_LEN",
           "use_v1", "v1_limit"]

#: Head sizes vLLM's native paged-attention kernels are instantiated for.
NATIVE_HEAD_SIZES: Tuple[int, ...] = (64, 80, 96, 112, 120, 128, 192, 256)

#: V1's longest safe ``max_seq_len`` on Iluvatar BI-V100 (field-measured) and stock CUDA.
ILUVATAR_V1_MAX_SEQ_LEN = 32768
STOCK_V1_MAX_SEQ_LEN = 8192


@dataclasses.dataclass(frozen=True)
class Routing:
    """Routing parameters (BI-V100 defaults: 16 SMs x 1 CTA x subscription 5 = 80 CTAs)."""

    fallback_above: Optional[int] = None  # tokens; None = never; 0 = always fallback
    sm_count: int = 16
    sm_occupancy: int = 1
    subscription: int = 5
    partition_size: int = 512
    #: Longest max_seq_len V1 may get; None: by machine and build (see ``v1_limit``).
    v1_max_seq_len: Optional[int] = None
    #: This is an Iluvatar machine (ixformer, a CoreX torch or an Iluvatar device).
    iluvatar: bool = False

    @property
    def max_blocks(self) -> int:
        """CTAs the device runs at once for attention (``GridEvenShare``'s max grid)."""
        return self.sm_count * self.sm_occupancy * self.subscription


def v1_limit(routing: Routing, build: str) -> int:
    """The longest ``max_seq_len`` V1 may be given: the configured limit, else Iluvatar's
    32,768 on an Iluvatar machine or for the vendor's kernels (``OpsProfile.build``), else
    stock CUDA's 8,192."""
    if routing.v1_max_seq_len is not None:
        return routing.v1_max_seq_len
    if routing.iluvatar or build == "vendor":
        return ILUVATAR_V1_MAX_SEQ_LEN
    return STOCK_V1_MAX_SEQ_LEN


def use_v1(num_seqs: int, num_heads: int, max_seq_len: int, routing: Routing,
           limit: int) -> bool:
    """The V1/V2 choice for the native kernels: V1 when one partition's worth of CTAs covers
    the sequence (grid of one) or the ``num_seqs * num_heads`` CTAs already fill the device;
    never above ``limit``, where V1's shared-memory logits do not fit."""
    if max_seq_len > limit:
        return False
    grid = min(ceil_div(max(0, max_seq_len), routing.partition_size), routing.max_blocks)
    return grid <= 1 or num_seqs * num_heads >= routing.max_blocks

"""The decode route table: the one place the routing rules are written.

Two declarative tables, read both by the per-call choice (``NativeDecoder.decode``) and by
``describe()`` (what ``doctor`` and ``status`` print), so an operator is never told a route the
server does not take:

- ``KERNEL_RULES``: when a present kernel cannot take a call (fp8 cache without scales,
  blocksparse without its parameters, V1 above its length limit, V2 with a block size that
  does not divide the partition size);
- ``ROUTES``: ordered rows of (condition, route, reason); the first row whose condition holds
  gives the route.  Each row also says, from what the decoder knows before any call (the
  probe and the routing settings), whether it can ever apply and in which words (``band``;
  None: never).

V1's length limit (``v1_limit``) and the BI-V100 occupancy rule (``use_v1``) are decided here
only.  Facts and sources: ``docs/bi100-limits.md``.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Callable, Optional, Tuple

from ..kernels._common import ceil_div

if TYPE_CHECKING:
    from .decoder import Facts, NativeDecoder
    from .probe import KernelProfile

__all__ = ["ILUVATAR_V1_MAX_SEQ_LEN", "KERNEL_RULES", "NATIVE_HEAD_SIZES", "ROUTES", "Routing",
           "STOCK_V1_MAX_SEQ_LEN", "use_v1", "v1_limit"]

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
    #: Longest max_seq_len V1 may get; None: by machine and convention (see ``v1_limit``).
    v1_max_seq_len: Optional[int] = None
    #: This is an Iluvatar machine (ixformer, a CoreX torch or an Iluvatar device).
    iluvatar: bool = False

    @property
    def max_blocks(self) -> int:
        """CTAs the device runs at once for attention (``GridEvenShare``'s max grid)."""
        return self.sm_count * self.sm_occupancy * self.subscription


def v1_limit(routing: Routing, convention: str) -> int:
    """The longest ``max_seq_len`` V1 may be given: the configured limit, else Iluvatar's
    32,768 on an Iluvatar machine or for the vendor convention, else stock CUDA's 8,192."""
    if routing.v1_max_seq_len is not None:
        return routing.v1_max_seq_len
    if routing.iluvatar or convention == "vendor":
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


def _label(kernel: "KernelProfile") -> str:
    return "V1" if kernel.name.endswith("v1") else "V2"


@dataclasses.dataclass(frozen=True)
class KernelRule:
    """A present kernel that cannot take a call: ``applies`` (can this rule ever exclude
    ``kernel`` here), ``excludes`` (does it for this call), ``band`` (in words)."""

    name: str
    applies: Callable[["NativeDecoder", "KernelProfile"], bool]
    excludes: Callable[["NativeDecoder", "Facts"], bool]
    band: Callable[["NativeDecoder", "KernelProfile"], str]


KERNEL_RULES: Tuple[KernelRule, ...] = (
    KernelRule("fp8", lambda d, k: not (k.takes_scales and k.takes_kv_cache_dtype),
               lambda d, f: f.fp8,
               lambda d, k: f"fp8 KV cache: {_label(k)} takes no scales, so not {_label(k)}"),
    KernelRule("blocksparse", lambda d, k: not k.takes_blocksparse,
               lambda d, f: f.blocksparse,
               lambda d, k: f"blocksparse attention: {_label(k)} takes no blocksparse "
                            f"parameters, so not {_label(k)}"),
    KernelRule("v1_length", lambda d, k: _label(k) == "V1",
               lambda d, f: f.call.max_seq_len > d.v1_limit,
               lambda d, k: f"max_seq_len > {d.v1_limit}: not V1 (its logits would not fit "
                            "in shared memory)"),
    KernelRule("v2_partition", lambda d, k: _label(k) == "V2",
               lambda d, f: d.routing.partition_size % f.call.block_size != 0,
               lambda d, k: f"block sizes that do not divide the partition size "
                            f"{d.routing.partition_size}: not V2"),
)


@dataclasses.dataclass(frozen=True)
class Route:
    """One row: ``when`` (does it apply to this call), ``route``, ``reason`` (why, for a
    fallback), ``band`` (whether it can ever apply with this decoder, and in which words)."""

    name: str
    route: str
    when: Callable[["NativeDecoder", "Facts"], bool]
    band: Callable[["NativeDecoder"], Optional[str]]
    reason: Callable[["NativeDecoder", "Facts"], str] = lambda d, f: ""


def _live(d: "NativeDecoder") -> bool:
    return d.profile is not None and d.routing.fallback_above != 0


def _present(d: "NativeDecoder", which: str) -> bool:
    return d.profile is not None and getattr(d.profile, which).present


def _both(d: "NativeDecoder") -> bool:
    return _live(d) and _present(d, "v1") and _present(d, "v2")


def _unusable(d: "NativeDecoder", f: "Facts") -> str:
    assert d.profile is not None
    return "; ".join(f"{_label(k)}: {d.why_not(k, f)}" for k in (d.profile.v1, d.profile.v2))


ROUTES: Tuple[Route, ...] = (
    Route("no_ops", "fallback", lambda d, f: True,
          lambda d: "every length: pure-PyTorch decode (no native ops)" if d.profile is None
          else None, lambda d, f: "no native ops"),
    Route("forced", "fallback", lambda d, f: True,
          lambda d: "every length: pure-PyTorch decode (fallback forced)"
          if d.profile is not None and d.routing.fallback_above == 0 else None,
          lambda d, f: "fallback_above=0"),
    Route("head_size", "fallback", lambda d, f: f.head_size not in NATIVE_HEAD_SIZES,
          lambda d: f"head sizes outside {list(NATIVE_HEAD_SIZES)}: pure-PyTorch decode"
          if _live(d) and (_present(d, "v1") or _present(d, "v2")) else None,
          lambda d, f: f"head size {f.head_size} has no native kernel"),
    Route("longest", "fallback", lambda d, f: f.longest_above(d.routing.fallback_above or 0),
          lambda d: f"longest sequence > {d.routing.fallback_above}: pure-PyTorch decode"
          if _live(d) and d.routing.fallback_above else None,
          lambda d, f: f"fallback_above={d.routing.fallback_above}"),
    Route("occupancy_v1", "native_v1",
          lambda d, f: f.usable("v1") and f.usable("v2") and f.occupancy_v1(),
          lambda d: f"max_seq_len <= {d.v1_limit}, V1 and V2 usable: native V1 where one "
                    f"partition ({d.routing.partition_size} tokens) covers it or num_seqs x "
                    f"num_heads fills the {d.routing.max_blocks} CTAs (occupancy rule)"
          if _both(d) else None),
    Route("occupancy_v2", "native_v2", lambda d, f: f.usable("v1") and f.usable("v2"),
          lambda d: f"max_seq_len <= {d.v1_limit}, V1 and V2 usable: native V2 otherwise "
                    "(occupancy rule)" if _both(d) else None),
    Route("v1", "native_v1", lambda d, f: f.usable("v1"),
          lambda d: None if not (_live(d) and _present(d, "v1")) else
          f"max_seq_len <= {d.v1_limit}: native V1" if not _present(d, "v2") else
          f"max_seq_len <= {d.v1_limit}, V2 not usable: native V1"),
    Route("v2", "native_v2", lambda d, f: f.usable("v2"),
          lambda d: None if not (_live(d) and _present(d, "v2")) else
          "every length: native V2 (no V1)" if not _present(d, "v1") else
          f"max_seq_len > {d.v1_limit} or V1 not usable: native V2"),
    Route("none_usable", "fallback", lambda d, f: True,
          lambda d: None if not _live(d) else
          f"max_seq_len > {d.v1_limit}: pure-PyTorch decode (no V2)"
          if _present(d, "v1") and not _present(d, "v2") else
          "every length: pure-PyTorch decode (no usable native kernel)"
          if not (_present(d, "v1") or _present(d, "v2")) else
          "neither kernel usable for the call: pure-PyTorch decode", _unusable),
)

#: The rows that choose between the kernels by length: listed first by ``describe``.
LENGTH_ROUTES = ("occupancy_v1", "occupancy_v2", "v1", "v2", "none_usable")

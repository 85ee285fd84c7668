"""Decode routing: vLLM's native ``paged_attention_v1/v2`` or the pure-PyTorch fallback.

The patch layer calls ``decode`` with the arguments vLLM passed to
``PagedAttention.forward_decode`` and the ops module that holds the native kernels (or
``None``); this module never imports vLLM.  The rules are the field-tested seed's, with its
defects fixed:

- native when ``ops`` is given and the head size is one the kernels are built for, fallback
  otherwise or when the longest sequence exceeds ``fallback_above`` (``0``: always);
- blocksparse attention is native-only: a case that would fall back raises
  NotImplementedError instead of silently ignoring the sparsity;
- V1 versus V2 follows the BI-V100 occupancy rule (``sm_count * sm_occupancy *
  subscription`` CTAs), *and* V1 is never used above ``v1_max_seq_len``: V1 keeps the logits
  of the whole sequence in shared memory sized from ``max_seq_len`` (the seed dropped this
  guard and fails on BI-V100 for long contexts);
- the actual longest sequence is read only when it is free (CPU tensors) or needed (eager
  mode, ``max_seq_len`` above the threshold), once per ``seq_lens`` tensor version, and never
  during CUDA-graph capture;
- V2 scratch buffers are grow-only, one per (device, dtype), and sliced per call.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import weakref
from typing import Any, Dict, List, Optional, Tuple

import torch

from ._common import ScaleLike, ceil_div
from .decode import paged_decode

__all__ = [
    "NATIVE_HEAD_SIZES",
    "ROUTE_COUNTS",
    "DecodeRouting",
    "decode",
    "reset_route_counts",
    "route_counts",
    "scratch_bytes",
    "use_v1",
]

logger = logging.getLogger("vllm.bi100_patch")

#: Head sizes vLLM's native paged-attention kernels are instantiated for.
NATIVE_HEAD_SIZES: Tuple[int, ...] = (64, 80, 96, 112, 120, 128, 192, 256)

#: How many decode calls took each route (the patch layer reports them in ``status()``).
ROUTE_COUNTS: Dict[str, int] = {"native_v1": 0, "native_v2": 0, "fallback": 0}
#: Guards ROUTE_COUNTS (``d[k] += 1`` is not atomic across threads).
_counts_lock = threading.Lock()


@dataclasses.dataclass(frozen=True)
class DecodeRouting:
    """Routing parameters (BI-V100 defaults: 16 SMs x 1 CTA x subscription 5 = 80 CTAs)."""

    fallback_above: Optional[int] = None  # tokens; None = never; 0 = always fallback
    sm_count: int = 16
    sm_occupancy: int = 1
    subscription: int = 5
    partition_size: int = 512
    v1_max_seq_len: int = 8192

    @property
    def max_blocks(self) -> int:
        """CTAs the device runs at once for attention (``GridEvenShare``'s max grid)."""
        return self.sm_count * self.sm_occupancy * self.subscription


def route_counts() -> Dict[str, int]:
    """A consistent copy of the route counters."""
    with _counts_lock:
        return dict(ROUTE_COUNTS)


def reset_route_counts() -> None:
    """Zero the route counters."""
    with _counts_lock:
        for key in ROUTE_COUNTS:
            ROUTE_COUNTS[key] = 0


def _count_route(route: str) -> None:
    with _counts_lock:
        ROUTE_COUNTS[route] += 1


def use_v1(num_seqs: int, num_heads: int, max_seq_len: int, routing: DecodeRouting) -> bool:
    """The V1/V2 choice for the native kernels.

    V1 when one partition's worth of CTAs covers the sequence (grid of one) or the
    ``num_seqs * num_heads`` CTAs already fill the device; never above
    ``routing.v1_max_seq_len``, where V1's shared-memory logits do not fit.
    """
    if max_seq_len > routing.v1_max_seq_len:
        return False
    total_tiles = ceil_div(max(0, max_seq_len), routing.partition_size)
    grid = min(total_tiles, routing.max_blocks)
    return grid <= 1 or num_seqs * num_heads >= routing.max_blocks


def decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    kv_cache_dtype: str,
    num_kv_heads: int,
    scale: float,
    alibi_slopes: Optional[torch.Tensor],
    scale_args: Tuple[Any, ...],
    tail_args: Tuple[Any, ...],
    *,
    ops: Any,
    routing: DecodeRouting,
) -> torch.Tensor:
    """Decode attention through the native kernels or ``paged_decode``.

    Args:
        query ... alibi_slopes: ``forward_decode``'s leading arguments, as vLLM passed them.
        scale_args: ``(kv_scale,)`` (vLLM 0.5.0-0.5.2) or ``(k_scale, v_scale)``; passed to
            the native kernels unchanged; the fallback uses ``k = v = kv_scale`` for the
            1-tuple.
        tail_args: ``(tp_rank, blocksparse_local_blocks, blocksparse_vert_stride,
            blocksparse_block_size, blocksparse_head_sliding_step)``, passed unchanged.
        ops: module with ``paged_attention_v1``/``paged_attention_v2``, or None.
        routing: the routing parameters.

    Returns:
        ``[num_seqs, num_heads, head_size]`` attention output in the query's dtype.

    Raises:
        NotImplementedError: blocksparse attention that would have to fall back.
        ValueError: ``scale_args`` of the wrong length; V2 with a partition size that is not
            a multiple of the block size.
    """
    num_seqs, num_heads, head_size = query.shape
    k_scale, v_scale = _fallback_scales(scale_args)
    vert_stride = tail_args[2] if len(tail_args) > 2 else 0
    blocksparse = vert_stride is not None and vert_stride > 1

    fallback = ops is None or head_size not in NATIVE_HEAD_SIZES
    if not fallback and routing.fallback_above is not None:
        threshold = routing.fallback_above
        fallback = threshold == 0 or _longest(seq_lens, max_seq_len, threshold) > threshold

    if fallback:
        if blocksparse:
            why = ("no native ops" if ops is None else
                   f"head size {head_size} has no native kernel"
                   if head_size not in NATIVE_HEAD_SIZES else
                   f"fallback_above={routing.fallback_above}")
            raise NotImplementedError(
                f"blocksparse paged attention (blocksparse_vert_stride={vert_stride}) is only "
                f"available in the native kernels, but this call would fall back ({why}); "
                "the pure-PyTorch decode does not implement block sparsity")
        _count_route("fallback")
        return paged_decode(query, key_cache, value_cache, block_tables, seq_lens, scale,
                            alibi_slopes=alibi_slopes, kv_cache_dtype=kv_cache_dtype,
                            k_scale=k_scale, v_scale=v_scale, max_seq_len=max_seq_len)

    block_size = value_cache.shape[3]
    out = torch.empty_like(query)
    if use_v1(num_seqs, num_heads, max_seq_len, routing):
        _count_route("native_v1")
        ops.paged_attention_v1(out, query, key_cache, value_cache, num_kv_heads, scale,
                               block_tables, seq_lens, block_size, max_seq_len, alibi_slopes,
                               kv_cache_dtype, *scale_args, *tail_args)
        return out

    if routing.partition_size % block_size != 0:
        raise ValueError(
            f"paged_attention_v2 needs partition_size ({routing.partition_size}) to be a "
            f"multiple of block_size ({block_size})")
    partitions = ceil_div(max_seq_len, routing.partition_size)
    exp_sums, max_logits, tmp_out = _SCRATCH.get(num_seqs, num_heads, partitions, head_size,
                                                 out.dtype, out.device)
    _count_route("native_v2")
    ops.paged_attention_v2(out, exp_sums, max_logits, tmp_out, query, key_cache, value_cache,
                           num_kv_heads, scale, block_tables, seq_lens, block_size, max_seq_len,
                           alibi_slopes, kv_cache_dtype, *scale_args, *tail_args)
    return out


def _fallback_scales(scale_args: Tuple[Any, ...]) -> Tuple[ScaleLike, ScaleLike]:
    if len(scale_args) == 1:
        return scale_args[0], scale_args[0]
    if len(scale_args) == 2:
        return scale_args[0], scale_args[1]
    raise ValueError(f"scale_args must be (kv_scale,) or (k_scale, v_scale), got "
                     f"{len(scale_args)} values")


# --- the actual longest sequence, without syncs that matter -------------------------------

_longest_cache: Dict[str, Any] = {"ref": None, "version": -1, "value": 0}


def _capturing() -> bool:
    try:
        return bool(torch.cuda.is_current_stream_capturing())
    except (RuntimeError, AssertionError, AttributeError):  # CPU-only builds raise
        return False


def _read_longest(seq_lens: torch.Tensor) -> int:
    """The one device synchronisation of the routing (tests replace it to count calls)."""
    return int(seq_lens.max().item()) if seq_lens.numel() else 0


def _longest(seq_lens: torch.Tensor, max_seq_len: int, threshold: int) -> int:
    """Longest sequence for the ``fallback_above`` test, or ``max_seq_len`` as its bound.

    ``max_seq_len`` bounds every sequence, so when it is within the threshold no sync is
    needed.  CPU tensors are read directly; during CUDA-graph capture nothing is read (the
    decision must hold for every replay); otherwise one sync per ``seq_lens`` version, shared
    by all layers of a step.
    """
    if max_seq_len <= threshold:
        return max_seq_len
    if seq_lens.device.type == "cpu":
        return int(seq_lens.max()) if seq_lens.numel() else 0
    if _capturing():
        return max_seq_len
    ref = _longest_cache["ref"]
    if ref is not None and ref() is seq_lens and _longest_cache["version"] == seq_lens._version:
        return int(_longest_cache["value"])
    value = _read_longest(seq_lens)
    _longest_cache.update(ref=weakref.ref(seq_lens), version=seq_lens._version, value=value)
    return value


# --- V2 scratch ----------------------------------------------------------------------------


class _Scratch:
    """Grow-only flat buffers for ``paged_attention_v2``: one float32 buffer per device for
    ``exp_sums`` and ``max_logits``, one per (device, dtype) for ``tmp_out``.  A buffer that
    was handed out during CUDA-graph capture is kept alive when it is replaced, because the
    captured graph still points at it."""

    def __init__(self) -> None:
        self.buffers: Dict[Tuple[str, str, torch.dtype], torch.Tensor] = {}
        self.captured: Dict[Tuple[str, str, torch.dtype], bool] = {}
        self.retired: List[torch.Tensor] = []

    def _flat(self, role: str, numel: int, dtype: torch.dtype,
              device: torch.device) -> torch.Tensor:
        key = (role, str(device), dtype)
        buf = self.buffers.get(key)
        if buf is None or buf.numel() < numel:
            if buf is not None and self.captured.get(key):
                self.retired.append(buf)
                logger.debug("V2 scratch %s grew during/after capture; old buffer kept", key)
            buf = torch.empty(numel, dtype=dtype, device=device)
            self.buffers[key] = buf
            self.captured[key] = False
        if _capturing():
            self.captured[key] = True
        return buf

    def get(self, num_seqs: int, num_heads: int, partitions: int, head_size: int,
            dtype: torch.dtype, device: torch.device
            ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        stats = num_seqs * num_heads * partitions
        f32 = self._flat("stats", 2 * stats, torch.float32, device)
        exp_sums = f32[:stats].view(num_seqs, num_heads, partitions)
        max_logits = f32[stats:2 * stats].view(num_seqs, num_heads, partitions)
        tmp = self._flat("tmp_out", stats * head_size, dtype, device)
        tmp_out = tmp[:stats * head_size].view(num_seqs, num_heads, partitions, head_size)
        return exp_sums, max_logits, tmp_out

    def nbytes(self) -> int:
        held = list(self.buffers.values()) + self.retired
        return sum(t.numel() * t.element_size() for t in held)

    def clear(self) -> None:
        self.buffers.clear()
        self.captured.clear()
        self.retired.clear()


_SCRATCH = _Scratch()


def scratch_bytes() -> int:
    """Total bytes held by the V2 scratch buffers (including ones kept for captured graphs)."""
    return _SCRATCH.nbytes()

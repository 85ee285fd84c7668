"""Decode routing: vLLM's native ``paged_attention_v1/v2`` or the pure-PyTorch fallback.

The patch layer calls ``decode`` with the arguments vLLM passed to
``PagedAttention.forward_decode`` and the ops module that holds the native kernels (or
``None``); this module never imports vLLM.  The rules:

- the native kernels are called as the installed build defines them (``native.NativeOps``:
  stock or Iluvatar vendor convention, each kernel's own parameters, stubs that only raise
  NotImplementedError treated as absent);
- native when ``ops`` is given and the head size is one the kernels are built for, fallback
  otherwise or when the longest sequence exceeds ``fallback_above`` (``0``: always);
- V1 is never given a ``max_seq_len`` above its limit: V1 keeps the logits of the whole
  sequence in shared memory sized from ``max_seq_len`` (Iluvatar BI-V100: correct through
  32,768 tokens, hangs above; stock CUDA: 8,192);
- when both V1 and V2 exist and V1 is safe, the BI-V100 occupancy rule chooses
  (``sm_count * sm_occupancy * subscription`` CTAs); when only one exists it is used where
  safe; otherwise the pure-PyTorch decode runs;
- an fp8 cache never reaches a kernel that cannot take the scales (CoreX 3.2.3's V1);
- blocksparse attention is native-only: a case that would fall back raises
  NotImplementedError instead of silently ignoring the sparsity;
- the actual longest sequence is read only when it is free (CPU tensors) or needed (eager
  mode, ``max_seq_len`` above the threshold), once per ``seq_lens`` tensor version, and never
  during CUDA-graph capture;
- V2 scratch buffers are grow-only, one per (device, dtype), and sliced per call.
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from typing import Any, Dict, List, Optional, Tuple, Union

import torch

from .._log import log
from . import native
from ._common import ScaleLike, as_count, ceil_div
from .decode import paged_decode

__all__ = [
    "ILUVATAR_V1_MAX_SEQ_LEN",
    "NATIVE_HEAD_SIZES",
    "STOCK_V1_MAX_SEQ_LEN",
    "ROUTE_COUNTS",
    "DecodeRouting",
    "decode",
    "reset_route_counts",
    "route_counts",
    "scratch_bytes",
    "use_v1",
    "v1_limit",
]


#: Head sizes vLLM's native paged-attention kernels are instantiated for.
NATIVE_HEAD_SIZES: Tuple[int, ...] = (64, 80, 96, 112, 120, 128, 192, 256)

#: V1's longest safe ``max_seq_len`` on Iluvatar BI-V100 (field-measured) and stock CUDA.
ILUVATAR_V1_MAX_SEQ_LEN = 32768
STOCK_V1_MAX_SEQ_LEN = 8192

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
    #: Longest max_seq_len V1 may get; None: by convention (vendor 32,768, stock 8,192).
    v1_max_seq_len: Optional[int] = None

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
    limit = routing.v1_max_seq_len
    if max_seq_len > (STOCK_V1_MAX_SEQ_LEN if limit is None else limit):
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
    num_kv_heads: Union[int, torch.Tensor],
    scale: float,
    alibi_slopes: Optional[torch.Tensor],
    *,
    k_scale: ScaleLike = 1.0,
    v_scale: ScaleLike = 1.0,
    kv_scale: Optional[ScaleLike] = None,
    tp_rank: int = 0,
    blocksparse_local_blocks: int = 0,
    blocksparse_vert_stride: int = 0,
    blocksparse_block_size: int = 64,
    blocksparse_head_sliding_step: int = 0,
    ops: Any,
    routing: DecodeRouting,
) -> torch.Tensor:
    """Decode attention through the native kernels or ``paged_decode``.

    Args:
        query ... alibi_slopes: ``forward_decode``'s leading arguments, as vLLM passed them.
            ``num_kv_heads`` may be the ``head_mapping`` tensor Iluvatar's XFormers backend
            passes in its place (one int32 entry per query head): it is handed unchanged to a
            kernel that takes ``head_mapping``; a stock-convention kernel gets the cache's KV
            head count instead.
        k_scale, v_scale: fp8 dequantisation scales.
        kv_scale: vLLM 0.5.0 - 0.5.2's single scale (used for K and V; given to the native
            kernels as ``kv_scale``); None for later families.
        tp_rank, blocksparse_*: passed to native kernels that take them.
        ops: module with ``paged_attention_v1``/``paged_attention_v2`` (profiled once, see
            ``native.NativeOps``), or None.
        routing: the routing parameters.

    Returns:
        ``[num_seqs, num_heads, head_size]`` attention output in the query's dtype.

    Raises:
        NotImplementedError: blocksparse attention that would have to fall back.
        ValueError: a ``head_mapping`` of the wrong shape, an int ``num_kv_heads`` that does
            not match the cache, a ``max_seq_len`` that is not an integer >= 0.
    """
    check_shapes(query, key_cache, value_cache, block_tables, seq_lens)
    num_seqs, num_heads, head_size = query.shape
    max_seq_len = as_count("max_seq_len", max_seq_len)
    if kv_scale is not None:
        k_scale = v_scale = kv_scale
    native.check_head_mapping(num_kv_heads, num_heads, int(key_cache.shape[1]), query.device)
    verify_bound(seq_lens, max_seq_len)
    blocksparse = blocksparse_vert_stride is not None and blocksparse_vert_stride > 1
    profile = native.NativeOps.of(ops) if ops is not None else None

    route, why = _choose(profile, query, value_cache.shape[3], seq_lens, max_seq_len,
                         kv_cache_dtype, blocksparse, routing)
    while route != "fallback":
        assert profile is not None
        out = torch.empty_like(query)
        values = {
            "out": out, "query": query, "key_cache": key_cache, "value_cache": value_cache,
            "num_kv_heads": native.kv_heads_of(num_kv_heads, key_cache),
            "scale": scale, "block_tables": block_tables, "seq_lens": seq_lens,
            "block_size": value_cache.shape[3], "max_seq_len": max_seq_len,
            "alibi_slopes": alibi_slopes, "kv_cache_dtype": kv_cache_dtype,
            "k_scale": k_scale, "v_scale": v_scale, "tp_rank": tp_rank,
            "blocksparse_local_blocks": blocksparse_local_blocks,
            "blocksparse_vert_stride": blocksparse_vert_stride,
            "blocksparse_block_size": blocksparse_block_size,
            "blocksparse_head_sliding_step": blocksparse_head_sliding_step,
        }
        if kv_scale is not None:
            values["kv_scale"] = kv_scale
        if profile.kernel(route[len("native_"):]).takes_head_mapping:
            # Only vendor kernels need it (and only vendor builds, always eager, run them):
            # never built for a stock kernel, so never during CUDA-graph capture.
            values["head_mapping"] = native.head_mapping_for(num_kv_heads, num_heads,
                                                             query.device)
        if route == "native_v2":
            partitions = ceil_div(max_seq_len, routing.partition_size)
            values["exp_sum"], values["max_logits"], values["tmp_out"] = _SCRATCH.get(
                num_seqs, num_heads, partitions, head_size, out.dtype, out.device)
        if profile.call(route[len("native_"):], values):
            _count_route(route)
            return out
        # The kernel turned out to be a stub: it is now marked absent; choose again.
        route, why = _choose(profile, query, value_cache.shape[3], seq_lens, max_seq_len,
                             kv_cache_dtype, blocksparse, routing)

    if blocksparse:
        raise NotImplementedError(
            f"blocksparse paged attention (blocksparse_vert_stride={blocksparse_vert_stride}) "
            f"is only available in the native kernels, but this call would fall back ({why}); "
            "the pure-PyTorch decode does not implement block sparsity")
    _count_route("fallback")
    return paged_decode(query, key_cache, value_cache, block_tables, seq_lens, scale,
                        alibi_slopes=alibi_slopes, kv_cache_dtype=kv_cache_dtype,
                        k_scale=k_scale, v_scale=v_scale, max_seq_len=max_seq_len)


_RANKS = (("query", 3, "[num_seqs, num_heads, head_size]"),
          ("key_cache", 5, "[num_blocks, num_kv_heads, head_size // x, block_size, x]"),
          ("value_cache", 4, "[num_blocks, num_kv_heads, head_size, block_size]"),
          ("block_tables", 2, "[num_seqs, max_blocks_per_seq]"),
          ("seq_lens", 1, "[num_seqs]"))


def check_shapes(*tensors: Any) -> None:
    """``query, key_cache, value_cache, block_tables, seq_lens`` are tensors of the ranks
    vLLM passes; else ValueError naming the argument (metadata only: no device read)."""
    for (name, rank, layout), t in zip(_RANKS, tensors):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a {rank}-D tensor {layout}, got "
                             f"{type(t).__name__}")
        if t.dim() != rank:
            raise ValueError(f"{name} must be {rank}-D {layout}, got shape {tuple(t.shape)}")


def verify_bound(seq_lens: torch.Tensor, max_seq_len: int) -> None:
    """``max_seq_len`` must bound every sequence: it alone decides whether V1 may run (V1
    sizes its shared memory from it; a longer sequence overruns it and hangs BI-V100).

    Checked where it is free: CPU ``seq_lens`` (read once per tensor version), or a device
    ``seq_lens`` whose longest value this step already read (``fallback_above``).  Otherwise
    it is trusted, as vLLM computes it from the same lengths on the host
    (docs/bi100-limits.md, "max_seq_len"): reading a device tensor here would be a host sync
    per step, and impossible during CUDA-graph capture."""
    longest = _known_longest(seq_lens)
    if longest is not None and longest > max_seq_len:
        raise ValueError(f"max_seq_len={max_seq_len} is below the longest sequence in "
                         f"seq_lens ({longest}): it must bound every sequence (V1 sizes its "
                         "shared memory from it)")


def v1_limit(profile: Optional[native.NativeOps], routing: DecodeRouting) -> int:
    """The longest ``max_seq_len`` V1 may be given: the configured limit, else Iluvatar's
    32,768 for the vendor convention and stock CUDA's 8,192 otherwise."""
    if routing.v1_max_seq_len is not None:
        return routing.v1_max_seq_len
    if profile is not None and profile.convention == "vendor":
        return ILUVATAR_V1_MAX_SEQ_LEN
    return STOCK_V1_MAX_SEQ_LEN


def _usable(kernel: native.KernelProfile, kv_cache_dtype: str, blocksparse: bool) -> bool:
    """Present, and able to take what this call needs (fp8 scales, block sparsity)."""
    if not kernel.present:
        return False
    if kv_cache_dtype not in ("auto", None) and not (kernel.takes_scales
                                                     and kernel.takes_kv_cache_dtype):
        return False  # e.g. CoreX 3.2.3's V1 ignores kv_cache_dtype: fp8 would be read raw
    if blocksparse and not kernel.takes_blocksparse:
        return False
    return True


def _choose(profile: Optional[native.NativeOps], query: torch.Tensor, block_size: int,
            seq_lens: torch.Tensor, max_seq_len: int, kv_cache_dtype: str, blocksparse: bool,
            routing: DecodeRouting) -> Tuple[str, str]:
    """The route for this call and, for the fallback, why."""
    num_seqs, num_heads, head_size = query.shape
    if profile is None:
        return "fallback", "no native ops"
    if head_size not in NATIVE_HEAD_SIZES:
        return "fallback", f"head size {head_size} has no native kernel"
    if routing.fallback_above is not None:
        threshold = routing.fallback_above
        if threshold == 0 or _longest(seq_lens, max_seq_len, threshold) > threshold:
            return "fallback", f"fallback_above={threshold}"
    limit = v1_limit(profile, routing)
    v1 = _usable(profile.v1, kv_cache_dtype, blocksparse) and max_seq_len <= limit
    v2 = (_usable(profile.v2, kv_cache_dtype, blocksparse)
          and routing.partition_size % block_size == 0)
    if v1 and v2:
        return ("native_v1" if use_v1(num_seqs, num_heads, max_seq_len,
                                      dataclasses.replace(routing, v1_max_seq_len=limit))
                else "native_v2"), ""
    if v1:
        return "native_v1", ""
    if v2:
        return "native_v2", ""
    return "fallback", (f"max_seq_len {max_seq_len} is above V1's limit {limit} and V2 is "
                        f"{profile.v2.describe()}" if profile.v1.present else
                        f"V1 is {profile.v1.describe()}, V2 is {profile.v2.describe()}")


def describe(ops: Any, routing: DecodeRouting) -> Dict[str, Any]:
    """The native-ops profile and the route each length band takes (``status``/``doctor``)."""
    if ops is None:
        return {"native_ops": None, "v1_limit": None,
                "bands": ["every length: pure-PyTorch decode (no native ops)"]}
    profile = native.NativeOps.of(ops)
    limit = v1_limit(profile, routing)
    v1, v2 = profile.v1.present, profile.v2.present
    if routing.fallback_above == 0:
        bands = ["every length: pure-PyTorch decode (fallback forced)"]
    elif v1 and v2:
        bands = [f"max_seq_len <= {limit}: native V1 or V2 (occupancy rule)",
                 f"max_seq_len > {limit}: native V2"]
    elif v1:
        bands = [f"max_seq_len <= {limit}: native V1",
                 f"max_seq_len > {limit}: pure-PyTorch decode (no V2)"]
    elif v2:
        bands = ["every length: native V2 (no V1)"]
    else:
        bands = ["every length: pure-PyTorch decode (no usable native kernel)"]
    if routing.fallback_above:
        bands.append(f"longest sequence > {routing.fallback_above}: pure-PyTorch decode")
    if (v1 or v2) and routing.fallback_above != 0:
        bands.append(f"head sizes outside {list(NATIVE_HEAD_SIZES)}: pure-PyTorch decode")
        if v1 and not profile.v1.takes_scales:
            bands.append("fp8 KV cache: V1 takes no scales, so not V1")
    return {"native_ops": profile.describe(), "v1_limit": limit, "bands": bands}


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
    known = _known_longest(seq_lens)
    if known is not None:
        return known
    if _capturing():
        return max_seq_len
    value = _read_longest(seq_lens)
    _longest_cache.update(ref=weakref.ref(seq_lens), version=seq_lens._version, value=value)
    return value


def _known_longest(seq_lens: torch.Tensor) -> Optional[int]:
    """The longest sequence when it costs no device sync: read from CPU ``seq_lens`` (once
    per tensor version), or the value already read for this device tensor's version."""
    ref = _longest_cache["ref"]
    if ref is not None and ref() is seq_lens and _longest_cache["version"] == seq_lens._version:
        return int(_longest_cache["value"])
    if seq_lens.device.type != "cpu":
        return None
    value = int(seq_lens.max()) if seq_lens.numel() else 0
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
                log.debug("V2 scratch %s grew during/after capture; old buffer kept", key)
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

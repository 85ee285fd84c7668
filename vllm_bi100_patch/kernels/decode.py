"""Pure-PyTorch paged decode attention (one new token per sequence).

All sequences of the batch are processed together: the kernel walks the block table in
tiles of positions (the same tiles for every sequence, padded to the widest one), gathers
each tile's K/V blocks for the whole batch with one ``index_select`` each, and merges the
tiles with an online softmax in float32.  There is no Python loop over sequences and no
host synchronisation, so the call is CUDA-graph capturable, and its Python call count
depends on the context width, not on ``num_seqs`` (see ``decode_tile_tokens``; only the
scratch cap for very large batches shortens tiles).

Tiles are kv-head-major (``_gather``) and merged by the online softmax shared with the
prefix path (``_softmax``).  On CPU (``"fp32"`` compute mode, ``_common.compute_mode``) the
K tile is gathered as whole blocks, transposed as 16-byte units and converted to float32;
values are never transposed: each ``[head_size, block_size]`` block is used as a
transposed matmul operand.  On GPUs (``"native"``) each tile is gathered in one strided
``index_select`` in the cache's dtype and both products run with half-precision inputs
and float32 accumulation; neither can overflow the half dtype (the query is bounded by
``_common.bounded_query``, each tile's probabilities are divided by twice their sum).
Value slots past a sequence's end are zeroed before ``P.V`` (on CPU only in tiles where
some sequence ends: the lengths are free to read there).
No per-sequence ``.item()``.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from ._common import (
    CacheSpec,
    ScaleLike,
    accumulate_bmm,
    as_count,
    bounded_query,
    ceil_div,
    check_alibi,
    check_cache,
    check_heads,
    check_int_tensor,
    fast_layout,
    scale_factor,
    scores_bmm,
    work_dtype,
)
from ._gather import gather_keys, gather_values, gather_values_blocks
from ._softmax import OnlineSoftmax

__all__ = ["decode_tile_tokens", "paged_decode"]

#: Minimum positions per tile (measured on CPU: 512-1024 is the sweet spot for 1-8
#: sequences of 8 KV heads x 128 on an idle machine).
DECODE_TILE_TOKENS = 512
#: Long contexts use at most this many tiles: fewer, larger operations (each one is a
#: parallel region; under CPU contention every region costs a scheduling delay).
DECODE_MAX_TILES = 16
#: Upper bound on one tile's float32 K+V scratch; large batches get shorter tiles so the
#: scratch stays bounded (only then does the tile count grow with the batch).
DECODE_TILE_BYTES = 64 << 20


def decode_tile_tokens(num_seqs: int, num_kv_heads: int, head_size: int, block_size: int,
                       width_tokens: int) -> int:
    """Positions per decode tile: a multiple of ``block_size``.

    ``max(DECODE_TILE_TOKENS, width / DECODE_MAX_TILES)`` (whole blocks), which depends on
    the context width only, unless the float32 K+V scratch of one tile for the whole batch
    would exceed ``DECODE_TILE_BYTES``; never less than one block, never more than the
    gathered width.
    """
    per_token = max(1, num_seqs) * num_kv_heads * head_size * 4 * 2
    tokens = max(DECODE_TILE_TOKENS, ceil_div(width_tokens, DECODE_MAX_TILES))
    tokens = min(tokens, max(1, DECODE_TILE_BYTES // per_token))
    blocks = max(1, ceil_div(tokens, block_size))
    return min(blocks * block_size, max(block_size, ceil_div(width_tokens, block_size)
                                        * block_size))


def paged_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    alibi_slopes: Optional[torch.Tensor] = None,
    kv_cache_dtype: str = "auto",
    k_scale: ScaleLike = 1.0,
    v_scale: ScaleLike = 1.0,
    max_seq_len: Optional[int] = None,
) -> torch.Tensor:
    """Decode attention of one query token per sequence over its paged KV cache.

    Args:
        query: ``[num_seqs, num_heads, head_size]``; float32, float16 or bfloat16.
        key_cache: ``[num_blocks, num_kv_heads, head_size // x, block_size, x]``.
        value_cache: ``[num_blocks, num_kv_heads, head_size, block_size]``.
        block_tables: ``[num_seqs, max_blocks_per_seq]`` physical block ids.
        seq_lens: ``[num_seqs]`` tokens in the cache per sequence (the query is the last).
        scale: softmax scale applied to ``q . k``.
        alibi_slopes: optional ``[num_heads]`` slopes; bias ``slope * (key_pos - query_pos)``.
        kv_cache_dtype: ``"auto"`` (cache dtype == query dtype) or ``"fp8"``,
            ``"fp8_e4m3"``, ``"fp8_e5m2"`` (uint8 cache dequantised with the scales).
        k_scale, v_scale: fp8 dequantisation scales, floats or 1-element tensors; ignored
            for ``"auto"`` as in vLLM.
        max_seq_len: optional host upper bound on ``seq_lens``; the gather is sized from it
            (capped at ``block_tables.shape[1]`` blocks) instead of from the table width
            (no device sync either way).

    Returns:
        ``[num_seqs, num_heads, head_size]`` in the query's dtype; zeros for sequences of
        length 0.  Cache slots no token attends to (past ``seq_lens``, blocks behind
        padding columns) never reach the output, whatever they hold (NaN, inf,
        uninitialised fp8 bytes): their scores are masked and their values zeroed.
        Inputs are never modified.

    Raises:
        ValueError: shapes, dtypes or head counts that disagree; for CPU tensors also a
            block table too short for ``seq_lens`` and block ids out of range (on devices
            these value checks would need a host sync, so they are skipped there).
        NotImplementedError: an fp8 cache on a torch without float8 dtypes.
    """
    spec, group, width, shortest = _check_call(query, key_cache, value_cache, block_tables,
                                               seq_lens, alibi_slopes, kv_cache_dtype,
                                               max_seq_len)
    out = torch.zeros_like(query)
    num_seqs, _, head_size = query.shape
    if num_seqs == 0 or width == 0:
        return out
    q_scale = scale_factor(scale, "scale")
    if spec.fp8:
        q_scale = q_scale * scale_factor(k_scale, "k_scale")
    result = _attend(query, key_cache, value_cache, block_tables, seq_lens, q_scale,
                     alibi_slopes, spec, width, shortest)
    if spec.fp8:
        result.mul_(scale_factor(v_scale, "v_scale"))
    out.view(num_seqs, spec.num_kv_heads, group, head_size).copy_(result.permute(1, 0, 2, 3))
    return out


def _check_call(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                block_tables: torch.Tensor, seq_lens: torch.Tensor,
                alibi_slopes: Optional[torch.Tensor], kv_cache_dtype: str,
                max_seq_len: Optional[int]) -> Tuple[CacheSpec, int, int, int]:
    """Validate the call; returns the cache spec, the GQA group, the gathered width in
    blocks and the shortest sequence length (0 where reading it would sync)."""
    if not isinstance(query, torch.Tensor) or query.dim() != 3:
        raise ValueError("query must be 3-D [num_seqs, num_heads, head_size], got shape "
                         f"{tuple(getattr(query, 'shape', ()))}")
    num_seqs, num_heads, head_size = query.shape
    spec = check_cache(key_cache, value_cache, query.dtype, kv_cache_dtype)
    group = check_heads(num_heads, head_size, spec)
    check_int_tensor(block_tables, "block_tables", (num_seqs, None))
    check_int_tensor(seq_lens, "seq_lens", (num_seqs,))
    check_alibi(alibi_slopes, num_heads)
    for name, t in (("key_cache", key_cache), ("block_tables", block_tables),
                    ("seq_lens", seq_lens)):
        if t.device != query.device:
            raise ValueError(f"{name} is on {t.device} but query is on {query.device}")
    block_size = spec.block_size
    table_width = block_tables.shape[1]
    width = table_width
    if max_seq_len is not None:
        max_seq_len = as_count("max_seq_len", max_seq_len)
        # An inflated bound (vLLM passes max_seq_len_to_capture under CUDA graphs) never
        # widens the gather past the table.
        width = min(ceil_div(max_seq_len, block_size), table_width)
    # Positions below ``shortest`` are inside every sequence: tiles that end there need no
    # value zeroing. Known for free on CPU; on devices reading it would sync, so 0.
    shortest = 0
    if query.device.type == "cpu":
        shortest = _check_values_cpu(block_tables, seq_lens, width, block_size,
                                     spec.num_blocks, max_seq_len)
    return spec, group, width, shortest


def _attend(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
            block_tables: torch.Tensor, seq_lens: torch.Tensor, q_scale: ScaleLike,
            alibi_slopes: Optional[torch.Tensor], spec: CacheSpec, width: int,
            shortest: int) -> torch.Tensor:
    """The tile loop; returns the normalised float32 ``[kv_heads, num_seqs, group, D]``."""
    num_seqs, num_heads, head_size = query.shape
    kv_heads, block_size = spec.num_kv_heads, spec.block_size
    group = num_heads // kv_heads
    device = query.device
    dtype = work_dtype(query.dtype, device)
    seq_lens_i = seq_lens.to(torch.int64)
    # Block ids past a sequence's end may be padding (garbage): read block 0 instead (its
    # values are zeroed there, see ``_gather``).
    block_start = torch.arange(width, device=device, dtype=torch.int64) * block_size
    used = block_start.unsqueeze(0) < seq_lens_i.unsqueeze(1)
    safe_tables = torch.where(used, block_tables[:, :width].to(torch.int64),
                              torch.zeros((), dtype=torch.int64, device=device))

    # Query kv-head-major [kv, num_seqs, group, D] (a new tensor: the input is left alone).
    # float32: pre-scaled; half: bounded (no score product can overflow), the float32
    # scores are scaled instead.
    q_kv = query.view(num_seqs, kv_heads, group, head_size).permute(1, 0, 2, 3)
    row_scale: Optional[torch.Tensor] = None
    if dtype == torch.float32:
        qf = (q_kv.to(torch.float32) * q_scale).contiguous()
    else:
        qf, row_scale = bounded_query(q_kv, q_scale, dtype)

    slopes: Optional[torch.Tensor] = None
    last_pos: Optional[torch.Tensor] = None
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(device=device, dtype=torch.float32).view(
            kv_heads, 1, group, 1)
        last_pos = (seq_lens_i - 1).to(torch.float32).view(1, num_seqs, 1, 1)

    tile = decode_tile_tokens(num_seqs, kv_heads, head_size, block_size,
                              width * block_size)
    tile_blocks = tile // block_size
    offsets = torch.arange(tile, device=device, dtype=torch.int64)
    blockwise_values = fast_layout(device)
    state = OnlineSoftmax((kv_heads, num_seqs, group), head_size, device, separate_sum=True)
    batch = kv_heads * num_seqs

    for w0 in range(0, width, tile_blocks):
        n = min(tile_blocks, width - w0)
        tokens = n * block_size
        ids = safe_tables[:, w0:w0 + n].reshape(-1)

        keys = gather_keys(key_cache, ids, num_seqs, n, spec, dtype)  # [kv, S, tokens, D]
        scores = scores_bmm(qf.view(batch, group, head_size),
                            keys.view(batch, tokens, head_size).transpose(1, 2))
        scores = scores.view(kv_heads, num_seqs, group, tokens)
        del keys
        if row_scale is not None:
            scores.mul_(row_scale)

        pos = offsets[:tokens] + w0 * block_size
        if slopes is not None and last_pos is not None:
            scores.add_(slopes * (pos.to(torch.float32).view(1, 1, 1, tokens) - last_pos))
        beyond = pos.unsqueeze(0) >= seq_lens_i.unsqueeze(1)  # [num_seqs, tokens]
        # masked_fill (not an additive mask) also replaces NaN/inf scores of unused keys.
        scores.masked_fill_(beyond.view(1, num_seqs, 1, tokens), -math.inf)
        hidden = beyond if (w0 + n) * block_size > shortest else None
        probs = state.step(scores)
        weight: Optional[torch.Tensor] = None
        if dtype != torch.float32:
            # Half products: the tile's probabilities are divided by twice their row sum
            # before rounding (they sum to <= 1/2, so P.V, a weighted mean of the values,
            # stays finite in any order of summation); the sum is put back in float32.
            assert state.tile_sum is not None
            weight = state.tile_sum.mul(2).clamp_min_(torch.finfo(torch.float32).tiny)
            probs = probs.div_(weight)
        probs = probs.to(dtype)

        if blockwise_values:
            # Per block: [group, bs] @ [bs, D] against the native [D, bs] block (a
            # transposed view, no copy), then sum the blocks of the tile.
            values = gather_values_blocks(value_cache, ids, num_seqs, n, spec, dtype, hidden)
            p_blocks = probs.view(kv_heads, num_seqs, group, n, block_size).permute(
                1, 3, 0, 2, 4)
            pv = torch.matmul(p_blocks, values.transpose(-1, -2))  # [S, n, kv, group, D]
            pv_sum = pv.sum(dim=1, dtype=torch.float32).permute(1, 0, 2, 3)
            del pv
            if weight is None:
                state.acc.add_(pv_sum)
            else:
                state.acc.addcmul_(pv_sum, weight)
        else:
            values = gather_values(value_cache, ids, num_seqs, n, spec, dtype, hidden)
            accumulate_bmm(state.acc.view(batch, group, head_size),
                           probs.view(batch, group, tokens),
                           values.view(batch, tokens, head_size),
                           None if weight is None else weight.view(batch, group, 1))
        del values, probs, scores

    # The row sum is >= 1 wherever a key was visible; 0 (acc 0 too) for empty sequences.
    return state.normalised(head_size)


def _check_values_cpu(block_tables: torch.Tensor, seq_lens: torch.Tensor, width: int,
                      block_size: int, num_blocks: int, max_seq_len: Optional[int]) -> int:
    """Value checks that are free on CPU tensors (skipped on devices: they would sync).

    Returns the shortest sequence length (0 for an empty batch)."""
    if seq_lens.numel() == 0:
        return 0
    longest = int(seq_lens.max())
    shortest = int(seq_lens.min())
    if shortest < 0:
        raise ValueError(f"seq_lens must be >= 0, got min {shortest}")
    if max_seq_len is not None and longest > max_seq_len:
        raise ValueError(f"seq_lens max {longest} exceeds max_seq_len={max_seq_len}")
    if longest > width * block_size:
        raise ValueError(
            f"block_tables too short: seq_lens max {longest} needs "
            f"{ceil_div(longest, block_size)} blocks of {block_size}, block_tables has "
            f"{block_tables.shape[1]} columns")
    needed = ceil_div(longest, block_size)
    if needed == 0:
        return shortest
    used = (torch.arange(needed).unsqueeze(0) * block_size
            < seq_lens.to(torch.int64).unsqueeze(1))
    ids = block_tables[:, :needed].to(torch.int64)
    bad = used & ((ids < 0) | (ids >= num_blocks))
    if bool(bad.any()):
        row, col = (int(v) for v in bad.nonzero()[0])
        raise ValueError(
            f"block_tables[{row}, {col}] = {int(ids[row, col])} is out of range for a cache "
            f"of {num_blocks} blocks")
    return shortest

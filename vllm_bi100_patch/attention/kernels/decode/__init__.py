"""Pure-PyTorch paged decode attention (one new token per sequence).

All sequences of the batch are processed together, with no Python loop over sequences and no
host synchronisation on devices (CUDA-graph capturable: the op sequence depends on the
gathered width, i.e. ``max_seq_len``, the batch size and the memory budget only).

Every sequence's positions are cut into tiles of one fixed size at absolute positions, each
tile's partial result is kept, and the partials are merged in an order that depends only on
the tiles' indices (``decode._tiles``): a sequence's output is bit-identical whatever else is
in the call (batch mates, their lengths, padding columns, the order of sequences), since
every matrix product and reduction has the tile's shape and tiles past a sequence's end add
exact zeros.  Two paths (``compute.compute_mode``):

- devices (``"native"``, ``decode._device``): half-precision products with float32
  accumulation, every tile at once: a fixed number of launches per call (about 30-40, the
  merge tree adding one per doubling of the width) while the memory budget allows one pass;
- CPU (``"fp32"`` with the CPU tile layout, ``decode._cpu``): float32 products, short tiles,
  moderate passes, the CPU-tuned gathers of ``_gather``.

(The ``"fp32"`` mode with the generic layout, a test formulation, runs the device path in
float32.)  Work is split into passes so that the call's working set stays under ``budget_mb``
(``decode._tiles.TilePlan``); passes do not change the result by a bit.  No per-sequence
``.item()``; value checks that read the lengths run in the CPU's compute mode only.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..cache import (
    CacheSpec,
    ScaleLike,
    as_count,
    ceil_div,
    check_alibi,
    check_cache,
    check_heads,
    check_int_tensor,
    scale_factor,
)
from ..compute import compute_mode, fast_layout, work_dtype
from . import _cpu, _device
from ._cpu import attend_cpu, plan_cpu
from ._device import attend_device, plan_device
from ._tiles import Calls, TilePlan

__all__ = ["DEFAULT_BUDGET_MB", "minimum_working_set", "paged_decode", "plan_decode"]

#: Default working-set budget of one call (MiB): the default of ``VLLM_BI100_PREFIX_BUDGET_MB``,
#: the setting the patch layer passes for both pure-PyTorch kernels.
DEFAULT_BUDGET_MB = 256


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
    budget_mb: int = DEFAULT_BUDGET_MB,
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
        budget_mb: working set of the call (MiB, besides inputs and output); the work is
            split into passes to stay under it (at least one tile of one sequence per pass).
            The result does not depend on it.

    Returns:
        ``[num_seqs, num_heads, head_size]`` in the query's dtype; zeros for sequences of
        length 0.  Each row depends only on its own sequence: bit-identical whatever else is
        in the batch.  Cache slots no token attends to (past ``seq_lens``, blocks behind
        padding columns) never reach the output, whatever they hold (NaN, inf,
        uninitialised fp8 bytes).  Inputs are never modified.

    Raises:
        ValueError: shapes, dtypes or head counts that disagree; in the CPU's compute mode
            also a block table too short for ``seq_lens`` and block ids out of range (these
            value checks read the lengths: on devices they would need a host sync, so they
            are skipped there; block ids are clamped into the cache instead).
        NotImplementedError: an fp8 cache on a torch without float8 dtypes.
    """
    spec, width, shortest = _check_call(query, key_cache, value_cache, block_tables, seq_lens,
                                        alibi_slopes, kv_cache_dtype, max_seq_len)
    budget = as_count("budget_mb", budget_mb)
    num_seqs, num_heads, head_size = query.shape
    if num_seqs == 0 or width == 0:
        return torch.zeros_like(query)
    out = torch.empty_like(query)  # every element is written below
    q_scale = scale_factor(scale, "scale")
    v_factor: Optional[ScaleLike] = None
    if spec.fp8:
        q_scale = q_scale * scale_factor(k_scale, "k_scale")
        v_factor = scale_factor(v_scale, "v_scale")
    plan = plan_decode(query, spec, width * spec.block_size, budget,
                       alibi=alibi_slopes is not None)
    on_cpu_path = _cpu_path(query.device)
    group = num_heads // spec.num_kv_heads
    out_kv = out.view(num_seqs, spec.num_kv_heads, group, head_size)
    for s0 in range(0, num_seqs, plan.seq_group):
        rows = slice(s0, s0 + plan.seq_group)
        calls = Calls(query[rows], block_tables[rows, :width], seq_lens[rows], alibi_slopes,
                      out_kv[rows])
        if on_cpu_path:
            attend_cpu(calls, key_cache, value_cache, spec, plan, q_scale, v_factor, shortest)
        else:
            attend_device(calls, key_cache, value_cache, spec, plan,
                          work_dtype(query.dtype, query.device), q_scale, v_factor)
    return out


def plan_decode(query: torch.Tensor, spec: CacheSpec, width_tokens: int,
                budget_mb: int = DEFAULT_BUDGET_MB, alibi: bool = False) -> TilePlan:
    """How a call over ``width_tokens`` positions is cut into tiles and passes (``alibi``:
    with ALiBi's bias)."""
    num_seqs, num_heads, _ = query.shape
    budget = max(1, budget_mb) << 20
    if _cpu_path(query.device):
        return plan_cpu(num_seqs, num_heads, spec, width_tokens, budget)
    return plan_device(num_seqs, num_heads, spec, width_tokens,
                       work_dtype(query.dtype, query.device), budget, alibi)


def minimum_working_set(query: torch.Tensor, spec: CacheSpec, width_tokens: int,
                        alibi: bool = False) -> int:
    """Bytes one call over ``width_tokens`` positions needs at least (one sequence, one tile
    of it per pass on CPUs; on devices one sequence beside the products' fixed chunk,
    ``decode._device.working_set``): under a smaller ``budget_mb`` the call runs over it
    (one WARNING per setting on devices; a CPU's one-tile pass is a few hundred KiB).
    ``alibi``: a call with ALiBi slopes (their distances count on devices)."""
    _, heads, _ = query.shape
    if _cpu_path(query.device):
        return _cpu.working_set(1, 1, heads, spec, width_tokens)
    return _device.working_set(1, heads, spec, width_tokens,
                               work_dtype(query.dtype, query.device), alibi)


def _cpu_path(device: torch.device) -> bool:
    """The CPU path: float32 products with the CPU tile layouts (else the device path)."""
    return compute_mode(device) == "fp32" and fast_layout(device)


def _check_call(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                block_tables: torch.Tensor, seq_lens: torch.Tensor,
                alibi_slopes: Optional[torch.Tensor], kv_cache_dtype: str,
                max_seq_len: Optional[int]) -> Tuple[CacheSpec, int, int]:
    """Validate the call; returns the cache spec, the gathered width in blocks and the
    shortest sequence length (0 where it is not read)."""
    if not isinstance(query, torch.Tensor) or query.dim() != 3:
        raise ValueError("query must be 3-D [num_seqs, num_heads, head_size], got shape "
                         f"{tuple(getattr(query, 'shape', ()))}")
    num_seqs, num_heads, head_size = query.shape
    spec = check_cache(key_cache, value_cache, query.dtype, kv_cache_dtype)
    check_heads(num_heads, head_size, spec)
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
    # Positions below ``shortest`` are inside every sequence: passes that end there need no
    # value zeroing.  Read (with the value checks) in the CPU's compute mode only: elsewhere
    # reading the lengths would be a host sync on a device.
    shortest = 0
    if query.device.type == "cpu" and compute_mode(query.device) == "fp32":
        shortest = _check_values_cpu(block_tables, seq_lens, width, block_size,
                                     spec.num_blocks, max_seq_len)
    return spec, width, shortest


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

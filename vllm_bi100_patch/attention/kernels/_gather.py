"""Gathering K/V tiles from the paged caches (layouts in ``cache``).

Tiles are kv-head-major, ``[num_kv_heads, num_seqs, tokens, head_size]``, so that the
matrix products batch over ``(kv head, sequence)`` without another copy.  ``ids`` holds
``num_seqs * blocks`` physical block ids, sequence-major; ``dtype`` is the work dtype
(``compute.work_dtype``): float32, or the query's dtype (fp8 caches are dequantised to it).

Two layouts (``compute.fast_layout``):

- CPU: one contiguous ``index_select`` of whole blocks, then the ``[head_size // x,
  block_size]`` key planes are transposed as 16-byte units (each ``x`` group is exactly 16
  bytes, moved as one complex128: a bit-exact same-dtype copy with a 16-byte inner loop)
  and converted in a separate contiguous pass when the dtype changes.
- other devices: one strided gather over a permuted view of the cache writes the tile in its
  final layout (one pass, straight into the caller's buffer when given: ``index.Tensor_out``,
  so that no second copy of a key group is ever in flight) when no conversion is needed;
  otherwise a gather of whole blocks and one fused transpose-convert copy.

``hidden`` (``[num_seqs, tokens]``, true where no query attends) zeroes value slots: a
probability of exactly 0 does not cancel a NaN or inf value (``0 * nan = nan``), so slots
past a sequence's end, blocks read for padding columns and uninitialised fp8 bytes must
not reach ``P.V``.  A stored 0 byte is +0.0 in every cache dtype.

Token gathers (decode on devices, ``decode._device``): one advanced-indexing op per chunk of
*pairs* (a tile of a sequence) reads every position from its own ``(block, slot)``, so a
position can be redirected to another token (the decode path sends hidden positions to a
visible one instead of zeroing values), straight into the chunk's buffer ``[pairs * kv,
tile, D]`` whose ``(pair, kv head)`` rows are the matrix products' batch.
"""

from __future__ import annotations

from typing import Optional

import torch

from .cache import CacheSpec, to_float
from .compute import fast_layout

__all__ = ["gather_keys", "gather_token_keys", "gather_token_values", "gather_values",
           "gather_values_blocks"]


def gather_keys(key_cache: torch.Tensor, ids: torch.Tensor, num_seqs: int, blocks: int,
                spec: CacheSpec, dtype: torch.dtype,
                out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Keys as ``[kv_heads, num_seqs, blocks * block_size, head_size]`` in ``dtype``,
    written into ``out`` (contiguous, that shape) when given."""
    kv, bs, x = spec.num_kv_heads, spec.block_size, spec.x
    chunks = spec.head_size // x
    shape = (kv, num_seqs, blocks * bs, spec.head_size)
    same = dtype == spec.storage_dtype
    if same and not fast_layout(key_cache.device):
        # One strided pass (``index_select``'s ``out=`` variant is avoided: torch 2.1's meta
        # kernel mis-sizes it for a permuted input; advanced indexing's is not).
        src = key_cache.permute(1, 0, 3, 2, 4)  # [kv, blocks, bs, D / x, x]
        if out is None:
            return torch.index_select(src, 1, ids).view(shape)
        return torch.ops.aten.index.Tensor_out(
            src, [None, ids], out=out.view(kv, num_seqs * blocks, bs, chunks, x)).view(shape)
    if out is None:
        out = torch.empty(shape, dtype=dtype, device=key_cache.device)
    if fast_layout(key_cache.device):
        raw = key_cache.index_select(0, ids)  # [num_seqs * blocks, kv, chunks, bs, x]
        units = raw.view(torch.complex128).view(num_seqs, blocks, kv, chunks, bs)
        units = units.permute(2, 0, 1, 4, 3)  # [kv, num_seqs, blocks, bs, chunks]
        if same:
            out.view(torch.complex128).view(kv, num_seqs, blocks, bs, chunks).copy_(units)
        else:
            staged = units.contiguous().view(spec.storage_dtype)
            del raw
            out.view(kv, num_seqs, blocks, bs, spec.head_size).copy_(to_float(staged, spec))
    else:
        raw = to_float(key_cache.index_select(0, ids), spec)
        out.view(kv, num_seqs, blocks, bs, chunks, x).copy_(
            raw.view(num_seqs, blocks, kv, chunks, bs, x).permute(2, 0, 1, 4, 3, 5))
    return out


def gather_values(value_cache: torch.Tensor, ids: torch.Tensor, num_seqs: int, blocks: int,
                  spec: CacheSpec, dtype: torch.dtype, hidden: Optional[torch.Tensor] = None,
                  out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Values as ``[kv_heads, num_seqs, blocks * block_size, head_size]`` in ``dtype``.

    ``out`` may be a strided view (e.g. the first ``head_size`` columns of a wider buffer)
    whose last dimension is contiguous.  Slots where ``hidden`` is true are zero.
    """
    kv, bs, d = spec.num_kv_heads, spec.block_size, spec.head_size
    if dtype == spec.storage_dtype and not fast_layout(value_cache.device):
        src = value_cache.permute(1, 0, 3, 2)  # [kv, blocks, bs, D]: one strided pass
        if out is None:
            tile = torch.index_select(src, 1, ids)
        else:
            tile = torch.ops.aten.index.Tensor_out(
                src, [None, ids], out=out.view(kv, num_seqs * blocks, bs, d))
        if hidden is not None:
            tile.masked_fill_(hidden.view(1, num_seqs * blocks, bs, 1), 0)
        return tile.view(kv, num_seqs, blocks * bs, d)
    if out is None:
        out = torch.empty((kv, num_seqs, blocks * bs, d), dtype=dtype, device=value_cache.device)
    dest = out.view(kv, num_seqs, blocks, bs, d)
    raw = value_cache.index_select(0, ids)  # [num_seqs * blocks, kv, D, bs]
    _zero_hidden(raw, hidden, num_seqs, blocks, spec)
    dest.copy_(to_float(raw, spec).view(num_seqs, blocks, kv, d, bs).permute(2, 0, 1, 4, 3))
    return out


def gather_values_blocks(value_cache: torch.Tensor, ids: torch.Tensor, num_seqs: int,
                         blocks: int, spec: CacheSpec, dtype: torch.dtype,
                         hidden: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Values in the native block layout ``[num_seqs, blocks, kv_heads, head_size, bs]`` in
    ``dtype`` (no transpose: each block is used as a transposed matmul operand)."""
    raw = value_cache.index_select(0, ids)
    _zero_hidden(raw, hidden, num_seqs, blocks, spec)
    vals = to_float(raw, spec)
    if vals.dtype != dtype:
        vals = vals.to(dtype)
    return vals.view(num_seqs, blocks, spec.num_kv_heads, spec.head_size, spec.block_size)


def _zero_hidden(raw: torch.Tensor, hidden: Optional[torch.Tensor], num_seqs: int,
                 blocks: int, spec: CacheSpec) -> None:
    """Zero, in place, the gathered value slots ``[num_seqs * blocks, kv, D, bs]`` where
    ``hidden`` (``[num_seqs, blocks * bs]``) is true."""
    if hidden is not None:
        raw.view(num_seqs, blocks, spec.num_kv_heads, spec.head_size, spec.block_size)\
            .masked_fill_(hidden.view(num_seqs, blocks, 1, 1, spec.block_size), 0)


def _token_indices(blocks: torch.Tensor, slots: torch.Tensor, heads: Optional[torch.Tensor],
                   first: int, count: int):
    """Index tensors for pairs ``first .. first + count`` (``blocks`` ``[pairs, nb]``, ``slots``
    ``[pairs, nb, bs]``, both contiguous: the result is laid out like them), broadcasting to
    ``[count, kv, nb, bs]``; the kv head index is a slice (``None``) for one KV head."""
    b = blocks[first:first + count].unsqueeze(1).unsqueeze(-1)
    s = slots[first:first + count].unsqueeze(1)
    return b, s, heads


def _gather_tokens(cache: torch.Tensor, index: list, shape: tuple, count: int,
                   spec: CacheSpec, out: torch.Tensor, raw: Optional[torch.Tensor]
                   ) -> torch.Tensor:
    """``cache[index]`` (of ``shape``) written into ``out[:count * kv]`` (``[rows, tile, D]``,
    the work dtype): directly when the dtypes agree, else through ``raw`` (a buffer like
    ``out`` in the cache's dtype) and one converting copy."""
    n = count * spec.num_kv_heads
    dest = out[:n]
    if raw is None:
        torch.ops.aten.index.Tensor_out(cache, index, out=dest.view(shape))
        return dest
    staged = torch.ops.aten.index.Tensor_out(cache, index, out=raw[:n].view(shape))
    return dest.copy_(to_float(staged, spec).view(dest.shape))


def gather_token_keys(key_cache: torch.Tensor, blocks: torch.Tensor, slots: torch.Tensor,
                      heads: Optional[torch.Tensor], first: int, count: int, spec: CacheSpec,
                      out: torch.Tensor, raw: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Keys of pairs ``first .. first + count`` into ``out[:count * kv]`` (``[rows, tile, D]``
    in the work dtype; ``raw``: a buffer like it in the cache's dtype when they differ):
    position ``j`` of pair ``p`` reads slot ``slots[p, j // bs, j % bs]`` of block
    ``blocks[p, j // bs]``.  Returns the written rows."""
    b, s, h = _token_indices(blocks, slots, heads, first, count)
    nb, bs, chunks = slots.shape[1], spec.block_size, spec.head_size // spec.x
    kv = spec.num_kv_heads
    shape = ((count, kv, nb, bs, chunks, spec.x) if h is not None
             else (count, 1, nb, bs, 1, chunks, spec.x))
    return _gather_tokens(key_cache, [b, h, None, s], shape, count, spec, out, raw)


def gather_token_values(value_cache: torch.Tensor, blocks: torch.Tensor, slots: torch.Tensor,
                        heads: Optional[torch.Tensor], first: int, count: int,
                        spec: CacheSpec, out: torch.Tensor,
                        raw: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Values like ``gather_token_keys``."""
    b, s, h = _token_indices(blocks, slots, heads, first, count)
    nb, bs, kv, d = slots.shape[1], spec.block_size, spec.num_kv_heads, spec.head_size
    shape = (count, kv, nb, bs, d) if h is not None else (count, 1, nb, bs, 1, d)
    return _gather_tokens(value_cache, [b, h, None, s], shape, count, spec, out, raw)

"""Gathering K/V tiles from the paged caches (layouts in ``_common``).

Tiles are kv-head-major, ``[num_kv_heads, num_seqs, tokens, head_size]``, so that the
matrix products batch over ``(kv head, sequence)`` without another copy.  ``ids`` holds
``num_seqs * blocks`` physical block ids, sequence-major; ``dtype`` is the work dtype
(``_common.work_dtype``): float32, or the query's dtype (fp8 caches are dequantised to it).

Two layouts (``_common.fast_layout``):

- CPU: one contiguous ``index_select`` of whole blocks, then the ``[head_size // x,
  block_size]`` key planes are transposed as 16-byte units (each ``x`` group is exactly 16
  bytes, moved as one complex128: a bit-exact same-dtype copy with a 16-byte inner loop)
  and converted in a separate contiguous pass when the dtype changes.
- other devices: one strided ``index_select`` over a permuted view of the cache writes the
  tile in its final layout (one pass) when no conversion is needed (plus a copy into the
  caller's reusable buffer, if any); otherwise a gather of whole blocks and one fused
  transpose-convert copy.

``hidden`` (``[num_seqs, tokens]``, true where no query attends) zeroes value slots: a
probability of exactly 0 does not cancel a NaN or inf value (``0 * nan = nan``), so slots
past a sequence's end, blocks read for padding columns and uninitialised fp8 bytes must
not reach ``P.V``.  A stored 0 byte is +0.0 in every cache dtype.

Token gathers (decode on devices, ``decode._device``): one advanced-indexing op per tile
chunk reads every position from its own ``(block, slot)``, so a position can be redirected
to another token (the decode path sends hidden positions to a visible one instead of
zeroing values), in the layout ``[tiles, S, kv, tile, D]`` whose ``(tile, sequence, kv
head)`` rows are the matrix products' batch.
"""

from __future__ import annotations

from typing import Optional

import torch

from ._common import CacheSpec, fast_layout, to_float

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
        # One strided pass (index_select allocates its result contiguous; its ``out=``
        # variant is avoided: torch 2.1's meta kernel mis-sizes it for a permuted input).
        tile = torch.index_select(key_cache.permute(1, 0, 3, 2, 4), 1, ids).view(shape)
        return tile if out is None else out.copy_(tile)
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
    if out is None and dtype == spec.storage_dtype and not fast_layout(value_cache.device):
        tile = torch.index_select(value_cache.permute(1, 0, 3, 2), 1, ids)  # one pass
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
    """Index tensors for tiles ``first .. first + count`` (``blocks`` ``[tiles, S, nb]``,
    ``slots`` ``[tiles, S, nb, bs]``, both contiguous: the result is laid out like them),
    broadcasting to ``[count, S, kv, nb, bs]``; the kv head index is a slice (``None``) for
    one KV head."""
    b = blocks[first:first + count].unsqueeze(2).unsqueeze(-1)
    s = slots[first:first + count].unsqueeze(2)
    return b, s, (slice(None) if heads is None else heads)


def _converted(tile: torch.Tensor, spec: CacheSpec, dtype: torch.dtype) -> torch.Tensor:
    tile = to_float(tile, spec)
    return tile if tile.dtype == dtype else tile.to(dtype)


def gather_token_keys(key_cache: torch.Tensor, blocks: torch.Tensor, slots: torch.Tensor,
                      heads: Optional[torch.Tensor], first: int, count: int, spec: CacheSpec,
                      dtype: torch.dtype) -> torch.Tensor:
    """Keys of tiles ``first .. first + count`` as ``[count * S * kv, tile, D]`` in
    ``dtype``: position ``j`` of tile ``t`` of sequence ``s`` reads slot
    ``slots[t, s, j // bs, j % bs]`` of block ``blocks[t, s, j // bs]``."""
    b, s, h = _token_indices(blocks, slots, heads, first, count)
    tile = key_cache[b, h, :, s, :]  # [count, S, kv, nb, bs, D/x, x] (kv last for a slice)
    return _converted(tile, spec, dtype).view(-1, slots.shape[2] * spec.block_size,
                                              spec.head_size)


def gather_token_values(value_cache: torch.Tensor, blocks: torch.Tensor, slots: torch.Tensor,
                        heads: Optional[torch.Tensor], first: int, count: int,
                        spec: CacheSpec, dtype: torch.dtype) -> torch.Tensor:
    """Values like ``gather_token_keys``: ``[count * S * kv, tile, D]`` in ``dtype``."""
    b, s, h = _token_indices(blocks, slots, heads, first, count)
    tile = value_cache[b, h, :, s]  # [count, S, kv, nb, bs, D]
    return _converted(tile, spec, dtype).view(-1, slots.shape[2] * spec.block_size,
                                              spec.head_size)

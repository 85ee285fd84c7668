"""KV-cache block moves in plain PyTorch: ``swap_blocks`` (between devices) and ``copy_blocks``.

vLLM swaps KV blocks to host memory when it preempts a sequence group by swapping (``n > 1``,
beam search, memory pressure) and copies blocks for copy-on-write.  Iluvatar's CoreX 3.2.3
build routes both through ``ixformer.functions`` names that its ixformer does not define
(``docs/corex-3.2.3.md``), so the server crashes the first time it preempts by swapping.
These functions do the same moves with ``index_select`` / ``index_copy_``: one gather on the
source device, one transfer, one scatter on the destination, in chunks of bounded size.  They
never import vLLM.

Caches are vLLM's ``[2, num_blocks, ...]`` per-layer tensors (plane 0 keys, plane 1 values);
mappings are ``[n, 2]`` integer tensors of (source block, destination block).
"""

from __future__ import annotations

from collections import Counter
from typing import List, Sequence, Tuple

import torch

__all__ = ["CHUNK_BYTES", "copy_blocks", "swap_blocks"]

#: Largest temporary buffer one move allocates (per device).
CHUNK_BYTES = 64 << 20


def _pairs(mapping: torch.Tensor, name: str, src_blocks: Sequence[Tuple[str, int]],
           dst_blocks: Sequence[Tuple[str, int]], same_cache: bool) -> torch.Tensor:
    """``mapping`` as an int64 ``[n, 2]`` tensor, checked on the host before anything moves.

    Refused, with ``name``: block ids outside any of the caches (``(name, num_blocks)``
    pairs), a destination that appears twice, and, when sources and destinations are the same
    cache (``same_cache``), a block that is both a source and a destination.  vLLM's CUDA
    ``copy_blocks`` applies the pairs in parallel, so there a chain (``a -> b, b -> c``) or a
    repeated destination is a race; refusing them keeps every chunk size equivalent to
    reading all sources before writing any destination.  A mapping on a device is read to the
    host once (a sync; block moves are rare, and an index out of range would be a device-side
    assert).
    """
    if not isinstance(mapping, torch.Tensor):
        raise ValueError(f"{name} must be an [n, 2] integer tensor, got {type(mapping).__name__}")
    if mapping.numel() == 0:
        return mapping.reshape(0, 2).long()
    if mapping.dim() != 2 or mapping.shape[1] != 2 or mapping.dtype.is_floating_point \
            or mapping.dtype == torch.bool:
        raise ValueError(f"{name} must be an [n, 2] integer tensor, got shape "
                         f"{tuple(mapping.shape)} dtype {mapping.dtype}")
    pairs: List[List[int]] = mapping.tolist()
    srcs, dsts = [p[0] for p in pairs], [p[1] for p in pairs]
    for ids, caches, role in ((srcs, src_blocks, "source"), (dsts, dst_blocks, "destination")):
        lo, hi = min(ids), max(ids)
        for cache_name, blocks in caches:
            if lo < 0 or hi >= blocks:
                raise ValueError(f"{name} has {role} block ids outside the caches: min {lo}, "
                                 f"max {hi}, but {cache_name} has {blocks} blocks")
    counts = Counter(dsts)
    dup, times = counts.most_common(1)[0]
    if times > 1:
        raise ValueError(f"{name}: block {dup} is the destination of {times} pairs of {name}; "
                         "each destination may be written once")
    if same_cache:
        both = sorted(set(srcs) & counts.keys())
        if both:
            raise ValueError(f"{name}: block {both[0]} is both a source and a destination "
                             "(a chained mapping); vLLM copies the pairs in parallel, so its "
                             "result is undefined there")
    return mapping.long()


def _check_cache(cache: torch.Tensor, name: str) -> None:
    if not isinstance(cache, torch.Tensor) or cache.dim() < 2 or cache.shape[0] != 2:
        raise ValueError(f"{name} must be a [2, num_blocks, ...] KV cache tensor, got shape "
                         f"{tuple(getattr(cache, 'shape', ()))}")


def _move(src: torch.Tensor, dst: torch.Tensor, pairs: torch.Tensor, chunk_bytes: int) -> None:
    block_bytes = max(1, src[0].numel() * src.element_size()) if src.shape[0] else 1
    rows = max(1, chunk_bytes // block_bytes)
    for at in range(0, pairs.shape[0], rows):
        part = pairs[at:at + rows]
        moved = src.index_select(0, part[:, 0].to(src.device))
        dst.index_copy_(0, part[:, 1].to(dst.device), moved.to(dst.device))


def swap_blocks(src_kv_cache: torch.Tensor, dst_kv_cache: torch.Tensor,
                src_to_dst: torch.Tensor, *, chunk_bytes: int = CHUNK_BYTES) -> None:
    """Copy blocks ``src_to_dst[:, 0]`` of ``src_kv_cache`` to blocks ``src_to_dst[:, 1]`` of
    ``dst_kv_cache``, keys and values, across devices (bit-exact).

    Raises:
        ValueError: caches that are not ``[2, num_blocks, ...]``, differ in block shape or
            dtype, a mapping that is not ``[n, 2]`` integers within both caches, or one
            that names a destination twice (or, on one cache, chains blocks); checked before
            anything moves.
    """
    _check_cache(src_kv_cache, "src_kv_cache")
    _check_cache(dst_kv_cache, "dst_kv_cache")
    if src_kv_cache.shape[2:] != dst_kv_cache.shape[2:] or src_kv_cache.dtype != dst_kv_cache.dtype:
        raise ValueError(f"src_kv_cache {tuple(src_kv_cache.shape)} {src_kv_cache.dtype} and "
                         f"dst_kv_cache {tuple(dst_kv_cache.shape)} {dst_kv_cache.dtype} differ "
                         "in block shape or dtype")
    pairs = _pairs(src_to_dst, "src_to_dst", [("src_kv_cache", src_kv_cache.shape[1])],
                   [("dst_kv_cache", dst_kv_cache.shape[1])],
                   src_kv_cache.data_ptr() == dst_kv_cache.data_ptr())
    for plane in (0, 1):
        _move(src_kv_cache[plane], dst_kv_cache[plane], pairs, chunk_bytes)


def copy_blocks(kv_caches: Sequence[torch.Tensor], src_to_dists: torch.Tensor, *,
                chunk_bytes: int = CHUNK_BYTES) -> None:
    """Copy block ``src_to_dists[i, 0]`` to block ``src_to_dists[i, 1]`` in every layer's
    cache, keys and values (copy-on-write).  The result is that of reading every source
    before writing any destination, for every chunk size: chained mappings and repeated
    destinations are refused (ValueError), as are block ids outside any layer's cache; all
    of it is checked before anything moves."""
    caches = list(kv_caches)
    for i, cache in enumerate(caches):
        _check_cache(cache, f"kv_caches[{i}]")
    if not caches:
        return
    sizes = [(f"kv_caches[{i}]", cache.shape[1]) for i, cache in enumerate(caches)]
    pairs = _pairs(src_to_dists, "src_to_dists", sizes, sizes, same_cache=True)
    for cache in caches:
        for plane in (0, 1):
            _move(cache[plane], cache[plane], pairs, chunk_bytes)

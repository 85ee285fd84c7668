"""Writing new tokens' K/V into fp8 paged caches, in pure PyTorch.

vLLM's ``reshape_and_cache`` with ``kv_cache_dtype`` ``"fp8"``/``"fp8_e4m3"`` (e4m3) or
``"fp8_e5m2"`` stores each element as the fp8 bits of ``float32(x) / scale``, rounded to
nearest and saturated to the largest finite fp8 value (CUDA's ``__nv_cvt_float_to_fp8(x /
scale, __NV_SATFINITE, ...)`` in ``csrc/quantization/fp8/nvidia/quant_utils.cuh``), in caches
of ``uint8`` laid out as vLLM's (``cache``); tokens whose slot is negative (padding) are not
written.  ``write_fp8`` does the same, so the bytes are vLLM's and the shim's decode and
prefix kernels read them back with the same scales.  Inputs are never written; the caches are
written only at the given slots.  Never imports vLLM.
"""

from __future__ import annotations

import torch

from .cache import ScaleLike, check_int_tensor, fp8_dtype, scale_factor

__all__ = ["FP8_CACHE_DTYPES", "quantize_fp8", "write_fp8"]

#: The ``kv_cache_dtype`` strings this module writes.
FP8_CACHE_DTYPES = ("fp8", "fp8_e4m3", "fp8_e5m2")


def quantize_fp8(x: torch.Tensor, scale: ScaleLike, kv_cache_dtype: str) -> torch.Tensor:
    """``x / scale`` as fp8 bits (uint8): float32 division, round to nearest, saturated."""
    f8 = fp8_dtype(kv_cache_dtype)
    biggest = torch.finfo(f8).max
    scaled = x.to(torch.float32) / scale_factor(scale, "scale")
    return scaled.clamp_(-biggest, biggest).to(f8).view(torch.uint8)


def write_fp8(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
              value_cache: torch.Tensor, slot_mapping: torch.Tensor, kv_cache_dtype: str,
              k_scale: ScaleLike, v_scale: ScaleLike) -> None:
    """Store ``key``/``value`` ``[tokens, kv_heads, head_size]`` at ``slot_mapping`` (flat
    slot ``block * block_size + offset``; negative: skipped) in fp8 caches."""
    if kv_cache_dtype not in FP8_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r}: write_fp8 writes "
                         f"{', '.join(FP8_CACHE_DTYPES)} caches only")
    f8 = fp8_dtype(kv_cache_dtype)
    if key_cache.dtype not in (torch.uint8, f8) or value_cache.dtype != key_cache.dtype:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} needs uint8 (or {f8}) caches, got "
                         f"key_cache {key_cache.dtype}, value_cache {value_cache.dtype}")
    if key_cache.dim() != 5 or value_cache.dim() != 4 or key_cache.shape[4] != 16:
        raise ValueError("fp8 caches must be key [blocks, kv_heads, head_size // 16, "
                         "block_size, 16] and value [blocks, kv_heads, head_size, block_size], "
                         f"got {tuple(key_cache.shape)} and {tuple(value_cache.shape)}")
    blocks, kv_heads, chunks, block_size, x = key_cache.shape
    head_size = chunks * x
    if tuple(value_cache.shape) != (blocks, kv_heads, head_size, block_size):
        raise ValueError(f"value_cache {tuple(value_cache.shape)} does not match key_cache "
                         f"{tuple(key_cache.shape)}")
    tokens = key.shape[0]
    if key.shape != (tokens, kv_heads, head_size) or value.shape != key.shape:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} must be "
                         f"[tokens, {kv_heads}, {head_size}]")
    slots = slot_mapping.flatten()
    check_int_tensor(slots, "slot_mapping", [tokens])
    slots = slots.long()
    rows = (slots >= 0).nonzero().squeeze(1)
    if rows.numel() == 0:
        return
    slots = slots.index_select(0, rows)
    if int(slots.max()) >= blocks * block_size:
        raise ValueError(f"slot_mapping holds slot {int(slots.max())}, past the cache's "
                         f"{blocks * block_size} slots")
    blk, off = slots // block_size, slots % block_size
    kc = key_cache.view(torch.uint8)
    vc = value_cache.view(torch.uint8)
    kq = quantize_fp8(key.index_select(0, rows), k_scale, kv_cache_dtype)
    vq = quantize_fp8(value.index_select(0, rows), v_scale, kv_cache_dtype)
    kc[blk, :, :, off, :] = kq.view(-1, kv_heads, chunks, x)
    vc[blk, :, :, off] = vq

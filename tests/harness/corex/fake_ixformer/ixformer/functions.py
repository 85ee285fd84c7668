"""Reference kernels of the fake ``ixformer.functions`` (see the package docstring)."""

from __future__ import annotations

import math
from typing import Dict, List, Optional

import torch

#: Longest ``max_context_len`` BI-V100's native V1 handles (field-measured).
V1_MAX_CONTEXT_LEN = 32768

#: Calls of each kernel in this process (the tests read it).
CALLS: Dict[str, int] = {}


class BI100Hang(RuntimeError):
    """What would hang (or corrupt) a BI-V100 card: raised instead."""


def _count(name: str) -> None:
    CALLS[name] = CALLS.get(name, 0) + 1


def vllm_single_query_cached_kv_attention(output, query, key_cache, value_cache, head_mapping,
                                          scale, block_tables, context_lens, block_size,
                                          max_context_len, alibi_slopes):
    """Paged attention V1 with ixformer's argument list (exactly 11 positional)."""
    _count("vllm_single_query_cached_kv_attention")
    num_seqs, num_heads, head_size = query.shape
    if not (isinstance(head_mapping, torch.Tensor) and head_mapping.dtype == torch.int32
            and head_mapping.dim() == 1 and head_mapping.shape[0] == num_heads):
        raise TypeError("ixformer V1 needs head_mapping: an int32 tensor with one entry per "
                        f"query head ({num_heads}); got {head_mapping!r}")
    if head_mapping.device != query.device:
        raise TypeError(f"head_mapping is on {head_mapping.device}, query on {query.device}")
    if isinstance(max_context_len, bool) or not isinstance(max_context_len, int):
        raise TypeError(f"max_context_len must be an int, got {max_context_len!r}")
    if max_context_len > V1_MAX_CONTEXT_LEN:
        raise BI100Hang(f"paged attention V1 with max_context_len={max_context_len} > "
                        f"{V1_MAX_CONTEXT_LEN}: its logits do not fit in shared memory (the "
                        "BI-V100 hangs)")
    if block_size != value_cache.shape[3]:
        raise ValueError(f"block_size {block_size} != cache block size {value_cache.shape[3]}")
    lens: List[int] = [int(n) for n in context_lens.tolist()]
    if lens and max(lens) > max_context_len:
        raise BI100Hang(f"a context of {max(lens)} tokens with max_context_len="
                        f"{max_context_len}: shared memory overrun")
    mapping = head_mapping.long().tolist()
    for i, length in enumerate(lens):
        if length == 0:
            output[i].zero_()
            continue
        n_blocks = math.ceil(length / block_size)
        blocks = block_tables[i, :n_blocks].long()
        keys = key_cache[blocks]            # [nb, kv, d/x, bs, x]
        kv = keys.shape[1]
        keys = keys.permute(1, 0, 3, 2, 4).reshape(kv, n_blocks * block_size, head_size)
        values = value_cache[blocks].permute(1, 0, 3, 2).reshape(kv, n_blocks * block_size,
                                                                 head_size)
        positions = torch.arange(length, dtype=torch.float32)
        for h in range(num_heads):
            k = keys[mapping[h], :length].float()
            v = values[mapping[h], :length].float()
            s = (k @ query[i, h].float()) * float(scale)
            if alibi_slopes is not None:
                s = s + float(alibi_slopes[h]) * (positions - (length - 1))
            output[i, h] = (torch.softmax(s, dim=0) @ v).to(output.dtype)


def vllm_cache_ops_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping):
    """Write tokens into the paged caches (no dtype, no scales: an fp8 cache is refused)."""
    _count("vllm_cache_ops_reshape_and_cache")
    if slot_mapping.dtype != torch.int32:
        raise TypeError(f"slot_mapping must be int32, got {slot_mapping.dtype}")
    if key_cache.dtype != key.dtype or value_cache.dtype != value.dtype:
        raise TypeError(f"ixformer reshape_and_cache writes {key.dtype} tokens only into a "
                        f"cache of the same dtype, got {key_cache.dtype}")
    slots = slot_mapping.long()
    keep = slots >= 0
    slots, key, value = slots[keep], key[keep], value[keep]
    block_size = value_cache.shape[3]
    x = key_cache.shape[-1]
    blk, off = slots // block_size, slots % block_size
    tokens, kv, head_size = key.shape
    key_cache[blk, :, :, off, :] = key.reshape(tokens, kv, head_size // x, x)
    value_cache[blk, :, :, off] = value


def vllm_swap_blocks(src: torch.Tensor, dst: torch.Tensor, mapping: Dict[int, int]) -> None:
    """Copy block ``s`` of ``src`` to block ``mapping[s]`` of ``dst`` (any devices)."""
    _count("vllm_swap_blocks")
    if not isinstance(mapping, dict):
        raise TypeError(f"vllm_swap_blocks takes a dict {{src: dst}}, got {type(mapping)}")
    for s, d in mapping.items():
        dst[int(d)].copy_(src[int(s)])


def copy_blocks(key_caches, value_caches, block_mapping: Optional[torch.Tensor]) -> None:
    """Copy blocks within each layer's caches (``block_mapping``: ``[n, 2]`` src, dst)."""
    _count("copy_blocks")
    pairs = block_mapping.tolist() if block_mapping is not None else []
    for caches in (key_caches, value_caches):
        for cache in caches:
            for s, d in pairs:
                cache[int(d)].copy_(cache[int(s)])

"""Dense reference attention and paged-cache builders for the patch-layer tests.

Written independently of the kernels: per-sequence loops, float64, explicit masks.
"""

from __future__ import annotations

import torch


def x_of(dtype: torch.dtype) -> int:
    return 16 // torch.tensor([], dtype=dtype).element_size()


def empty_caches(num_blocks: int, kv_heads: int, head_size: int, block_size: int,
                 dtype: torch.dtype):
    x = x_of(dtype)
    key_cache = torch.zeros(num_blocks, kv_heads, head_size // x, block_size, x, dtype=dtype)
    value_cache = torch.zeros(num_blocks, kv_heads, head_size, block_size, dtype=dtype)
    return key_cache, value_cache


def write(key_cache, value_cache, block_row, start: int, k: torch.Tensor, v: torch.Tensor):
    """Write tokens ``start .. start+len(k)`` of one sequence (k, v: [n, kv_heads, d])."""
    block_size = value_cache.shape[3]
    x = key_cache.shape[4]
    for t in range(k.shape[0]):
        pos = start + t
        blk = int(block_row[pos // block_size])
        off = pos % block_size
        key_cache[blk, :, :, off, :] = k[t].reshape(k.shape[1], -1, x)
        value_cache[blk, :, :, off] = v[t]


def read(key_cache, value_cache, block_row, n: int):
    block_size = value_cache.shape[3]
    ks, vs = [], []
    for pos in range(n):
        blk = int(block_row[pos // block_size])
        off = pos % block_size
        ks.append(key_cache[blk, :, :, off, :].reshape(key_cache.shape[1], -1))
        vs.append(value_cache[blk, :, :, off])
    if not ks:
        d = value_cache.shape[2]
        return (torch.zeros(0, key_cache.shape[1], d, dtype=key_cache.dtype),) * 2
    return torch.stack(ks), torch.stack(vs)


def attend(q, k, v, scale, q_pos, alibi=None, window=None):
    """q [m, H, d], k/v [n, KV, d]; query i sits at absolute position q_pos[i]."""
    heads, kv = q.shape[1], k.shape[1]
    k = k.double().repeat_interleave(heads // kv, dim=1)
    v = v.double().repeat_interleave(heads // kv, dim=1)
    s = torch.einsum("mhd,nhd->hmn", q.double(), k) * scale
    kpos = torch.arange(k.shape[0], dtype=torch.float64)
    qpos = torch.as_tensor(q_pos, dtype=torch.float64)
    mask = kpos[None, :] > qpos[:, None]
    if window is not None:
        mask |= kpos[None, :] <= qpos[:, None] - window
    if alibi is not None:
        s = s + alibi.double()[:, None, None] * (kpos[None, None, :] - qpos[None, :, None])
    s = s.masked_fill(mask[None], float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return torch.einsum("hmn,nhd->mhd", p, v)


def decode_ref(query, key_cache, value_cache, block_tables, seq_lens, scale, alibi=None):
    out = torch.zeros(query.shape, dtype=torch.float64)
    for i, n in enumerate(seq_lens.tolist()):
        if n == 0:
            continue
        k, v = read(key_cache, value_cache, block_tables[i], n)
        out[i] = attend(query[i:i + 1], k, v, scale, [n - 1], alibi)[0]
    return out


def prefix_ref(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens,
               context_lens, new_k, new_v, scale, alibi=None, window=None):
    out = torch.zeros(query.shape, dtype=torch.float64)
    starts = query_start_loc.tolist()
    for i, (ctx, total) in enumerate(zip(context_lens.tolist(), seq_lens.tolist())):
        a, b = starts[i], starts[i + 1]
        k_ctx, v_ctx = read(key_cache, value_cache, block_tables[i], ctx)
        k = torch.cat([k_ctx, new_k[a:b]])
        v = torch.cat([v_ctx, new_v[a:b]])
        out[a:b] = attend(query[a:b], k, v, scale, list(range(ctx, total)), alibi, window)
    return out

"""Seed-style baseline for the benchmark only: the algorithm of the field-tested seed
(the field-tested hand-edited vLLM 0.6.x paged_attn.py, docs/bi100-limits.md), re-implemented for timing.

Faithful to its cost structure: a Python loop over sequences with an ``.item()`` host read
per sequence, a ``permute(...).contiguous()`` gather of each tile of blocks, float32 upcast,
and an online softmax over a few large tiles (decode: 2 target tiles of 128..8192 blocks;
prefix: 96 MiB score budget, ~4 tiles).  One deliberate difference: the seed scaled a
float32 query in place (``.float()`` is a no-op then, so it modified the caller's tensor);
this copy scales out of place.  Not part of the package; never used by the shim.
"""

from __future__ import annotations


import torch

_TARGET_TILES = 2
_MIN_TILE_BLOCKS = 128
_MAX_TILE_BLOCKS = 8192
_SCORE_BUDGET = 96 * 1024 * 1024


def seed_decode(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Decode, one sequence at a time (the seed's ``_forward_decode_pytorch``)."""
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[1]
    block_size = value_cache.shape[3]
    gqa = num_heads // num_kv_heads
    dev = query.device
    output = torch.empty_like(query)
    for i in range(num_seqs):
        seq_len = int(seq_lens[i].item())
        if seq_len == 0:
            output[i].zero_()
            continue
        nblocks = (seq_len + block_size - 1) // block_size
        blk_ids = block_tables[i, :nblocks]
        q = (query[i].float() * scale).view(num_kv_heads, gqa, head_dim).unsqueeze(2)
        m = torch.full((num_kv_heads, gqa, 1), float("-inf"), dtype=torch.float32, device=dev)
        l_sum = torch.zeros_like(m)
        o = torch.zeros((num_kv_heads, gqa, 1, head_dim), dtype=torch.float32, device=dev)
        tile_blocks = max(_MIN_TILE_BLOCKS,
                          min(_MAX_TILE_BLOCKS, (nblocks + _TARGET_TILES - 1) // _TARGET_TILES))
        for t0 in range(0, nblocks, tile_blocks):
            t1 = min(t0 + tile_blocks, nblocks)
            ids = blk_ids[t0:t1]
            valid = min(t1 * block_size, seq_len) - t0 * block_size
            k_t = (key_cache[ids].permute(1, 2, 4, 0, 3).contiguous()
                   .view(num_kv_heads, head_dim, -1)[:, :, :valid].unsqueeze(1).float())
            v_t = (value_cache[ids].permute(1, 2, 0, 3).contiguous()
                   .view(num_kv_heads, head_dim, -1)[:, :, :valid].transpose(1, 2)
                   .unsqueeze(1).float())
            s = torch.matmul(q, k_t)
            m_tile = s.amax(dim=-1, keepdim=True)
            m_new = torch.maximum(m, m_tile.squeeze(-1))
            corr = torch.exp(m - m_new)
            p = torch.exp(s - m_new.unsqueeze(-1))
            m.copy_(m_new)
            l_sum.mul_(corr).add_(p.sum(dim=-1))
            o.mul_(corr.unsqueeze(-1)).add_(torch.matmul(p, v_t))
        o.div_(l_sum.unsqueeze(-1))
        output[i] = o.view(num_heads, head_dim).to(query.dtype)
    return output


def seed_prefix(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                key_cache: torch.Tensor, value_cache: torch.Tensor, block_tables: torch.Tensor,
                query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                context_lens: torch.Tensor) -> torch.Tensor:
    """Prefix attention, one sequence at a time (the seed's ``_forward_prefix_pytorch``)."""
    batch = seq_lens.shape[0]
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = key_cache.shape[1]
    gqa = num_heads // num_kv_heads
    block_size = value_cache.shape[3]
    scale = head_dim ** -0.5
    dev = query.device
    output = torch.empty_like(query)
    for i in range(batch):
        ctx = int(context_lens[i].item())
        q0 = int(query_start_loc[i].item())
        q1 = int(query_start_loc[i + 1].item())
        q_len = q1 - q0
        k_i, v_i = key[q0:q1], value[q0:q1]
        row_bytes = num_kv_heads * gqa * q_len * 4
        mem_tokens = (_SCORE_BUDGET // row_bytes) // block_size * block_size if row_bytes else 4096
        spread = max(block_size, (ctx + q_len + 3) // 4) // block_size * block_size
        tile = max(min(max(spread, block_size), mem_tokens), block_size)
        q = (query[q0:q1].permute(1, 0, 2).float() * scale).view(num_kv_heads, gqa, q_len,
                                                                 head_dim)
        m = torch.full((num_kv_heads, gqa, q_len), float("-inf"), dtype=torch.float32,
                       device=dev)
        l_sum = torch.zeros_like(m)
        o = torch.zeros((num_kv_heads, gqa, q_len, head_dim), dtype=torch.float32, device=dev)

        state = [m, l_sum, o]
        per_tile = tile // block_size
        nctx = (ctx + block_size - 1) // block_size
        for b0 in range(0, nctx, per_tile):
            b1 = min(b0 + per_tile, nctx)
            ids = block_tables[i, b0:b1]
            k_tile = key_cache[ids].permute(0, 3, 1, 2, 4).contiguous().view(
                -1, num_kv_heads, head_dim)
            v_tile = value_cache[ids].permute(0, 3, 1, 2).contiguous().view(
                -1, num_kv_heads, head_dim)
            valid = min(b1 * block_size, ctx) - b0 * block_size
            k_t = k_tile[:valid].permute(1, 0, 2).unsqueeze(1).transpose(-1, -2).float()
            v_t = v_tile[:valid].permute(1, 0, 2).unsqueeze(1).float()
            _merge(state, torch.matmul(q, k_t), v_t)
        for c0 in range(0, q_len, tile):
            c1 = min(c0 + tile, q_len)
            k_t = k_i[c0:c1].permute(1, 0, 2).unsqueeze(1).transpose(-1, -2).float()
            v_t = v_i[c0:c1].permute(1, 0, 2).unsqueeze(1).float()
            s = torch.matmul(q, k_t)
            mask = (torch.arange(c0, c1, device=dev).unsqueeze(0)
                    > torch.arange(q_len, device=dev).unsqueeze(1))
            s.masked_fill_(mask, float("-inf"))
            _merge(state, s, v_t)
        m, l_sum, o = state
        o.div_(l_sum.unsqueeze(-1))
        output[q0:q1] = o.view(num_heads, q_len, head_dim).permute(1, 0, 2).to(query.dtype)
    return output




def _merge(state: list, s: torch.Tensor, v_t: torch.Tensor) -> None:
    """The seed's online-softmax update of ``[m, l, o]`` with one tile of scores."""
    m, l_sum, o = state
    m_new = torch.maximum(m, s.amax(dim=-1))
    p = (s - m_new.unsqueeze(-1)).exp_()
    corr = torch.exp(m - m_new)
    state[0] = m_new
    l_sum.mul_(corr).add_(p.sum(dim=-1))
    o.mul_(corr.unsqueeze(-1)).add_(torch.matmul(p, v_t))

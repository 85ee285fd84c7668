"""The one dense reference and the paged-cache builders, for every layer's tests.

Written independently of the kernels: token-by-token gathers, float64, explicit masks.
Caches in vLLM's layout (key ``[blocks, kv_heads, d / x, block_size, x]``, value
``[blocks, kv_heads, d, block_size]``); fp8 caches are uint8 tensors.  Also the reference-grid
inputs and tolerances shared by the pytest suite and the device checks (``checks.py``, run
by ``vllm-bi100-patch selftest``).  Needs torch only (no pytest, no vLLM, no shim)."""

from __future__ import annotations

import itertools
import math
from typing import List, Optional, Sequence, Tuple

import torch

FP8 = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


def cpu_half_gemm() -> bool:
    """Whether this torch multiplies float16 matrices on CPU (torch 2.1 does not: the GPU
    compute mode and the SDPA path can then not be run on CPU for float16)."""
    try:
        a = torch.ones(1, 2, 2, dtype=torch.float16)
        torch.bmm(a, a)
    except RuntimeError:
        return False
    return True


def fp8_available(name: str = "fp8") -> bool:
    return hasattr(torch, FP8[name])


def x_of(dtype: torch.dtype) -> int:
    """Elements per 16 bytes: the innermost dimension of vLLM's key cache."""
    return 16 // torch.empty((), dtype=dtype).element_size()


def empty_caches(num_blocks: int, kv_heads: int, head_size: int, block_size: int,
                 dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    """Zeroed key/value caches (tokens are put in with ``write``)."""
    x = x_of(dtype)
    key_cache = torch.zeros(num_blocks, kv_heads, head_size // x, block_size, x, dtype=dtype)
    value_cache = torch.zeros(num_blocks, kv_heads, head_size, block_size, dtype=dtype)
    return key_cache, value_cache


def write(key_cache: torch.Tensor, value_cache: torch.Tensor, table_row: torch.Tensor,
          start: int, k: torch.Tensor, v: torch.Tensor) -> None:
    """Write tokens ``start .. start+len(k)`` of one sequence (k, v: [n, kv_heads, d])."""
    block_size = value_cache.shape[3]
    x = key_cache.shape[4]
    for t in range(k.shape[0]):
        pos = start + t
        blk = int(table_row[pos // block_size])
        off = pos % block_size
        key_cache[blk, :, :, off, :] = k[t].reshape(k.shape[1], -1, x)
        value_cache[blk, :, :, off] = v[t]


def make_cache(num_blocks: int, kv_heads: int, head_size: int, block_size: int,
               dtype: torch.dtype, kv_cache_dtype: str = "auto",
               gen: Optional[torch.Generator] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Random key/value caches in vLLM's layout; fp8 caches are uint8 tensors."""
    x = x_of(torch.uint8 if kv_cache_dtype != "auto" else dtype)
    k = torch.randn(num_blocks, kv_heads, head_size // x, block_size, x, generator=gen)
    v = torch.randn(num_blocks, kv_heads, head_size, block_size, generator=gen)
    if kv_cache_dtype == "auto":
        return k.to(dtype), v.to(dtype)
    f8 = getattr(torch, FP8[kv_cache_dtype])
    return k.to(f8).view(torch.uint8), v.to(f8).view(torch.uint8)


def make_tables(seq_lens: Sequence[int], block_size: int, width: int, num_blocks: int,
                gen: Optional[torch.Generator] = None, pad: int = 0) -> torch.Tensor:
    """Block tables: a random permutation of physical blocks; unused entries = ``pad``."""
    need = sum(math.ceil(s / block_size) for s in seq_lens)
    assert need <= num_blocks, (need, num_blocks)
    perm = torch.randperm(num_blocks, generator=gen)
    table = torch.full((len(seq_lens), width), pad, dtype=torch.int32)
    at = 0
    for i, s in enumerate(seq_lens):
        n = math.ceil(s / block_size)
        table[i, :n] = perm[at:at + n].to(torch.int32)
        at += n
    return table


def paged_batch(seq_lens: Sequence[int], kv_heads: int, head_size: int, block_size: int,
                num_blocks: int, width: int, gen: torch.Generator,
                dtype: torch.dtype = torch.float32):
    """Sequences of random K/V written into zeroed caches through a random block table
    (``width`` entries a row).  Returns ``key_cache, value_cache, block_tables, ks, vs`` with
    the dense per-sequence ``ks[i]``/``vs[i]`` [seq_lens[i], kv_heads, head_size]."""
    key_cache, value_cache = empty_caches(num_blocks, kv_heads, head_size, block_size, dtype)
    perm = torch.randperm(num_blocks, generator=gen)
    tables = perm[:len(seq_lens) * width].reshape(len(seq_lens), width).to(torch.int32)
    ks, vs = [], []
    for i, n in enumerate(seq_lens):
        k = torch.randn(n, kv_heads, head_size, generator=gen).to(dtype)
        v = torch.randn(n, kv_heads, head_size, generator=gen).to(dtype)
        write(key_cache, value_cache, tables[i], 0, k, v)
        ks.append(k)
        vs.append(v)
    return key_cache, value_cache, tables, ks, vs


def prefix_batch(seq_lens: torch.Tensor, new: torch.Tensor, ks: Sequence[torch.Tensor],
                 vs: Sequence[torch.Tensor]):
    """The prefill step of sequences whose last ``new[i]`` of ``seq_lens[i]`` tokens are new
    (dense K/V ``ks[i]``/``vs[i]``): ``context_lens, query_start_loc, key, value`` with the
    new tokens' K/V concatenated in batch order."""
    context_lens = seq_lens - new
    query_start_loc = torch.zeros(len(new) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.cumsum(new, 0)
    key = torch.cat([k[c:] for k, c in zip(ks, context_lens.tolist())])
    value = torch.cat([v[c:] for v, c in zip(vs, context_lens.tolist())])
    return context_lens, query_start_loc, key, value


def gather_seq(key_cache: torch.Tensor, value_cache: torch.Tensor, table_row: torch.Tensor,
               length: int, kv_cache_dtype: str = "auto", k_scale: float = 1.0,
               v_scale: float = 1.0) -> Tuple[torch.Tensor, torch.Tensor]:
    """K, V of one sequence as float64 [length, kv_heads, head_size], token by token."""
    kv_heads = key_cache.shape[1]
    head_size = value_cache.shape[2]
    block_size = value_cache.shape[3]
    if kv_cache_dtype != "auto":
        f8 = getattr(torch, FP8[kv_cache_dtype])
        key_cache, value_cache = key_cache.view(f8), value_cache.view(f8)
    ks: List[torch.Tensor] = []
    vs: List[torch.Tensor] = []
    for t in range(length):
        blk = int(table_row[t // block_size])
        off = t % block_size
        ks.append(key_cache[blk, :, :, off, :].to(torch.float64).reshape(kv_heads, head_size))
        vs.append(value_cache[blk, :, :, off].to(torch.float64))
    if not ks:
        empty = torch.zeros(0, kv_heads, head_size, dtype=torch.float64)
        return empty, empty.clone()
    k = torch.stack(ks)
    v = torch.stack(vs)
    if kv_cache_dtype != "auto":
        k, v = k * k_scale, v * v_scale
    return k, v


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: Sequence[int],
           scale: float, alibi: Optional[torch.Tensor] = None,
           window: Optional[int] = None) -> torch.Tensor:
    """Plain softmax attention in float64 with causal mask by absolute position.

    q [nq, H, D], k/v [nk, KVH, D] (key j at position j; any dtype); returns [nq, H, D];
    a query that sees no key gets zeros.
    """
    nq, heads, d = q.shape
    nk, kv_heads, _ = k.shape
    group = heads // kv_heads
    out = torch.zeros(nq, heads, d, dtype=torch.float64)
    if nk == 0:
        return out
    k = k.to(torch.float64).repeat_interleave(group, dim=1)
    v = v.to(torch.float64).repeat_interleave(group, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.to(torch.float64), k) * scale
    qp = torch.tensor(list(q_pos), dtype=torch.float64).view(1, nq, 1)
    kp = torch.arange(nk, dtype=torch.float64).view(1, 1, nk)
    if alibi is not None:
        s = s + alibi.to(torch.float64).view(heads, 1, 1) * (kp - qp)
    visible = kp <= qp
    if window is not None:
        visible = visible & (kp > qp - window)
    s = s.masked_fill(~visible, float("-inf"))
    p = torch.softmax(s, dim=-1)
    p = torch.nan_to_num(p, nan=0.0)
    return torch.einsum("hqk,khd->qhd", p, v)


def ref_decode(query, key_cache, value_cache, block_tables, seq_lens, scale,
               alibi_slopes=None, kv_cache_dtype="auto", k_scale=1.0, v_scale=1.0):
    """Each sequence's one query (at position ``seq_lens[i] - 1``) over its cached tokens;
    an empty sequence gets zeros."""
    outs = []
    for i in range(query.shape[0]):
        n = int(seq_lens[i])
        k, v = gather_seq(key_cache, value_cache, block_tables[i], n, kv_cache_dtype,
                          k_scale, v_scale)
        outs.append(attend(query[i:i + 1], k, v, [n - 1], scale, alibi_slopes))
    return torch.cat(outs) if outs else torch.zeros(query.shape, dtype=torch.float64)


def ref_prefix(query, key, value, key_cache, value_cache, block_tables, query_start_loc,
               seq_lens, context_lens, scale, alibi_slopes=None, sliding_window=None,
               kv_cache_dtype="auto", k_scale=1.0, v_scale=1.0):
    """Queries ``query_start_loc[i]:query_start_loc[i+1]`` (new tokens at positions
    ``context_lens[i]`` on, their K/V in ``key``/``value``) over the cached context plus the
    new tokens; ``sliding_window`` w: a query sees the last w positions, itself included.
    fp8 caches: the new tokens' K/V count as the cache stores them (``through_fp8``), what
    the kernels read (a token reads the same whether new in this call or cached)."""
    out = torch.zeros(query.shape, dtype=torch.float64)
    starts = [int(v) for v in query_start_loc]
    for i in range(len(starts) - 1):
        a, b = starts[i], starts[i + 1]
        ctx = int(context_lens[i])
        if int(seq_lens[i]) != ctx + b - a:
            raise ValueError(f"seq_lens[{i}] must be context_lens[{i}] + its query count "
                             f"({ctx} + {b - a}), got {int(seq_lens[i])}")
        kc, vc = gather_seq(key_cache, value_cache, block_tables[i], ctx, kv_cache_dtype,
                            k_scale, v_scale)
        k = torch.cat([kc, through_fp8(key[a:b], kv_cache_dtype, k_scale)])
        v = torch.cat([vc, through_fp8(value[a:b], kv_cache_dtype, v_scale)])
        out[a:b] = attend(query[a:b], k, v, range(ctx, ctx + b - a), scale, alibi_slopes,
                          sliding_window)
    return out


def through_fp8(x: torch.Tensor, kv_cache_dtype: str, scale: float) -> torch.Tensor:
    """``x`` in float64 as an fp8 cache of ``kv_cache_dtype`` stores and returns it: float32
    ``x / scale`` rounded to fp8, saturated, times ``scale`` (``auto``: ``x`` itself)."""
    if kv_cache_dtype == "auto":
        return x.to(torch.float64)
    f8 = getattr(torch, FP8[kv_cache_dtype])
    top = torch.finfo(f8).max
    stored = (x.to(torch.float32) / float(scale)).clamp(-top, top).to(f8)
    return stored.to(torch.float64) * float(scale)


#: ``max |out - ref| / max |ref|`` bounds per (compute mode, dtype); how they were set:
#: ``test_numerics`` (measured worst case on its grid, about 3x margin).
TOLERANCE = {
    ("fp32", torch.float32): 1e-5, ("fp32", torch.float16): 1.5e-3,
    ("fp32", torch.bfloat16): 1e-2,
    ("native", torch.float32): 1e-5, ("native", torch.float16): 1e-2,
    ("native", torch.bfloat16): 6e-2,
}


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest absolute error relative to the largest reference magnitude."""
    return (out.double() - ref).abs().max().item() / ref.abs().max().item()


def decode_inputs(dtype, head_size, amp, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    lens = [1, 15, 16, 17, 53, 700]
    num_blocks = sum(math.ceil(n / 16) for n in lens) + 2
    kc, vc = make_cache(num_blocks, 2, head_size, 16, dtype, gen=g)
    kc = (kc.float() * amp).to(dtype)
    bt = make_tables(lens, 16, max(math.ceil(n / 16) for n in lens), num_blocks, g)
    q = torch.randn(len(lens), 8, head_size, generator=g).to(dtype)
    sl = torch.tensor(lens, dtype=torch.int32)
    return [t.to(device) for t in (q, kc, vc, bt, sl)]


def prefix_inputs(dtype, head_size, amp, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    ctxs, news = [0, 17, 40, 300], [5, 16, 9, 64]
    num_blocks = sum(math.ceil(c / 16) for c in ctxs) + 2
    kc, vc = make_cache(num_blocks, 2, head_size, 16, dtype, gen=g)
    kc = (kc.float() * amp).to(dtype)
    bt = make_tables(ctxs, 16, max(math.ceil(c / 16) for c in ctxs), num_blocks, g)
    n = sum(news)
    q = torch.randn(n, 8, head_size, generator=g).to(dtype)
    k = (torch.randn(n, 2, head_size, generator=g) * amp).to(dtype)
    v = torch.randn(n, 2, head_size, generator=g).to(dtype)
    qsl = torch.tensor([0] + list(itertools.accumulate(news)), dtype=torch.int32)
    sl = torch.tensor([c + m for c, m in zip(ctxs, news)], dtype=torch.int32)
    cl = torch.tensor(ctxs, dtype=torch.int32)
    return [t.to(device) for t in (q, k, v, kc, vc, bt, qsl, sl, cl)]

"""Nothing that is not attended to may reach the output.

Every cache slot no token attends to (past ``seq_len`` in a sequence's last block, whole
blocks read only for padding columns, blocks referenced by padded block-table entries) is
filled with NaN, +inf, -inf or random fp8 bytes; the kernels must then give exactly the
same result as with clean caches, and a sequence of length 0 gives zeros.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from helpers.reference import FP8, fp8_available, make_cache, ref_decode, ref_prefix

from vllm_bi100_patch.attention.kernels import paged_decode, paged_prefix

POISONS = [math.nan, math.inf, -math.inf]


def _tables(lens, block_size, width, num_blocks, gen, pad):
    """Block tables that never use block 0 (the block decode reads for padding columns) nor
    ``pad``; unused entries hold ``pad``."""
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    perm = [b for b in perm if b != pad]
    table = torch.full((len(lens), width), pad, dtype=torch.int32)
    at = 0
    for i, n in enumerate(lens):
        k = math.ceil(n / block_size)
        table[i, :k] = torch.tensor(perm[at:at + k], dtype=torch.int32)
        at += k
    return table


def _used_slots(table, lens, num_blocks, block_size):
    """[num_blocks, block_size] bool: the slots some sequence attends to."""
    used = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    for row, n in zip(table.tolist(), lens):
        for pos in range(n):
            used[row[pos // block_size], pos % block_size] = True
    return used


def _poison(kc, vc, used, value, gen):
    """Copies of the caches with every unused slot set to ``value`` (a float, or ``"bytes"``:
    random fp8 bytes, NaN/inf encodings included)."""
    kc, vc = kc.clone(), vc.clone()
    k_mask = ~used[:, None, None, :, None].expand_as(kc)
    v_mask = ~used[:, None, None, :].expand_as(vc)
    if value == "bytes":
        assert kc.dtype == torch.uint8
        for cache, mask in ((kc, k_mask), (vc, v_mask)):
            noise = torch.randint(0, 256, cache.shape, generator=gen, dtype=torch.uint8)
            noise.view(-1)[:4] = torch.tensor([0x7F, 0xFF, 0x7C, 0xFC], dtype=torch.uint8)
            cache[mask] = noise[mask]
    else:
        kc[k_mask] = value
        vc[v_mask] = value
    return kc, vc


def _bytes_have_non_finite(cache, used_mask, kv_cache_dtype):
    vals = cache[used_mask].view(getattr(torch, FP8[kv_cache_dtype])).float()
    return not bool(vals.isfinite().all())


DECODE_LENS = [0, 1, 15, 16, 17, 50, 33]


def _decode_case(dtype, kv_cache_dtype="auto", block_size=16, width=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    lens = DECODE_LENS
    num_blocks = sum(math.ceil(n / block_size) for n in lens) + 3
    pad = num_blocks - 1
    kc, vc = make_cache(num_blocks, 2, 64, block_size, dtype, kv_cache_dtype, g)
    bt = _tables(lens, block_size, width, num_blocks, g, pad)
    q = torch.randn(len(lens), 8, 64, generator=g).to(dtype)
    sl = torch.tensor(lens, dtype=torch.int32)
    used = _used_slots(bt, lens, num_blocks, block_size)
    assert not used[0].any() and not used[pad].any() and not used.all()
    return q, kc, vc, bt, sl, used, g


@pytest.mark.parametrize("poison", POISONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("max_seq_len", [None, 50, 96])
def test_decode_ignores_unused_slots(poison, dtype, max_seq_len, formulation):
    q, kc, vc, bt, sl, used, g = _decode_case(dtype)
    kw = {"max_seq_len": max_seq_len, "alibi_slopes": torch.rand(8) if dtype != torch.float16
          else None}
    clean = paged_decode(q, kc, vc, bt, sl, 0.125, **kw)
    pk, pv = _poison(kc, vc, used, poison, g)
    out = paged_decode(q, pk, pv, bt, sl, 0.125, **kw)
    assert torch.equal(out, clean), (out - clean).abs().max()
    assert out.isfinite().all()
    assert not out[0].any()  # seq_len 0: zeros, as documented
    ref = ref_decode(q, kc, vc, bt, sl, 0.125, alibi_slopes=kw["alibi_slopes"])
    torch.testing.assert_close(out.double(), ref, atol=4e-2, rtol=0)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
def test_decode_fp8_random_bytes_in_unused_slots(kv_cache_dtype, formulation):
    if not fp8_available(kv_cache_dtype):
        pytest.skip("torch has no float8 dtypes")
    q, kc, vc, bt, sl, used, g = _decode_case(torch.bfloat16, kv_cache_dtype)
    kw = {"kv_cache_dtype": kv_cache_dtype, "k_scale": 0.5, "v_scale": 2.0}
    clean = paged_decode(q, kc, vc, bt, sl, 0.125, **kw)
    pk, pv = _poison(kc, vc, used, "bytes", g)
    assert _bytes_have_non_finite(pv, ~used[:, None, None, :].expand_as(pv), kv_cache_dtype)
    out = paged_decode(q, pk, pv, bt, sl, 0.125, **kw)
    assert torch.equal(out, clean)
    assert out.isfinite().all() and not out[0].any()


def test_decode_all_sequences_empty_on_poisoned_cache(formulation):
    q, kc, vc, bt, _, used, g = _decode_case(torch.float32)
    pk, pv = _poison(kc, vc, torch.zeros_like(used), math.nan, g)  # every slot NaN
    sl = torch.zeros(q.shape[0], dtype=torch.int32)
    out = paged_decode(q, pk, pv, bt, sl, 0.125, max_seq_len=40)
    assert torch.equal(out, torch.zeros_like(q))


def _prefix_case(dtype, kv_cache_dtype="auto", block_size=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    contexts, news = [0, 1, 15, 16, 17, 40], [5, 1, 16, 3, 17, 9]
    num_blocks = sum(math.ceil(c / block_size) for c in contexts) + 3
    pad = num_blocks - 1
    kc, vc = make_cache(num_blocks, 2, 64, block_size, dtype, kv_cache_dtype, g)
    bt = _tables(contexts, block_size, 5, num_blocks, g, pad)
    n = sum(news)
    q = torch.randn(n, 4, 64, generator=g).to(dtype)
    k = torch.randn(n, 2, 64, generator=g).to(dtype)
    v = torch.randn(n, 2, 64, generator=g).to(dtype)
    qsl = torch.tensor([0] + list(itertools.accumulate(news)), dtype=torch.int32)
    sl = torch.tensor([c + m for c, m in zip(contexts, news)], dtype=torch.int32)
    cl = torch.tensor(contexts, dtype=torch.int32)
    used = _used_slots(bt, contexts, num_blocks, block_size)
    return (q, k, v, kc, vc, bt, qsl, sl, cl), used, g


@pytest.mark.parametrize("poison", POISONS)
@pytest.mark.parametrize("window", [None, 7])
def test_prefix_ignores_unused_slots(poison, window, path, formulation):
    args, used, g = _prefix_case(torch.bfloat16)
    clean = paged_prefix(*args, sliding_window=window)
    pk, pv = _poison(args[3], args[4], used, poison, g)
    out = paged_prefix(*args[:3], pk, pv, *args[5:], sliding_window=window)
    assert torch.equal(out, clean)
    assert out.isfinite().all()
    ref = ref_prefix(*args, 0.125, sliding_window=window)
    torch.testing.assert_close(out.double(), ref, atol=3e-2, rtol=0)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
def test_prefix_fp8_random_bytes_in_unused_slots(kv_cache_dtype, path):
    if not fp8_available(kv_cache_dtype):
        pytest.skip("torch has no float8 dtypes")
    args, used, g = _prefix_case(torch.bfloat16, kv_cache_dtype)
    kw = {"kv_cache_dtype": kv_cache_dtype, "k_scale": 0.5, "v_scale": 2.0}
    clean = paged_prefix(*args, **kw)
    pk, pv = _poison(args[3], args[4], used, "bytes", g)
    out = paged_prefix(*args[:3], pk, pv, *args[5:], **kw)
    assert torch.equal(out, clean) and out.isfinite().all()

"""``kernels.kv_write``: fp8 cache writes with vLLM's bytes and layout, read back by the shim's
decode and prefix within fp8 tolerance."""

from __future__ import annotations

import math

import pytest
import torch
from helpers.reference import attend, fp8_available, gather_seq, make_tables, x_of

from vllm_bi100_patch.attention.kernels import kv_write, paged_decode, paged_prefix

pytestmark = pytest.mark.skipif(not fp8_available(), reason="torch without float8 dtypes")

BS = 16


def _reference_bytes(x: torch.Tensor, scale: float, name: str) -> torch.Tensor:
    """One token's fp8 bytes, element by element from the definition (float32 division,
    saturation, round to nearest by torch's cast)."""
    f8 = getattr(torch, "float8_e5m2" if name == "fp8_e5m2" else "float8_e4m3fn")
    top = torch.finfo(f8).max
    flat = [min(max(float(torch.tensor(v, dtype=torch.float32) / torch.tensor(
        scale, dtype=torch.float32)), -top), top) for v in x.float().flatten().tolist()]
    return torch.tensor(flat, dtype=torch.float32).to(f8).view(torch.uint8).view(x.shape)


@pytest.mark.parametrize("name,values,expected", [
    ("fp8", [1.0, -1.0, 448.0, 1000.0, -1e9, 0.0], [0x38, 0xB8, 0x7E, 0x7E, 0xFE, 0x00]),
    ("fp8_e4m3", [2.0, 0.015625], [0x40, 0x08]),
    ("fp8_e5m2", [1.0, 57344.0, 1e9, -2.0], [0x3C, 0x7B, 0x7B, 0xC0]),
])
def test_known_bytes_saturate_like_vllm(name, values, expected):
    got = kv_write.quantize_fp8(torch.tensor(values) * 0.5, 0.5, name)
    assert got.tolist() == expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", ["fp8", "fp8_e5m2"])
def test_bytes_equal_vllm_layout_and_padding_slots_are_skipped(dtype, name):
    g = torch.Generator().manual_seed(1)
    blocks, kv, d = 6, 2, 32
    key_cache = torch.randint(0, 256, (blocks, kv, d // 16, BS, 16), dtype=torch.uint8,
                              generator=g)
    value_cache = torch.randint(0, 256, (blocks, kv, d, BS), dtype=torch.uint8, generator=g)
    tokens = 40
    key = (torch.randn(tokens, kv, d, generator=g) * 3).to(dtype)
    value = (torch.randn(tokens, kv, d, generator=g) * 3).to(dtype)
    slots = torch.randperm(blocks * BS, generator=g)[:tokens]
    slots[::7] = -1
    want_k, want_v = key_cache.clone(), value_cache.clone()
    for t in range(tokens):
        s = int(slots[t])
        if s < 0:
            continue
        want_k[s // BS, :, :, s % BS, :] = _reference_bytes(key[t], 0.25, name).view(kv, -1, 16)
        want_v[s // BS, :, :, s % BS] = _reference_bytes(value[t], 2.0, name)
    kv_write.write_fp8(key, value, key_cache, value_cache, slots, name, 0.25, 2.0)
    assert torch.equal(key_cache, want_k) and torch.equal(value_cache, want_v)


def test_read_back_by_decode_and_prefix_within_fp8_tolerance():
    g = torch.Generator().manual_seed(2)
    heads, kv, d, dtype = 8, 2, 64, torch.float16
    lens = [37, 5, 64]
    blocks = sum(math.ceil(n / BS) for n in lens) + 2
    tables = make_tables(lens, BS, max(math.ceil(n / BS) for n in lens), blocks, g)
    key_cache = torch.zeros(blocks, kv, d // x_of(torch.uint8), BS, x_of(torch.uint8),
                            dtype=torch.uint8)
    value_cache = torch.zeros(blocks, kv, d, BS, dtype=torch.uint8)
    ks = [torch.randn(n, kv, d, generator=g).to(dtype) for n in lens]
    vs = [torch.randn(n, kv, d, generator=g).to(dtype) for n in lens]
    k_scale, v_scale = 0.05, 0.03
    for i, n in enumerate(lens):
        pos = torch.arange(n)
        slots = tables[i].long()[pos // BS] * BS + pos % BS
        kv_write.write_fp8(ks[i], vs[i], key_cache, value_cache, slots, "fp8", k_scale, v_scale)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    query = torch.randn(len(lens), heads, d, generator=g).to(dtype)
    out = paged_decode(query, key_cache, value_cache, tables, seq_lens, d ** -0.5,
                       kv_cache_dtype="fp8", k_scale=k_scale, v_scale=v_scale)
    for i, n in enumerate(lens):
        kq, vq = gather_seq(key_cache, value_cache, tables[i], n, "fp8", k_scale, v_scale)
        exact = attend(query[i:i + 1], kq, vq, [n - 1], d ** -0.5)[0]
        assert (out[i].double() - exact).abs().max() <= 2e-3  # the decode of those bytes
        true = attend(query[i:i + 1], ks[i], vs[i], [n - 1], d ** -0.5)[0]
        assert (out[i].double() - true).abs().max() <= 0.15  # fp8 e4m3 K and V: 2^-4 relative each
    # prefix: the last 9 tokens of the first sequence are new, the rest cached
    new = 9
    ctx = lens[0] - new
    q = torch.randn(new, heads, d, generator=g).to(dtype)
    out = paged_prefix(q, ks[0][ctx:], vs[0][ctx:], key_cache, value_cache, tables[:1],
                       torch.tensor([0, new], dtype=torch.int32),
                       torch.tensor([lens[0]], dtype=torch.int32),
                       torch.tensor([ctx], dtype=torch.int32), scale=d ** -0.5,
                       kv_cache_dtype="fp8", k_scale=k_scale, v_scale=v_scale)
    true = attend(q, ks[0], vs[0], range(ctx, lens[0]), d ** -0.5)
    assert (out.double() - true).abs().max() <= 0.15


def test_refuses_what_it_cannot_write():
    key = torch.zeros(1, 1, 16)
    kc = torch.zeros(1, 1, 1, BS, 16, dtype=torch.uint8)
    vc = torch.zeros(1, 1, 16, BS, dtype=torch.uint8)
    with pytest.raises(ValueError, match="kv_cache_dtype='int8'"):
        kv_write.write_fp8(key, key, kc, vc, torch.zeros(1, dtype=torch.long), "int8", 1.0, 1.0)
    with pytest.raises(ValueError, match="past the cache"):
        kv_write.write_fp8(key, key, kc, vc, torch.tensor([BS]), "fp8", 1.0, 1.0)
    with pytest.raises(ValueError, match="uint8"):
        kv_write.write_fp8(key, key, kc.half(), vc.half(), torch.zeros(1, dtype=torch.long),
                           "fp8", 1.0, 1.0)

"""Decode at the edges of the range (issue 26 defects 1 and 2): every finite input the CPU
mode gets right, the GPU compute mode gets right too, against a float64 reference.

Defect 1: the maximum score was subtracted after a rounded product (``top * factor``), so
the maximum key's exponent was a rounding residual (up to +-2,048 at scaled scores of about
4.9e10): zeros or NaN for fp16 q = k = 65,504, bf16 q = k = 1e5, keys of 1e30 or random
keys times 1e12.  Defect 2: a softmax scale of 0 (or an fp8 ``k_scale`` of 0) made the masked
``-inf`` scores NaN and the rows zeros; a zero scale weighs every visible key alike.
"""

from __future__ import annotations

import pytest
import torch
from helpers.reference import (cpu_half_gemm, empty_caches, fp8_available, make_cache,
                               ref_decode, rel_error, write)

from vllm_bi100_patch.attention.kernels import paged_decode

HEADS, KV, D, BS, LEN = 4, 1, 64, 16, 100


def _case(dtype, q_fill=None, k_fill=None, k_mult=1.0, seed=26, kv_cache_dtype="auto"):
    g = torch.Generator().manual_seed(seed)
    blocks = LEN // BS + 2
    store = dtype if kv_cache_dtype == "auto" else torch.uint8
    kc, vc = empty_caches(blocks, KV, D, BS, store)
    table = torch.arange(1, blocks, dtype=torch.int32).view(1, -1)
    k = torch.randn(LEN, KV, D, generator=g, dtype=torch.float64) * k_mult
    if k_fill is not None:
        k.fill_(k_fill)
    v = torch.randn(LEN, KV, D, generator=g)
    q = torch.randn(1, HEADS, D, generator=g, dtype=torch.float64)
    if q_fill is not None:
        q.fill_(q_fill)
    return q.to(dtype), kc, vc, table, k.to(dtype), v.to(dtype)


CASES = {
    "fp16 q = k = 65504": (torch.float16, dict(q_fill=65504.0, k_fill=65504.0)),
    "fp16 q = 65504, k = -65504": (torch.float16, dict(q_fill=65504.0, k_fill=-65504.0)),
    "fp16 q = k = 16000": (torch.float16, dict(q_fill=16000.0, k_fill=16000.0)),
    "bf16 q = k = 1e5": (torch.bfloat16, dict(q_fill=1e5, k_fill=1e5)),
    "bf16 k = 1e30": (torch.bfloat16, dict(k_fill=1e30)),
    "bf16 random keys x 1e12": (torch.bfloat16, dict(k_mult=1e12)),
}


def _mode(force, mode):
    force(compute="native" if mode == "gpu" else "fp32",
          layout="generic" if mode == "gpu" else None)


@pytest.mark.parametrize("mode", ["cpu", "gpu"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_very_large_scores_are_finite_and_right(name, mode, force):
    dtype, kw = CASES[name]
    if dtype == torch.float16 and mode == "gpu" and not cpu_half_gemm():
        pytest.skip("no float16 GEMM on this CPU torch")
    _mode(force, mode)
    q, kc, vc, table, k, v = _case(dtype, **kw)
    write(kc, vc, table[0], 0, k, v)
    seq_lens = torch.tensor([LEN], dtype=torch.int32)
    # 128 ** -0.5: not a power of two (a power-of-two factor made the old product exact).
    out = paged_decode(q, kc, vc, table, seq_lens, 128 ** -0.5)
    ref = ref_decode(q, kc, vc, table, seq_lens, 128 ** -0.5)
    assert bool(torch.isfinite(out).all()), name
    assert rel_error(out, ref) <= 1e-2, (name, rel_error(out, ref))


@pytest.mark.parametrize("mode", ["cpu", "gpu"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_zero_scale_is_the_plain_mean(dtype, mode, force):
    if dtype == torch.float16 and mode == "gpu" and not cpu_half_gemm():
        pytest.skip("no float16 GEMM on this CPU torch")
    _mode(force, mode)
    q, kc, vc, table, k, v = _case(dtype)
    write(kc, vc, table[0], 0, k, v)
    seq_lens = torch.tensor([LEN - 3], dtype=torch.int32)  # slots past the end: hidden
    out = paged_decode(q, kc, vc, table, seq_lens, 0.0)
    mean = v[:LEN - 3].double().mean(0).repeat_interleave(HEADS // KV, 0).unsqueeze(0)
    assert rel_error(out, mean) <= 1e-2


@pytest.mark.skipif(not fp8_available(), reason="torch without float8 dtypes")
@pytest.mark.parametrize("mode", ["cpu", "gpu"])
def test_a_zero_fp8_k_scale_is_the_plain_mean(mode, force):
    _mode(force, mode)
    q, _, _, table, _, _ = _case(torch.bfloat16)
    kc, vc = make_cache(LEN // BS + 2, KV, D, BS, torch.bfloat16, "fp8",
                        torch.Generator().manual_seed(8))
    seq_lens = torch.tensor([LEN], dtype=torch.int32)
    out = paged_decode(q, kc, vc, table, seq_lens, D ** -0.5, kv_cache_dtype="fp8",
                       k_scale=0.0, v_scale=1.0)
    ref = ref_decode(q, kc, vc, table, seq_lens, D ** -0.5, kv_cache_dtype="fp8",
                     k_scale=0.0, v_scale=1.0)
    assert bool(torch.isfinite(out).all())
    assert rel_error(out, ref) <= 1e-2, rel_error(out, ref)

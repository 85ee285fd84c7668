"""``kernels.dense.varlen_attention``: packed prompts against the float64 reference, in every
formulation; tiles under the budget; clear errors."""

from __future__ import annotations

import pytest
import torch
from helpers.reference import TOLERANCE, attend, rel_error
from tools.memtrack import PeakMemory

from vllm_bi100_patch.kernels import _common, dense

LENS = [1, 23, 70, 8]


def _inputs(heads, kv, d, dtype, lens, seed=0, kv_lens=None):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lens), heads, d, generator=g).to(dtype)
    n = sum(kv_lens or lens)
    return (q, torch.randn(n, kv, d, generator=g).to(dtype),
            torch.randn(n, kv, d, generator=g).to(dtype), g)


def _reference(q, k, v, lens, scale, alibi=None, window=None, causal=True, kv_lens=None):
    ref = torch.zeros(q.shape, dtype=torch.float64)
    a = b = 0
    for n, m in zip(lens, kv_lens or lens):
        pos = list(range(n)) if causal else [m] * n  # non-causal: every key is visible
        ref[a:a + n] = attend(q[a:a + n], k[b:b + m], v[b:b + m], pos, scale, alibi, window)
        a, b = a + n, b + m
    return ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads,kv", [(8, 8), (8, 2), (8, 1)])
@pytest.mark.parametrize("variant", ["causal", "window", "alibi"])
def test_matches_reference(formulation, dtype, heads, kv, variant):
    d = 64
    q, k, v, g = _inputs(heads, kv, d, dtype, LENS)
    alibi = torch.rand(heads, generator=g) if variant == "alibi" else None
    window = 9 if variant == "window" else None
    out = dense.varlen_attention(q, k, v, LENS, d ** -0.5, alibi_slopes=alibi,
                                 sliding_window=window, budget_mb=1)
    ref = _reference(q, k, v, LENS, d ** -0.5, alibi, window)
    assert out.dtype == dtype and out.shape == q.shape
    assert rel_error(out, ref) <= TOLERANCE[(_common.compute_mode(q.device), dtype)]


def test_encoder_and_cross_attention_are_unmasked():
    q, k, v, _ = _inputs(4, 2, 32, torch.float32, LENS, kv_lens=[5, 0, 30, 2])
    out = dense.varlen_attention(q, k, v, LENS, 0.2, kv_lens=[5, 0, 30, 2], causal=False)
    ref = _reference(q, k, v, LENS, 0.2, causal=False, kv_lens=[5, 0, 30, 2])
    assert rel_error(out, ref) <= 1e-5
    assert torch.count_nonzero(out[1:24]) == 0  # the sequence with no keys: zeros


def test_tiles_stay_under_the_budget_and_give_the_same_answer():
    heads, kv, d, n = 8, 2, 128, 2048
    q, k, v, _ = _inputs(heads, kv, d, torch.float32, [n])
    whole = dense.varlen_attention(q, k, v, [n], d ** -0.5, budget_mb=4096)
    with PeakMemory() as mem:
        tiled = dense.varlen_attention(q, k, v, [n], d ** -0.5, budget_mb=8)
    work = mem.peak_bytes - tiled.numel() * tiled.element_size()
    assert work <= 8 << 20, mem.peak_bytes
    assert heads * n * n * 4 > 8 * (8 << 20)  # untiled scores would be far above it
    assert (tiled - whole).abs().max() <= 1e-5
    assert dense.tile_rows(n, n, heads, kv, d, 4, 8 << 20) < n


@pytest.mark.parametrize("call,match", [
    (lambda q, k, v: dense.varlen_attention(q, k, v, [10], 1.0), "cover 10 query"),
    (lambda q, k, v: dense.varlen_attention(q, k.half(), v, [12], 1.0), "share one of"),
    (lambda q, k, v: dense.varlen_attention(q, k, v, [12], 1.0, sliding_window=0),
     "sliding_window"),
    (lambda q, k, v: dense.varlen_attention(q, k, v, [12], 1.0, causal=False,
                                            alibi_slopes=torch.ones(4)), "causal attention only"),
    (lambda q, k, v: dense.varlen_attention(q, k, v, [12], 1.0, alibi_slopes=torch.ones(3)),
     r"alibi_slopes must have shape \[4\]"),
])
def test_clear_errors(call, match):
    q, k, v, _ = _inputs(4, 2, 16, torch.float32, [12])
    with pytest.raises(ValueError, match=match):
        call(q, k, v)

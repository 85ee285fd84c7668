"""``kernels.prefill.dense.varlen_attention``: packed prompts against the float64 reference, in every
formulation; tiles under the budget; clear errors."""

from __future__ import annotations

import logging

import pytest
import torch
from helpers.reference import TOLERANCE, attend, cpu_half_gemm, rel_error
from tools.memtrack import PeakMemory

from vllm_bi100_patch.attention.kernels.compute import compute_mode
from vllm_bi100_patch.attention.kernels.prefill import dense

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
    assert rel_error(out, ref) <= TOLERANCE[(compute_mode(q.device), dtype)]


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
    assert dense.tile_rows(n, n, heads, kv, d, 4, 8 << 20) < n  # one query tile per unit


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


# --- issue 21, items 4-6: the dense kernel's range and tile choice -------------------------

def _gpu_mode(force):
    force(compute="native", layout="generic")


def test_large_scores_at_head_256_are_not_nan_in_float16(monkeypatch, force):
    """q = k = 24 in every component of a 256-wide head: q.k = 147,456 is past float16
    before the scale, 9,216 after it; every score is the same, so the answer is the
    values' mean (1), as in float32 mode (item 4: the GEMM used to round q.k unscaled)."""
    if not cpu_half_gemm():
        pytest.skip("no float16 GEMM on this CPU torch")
    _gpu_mode(force)
    n = 64
    q = torch.full((n, 4, 256), 24.0, dtype=torch.float16)
    k = torch.full((n, 1, 256), 24.0, dtype=torch.float16)
    v = torch.ones(n, 1, 256, dtype=torch.float16)
    out = dense.varlen_attention(q, k, v, [n], 256 ** -0.5)
    assert torch.equal(out, torch.ones_like(out))
    force(compute="fp32")
    assert torch.equal(dense.varlen_attention(q, k, v, [n], 256 ** -0.5), out)


def test_scores_below_the_float16_range_in_every_key_group_are_recomputed(force):
    """q = 64, k = -64 at head 256: every scaled score is -65,536, -inf in float16; under a
    1 MiB budget the 600 keys span several key groups, so no row's running max is ever
    finite and its weights are all 0: the row is recomputed in float32 (it was 0/0, NaN)."""
    if not cpu_half_gemm():
        pytest.skip("no float16 GEMM on this CPU torch")
    _gpu_mode(force)
    n = 600
    q = torch.full((n, 4, 256), 64.0, dtype=torch.float16)
    k = torch.full((n, 1, 256), -64.0, dtype=torch.float16)
    v = torch.ones(n, 1, 256, dtype=torch.float16)
    out = dense.varlen_attention(q, k, v, [n], 256 ** -0.5, budget_mb=1)
    assert torch.equal(out, torch.ones_like(out))


@pytest.mark.parametrize("spread", [0.2, 1.5])
def test_values_near_the_float16_limit_stay_finite(spread, force, caplog):
    """Values at 65,504 (the largest float16): every output is 65,504 or one ulp below.  ``P.V`` is a
    weighted mean (the weights normalised by the softmax, halved so that weights rounded to
    a sum just over 1 cannot carry it past float16), whether the weights are near-uniform
    (``spread`` 0.2: ~500 keys of equal weight, past float16 at the old ``2**-8`` scale of
    unnormalised weights) or peaked (1.5); where the quotient of the two rounded sums
    rounds past 65,504 the row is recomputed in float32 (logged), never left infinite or
    clamped."""
    if not cpu_half_gemm():
        pytest.skip("no float16 GEMM on this CPU torch")
    _gpu_mode(force)
    caplog.set_level(logging.WARNING, logger="vllm.bi100_patch")
    g = torch.Generator().manual_seed(5)
    lens = [500, 500, 500, 500]
    q = (torch.randn(2000, 8, 128, generator=g) * spread).half()
    k = torch.randn(2000, 2, 128, generator=g).half()
    v = torch.full((2000, 2, 128), 65504.0, dtype=torch.float16)
    out = dense.varlen_attention(q, k, v, lens, 128 ** -0.5)
    # Since issue 41 float16's weights are corrected after the softmax (``p + p expm1(r)``):
    # their sum is no longer the softmax's 1, and the quotient of the two rounded sums may
    # land one float16 ulp below (65,472): finite, never past 65,504.
    assert bool(((out == 65504) | (out == 65472)).all()), out.unique()
    for r in caplog.records:
        assert "recomputed in float32" in r.getMessage()


def test_tile_choice_never_collapses():
    """The profiling run's shape (8,192 tokens, 16/16 heads of 256, float16, 256 MiB): a
    tile holds far more than one query row (item 6: a unit used to be 1 row) in both modes:
    the last tile of the prompt has 128 rows in the GPU compute mode (its score row over
    8,192 keys, with the residuals beside the float16 scores since issue 41, fits three
    eighths of the budget; the softmax writes the probabilities in place), 64 on CPUs
    (their largest tile)."""
    gpu = dense.tile_rows(8192, 8192, 16, 16, 256, 2, 256 << 20)
    cpu = dense.tile_rows(8192, 8192, 16, 16, 256, 4, 256 << 20)
    assert (gpu, cpu) == (128, 64)


@pytest.mark.parametrize("compute", ["fp32", "native"])
def test_peak_within_the_budget_in_both_modes(compute, force):
    """2,048 tokens of 16/16 heads of 256 under 64 MiB (float32 mode used to exceed it)."""
    force(compute=compute, layout="generic" if compute == "native" else None)
    dtype = torch.bfloat16
    q, k, v, _ = _inputs(16, 16, 256, dtype, [2048], seed=6)
    with PeakMemory() as mem:
        out = dense.varlen_attention(q, k, v, [2048], 1 / 16, budget_mb=64)
    assert mem.peak_bytes - out.untyped_storage().nbytes() <= 64 << 20

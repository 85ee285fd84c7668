"""Large magnitudes, long ALiBi contexts and window-hidden slots, in every formulation.

The GPU formulation ("native") multiplies in the half dtypes; nothing it rounds to them may
overflow (inf, then NaN) where the float32 formulation gives the right answer.  The grid is
``vllm_bi100_patch.ops.selftest.magnitudes.MAGNITUDES`` (shared with ``selftest``); the ALiBi
and sliding-window cases are the reproductions of the issue, made cheap (one KV head, small heads).
"""

from __future__ import annotations

import logging
import math

import pytest
import torch
from helpers.reference import (
    TOLERANCE,
    attend,
    cpu_half_gemm,
    make_cache,
    make_tables,
    ref_decode,
    ref_prefix,
    rel_error,
)

from vllm_bi100_patch.attention.kernels.forced import forcing
from vllm_bi100_patch.attention.kernels import paged_decode, paged_prefix
from vllm_bi100_patch.attention.kernels.prefill import prefix
from vllm_bi100_patch.ops.selftest.magnitudes import decode_from, large_magnitude_errors, magnitude_case


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_large_magnitudes_within_tolerance(dtype, formulation, force):
    if formulation == "gpu":  # the same grid, formulation and dtypes as this check on CPU
        pytest.skip("test_device.py::test_device_check[check_large_magnitudes] runs it")
    force(path=None)
    assert large_magnitude_errors(torch.device("cpu"), dtype) == []


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_issue_reproductions_are_finite(dtype, formulation, force):
    """Keys 0 and values 128 over 4,096 tokens (prefix), values 300 (decode), q = k = 24 in
    every component of a 128-wide head (decode): the exact answers are 128, 300 and 1."""
    force(path="tiled")
    case = magnitude_case(dtype, 4096, 4, 1.0, 0.0, 128.0, constant=True)
    assert torch.equal(paged_prefix(*case).float(), torch.full(case[0].shape, 128.0))
    case = magnitude_case(dtype, 4096, 1, 1.0, 1.0, 300.0, constant=True)
    out = paged_decode(*decode_from(case), 128 ** -0.5)
    assert torch.equal(out.float(), torch.full(out.shape, 300.0))
    case = magnitude_case(dtype, 64, 1, 24.0, 24.0, 1.0, constant=True)
    out = paged_decode(*decode_from(case), 128 ** -0.5)
    assert torch.equal(out.float(), torch.ones(out.shape))


def _alibi_case(dtype, ctx, head_size=16):
    """One sequence of ``ctx`` cached tokens plus 2 new ones, two heads on one KV head, keys
    random (small), values random; the dense K/V too, for the float64 reference."""
    case = magnitude_case(dtype, ctx, 2, 0.5, 0.5, 1.0, constant=False, head_size=head_size)
    q, k, v, kc, vc = case[:5]
    x = kc.shape[-1]
    blocks = kc.shape[0]
    dense_k = kc.permute(0, 3, 1, 2, 4).reshape(blocks * 16, 1, head_size)[:ctx]
    dense_v = vc.permute(0, 3, 1, 2).reshape(blocks * 16, 1, head_size)[:ctx]
    assert x * (head_size // x) == head_size
    return case, torch.cat([dense_k, k]), torch.cat([dense_v, v])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_alibi_bias_at_70k_tokens(dtype, formulation, force):
    """Distances past 65,504 (slopes 0 and 0.5): the bias is computed in float32, so a slope
    of 0 gives a bias of 0, never 0 * inf."""
    force(path="tiled")
    ctx = 70_000
    case, dense_k, dense_v = _alibi_case(dtype, ctx)
    slopes = torch.tensor([0.0, 0.5])
    out = paged_prefix(*case, scale=0.25, alibi_slopes=slopes)
    assert out.isfinite().all()
    ref = attend(case[0], dense_k, dense_v, [ctx, ctx + 1], 0.25, slopes)
    assert rel_error(out, ref) <= TOLERANCE[(forcing().compute, dtype)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("poison", [math.nan, math.inf])
def test_window_hidden_slots_never_reach_the_output(dtype, poison, path, formulation):
    """Context 40, window 5: the block holding positions 32-47 straddles the window's start
    (36 for the first query); a poisoned slot at 33 (hidden from every query) changes
    nothing."""
    case = list(magnitude_case(dtype, 40, 3, 1.0, 1.0, 1.0, constant=False, head_size=64))
    clean = paged_prefix(*case, sliding_window=5)
    kc, vc = case[3].clone(), case[4].clone()
    block, slot = divmod(33, 16)
    kc[block, :, :, slot, :] = poison
    vc[block, :, :, slot] = poison
    out = paged_prefix(*case[:3], kc, vc, *case[5:], sliding_window=5)
    assert torch.equal(out, clean)
    ref = ref_prefix(*case, 64 ** -0.5, sliding_window=5)
    assert rel_error(out, ref) <= TOLERANCE[(forcing().compute, dtype)]


def test_overflowed_float16_scores_are_recomputed_in_float32(caplog, force):
    """q = k = 100 in every component of a 128-wide head: scale * q.k = 113,137 is past the
    float16 range even when scaled first; those rows are recomputed with float32 products
    (a WARNING says so) and their answer is the exact uniform mean (the values, 1,000).  The
    rows of the other sequence (q = k = 1) are not recomputed: they are the rows it gets
    alone (the re-run is decided per row)."""
    force(compute="native", layout="generic", path="tiled")
    caplog.set_level(logging.WARNING, logger="vllm.bi100_patch")
    quiet = magnitude_case(torch.float16, 64, 4, 1.0, 1.0, 1000.0, constant=True)
    loud = magnitude_case(torch.float16, 64, 4, 100.0, 100.0, 1000.0, constant=True)
    both = [torch.cat([a, b]) for a, b in zip(quiet[:3], loud[:3])]
    kc, vc = (torch.cat([a, b]) for a, b in zip(quiet[3:5], loud[3:5]))
    blocks = quiet[5].shape[1]
    bt = torch.stack([quiet[5][0], loud[5][0] + blocks])
    args = (*both, kc, vc, bt, torch.tensor([0, 4, 8], dtype=torch.int32),
            torch.tensor([68, 68], dtype=torch.int32), torch.tensor([64, 64], dtype=torch.int32))
    stats = prefix.PrefixStats()
    out = paged_prefix(*args, stats=stats)
    assert torch.equal(out[4:].float(), torch.full(out[4:].shape, 1000.0))
    warned = [r.getMessage() for r in caplog.records if "recomputed" in r.getMessage()]
    assert len(warned) == 1 and "4 rows past the range" in warned[0], warned
    # What the patch layer counts (metrics): one sequence re-run, the tokens once.
    assert stats.fp32_reruns == 1 and stats.sequences == {"sdpa": 0, "tiled": 2}
    assert stats.tokens == {"sdpa": 0, "tiled": 8}
    caplog.clear()
    alone = paged_prefix(*quiet)
    assert torch.equal(out[:4], alone) and not caplog.records
    assert rel_error(alone, ref_prefix(*quiet, 128 ** -0.5)) <= TOLERANCE[("native",
                                                                            torch.float16)]


def _needs_half_gemm():
    """The GPU formulation of a float16 call needs float16 GEMMs on CPU (not in torch 2.1)."""
    if forcing().compute == "native" and not cpu_half_gemm():
        pytest.skip(f"torch {torch.__version__} has no float16 GEMM on CPU")


def _big_values_batch(seed, dtype=torch.float16):
    """Four sequences (1-299 tokens), two KV heads of 64, every value 65,504 (the float16
    maximum), random queries and keys: the exact answer is 65,504 everywhere."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 300, (4,), generator=g).tolist()
    num_blocks = sum(math.ceil(n / 16) for n in lens) + 1
    kc, _ = make_cache(num_blocks, 2, 64, 16, dtype, gen=g)
    vc = torch.full((num_blocks, 2, 64, 16), torch.finfo(dtype).max, dtype=dtype)
    bt = make_tables(lens, 16, max(math.ceil(n / 16) for n in lens), num_blocks, g)
    q = torch.randn(len(lens), 4, 64, generator=g).to(dtype)
    return q, kc, vc, bt, torch.tensor(lens, dtype=torch.int32)


def test_decode_mean_of_largest_values_is_finite(formulation):
    """Issue 21 item 5: probabilities rounded to float16 but normalised by the unrounded
    float32 sum made a mean of 65,504s exceed the range (inf in about a quarter of such
    batches).  200 random batches, scores from peaked to flat: every output is 65,504 within
    one float16 step (products rounded to float16 cannot promise the last bit).  (bfloat16
    values near its maximum, 3.4e38, overflow float32's accumulation as float32 math would.)"""
    _needs_half_gemm()
    for seed in range(200):
        for scale in (0.125, 1.0):
            out = paged_decode(*_big_values_batch(seed), scale)
            assert out.isfinite().all(), (seed, scale)
            assert (out.float() - 65504).abs().max() <= 32, (seed, scale)


def test_decode_mean_of_largest_values_long_context(formulation):
    """The same at 40,000 tokens (float32 accumulation over long contexts)."""
    _needs_half_gemm()
    g = torch.Generator().manual_seed(3)
    n = 40_000
    num_blocks = n // 16
    kc, _ = make_cache(num_blocks, 1, 32, 16, torch.float16, gen=g)
    vc = torch.full((num_blocks, 1, 32, 16), 65504.0, dtype=torch.float16)
    bt = torch.arange(num_blocks, dtype=torch.int32).view(1, -1)
    q = torch.randn(1, 2, 32, generator=g).to(torch.float16)
    out = paged_decode(q, kc, vc, bt, torch.tensor([n], dtype=torch.int32), 0.2)
    assert out.isfinite().all() and (out.float() - 65504).abs().max() <= 32


def _outlier_case(head_size, outlier, seed=3):
    """A query with one outlier channel ``outlier`` times the others (normal), keys whose
    component in that channel is small: the scores come from the small components, which
    the query's bounding must keep out of float16's subnormal range."""
    g = torch.Generator().manual_seed(seed)
    lens = [700, 300]
    num_blocks = sum(math.ceil(n / 16) for n in lens) + 1
    k = torch.randn(num_blocks, 1, head_size, 16, generator=g)
    k[:, :, 3] *= 1e-3
    x = 8
    kc = k.view(num_blocks, 1, head_size // x, x, 16).transpose(-1, -2).contiguous().half()
    vc = torch.randn(num_blocks, 1, head_size, 16, generator=g).half()
    bt = make_tables(lens, 16, 44, num_blocks, g)
    q = torch.randn(2, 4, head_size, generator=g)
    q[..., 3] = outlier
    return q.half(), kc, vc, bt, torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize("head_size", [128, 256])
@pytest.mark.parametrize("outlier", [1.0, 100.0, 4000.0])
def test_query_outlier_channel_keeps_fp16_precision(head_size, outlier, formulation):
    """Issue 21 item 9: dividing the query by ``head_size * max |q|`` pushed the other
    components of a query with a 4,000x outlier channel into float16 subnormals (decode
    error 1.8e-2 at head 256); a plain float16 cast of the query keeps 1.5e-3
    (``TOLERANCE`` of the float32 mode for float16)."""
    _needs_half_gemm()
    args = _outlier_case(head_size, outlier)
    out = paged_decode(*args, head_size ** -0.5)
    ref = ref_decode(*args, head_size ** -0.5)
    assert rel_error(out, ref) <= TOLERANCE[("fp32", torch.float16)]

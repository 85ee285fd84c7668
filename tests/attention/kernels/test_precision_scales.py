"""Precision at every value scale (issue 26 item 3): the GPU compute mode's prefix and dense
kernels within about two float16 ulps of a float64 reference (median relative error at most
1e-3) wherever the CPU mode is, ALiBi included.

The shape of the issue's table: float16, 4 query / 1 KV heads of 128, 256 cached + 64 new
tokens (prefix; dense: the 320-token prompt), the tiled path, values scaled by 1, 1e-2 and
1e-3.  Before: ``P.V`` ran on unnormalised weights at ``alpha = 2**-8`` (so that weight sums
could not overflow float16), and products of small values fell into float16's subnormals:
median relative errors 2.1e-3 (ALiBi 3.7e-3) at 1e-3.  Now each row's weights are
normalised by a softmax over its whole tile row before ``P.V``: a weighted mean, in float16's
normal range at every value scale (measured on this code: at most 6.0e-4).
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers.reference import cpu_half_gemm, make_cache, make_tables, ref_prefix

from vllm_bi100_patch.attention.kernels.prefill import dense, prefix

CTX, NEW, HEADS, KV, HEAD, BLOCK = 256, 64, 4, 1, 128, 16
SLOPES = torch.tensor([0.5, 0.25, 0.125, 0.0625])


def _inputs(scale: float, seed: int = 26):
    g = torch.Generator().manual_seed(seed)
    blocks = math.ceil(CTX / BLOCK) + 2
    kc, vc = make_cache(blocks, KV, HEAD, BLOCK, torch.float16, gen=g)
    vc = (vc.float() * scale).half()
    table = make_tables([CTX], BLOCK, math.ceil(CTX / BLOCK), blocks, g)
    q = torch.randn(NEW, HEADS, HEAD, generator=g).half()
    k = torch.randn(NEW, KV, HEAD, generator=g).half()
    v = (torch.randn(NEW, KV, HEAD, generator=g) * scale).half()
    lens = [torch.tensor(x, dtype=torch.int32) for x in ([0, NEW], [CTX + NEW], [CTX])]
    return (q, k, v, kc, vc, table, *lens)


def _median_rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    mag = ref.abs()
    seen = mag > 0
    return ((out.double() - ref).abs()[seen] / mag[seen]).median().item()


def _modes(force, run):
    """``run()``'s output in the CPU mode and in the GPU compute mode."""
    outs = []
    for mode in ("fp32", "native"):
        force(compute=mode, layout="generic" if mode == "native" else None)
        outs.append(run())
    return outs


@pytest.mark.parametrize("alibi", [False, True], ids=["plain", "alibi"])
@pytest.mark.parametrize("scale", [1.0, 1e-2, 1e-3])
def test_prefix_median_error_at_every_value_scale(scale, alibi, force):
    if not cpu_half_gemm():
        pytest.skip("no float16 GEMM on this CPU torch")
    force(path="tiled")
    args = _inputs(scale)
    slopes = SLOPES if alibi else None
    ref = ref_prefix(*args, HEAD ** -0.5, alibi_slopes=slopes)
    cpu, gpu = _modes(force, lambda: prefix.paged_prefix(*args, alibi_slopes=slopes))
    assert _median_rel(cpu, ref) <= 1e-3
    assert _median_rel(gpu, ref) <= 1e-3, (scale, alibi, _median_rel(gpu, ref))


@pytest.mark.parametrize("alibi", [False, True], ids=["plain", "alibi"])
@pytest.mark.parametrize("scale", [1.0, 1e-3])
def test_dense_median_error_at_every_value_scale(scale, alibi, force):
    """The dense kernel over the same 320 tokens as one prompt (its rows are the prefix
    kernel's, so the same bound holds for every row)."""
    if not cpu_half_gemm():
        pytest.skip("no float16 GEMM on this CPU torch")
    force(path="tiled")
    g = torch.Generator().manual_seed(27)
    n = CTX + NEW
    q = torch.randn(n, HEADS, HEAD, generator=g).half()
    k = torch.randn(n, KV, HEAD, generator=g).half()
    v = (torch.randn(n, KV, HEAD, generator=g) * scale).half()
    slopes = SLOPES if alibi else None
    empty = torch.zeros(1, KV, HEAD // 8, BLOCK, 8, dtype=torch.float16)
    ref = ref_prefix(q, k, v, empty, torch.zeros(1, KV, HEAD, BLOCK, dtype=torch.float16),
                     torch.zeros(1, 1, dtype=torch.int32), torch.tensor([0, n]),
                     torch.tensor([n]), torch.tensor([0]), HEAD ** -0.5, alibi_slopes=slopes)
    cpu, gpu = _modes(force, lambda: dense.varlen_attention(
        q, k, v, [n], HEAD ** -0.5, alibi_slopes=slopes))
    assert _median_rel(cpu, ref) <= 1e-3
    assert _median_rel(gpu, ref) <= 1e-3, (scale, alibi, _median_rel(gpu, ref))

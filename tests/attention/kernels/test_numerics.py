"""Numerics of the two compute modes against the float64 reference, with stated tolerances.

The GPU formulation ("native": K/V tiles in the query's dtype, half-precision GEMMs with
float32 accumulation, scores and each tile's P.V rounded once to that dtype) is forced on
CPU so that its error is measured here, where no GPU is needed.

Tolerances (``helpers.reference.TOLERANCE``) are relative to the largest reference output
(``max |out - ref| / max |ref|``), because the outputs' magnitude varies with the data.
The grid spans score magnitudes up to ~30 (keys scaled 1x to 6x).  Measured worst cases
on this grid (torch 2.13 CPU), and the bound set at about 3x (2.5x for the largest):

=========  =========  ==========  =====
mode       dtype      measured    bound
=========  =========  ==========  =====
fp32       float32    3.0e-6      1e-5
fp32       float16    4.6e-4      1.5e-3
fp32       bfloat16   3.7e-3      1e-2
native     float32    3.0e-6      1e-5
native     float16    3.5e-3      1e-2
native     bfloat16   2.3e-2      6e-2
=========  =========  ==========  =====

(bfloat16 keeps 8 significant bits: a score of 30 rounds by up to 0.06, which moves its
probability by up to 6%; float16 keeps 11.)
"""

from __future__ import annotations

import itertools

import pytest
import torch
from helpers.reference import (
    TOLERANCE,
    decode_inputs,
    prefix_inputs,
    ref_decode,
    ref_prefix,
    rel_error,
)
from torch.utils._python_dispatch import TorchDispatchMode

from vllm_bi100_patch.attention.kernels.forced import forcing
from vllm_bi100_patch.attention.kernels import paged_decode, paged_prefix
from vllm_bi100_patch.attention.kernels.compute import compute_mode, work_dtype

def worst_errors(dtype, amps=(1.0, 3.0, 6.0), head_sizes=(64, 128), device="cpu"):
    """Worst relative decode and prefix (tiled path, several tiles) errors over the grid."""
    worst = [0.0, 0.0]
    for amp, head_size in itertools.product(amps, head_sizes):
        args = decode_inputs(dtype, head_size, amp, int(amp), device)
        out = paged_decode(*args, head_size ** -0.5).cpu()
        worst[0] = max(worst[0], rel_error(out, ref_decode(*[a.cpu() for a in args],
                                                           head_size ** -0.5)))
        args = prefix_inputs(dtype, head_size, amp, int(amp), device)
        out = paged_prefix(*args, budget_mb=1).cpu()
        worst[1] = max(worst[1], rel_error(out, ref_prefix(*[a.cpu() for a in args],
                                                           head_size ** -0.5)))
    return worst


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_error_within_stated_tolerance(dtype, formulation, force):
    force(path="tiled")
    bound = TOLERANCE[(forcing().compute, dtype)]
    decode_err, prefix_err = worst_errors(dtype)
    assert decode_err <= bound and prefix_err <= bound, (decode_err, prefix_err, bound)


class _GemmLog(TorchDispatchMode):
    """Records the input dtypes of every matrix product."""

    def __init__(self):
        super().__init__()
        self.dtypes = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if any(op in name for op in ("bmm", "baddbmm", ".mm", "matmul", "addmm")):
            self.dtypes.update(a.dtype for a in args if isinstance(a, torch.Tensor)
                               and a.dim() >= 2)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gemm_inputs_follow_the_compute_mode(dtype, formulation, force):
    force(path="tiled")
    want = {torch.float32} if forcing().compute == "fp32" else {dtype}
    with _GemmLog() as log:
        paged_decode(*decode_inputs(dtype, 64, 1.0, 0), 0.125)
    assert log.dtypes == want
    with _GemmLog() as log:
        paged_prefix(*prefix_inputs(dtype, 64, 1.0, 0), budget_mb=1)
    assert log.dtypes == want


def test_compute_mode_by_device(force):
    force(compute=None)
    assert compute_mode(torch.device("cpu")) == "fp32"
    for dev in ("cuda", "cuda:1", "meta"):
        assert compute_mode(torch.device(dev)) == "native"
    assert work_dtype(torch.bfloat16, torch.device("cpu")) == torch.float32
    assert work_dtype(torch.bfloat16, torch.device("cuda")) == torch.bfloat16
    force(compute="native")
    assert work_dtype(torch.float16, torch.device("cpu")) == torch.float16

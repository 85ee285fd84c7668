"""Kernels-layer test configuration: the formulation fixtures."""

from __future__ import annotations

import contextlib

import pytest
import torch
from helpers.reference import cpu_half_gemm


#: Formulations: (tile layout, compute mode).  "cpu" is what CPUs run, "gpu" what every
#: other device runs (strided gathers, half-precision GEMMs with float32 accumulation),
#: "generic-fp32" the GPU layout with float32 math (isolates layout from precision).
FORMULATIONS = {"cpu": ("fast", "fp32"), "generic-fp32": ("generic", "fp32"),
                "gpu": ("generic", "native")}


@pytest.fixture
def force():
    """``force(compute=..., layout=..., path=...)``: ``kernels.forced`` entered for the rest
    of the test (a later call nests inside an earlier one); every block closes, in reverse,
    at teardown, so the kernels' choice by device comes back."""
    from vllm_bi100_patch.attention.kernels.forced import forced

    with contextlib.ExitStack() as stack:
        yield lambda **overrides: stack.enter_context(forced(**overrides))


@pytest.fixture(params=sorted(FORMULATIONS))
def formulation(request, force):
    """Run a test under each formulation (see ``FORMULATIONS``); returns its name."""
    layout, compute = FORMULATIONS[request.param]
    _skip_half_without_cpu_gemm(request, compute == "native")
    force(layout=layout, compute=compute)
    return request.param


@pytest.fixture(params=["sdpa", "tiled"])
def path(request, force):
    """Run a prefix test under both paths (SDPA over gathered K/V, and the tiled one)."""
    _skip_half_without_cpu_gemm(request, request.param == "sdpa")
    force(path=request.param)
    return request.param


def _skip_half_without_cpu_gemm(request, half_gemm_needed: bool) -> None:
    """float16 with half-precision GEMMs on CPU needs a torch that has them (not 2.1)."""
    params = getattr(request.node, "callspec", None)
    dtype = params.params.get("dtype") if params is not None else None
    if half_gemm_needed and dtype == torch.float16 and not cpu_half_gemm():
        pytest.skip(f"torch {torch.__version__} has no float16 GEMM on CPU")


@pytest.fixture(params=["1-thread", "default-threads"])
def threads(request):
    """Run at one thread and at torch's default count (restored after): a BLAS splits its
    reductions by thread count, so the bit-for-bit properties must hold at both."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1 if request.param == "1-thread" else saved)
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(saved)

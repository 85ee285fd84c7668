"""Kernels-layer test configuration: helper import path and markers."""

from __future__ import annotations

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
# scripts/memtrack.py (peak-memory tracker shared with scripts/bench_attention.py).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "scripts"))


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: long-running tests")


#: Formulations: (tile layout, compute mode).  "cpu" is what CPUs run, "gpu" what every
#: other device runs (strided gathers, half-precision GEMMs with float32 accumulation),
#: "generic-fp32" the GPU layout with float32 math (isolates layout from precision).
FORMULATIONS = {"cpu": ("fast", "fp32"), "generic-fp32": ("generic", "fp32"),
                "gpu": ("generic", "native")}


@pytest.fixture(params=sorted(FORMULATIONS))
def formulation(request, monkeypatch):
    """Run a test under each formulation (see ``FORMULATIONS``); returns its name."""
    from vllm_bi100_patch.kernels import _common

    layout, compute = FORMULATIONS[request.param]
    monkeypatch.setattr(_common, "FORCE_LAYOUT", layout)
    monkeypatch.setattr(_common, "FORCE_COMPUTE", compute)
    return request.param


@pytest.fixture(params=["sdpa", "tiled"])
def path(request, monkeypatch):
    """Run a prefix test under both paths (SDPA over gathered K/V, and the tiled one)."""
    from vllm_bi100_patch.kernels import prefix

    monkeypatch.setattr(prefix, "FORCE_PATH", request.param)
    return request.param

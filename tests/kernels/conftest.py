"""Kernels-layer test configuration: helper import path and markers."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(params=["fast", "generic"])
def layout(request, monkeypatch):
    """Run a test under both tile layouts (CPU-tuned and the one used on GPUs)."""
    from vllm_bi100_patch.kernels import _common

    monkeypatch.setattr(_common, "FORCE_LAYOUT", request.param)
    return request.param


@pytest.fixture(params=["sdpa", "tiled"])
def path(request, monkeypatch):
    """Run a prefix test under both paths (SDPA over gathered K/V, and the tiled one)."""
    from vllm_bi100_patch.kernels import prefix

    monkeypatch.setattr(prefix, "FORCE_PATH", request.param)
    return request.param

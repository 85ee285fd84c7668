"""scripts/prompt_attention_cost.py compares like with like: the shim's prompt kernel, the
xformers stand-in as vLLM calls it and SDPA compute the same attention; the fused minimum is
the bytes of Q/K/V/O and the FLOPs of the causal pairs."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch

from helpers.reference import attend

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(autouse=True)
def _no_leak(monkeypatch):
    """The script puts the xformers stand-in on sys.path and imports it: undo both."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        if name == "xformers" or name.startswith("xformers."):
            del sys.modules[name]


def _script():
    spec = importlib.util.spec_from_file_location(
        "prompt_attention_cost", os.path.join(ROOT, "scripts", "prompt_attention_cost.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_three_kernels_compute_the_same_attention():
    cost = _script()
    lens = (5, 11)
    q, k, v = cost._inputs(lens, torch.float32)
    want, start = [], 0
    for n in lens:
        want.append(attend(q[start:start + n], k[start:start + n], v[start:start + n],
                           range(n), cost.HEAD ** -0.5))
        start += n
    want = torch.cat(want)
    for fn in (cost.shim, cost.xformers_standin, cost.sdpa):
        got = fn(q, k, v, lens).reshape(want.shape)
        assert (got.double() - want).abs().max() < 1e-4, fn.__name__


def test_fused_minimum():
    cost = _script()
    nbytes, flops = cost._fused_minimum((3, 4), torch.bfloat16)
    assert nbytes == (2 * 7 * cost.HEADS + 2 * 7 * cost.KV_HEADS) * cost.HEAD * 2
    assert flops == 4 * cost.HEADS * cost.HEAD * (6 + 10)

"""The memory budget holds (issue 34, item 3): the peak of the new storage a call creates
(``tools.memtrack.PeakMemory``: every storage an op creates, counted until it is freed; the
output excluded) stays at or below ``budget_mb`` wherever the budget is at least the call's
documented minimum working set (``decode.minimum_working_set``,
``prefill._plan.minimum_working_set``), and a budget below it is named in a WARNING.

Decode, prefix and dense; both tile layouts (the CPU's ``fast`` and the GPU's ``generic``)
in both compute modes.  Matrix products are answered by ones of their result's shape and
dtype (``OneGemms``: the same allocations, no emulated float16 arithmetic).  The issue's
case: float16, 4 query / 1 KV heads of 256, 4,096 cached + 256 new tokens, 8 MiB (10.0 MiB
peak reported there, the generic layout's key gather materialising a key group beside its
staging buffer).
"""

from __future__ import annotations

import logging
import math

import pytest
import torch
from helpers.reference import make_cache
from test_budgets_prefix import OneGemms
from tools.memtrack import PeakMemory

from vllm_bi100_patch.attention.kernels import decode, paged_decode
from vllm_bi100_patch.attention.kernels.cache import check_cache
from vllm_bi100_patch.attention.kernels.compute import compute_mode, work_dtype
from vllm_bi100_patch.attention.kernels.prefill import _attend, _plan, dense, prefix
from vllm_bi100_patch.attention.kernels.decode import _device

MiB = 1 << 20
LOGGER = "vllm.bi100_patch"
#: (layout, compute): the CPU's formulation, the GPU's, and the two mixed ones.
MODES = [("fast", "fp32"), ("generic", "native"), ("generic", "fp32"), ("fast", "native")]


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch):
    monkeypatch.setattr(_device, "_warned", set())
    monkeypatch.setattr(_attend, "_warned", set())


def _mode(force, layout, compute, path="tiled"):
    force(layout=layout, compute=compute, path=path)


def _peak(fn):
    with OneGemms(), PeakMemory() as mem:
        out = fn()
    return mem.peak_bytes - out.untyped_storage().nbytes()


def _decode_case(lens, heads, kv, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    blocks = [max(1, math.ceil(n / 16)) for n in lens]
    kc, vc = make_cache(sum(blocks) + 1, kv, d, 16, dtype, gen=g)
    table = torch.zeros(len(lens), max(blocks), dtype=torch.int32)
    at = 1
    for i, n in enumerate(blocks):
        table[i, :n] = torch.arange(at, at + n, dtype=torch.int32)
        at += n
    q = torch.randn(len(lens), heads, d, generator=g).to(dtype)
    return q, kc, vc, table, torch.tensor(lens, dtype=torch.int32)


def _prefix_case(ctx, new, heads, kv, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    blocks = math.ceil((ctx + new) / 16) + 1
    kc, vc = make_cache(blocks, kv, d, 16, dtype, gen=g)
    table = torch.randperm(blocks, generator=g).to(torch.int32).view(1, blocks)
    q = torch.randn(new, heads, d, generator=g).to(dtype)
    k = torch.randn(new, kv, d, generator=g).to(dtype)
    v = torch.randn(new, kv, d, generator=g).to(dtype)
    return (q, k, v, kc, vc, table, torch.tensor([0, new], dtype=torch.int32),
            torch.tensor([ctx + new], dtype=torch.int32), torch.tensor([ctx], dtype=torch.int32))


def _prompt_least(heads, kv, d, dtype, budget_mb, end, window=None, gathered=True):
    """The prefix/dense kernels' minimum working set for keys ending at ``end``."""
    work = work_dtype(dtype, torch.device("cpu"))
    til = _plan.tiling(heads, kv, d, 16, work, budget_mb * MiB, window=window,
                       gpu=compute_mode(torch.device("cpu")) == "native")
    return _plan.minimum_working_set(til, kv, d, end, gathered, window)


def _check(peak, least, budget_mb, caplog, what):
    warned = any("below the minimum working set" in r.getMessage() for r in caplog.records)
    if budget_mb * MiB >= least:
        assert peak <= budget_mb * MiB, (what, peak / MiB, budget_mb, least / MiB)
        assert not warned, (what, budget_mb, least / MiB)
    else:
        assert warned, (what, budget_mb, least / MiB, peak / MiB)


@pytest.mark.parametrize("layout,compute", MODES)
def test_the_issues_prefix_case_stays_under_8_mib(layout, compute, force, caplog):
    """float16, 4/1 heads of 256, 4,096 cached + 256 new tokens, 8 MiB."""
    _mode(force, layout, compute)
    caplog.set_level(logging.WARNING, logger=LOGGER)
    args = _prefix_case(4096, 256, 4, 1, 256, torch.float16)
    peak = _peak(lambda: prefix.paged_prefix(*args, budget_mb=8))
    least = _prompt_least(4, 1, 256, torch.float16, 8, 4096 + 256)
    assert least <= 8 * MiB
    _check(peak, least, 8, caplog, "prefix 4096+256")


@pytest.mark.parametrize("layout,compute", MODES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("budget_mb", [1, 3, 16, 64])
@pytest.mark.parametrize("variant", ["plain", "window"])
def test_prefix_and_dense_peaks(layout, compute, dtype, budget_mb, variant, monkeypatch,
                                caplog, force):
    """A long context over several key groups at small budgets (tiles spanning groups,
    halving tiles), and the dense kernel over a whole prompt."""
    _mode(force, layout, compute)
    caplog.set_level(logging.WARNING, logger=LOGGER)
    heads, kv, d = 8, 2, 128
    window = 1500 if variant == "window" else None
    args = _prefix_case(3000, 200, heads, kv, d, dtype, seed=budget_mb)
    peak = _peak(lambda: prefix.paged_prefix(*args, budget_mb=budget_mb,
                                             sliding_window=window))
    _check(peak, _prompt_least(heads, kv, d, dtype, budget_mb, 3200, window), budget_mb,
           caplog, ("prefix", budget_mb))
    caplog.clear()
    monkeypatch.setattr(_attend, "_warned", set())
    q, k, v = args[0][:150], args[1][:150], args[2][:150]
    q = torch.cat([q] * 8)
    k, v = torch.cat([k] * 8), torch.cat([v] * 8)
    peak = _peak(lambda: dense.varlen_attention(q, k, v, [1200], d ** -0.5,
                                                budget_mb=budget_mb, sliding_window=window))
    _check(peak, _prompt_least(heads, kv, d, dtype, budget_mb, 1200, window, False),
           budget_mb, caplog, ("dense", budget_mb))


@pytest.mark.parametrize("layout,compute", MODES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decode_peaks(layout, compute, dtype, monkeypatch, caplog, force):
    """Budgets from below the minimum working set up to one pass: the peak stays under each
    one at or above the minimum (groups of sequences), a WARNING names each one below."""
    _mode(force, layout, compute)
    caplog.set_level(logging.WARNING, logger=LOGGER)
    lens = [6000, 3000, 17, 0, 5000, 2500]
    q, kc, vc, bt, sl = _decode_case(lens, 8, 2, 128, dtype)
    spec = check_cache(kc, vc, q.dtype, "auto")
    width = bt.shape[1] * 16
    least = decode.minimum_working_set(q, spec, width)
    for budget_mb in sorted({1, 2, math.ceil(least / MiB), math.ceil(least / MiB) + 3,
                             2 * math.ceil(least / MiB), 256}):
        caplog.clear()
        monkeypatch.setattr(_device, "_warned", set())
        peak = _peak(lambda mb=budget_mb: paged_decode(q, kc, vc, bt, sl, 0.1, budget_mb=mb))
        if layout == "fast" and compute == "fp32":
            # The CPU path: a one-tile pass of one sequence is its least; no warning exists.
            if budget_mb * MiB >= least:
                assert peak <= budget_mb * MiB, (budget_mb, peak / MiB)
            continue
        _check(peak, least, budget_mb, caplog, ("decode", budget_mb))


def test_decode_minimum_at_the_field_shape(force, caplog):
    """The documented figure (docs/operating.md): at the field's shape (4/1 heads of 256,
    float16) the device path's minimum working set is about 36 MiB at 4,096 tokens, 41 MiB
    at 131,072 (the products' fixed chunk, 32 MiB of keys, is most of it), and a 32,768-token
    call under its minimum as budget stays there."""
    _mode(force, "generic", "native")
    caplog.set_level(logging.WARNING, logger=LOGGER)
    q, kc, vc, bt, sl = _decode_case([32768], 4, 1, 256, torch.float16)
    spec = check_cache(kc, vc, q.dtype, "auto")
    least = {n: decode.minimum_working_set(q, spec, n) for n in (4096, 32768, 131072)}
    assert 35 * MiB < least[4096] < least[32768] < least[131072] < 42 * MiB, least
    budget_mb = math.ceil(least[32768] / MiB)
    peak = _peak(lambda: paged_decode(q, kc, vc, bt, sl, 0.0625, budget_mb=budget_mb))
    _check(peak, least[32768], budget_mb, caplog, "decode 1x32768")

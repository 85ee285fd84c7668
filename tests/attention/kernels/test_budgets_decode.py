"""The decode kernel's launch and time budgets in the GPU compute mode (issues 19 and 34).

Counted by ``tools.account.Account`` on CPU tensors with the GPU compute mode forced
(``forced(compute="native")``): every non-view aten op is a launch (on a GPU in eager
mode, as CoreX forces it, each one costs host time), bytes are what each op reads and writes.
"Minimal" is reading K and V of the sequences once plus the query and the output.  At the
field's per-rank shape (4 query heads / 1 KV head of 256, fp16, block 16) a call must make at
most 48 launches, read nothing back to the host, and take at most 1.25x the modelled BI-V100
time of 3d07fab (the kernels before issue 34's float32-precise scores and fixed-shape
products: ``BEFORE_ISSUE_34``, ``tools.account.predict``) while the memory budget allows one
pass.  The counts are deterministic: a later change cannot lose them quietly.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers.reference import cpu_half_gemm

from tools.account import DEVICES, Account, predict

from vllm_bi100_patch.attention.kernels.forced import forced
from vllm_bi100_patch.attention.kernels import decode, paged_decode
from vllm_bi100_patch.attention.kernels.cache import check_cache

#: The field's per-rank shape (TP=4 of a 16/4-head model of head size 256) and the benchmark's.
FIELD = dict(heads=4, kv_heads=1, head_size=256, dtype=torch.float16)
BENCH = dict(heads=32, kv_heads=8, head_size=128, dtype=torch.bfloat16)
SHAPES = {"1x32768": [32768], "1x65536": [65536], "1x131072": [131072],
          "8x4096": [4096] * 8, "32x1024": [1024] * 32}
MAX_LAUNCHES = 48
#: 3d07fab's modelled BI-V100 ms of each row (``scripts/bench_attention.py --account-only``,
#: the same account): the rows may take at most ``MAX_TIME_RATIO`` times as long.
BEFORE_ISSUE_34 = {("field", "1x32768"): 0.385, ("field", "1x65536"): 0.482,
                   ("field", "1x131072"): 0.667, ("field", "8x4096"): 0.361,
                   ("field", "32x1024"): 0.346, ("bench", "1x32768"): 0.668,
                   ("bench", "8x4096"): 0.645}
MAX_TIME_RATIO = 1.25

#: The field's shape is float16: its half-precision products need a torch with float16 GEMMs
#: on CPU (2.1 has none; the kernels' op sequence does not depend on the torch release).
needs_half_gemm = pytest.mark.skipif(not cpu_half_gemm(),
                                     reason=f"torch {torch.__version__} has no float16 GEMM on CPU")


def _case(lens, heads, kv_heads, head_size, dtype, block_size=16):
    """Sequences in consecutive blocks behind one padding block; random values."""
    g = torch.Generator().manual_seed(0)
    num_blocks = sum(math.ceil(n / block_size) for n in lens) + 1
    x = 16 // torch.empty((), dtype=dtype).element_size()
    kc = torch.randn(num_blocks, kv_heads, head_size // x, block_size, x, generator=g).to(dtype)
    vc = torch.randn(num_blocks, kv_heads, head_size, block_size, generator=g).to(dtype)
    width = max(math.ceil(n / block_size) for n in lens)
    bt = torch.zeros(len(lens), width, dtype=torch.int32)
    at = 1
    for i, n in enumerate(lens):
        m = math.ceil(n / block_size)
        bt[i, :m] = torch.arange(at, at + m, dtype=torch.int32)
        at += m
    q = torch.randn(len(lens), heads, head_size, generator=g).to(dtype)
    return q, kc, vc, bt, torch.tensor(lens, dtype=torch.int32)


def minimal_bytes(lens, heads, kv_heads, head_size, dtype):
    """K and V of every sequence read once, the query read and the output written."""
    size = torch.empty((), dtype=dtype).element_size()
    return (sum(lens) * kv_heads * head_size * 2 + 2 * len(lens) * heads * head_size) * size


def account(lens, shape, layout=None, **kw):
    """The account of one GPU-compute-mode call (layout: ``None`` = chosen by device)."""
    with forced(compute="native", layout=layout):
        args = _case(lens, **shape)
        with Account() as acc:
            paged_decode(*args, shape["head_size"] ** -0.5, max_seq_len=max(lens), **kw)
    return acc, acc.bytes / minimal_bytes(lens, **shape)


@needs_half_gemm
@pytest.mark.parametrize("layout", [None, "generic"])
@pytest.mark.parametrize("name", sorted(SHAPES))
def test_field_shape_within_budgets(name, layout):
    """<= 48 launches, <= 1.25x 3d07fab's modelled time, no host read (layout: the GPU
    compute mode is what a device runs whatever the tile layout a CPU would pick)."""
    acc, ratio = account(SHAPES[name], FIELD, layout)
    assert acc.launches <= MAX_LAUNCHES, (name, acc.launches, acc.by_op)
    ms = predict(acc, DEVICES["bi-v100"]) * 1e3
    assert ms <= MAX_TIME_RATIO * BEFORE_ISSUE_34[("field", name)], (name, ms, ratio)
    assert acc.host_reads == 0, name


@pytest.mark.parametrize("name", ["1x32768", "8x4096"])
def test_bench_shape_stays_sane(name):
    """The benchmark's shape (32 / 8 heads of 128, bf16): the same launch and time budgets
    (two chunks of products here: 16 tiles of 8 KV heads each)."""
    acc, ratio = account(SHAPES[name], BENCH)
    assert acc.launches <= MAX_LAUNCHES, (name, acc.launches, acc.by_op)
    ms = predict(acc, DEVICES["bi-v100"]) * 1e3
    assert ms <= MAX_TIME_RATIO * BEFORE_ISSUE_34[("bench", name)], (name, ms, ratio)
    assert acc.host_reads == 0


@needs_half_gemm
def test_launches_do_not_grow_with_the_batch():
    """The op sequence depends on the width and the budget, not on the number of sequences."""
    one, _ = account([4096], FIELD)
    many, _ = account([4096] * 8, FIELD)
    assert many.launches == one.launches


@needs_half_gemm
def test_passes_follow_the_budget():
    """Under a budget too small for one pass the call makes more passes (groups of
    sequences: more launches), under one below the minimum working set (``decode
    .minimum_working_set``) one pass per sequence, and the answer does not change by a bit:
    every product has the chunk's shape whatever the passes."""
    lens = [8192, 3000, 5000, 100]
    args = _case(lens, **FIELD)
    with forced(compute="native", layout="generic"):
        spec = check_cache(args[1], args[2], args[0].dtype, "auto")
        least = decode.minimum_working_set(args[0], spec, 8192)
        two = (least >> 20) + 1  # room for one sequence, not for all four
        outs, launches = [], []
        for budget in (decode.DEFAULT_BUDGET_MB, two, 1):
            with Account() as acc:
                outs.append(paged_decode(*args, 0.0625, max_seq_len=8192, budget_mb=budget))
            launches.append(acc.launches)
    assert launches[0] < launches[1] <= launches[2], launches
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])

"""The reference grid, reduced, on the device named by ``BI100_TEST_DEVICE`` (default cpu).

``BI100_TEST_DEVICE=cuda python -m pytest tests/kernels/test_device.py`` is what
``scripts/gpu_kernels_check.sh`` runs on a GPU: there the kernels choose their own
formulation (``compute_mode`` must say "native").  On CPU the GPU formulation is forced,
so this file runs (and can fail) everywhere.  Tolerances: ``test_numerics.TOLERANCE``.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from bi100_kernel_ref import fp8_available, make_cache, make_tables, ref_decode, ref_prefix
from test_numerics import TOLERANCE, decode_inputs, prefix_inputs, rel_error

from vllm_bi100_patch.kernels import _common, paged_decode, paged_prefix, prefix

DEVICE = torch.device(os.environ.get("BI100_TEST_DEVICE", "cpu"))


@pytest.fixture(autouse=True)
def _device_formulation(monkeypatch):
    if DEVICE.type == "cpu":
        monkeypatch.setattr(_common, "FORCE_LAYOUT", "generic")
        monkeypatch.setattr(_common, "FORCE_COMPUTE", "native")
    else:
        monkeypatch.setattr(_common, "FORCE_LAYOUT", None)
        monkeypatch.setattr(_common, "FORCE_COMPUTE", None)
    monkeypatch.setattr(prefix, "FORCE_PATH", None)


def _sync():
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def test_device_formulation_is_native():
    assert _common.compute_mode(DEVICE) == "native"
    if DEVICE.type != "cpu":
        assert not _common.fast_layout(DEVICE)
        assert not prefix.sdpa_path_ok(torch.bfloat16, DEVICE)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_size", [64, 128, 256])
@pytest.mark.parametrize("amp", [1.0, 4.0])
def test_decode_and_prefix_match_reference(dtype, head_size, amp):
    bound = TOLERANCE[("native", dtype)]
    args = decode_inputs(dtype, head_size, amp, 1, DEVICE)
    out = paged_decode(*args, head_size ** -0.5, max_seq_len=700)
    _sync()
    ref = ref_decode(*[a.cpu() for a in args], head_size ** -0.5)
    assert rel_error(out.cpu(), ref) <= bound
    args = prefix_inputs(dtype, head_size, amp, 1, DEVICE)
    for budget_mb in (1, 256):
        out = paged_prefix(*args, budget_mb=budget_mb)
        _sync()
        ref = ref_prefix(*[a.cpu() for a in args], head_size ** -0.5)
        assert rel_error(out.cpu(), ref) <= bound, budget_mb


@pytest.mark.parametrize("group", [1, 4, 8])
def test_gqa_window_alibi(group):
    dtype = torch.bfloat16
    g = torch.Generator().manual_seed(group)
    ctxs, news = [0, 33, 100], [7, 20, 12]
    num_blocks = sum(math.ceil(c / 16) for c in ctxs) + 1
    kc, vc = make_cache(num_blocks, 2, 128, 16, dtype, gen=g)
    bt = make_tables(ctxs, 16, 7, num_blocks, g)
    n, heads = sum(news), 2 * group
    q = torch.randn(n, heads, 128, generator=g).to(dtype)
    k = torch.randn(n, 2, 128, generator=g).to(dtype)
    v = torch.randn(n, 2, 128, generator=g).to(dtype)
    qsl = torch.tensor([0, 7, 27, 39], dtype=torch.int32)
    sl = torch.tensor([7, 53, 112], dtype=torch.int32)
    cl = torch.tensor(ctxs, dtype=torch.int32)
    slopes = torch.tensor([2.0 ** -(i + 1) for i in range(heads)])
    cpu_args = (q, k, v, kc, vc, bt, qsl, sl, cl)
    dev_args = [t.to(DEVICE) for t in cpu_args]
    for window, alibi in ((None, None), (9, None), (None, slopes)):
        out = paged_prefix(*dev_args, sliding_window=window,
                           alibi_slopes=None if alibi is None else alibi.to(DEVICE))
        ref = ref_prefix(*cpu_args, 128 ** -0.5, alibi_slopes=alibi, sliding_window=window)
        assert rel_error(out.cpu(), ref) <= TOLERANCE[("native", dtype)]


def test_unattended_slots_never_reach_the_output():
    q, kc, vc, bt, sl = decode_inputs(torch.float16, 128, 1.0, 2)
    sl = torch.tensor([0, 1, 15, 16, 17, 50], dtype=torch.int32)
    used = torch.zeros(kc.shape[0], 16, dtype=torch.bool)
    for row, n in zip(bt.tolist(), sl.tolist()):
        for pos in range(n):
            used[row[pos // 16], pos % 16] = True
    pk, pv = kc.clone(), vc.clone()
    pk[~used[:, None, None, :, None].expand_as(pk)] = math.nan
    pv[~used[:, None, None, :].expand_as(pv)] = math.inf
    clean = paged_decode(*[t.to(DEVICE) for t in (q, kc, vc, bt, sl)], 0.1)
    dirty = paged_decode(*[t.to(DEVICE) for t in (q, pk, pv, bt, sl)], 0.1)
    assert torch.equal(clean, dirty) and bool(dirty.isfinite().all())
    assert not dirty[0].any()


def test_fp8_cache():
    if not fp8_available("fp8"):
        pytest.skip("torch has no float8 dtypes")
    g = torch.Generator().manual_seed(5)
    lens = [3, 40, 129]
    num_blocks = sum(math.ceil(n / 16) for n in lens) + 1
    kc, vc = make_cache(num_blocks, 2, 128, 16, torch.bfloat16, "fp8", g)
    bt = make_tables(lens, 16, 9, num_blocks, g)
    q = torch.randn(3, 8, 128, generator=g).to(torch.bfloat16)
    sl = torch.tensor(lens, dtype=torch.int32)
    kw = {"kv_cache_dtype": "fp8", "k_scale": 0.5, "v_scale": 2.0}
    out = paged_decode(*[t.to(DEVICE) for t in (q, kc, vc, bt, sl)], 0.1, **kw)
    ref = ref_decode(q, kc, vc, bt, sl, 0.1, **kw)
    assert rel_error(out.cpu(), ref) <= TOLERANCE[("native", torch.bfloat16)]


@pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA only: sync debug mode, allocator stats")
def test_cuda_decode_never_syncs_and_prefix_stays_in_budget():
    args = [t.to(DEVICE) for t in decode_inputs(torch.bfloat16, 128, 1.0, 3)]
    paged_decode(*args, 0.1, max_seq_len=700)  # warm-up (allocator, cuBLAS handles)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        paged_decode(*args, 0.1, max_seq_len=700)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    g = torch.Generator().manual_seed(0)
    ctx, new, heads, kv, d = 8192, 512, 32, 8, 128
    num_blocks = ctx // 16 + 1
    kc, vc = make_cache(num_blocks, kv, d, 16, torch.bfloat16, gen=g)
    bt = make_tables([ctx], 16, ctx // 16, num_blocks, g)
    q = torch.randn(new, heads, d, generator=g).to(torch.bfloat16)
    k = torch.randn(new, kv, d, generator=g).to(torch.bfloat16)
    v = torch.randn(new, kv, d, generator=g).to(torch.bfloat16)
    meta = (torch.tensor([0, new], dtype=torch.int32), torch.tensor([ctx + new], dtype=torch.int32),
            torch.tensor([ctx], dtype=torch.int32))
    dev = [t.to(DEVICE) for t in (q, k, v, kc, vc, bt) + meta]
    paged_prefix(*[t.to(DEVICE) for t in prefix_inputs(torch.bfloat16, 128, 1.0, 0)])  # warm-up
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = paged_prefix(*dev, budget_mb=64)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base - out.untyped_storage().nbytes()
    assert extra <= 64 << 20, extra

"""The reference grid, reduced, on one device: plain functions that need torch only.

``python tests/kernels/device_checks.py --device cuda`` runs them without pytest (a bare
GPU machine may have only torch: ``scripts/gpu_kernels_check.sh`` does this);
``test_device.py`` runs the same checks under pytest on the device named by
``BI100_TEST_DEVICE`` (default cpu).  On a GPU the kernels choose their own formulation,
which must be the GPU one ("native"); on CPU that formulation is forced, so these checks
run (and can fail) everywhere.  Tolerances: ``helpers.reference.TOLERANCE``.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import traceback
from typing import Callable, Dict, List

import torch

# Run as a plain script (no pytest configuration): tests/ for the helpers, the root for the shim.
TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [TESTS, os.path.dirname(TESTS)]

from helpers.reference import (  # noqa: E402
    TOLERANCE,
    cpu_half_gemm,
    decode_inputs,
    fp8_available,
    make_cache,
    make_tables,
    prefix_inputs,
    ref_decode,
    ref_prefix,
    rel_error,
)

from vllm_bi100_patch.kernels import _common, paged_decode, paged_prefix, prefix  # noqa: E402


class Skip(Exception):
    """A check that does not apply here."""


def use_device_formulation(device: torch.device) -> Dict[str, object]:
    """Force the GPU formulation on CPU, the device's own choice elsewhere; returns the
    previous settings for ``restore``."""
    saved = {"FORCE_LAYOUT": _common.FORCE_LAYOUT, "FORCE_COMPUTE": _common.FORCE_COMPUTE,
             "FORCE_PATH": prefix.FORCE_PATH}
    cpu = device.type == "cpu"
    _common.FORCE_LAYOUT = "generic" if cpu else None
    _common.FORCE_COMPUTE = "native" if cpu else None
    prefix.FORCE_PATH = None
    return saved


def restore(saved: Dict[str, object]) -> None:
    _common.FORCE_LAYOUT = saved["FORCE_LAYOUT"]  # type: ignore[assignment]
    _common.FORCE_COMPUTE = saved["FORCE_COMPUTE"]  # type: ignore[assignment]
    prefix.FORCE_PATH = saved["FORCE_PATH"]  # type: ignore[assignment]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _dtypes(device: torch.device):
    """float16 needs half-precision GEMMs, which some torch releases lack on CPU (2.1)."""
    half = [torch.float16] if device.type != "cpu" or cpu_half_gemm() else []
    return half + [torch.bfloat16, torch.float32]


def check_formulation(device: torch.device) -> None:
    assert _common.compute_mode(device) == "native"
    if device.type != "cpu":
        assert not _common.fast_layout(device)
        assert not prefix.sdpa_path_ok(torch.bfloat16, device)


def check_reference_grid(device: torch.device) -> None:
    """Decode and prefix (budgets 1 and 256 MiB) for fp16/bf16/fp32, head sizes 64, 128,
    256, keys scaled 1x and 4x."""
    for dtype in _dtypes(device):
        bound = TOLERANCE[("native", dtype)]
        for head_size in (64, 128, 256):
            for amp in (1.0, 4.0):
                args = decode_inputs(dtype, head_size, amp, 1, device)
                out = paged_decode(*args, head_size ** -0.5, max_seq_len=700)
                _sync(device)
                ref = ref_decode(*[a.cpu() for a in args], head_size ** -0.5)
                err = rel_error(out.cpu(), ref)
                assert err <= bound, ("decode", dtype, head_size, amp, err)
                args = prefix_inputs(dtype, head_size, amp, 1, device)
                ref = ref_prefix(*[a.cpu() for a in args], head_size ** -0.5)
                for budget_mb in (1, 256):
                    out = paged_prefix(*args, budget_mb=budget_mb)
                    _sync(device)
                    err = rel_error(out.cpu(), ref)
                    assert err <= bound, ("prefix", dtype, head_size, amp, budget_mb, err)


def magnitude_case(dtype: torch.dtype, ctx: int, new: int, q_val: float, k_val: float,
                   v_val: float, *, constant: bool, head_size: int = 128, seed: int = 0):
    """One sequence of ``ctx`` cached tokens (block 16, blocks in order) and ``new`` new ones,
    two query heads on one KV head.  ``constant``: every q/k component is ``q_val``/``k_val``
    (all scores equal: the softmax is uniform whatever their size) and values are
    ``v_val``; else q/k are normal times ``q_val``/``k_val`` and values uniform in
    ``[-v_val, v_val]``.  Returns the prefix arguments (decode uses ``(q[-1:], kc, vc, bt,
    seq_lens)`` of a context of ``ctx + new`` tokens, see ``decode_from``)."""
    g = torch.Generator().manual_seed(seed)
    total, x = ctx + new, 16 // torch.empty((), dtype=dtype).element_size()
    blocks = max(1, math.ceil(total / 16))

    def draw(shape, val, uniform=False):
        if constant:
            return torch.full(shape, float(val))
        if uniform:
            return (torch.rand(shape, generator=g) * 2 - 1) * val
        return torch.randn(shape, generator=g) * val

    k_all = draw((total, 1, head_size), k_val).to(dtype)
    v_all = draw((total, 1, head_size), v_val, uniform=True).to(dtype)
    kc = k_all[:blocks * 16].new_zeros(blocks * 16, 1, head_size)
    vc = kc.clone()
    kc[:total], vc[:total] = k_all, v_all
    # Dense [tokens, 1, D] -> vLLM's layout: key [blocks, 1, D/x, 16, x], value [blocks, 1, D, 16].
    key_cache = kc.view(blocks, 16, 1, head_size // x, x).permute(0, 2, 3, 1, 4).contiguous()
    value_cache = vc.view(blocks, 16, 1, head_size).permute(0, 2, 3, 1).contiguous()
    q = draw((new, 2, head_size), q_val).to(dtype)
    bt = torch.arange(blocks, dtype=torch.int32).view(1, blocks)
    return (q, k_all[ctx:], v_all[ctx:], key_cache, value_cache, bt,
            torch.tensor([0, new], dtype=torch.int32),
            torch.tensor([total], dtype=torch.int32), torch.tensor([ctx], dtype=torch.int32))


def decode_from(case):
    """The decode call of a ``magnitude_case``: the last new token's query over all
    ``ctx + new`` tokens (the case's cache holds them all)."""
    q, _, _, kc, vc, bt, _, sl, _ = case
    return q[-1:], kc, vc, bt, sl


#: (ctx, new, q, k, v, constant): the issue's reproductions (values 128 / 300 over 4,096
#: tokens, q = k = 24 with head 128) and magnitudes around and past the float16 range:
#: unnormalised P.V sums up to 4,096 x 60,000, scores q.k up to 1.3e6 before scaling
#: (1.1e5 after: past float16 even when scaled first).
MAGNITUDES = [
    (4096, 8, 1.0, 0.0, 128.0, True),
    (4096, 8, 1.0, 1.0, 300.0, True),
    (4096, 8, 1.0, 1.0, 300.0, False),
    (4096, 8, 1.0, 1.0, 60000.0, False),
    (600, 8, 24.0, 24.0, 1.0, True),
    (600, 8, 64.0, 64.0, 50.0, True),
    (600, 8, 100.0, 100.0, 1000.0, True),
    (300, 8, 2.0, 2.0, 20000.0, False),
]


def large_magnitude_errors(device: torch.device, dtype: torch.dtype) -> list:
    """``MAGNITUDES`` for one dtype: the cases whose error against the float64 reference
    exceeds ``TOLERANCE`` (decode, the tiled prefix and, on CPU, the SDPA prefix path)."""
    failures = []
    bound = TOLERANCE[(_common.compute_mode(device), dtype)]
    scale = 128 ** -0.5
    for ctx, new, qv, kv, vv, const in MAGNITUDES:
        case = magnitude_case(dtype, ctx, new, qv, kv, vv, constant=const)
        ref = ref_prefix(*case, scale)
        dev = [t.to(device) for t in case]
        for path in ["tiled"] + (["sdpa"] if device.type == "cpu" else []):
            saved, prefix.FORCE_PATH = prefix.FORCE_PATH, path
            try:
                out = paged_prefix(*dev, scale=scale).cpu()
            finally:
                prefix.FORCE_PATH = saved
            err = rel_error(out, ref)
            if not err <= bound:
                failures.append((f"prefix {path}", ctx, qv, kv, vv, const, err))
        err = rel_error(paged_decode(*decode_from(dev), scale).cpu(), ref[-1:])
        if not err <= bound:
            failures.append(("decode", ctx, qv, kv, vv, const, err))
    return failures


def check_large_magnitudes(device: torch.device) -> None:
    """No overflow in either half dtype: ``large_magnitude_errors`` finds nothing."""
    failures = {d: large_magnitude_errors(device, d) for d in _dtypes(device)
                if d != torch.float32}
    assert not any(failures.values()), failures


def check_gqa_window_alibi(device: torch.device) -> None:
    dtype = torch.bfloat16
    for group in (1, 4, 8):
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
        dev_args = [t.to(device) for t in cpu_args]
        for window, alibi in ((None, None), (9, None), (None, slopes)):
            out = paged_prefix(*dev_args, sliding_window=window,
                               alibi_slopes=None if alibi is None else alibi.to(device))
            ref = ref_prefix(*cpu_args, 128 ** -0.5, alibi_slopes=alibi, sliding_window=window)
            assert rel_error(out.cpu(), ref) <= TOLERANCE[("native", dtype)]


def check_unattended_slots(device: torch.device) -> None:
    q, kc, vc, bt, sl = decode_inputs(_dtypes(device)[0], 128, 1.0, 2)
    sl = torch.tensor([0, 1, 15, 16, 17, 50], dtype=torch.int32)
    used = torch.zeros(kc.shape[0], 16, dtype=torch.bool)
    for row, n in zip(bt.tolist(), sl.tolist()):
        for pos in range(n):
            used[row[pos // 16], pos % 16] = True
    pk, pv = kc.clone(), vc.clone()
    pk[~used[:, None, None, :, None].expand_as(pk)] = math.nan
    pv[~used[:, None, None, :].expand_as(pv)] = math.inf
    clean = paged_decode(*[t.to(device) for t in (q, kc, vc, bt, sl)], 0.1)
    dirty = paged_decode(*[t.to(device) for t in (q, pk, pv, bt, sl)], 0.1)
    assert torch.equal(clean, dirty) and bool(dirty.isfinite().all())
    assert not dirty[0].any()


def check_fp8_cache(device: torch.device) -> None:
    if not fp8_available("fp8"):
        raise Skip("torch has no float8 dtypes")
    g = torch.Generator().manual_seed(5)
    lens = [3, 40, 129]
    num_blocks = sum(math.ceil(n / 16) for n in lens) + 1
    kc, vc = make_cache(num_blocks, 2, 128, 16, torch.bfloat16, "fp8", g)
    bt = make_tables(lens, 16, 9, num_blocks, g)
    q = torch.randn(3, 8, 128, generator=g).to(torch.bfloat16)
    sl = torch.tensor(lens, dtype=torch.int32)
    kw = {"kv_cache_dtype": "fp8", "k_scale": 0.5, "v_scale": 2.0}
    out = paged_decode(*[t.to(device) for t in (q, kc, vc, bt, sl)], 0.1, **kw)
    ref = ref_decode(q, kc, vc, bt, sl, 0.1, **kw)
    assert rel_error(out.cpu(), ref) <= TOLERANCE[("native", torch.bfloat16)]


def check_cuda_no_sync_and_budget(device: torch.device) -> None:
    """CUDA only: decode makes no host sync; the prefix peak stays under its budget."""
    if device.type != "cuda":
        raise Skip("CUDA only: sync debug mode, allocator statistics")
    args = [t.to(device) for t in decode_inputs(torch.bfloat16, 128, 1.0, 3)]
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
    dev = [t.to(device) for t in (q, k, v, kc, vc, bt) + meta]
    paged_prefix(*[t.to(device) for t in prefix_inputs(torch.bfloat16, 128, 1.0, 0)])  # warm-up
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = paged_prefix(*dev, budget_mb=64)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base - out.untyped_storage().nbytes()
    assert extra <= 64 << 20, extra


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def _invariance_case(dtype: torch.dtype, lens: List[int], seed: int = 7):
    """Sequences ``lens`` in random blocks, a block table with garbage padding columns."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(math.ceil(n / 16) for n in lens) + 2
    kc, vc = make_cache(num_blocks, 2, 128, 16, dtype, gen=g)
    width = max(math.ceil(n / 16) for n in lens) + 5
    bt = make_tables(lens, 16, width, num_blocks, g, pad=num_blocks + 999)
    q = torch.randn(len(lens), 8, 128, generator=g).to(dtype)
    return q, kc, vc, bt, torch.tensor(lens, dtype=torch.int32)


def check_decode_batch_invariance(device: torch.device) -> None:
    """A sequence's decode output is bit-identical alone and batched (a mate past 8,192
    tokens, short and empty mates, padding columns, two orders, a budget that forces passes),
    with GQA and ALiBi.  Exact on CPU by construction (every product and reduction has the
    tile's shape); on a GPU the matrix-product library could still pick another algorithm by
    batch count: this check shows whether it does."""
    failures = []
    for dtype in _dtypes(device):
        q, kc, vc, bt, sl = _invariance_case(dtype, [3000, 9000, 100, 0])
        slopes = torch.linspace(0.01, 0.2, 8)
        for alibi in (None, slopes):
            alone_args = [t.to(device) for t in (q[:1], kc, vc, bt[:1, :188].clone(), sl[:1])]
            alone = paged_decode(*alone_args, 0.09, max_seq_len=3000,
                                 alibi_slopes=None if alibi is None else alibi.to(device))
            order = [2, 0, 3, 1]
            for budget_mb, rows in ((256, list(range(4))), (1, order)):
                args = [t.to(device) for t in (q[rows], kc, vc, bt[rows], sl[rows])]
                batched = paged_decode(*args, 0.09, max_seq_len=9000, budget_mb=budget_mb,
                                       alibi_slopes=None if alibi is None else alibi.to(device))
                row = rows.index(0)
                _sync(device)
                got, want = batched[row].cpu(), alone[0].cpu()
                if not torch.equal(_bits(got), _bits(want)):
                    diff = (got.double() - want.double()).abs().max().item()
                    failures.append((str(dtype), "alibi" if alibi is not None else "-",
                                     budget_mb, diff))
    assert not failures, f"decode rows differ alone vs batched: {failures}"


CHECKS: List[Callable[[torch.device], None]] = [
    check_formulation, check_reference_grid, check_large_magnitudes, check_gqa_window_alibi,
    check_unattended_slots, check_fp8_cache, check_decode_batch_invariance,
    check_cuda_no_sync_and_budget,
]


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default=os.environ.get("BI100_TEST_DEVICE", "cpu"))
    device = torch.device(parser.parse_args(argv).device)
    saved = use_device_formulation(device)
    failed = passed = skipped = 0
    try:
        for check in CHECKS:
            t0 = time.perf_counter()
            try:
                check(device)
            except Skip as why:
                skipped += 1
                print(f"SKIP {check.__name__}: {why}")
                continue
            except Exception:
                failed += 1
                print(f"FAIL {check.__name__}:\n{traceback.format_exc()}")
                continue
            passed += 1
            print(f"ok   {check.__name__} ({time.perf_counter() - t0:.1f} s)")
    finally:
        restore(saved)
    print(f"device checks on {device}: {passed} passed, {failed} failed, {skipped} skipped")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

# mypy: disable-error-code="call-arg,arg-type,misc"
# (the checks unpack argument lists built by the reference helpers: *args then more positionals)
"""The device checks: the reference grid, reduced, on one device; plain functions of the
device that need torch only (no pytest, no vLLM).

``vllm-bi100-patch selftest`` runs them on the operator's card (``cli.py``);
``tests/attention/kernels/test_device.py`` runs them under pytest on the device named by
``BI100_TEST_DEVICE`` (default cpu).  On a GPU the kernels choose their own formulation,
which must be the GPU one ("native"); on CPU the tests force that formulation
(``device_formulation``), so these checks run (and can fail) everywhere.  Tolerances:
``reference.TOLERANCE``.  A check raises ``Skip`` where it does not apply, anything else
where it fails.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from ...attention.kernels import decode, paged_decode, paged_prefix
from ...attention.kernels.cache import check_cache
from ...attention.kernels.compute import compute_mode, fast_layout
from ...attention.kernels.forced import forced, forcing
from ...attention.kernels.prefill import prefix
from .magnitudes import (MAGNITUDES, decode_from, dense_last_rows,  # noqa: F401 (re-exported)
                         large_magnitude_errors, magnitude_case)
from .precision import DIFFUSE_LOGITS, LOGITS, MAX_RATIO, precision_results
from .reference import (TOLERANCE, cpu_half_gemm, decode_inputs, fp8_available, make_cache,
                        make_tables, prefix_inputs, ref_decode, ref_prefix, rel_error)
from .slicing import chunked, dense_rows, hit, prefix_rows, prompt, same_rows

#: The dtypes the checks run in (None: every dtype the device multiplies, see ``_dtypes``);
#: ``selftest --quick`` narrows it to the model's.  Set through ``device_formulation``.
DTYPES: Optional[Sequence[torch.dtype]] = None
#: The per-rank shape of the precision check, ``(query heads, KV heads, head size)``: the
#: model's in ``selftest`` (``device_formulation``), else issue 34's.
SHAPE: Tuple[int, int, int] = (4, 1, 128)
#: ``selftest --quick``: fewer precision variants.
QUICK = False
#: The long context of ``check_logit_precision``'s diffuse rows (``--quick``: the shorter).
LONG_CONTEXT, LONG_CONTEXT_QUICK = 131072, 16384
#: The rows of the last ``check_logit_precision`` (``selftest``'s ``precision`` section).
PRECISION_RESULTS: List[Dict[str, Any]] = []


class Skip(Exception):
    """A check that does not apply here."""


@contextlib.contextmanager
def device_formulation(device: torch.device, gpu: bool = True,
                       dtypes: Optional[Sequence[torch.dtype]] = None,
                       shape: Optional[Tuple[int, int, int]] = None,
                       quick: bool = False) -> Iterator[None]:
    """While inside: the GPU formulation forced on CPU (``gpu``; else the CPU's own), the
    device's own choice elsewhere; the checks' dtypes (``DTYPES``), the precision check's
    shape and ``QUICK``.  The previous settings come back on exit."""
    global DTYPES, SHAPE, QUICK
    saved = DTYPES, SHAPE, QUICK
    cpu = device.type == "cpu" and gpu
    with forced(layout="generic" if cpu else None, compute="native" if cpu else None,
                path=None):
        DTYPES, SHAPE, QUICK = dtypes, shape or SHAPE, quick
        try:
            yield
        finally:
            DTYPES, SHAPE, QUICK = saved


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _dtypes(device: torch.device) -> List[torch.dtype]:
    """float16 needs half-precision GEMMs, which some torch releases lack on CPU (2.1);
    ``DTYPES`` narrows the list."""
    half = [torch.float16] if device.type != "cpu" or cpu_half_gemm() else []
    every = half + [torch.bfloat16, torch.float32]
    return every if DTYPES is None else [d for d in every if d in DTYPES] or every[:1]


def check_formulation(device: torch.device) -> None:
    """The kernels compute in the GPU formulation on a GPU (and on CPU where it is forced),
    in float32 on CPU otherwise: the formulation the other checks' tolerances are for."""
    compute = forcing().compute
    want = "fp32" if device.type == "cpu" and compute is None else (compute or "native")
    assert compute_mode(device) == want, (compute_mode(device), want)
    if device.type != "cpu":
        assert not fast_layout(device)
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


def check_logit_precision(device: torch.device) -> None:
    """Issue 34's rows (logit std 1, 5, 10, 30; sinks 10-200 above std-1 logits) and issue
    41's diffuse rows (a bulk of logits of std 0.1 or 0.3, one key 3, 4.5 or 7 above it; with
    ``--quick`` the two the issue measured worst) in each half dtype: decode over 4,096
    tokens, the prefix (512 cached + 256 new; keys in one group and, but with ``--quick``,
    under a 1 MiB budget in several) and the dense kernel; then the diffuse rows on the
    prefix after a long context (8 new tokens after 131,072; 16,384 with ``--quick``), all
    at the model's per-rank shape: the median error against float64 at most twice the
    float32-score reference's (what vLLM's CUDA kernel computes).  The rows are the
    report's ``precision`` section (a long context's variant reads ``ctx 131072``)."""
    halves = [d for d in _dtypes(device) if d != torch.float32]
    if not halves:
        raise Skip("no half-precision dtype to check")
    heads, kv, head_size = SHAPE
    diffuse = (DIFFUSE_LOGITS[1], DIFFUSE_LOGITS[3]) if QUICK else DIFFUSE_LOGITS
    long_ctx = LONG_CONTEXT_QUICK if QUICK else LONG_CONTEXT
    with forced(path="tiled") if device.type == "cpu" else forced():  # what a card runs
        results = precision_results(device, halves, ("decode", "prefix", "dense"), LOGITS + diffuse,
                                    variants=("plain",) if QUICK else ("plain", "groups"),
                                    heads=heads, kv_heads=kv, head_size=head_size)
        long_results = precision_results(device, halves, ("prefix",), diffuse, ctx=long_ctx, new=8,
                                         heads=heads, kv_heads=kv, head_size=head_size)
    for r in long_results:
        r["variant"] = f"ctx {long_ctx}"
    results += long_results
    PRECISION_RESULTS[:] = results
    worse = [(r["kernel"], r["variant"], r["dtype"], r["row"], round(r["ratio"], 2))
             for r in results if not r["ratio"] <= MAX_RATIO]
    assert not worse, f"median error above {MAX_RATIO}x the float32-score reference: {worse}"


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
    """Sequences ``lens`` in random blocks, a block table with garbage padding columns, at
    the model's per-rank shape (``SHAPE``)."""
    heads, kv, head_size = SHAPE
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(math.ceil(n / 16) for n in lens) + 2
    kc, vc = make_cache(num_blocks, kv, head_size, 16, dtype, gen=g)
    width = max(math.ceil(n / 16) for n in lens) + 5
    bt = make_tables(lens, 16, width, num_blocks, g, pad=num_blocks + 999)
    q = torch.randn(len(lens), heads, head_size, generator=g).to(dtype)
    return q, kc, vc, bt, torch.tensor(lens, dtype=torch.int32)


def check_decode_batch_invariance(device: torch.device) -> None:
    """A sequence's decode output is bit-identical alone and batched, at the model's shape: a
    3,000-token sequence and a one-tile one (800 tokens: alone, every product has one batch
    element per KV head) beside a mate past 8,192 tokens, short and empty mates, padding
    columns, two orders, a budget that forces passes (one MiB above the minimum working
    set); with and without ALiBi (``--quick``: without).  On devices every product has one
    fixed shape whatever the batch (``kernels.decode._device``); the matrix-product library
    could still compute a batch element differently by its place in the batch: this check
    shows whether it does."""
    failures = []
    heads = SHAPE[0]
    for dtype in _dtypes(device):
        q, kc, vc, bt, sl = _invariance_case(dtype, [3000, 9000, 100, 0, 800])
        spec = check_cache(kc, vc, dtype, "auto")
        small = (decode.minimum_working_set(q.to(device), spec, 9008) >> 20) + 1
        slopes = torch.linspace(0.01, 0.2, heads)
        for target, n in ((0, 3000), (4, 800)):
            for alibi in (None,) if QUICK else (None, slopes):
                al = None if alibi is None else alibi.to(device)
                blocks = math.ceil(n / 16)
                alone_args = [t.to(device) for t in (q[target:target + 1], kc, vc,
                                                     bt[target:target + 1, :blocks].clone(),
                                                     sl[target:target + 1])]
                alone = paged_decode(*alone_args, 0.09, max_seq_len=n, alibi_slopes=al)
                for budget_mb, rows in ((256, [0, 1, 2, 3, 4]), (small, [2, 4, 0, 3, 1])):
                    args = [t.to(device) for t in (q[rows], kc, vc, bt[rows], sl[rows])]
                    batched = paged_decode(*args, 0.09, max_seq_len=9000, budget_mb=budget_mb,
                                           alibi_slopes=al)
                    _sync(device)
                    got, want = batched[rows.index(target)].cpu(), alone[0].cpu()
                    if not torch.equal(_bits(got), _bits(want)):
                        diff = (got.double() - want.double()).abs().max().item()
                        failures.append((str(dtype), n, "alibi" if alibi is not None else "-",
                                         budget_mb, diff))
    assert not failures, f"decode rows differ alone vs batched: {failures}"


#: Issue 20's slicings of one 1,024-token prompt (rows 896-1023 compared with one chunk).
#: The compared rows are 896-1023: the chunks of 37 (with batch mates) start after a hit of
#: 896 (what the cache holds then is what 24 earlier chunks would have written), so that
#: each step's calls cover those rows only (a CPU's emulated half-precision products pay for
#: every tile a step touches).
SLICINGS = {"chunks of 512": chunked(1024, 512), "hit of 896": hit(1024, 896),
            "hit inside a block, then the rest": hit(1024, 896, 901),
            "hit of 896, then chunks of 37": [(a, min(1024, a + 37)) for a in range(896, 1024, 37)]}


def check_prefix_slicing_invariance(device: torch.device) -> None:
    """Same prompt, same answer: the prefix rows 896-1023 of a 1,024-token prompt (8/2 heads
    of 128) are bit-identical however it is sliced (chunked prefill, prefix-cache hits, a
    batch mate), and at head 256 the dense kernel's rows equal the prefix kernel's after a
    hit.  Exact on CPU by construction; on a GPU a matrix-product library could pick another
    algorithm by shape: this check shows whether it does."""
    failures = []
    for dtype in _dtypes(device):
        p = prompt(1024, 8, 2, 128, dtype, seed=20)
        whole = prefix_rows(p, [(0, 1024)], device=str(device))
        cases = dict(SLICINGS)
        for name, steps in cases.items():
            rows = prefix_rows(p, steps, device=str(device), mates=2 if "37" in name else 0)
            if not same_rows(rows[896 - steps[0][0]:], whole[896:]):
                failures.append((str(dtype), name))
        p = prompt(1024, 4, 1, 256, dtype, seed=21)
        if not same_rows(dense_rows(p, device=str(device))[896:],
                         prefix_rows(p, hit(1024, 896), device=str(device))):
            failures.append((str(dtype), "head 256: dense prompt vs prefix after a hit of 896"))
    assert not failures, f"rows differ between slicings: {failures}"


CHECKS: List[Callable[[torch.device], None]] = [
    check_formulation, check_reference_grid, check_large_magnitudes, check_logit_precision,
    check_gqa_window_alibi, check_unattended_slots, check_fp8_cache, check_decode_batch_invariance,
    check_prefix_slicing_invariance,
    check_cuda_no_sync_and_budget,
]

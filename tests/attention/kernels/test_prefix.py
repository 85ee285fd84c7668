"""paged_prefix against a dense float64 reference; tiling under the memory budget."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from helpers.reference import fp8_available, make_cache, make_tables, ref_prefix
from hypothesis import given, settings
from hypothesis import strategies as st

from tools.memtrack import PeakMemory

from vllm_bi100_patch.attention.kernels.forced import forced
from vllm_bi100_patch.attention.kernels import paged_prefix
from vllm_bi100_patch.attention.kernels.compute import work_dtype
from vllm_bi100_patch.attention.kernels.prefill import _attend
from vllm_bi100_patch.attention.kernels.prefill import _plan as _prefix_plan
from vllm_bi100_patch.attention.kernels.prefill import prefix

ATOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def _case(dtype, head_size, heads, kv_heads, block_size, contexts, news, *, seed=0,
          kv_cache_dtype="auto", width=None):
    g = torch.Generator().manual_seed(seed)
    need = sum(math.ceil(c / block_size) for c in contexts)
    num_blocks = need + 2
    kc, vc = make_cache(num_blocks, kv_heads, head_size, block_size, dtype, kv_cache_dtype, g)
    width = width or max([1] + [math.ceil(c / block_size) for c in contexts])
    bt = make_tables(contexts, block_size, width, num_blocks, g)
    n = sum(news)
    q = torch.randn(n, heads, head_size, generator=g).to(dtype)
    k = torch.randn(n, kv_heads, head_size, generator=g).to(dtype)
    v = torch.randn(n, kv_heads, head_size, generator=g).to(dtype)
    qsl = torch.tensor([0] + list(itertools.accumulate(news)), dtype=torch.int32)
    sl = torch.tensor([c + m for c, m in zip(contexts, news)], dtype=torch.int32)
    cl = torch.tensor(contexts, dtype=torch.int32)
    return q, k, v, kc, vc, bt, qsl, sl, cl


def _run(args, **kw):
    return paged_prefix(*args, **kw)


def _ref(args, scale, **kw):
    return ref_prefix(*args, scale, **kw)


def _check(out, ref, dtype):
    assert out.dtype == dtype
    torch.testing.assert_close(out.to(torch.float64), ref, atol=ATOL[dtype], rtol=0)


CONTEXTS = [0, 1, 15, 16, 17, 40]
NEWS = [5, 1, 16, 3, 17, 9]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_size", [64, 80, 96, 128, 256])
def test_dtypes_head_sizes(dtype, head_size, path):
    args = _case(dtype, head_size, 4, 2, 16, CONTEXTS, NEWS)
    _check(_run(args), _ref(args, head_size ** -0.5), dtype)


@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_gqa_block_sizes(group, block_size, formulation, path):
    dtype = torch.bfloat16 if group % 2 else torch.float32
    ctxs = [0, block_size - 1, block_size, block_size + 1, 3 * block_size]
    news = [7, 1, block_size + 2, 4, 2]
    args = _case(dtype, 64, 2 * group, 2, block_size, ctxs, news, seed=group)
    _check(_run(args, scale=0.2), _ref(args, 0.2), dtype)


@pytest.mark.parametrize("window", [1, 4, 20, 10_000])
@pytest.mark.parametrize("alibi", [False, True])
def test_sliding_window_and_alibi(window, alibi, path):
    args = _case(torch.float32, 64, 4, 2, 8, [0, 30, 50], [12, 9, 25], seed=window)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625]) if alibi else None
    out = _run(args, sliding_window=window, alibi_slopes=slopes)
    # With ALiBi the window is ignored, as vLLM's own ALiBi kernels do (prefix.alibi_window).
    ref = _ref(args, 0.125, sliding_window=None if alibi else window, alibi_slopes=slopes)
    _check(out, ref, torch.float32)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
def test_fp8_context(kv_cache_dtype, path):
    if not fp8_available(kv_cache_dtype):
        pytest.skip("torch has no float8 dtypes")
    args = _case(torch.bfloat16, 64, 4, 2, 16, CONTEXTS, NEWS, kv_cache_dtype=kv_cache_dtype)
    out = _run(args, kv_cache_dtype=kv_cache_dtype, k_scale=torch.tensor([0.5]), v_scale=2.0)
    ref = _ref(args, 0.125, kv_cache_dtype=kv_cache_dtype, k_scale=0.5, v_scale=2.0)
    torch.testing.assert_close(out.double(), ref, atol=6e-2, rtol=0)


def test_small_budget_tiles_queries_and_keys(formulation, force):
    # 1 MiB forces several query chunks and key groups; the answer must not change.
    force(path="tiled")
    args = _case(torch.float32, 64, 8, 2, 16, [240, 0, 33], [160, 40, 1], seed=5)
    work = work_dtype(torch.float32, torch.device("cpu"))
    til = _prefix_plan.tiling(8, 2, 64, 16, work, 1 << 20)
    assert til.group_keys < 400
    assert til.tile_of(240)[1] < 160  # absolute query tiles: several here
    ref = _ref(args, 0.1, sliding_window=300)
    _check(_run(args, scale=0.1, sliding_window=300, budget_mb=1), ref, torch.float32)
    _check(_run(args, scale=0.1, sliding_window=300, budget_mb=256), ref, torch.float32)


def test_budget_default_is_256_mib_and_the_environment_is_not_read(monkeypatch):
    seen = []
    real = prefix.attend

    def spy(*a, **kw):
        seen.append(a[2])
        return real(*a, **kw)

    monkeypatch.setattr(prefix, "attend", spy)
    monkeypatch.setenv("VLLM_BI100_PREFIX_BUDGET_MB", "3")  # the shim's setting, not the kernel's
    args = _case(torch.float32, 64, 4, 2, 16, [20], [5])
    _run(args)
    _run(args, budget_mb=3)
    assert prefix.DEFAULT_BUDGET_MB == 256
    assert seen == [256 << 20, 3 << 20]


@pytest.mark.parametrize("budget_mb", [4, 16])
def test_peak_memory_under_budget_and_flat_in_context(budget_mb, force):
    # The tiled path; the SDPA path's memory grows with the context (next test).
    force(path="tiled")
    peaks = []
    for ctx in (2400, 4800):
        args = _case(torch.bfloat16, 128, 8, 2, 16, [ctx], [128], seed=ctx)
        with PeakMemory() as mem:
            out = _run(args, budget_mb=budget_mb)
        extra = mem.peak_bytes - out.untyped_storage().nbytes()
        assert extra <= budget_mb << 20, (ctx, extra)
        peaks.append(extra)
    # Independent of the context length (same tiles, more of them).
    assert peaks[1] <= peaks[0] * 1.25 + (64 << 10)


@pytest.mark.parametrize("alibi", [False, True])
def test_inputs_unmodified(alibi, path):
    args = _case(torch.float32, 64, 4, 2, 16, CONTEXTS, NEWS, seed=11)
    slopes = torch.rand(4) if alibi else None
    before = [t.clone() for t in args] + [None if slopes is None else slopes.clone()]
    _run(args, scale=0.3, alibi_slopes=slopes, sliding_window=7)
    for a, b in zip(list(args) + [slopes], before):
        assert a is None and b is None or torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_window_one_and_empty_context(dtype, path):
    # Window 1: each query sees only itself (its row is never fully masked, no NaN).
    args = _case(dtype, 64, 4, 2, 16, [0, 20, 0], [6, 5, 1], seed=3)
    for window in (1, None):
        out = _run(args, sliding_window=window)
        assert not out.isnan().any()
        _check(out, _ref(args, 0.125, sliding_window=window), dtype)
    out = _run(args, sliding_window=1)
    v = args[2].repeat_interleave(2, dim=1)  # query head h reads kv head h // 2
    torch.testing.assert_close(out.double(), v.double(), atol=ATOL[dtype], rtol=0)


@pytest.mark.skipif(_prefix_plan._TORCH_RELEASE < _prefix_plan.SDPA_MIN_TORCH,
                    reason="the SDPA path's memory model holds for the verified torch only")
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_sdpa_path_chosen_per_tile_and_accounted(kv_cache_dtype, monkeypatch):
    """The SDPA path takes the rows whose absolute query tile ends where its K/V fit the
    budget (``sdpa_max_end``), within the estimate; the rest, and ALiBi, take the tiled path."""
    if kv_cache_dtype != "auto" and not fp8_available(kv_cache_dtype):
        pytest.skip("torch has no float8 dtypes")
    rows = {"sdpa": 0, "tiled": 0}
    real_sdpa, real_run = _attend.sdpa_rows, _attend.TiledRunner.run

    def sdpa_spy(inp, seq, n, out, *rest):
        rows["sdpa"] += n
        return real_sdpa(inp, seq, n, out, *rest)

    def run_spy(self, seq, out, i0=0, i1=-1, dest=None):
        rows["tiled"] += (seq.q_len if i1 < 0 else i1) - i0
        return real_run(self, seq, out, i0, i1, dest)

    monkeypatch.setattr(_attend, "sdpa_rows", sdpa_spy)
    monkeypatch.setattr(_attend.TiledRunner, "run", run_spy)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)  # SDPA scratch is per thread
    args = _case(torch.bfloat16, 128, 8, 2, 16, [2400], [600], seed=1,
                 kv_cache_dtype=kv_cache_dtype)
    kw = {} if kv_cache_dtype == "auto" else {"kv_cache_dtype": kv_cache_dtype,
                                               "k_scale": 0.5, "v_scale": 2.0}
    end = _prefix_plan.sdpa_max_end(8, 2, 128, 2, 2, 9 << 20)
    assert 2400 < end < 3000  # the tiles ending at 2560 and 2816 fit 9 MiB, 3072 not
    with PeakMemory() as mem:
        out = _run(args, budget_mb=9, **kw)
    assert rows == {"sdpa": end - 2400, "tiled": 3000 - end}
    extra = mem.peak_bytes - out.untyped_storage().nbytes()
    assert extra <= 9 << 20
    rows.update(sdpa=0, tiled=0)
    _run(args, budget_mb=2, **kw)  # the gathered K/V (2.9 MiB) do not fit: tiled
    assert rows == {"sdpa": 0, "tiled": 600}
    rows.update(sdpa=0, tiled=0)
    _run(args, alibi_slopes=torch.rand(8), **kw)  # ALiBi: always tiled
    assert rows == {"sdpa": 0, "tiled": 600}


def test_sdpa_path_only_on_cpu_for_fast_dtypes_and_verified_torch(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.setattr(_prefix_plan, "_TORCH_RELEASE", _prefix_plan.SDPA_MIN_TORCH)
    assert prefix.sdpa_path_ok(torch.float32, cpu) and prefix.sdpa_path_ok(torch.bfloat16, cpu)
    assert not prefix.sdpa_path_ok(torch.float16, cpu)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        assert not prefix.sdpa_path_ok(dtype, cuda)  # fused GPU attention: the BI-V100 hang class
    monkeypatch.setattr(_prefix_plan, "_TORCH_RELEASE", (2, 8))
    assert not prefix.sdpa_path_ok(torch.float32, cpu)


def test_empty_batch_and_padding_rows():
    args = list(_case(torch.float32, 64, 4, 2, 16, [3], [4]))
    q, k, v = (torch.cat([t, torch.ones_like(t[:2])]) for t in args[:3])  # 2 padding rows
    out = paged_prefix(q, k, v, *args[3:])
    assert out.shape == q.shape and not out[4:].any()
    empty = paged_prefix(q, k, v, args[3], args[4], args[5][:0], torch.zeros(1, dtype=torch.int32),
                         args[7][:0], args[8][:0])
    assert not empty.any()


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda a: a.__setitem__(7, a[7] + 1), r"seq_lens\[0\]=26 must equal context_lens\[0\]=20"),
        (lambda a: a.__setitem__(5, a[5][:, :1]),
         r"block_tables too short: context_lens\[0\]=20 needs 2 blocks"),
        (lambda a: a.__setitem__(1, a[1][:, :1]), r"key must have shape \(11, 2, 64\)"),
        (lambda a: a.__setitem__(2, a[2].double()), r"value dtype torch.float64 != query dtype"),
        (lambda a: a.__setitem__(6, torch.tensor([0, 5, 99], dtype=torch.int32)),
         r"query_start_loc must be non-decreasing within \[0, 11\]"),
        (lambda a: a.__setitem__(0, a[0][:, :3]), r"num_heads 3 .* multiple of num_kv_heads 2"),
        (lambda a: a[5].__setitem__((1, 0), -1), r"block_tables\[1, 0\] = -1 is out of range"),
    ],
)
def test_value_errors(mutate, match):
    args = list(_case(torch.float32, 64, 4, 2, 16, [20, 40], [5, 6]))
    args[5] = args[5].clone()
    mutate(args)
    with pytest.raises(ValueError, match=match):
        paged_prefix(*args)


def test_budget_and_window_errors():
    args = _case(torch.float32, 64, 4, 2, 16, [20], [5])
    with pytest.raises(ValueError, match="sliding_window must be >= 1"):
        paged_prefix(*args, sliding_window=0)
    with pytest.raises(ValueError, match="budget_mb must be >= 1"):
        paged_prefix(*args, budget_mb=0)


@settings(max_examples=20, deadline=None)
@given(
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    kv_heads=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 3]),
    block_size=st.sampled_from([8, 16]),
    seqs=st.lists(st.tuples(st.integers(0, 60), st.integers(0, 20)), min_size=1, max_size=4),
    window=st.one_of(st.none(), st.integers(1, 70)),
    use_alibi=st.booleans(),
    forced_path=st.sampled_from(["sdpa", "tiled"]),
    seed=st.integers(0, 2**16),
)
def test_property_matches_reference(dtype, kv_heads, group, block_size, seqs, window,
                                    use_alibi, forced_path, seed):
    with forced(path=forced_path):
        _property_case(dtype, kv_heads, group, block_size, seqs, window, use_alibi, seed)


def _property_case(dtype, kv_heads, group, block_size, seqs, window, use_alibi, seed):
    contexts = [c for c, _ in seqs]
    news = [n for _, n in seqs]
    args = _case(dtype, 32, kv_heads * group, kv_heads, block_size, contexts, news, seed=seed)
    slopes = torch.rand(kv_heads * group) if use_alibi else None
    out = _run(args, sliding_window=window, alibi_slopes=slopes)
    ref = _ref(args, 32 ** -0.5, sliding_window=None if use_alibi else window,
               alibi_slopes=slopes)
    _check(out, ref, dtype)


def test_decreasing_query_start_loc_is_named_before_seq_lens():
    """[0, 10, 5]: sequence 0 would get 10 tokens (its seq_lens says 5), sequence 1 minus 5;
    the error is about query_start_loc, not a seq_lens mismatch."""
    args = list(_case(torch.float32, 64, 4, 2, 16, [20, 3], [5, 5]))
    args[6] = torch.tensor([0, 10, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"query_start_loc must be non-decreasing.*\[0, 10, 5\]"):
        paged_prefix(*args)


def test_stats_report_paths_tokens_and_context(path):
    """What a call did, as the patch layer counts it (metrics): per path, the sequences with
    new tokens, their new tokens and their cached context; a sequence without new tokens is
    not attended and not counted."""
    contexts, news = [0, 17, 40, 5], [5, 3, 9, 0]
    stats = prefix.PrefixStats()
    _run(_case(torch.float32, 64, 4, 2, 16, contexts, news), stats=stats)
    other = "tiled" if path == "sdpa" else "sdpa"
    assert stats.sequences == {path: 3, other: 0}
    assert stats.tokens == {path: 17, other: 0} and stats.context == {path: 57, other: 0}
    assert stats.fp32_reruns == 0 and stats.path == path


def test_stats_path_names_a_mixed_call():
    stats = prefix.PrefixStats()
    assert stats.path == "none"
    stats.sequences.update(sdpa=1, tiled=2)
    assert stats.path == "mixed"

"""paged_decode against a dense float64 reference over a grid of shapes and options."""

from __future__ import annotations

import math
import sys

import pytest
import torch
from helpers.reference import fp8_available, make_cache, make_tables, ref_decode
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from tools.memtrack import PeakMemory

from vllm_bi100_patch.attention.kernels.cache import check_cache
from vllm_bi100_patch.attention.kernels import decode as decode_mod
from vllm_bi100_patch.attention.kernels import paged_decode
from vllm_bi100_patch.attention.kernels.decode import _device

ATOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def _case(dtype, head_size, heads, kv_heads, block_size, lens, *, seed=0, kv_cache_dtype="auto",
          extra_blocks=3, width=None, pad=0):
    g = torch.Generator().manual_seed(seed)
    need = sum(math.ceil(n / block_size) for n in lens)
    num_blocks = need + extra_blocks
    kc, vc = make_cache(num_blocks, kv_heads, head_size, block_size, dtype, kv_cache_dtype, g)
    width = width or max([1] + [math.ceil(n / block_size) for n in lens])
    bt = make_tables(lens, block_size, width, num_blocks, g, pad=pad)
    q = torch.randn(len(lens), heads, head_size, generator=g).to(dtype)
    sl = torch.tensor(lens, dtype=torch.int32)
    return q, kc, vc, bt, sl


def _check(out, ref, dtype):
    assert out.dtype == dtype
    torch.testing.assert_close(out.to(torch.float64), ref, atol=ATOL[dtype], rtol=0)


def _lens(block_size):
    return [0, 1, block_size - 1, block_size, block_size + 1, 3 * block_size + 5]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_size", [64, 80, 96, 128, 256])
def test_dtypes_head_sizes(dtype, head_size, formulation):
    q, kc, vc, bt, sl = _case(dtype, head_size, 4, 2, 16, _lens(16))
    out = paged_decode(q, kc, vc, bt, sl, head_size ** -0.5)
    _check(out, ref_decode(q, kc, vc, bt, sl, head_size ** -0.5), dtype)


@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_gqa_block_sizes(group, block_size, formulation):
    dtype = torch.bfloat16 if group % 2 else torch.float32
    q, kc, vc, bt, sl = _case(dtype, 64, 2 * group, 2, block_size, _lens(block_size), seed=group)
    out = paged_decode(q, kc, vc, bt, sl, 0.11)
    _check(out, ref_decode(q, kc, vc, bt, sl, 0.11), dtype)


def test_long_context_many_tiles(formulation):
    # 2100 tokens: several 512-token tiles plus a ragged shorter neighbour.
    lens = [2100, 700, 0]
    q, kc, vc, bt, sl = _case(torch.float32, 64, 4, 1, 16, lens, seed=3)
    out = paged_decode(q, kc, vc, bt, sl, 0.125)
    _check(out, ref_decode(q, kc, vc, bt, sl, 0.125), torch.float32)


def test_alibi(formulation):
    q, kc, vc, bt, sl = _case(torch.float32, 64, 8, 2, 16, _lens(16) + [600], seed=4)
    slopes = torch.tensor([2.0 ** -(i + 1) for i in range(8)])
    out = paged_decode(q, kc, vc, bt, sl, 0.125, alibi_slopes=slopes)
    _check(out, ref_decode(q, kc, vc, bt, sl, 0.125, alibi_slopes=slopes), torch.float32)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tensor_scales", [False, True])
def test_fp8_cache(kv_cache_dtype, dtype, tensor_scales, formulation):
    if not fp8_available(kv_cache_dtype):
        pytest.skip("torch has no float8 dtypes")
    q, kc, vc, bt, sl = _case(dtype, 64, 4, 2, 16, _lens(16), kv_cache_dtype=kv_cache_dtype)
    assert kc.dtype == torch.uint8 and kc.shape[-1] == 16
    k_scale, v_scale = 0.5, 3.0
    ks = torch.tensor(k_scale) if tensor_scales else k_scale
    vs = torch.tensor([v_scale]) if tensor_scales else v_scale
    out = paged_decode(q, kc, vc, bt, sl, 0.125, kv_cache_dtype=kv_cache_dtype, k_scale=ks,
                       v_scale=vs)
    ref = ref_decode(q, kc, vc, bt, sl, 0.125, kv_cache_dtype=kv_cache_dtype, k_scale=k_scale,
                     v_scale=v_scale)
    torch.testing.assert_close(out.double(), ref, atol=3 * ATOL[dtype] * v_scale, rtol=0)


def test_auto_ignores_scales():
    # vLLM applies k_scale/v_scale only to fp8 caches.
    q, kc, vc, bt, sl = _case(torch.float32, 64, 4, 2, 16, _lens(16))
    a = paged_decode(q, kc, vc, bt, sl, 0.1)
    b = paged_decode(q, kc, vc, bt, sl, 0.1, k_scale=2.0, v_scale=torch.tensor(3.0))
    torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_max_seq_len_and_garbage_padding(formulation):
    # Table wider than needed, padded with ids that do not exist: the padding is never read.
    lens = [5, 40, 17]
    q, kc, vc, bt, sl = _case(torch.float32, 64, 4, 2, 8, lens, width=12, pad=10_000)
    ref = ref_decode(q, kc, vc, bt, sl, 0.1)
    _check(paged_decode(q, kc, vc, bt, sl, 0.1), ref, torch.float32)
    _check(paged_decode(q, kc, vc, bt, sl, 0.1, max_seq_len=40), ref, torch.float32)
    _check(paged_decode(q, kc, vc, bt, sl, 0.1, max_seq_len=96), ref, torch.float32)
    # An inflated bound (CUDA-graph max_seq_len_to_capture) is capped at the table width.
    _check(paged_decode(q, kc, vc, bt, sl, 0.1, max_seq_len=8192), ref, torch.float32)


def test_all_empty_and_no_sequences():
    q, kc, vc, bt, sl = _case(torch.bfloat16, 64, 4, 2, 16, [0, 0])
    out = paged_decode(q, kc, vc, bt, sl, 0.1)
    assert out.shape == q.shape and out.dtype == q.dtype and not out.any()
    out = paged_decode(q, kc, vc, bt, sl, 0.1, max_seq_len=0)
    assert not out.any()
    empty = paged_decode(q[:0], kc, vc, bt[:0], sl[:0], 0.1)
    assert empty.shape == (0, 4, 64)


def test_inputs_unmodified():
    q, kc, vc, bt, sl = _case(torch.float32, 64, 4, 2, 16, _lens(16), seed=9)
    slopes = torch.rand(4)
    ks = torch.tensor(2.0)
    before = [t.clone() for t in (q, kc, vc, bt, sl, slopes, ks)]
    paged_decode(q, kc, vc, bt, sl, 0.3, alibi_slopes=slopes, k_scale=ks, v_scale=ks)
    for a, b in zip((q, kc, vc, bt, sl, slopes, ks), before):
        assert torch.equal(a, b)


def test_output_is_not_an_alias_and_noncontiguous_query():
    q, kc, vc, bt, sl = _case(torch.float32, 64, 4, 2, 16, _lens(16))
    qt = q.transpose(0, 1).contiguous().transpose(0, 1)  # same values, other strides
    out = paged_decode(qt, kc, vc, bt, sl, 0.1)
    _check(out, ref_decode(q, kc, vc, bt, sl, 0.1), torch.float32)
    assert out.data_ptr() != qt.data_ptr()


class _OpLog(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _meta(*tensors):
    return [t.to("meta") for t in tensors]


def test_no_host_sync_on_device_tensors():
    # Meta tensors have no data: any .item()/.tolist()/bool-mask indexing would raise.
    q, kc, vc, bt, sl = _meta(*_case(torch.bfloat16, 128, 8, 2, 16, _lens(16)))
    out = paged_decode(q, kc, vc, bt, sl, 0.1, alibi_slopes=torch.rand(8, device="meta"),
                       max_seq_len=60)
    assert out.shape == q.shape and out.device.type == "meta"


def _python_calls(fn):
    """Python-level calls (functions and builtins/torch C functions) made while running fn."""
    events = []

    def prof(frame, event, arg):
        if event in ("call", "c_call"):
            events.append(event)

    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return len(events)


@pytest.mark.parametrize("path", ["cpu", "gpu"])
def test_call_count_independent_of_num_seqs(path, force):
    """While one pass fits the budget, the Python-level work of a call does not grow with
    the number of sequences, each cache is gathered once, and on the device path the op
    sequence is the same (on CPU a reshape may be a view for one sequence)."""
    layout, compute = {"cpu": ("fast", "fp32"), "gpu": ("generic", "native")}[path]
    force(layout=layout, compute=compute)
    counts, ops = [], []
    for num_seqs in (1, 16):
        q, kc, vc, bt, sl = _case(torch.float32, 64, 4, 2, 16, [400] * num_seqs)
        plan = decode_mod.plan_decode(q, check_cache(kc, vc, q.dtype, "auto"), 400)
        assert plan.seq_group == num_seqs  # one pass: every tile at once (one chunk)
        assert plan.chunk == plan.tiles if path == "cpu" else num_seqs * plan.tiles <= plan.chunk
        counts.append(_python_calls(
            lambda a=(q, kc, vc, bt, sl): paged_decode(*a, 0.1, max_seq_len=400)))
        with _OpLog() as log:
            paged_decode(q, kc, vc, bt, sl, 0.1, max_seq_len=400)
        gathers = [op for op in log.ops if "index_select" in op or "aten.index." in op]
        assert len(gathers) == 2, gathers  # K and V, once each
        ops.append(log.ops)
    assert counts[0] == counts[1]
    if path == "gpu":
        assert ops[0] == ops[1]


@pytest.mark.parametrize("path", ["cpu", "gpu"])
def test_plan_bounded_for_huge_batches(path, force):
    """4,096 sequences over 32,768 positions (8 KV heads of 128, bf16): the plan's passes
    keep the working set under the budget (groups of sequences, one tile per pass at
    worst on CPUs; on devices the products' chunk is the same as for one sequence), with
    the same fixed tile as a single sequence."""
    layout, compute = {"cpu": ("fast", "fp32"), "gpu": ("generic", "native")}[path]
    force(layout=layout, compute=compute)
    q = torch.empty(4096, 32, 128, dtype=torch.bfloat16, device="meta")
    kc = torch.empty(4096 * 2048, 8, 16, 16, 8, dtype=torch.bfloat16, device="meta")
    vc = torch.empty(4096 * 2048, 8, 128, 16, dtype=torch.bfloat16, device="meta")
    spec = check_cache(kc, vc, q.dtype, "auto")
    huge = decode_mod.plan_decode(q, spec, 32768, 256)
    alone = decode_mod.plan_decode(q[:1], spec, 32768, 256)
    assert huge.tile == alone.tile and huge.tiles == alone.tiles == 32768 // huge.tile
    assert 1 <= huge.seq_group < 4096, huge
    if path == "cpu":
        assert huge.seq_group * huge.chunk * huge.tile * 8 * 128 * 4 <= 256 << 20, huge
    else:
        assert huge.chunk == alone.chunk, (huge, alone)
        assert _device.working_set(huge.seq_group, 32, spec, 32768, torch.bfloat16) <= 256 << 20


@pytest.mark.parametrize("path", ["cpu", "gpu"])
@pytest.mark.parametrize("budget_mb", [2, 8])
def test_peak_memory_under_budget(path, budget_mb, force):
    """The working set of a call (tools.memtrack, besides the output) stays under
    ``budget_mb`` whatever the context, and the answer does not depend on the budget (the
    device path's budgets here: its minimum working set, the products' chunk and one
    sequence, plus 2 or 8 MiB: ``test_memory_budget.py`` holds the rest)."""
    layout, compute = {"cpu": ("fast", "fp32"), "gpu": ("generic", "native")}[path]
    force(layout=layout, compute=compute)
    q, kc, vc, bt, sl = _case(torch.bfloat16, 128, 8, 4, 16, [6000, 3000, 17, 0], seed=2)
    if path == "gpu":
        spec = check_cache(kc, vc, q.dtype, "auto")
        budget_mb += decode_mod.minimum_working_set(q, spec, bt.shape[1] * 16) >> 20
    with PeakMemory() as mem:
        out = paged_decode(q, kc, vc, bt, sl, 0.1, budget_mb=budget_mb)
    assert mem.peak_bytes - out.untyped_storage().nbytes() <= budget_mb << 20
    assert torch.equal(out, paged_decode(q, kc, vc, bt, sl, 0.1))


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda a: a.update(q=a["q"][:, :, :32]), r"head_size 32 does not match the cache head_size 64"),
        (lambda a: a.update(q=a["q"][:, :3]), r"num_heads 3 .* multiple of num_kv_heads 2"),
        (lambda a: a.update(sl=a["sl"][:2]), r"seq_lens must have shape \[6\], got \(2,\)"),
        (lambda a: a.update(bt=a["bt"][:, :1]), r"block_tables too short: seq_lens max 53"),
        (lambda a: a.update(bt=a["bt"][:, :3], kw={"max_seq_len": 100}),
         r"block_tables too short: seq_lens max 53 needs 4 blocks of 16, block_tables has 3"),
        (lambda a: a.update(kw={"max_seq_len": 20}), r"seq_lens max 53 exceeds max_seq_len=20"),
        (lambda a: a.update(q=a["q"].half()), r"kv_cache_dtype='auto' .* key_cache is torch.float32"),
        (lambda a: a.update(kw={"kv_cache_dtype": "int8"}), r"kv_cache_dtype='int8' is not supported"),
        (lambda a: a.update(kc=a["kc"].view(*a["kc"].shape[:4], 2, 2)),
         r"key_cache must be 5-D"),
        (lambda a: a.update(kc=a["kc"].reshape(a["kc"].shape[0], 2, 8, 16, 8)),
         r"key_cache last dim x=8 but 16 // element_size = 4"),
        (lambda a: a.update(vc=a["vc"][:, :, :, :8]), r"value_cache shape .* does not match"),
        (lambda a: a.update(kw={"alibi_slopes": torch.ones(3)}), r"alibi_slopes must have shape \[4\]"),
        (lambda a: a.update(bt=a["bt"].float()), r"block_tables must be an integer tensor"),
        (lambda a: a["bt"].__setitem__((1, 0), 999), r"block_tables\[1, 0\] = 999 is out of range"),
    ],
)
def test_value_errors(mutate, match):
    q, kc, vc, bt, sl = _case(torch.float32, 64, 4, 2, 16, _lens(16))
    args = {"q": q, "kc": kc, "vc": vc, "bt": bt.clone(), "sl": sl, "kw": {}}
    mutate(args)
    with pytest.raises(ValueError, match=match):
        paged_decode(args["q"], args["kc"], args["vc"], args["bt"], args["sl"], 0.1, **args["kw"])


@settings(max_examples=25, deadline=None)
@given(
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    kv_heads=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 2, 4]),
    head_size=st.sampled_from([32, 64]),
    block_size=st.sampled_from([8, 16, 32]),
    lens=st.lists(st.integers(0, 90), min_size=1, max_size=5),
    use_alibi=st.booleans(),
    tight=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_property_matches_reference(dtype, kv_heads, group, head_size, block_size, lens,
                                    use_alibi, tight, seed):
    q, kc, vc, bt, sl = _case(dtype, head_size, kv_heads * group, kv_heads, block_size, lens,
                              seed=seed, width=None if tight else 13)
    slopes = torch.rand(kv_heads * group) if use_alibi else None
    out = paged_decode(q, kc, vc, bt, sl, head_size ** -0.5, alibi_slopes=slopes,
                       max_seq_len=max(lens) if tight else None)
    _check(out, ref_decode(q, kc, vc, bt, sl, head_size ** -0.5, alibi_slopes=slopes), dtype)

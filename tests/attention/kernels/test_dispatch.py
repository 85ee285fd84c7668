"""Decode routing with a fake ops module: native V1/V2 versus fallback, guards, scratch."""

from __future__ import annotations

import types

import pytest
import torch
from helpers.reference import make_cache, make_tables, ref_decode

from helpers import native_decode

from vllm_bi100_patch.attention.native import decoder as dispatch
from vllm_bi100_patch.attention.native import longest
from vllm_bi100_patch.attention.native import routes
from vllm_bi100_patch.attention.native.routes import Routing as DecodeRouting

TAIL = (0, 0, 0, 64, 0)  # tp_rank, blocksparse_local_blocks, vert_stride, block_size, step


class FakeOps:
    """Records calls; fills ``out`` with a value that identifies the kernel."""

    def __init__(self):
        self.calls = []

    def paged_attention_v1(self, out, *args):
        self.calls.append(("v1", args))
        out.fill_(1.0)

    def paged_attention_v2(self, out, exp_sums, max_logits, tmp_out, *args):
        self.calls.append(("v2", (exp_sums, max_logits, tmp_out) + args))
        assert exp_sums.dtype == max_logits.dtype == torch.float32
        assert tmp_out.dtype == out.dtype
        exp_sums.fill_(3.0)
        max_logits.fill_(4.0)
        tmp_out.fill_(5.0)
        out.fill_(2.0)


@pytest.fixture(autouse=True)
def _clean():
    dispatch.reset_route_counts()
    dispatch.SCRATCH.clear()
    longest.forget()
    native_decode.forget()
    yield
    dispatch.SCRATCH.clear()
    native_decode.forget()


def _inputs(num_seqs=2, heads=4, head_size=64, lens=(5, 30), block_size=16, dtype=torch.float32,
            device="cpu"):
    g = torch.Generator().manual_seed(0)
    lens = list(lens)[:num_seqs] + [1] * max(0, num_seqs - len(lens))
    kc, vc = make_cache(sum(-(-n // block_size) for n in lens) + 1, 2, head_size, block_size,
                        dtype, gen=g)
    bt = make_tables(lens, block_size, max(1, max(-(-n // block_size) for n in lens)),
                     kc.shape[0], g)
    q = torch.randn(num_seqs, heads, head_size, generator=g).to(dtype)
    sl = torch.tensor(lens, dtype=torch.int32)
    return [t.to(device) for t in (q, kc, vc, bt, sl)]


DEFAULT_ROUTING = DecodeRouting()


def _decode(inputs, max_seq_len, *, ops, routing=DEFAULT_ROUTING, scale_args=(1.0, 1.0),
            tail=TAIL, alibi=None):
    q, kc, vc, bt, sl = inputs
    k_scale, v_scale = scale_args if len(scale_args) == 2 else scale_args * 2
    names = ("tp_rank", "blocksparse_local_blocks", "blocksparse_vert_stride",
             "blocksparse_block_size", "blocksparse_head_sliding_step")
    return native_decode.decode(q, kc, vc, bt, sl, max_seq_len, "auto", 2, 0.125, alibi,
                           k_scale=k_scale, v_scale=v_scale, **dict(zip(names, tail)),
                           ops=ops, routing=routing)


def test_v1_for_single_partition_and_args_passed_through():
    ops = FakeOps()
    inputs = _inputs()
    out = _decode(inputs, 30, ops=ops, scale_args=(0.5, 0.25))
    assert torch.all(out == 1.0) and out.shape == inputs[0].shape
    kind, args = ops.calls[0]
    assert kind == "v1"
    q, kc, vc, bt, sl = inputs
    assert args[0] is q and args[1] is kc and args[2] is vc and args[3] == 2 and args[4] == 0.125
    assert args[5] is bt and args[6] is sl and args[7] == 16 and args[8] == 30
    assert args[9] is None and args[10] == "auto" and args[11:] == (0.5, 0.25) + TAIL
    assert dispatch.route_counts() == {"native_v1": 1, "native_v2": 0, "fallback": 0}


def test_v2_occupancy_rule_and_shapes():
    ops = FakeOps()
    inputs = _inputs(num_seqs=2, heads=4)  # 8 CTAs < 80: partitioning pays
    _decode(inputs, 4000, ops=ops, scale_args=(0.7,))
    kind, args = ops.calls[0]
    assert kind == "v2"
    exp_sums, max_logits, tmp_out = args[:3]
    assert exp_sums.shape == max_logits.shape == (2, 4, 8)  # ceil(4000 / 512)
    assert tmp_out.shape == (2, 4, 8, 64)
    assert args[3 + 8] == 4000 and args[3 + 11:] == (0.7, 0.7) + TAIL
    # Enough sequences x heads to fill 80 CTAs: V1 even with several partitions.
    ops2 = FakeOps()
    _decode(_inputs(num_seqs=20, heads=4), 4000, ops=ops2)
    assert ops2.calls[0][0] == "v1"


@pytest.mark.parametrize("max_seq_len, num_seqs, heads, expect", [
    (512, 1, 4, True),      # one partition
    (513, 1, 4, False),     # two partitions, 4 CTAs
    (8192, 40, 2, True),    # 80 CTAs fill the device
    (8193, 40, 2, False),   # shared-memory guard
    (100_000, 512, 32, False),
    (0, 1, 1, True),
])
def test_use_v1_rule(max_seq_len, num_seqs, heads, expect):
    assert routes.use_v1(num_seqs, heads, max_seq_len, DecodeRouting(), 8192) is expect


def test_smem_guard_never_v1_above_limit():
    ops = FakeOps()
    _decode(_inputs(num_seqs=64, heads=4), 9000, ops=ops)  # 256 CTAs >= 80, but 9000 > 8192
    assert ops.calls[0][0] == "v2"
    routing = DecodeRouting(sm_count=1000)
    assert not routes.use_v1(1, 1, 8193, routing, routes.v1_limit(routing, "stock"))


def test_fallback_without_ops_matches_reference():
    inputs = _inputs()
    out = _decode(inputs, 30, ops=None, alibi=torch.rand(4))
    q, kc, vc, bt, sl = inputs
    ref = ref_decode(q, kc, vc, bt, sl, 0.125, alibi_slopes=None)
    assert dispatch.route_counts()["fallback"] == 1
    assert not torch.allclose(out.double(), ref)  # alibi was applied
    out = _decode(inputs, 30, ops=None)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=0)


def test_fallback_for_unsupported_head_size():
    ops = FakeOps()
    out = _decode(_inputs(head_size=32), 30, ops=ops)
    assert ops.calls == [] and dispatch.route_counts()["fallback"] == 1
    assert not torch.all(out == 1.0)


def test_kv_scale_one_tuple_used_for_k_and_v(monkeypatch):
    seen = {}

    def fake_paged_decode(*args, **kw):
        seen.update(kw)
        return torch.zeros_like(args[0])

    monkeypatch.setattr(dispatch, "paged_decode", fake_paged_decode)
    _decode(_inputs(), 30, ops=None, scale_args=(0.3, 0.4))
    assert seen["k_scale"] == 0.3 and seen["v_scale"] == 0.4 and seen["max_seq_len"] == 30


def test_fallback_above_zero_always_falls_back():
    ops = FakeOps()
    _decode(_inputs(), 30, ops=ops, routing=DecodeRouting(fallback_above=0))
    assert ops.calls == [] and dispatch.route_counts()["fallback"] == 1


def test_fallback_above_uses_actual_longest_on_cpu():
    ops = FakeOps()
    routing = DecodeRouting(fallback_above=20)
    inputs = _inputs(lens=(5, 18))
    _decode(inputs, 4096, ops=ops, routing=routing)  # max_seq_len inflated, actual 18
    assert [c[0] for c in ops.calls] == ["v2"]
    inputs = _inputs(lens=(5, 21))
    _decode(inputs, 4096, ops=ops, routing=routing)
    assert dispatch.route_counts() == {"native_v1": 0, "native_v2": 1, "fallback": 1}


def test_blocksparse_never_silently_falls_back():
    tail = (0, 16, 8, 64, 1)
    with pytest.raises(NotImplementedError, match="blocksparse.*no native ops"):
        _decode(_inputs(), 30, ops=None, tail=tail)
    with pytest.raises(NotImplementedError, match="fallback_above=0"):
        _decode(_inputs(), 30, ops=FakeOps(), tail=tail, routing=DecodeRouting(fallback_above=0))
    ops = FakeOps()
    _decode(_inputs(), 30, ops=ops, tail=tail)  # native handles it
    assert ops.calls[0][1][-5:] == tail


def test_v2_only_with_a_partition_that_is_a_multiple_of_block_size():
    ops = FakeOps()
    routing = DecodeRouting(partition_size=500)
    _decode(_inputs(), 4000, ops=ops, routing=routing)  # V2 unusable: V1 while it is safe
    _decode(_inputs(), 9000, ops=ops, routing=routing)  # above V1's limit: fallback
    assert [c[0] for c in ops.calls] == ["v1"]
    assert dispatch.route_counts() == {"native_v1": 1, "native_v2": 0, "fallback": 1}


def _meta_inputs():
    return _inputs(device="meta")


def test_graph_capture_never_syncs(monkeypatch):
    # Device tensors (meta: no data at all) while "capturing": routing must use max_seq_len.
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)

    def no_sync(seq_lens):
        raise AssertionError("host sync during graph capture")

    monkeypatch.setattr(longest, "_read_longest", no_sync)
    ops = FakeOps()
    routing = DecodeRouting(fallback_above=1000)
    _decode(_meta_inputs(), 4096, ops=ops, routing=routing)  # bound 4096 > 1000: fallback
    assert dispatch.route_counts()["fallback"] == 1 and ops.calls == []
    _decode(_meta_inputs(), 900, ops=ops, routing=routing)  # bound within threshold: native
    assert ops.calls[0][0] == "v2"


def test_eager_device_syncs_once_per_seq_lens_version(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    reads = []

    def read(seq_lens):
        reads.append(seq_lens)
        return 500

    monkeypatch.setattr(longest, "_read_longest", read)
    ops = FakeOps()
    routing = DecodeRouting(fallback_above=1000)
    inputs = _meta_inputs()
    for _layer in range(4):
        _decode(inputs, 4096, ops=ops, routing=routing)
    assert len(reads) == 1 and len(ops.calls) == 4  # actual 500 <= 1000: native
    inputs[4].add_(1)  # next step updates seq_lens in place: a new version
    _decode(inputs, 4096, ops=ops, routing=routing)
    assert len(reads) == 2
    _decode(inputs, 900, ops=ops, routing=routing)  # bound within threshold: no read
    assert len(reads) == 2


def test_scratch_is_bounded_by_largest_need():
    ops = FakeOps()
    largest_stats = largest_tmp = total_needs = 0
    for num_seqs, max_len in [(2, 1000), (1, 4000), (3, 2000), (2, 9000), (1, 600), (3, 9000),
                              (2, 3000)] * 3:
        _decode(_inputs(num_seqs=num_seqs, lens=(5, 30, 7)), max_len, ops=ops)
        parts = -(-max_len // 512)
        need_stats = 2 * num_seqs * 4 * parts * 4
        need_tmp = num_seqs * 4 * parts * 64 * 4
        largest_stats = max(largest_stats, need_stats)
        largest_tmp = max(largest_tmp, need_tmp)
        total_needs += need_stats + need_tmp
        assert dispatch.scratch_bytes() == largest_stats + largest_tmp
    assert dispatch.scratch_bytes() < total_needs / 5
    assert dispatch.route_counts()["native_v2"] == 21
    # Different dtypes get their own tmp_out buffer; stats are shared.
    before = dispatch.scratch_bytes()
    _decode(_inputs(num_seqs=1, dtype=torch.bfloat16), 600, ops=ops)
    assert dispatch.scratch_bytes() == before + 1 * 4 * 2 * 64 * 2


def test_scratch_used_in_capture_is_kept_when_it_grows(monkeypatch):
    ops = FakeOps()
    capturing = {"on": True}
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing["on"])
    _decode(_inputs(num_seqs=1), 1000, ops=ops)
    captured_tmp = ops.calls[-1][1][2]
    capturing["on"] = False
    _decode(_inputs(num_seqs=2), 9000, ops=ops)  # grows
    assert any(t.data_ptr() == captured_tmp.data_ptr() for t in dispatch.SCRATCH.retired)
    stats_and_tmp_small = 2 * 1 * 4 * 2 * 4 + 1 * 4 * 2 * 64 * 4
    big = 2 * 2 * 4 * 18 * 4 + 2 * 4 * 18 * 64 * 4
    assert dispatch.scratch_bytes() == big + stats_and_tmp_small


def test_any_ops_object_with_both_kernels_takes_the_native_route():
    # The decoder trusts the ops it is given: a plain namespace with the two functions is
    # native (V1 fills 1.0). Detecting an ops module without real kernels is the patch layer's
    # job: tests/attention/test_patched_calls.py::test_fallback_when_vllm_ops_have_no_kernels_behind_them.
    ops = types.SimpleNamespace(paged_attention_v1=FakeOps().paged_attention_v1,
                                paged_attention_v2=FakeOps().paged_attention_v2)
    out = _decode(_inputs(), 30, ops=ops)
    assert torch.all(out == 1.0)
    assert dispatch.route_counts() == {"native_v1": 1, "native_v2": 0, "fallback": 0}


def test_fallback_through_module_without_kernels_matches_reference():
    ops = types.SimpleNamespace()  # neither kernel defined
    inputs = _inputs()
    out = _decode(inputs, 30, ops=ops)
    q, kc, vc, bt, sl = inputs
    torch.testing.assert_close(out.double(), ref_decode(q, kc, vc, bt, sl, 0.125), atol=2e-5,
                               rtol=0)
    assert dispatch.route_counts() == {"native_v1": 0, "native_v2": 0, "fallback": 1}


@pytest.mark.parametrize("which, bad, message", [
    (0, lambda t: t[0], r"query must be 3-D \[num_seqs, num_heads, head_size\], got shape "
                        r"\(4, 64\)"),
    (0, lambda t: None, r"query must be a 3-D tensor .* got NoneType"),
    (1, lambda t: t[..., 0], r"key_cache must be 5-D \[num_blocks, num_kv_heads, "
                             r"head_size // x, block_size, x\], got shape"),
    (2, lambda t: None, r"value_cache must be a 4-D tensor .* got NoneType"),
    (4, lambda t: t.tolist(), r"seq_lens must be a 1-D tensor \[num_seqs\], got list"),
])
def test_malformed_arguments_are_named(which, bad, message):
    inputs = _inputs()
    inputs[which] = bad(inputs[which])
    for ops in (None, FakeOps()):
        with pytest.raises(ValueError, match=message):
            _decode(inputs, 30, ops=ops)

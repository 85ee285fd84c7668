"""The native-ops adapter against ops modules with exactly the vendor builds' signatures.

CoreX 3.2.3 (vLLM 0.6.3+corex.3.2.3): V1 takes ``head_mapping`` and stops at
``kv_cache_dtype``; V2 keeps the stock signature and only raises NotImplementedError.
CoreX 4.3 (vLLM 0.8.3+corex): both kernels raise NotImplementedError.  V1 here is the fake
ixformer's CPU reference (tests/harness/corex/fake_ixformer), which raises ``BI100Hang`` where the
card would hang, so a wrong route fails the test instead of passing silently.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import types

import pytest
import torch
from helpers.reference import make_cache, make_tables, ref_decode

from helpers import native_decode
from helpers.probes import HARNESS

from vllm_bi100_patch.attention import native
from vllm_bi100_patch.attention.native import decoder as dispatch
from vllm_bi100_patch.attention.native import longest
from vllm_bi100_patch.attention.native.routes import Routing as DecodeRouting

_IXF_PATH = os.path.join(HARNESS, "corex", "fake_ixformer", "ixformer", "functions.py")


def _load_fake_ixformer():
    # Loaded by path under another name: putting the fake on sys.path would make every other
    # test in this process see an "Iluvatar machine".
    spec = importlib.util.spec_from_file_location("fake_ixformer_functions", _IXF_PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


IXF = _load_fake_ixformer()


def vendor_ops(v2_message=None):
    """An ops module shaped like CoreX 3.2.3's ``vllm._custom_ops`` (signatures verbatim)."""
    calls = []

    def paged_attention_v1(output, query, key_cache, value_cache, head_mapping, scale,
                           block_tables, context_lens, block_size, max_context_len,
                           alibi_slopes=None, kv_cache_dtype=None):
        calls.append(("v1", 12 if kv_cache_dtype is not None else 11))
        return IXF.vllm_single_query_cached_kv_attention(
            output, query, key_cache, value_cache, head_mapping, scale, block_tables,
            context_lens, block_size, max_context_len, alibi_slopes)

    def paged_attention_v2(out, exp_sum, max_logits, tmp_out, query, key_cache, value_cache,
                           num_kv_heads, scale, block_tables, seq_lens, block_size, max_seq_len,
                           alibi_slopes, kv_cache_dtype, k_scale, v_scale, tp_rank=0,
                           blocksparse_local_blocks=0, blocksparse_vert_stride=0,
                           blocksparse_block_size=64, blocksparse_head_sliding_step=0):
        raise NotImplementedError()

    ops = types.SimpleNamespace(paged_attention_v1=paged_attention_v1,
                                paged_attention_v2=paged_attention_v2, calls=calls)
    return ops


@pytest.fixture(autouse=True)
def _clean():
    dispatch.reset_route_counts()
    native_decode.forget()
    IXF.CALLS.clear()
    yield
    native_decode.forget()


def _batch(lens, heads=8, kv=2, head_size=128, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    bs = 16
    blocks = sum(-(-n // bs) for n in lens) + 1
    kc, vc = make_cache(blocks, kv, head_size, bs, dtype, gen=g)
    bt = make_tables(lens, bs, max(1, max(-(-n // bs) for n in lens)), blocks, g)
    q = torch.randn(len(lens), heads, head_size, generator=g).to(dtype)
    sl = torch.tensor(lens, dtype=torch.int32)
    mapping = torch.repeat_interleave(torch.arange(kv, dtype=torch.int32), heads // kv)
    return q, kc, vc, bt, sl, mapping


def _run(batch, ops, max_seq_len=None, num_kv_heads=None, routing=None, **kw):
    q, kc, vc, bt, sl, mapping = batch
    max_seq_len = int(sl.max()) if max_seq_len is None else max_seq_len
    nkv = mapping if num_kv_heads is None else num_kv_heads
    return native_decode.decode(q, kc, vc, bt, sl, max_seq_len, kw.pop("kv_cache_dtype", "auto"),
                                nkv, q.shape[-1] ** -0.5, None, ops=ops,
                                routing=routing or DecodeRouting(), **kw)


def _check(out, batch):
    q, kc, vc, bt, sl, _ = batch
    torch.testing.assert_close(out.double(), ref_decode(q, kc, vc, bt, sl, q.shape[-1] ** -0.5),
                               atol=2e-5, rtol=2e-5)


def test_profile_of_the_vendor_build():
    prof = native_decode.decoder_for(vendor_ops()).profile
    assert prof.build == "vendor"
    assert prof.v1.present and prof.v1.takes_head_mapping and not prof.v1.takes_scales
    assert not prof.v2.present
    assert prof.v2.absent_reason == "its body only raises NotImplementedError"
    assert native_decode.decoder_for(prof.ops).profile is prof  # once per ops object


@pytest.mark.parametrize("lens, route", [
    ([100], "native_v1"),          # today: 19 positional arguments -> TypeError
    ([4000], "native_v1"),         # today: V2 -> NotImplementedError
    ([20000], "native_v1"),        # today: V2 (V1 refused above 8,192) -> NotImplementedError
    ([32768], "native_v1"),
    ([32769], "fallback"),         # V1 would hang, V2 does not exist
    ([3, 40000], "fallback"),
])
def test_issue_table_rows_route_and_match_reference(lens, route):
    batch = _batch(lens, heads=32, kv=8, head_size=128)
    ops = vendor_ops()
    out = _run(batch, ops)
    _check(out, batch)
    counts = dispatch.route_counts()
    assert counts[route] == 1 and counts["native_v2"] == 0, counts
    if route == "native_v1":
        assert ops.calls == [("v1", 11)]  # exactly what the vendor's own code passes
    else:
        assert ops.calls == []


def test_v1_gets_head_mapping_unchanged_and_an_int_becomes_one():
    seen = []
    ops = vendor_ops()
    inner = ops.paged_attention_v1

    @functools.wraps(inner)
    def spy(*args, **kwargs):
        seen.append(args[4])
        return inner(*args, **kwargs)

    ops.paged_attention_v1 = spy
    batch = _batch([50, 70], heads=8, kv=2)
    _check(_run(batch, ops), batch)
    assert seen[0] is batch[5]
    _check(_run(batch, ops, num_kv_heads=2), batch)  # stock-style int on a vendor kernel
    assert seen[1].dtype == torch.int32 and seen[1].tolist() == [0, 0, 0, 0, 1, 1, 1, 1]


def test_stock_kernel_gets_an_int_when_vllm_passes_head_mapping():
    got = []

    def paged_attention_v1(out, query, key_cache, value_cache, num_kv_heads, scale,
                           block_tables, seq_lens, block_size, max_seq_len, alibi_slopes,
                           kv_cache_dtype, k_scale, v_scale, tp_rank=0,
                           blocksparse_local_blocks=0, blocksparse_vert_stride=0,
                           blocksparse_block_size=64, blocksparse_head_sliding_step=0):
        got.append((num_kv_heads, k_scale, v_scale, kv_cache_dtype))
        out.fill_(1.0)

    ops = types.SimpleNamespace(paged_attention_v1=paged_attention_v1)
    assert native_decode.decoder_for(ops).profile.build == "stock"
    dispatch._mappings.clear()
    _run(_batch([10], heads=8, kv=2), ops, k_scale=0.5, v_scale=0.25)
    _run(_batch([10], heads=8, kv=2), ops, num_kv_heads=2)
    assert got == [(2, 0.5, 0.25, "auto"), (2, 1.0, 1.0, "auto")]
    # No head_mapping is ever built for a stock kernel (so none during CUDA-graph capture).
    assert dispatch._mappings == {}


def test_v1_limit_follows_the_convention_and_the_setting():
    stock = types.SimpleNamespace(paged_attention_v1=lambda *a: None)
    assert native_decode.decoder_for(stock, DecodeRouting()).routes.v1_limit == 8192
    assert native_decode.decoder_for(vendor_ops(), DecodeRouting()).routes.v1_limit == 32768
    assert native.build(None, DecodeRouting(v1_max_seq_len=1000)).routes.v1_limit == 1000
    ops = vendor_ops()
    batch = _batch([1500])
    _check(_run(batch, ops, routing=DecodeRouting(v1_max_seq_len=1000)), batch)
    assert ops.calls == [] and dispatch.route_counts()["fallback"] == 1


def test_hazard_is_real_max_seq_len_above_limit_never_reaches_v1():
    # A batch of short sequences with an inflated max_seq_len: V1 sizes its shared memory
    # from max_seq_len, so the bound decides, not the actual lengths.
    ops = vendor_ops()
    batch = _batch([10, 20])
    _check(_run(batch, ops, max_seq_len=40000), batch)
    assert ops.calls == [] and IXF.CALLS == {}


def test_kernel_that_raises_not_implemented_when_called_is_learned_once(caplog):
    ops = vendor_ops()

    @functools.wraps(ops.paged_attention_v2)
    def opaque_v2(*args, **kwargs):  # source not a plain raise: only a call tells
        if args:
            raise NotImplementedError("not built for this device")

    opaque_v2.__wrapped__ = None  # nothing to unwrap to: the static check cannot see through
    del opaque_v2.__wrapped__
    ops.paged_attention_v2 = opaque_v2
    ops.paged_attention_v1 = None  # no V1 at all: V2 would be the route
    caplog.set_level(logging.WARNING, logger="vllm.bi100_patch")
    batch = _batch([600, 900])
    _check(_run(batch, ops), batch)
    _check(_run(batch, ops), batch)
    assert dispatch.route_counts() == {"native_v1": 0, "native_v2": 0, "fallback": 2}
    warnings = [r for r in caplog.records if "unavailable in this build" in r.getMessage()]
    assert len(warnings) == 1 and "not built for this device" in warnings[0].getMessage()


def test_corex_4_3_both_kernels_stubs_always_fall_back():
    def v1(out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens,
           block_size, max_seq_len, alibi_slopes, kv_cache_dtype, k_scale, v_scale, tp_rank=0,
           blocksparse_local_blocks=0, blocksparse_vert_stride=0, blocksparse_block_size=64,
           blocksparse_head_sliding_step=0):
        raise NotImplementedError("Do not use this in our implement")

    ops = types.SimpleNamespace(paged_attention_v1=v1, paged_attention_v2=v1)
    prof = native_decode.decoder_for(ops).profile
    assert not prof.v1.present and not prof.v2.present
    batch = _batch([100])
    _check(_run(batch, ops), batch)
    assert dispatch.route_counts()["fallback"] == 1
    assert native_decode.describe(ops, DecodeRouting())["bands"] == [
        "every length: pure-PyTorch decode (no usable native kernel)"]


def test_fp8_cache_never_reaches_a_kernel_without_scales():
    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("no float8 in this torch")
    g = torch.Generator().manual_seed(3)
    kc, vc = make_cache(4, 2, 128, 16, torch.float16, "fp8", gen=g)
    bt = make_tables([40], 16, 3, 4, g)
    q = torch.randn(1, 8, 128, generator=g).half()
    mapping = torch.repeat_interleave(torch.arange(2, dtype=torch.int32), 4)
    ops = vendor_ops()
    out = native_decode.decode(q, kc, vc, bt, torch.tensor([40], dtype=torch.int32), 40, "fp8",
                               mapping, 128 ** -0.5, None, k_scale=0.5, v_scale=2.0, ops=ops,
                               routing=DecodeRouting())
    ref = ref_decode(q, kc, vc, bt, torch.tensor([40]), 128 ** -0.5, kv_cache_dtype="fp8",
                     k_scale=0.5, v_scale=2.0)
    torch.testing.assert_close(out.double(), ref, atol=2e-3, rtol=2e-3)
    assert ops.calls == [] and dispatch.route_counts()["fallback"] == 1


def test_head_mapping_checked_from_its_shape():
    batch = _batch([10])
    bad = torch.zeros(3, dtype=torch.int32)
    with pytest.raises(ValueError, match="head_mapping tensor.*one entry per query head \\(8\\)"):
        _run(batch, vendor_ops(), num_kv_heads=bad)
    with pytest.raises(ValueError, match="num_kv_heads=3 does not match the cache's 2"):
        _run(batch, vendor_ops(), num_kv_heads=3)


def _recording_v1(seen, what):
    """Ops whose vendor-signature V1 records one of its arguments and computes nothing."""
    def paged_attention_v1(output, query, key_cache, value_cache, head_mapping, scale,
                           block_tables, context_lens, block_size, max_context_len,
                           alibi_slopes=None, kv_cache_dtype=None):
        seen.append({"head_mapping": head_mapping, "max_context_len": max_context_len}[what])

    return types.SimpleNamespace(paged_attention_v1=paged_attention_v1)


def _meta_batch():
    """A batch of meta tensors: no data, so any read of head_mapping or seq_lens raises."""
    return tuple(t.to("meta") for t in _batch([10, 20]))


def test_head_mapping_on_a_device_is_never_read(monkeypatch):
    # Meta tensors hold no data: any read of head_mapping or seq_lens would raise.
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    q, kc, vc, bt, sl, mapping = _meta_batch()
    calls = []

    ops = _recording_v1(calls, "head_mapping")
    native_decode.decode(q, kc, vc, bt, sl, 20, "auto", mapping, 0.1, None, ops=ops,
                         routing=DecodeRouting())
    assert calls == [mapping]
    native_decode.decode(q, kc, vc, bt, sl, 20, "auto", 2, 0.1, None, ops=ops,
                         routing=DecodeRouting())
    assert calls[1].device.type == "meta" and calls[1].shape == (8,)


def test_kv_scale_family_kernels_get_kv_scale():
    got = []

    def v1(out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens,
           block_size, max_seq_len, alibi_slopes, kv_cache_dtype, kv_scale, tp_rank=0,
           blocksparse_local_blocks=0, blocksparse_vert_stride=0, blocksparse_block_size=64,
           blocksparse_head_sliding_step=0):
        got.append((kv_scale, tp_rank))

    ops = types.SimpleNamespace(paged_attention_v1=v1)
    _run(_batch([10]), ops, num_kv_heads=2, kv_scale=0.75)
    assert got == [(0.75, 0)]


def test_describe_bands_for_the_vendor_build():
    desc = native_decode.describe(vendor_ops(), DecodeRouting())
    assert desc["native_ops"]["convention"] == "vendor"
    assert desc["v1_limit"] == 32768
    assert desc["bands"][:2] == ["max_seq_len <= 32768: native V1",
                                 "max_seq_len > 32768: pure-PyTorch decode (no V2)"]
    assert "fp8 KV cache: V1 takes no scales, so not V1" in desc["bands"]
    assert native_decode.describe(None, DecodeRouting())["native_ops"] is None


# --- max_seq_len is verified where that is free (issue 16, item 4) ------------------------


def test_a_lying_max_seq_len_is_refused_before_v1_when_seq_lens_is_on_the_cpu():
    # max_seq_len=100 for a real sequence of 40,000 tokens would send it to V1, whose shared
    # memory is sized from max_seq_len: the card hangs (the fake ixformer raises BI100Hang).
    ops = vendor_ops()
    batch = _batch([40000], heads=8, kv=2, head_size=64)
    with pytest.raises(ValueError, match=r"max_seq_len=100 is below the longest sequence in "
                                         r"seq_lens \(40000\)"):
        _run(batch, ops, max_seq_len=100)
    assert ops.calls == [] and IXF.CALLS == {}


def test_max_seq_len_on_a_device_is_checked_against_a_value_already_read(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    reads = []
    monkeypatch.setattr(longest, "_read_longest", lambda sl: reads.append(sl) or 40000)
    longest.forget()
    q, kc, vc, bt, sl, mapping = _meta_batch()
    calls = []

    ops = _recording_v1(calls, "max_context_len")
    # Not read yet, and reading would sync: trusted (vLLM computes it on the host).
    native_decode.decode(q, kc, vc, bt, sl, 100, "auto", mapping, 0.1, None, ops=ops,
                         routing=DecodeRouting())
    assert calls == [100] and reads == []
    # fallback_above reads the longest sequence of this step once: from then on it is free.
    native_decode.decode(q, kc, vc, bt, sl, 40000, "auto", mapping, 0.1, None, ops=ops,
                         routing=DecodeRouting(fallback_above=1000))
    assert len(reads) == 1 and dispatch.route_counts()["fallback"] == 1
    with pytest.raises(ValueError, match="max_seq_len=100 is below the longest"):
        native_decode.decode(q, kc, vc, bt, sl, 100, "auto", mapping, 0.1, None, ops=ops,
                             routing=DecodeRouting())
    assert calls == [100]


# --- kernels the adapter cannot call safely are absent (issue 16, item 5) -----------------


def _vendor_v1_body(output, query, key_cache, value_cache, head_mapping, scale, block_tables,
                    context_lens, block_size, max_context_len, alibi_slopes=None):
    return IXF.vllm_single_query_cached_kv_attention(
        output, query, key_cache, value_cache, head_mapping, scale, block_tables, context_lens,
        block_size, max_context_len, alibi_slopes)


def test_a_required_keyword_only_parameter_it_cannot_supply_makes_the_kernel_absent():
    def paged_attention_v1(output, query, key_cache, value_cache, head_mapping, scale,
                           block_tables, context_lens, block_size, max_context_len,
                           alibi_slopes=None, *, stream):
        raise AssertionError("called without its stream")

    ops = types.SimpleNamespace(paged_attention_v1=paged_attention_v1)
    prof = native_decode.decoder_for(ops).profile
    assert not prof.v1.present and "['stream']" in prof.v1.absent_reason
    batch = _batch([30])
    _check(_run(batch, ops), batch)
    assert dispatch.route_counts()["fallback"] == 1
    assert "absent (required parameters" in native_decode.describe(ops, DecodeRouting())[
        "native_ops"]["paged_attention_v1"]


def test_a_keyword_only_parameter_is_never_passed_wrongly():
    # The conventions pass arguments positionally: a kernel that wants one by keyword is
    # absent (today: called without it -> TypeError at the first decode).
    def paged_attention_v1(output, query, key_cache, value_cache, head_mapping, scale,
                           block_tables, context_lens, block_size, max_context_len, *,
                           alibi_slopes):
        raise AssertionError("called without its alibi_slopes")

    ops = types.SimpleNamespace(paged_attention_v1=paged_attention_v1)
    prof = native_decode.decoder_for(ops).profile
    assert not prof.v1.present and "['alibi_slopes']" in prof.v1.absent_reason
    batch = _batch([30, 50])
    _check(_run(batch, ops), batch)
    assert dispatch.route_counts()["fallback"] == 1


def test_a_kwargs_forwarder_is_absent_never_called_without_arguments():
    called = []

    def paged_attention_v1(**kw):  # tolerates no arguments: would return uninitialised memory
        called.append(kw)

    ops = types.SimpleNamespace(paged_attention_v1=paged_attention_v1)
    prof = native_decode.decoder_for(ops).profile
    assert not prof.v1.present and "**kwargs" in prof.v1.absent_reason
    batch = _batch([30])
    _check(_run(batch, ops), batch)
    assert called == [] and dispatch.route_counts() == {"native_v1": 0, "native_v2": 0,
                                                        "fallback": 1}
    assert "**kwargs" in native_decode.describe(ops, DecodeRouting())["native_ops"][
        "paged_attention_v1"]


def test_positional_only_parameters_after_a_skipped_default_are_passed_positionally():
    seen = []

    def paged_attention_v1(output, query, key_cache, value_cache, head_mapping, scale,
                           block_tables, context_lens, block_size, max_context_len,
                           alibi_slopes=None, kv_cache_dtype=None, tp_rank=0, /):
        seen.append((kv_cache_dtype, tp_rank))
        _vendor_v1_body(output, query, key_cache, value_cache, head_mapping, scale,
                        block_tables, context_lens, block_size, max_context_len, alibi_slopes)

    ops = types.SimpleNamespace(paged_attention_v1=paged_attention_v1)
    batch = _batch([30])
    _check(_run(batch, ops, tp_rank=0), batch)
    assert seen == [(None, 0)]  # kv_cache_dtype left at its default, tp_rank after it


# --- head_mapping dtype and device (issue 16, item 6) --------------------------------------


def test_an_int64_head_mapping_reaches_the_vendor_kernel_as_int32():
    batch = _batch([40, 70])
    ops = vendor_ops()
    out = _run(batch, ops, num_kv_heads=batch[5].long())
    _check(out, batch)  # the fake ixformer refuses anything but int32
    assert ops.calls == [("v1", 11)]


def test_an_int64_head_mapping_is_converted_without_a_host_read(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    q, kc, vc, bt, sl, mapping = _meta_batch()
    got = []

    ops = _recording_v1(got, "head_mapping")
    native_decode.decode(q, kc, vc, bt, sl, 20, "auto", mapping.long(), 0.1, None, ops=ops,
                         routing=DecodeRouting())
    assert got[0].dtype == torch.int32 and got[0].device.type == "meta"


def test_a_head_mapping_on_another_device_is_refused_by_name():
    batch = _batch([10])
    ops = vendor_ops()
    with pytest.raises(ValueError, match="head_mapping tensor on meta, but the query is on cpu"):
        _run(batch, ops, num_kv_heads=batch[5].to("meta"))
    assert ops.calls == []

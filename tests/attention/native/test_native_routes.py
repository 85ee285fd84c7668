"""The route table is the one source of the decode routing: for every scenario the route the
decoder takes is the first applicable entry of ``routes.ROUTES``, and ``describe()`` (what doctor
and status print) lists exactly the entries that can apply; every entry and every kernel rule is
driven both ways (taken / excluding in some scenario, not in another)."""

from __future__ import annotations

import types

import pytest
import torch
from helpers.reference import make_cache, make_tables

from vllm_bi100_patch.attention import native
from vllm_bi100_patch.attention.native import decoder as dec
from vllm_bi100_patch.attention.native import longest, routes
from vllm_bi100_patch.attention.native.routes import Facts, Routing
from vllm_bi100_patch.attention.paged_attention import decode_call


def _stock_ops(v1=True, v2=True):
    def paged_attention_v1(out, *args):
        out.fill_(1.0)

    def paged_attention_v2(out, exp_sums, max_logits, tmp_out, *args):
        out.fill_(2.0)

    return types.SimpleNamespace(**({"paged_attention_v1": paged_attention_v1} if v1 else {}),
                                 **({"paged_attention_v2": paged_attention_v2} if v2 else {}))


def _vendor_ops():
    def paged_attention_v1(output, query, key_cache, value_cache, head_mapping, scale,
                           block_tables, context_lens, block_size, max_context_len,
                           alibi_slopes=None, kv_cache_dtype=None):
        output.fill_(1.0)

    def paged_attention_v2(out, *args):
        raise NotImplementedError()

    return types.SimpleNamespace(paged_attention_v1=paged_attention_v1,
                                 paged_attention_v2=paged_attention_v2)


def _call(lens=(5, 30), max_seq_len=None, head_size=64, kv_cache_dtype="auto", sparse=False):
    g = torch.Generator().manual_seed(0)
    fp8 = kv_cache_dtype != "auto"
    kc, vc = make_cache(sum(-(-n // 16) for n in lens) + 1, 2, head_size, 16,
                        torch.float16 if fp8 else torch.float32, "fp8" if fp8 else "auto", gen=g)
    bt = make_tables(list(lens), 16, max(-(-n // 16) for n in lens), kc.shape[0], g)
    q = torch.randn(len(lens), 4, head_size, generator=g)
    values = {"query": q.half() if fp8 else q, "key_cache": kc, "value_cache": vc,
              "block_tables": bt, "seq_lens": torch.tensor(lens, dtype=torch.int32),
              "max_seq_len": max(lens) if max_seq_len is None else max_seq_len,
              "kv_cache_dtype": kv_cache_dtype, "num_kv_heads": 2, "scale": 0.125,
              "alibi_slopes": None, "blocksparse_vert_stride": 8 if sparse else 0}
    return decode_call(values)


FP8 = "fp8" if hasattr(torch, "float8_e4m3fn") else "auto"

#: name -> (ops factory, routing, call arguments, the row expected to decide)
SCENARIOS = {
    "no ops": (lambda: None, Routing(), {}, "no_ops"),
    "forced": (_stock_ops, Routing(fallback_above=0), {}, "forced"),
    "head size": (_stock_ops, Routing(), {"head_size": 32}, "head_size"),
    "longest": (_stock_ops, Routing(fallback_above=20), {"lens": (5, 21), "max_seq_len": 4096},
                "longest"),
    "within fallback_above": (_stock_ops, Routing(fallback_above=20),
                              {"lens": (5, 18), "max_seq_len": 4096}, "occupancy_v2"),
    "one partition": (_stock_ops, Routing(), {}, "occupancy_v1"),
    "partitioning pays": (_stock_ops, Routing(), {"max_seq_len": 4000}, "occupancy_v2"),
    "V2 needs a dividing block": (_stock_ops, Routing(partition_size=500), {"max_seq_len": 4000},
                                  "v1"),
    "above V1's limit": (_stock_ops, Routing(), {"max_seq_len": 9000}, "v2"),
    "nothing usable": (_stock_ops, Routing(partition_size=500), {"max_seq_len": 9000},
                       "none_usable"),
    "V2 only": (lambda: _stock_ops(v1=False), Routing(), {"max_seq_len": 100}, "v2"),
    "vendor": (_vendor_ops, Routing(), {}, "v1"),
    "vendor fp8": (_vendor_ops, Routing(), {"kv_cache_dtype": FP8},
                   "none_usable" if FP8 != "auto" else "v1"),
    "vendor blocksparse": (_vendor_ops, Routing(), {"sparse": True}, "none_usable"),
    "vendor above 32768": (_vendor_ops, Routing(), {"max_seq_len": 40000}, "none_usable"),
    "stubs only": (lambda: types.SimpleNamespace(paged_attention_v1=_vendor_ops().
                                                 paged_attention_v2), Routing(), {},
                   "none_usable"),
}


@pytest.fixture(autouse=True)
def _clean():
    dec.reset_route_counts()
    dec.SCRATCH.clear()
    longest.forget()
    yield
    dec.SCRATCH.clear()


def _run(name):
    make_ops, routing, kw, _ = SCENARIOS[name]
    decoder = native.build(make_ops(), routing)
    call = _call(**kw)
    return decoder, call, decoder.routes.choose(Facts(decoder.routes, call))


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_the_route_taken_is_the_first_applicable_entry_and_describe_lists_it(name):
    decoder, call, row = _run(name)
    assert row.name == SCENARIOS[name][3]
    bands = decoder.describe()["bands"]
    active = {r.name for r, _ in decoder.routes.applicable()}
    for r in routes.ROUTES:  # describe lists exactly the entries that can apply
        band = r.band(decoder.routes)
        assert (band is not None) is (r.name in active)
        assert (band in bands) if band is not None else True
    assert row.name in active and row.band(decoder.routes) in bands
    if call.is_blocksparse and row.route == "fallback":
        with pytest.raises(NotImplementedError, match="blocksparse"):
            decoder.decode(call)
        return
    before = dec.route_counts()
    decoder.decode(call)
    after = dec.route_counts()
    assert {k: after[k] - before[k] for k in after} == {
        k: int(k == row.route) for k in after}


def test_every_route_is_driven_both_ways():
    taken, inactive = set(), set()
    for name in SCENARIOS:
        decoder, _, row = _run(name)
        taken.add(row.name)
        inactive |= {r.name for r in routes.ROUTES if r.band(decoder.routes) is None}
    names = {r.name for r in routes.ROUTES}
    assert taken == names, names - taken
    assert inactive == names, names - inactive


def test_every_kernel_rule_is_driven_both_ways_and_described_where_it_applies():
    excluded, passed = set(), set()
    for name in SCENARIOS:
        decoder, call, _ = _run(name)
        if decoder.profile is None:
            continue
        bands = decoder.describe()["bands"]
        facts = Facts(decoder.routes, call)
        pairs = [(k, rule) for k in (decoder.profile.v1, decoder.profile.v2)
                 for rule in routes.KERNEL_RULES]
        expected = {rule.band(decoder.routes, k) for k, rule in pairs
                    if k.present and rule.applies(decoder.routes, k)}
        if decoder.routes.routing.fallback_above != 0:
            for k, rule in pairs:
                band = rule.band(decoder.routes, k)
                assert (band in bands) is (band in expected), (name, rule.name)
        for k, rule in pairs:
            if k.present and rule.applies(decoder.routes, k):
                (excluded if rule.excludes(decoder.routes, facts) else passed).add(rule.name)
    names = {r.name for r in routes.KERNEL_RULES}
    if FP8 == "auto":
        names.discard("fp8")
    assert names <= excluded and names <= passed, (excluded, passed)


def test_the_fallback_works_under_the_settings_budget(monkeypatch):
    """The patch's decoder hands ``VLLM_BI100_PREFIX_BUDGET_MB`` to the pure-PyTorch decode:
    a smaller budget means more passes, the same answer."""
    from vllm_bi100_patch.activation import config
    from vllm_bi100_patch.attention import paged_attention

    seen = []
    real = dec.paged_decode

    def spy(*args, **kwargs):
        seen.append(kwargs["budget_mb"])
        return real(*args, **kwargs)

    monkeypatch.setattr(dec, "paged_decode", spy)
    module = types.ModuleType("attn_without_ops")
    call = _call(lens=(5, 300))
    outs = [paged_attention.decoder_for(module, config.Settings(prefix_budget_mb=mb)).decode(call)
            for mb in (1, 512)]
    assert seen == [1, 512]
    assert torch.allclose(outs[0], outs[1], atol=1e-6)

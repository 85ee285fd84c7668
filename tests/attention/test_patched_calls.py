"""The replacements adapt every family's arguments to the kernels and give the right numbers."""

import importlib

import pytest
import torch
from helpers.reference import paged_batch, prefix_batch, ref_decode, ref_prefix
from helpers.shim import FAMILY_VERSIONS

from vllm_bi100_patch.activation import config
from vllm_bi100_patch.patching import factories, hardware, registry, versions

ON = config.load({config.MODE: "1"})
#: float32 kernels against the float64 reference on these inputs (|values| < 4): the largest
#: error measured over every test here is 2.6e-7 (decode, prefix, native fake, every family);
#: ATOL is that with a 10x margin.
ATOL = 3e-6
HEADS, KV_HEADS, D, BS = 4, 2, 64, 16


def _scenario(seed=0, seq_lens=(37, 1, 16), new=(5, 1, 3)):
    g = torch.Generator().manual_seed(seed)
    kc, vc, block_tables, ks, vs = paged_batch(seq_lens, KV_HEADS, D, BS, 32, 4, g)
    return g, kc, vc, block_tables, torch.tensor(seq_lens, dtype=torch.int32), ks, vs


def _scales(fam):
    one = torch.tensor(1.0) if fam.scales == "Tensor" else 1.0
    return (one,) * len(fam.decode_scale_names)


@pytest.fixture
def patched(paged_attn_module):
    def load(version):
        mod = paged_attn_module(version)
        report = registry.apply_to(mod, ON)
        assert report.reason is None, report.reason
        return mod, versions.family_for(versions.VersionInfo(version))
    return load


@pytest.mark.parametrize("version", sorted(FAMILY_VERSIONS.values()))
@pytest.mark.parametrize("by_keyword", [False, True])
def test_decode_every_family(patched, version, by_keyword):
    mod, fam = patched(version)
    g, kc, vc, bt, seq_lens, _, _ = _scenario()
    query = torch.randn(3, HEADS, D, generator=g)
    q_before = query.clone()
    scale = D ** -0.5
    args = (query, kc, vc, bt, seq_lens, int(seq_lens.max()), "auto", KV_HEADS, scale, None,
            *_scales(fam))
    if by_keyword:
        out = mod.PagedAttention.forward_decode(**dict(zip(fam.decode_params, args)))
    else:
        out = mod.PagedAttention().forward_decode(*args)
    torch.testing.assert_close(out.double(), ref_decode(query, kc, vc, bt, seq_lens, scale),
                               atol=ATOL, rtol=0)
    assert torch.equal(query, q_before)
    assert "forward_decode" not in mod.STOCK_CALLS


@pytest.mark.parametrize("version", sorted(FAMILY_VERSIONS.values()))
def test_prefix_every_family(patched, version):
    mod, fam = patched(version)
    values = _prefix_values(fam)
    out = mod.PagedAttention.forward_prefix(*[values[p] for p in fam.prefix_params])
    ref = ref_prefix(*[values[p] for p in ("query", "key", "value", "key_cache", "value_cache",
                                           "block_tables", "query_start_loc", "seq_lens_tensor",
                                           "context_lens")], D ** -0.5)
    torch.testing.assert_close(out.double(), ref, atol=ATOL, rtol=0)
    assert mod.STOCK_CALLS == []  # the Triton path was never taken
    assert factories.call_counts()["forward_prefix"] >= 1


@pytest.mark.parametrize("version", ["0.5.0", "0.6.3.post1", "0.8.5"])
def test_native_route_passes_the_family_scales_through(patched, version, monkeypatch):
    monkeypatch.setattr(hardware, "ixformer_present", lambda: True)  # asked at patch time
    mod, fam = patched(version)
    ops = importlib.import_module("vllm._custom_ops")
    ops.CALLS.clear()
    g, kc, vc, bt, seq_lens, _, _ = _scenario(seed=2)
    query = torch.randn(3, HEADS, D, generator=g)
    scales = tuple(0.5 + i for i in range(len(fam.decode_scale_names)))
    out = mod.PagedAttention.forward_decode(query, kc, vc, bt, seq_lens, 64, "auto", KV_HEADS,
                                            0.125, None, *scales)
    assert len(ops.CALLS) == 1
    route, max_seq_len, rest = ops.CALLS[0]
    assert route in ("v1", "v2") and max_seq_len == 64
    assert rest[:len(scales)] == scales and rest[len(scales):] == (0, 0, 0, 64, 0)
    # The fake native op scales K by k_scale and V by v_scale: compare with a scaled reference.
    kref, vref = kc * scales[0], vc * scales[-1]
    torch.testing.assert_close(out.double(), ref_decode(query, kref, vref, bt, seq_lens, 0.125),
                               atol=ATOL, rtol=0)


def test_argument_errors_look_like_python_ones(patched):
    mod, fam = patched("0.8.5")
    with pytest.raises(TypeError, match="missing required argument: 'key_cache'"):
        mod.PagedAttention.forward_decode(torch.zeros(1, HEADS, D))
    with pytest.raises(TypeError, match="unexpected keyword"):
        mod.PagedAttention.forward_decode(*range(12), bogus=1)


def test_fallback_when_vllm_ops_have_no_kernels_behind_them(patched, monkeypatch):
    # vllm._custom_ops exposes paged_attention_v1/v2 as Python wrappers even where the
    # compiled kernels are missing (official CUDA wheels on a CPU torch): without ixformer and
    # without torch.ops._C kernels the patched decode must take the pure-PyTorch fallback.
    monkeypatch.setattr(hardware, "ixformer_present", lambda: False)  # asked at patch time
    mod, fam = patched("0.6.3.post1")
    ops = importlib.import_module("vllm._custom_ops")
    ops.CALLS.clear()
    before = factories.call_counts()["decode_fallback"]
    g, kc, vc, bt, seq_lens, _, _ = _scenario(seed=3)
    query = torch.randn(3, HEADS, D, generator=g)
    out = mod.PagedAttention.forward_decode(query, kc, vc, bt, seq_lens, 64, "auto", KV_HEADS,
                                            0.125, None, 1.0, 1.0)
    assert ops.CALLS == []
    assert factories.call_counts()["decode_fallback"] == before + 1
    torch.testing.assert_close(out.double(), ref_decode(query, kc, vc, bt, seq_lens, 0.125),
                               atol=ATOL, rtol=0)


def _prefix_values(fam, seed=1):
    g, kc, vc, bt, seq_lens, ks, vs = _scenario(seed=seed)
    new = torch.tensor([5, 1, 3], dtype=torch.int32)
    context_lens, qsl, key, value = prefix_batch(seq_lens, new, ks, vs)
    return {
        "query": torch.randn(int(new.sum()), HEADS, D, generator=g), "key": key, "value": value,
        "kv_cache_dtype": "auto", "key_cache": kc, "value_cache": vc, "block_tables": bt,
        "query_start_loc": qsl, "seq_lens_tensor": seq_lens, "context_lens": context_lens,
        "max_query_len": int(new.max()), "alibi_slopes": None, "sliding_window": None,
        "k_scale": _scales(fam)[0], "v_scale": _scales(fam)[0],
    }


@pytest.mark.parametrize("arg,value,error,match", [
    ("max_seq_len", float("inf"), ValueError, r"max_seq_len must be an integer >= 0, got inf"),
    ("scale", None, TypeError, r"scale must be a float or a 1-element tensor, got None"),
])
def test_decode_errors_name_the_argument_and_value(patched, arg, value, error, match):
    mod, fam = patched("0.8.5")
    g, kc, vc, bt, seq_lens, _, _ = _scenario()
    args = dict(zip(fam.decode_params, (torch.randn(3, HEADS, D, generator=g), kc, vc, bt,
                                        seq_lens, 64, "auto", KV_HEADS, 0.125, None,
                                        *_scales(fam))))
    args[arg] = value
    with pytest.raises(error, match=match):
        mod.PagedAttention.forward_decode(**args)


@pytest.mark.parametrize("version", ["0.6.3.post1", "0.8.5"])
def test_prefix_errors_name_the_argument_and_value(patched, version):
    mod, fam = patched(version)
    for name in ("key", "value"):
        values = _prefix_values(fam)
        values[name] = torch.empty(values[name].shape, device="meta")
        with pytest.raises(ValueError, match=f"^{name} is on meta but query is on cpu"):
            mod.PagedAttention.forward_prefix(*[values[p] for p in fam.prefix_params])
    values = _prefix_values(fam)
    values["query_start_loc"] = torch.tensor([0, 5, 4, 9], dtype=torch.int32)
    # from 0.8.0 on, context_lens is derived from query_start_loc: still blamed on the cause
    with pytest.raises(ValueError, match=r"query_start_loc must be non-decreasing .*\[0, 5, 4, 9\]"):
        mod.PagedAttention.forward_prefix(*[values[p] for p in fam.prefix_params])

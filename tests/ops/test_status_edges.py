"""``status()`` and ``doctor`` at the edges: a reloaded target module, the environment changed
after activation, a vLLM whose metadata has no Version line, a module that exits at import."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

from fakes.fake_vllm import write_fake_vllm
from helpers.shim import ROOT

import vllm_bi100_patch
from vllm_bi100_patch.activation import bootstrap, config
from vllm_bi100_patch.patching import versions

PAGED_ATTN = "vllm.attention.ops.paged_attn"


def test_patched_lists_each_method_once_after_a_reload(fake_vllm_factory, monkeypatch):
    fake_vllm_factory("0.6.3.post1")
    monkeypatch.setenv(config.MODE, "1")
    vllm_bi100_patch.apply()
    module = importlib.import_module(PAGED_ATTN)
    assert vllm_bi100_patch.status()["patched"] == ["forward_decode", "forward_prefix"]
    importlib.reload(module)  # a new PagedAttention class: the hook patches it again
    assert type(vars(module.PagedAttention)["forward_decode"].__func__).__name__ == \
        "PatchWrapper"
    assert vllm_bi100_patch.status()["patched"] == ["forward_decode", "forward_prefix"]


def test_status_reports_the_configuration_the_process_acted_on(fake_vllm_factory, monkeypatch):
    fake_vllm_factory("0.6.3.post1")
    monkeypatch.setenv(config.MODE, "1")
    vllm_bi100_patch.apply()
    importlib.import_module(PAGED_ATTN)
    monkeypatch.setenv(config.MODE, "0")  # set at run time: the patches stay installed
    st = vllm_bi100_patch.status()
    assert st["patched"] == ["forward_decode", "forward_prefix"]
    assert st["mode"] == "1" and st["mode_raw"] == "1"
    assert st["config_live"] == {"mode": "0", "mode_raw": "0", "disabled": []}
    monkeypatch.setenv(config.MODE, "1")
    assert vllm_bi100_patch.status()["config_live"] is None


def test_status_before_activation_reads_the_environment(monkeypatch):
    assert bootstrap.settings() is None
    monkeypatch.setenv(config.MODE, "0")
    st = vllm_bi100_patch.status()
    assert st["mode"] == "0" and st["config_live"] is None


def test_metadata_without_a_version_line_is_installed_with_an_unknown_version(tmp_path,
                                                                            monkeypatch):
    dist = tmp_path / "vllm-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    info = versions.installed_vllm_version()
    assert info.raw is not None  # installed, even though the version is unknown
    assert info.raw == versions.NO_VERSION
    assert versions.family_for(info) is None


def _doctor(path, **env):
    full = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_BI100", "PYTHONPATH"))}
    full.update(env, PYTHONPATH=os.pathsep.join([ROOT] + path))
    return subprocess.run([sys.executable, "-m", "vllm_bi100_patch", "doctor"], env=full,
                          capture_output=True, text=True, timeout=300, cwd=ROOT)


def test_doctor_says_vllm_without_a_version_is_installed(tmp_path):
    root = write_fake_vllm(str(tmp_path / "v"), "0.6.3.post1")
    with open(os.path.join(root, "vllm-0.6.3.post1.dist-info", "METADATA"), "w") as fh:
        fh.write("Metadata-Version: 2.1\nName: vllm\n")
    proc = _doctor([root], VLLM_BI100_PATCH="1")
    assert "vLLM not installed" not in proc.stdout and "[FAIL] vLLM: not installed" not in \
        proc.stdout, proc.stdout
    assert f"[FAIL] version: {versions.NO_VERSION} is not a supported version" in proc.stdout
    assert proc.returncode == 1, proc.stdout + proc.stderr


def test_doctor_reports_a_module_that_exits_at_import(tmp_path):
    root = write_fake_vllm(str(tmp_path / "v"), "0.6.3.post1")
    path = os.path.join(root, "vllm", "attention", "ops", "paged_attn.py")
    with open(path) as fh:
        source = fh.read()
    with open(path, "w") as fh:
        fh.write(source + "\nimport sys\nsys.exit(3)\n")
    proc = _doctor([root], VLLM_BI100_PATCH="1")
    assert "[FAIL] import vllm.attention.ops.paged_attn: SystemExit(3)" in proc.stdout, \
        proc.stdout + proc.stderr
    assert proc.stdout.rstrip().splitlines()[-1].startswith("verdict: will NOT patch")
    assert proc.returncode == 1  # doctor's "will not patch", not the module's 3

"""scripts/gpu_e2e.sh --check: the GPU end-to-end script parses, lints (shellcheck when
installed), finds the files it references and its embedded Python compiles. Fast, CPU only."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "scripts", "gpu_e2e.sh")


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_gpu_e2e_check_passes(tmp_path):
    env = dict(os.environ, E2E_PYTHON=sys.executable, E2E_OUT=str(tmp_path))
    proc = subprocess.run(["bash", SCRIPT, "--check"], capture_output=True, text=True,
                          timeout=120, env=env, cwd=str(tmp_path))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "bash -n: OK" in out
    assert "embedded Python helpers compile: OK" in out
    assert "plan (gpu_e2e.sh):" in out
    assert "vllm==0.6.3.post1" in out and "VLLM_ATTENTION_BACKEND=XFORMERS" in out
    assert not os.path.exists(os.path.join(str(tmp_path), "venv")), "--check must install nothing"


def test_gpu_e2e_rejects_unknown_arguments(tmp_path):
    proc = subprocess.run(["bash", SCRIPT, "--bogus"], capture_output=True, text=True,
                          timeout=60, cwd=str(tmp_path))
    assert proc.returncode == 2
    assert "unknown argument" in proc.stderr

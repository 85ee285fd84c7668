"""scripts/gpu_e2e.sh --check: the GPU end-to-end script parses, lints (shellcheck when
installed), finds the files it references and its Python side (scripts/gpu_e2e.py) imports and
prints the server command. Fast, CPU only."""

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
    assert "Python helpers import: OK" in out
    assert "plan (gpu_e2e.sh):" in out
    assert "vllm==0.6.3.post1 torch==2.4.0 xformers==0.0.27.post2" in out
    assert "with 94 constraints" in out
    assert "VLLM_ATTENTION_BACKEND=XFORMERS" in out and "--host 127.0.0.1" in out
    assert "--enable-chunked-prefill" in out and "--enable-prefix-caching" in out
    assert not os.path.exists(os.path.join(str(tmp_path), "venv")), "--check must install nothing"


def test_gpu_e2e_rejects_unknown_arguments(tmp_path):
    proc = subprocess.run(["bash", SCRIPT, "--bogus"], capture_output=True, text=True,
                          timeout=60, cwd=str(tmp_path))
    assert proc.returncode == 2
    assert "unknown argument" in proc.stderr


def test_gpu_e2e_check_fails_when_the_python_side_cannot_run(tmp_path):
    env = dict(os.environ, E2E_PYTHON="/nonexistent/python3", E2E_OUT=str(tmp_path))
    proc = subprocess.run(["bash", SCRIPT, "--check"], capture_output=True, text=True,
                          timeout=120, env=env, cwd=str(tmp_path))
    assert proc.returncode != 0
    assert "Python helpers: FAILED" in proc.stderr

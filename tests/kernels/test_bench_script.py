"""The benchmark script runs (--quick) and prints its table."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_bench_quick_runs(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "bench_attention.py"), "--quick",
         "--repeats", "1", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300, env=env, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "| case | paged ms | SDPA ms | seed ms | native ms |" in out
    for case in ("decode 2x256", "decode 1x1024", "prefix 1x(256+64)", "prefix 2x(128+32)",
                 "prefix 1x(256+64) tiled", "prefix 2x(128+32) native"):
        assert f"| {case} |" in out
    assert "measured copy bandwidth" in out
    assert "target decode <= 1.0x dense SDPA: " in out
    assert "target tiled prefix, GPU compute mode, <= 1.2x SDPA and >= 2x seed: " in out
    assert (tmp_path / "results.json").exists()
    assert "plot: " in out


def test_gpu_kernels_check_dry_run(tmp_path):
    """scripts/gpu_kernels_check.sh --dry-run: the GPU check's steps on CPU, tiny sizes."""
    env = dict(os.environ, PYTHON=sys.executable, BI100_CHECK_OUT=str(tmp_path / "out"))
    env.pop("PYTHONPATH", None)  # the script must find the package itself
    proc = subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu_kernels_check.sh"),
                           "--dry-run"], capture_output=True, text=True, timeout=600, env=env,
                          cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    summary = proc.stdout[proc.stdout.index("==== gpu_kernels_check summary ===="):]
    assert "device checks on cpu: 7 passed, 0 failed, 1 skipped" in summary
    assert "| decode 2x256 |" in summary and "| prefix 2x(128+32) native |" in summary
    assert "target tiled prefix" in summary
    assert summary.rstrip().endswith("RESULT: PASS")
    assert (tmp_path / "out" / "summary.txt").exists()


def test_gpu_kernels_check_rejects_unknown_arguments(tmp_path):
    proc = subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu_kernels_check.sh"),
                           "--fast"], capture_output=True, text=True, timeout=60,
                          cwd=str(tmp_path))
    assert proc.returncode == 2 and "unknown argument: --fast" in proc.stderr

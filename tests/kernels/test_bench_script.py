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
                 "decode 2x256 gpu", "prefix 1x(256+64) tiled", "prefix 2x(128+32) gpu"):
        assert f"| {case} |" in out
    assert "measured copy bandwidth" in out
    assert (tmp_path / "results.json").exists()
    assert "plot: " in out

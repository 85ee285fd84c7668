"""A multi-node deployment's worker: a local Ray cluster (loopback only) runs a task in a Ray
worker process, which imports vLLM's paged_attn with the shim active (ray_probe.py).

Ray comes with vLLM (a dependency of the 0.6.x wheels); the session that runs this installs
the release.  Bounded: the probe's task waits at most TASK_TIMEOUT_S, the probe process at most
TIMEOUT_S; the cluster is shut down by the probe, and what Ray left running is reported (and
killed) there.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from helpers.probes import HARNESS, clean_env, reports

pytestmark = pytest.mark.ray

PROBE = os.path.join(HARNESS, "ray", "ray_probe.py")
TIMEOUT_S = 420
LOOPBACK = ("127.0.0.1", "::ffff:127.0.0.1")


def test_ray_worker_runs_the_shim():
    if importlib.util.find_spec("ray") is None:
        pytest.fail("ray is not installed in this session's venv (it comes with vLLM 0.6.x)")
    env = clean_env({"VLLM_BI100_PATCH": "1", "RAY_USAGE_STATS_ENABLED": "0"})
    proc = subprocess.run([sys.executable, PROBE], env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S, cwd=os.path.dirname(PROBE))
    result = reports(proc)[-1]
    worker = result["worker"]
    st = worker["status"]
    assert worker["pid"] != result["driver_pid"]
    assert st["active"] is True and {"sitecustomize", "pth"} & set(st["activated_by"])
    assert worker["is_ours"] and {"forward_decode", "forward_prefix"} <= set(st["patched"])
    assert st["counts"]["forward_decode"] == 1 and worker["finite"]
    # Its series, in the PROMETHEUS_MULTIPROC_DIR it inherited, as vLLM's /metrics reads them.
    assert st["metrics"]["export"] == "files" and result["metrics_calls"] == 1
    assert f"counter_vllm-bi100-{worker['pid']}.db" in result["metrics_files"]
    if "+corex" in (st["vllm_version"] or "") or st["vllm_version"] == "0.6.3.post1":
        assert "prefix_block_table" in st["report"]["applied"]
    # The shim's INFO line, logged in the worker and forwarded to the driver by Ray.
    log = proc.stdout + proc.stderr
    assert any("vllm-bi100-patch active" in ln and f"pid={worker['pid']}" in ln
               for ln in log.splitlines()), log[-3000:]
    assert result["nodes"] == ["127.0.0.1"]
    assert result["sockets"], "no listening socket seen: the check below would prove nothing"
    assert all(ip in LOOPBACK for _, _, ip in result["sockets"]), result["sockets"]
    assert result["children_left"] == [], result["children_left"]

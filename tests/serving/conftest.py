"""The serving runs that tests/serving/test_serving_compat.py and test_serving_tools.py read: vLLM
0.6.3's own server app (serving_app.py, after scheduler_probe.py in the same interpreter), once
with the shim and once stock, both started at once, once per session."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from helpers.probes import HARNESS, clean_env, installed_vllm, reports

REAL = os.path.join(HARNESS, "real")
#: One interpreter each (both started at once): the scheduler scenarios, then the server app.
SERVING_RUNS = {"shim": {"VLLM_BI100_PATCH": "1"}, "stock": {"VLLM_BI100_PATCH": "0"}}


@pytest.fixture(scope="session")
def serving_runs():
    """``{"shim": {case: report}, "stock": {...}, "shim_log": text, "stock_log": text}``."""
    installed = installed_vllm()
    if not installed.startswith("0.6.3"):
        pytest.skip(f"the serving rows are for vLLM 0.6.3; this is {installed}")
    procs = {name: subprocess.Popen([sys.executable, os.path.join(REAL, "serving_app.py")],
                                    env=clean_env(env), cwd=REAL, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True)
             for name, env in SERVING_RUNS.items()}
    out = {}
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=600)
        done = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
        out[name] = {r.get("case", r.get("scenario")): r for r in reports(done)}
        out[name + "_log"] = stdout + stderr  # vLLM's logger writes to stdout
    return out

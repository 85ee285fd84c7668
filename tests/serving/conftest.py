"""The serving runs that tests/serving/test_serving_compat.py and test_serving_tools.py read: vLLM
0.6.3's own server app (serving_app.py, after scheduler_probe.py in the same interpreter), once
with the shim and once stock, both started at once, once per session."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from helpers.probes import HARNESS, clean_env, installed_vllm, reports, served, stop_servers

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


#: tests/harness/real/tool_stream_app.py ``serve`` apps, all started at once, once per session:
#: test_hermes_stream.py reads shim, stock and args_off; test_responses.py shim, stock, r1 and
#: qwen3.  args_off: the shim with the kill switches of the rows the hermes tests prove; r1: the
#: shim started with upstream's reasoning flags; qwen3: the shim with the reasoning parser from
#: the environment.
TOOL_STREAM_SERVERS = {
    "shim": {"VLLM_BI100_PATCH": "1"},
    "stock": {"VLLM_BI100_PATCH": "0"},
    "args_off": {"VLLM_BI100_PATCH": "1", "VLLM_BI100_PATCH_DISABLE":
                 "hermes_tool_args,named_tool_stream,hermes_cut_call"},
    "r1": {"VLLM_BI100_PATCH": "1",
           "BI100_APP_FLAGS": "--enable-reasoning --reasoning-parser deepseek_r1"},
    "qwen3": {"VLLM_BI100_PATCH": "1", "VLLM_BI100_REASONING_PARSER": "qwen3"},
}


@pytest.fixture(scope="session")
def tool_stream_servers(tmp_path_factory):
    """``{name: {"port", "applied", "log"}}`` of every ``TOOL_STREAM_SERVERS`` app, serving
    until the session ends (their ERROR records are read as deltas: the apps are shared)."""
    import time

    installed = installed_vllm()
    if not installed.startswith("0.6.3"):
        pytest.skip(f"the serving rows are for vLLM 0.6.3; this is {installed}")
    tmp = tmp_path_factory.mktemp("tool-stream-apps")
    procs, logs = {}, {}
    for name, env in TOOL_STREAM_SERVERS.items():
        logs[name] = str(tmp / f"{name}.log")
        with open(logs[name], "w") as log:
            procs[name] = subprocess.Popen(
                [sys.executable, os.path.join(REAL, "tool_stream_app.py"), "serve"],
                env=clean_env(env), cwd=REAL, stdin=subprocess.PIPE, stdout=log,
                stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 600
        info = {name: dict(served(name, proc, logs[name], deadline), log=logs[name])
                for name, proc in procs.items()}
        yield info
    finally:
        stop_servers(procs.values())

"""Today's agent frameworks at their default settings against vLLM 0.6.3's own OpenAI server
(``standin_server.py``: ``build_app`` + ``init_app_state``, hermes auto tool choice,
``--max-num-seqs 4``, an engine stand-in whose answers fit the request), with the shim and
stock, on the official 0.6.3.post1 wheel and on the CoreX 3.2.3 stand-in: ``nox -s
frameworks`` (docs/testing.md, docs/serving-compat.md).

Every case of ``clients.py`` must pass with the shim: the framework's default path completes,
its result is what the engine answered, the server logged no ERROR.  Stock outcomes are
recorded for the docs, never asserted.  The servers start at once; each client venv's cases
then run one after another against each server (one case at a time per server).

Environment (noxfile.py sets it): ``BI100_FRAMEWORK_VENVS`` (JSON: client group -> the
python of its venv), ``BI100_FRAMEWORK_SERVERS`` (which of ``shim``, ``stock`` to start;
default both), ``BI100_FRAMEWORK_OUT`` (the servers' logs and the outcome table go there),
``BI100_EXPECT_VLLM`` (the vLLM the servers must report).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

import pytest
from helpers.probes import TAG, clean_env, served, stop_servers

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from clients import CASES, runs_on  # noqa: E402  (standard library only at import)

pytestmark = pytest.mark.frameworks

#: ``reasoning``, ``stock_reasoning``: the engine stand-in thinks before it answers
#: (``standin_server.REASONING``); the shim's server is started with upstream's
#: ``--enable-reasoning --reasoning-parser deepseek_r1``, stock's has no such flags.
SERVERS = {"shim": {"VLLM_BI100_PATCH": "1"}, "stock": {"VLLM_BI100_PATCH": "0"},
           "reasoning": {"VLLM_BI100_PATCH": "1", "BI100_STANDIN_REASONING": "deepseek_r1"},
           "stock_reasoning": {"VLLM_BI100_PATCH": "0",
                               "BI100_STANDIN_REASONING": "deepseek_r1"}}
#: The shim's server for each kind of case.
SHIM_FOR = {"plain": "shim", "reasoning": "reasoning"}
ROWS = ("chat_request_compat", "seq_limit_openai", "error_message_cause", "responses_api",
        "reasoning_flags", "reasoning_parser", "reasoning_output", "reasoning_stream")
#: Nothing leaves the machine: any proxied request goes to a closed local port and fails at
#: once (the servers are reached directly: NO_PROXY), telemetry and tracing are off.
OFFLINE = {"HTTP_PROXY": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9",
           "ALL_PROXY": "http://127.0.0.1:9", "http_proxy": "http://127.0.0.1:9",
           "https_proxy": "http://127.0.0.1:9", "all_proxy": "http://127.0.0.1:9",
           "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost",
           "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
SERVER_ENV = {**OFFLINE, "VLLM_NO_USAGE_STATS": "1"}
CLIENT_ENV = {**OFFLINE, "OPENAI_API_KEY": "dummy", "OPENAI_AGENTS_DISABLE_TRACING": "1",
              "LANGSMITH_TRACING": "false", "LANGCHAIN_TRACING_V2": "false"}
START_TIMEOUT = 300


def _wanted():
    names = os.environ.get("BI100_FRAMEWORK_SERVERS",
                           "shim,stock,reasoning,stock_reasoning").split(",")
    return [n for n in names if n]


def _start(label, log_path):
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, os.path.join(HERE, "standin_server.py")],
                            env=clean_env({**SERVER_ENV, **SERVERS[label]}), cwd=HERE,
                            stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT)
    log.close()
    return proc


def _table(reports, servers) -> str:
    head = "| case | " + " | ".join(servers) + " |\n|---|" + "---|" * len(servers) + "\n"
    rows = []
    for name, (_, _, kind) in CASES.items():
        cells = []
        for label in servers:
            r = reports.get((label, name))
            if not runs_on(kind, label):
                cells.append("")
            elif r is None:
                cells.append("not run")
            elif r["ok"]:
                cells.append("ok " + ",".join(map(str, r["http"])))
            else:
                logged = (f"; the server logged {r['server_errors'][0]}"
                          if r["server_errors"] and not r["error"].startswith("the server")
                          else "")
                cells.append(f"**fails** {','.join(map(str, r['http']))}: "
                             f"{r['error'][:160]}{logged}")
        rows.append(f"| {name} | " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    return head + "\n".join(rows) + "\n"


@pytest.fixture(scope="module")
def outcomes():
    venvs = json.loads(os.environ.get("BI100_FRAMEWORK_VENVS") or "{}")
    if not venvs:
        pytest.fail("BI100_FRAMEWORK_VENVS is not set: run `nox -s frameworks` (noxfile.py "
                    "builds the client venvs)")
    out = os.environ.get("BI100_FRAMEWORK_OUT") or tempfile.mkdtemp(prefix="bi100-fw-")
    os.makedirs(out, exist_ok=True)
    labels = _wanted()
    deadline = time.monotonic() + START_TIMEOUT
    logs = {label: os.path.join(out, f"server-{label}.log") for label in labels}
    procs = {label: _start(label, logs[label]) for label in labels}
    reports, versions, seconds = {}, {}, {}
    t0 = time.monotonic()
    try:
        servers = {label: served(label, procs[label], logs[label], deadline)
                   for label in labels}
        seconds["servers_ready"] = round(time.monotonic() - t0, 1)
        urls = [f"{label}=http://127.0.0.1:{servers[label]['port']}" for label in labels]
        for group, python in venvs.items():
            t1 = time.monotonic()
            proc = subprocess.run([python, os.path.join(HERE, "clients.py"), group, *urls],
                                  env=clean_env(CLIENT_ENV), cwd=HERE, capture_output=True,
                                  text=True, timeout=900)
            lines = [json.loads(ln[len(TAG):]) for ln in proc.stdout.splitlines()
                     if ln.startswith(TAG)]
            if proc.returncode != 0 or not lines:
                pytest.fail(f"client group {group} failed (rc={proc.returncode}):\n"
                            f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
            for r in lines:
                if "case" in r:
                    reports[(r["server"], r["case"])] = r
                else:
                    versions[group] = r["versions"]
            seconds[group] = round(time.monotonic() - t1, 1)
    finally:
        stop_servers(procs.values())
    vllm = servers[labels[0]]["vllm"]
    with open(os.path.join(out, f"outcomes-{vllm}.json"), "w") as fh:
        json.dump({"vllm": vllm, "servers": servers, "versions": versions, "seconds": seconds,
                   "cases": [reports[k] for k in sorted(reports)]}, fh, indent=1)
    with open(os.path.join(out, f"outcomes-{vllm}.md"), "w") as fh:
        fh.write(f"vLLM {vllm}; clients: {json.dumps(versions)}; wall seconds: "
                 f"{json.dumps(seconds)}\n\n" + _table(reports, labels))
    return {"reports": reports, "servers": servers, "versions": versions}


def test_the_servers_are_what_they_claim(outcomes):
    servers = outcomes["servers"]
    expect = os.environ.get("BI100_EXPECT_VLLM")
    for label, info in servers.items():
        if expect:
            assert info["vllm"] == expect, (label, info)
        if SERVERS[label]["VLLM_BI100_PATCH"] == "1":
            assert set(ROWS) <= set(info["patched"]), info
        else:
            assert info["patched"] == [], info


def test_every_case_ran_on_every_server(outcomes):
    groups = set(json.loads(os.environ["BI100_FRAMEWORK_VENVS"]))
    want = {(label, name) for label in _wanted() for name, (g, _, kind) in CASES.items()
            if g in groups and runs_on(kind, label)}
    assert set(outcomes["reports"]) == want


@pytest.mark.parametrize("name", list(CASES))
def test_default_path_served_with_the_shim(outcomes, name):
    shim = SHIM_FOR[CASES[name][2]]
    if shim not in _wanted():
        pytest.skip(f"no {shim} server in this run")
    r = outcomes["reports"].get((shim, name))
    if r is None:
        pytest.skip(f"the client venv of {name} was not built in this run")
    assert r["ok"], (f"{name} with the shim: HTTP {r['http']}, {r['requests']} request(s) "
                     f"reached the engine\n{r['error']}\nserver logged: {r['server_errors']}\n"
                     f"{r.get('traceback', '')}")

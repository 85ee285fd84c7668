"""The shim's series as vLLM 0.6.3's own server collects them (``probe_metrics.py``): the
multiprocessing front end's ``PROMETHEUS_MULTIPROC_DIR``, an engine process and a forked worker
that decode through the shim, vLLM's ``mount_metrics`` app serving /metrics.  On the official
wheel (no compiled kernels on CPU: every call falls back) and on the CoreX 3.2.3 stand-in
(native V1 up to 32,768 tokens, the pure-PyTorch decode above)."""

from __future__ import annotations

import os

import pytest
from helpers.probes import HARNESS, installed_vllm, run_probe

pytestmark = pytest.mark.real_vllm

REAL = os.path.join(HARNESS, "real")
INSTALLED = installed_vllm()


def _run(mode: str) -> dict:
    if not INSTALLED.startswith("0.6.3"):
        pytest.skip(f"vLLM 0.6.3's V0 front end and mount_metrics; this is {INSTALLED!r}")
    return run_probe(os.path.join(REAL, "probe_metrics.py"), "serve",
                     {"VLLM_BI100_PATCH": mode, "VLLM_BI100_METRICS_INTERVAL_S": "1"},
                     timeout=900)[0]


@pytest.fixture(scope="module")
def shim():
    return _run("1")


@pytest.fixture(scope="module")
def stock():
    return _run("0")


def _samples(families, name, **labels):
    fam = families.get(name)
    return [s for s in (fam["samples"] if fam else [])
            if all(s[1].get(k) == v for k, v in labels.items())]


def _sum(families, name, sample=None, **labels):
    return sum(s[2] for s in _samples(families, name, **labels)
               if sample is None or s[0] == sample)


def test_the_series_add_up_over_the_two_processes(shim):
    fams, workers = shim["families"], {w["who"]: w for w in shim["workers"]}
    assert shim["exitcode"] == 0
    calls = {who: w["counts"]["forward_decode"] for who, w in workers.items()}
    assert calls == {"engine": 5, "worker": 7}  # 4 + 1 and 6 + 1, one above 32,768 each
    assert {w["metrics"]["export"] for w in workers.values()} == {"files"}
    assert _sum(fams, "vllm_bi100:decode_calls") == shim["expected"] == 12
    assert _sum(fams, "vllm_bi100:decode_max_seq_len", "vllm_bi100:decode_max_seq_len_count") == 12
    le: dict = {}  # cumulative buckets, added up over the routes
    for s in _samples(fams, "vllm_bi100:decode_max_seq_len"):
        if s[0].endswith("_bucket"):
            le[s[1]["le"]] = le.get(s[1]["le"], 0) + s[2]
    assert le["512.0"] == 10 and le["32768.0"] == 10 and le["65536.0"] == 12
    if "corex" in INSTALLED:  # native V1 through 32,768 tokens, no V2: the long ones fall back
        assert _sum(fams, "vllm_bi100:decode_calls", route="native_v1") == 10
        assert _sum(fams, "vllm_bi100:decode_route_reasons", route="fallback",
                    reason="above_v1_limit") == 2
    else:  # the official wheel on CPU: no compiled kernels, every call falls back
        assert _sum(fams, "vllm_bi100:decode_calls", route="fallback") == 12
        assert _sum(fams, "vllm_bi100:decode_route_reasons", reason="no_native_ops") == 12
    info = _samples(fams, "vllm_bi100:info")  # one per configuration of the patching processes
    live = [s for s in info if s[2] == 1.0]
    assert live and all(s[1]["vllm_version"] == INSTALLED and s[1]["family"] == "v0.5.5"
                        for s in live)
    for s in info:  # a process's earlier configuration (its rows before a later module's): 0
        assert s in live or (s[2] == 0.0 and any(
            set(s[1]["rows"].split(",")) < set(x[1]["rows"].split(",")) for x in live)), info
    decoding = [s for s in live if "decode" in s[1]["rows"].split(",")]
    assert len(decoding) == 1  # the engine's and the worker's, added up
    # The front end: the serving rows (docs/serving-compat.md), and stream_delta on CoreX.
    front = [s for s in live if s not in decoding]
    assert len(front) <= 1 and all(set(s[1]["rows"].split(",")) <= SERVING for s in front), info
    assert all(fams[n]["type"] == ("gauge" if n.endswith(":info") else "histogram"
                                   if n.endswith("max_seq_len") else "counter")
               for n in fams if n.startswith("vllm_bi100:"))
    assert any(f.startswith("counter_vllm-bi100-") for f in shim["files"])


#: The rows a front end (API server process) applies.
SERVING = {"chat_request_compat", "completion_request_compat", "chat_tool_calls",
           "error_message_cause", "seq_limit_client", "seq_limit_openai", "seq_limit_engine",
           "unschedulable_group", "stream_delta", "async_add_request", "llm_batch_refusal",
           "guided_decoding_errors", "hermes_tool_start", "stream_finish_reason",
           "named_tool_stream", "hermes_tool_args", "hermes_cut_call", "responses_api",
           "reasoning_flags", "reasoning_parser", "reasoning_output", "reasoning_stream"}


def test_vllms_own_series_are_unchanged_and_the_kill_switch_shows_none(shim, stock):
    def vllm_series(run):
        return {n: f["type"] for n, f in run["families"].items() if n.startswith("vllm:")}

    assert vllm_series(stock) and vllm_series(shim) == vllm_series(stock)
    assert not [n for n in stock["families"] if n.startswith("vllm_bi100")]
    assert not [f for f in stock["files"] if "bi100" in f]
    assert {w["metrics"]["export"] for w in stock["workers"]} == {"not started"}

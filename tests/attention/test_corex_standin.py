"""The CoreX 3.2.3 stand-in (``nox -s real-corex-3.2.3``): the vendor build's own behaviour,
and the shim on it in auto mode, driven as the vendor XFormers backend drives vLLM.

Each probe runs in a fresh interpreter of the session's venv, where the shim is installed from
its wheel (sitecustomize, .pth and entry point are the real ones) and the official vLLM
0.6.3.post1 carries the vendor deltas of ``tests/harness/corex/standin.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers.probes import HARNESS, run_probe

pytestmark = pytest.mark.corex

COREX = os.path.join(HARNESS, "corex")
V1_LIMIT = 32768


def probe(mode: str, **env: str):
    return run_probe(os.path.join(COREX, "probe_corex.py"), mode, env, timeout=1200)


@pytest.fixture(scope="module")
def facts():
    return probe("facts")


@pytest.fixture(scope="module")
def stock():
    return probe("stock", VLLM_BI100_PATCH="0")


@pytest.fixture(scope="module")
def decode_grid():
    return probe("decode")


@pytest.fixture(scope="module")
def prefix_run():
    return probe("prefix")


def test_standin_is_the_vendor_build(facts):
    report, _ = facts
    assert report["version"] == "0.6.3+corex.3.2.3"
    assert report["has_triton"] is False
    assert report["v1_params"] == ["output", "query", "key_cache", "value_cache", "head_mapping",
                                   "scale", "block_tables", "context_lens", "block_size",
                                   "max_context_len", "alibi_slopes", "kv_cache_dtype"]
    assert report["v2_params"][7] == "num_kv_heads" and len(report["v2_params"]) == 22
    assert report["binds_context_attention_fwd"] is False
    assert report["ixformer"] == "0.4.0+corex.3.2.3"


def test_auto_mode_activates_and_reports_the_vendor_version(facts):
    report, log = facts
    st = report["status"]
    assert st["mode"] == "auto" and st["active"] is True, st
    assert st["vllm_version"] == "0.6.3+corex.3.2.3" and st["family"] == "v0.5.5"
    assert set(st["activated_by"]) >= {"sitecustomize"}
    # vllm.sequence: row stream_delta; vllm.core.scheduler, vllm.engine.llm_engine,
    # vllm.engine.async_llm_engine and vllm.entrypoints.llm (imported with the engine):
    # unschedulable_group, seq_limit_engine, guided_decoding_errors, async_add_request,
    # llm_batch_refusal
    assert sorted(st["patched"]) == ["_build_logits_processors", "_schedule_prefills",
                                    "_validate_and_add_requests", "add_request",
                                    "add_request_async", "forward_decode", "forward_prefix",
                                    "get_output_token_ids_to_return", "swap_blocks",
                                    "write_to_paged_cache"]
    assert "vllm-bi100-patch active: vLLM 0.6.3+corex.3.2.3" in log


def test_kill_switch_gives_the_vendor_build_with_its_hazards(stock):
    """Faithfulness: with the shim off, the stand-in fails exactly where the real build does."""
    report, log = stock
    assert report["decode_32768_worst"] <= 1.0  # the fake V1 is a correct kernel
    assert report["decode_32769"].startswith("BI100Hang: paged attention V1 with "
                                             "max_context_len=32769")
    assert report["forward_prefix"] == "NameError: name 'context_attention_fwd' is not defined"
    assert report["import_prefix_prefill"].startswith("RuntimeError: CoreX stand-in")
    assert report["swap_blocks"].startswith("AttributeError: module 'ixformer.functions' has no "
                                            "attribute 'swap_blocks'")
    assert report["v2"].startswith("NotImplementedError")
    assert "vllm-bi100-patch active" not in log


def _cases(grid):
    report, _ = grid
    return report["cases"]


def _ids(case):
    return (f"h{case['heads']}kv{case['kv_heads']}-d{case['head_size']}-{case['dtype']}-"
            + "+".join(map(str, case["lengths"])))


def test_decode_grid_matches_reference_on_the_route_the_length_allows(decode_grid):
    cases = _cases(decode_grid)
    assert len(cases) == 10 + 3 * 2 * 2 * 3
    failures = []
    for case in cases:
        name = _ids(case)
        if "error" in case:
            failures.append(f"{name}: {case['error']}")
            continue
        if case["worst"] > 1.0:
            failures.append(f"{name}: error {case['worst']:.2f} x tolerance")
        # The test can fail: a dropped last key moves the output by far more than the
        # tolerance (planted needles carry ~40% of the attention).
        assert case["needle_weight_effect"] > 0.1, name
        longest = max(case["lengths"])
        want = "native_v1" if longest <= V1_LIMIT else "fallback"
        routes = case["routes"]
        expected = {"native_v1": int(want == "native_v1"), "native_v2": 0,
                    "fallback": int(want == "fallback"),
                    "ixformer_v1": int(want == "native_v1")}
        if routes != expected:
            failures.append(f"{name}: routes {routes}, expected {expected}")
    assert not failures, "\n".join(failures)


def test_decode_status_counts_and_v2_never_called(decode_grid):
    report, log = decode_grid
    counts = report["status"]["counts"]
    cases = report["cases"]
    v1 = sum(1 for c in cases if max(c["lengths"]) <= V1_LIMIT)
    assert counts["decode_native_v1"] == v1 and counts["decode_native_v2"] == 0
    assert counts["decode_fallback"] == len(cases) - v1
    assert counts["forward_decode"] == len(cases)
    assert "NotImplementedError" not in log and "Error in calling custom op" not in log


def test_decode_status_shows_the_vendor_profile(decode_grid):
    st = decode_grid[0]["status"]
    native = st["native_ops"]
    assert native["native_ops"]["convention"] == "vendor"
    assert native["native_ops"]["paged_attention_v2"].startswith("absent (its body only raises")
    assert native["v1_limit"] == V1_LIMIT
    assert native["bands"][:2] == ["max_seq_len <= 32768: native V1",
                                   "max_seq_len > 32768: pure-PyTorch decode (no V2)"]


def test_prefix_chunked_and_prefix_hit_match_reference(prefix_run):
    report, _ = prefix_run
    results = report["results"]
    kinds = [(r["kind"], r["context"]) for r in results]
    assert kinds == [("chunk", 0), ("chunk", 64), ("chunk", 164), ("chunk", 200),
                     ("prefix-hit", 256)] * 2
    bad = [r for r in results if r["worst"] > 1.0]
    assert not bad, bad
    assert report["status"]["counts"]["forward_prefix"] == len(results)
    assert report["status"]["import_guard"]["prefix_prefill"] == "absent"


def test_doctor_on_the_standin_shows_the_vendor_profile():
    full = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_BI100")}
    full.pop("PYTHONPATH", None)
    proc = subprocess.run([sys.executable, "-m", "vllm_bi100_patch", "doctor"], env=full,
                          capture_output=True, text=True, timeout=600, cwd=COREX)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "[info] convention: vendor (Iluvatar: head_mapping, no scales)" in out
    assert "[info] paged_attention_v2: absent (its body only raises NotImplementedError)" in out
    assert "[info] route: max_seq_len <= 32768: native V1" in out
    assert "[info] route: max_seq_len > 32768: pure-PyTorch decode (no V2)" in out
    assert "verdict: WILL patch vLLM 0.6.3+corex.3.2.3 (family v0.5.5)" in out


def test_swapped_out_blocks_come_back_bit_identical():
    report, log = probe("blocks")
    assert report["bit_identical"] is True
    st = report["status"]
    assert "swap_blocks" in st["report"]["applied"]
    # The fake ixformer has copy_blocks (whether 3.2.3's does is not documented): not needed.
    assert st["report"]["skipped"]["copy_blocks"].startswith("not needed")
    assert st["counts"]["swap_blocks"] == 2


def test_selftest_on_the_standin_never_calls_v1_above_its_limit():
    """``vllm-bi100-patch selftest`` as an operator runs it on the vendor build: it finds the
    vendor V1 (ixformer's, whose fake raises ``BI100Hang`` above 32,768 tokens), times it at
    its limit and not one token above, checks it against the reference, and keeps Triton's
    prefix kernel out of the process."""
    full = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_BI100")}
    full.pop("PYTHONPATH", None)
    proc = subprocess.run(
        [sys.executable, "-m", "vllm_bi100_patch", "selftest", "--json", "--quick",
         "--heads", "2", "--kv-heads", "1", "--head-size", "128", "--layers", "2",
         "--dtype", "bfloat16", "--max-len", "40000", "--lengths", "1024,32768,32769",
         "--contexts", "0", "--chunk-size", "64", "--repeats", "1",
         "--check", "check_native_v1_matches_reference", "--check",
         "check_route_above_v1_limit"],
        env=full, capture_output=True, text=True, timeout=900, cwd=COREX)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert out["native"]["v1_limit"] == V1_LIMIT and out["native"]["convention"] == "vendor"
    assert out["native"]["native_v1"].startswith("paged_attention_v1 present (vendor")
    assert out["native"]["calls_max_seq_len"] == V1_LIMIT
    assert out["native"]["prefix_prefill"] in ("absent", "substitute")
    assert [(c["name"], c["ok"]) for c in out["checks"]] == [
        ("check_native_v1_matches_reference", True), ("check_route_above_v1_limit", True)]
    routes = [(t["route"], t["tokens"]) for t in out["timings"] if t["kernel"] == "decode"]
    assert routes == [("fallback", 1024), ("native_v1", 1024), ("fallback", 32768),
                      ("native_v1", 32768), ("fallback", 32769)]
    assert "BI100Hang" not in proc.stderr

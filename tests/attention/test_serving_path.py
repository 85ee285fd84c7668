"""Prompt prefill with head size 256 through the real 0.6.3 ``XFormersImpl.forward`` on the
CoreX stand-in (``probe_serving.py``): the vendor kernel's hazards with the shim off, the
``dense_prefill`` row with it on (varlen batches, the profiling run within budget), head 128
left on the vendor kernel."""

from __future__ import annotations

import os

import pytest
from helpers.probes import HARNESS, run_probe

pytestmark = pytest.mark.corex

COREX = os.path.join(HARNESS, "corex")


def probe(mode: str, **env: str):
    return run_probe(os.path.join(COREX, "probe_serving.py"), mode, env, timeout=1200)


def test_kill_switch_shows_the_vendor_flash_hazards():
    report, _ = probe("stock", VLLM_BI100_PATCH="0")
    assert report["causal_256"]["error"].startswith("BI100FlashError: flash attention forward: "
                                                    "causal attention with head size 256")
    garbage = report["alibi_256"]
    assert garbage["calls"]["fwop_garbage"] == 5 and garbage["rel_err"] >= 0.99
    ok = report["causal_128"]
    assert ok["calls"]["fwop"] == 1 and ok["rel_err"] <= ok["tolerance"]


def test_head_256_prompts_match_the_reference_and_head_128_keeps_the_vendor_kernel():
    report, log = probe("dense")
    assert "_run_memory_efficient_xformers_forward" in report["patched"]
    assert "dense_prefill" in log
    big = [c for c in report["cases"] if c["head_size"] == 256]
    assert len(big) == 12
    assert {(c["dtype"], c["heads"] // c["kv_heads"]) for c in big} == {
        ("float16", 4), ("float16", 8), ("bfloat16", 4), ("bfloat16", 8)}
    for c in big:
        assert "error" not in c, c
        assert c["calls"] == {"fwop": 0, "fwop_garbage": 0, "dense": 1, "vendor": 0}, c
        assert c["rel_err"] <= c["tolerance"], c
        if c["alibi"] or c["window"]:  # the reference without them is far off: it would show
            assert c["plain_vs_ref"] > 20 * c["tolerance"], c
    small = [c for c in report["cases"] if c["head_size"] == 128]
    assert len(small) == 2
    for c in small:
        assert c["calls"]["dense"] == 0 and c["calls"]["vendor"] == 1, c
        assert c["calls"]["fwop"] >= 1 and c["calls"]["fwop_garbage"] == 0, c
        assert c["rel_err"] <= c["tolerance"], c


def test_profiling_batch_of_8192_tokens_at_head_256_stays_within_the_budget():
    report, _ = probe("profile")
    assert report["calls"] == {"fwop": 0, "fwop_garbage": 0, "dense": 1, "vendor": 0}
    assert report["finite"] and report["rel_err"] <= report["tolerance"], report
    # Everything allocated inside forward: vLLM's output, the kernel's result, and the
    # kernel's working set, which must stay under VLLM_BI100_PREFIX_BUDGET_MB.
    work = report["peak_bytes"] - 2 * report["output_bytes"]
    assert 0 < work <= report["budget_bytes"], report
    assert report["untiled_scores_bytes"] > 10 * report["budget_bytes"]


def test_threshold_is_configurable():
    report, _ = probe("dense", VLLM_BI100_DENSE_HEAD_MAX="64")
    small = [c for c in report["cases"] if c["head_size"] == 128]
    for c in small:
        assert c["calls"]["dense"] == 1 and c["calls"]["fwop"] == 0, c
        assert c["rel_err"] <= c["tolerance"], c


def test_fp8_cache_is_refused_by_the_vendor_write_without_the_shim():
    report, _ = probe("fp8", VLLM_BI100_PATCH="0")
    assert report["write"].startswith("TypeError: ixformer reshape_and_cache writes")
    assert report["bytes_equal"] is False


def test_fp8_cache_gets_vllm_bytes_and_reads_back_within_fp8_tolerance():
    report, _ = probe("fp8")
    assert report["write"] == "no error" and report["bytes_equal"] is True
    counts = report["counts"]
    assert counts["kv_write_fp8"] == 3  # one call per sequence, each with 3 padding slots
    assert counts["decode_fallback"] == 1 and counts["decode_native_v1"] == 0  # no scales there
    # fp8 e4m3 keys and values (3 mantissa bits) on O(1) data: a few per cent of the largest
    # output; a dropped scale or garbage bytes are off by far more than 100%.
    assert report["decode_rel_err"] <= 0.1 and report["prefix_rel_err"] <= 0.1, report


def doctor(**env: str) -> str:
    import subprocess
    import sys

    from helpers.probes import clean_env

    proc = subprocess.run([sys.executable, "-m", "vllm_bi100_patch", "doctor"],
                          env=clean_env(env), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr  # the audit leaves the verdict
    return proc.stdout


def test_doctor_audits_the_vendor_ops():
    out = doctor()
    section = out.split("vendor ops (vllm._custom_ops) and engine timeout\n", 1)[1]
    lines = section.split("\nthis process", 1)[0].splitlines()
    states = {ln.split("] ", 1)[1].split(":", 1)[0]: ln.split("]", 1)[0].strip("[ ")
              for ln in lines}
    assert states == {"moe_align_block_size": "FAIL", "topk_softmax": "FAIL",
                      "invoke_fused_moe_kernel": "FAIL", "supports_moe_ops": "FAIL",
                      "swap_blocks": "ok", "VLLM_ENGINE_ITERATION_TIMEOUT_S": "WARN"}, section
    assert "MoE models (FusedMoE) will crash" in section
    assert "replaced by the shim's row swap_blocks" in section
    assert "60 s (vLLM's default)" in section and "the field ran 3600" in section


def test_doctor_fails_a_block_move_nothing_replaces_and_accepts_a_long_timeout():
    out = doctor(VLLM_BI100_PATCH_DISABLE="swap_blocks", VLLM_ENGINE_ITERATION_TIMEOUT_S="3600")
    assert ("[FAIL] swap_blocks: calls ixformer.functions.swap_blocks, which does not exist: "
            "preemption by swapping") in out
    assert "[ok  ] VLLM_ENGINE_ITERATION_TIMEOUT_S: 3600 s" in out

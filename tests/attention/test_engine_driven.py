"""vLLM's scheduler and model-input builder make the attention metadata of multi-step
scenarios; every attention call is checked against a dense float64 reference (driver.py).

Runs in the real-vLLM sessions of releases with the V0 input builder (noxfile ENGINE) and in
the CoreX 3.2.3 stand-in's.  One driver process runs every scenario with the shim; one more
runs the prefix-cache scenarios with the ``prefix_block_table`` row disabled, which on a build
with vLLM's bug must fail exactly as that bug does, and on a release with vLLM's fix (0.6.4+)
must pass: the row is then not needed, and not applied.
"""

from __future__ import annotations

import os
import sys

import pytest

from helpers.probes import HARNESS, clean_env, reports
from helpers.reference import TOLERANCE

import subprocess
import torch

pytestmark = pytest.mark.engine

DRIVER = os.path.join(HARNESS, "engine", "driver.py")
ROW = "prefix_block_table"
TOL = TOLERANCE[("fp32", torch.float32)]
BLOCK = 16
#: Small, so the decode scenario crosses it (native V1 below, where the build has one).
V1_LIMIT = "48"
SHIM = {"VLLM_BI100_PATCH": "1", "VLLM_BI100_V1_MAX_SEQ_LEN": V1_LIMIT}
PREFIX_HIT = ("hit_lt_chunk", "hit_eq_chunk", "hit_gt_chunk", "hit_inside_chunk",
              "hit_inside_block", "batch_shared")


def _run(names, env):
    proc = subprocess.run([sys.executable, DRIVER, *names], env=clean_env(env),
                          capture_output=True, text=True, timeout=900,
                          cwd=os.path.dirname(DRIVER))
    return {r["scenario"]: r for r in reports(proc)}, proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def with_row():
    return _run([], SHIM)


@pytest.fixture(scope="module")
def without_row():
    return _run(["hit_eq_chunk", "batch_shared"], dict(SHIM, VLLM_BI100_PATCH_DISABLE=ROW))


def _bug_in_build(result) -> bool:
    """The row is needed here (applied, or reported not needed because vLLM has its fix)."""
    report = result["status"]["report"]
    skipped = report["skipped"].get(ROW, "")
    assert ROW in report["applied"] or skipped.startswith("not needed"), report
    return ROW in report["applied"]


def _worst(result):
    return max(c["err"] for c in result["calls"])


@pytest.mark.parametrize("name", ["hit_lt_chunk", "hit_eq_chunk", "hit_gt_chunk",
                                  "hit_inside_chunk", "hit_inside_block", "batch_shared",
                                  "decode_steps", "preempt_recompute", "preempt_swap",
                                  "long_decode"])
def test_every_attention_call_matches_the_reference(with_row, name):
    result = with_row[0][name]
    assert result["ok"], result.get("trace")
    assert result["calls"], "no attention call"
    bad = [c for c in result["calls"] if c["err"] > TOL]
    assert not bad, bad[:3]


@pytest.mark.parametrize("name", PREFIX_HIT)
def test_chunks_past_a_cached_prefix_get_the_sequence_table(with_row, name):
    """The scenario has a chunk past its cached prefix (where vLLM 0.6.3 goes wrong), and
    every prefill chunk's block table is its sequence's own."""
    result = with_row[0][name]
    prompts = [c for c in result["calls"] if "table" in c]
    past = [c for c in prompts if c["cached_blocks"] and
            c["context_len"] > len(c["cached_blocks"]) * BLOCK]
    assert past, prompts
    for c in prompts:
        assert c["table"][:len(c["own_table"])] == c["own_table"], c
    if _bug_in_build(result):
        assert result["status"]["counts"][ROW] > 0


def test_decode_steps_follow_every_prefill(with_row):
    result = with_row[0]["decode_steps"]
    decodes = [c for c in result["calls"] if not c["prompt"]]
    assert {c["seq"] for c in decodes} == {0, 1} and len(decodes) == 2 * 11


@pytest.mark.parametrize("name,event", [("preempt_recompute", "preempted"),
                                        ("preempt_swap", "blocks_to_swap_in")])
def test_preemption_happens(with_row, name, event):
    result = with_row[0][name]
    assert any(event in e for e in result["events"]), result["events"]
    if name == "preempt_swap":
        assert any("blocks_to_swap_out" in e for e in result["events"])
        if "swap_blocks" in result["status"]["report"]["applied"]:  # CoreX 3.2.3
            assert all("(shim swap_blocks)" in e for e in result["events"] if "swap_" in e)
            assert result["status"]["counts"]["swap_blocks"] > 0


def test_decode_crosses_the_v1_limit(with_row):
    result = with_row[0]["long_decode"]
    lens = [c["positions"][0] + 1 for c in result["calls"] if not c["prompt"]]
    assert min(lens) <= int(V1_LIMIT) < max(lens)
    counts = result["status"]["counts"]
    assert counts["decode_fallback"] > 0  # past the limit: never the native V1
    if result["status"]["native_ops"]["native_ops"] is not None:  # the build has V1
        assert counts["decode_native_v1"] > 0  # within the limit


def test_without_the_row_the_bug_shows(with_row, without_row):
    """Row disabled: one sequence past its cached prefix gets the cached blocks only (the
    prefix kernel refuses it); batched, its row is zero-padded and block 0 read as context.
    On a release with vLLM's fix, both pass without the row."""
    results, _ = without_row
    single, batch = results["hit_eq_chunk"], results["batch_shared"]
    assert single["status"]["report"]["skipped"][ROW].startswith("disabled by")
    if not _bug_in_build(with_row[0]["hit_eq_chunk"]):
        assert single["ok"] and batch["ok"], (single.get("error"), batch.get("error"))
        assert _worst(single) <= TOL and _worst(batch) <= TOL
        return
    assert not single["ok"]
    assert single["error"].startswith(
        "ValueError: block_tables too short: context_lens[0]=64 needs 4 blocks of 16, "
        "block_tables has 2 columns"), single["error"]
    assert "pull request #9532" in single["error"] and ROW in single["error"]
    assert batch["ok"], batch.get("trace")
    wrong = [c for c in batch["calls"] if c["err"] > TOL]
    assert wrong and all("table" in c for c in wrong), batch["calls"]
    for c in wrong:  # the cached blocks, zero-padded to the batch's width
        cached = c["cached_blocks"]
        assert 0 < len(cached) < len(c["own_table"]), c
        assert c["table"] == cached + [0] * (len(c["table"]) - len(cached)), c
    assert _worst(batch) > 100 * TOL

"""The engine rows as vLLM drives them (killers.py, tp_logits.py): in the CoreX 3.2.3 stand-in
and the real sessions of releases with the V0 engine (noxfile ENGINE).  With the shim every
step is right; with the row disabled, a build with the bug fails exactly as it does in the
field, and a release with vLLM's fix passes (the row reports itself not needed there)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from helpers.probes import HARNESS, clean_env, reports

pytestmark = pytest.mark.engine

ENGINE = os.path.join(HARNESS, "engine")
SHIM = {"VLLM_BI100_PATCH": "1"}
ROWS = ("tp_empty_logits", "stream_delta", "mrope_positions")


def _run(script, args, env):
    proc = subprocess.run([sys.executable, os.path.join(ENGINE, script), *args],
                          env=clean_env(env), capture_output=True, text=True, timeout=900,
                          cwd=ENGINE)
    return reports(proc)


@pytest.fixture(scope="module")
def with_rows():
    return {r["scenario"]: r for r in _run("killers.py", [], SHIM)}


@pytest.fixture(scope="module")
def without_rows():
    env = dict(SHIM, VLLM_BI100_PATCH_DISABLE="stream_delta,mrope_positions")
    return {r["scenario"]: r for r in _run("killers.py", [], env)}


def _tp(env):
    return {r["rank"]: r for r in _run("tp_logits.py", ["mixed"], env)}


@pytest.fixture(scope="module")
def tp_with_row():
    return _tp(SHIM)


@pytest.fixture(scope="module")
def tp_without_row():
    return _tp(dict(SHIM, VLLM_BI100_PATCH_DISABLE="tp_empty_logits"))


def _needed(result, row):
    """The row is needed here (applied), or reported not needed (vLLM's own code is right)."""
    report = result["status"]["report"]
    skipped = report["skipped"].get(row, "")
    assert row in report["applied"] or skipped.startswith("not needed"), report
    return row in report["applied"]


# -- tp_empty_logits -----------------------------------------------------------------------
def test_tp_rank_1_gets_none_on_every_step_and_rank_0_the_gathered_logits(tp_with_row):
    rank0, rank1 = tp_with_row[0], tp_with_row[1]
    assert rank0["ok"] and rank1["ok"], (rank0.get("trace"), rank1.get("trace"))
    assert [s["selected"] for s in rank0["steps"]] == [s["selected"] for s in rank1["steps"]]
    assert any(s["selected"] == 0 for s in rank0["steps"]), rank0["steps"]  # a chunk alone
    assert all(s["seq_groups"] is None and s["result"] == "None" for s in rank1["steps"])
    for step in rank0["steps"]:
        if step["selected"]:
            assert step["result"] == f"tensor[{step['selected']}, 100]" and step["err"] < 1e-5
    if _needed(rank1, "tp_empty_logits"):
        assert rank1["status"]["counts"]["tp_empty_logits"] == sum(
            1 for s in rank1["steps"] if s["selected"] == 0)


def test_tp_without_the_row_the_vendor_worker_dies(tp_with_row, tp_without_row):
    rank1 = tp_without_row[1]
    assert rank1["status"]["report"]["skipped"]["tp_empty_logits"].startswith("disabled by")
    failed = [s for s in rank1["steps"] if s["result"] != "None"]
    if not _needed(tp_with_row[1], "tp_empty_logits"):
        assert not failed, rank1["steps"]  # stock vLLM's gather: None on rank 1
        return
    assert failed and all(s["selected"] == 0 for s in failed), rank1["steps"]
    assert {s["result"] for s in failed} == {"TypeError: 'NoneType' object is not iterable"}


# -- stream_delta --------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["stream_delta", "stream_delta_cached"])
def test_streamed_deltas_are_the_new_tokens_only(with_rows, name):
    result = with_rows[name]
    assert result["ok"], result.get("trace")
    steps = result["steps"]
    assert [s["chunks"] for s in steps[:3]] == [[32], [32], [16]]  # two chunks without a token
    assert steps[0]["token_ids"] == [] and steps[1]["token_ids"] == []
    streamed = [t for s in steps for t in s["token_ids"]]
    assert streamed == result["output_ids"] and len(streamed) == 4
    if _needed(result, "stream_delta"):
        assert result["status"]["counts"]["stream_delta"] >= 2


@pytest.mark.parametrize("name", ["stream_delta", "stream_delta_cached"])
def test_without_the_row_a_chunk_streams_the_whole_prompt(with_rows, without_rows, name):
    result = without_rows[name]
    assert result["ok"], result.get("trace")
    if not _needed(with_rows[name], "stream_delta"):
        assert [t for s in result["steps"] for t in s["token_ids"]] == result["output_ids"]
        return
    first = result["steps"][0]["token_ids"]
    assert len(first) == result["prompt_len"], first  # every prompt token, as new tokens
    assert result["steps"][1]["token_ids"] == first


# -- mrope_positions -----------------------------------------------------------------------
@pytest.mark.parametrize("name", ["mrope_chunked", "mrope_prefix_hit"])
def test_every_chunk_gets_its_tokens_true_mrope_positions(with_rows, name):
    result = with_rows[name]
    assert result["ok"], result.get("trace")
    steps = result["steps"]
    assert any(s["tokens"] < s["seq_lens"][0] for s in steps)  # chunks before the prompt's end
    bad = [s for s in steps if not s["positions_ok"] or s.get("error") or s["err"] != 0.0]
    assert not bad, bad
    assert all(s["positions"] == [3, s["tokens"]] for s in steps)
    if name == "mrope_prefix_hit":
        hit = [s for s in steps if s["request"] == "hit"]
        if hit[0]["seq_lens"] == [32]:  # 0.6.x schedules the cached prefix again, in chunks:
            assert (hit[0]["tokens"], hit[1]["tokens"], hit[1]["seq_lens"]) == (1, 16, [64])
        else:  # the scheduler starts past the 48 cached tokens (0.7)
            assert hit[0]["seq_lens"][0] - hit[0]["tokens"] == 48, hit
    if _needed(result, "mrope_positions"):
        assert result["status"]["counts"]["mrope_positions"] > 0


def test_without_the_row_mrope_chunks_crash_or_rotate_wrong(with_rows, without_rows):
    chunked, hit = without_rows["mrope_chunked"], without_rows["mrope_prefix_hit"]
    assert chunked["ok"] and hit["ok"], (chunked.get("trace"), hit.get("trace"))
    wrong = [s for s in chunked["steps"] + hit["steps"] if not s["positions_ok"]]
    if not _needed(with_rows["mrope_chunked"], "mrope_positions"):
        assert not wrong, wrong
        return
    first = chunked["steps"][0]
    assert first["positions"] == [3, 100] and first["error"] == (
        "RuntimeError: shape '[100, -1, 64]' is invalid for input of size 8192")
    warm = hit["steps"][0]  # 64 positions for 32 tokens: a multiple, so no error, wrong values
    assert warm["positions"] == [3, 64] and "error" not in warm and warm["err"] > 1.0
    full, partial = [s for s in hit["steps"] if s["request"] == "hit"][:2]
    assert full["positions"] == [3, 57] and "is invalid for input of size" in full["error"]
    assert partial["positions"] == [3, 40] and "is invalid for input of size" in partial["error"]


def test_doctor_shows_each_row_as_this_build_needs_it(with_rows, tp_with_row):
    proc = subprocess.run([sys.executable, "-m", "vllm_bi100_patch", "doctor"],
                          env=clean_env(SHIM), capture_output=True, text=True, timeout=600,
                          cwd=ENGINE)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    statuses = {"tp_empty_logits": tp_with_row[1]["status"],
                "stream_delta": with_rows["stream_delta"]["status"],
                "mrope_positions": with_rows["mrope_chunked"]["status"]}
    for row, attr in (("tp_empty_logits", "forward"),
                      ("stream_delta", "get_output_token_ids_to_return"),
                      ("mrope_positions", "_compute_multi_modal_input")):
        lines = [ln for ln in proc.stdout.splitlines() if f"] code check {attr}: " in ln]
        assert len(lines) == 1, proc.stdout
        if row in statuses[row]["report"]["applied"]:
            assert lines[0].startswith("  [ok  ]"), lines
        else:
            assert lines[0].startswith("  [info]") and "not needed in this build" in lines[0]

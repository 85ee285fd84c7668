"""``invariance.verdict``: whether every prompt and prefix attention row is the shim's (so
bit-identical however vLLM slices a prompt), and if not, why; and ``status()`` reporting it
for the rows this process applied."""

from __future__ import annotations

import importlib

import pytest

import vllm_bi100_patch
from vllm_bi100_patch.activation import config
from vllm_bi100_patch.ops import invariance

DISABLED = "disabled by " + config.DISABLE


def _report(applied=("decode", "prefix", "dense_prefill"), skipped=None, reason=None,
            version="0.6.3+corex.3.2.3"):
    return {"applied": list(applied), "skipped": dict(skipped or {}), "reason": reason,
            "vllm_version": version}


def _settings(**env):
    return config.load(dict({config.MODE: "1"}, **env))


OPT_IN = {config.PROMPT_ATTENTION: "shim"}
STOCK_SKIP = {"dense_prefill": "not needed: the backend's xops is xformers.ops, not ixformer's"}

# name -> (settings env, report, inactive, the verdict starts with, and contains)
CASES = {
    "opt-in, vendor build": (OPT_IN, _report(), None, "yes: every prompt and prefix attention",
                             "bit-identical however vLLM slices a prompt"),
    "opt-in, stock build": (OPT_IN, _report(version="0.7.3"), None, "yes:", "XFormers backend"),
    "default, vendor build": ({}, _report(), None, "partly: yes for head sizes above 128",
                              "no for head sizes <= 128: prompts without a cached prefix run "
                              "on the vendor's FwOp; set VLLM_BI100_PROMPT_ATTENTION=shim"),
    "default, threshold": ({config.DENSE_HEAD_MAX: "64"}, _report(), None,
                           "partly: yes for head sizes above 64", "<= 64"),
    "default, stock build": ({}, _report(("decode", "prefix"), STOCK_SKIP, version="0.6.3.post1"),
                             None, "no: prompts without a cached prefix run on the backend's own "
                             "kernel, not the shim's (the backend's xops is xformers.ops",
                             "set VLLM_BI100_PROMPT_ATTENTION=shim"),
    "opt-in refused": (OPT_IN, _report(("decode", "prefix"), {
        "dense_prefill": "not needed: VLLM_BI100_PROMPT_ATTENTION=shim cannot be applied to "
                         "vllm.attention.backends.xformers: _run_memory_efficient_xformers_forward "
                         "has the parameters"}), None,
        "no: VLLM_BI100_PROMPT_ATTENTION=shim cannot be applied", "has the parameters"),
    "dense row disabled": ({config.DISABLE: "dense_prefill"}, _report(
        ("decode", "prefix"), {"dense_prefill": DISABLED}), None,
        "no: the dense_prefill row is disabled by VLLM_BI100_PATCH_DISABLE",
        "backend's own kernel"),
    "prefix row disabled": ({config.DISABLE: "prefix"}, _report(
        ("decode", "dense_prefill"), {"prefix": DISABLED}), None,
        "no: the prefix row is not applied (disabled by VLLM_BI100_PATCH_DISABLE)",
        "prefix-cache hits"),
    "nothing patched": ({}, _report((), {}, reason="vLLM 0.6.3 fails the code check"), None,
                        "no: the prefix row is not applied (vLLM 0.6.3 fails the code check)",
                        "not computed by the shim"),
    "block-table row disabled before 0.6.4": (OPT_IN, _report(
        ("decode", "prefix", "dense_prefill"), {"prefix_block_table": DISABLED}), None,
        "no: the prefix_block_table row is disabled", "#9532"),
    "block-table row disabled from 0.6.4": (OPT_IN, _report(
        ("decode", "prefix", "dense_prefill"), {"prefix_block_table": DISABLED},
        version="0.7.3"), None, "yes:", ""),
    "backend not imported": ({}, _report(("decode", "prefix")), None,
                             "unknown: vLLM's XFormers backend is not imported", ""),
    "vLLM not imported": ({}, None, None, "unknown: vLLM's attention is not imported", ""),
    "kill switch": ({config.MODE: "0"}, None, None, "no: the shim is off (VLLM_BI100_PATCH=0)",
                    ""),
    "reverted": (OPT_IN, _report(()), "reverted: stock vLLM (apply() patches again)",
                 "no: the shim is not active in this process (reverted:", ""),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_verdict(case):
    env, report, inactive, start, contains = CASES[case]
    line = invariance.verdict(_settings(**env), report, inactive=inactive)
    assert line.startswith(start), line
    assert contains in line, line


def test_verdict_without_an_activation():
    assert invariance.verdict(None, None).startswith("unknown: the shim has not activated")


def test_counts_say_what_this_process_ran():
    line = invariance.verdict(_settings(), _report(), {"dense_prefill": 3, "dense_vendor": 2})
    assert line.endswith("(this process so far: 3 prompt calls on the shim's kernel, 2 on the "
                         "backend's own)"), line
    assert "this process so far" not in invariance.verdict(_settings(), _report(),
                                                           {"forward_prefix": 1})


def test_status_reports_it_for_the_rows_this_process_applied(fake_vllm_factory, monkeypatch):
    """A fake 0.6.3 tree (paged_attn only): prefix applied, no XFormers backend imported."""
    fake_vllm_factory("0.6.3.post1")
    monkeypatch.setenv(config.MODE, "1")
    vllm_bi100_patch.apply()
    assert vllm_bi100_patch.status()["slicing_invariant"].startswith(
        "unknown: vLLM's attention is not imported")
    importlib.import_module("vllm.attention.ops.paged_attn")
    assert vllm_bi100_patch.status()["slicing_invariant"].startswith(
        "unknown: vLLM's XFormers backend is not imported")
    vllm_bi100_patch.revert()
    assert vllm_bi100_patch.status()["slicing_invariant"].startswith(
        "no: the shim is not active in this process (reverted")


def test_status_with_the_prefix_row_disabled(fake_vllm_factory, monkeypatch):
    fake_vllm_factory("0.6.3.post1")
    monkeypatch.setenv(config.MODE, "1")
    monkeypatch.setenv(config.DISABLE, "prefix")
    vllm_bi100_patch.apply()
    importlib.import_module("vllm.attention.ops.paged_attn")
    assert vllm_bi100_patch.status()["slicing_invariant"].startswith(
        "no: the prefix row is not applied (disabled by VLLM_BI100_PATCH_DISABLE)")

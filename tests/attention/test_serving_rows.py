"""The serving-path rows on a real vLLM 0.6.3: applied on the CoreX stand-in only; on the
official wheel the XFormers backend (xformers' own kernels) and the cache write (which passes
the dtype on) are left as they are."""

from __future__ import annotations

import os

import pytest
from helpers.probes import HARNESS, installed_vllm, run_probe

pytestmark = pytest.mark.real_vllm

REAL = os.path.join(HARNESS, "real")
FAKE_XFORMERS = os.path.join(os.path.dirname(HARNESS), "fakes", "fake_xformers")
INSTALLED = installed_vllm()


@pytest.fixture(scope="module")
def rows():
    if not INSTALLED.startswith("0.6.3"):
        pytest.skip(f"the XFormers backend rows are for vLLM 0.6.3; this is {INSTALLED}")
    return run_probe(os.path.join(REAL, "probe_rows.py"), "rows",
                     {"VLLM_BI100_PATCH": "1", "PYTHONPATH": FAKE_XFORMERS}, timeout=600)[0]


def test_rows_apply_only_where_the_build_needs_them(rows):
    if INSTALLED == "0.6.3.post1":
        assert rows["xops"] == "xformers.ops"
        assert rows["dense_ours"] is False and rows["write_ours"] is False
        assert rows["skipped"]["dense_prefill"] == ("not needed: the backend's xops is "
                                                    "xformers.ops, not ixformer's")
        assert rows["skipped"]["kv_write"] == ("not needed: the build's ops.reshape_and_cache "
                                               "passes kv_cache_dtype and the scales on")
        assert "_run_memory_efficient_xformers_forward" not in rows["patched"]
        assert rows["counts"].get("dense_prefill", 0) == 0
    else:  # the CoreX stand-in
        assert rows["xops"] == "ixformer.contrib.xformers.ops"
        assert rows["dense_ours"] is True and rows["write_ours"] is True
        assert rows["counts"]["dense_prefill"] == 1
    # Either way the head-256 prompt batch is right (stock: xformers' own kernel).
    assert rows["prompt_max_err"] < 1e-4, rows


def test_doctor_finds_nothing_broken_in_the_official_ops():
    import subprocess
    import sys

    from helpers.probes import clean_env

    if INSTALLED != "0.6.3.post1":
        pytest.skip("the official wheel's audit (the stand-in's: test_serving_path.py)")
    proc = subprocess.run([sys.executable, "-m", "vllm_bi100_patch", "doctor"],
                          env=clean_env({"VLLM_BI100_PATCH": "1"}), capture_output=True,
                          text=True, timeout=600)
    section = proc.stdout.split("vendor ops (vllm._custom_ops) and engine timeout\n")[1]
    section = section.split("\nthis process")[0]
    assert section.splitlines()[0] == ("  [ok  ] vllm._custom_ops: every function calls only "
                                       "functions that exist"), section
    assert "FAIL" not in section

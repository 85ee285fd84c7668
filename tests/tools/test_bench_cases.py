"""tools/bench_cases.py: the benchmark's rows, their inputs and their account are what they
say (the account of a row is the account of the kernel call written out by hand)."""

from __future__ import annotations

import dataclasses
import os
import types

import pytest
import torch

from tools.account import DEVICES, Account, predict
from tools.bench_cases import (
    BENCH,
    FIELD,
    FIELD_FIGURES,
    Case,
    account_row,
    build,
    call,
    load_baseline,
    sections,
    this_package,
)
from vllm_bi100_patch.attention.kernels import paged_decode, paged_prefix
from vllm_bi100_patch.attention.kernels.forced import Forcing, forced, forcing
from vllm_bi100_patch.attention.kernels.prefill import dense

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_field_shape_is_issue_19s():
    assert (FIELD.heads, FIELD.kv_heads, FIELD.head_size, FIELD.block, FIELD.dtype) == (
        4, 1, 256, 16, torch.float16)
    assert FIELD.describe() == "4 query / 1 KV heads x 256, fp16, block 16"


def test_minimal_bytes_are_kv_once_plus_query_and_output():
    e = 2
    assert Case("decode", 1, 32768, 1, "native", FIELD).minimal_bytes() == (
        2 * 32768 * 1 * 256 * e + 2 * 1 * 4 * 256 * e)
    assert Case("prefix", 2, 1000, 24, "native", FIELD).minimal_bytes() == 2 * (
        2 * 1024 * 256 * e + 2 * 24 * 4 * 256 * e)
    assert Case("dense", 1, 0, 2048, "native", FIELD).minimal_bytes() == (
        2 * 2048 * 256 * e + 2 * 2048 * 4 * 256 * e)
    assert Case("decode", 8, 4096, shape=BENCH).kv_bytes() == 2 * 8 * 4096 * 8 * 128 * 2


def test_names():
    assert Case("decode", 8, 4096).name == "decode 8x4096"
    assert Case("prefix", 1, 16384, 512, "native", FIELD).name == "prefix 1x(16384+512) native"
    assert Case("dense", 1, 0, 2048, "tiled").name == "dense 1x2048 tiled"
    assert Case("dense", 1, 0, 2048, "tiled").base == "dense 1x2048"


def test_build_lays_out_vllm_caches_with_distinct_blocks():
    case = Case("decode", 3, 100, 1, "native", FIELD)
    q, kc, vc, bt, sl = build(case, "cpu").args
    assert q.shape == (3, 4, 256) and q.dtype == torch.float16
    assert kc.shape[1:] == (1, 256 // 8, 16, 8) and vc.shape[1:] == (1, 256, 16)
    assert sl.tolist() == [100, 100, 100] and bt.shape == (3, 7)
    used = bt.flatten().tolist()
    assert len(set(used)) == len(used) and max(used) < kc.shape[0]
    p = build(Case("prefix", 2, 40, 8, shape=FIELD), "cpu").args
    assert [t.shape[0] for t in p[:3]] == [16, 16, 16]
    assert p[6].tolist() == [0, 8, 16] and p[7].tolist() == [48, 48] and p[8].tolist() == [40, 40]


def _by_hand(case):
    """The account of the row's call written out without the case builders' ``call``."""
    inp = build(case, "cpu")
    with forced(compute="native", path="tiled", layout="generic"):
        with Account() as acc:
            if case.op == "decode":
                paged_decode(*inp.args, 256 ** -0.5, max_seq_len=case.ctx)
            elif case.op == "prefix":
                paged_prefix(*inp.args)
            else:
                dense.varlen_attention(*inp.args, [case.new], 256 ** -0.5, causal=True)
    return acc


@pytest.mark.parametrize("case", [Case("decode", 2, 300, 1, "native", FIELD),
                                  Case("prefix", 1, 200, 24, "native", FIELD),
                                  Case("dense", 1, 0, 48, "native", FIELD)],
                         ids=lambda c: c.name)
def test_account_row_is_the_account_of_the_call(case):
    row = account_row(build(case, "cpu"), this_package())
    acc = _by_hand(case)
    assert acc.launches > 0
    assert (row["launches"], row["bytes"], row["flops"], row["host_reads"]) == (
        acc.launches, acc.bytes, acc.flops, acc.host_reads)
    assert row["minimal"] == case.minimal_bytes() and row["bytes"] > row["minimal"]
    for key, dev in DEVICES.items():
        assert row["model_s"][key] == pytest.approx(predict(acc, dev))


def test_formulation_is_forced_inside_the_call_only():
    seen = []

    def spy(*args, **kwargs):
        now = forcing()
        seen.append((now.compute, now.path, now.layout))
        return paged_decode(*args, **kwargs)

    kernels = dataclasses.replace(this_package(), label="spy", paged_decode=spy)
    now = forcing()
    before = (now.compute, now.path, now.layout)
    for kind in ("default", "tiled", "native"):
        call(build(Case("decode", 1, 32, 1, kind, FIELD), "cpu"), kernels)()
    assert seen == [before, (before[0], "tiled", before[2]), ("native", "tiled", "generic")]
    now = forcing()
    assert (now.compute, now.path, now.layout) == before


def test_formulation_forces_an_older_checkouts_module_globals():
    """A baseline from before ``kernels.forced`` is forced through its modules' globals, and
    they come back after."""
    old_prefix, old_common = types.ModuleType("prefix"), types.ModuleType("_common")
    old_prefix.FORCE_PATH = old_common.FORCE_COMPUTE = old_common.FORCE_LAYOUT = None
    seen = []

    def spy(*args, **kwargs):
        seen.append((old_common.FORCE_COMPUTE, old_prefix.FORCE_PATH, old_common.FORCE_LAYOUT))
        return paged_decode(*args, **kwargs)

    kernels = dataclasses.replace(this_package(), label="old", paged_decode=spy,
                                  prefix=old_prefix, common=old_common, forced=None)
    for kind in ("default", "tiled", "native"):
        call(build(Case("decode", 1, 32, 1, kind, FIELD), "cpu"), kernels)()
    assert seen == [(None, None, None), (None, "tiled", None), ("native", "tiled", "generic")]
    assert (old_common.FORCE_COMPUTE, old_prefix.FORCE_PATH, old_common.FORCE_LAYOUT) == (
        None, None, None)
    assert forcing() == Forcing()


def test_native_rows_count_the_gpu_compute_mode():
    """fp32 (CPU) and native rows differ: the native one keeps K/V in float16 (32 tiles: the
    products' chunk of 64 is half padding, and still fewer bytes)."""
    inp = build(Case("decode", 1, 32768, 1, "default", FIELD), "cpu")
    fp32 = account_row(inp, this_package())
    inp.case = Case("decode", 1, 32768, 1, "native", FIELD)
    native = account_row(inp, this_package())
    assert native["bytes"] < fp32["bytes"]


def test_baseline_kernels_load_and_count_alike():
    """--baseline loads another checkout's kernels under their own name (here: this one)."""
    base = load_baseline(ROOT)
    assert base.paged_decode is not paged_decode
    assert base.paged_decode.__module__.startswith("bi100_baseline")
    case = Case("prefix", 1, 64, 16, "native", FIELD)
    mine = account_row(build(case, "cpu"), this_package())
    theirs = account_row(build(case, "cpu"), base)
    assert (mine["launches"], mine["bytes"]) == (theirs["launches"], theirs["bytes"])


def test_sections_hold_issue_19s_cases():
    (bench_title, bench), (field_title, field) = sections(quick=False, gpu=False,
                                                          bench_dtype=torch.bfloat16)
    names = {c.name: c for c in field}
    wanted = ["decode 1x32768 native", "decode 1x65536 native", "decode 1x131072 native",
              "decode 8x4096 native", "decode 32x1024 native", "prefix 1x(16384+512) native",
              "prefix 1x(32768+256) native", "dense 1x2048 native"]
    assert all(n in names and names[n].shape == FIELD for n in wanted)
    assert not any(names[n].timed for n in wanted)  # fp16 GPU-mode rows: account only on CPU
    assert set(FIELD_FIGURES) <= {names[n].base for n in wanted}
    assert "4 query / 1 KV heads x 256, fp16" in field_title and "32 query" in bench_title
    assert all(c.shape == BENCH for c in bench)
    gpu_field = sections(quick=False, gpu=True, bench_dtype=torch.bfloat16)[1][1]
    assert {c.base for c in gpu_field} >= set(FIELD_FIGURES)
    assert all(c.timed and c.kind == "default" for c in gpu_field)

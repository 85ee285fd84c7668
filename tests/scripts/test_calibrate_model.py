"""scripts/calibrate_model.py counts without computing: under ``tools.uncomputed.Uncomputed``
the account (launches, bytes, FLOPs of every launch) of the field's formulations and of the
shim's kernels in the GPU formulation is the account of a real run, at small shapes; the fit
recovers constants a synthetic card was given; the shipped constants are the script's."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

from tools.account import Account
from vllm_bi100_patch.ops.selftest import calibrated, fitted

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def cm():
    spec = importlib.util.spec_from_file_location(
        "calibrate_model", os.path.join(ROOT, "scripts", "calibrate_model.py"))
    module = importlib.util.module_from_spec(spec)
    saved = list(sys.path)
    spec.loader.exec_module(module)
    sys.path[:] = saved
    return module


def _real(fn, with_acc=False):
    with Account() as acc:
        fn(acc if with_acc else None)
    return [(x.name, x.bytes, x.flops) for x in acc.log]


def _counted(cm, fn):
    return [(x.name, x.bytes, x.flops) for x in cm.count(fn)]


def test_uncomputed_counts_what_a_real_run_counts(cm):
    scale = 256 ** -0.5
    dargs = cm._decode_args(6, 1, 3000)
    pargs = cm._prefix_args(4, 1, 1500, 256)
    cases = [
        (lambda acc: cm.field_decode(*dargs, scale), False),
        (lambda acc: cm.field_decode(*dargs, scale, acc), True),
        (lambda acc: cm.field_prefix(*pargs, scale), False),
    ]
    for fn, with_acc in cases:
        real = _real(fn, with_acc)
        assert real and _counted(cm, fn) == real
    with cm.forced(compute="native", layout="generic"):
        sargs = cm._prefix_args(4, 1, 3000, 512)
        for fn in (lambda acc: cm.paged_decode(*dargs[:5], scale, max_seq_len=3000),
                   lambda acc: cm.paged_prefix(*sargs, scale=scale)):
            real = _real(fn)
            assert real and _counted(cm, fn) == real


def test_the_fit_recovers_a_synthetic_cards_constants(cm):
    """Timings made by a model with known constants (launch 3 us; products 100 GB/s, gathers
    200, elementwise 500, reductions 700; 147 TFLOP/s) over the measured points' accounts are
    fitted back within a few percent where the points constrain them."""
    truth = {"launch_s": 3e-6, "matmul": 100e9, "gather": 200e9, "elementwise": 500e9,
             "reduction": 700e9, "flops": 147e12}
    points = [("field_decode", 6, 1, n, 1) for n in (16384, 32768, 65536)]
    points += [("field_gather", 6, 1, n, 1) for n in (16384, 65536)]
    points += [("field_prefix", 4, 1, n, 256) for n in (4096, 8192, 16384)]
    sums = [cm._summary(cm.field_account(*p)) for p in points]
    times = [cm._predict(s, truth) for s in sums]
    got = cm.fit(sums, times)
    for key in ("launch_s", "matmul", "gather"):
        assert got[key] == pytest.approx(truth[key], rel=0.05), (key, got)
    assert all(cm._predict(s, got) == pytest.approx(t, rel=0.02) for s, t in zip(sums, times))


def test_the_shipped_constants_are_a_fit_and_load():
    model = calibrated.load()
    assert set(fitted.CONSTANTS) == {"launch_us", "bandwidth_gb_per_s", "tflops", "source"}
    assert "scripts/calibrate_model.py" in fitted.CONSTANTS["source"]
    assert model.launch_s > 0 and all(v > 0 for v in model.bandwidth.values())
    assert calibrated.op_class("bmm") == "matmul" and calibrated.op_class("amax") == "reduction"
    assert calibrated.op_class("index") == "gather" and calibrated.op_class("exp") == "elementwise"

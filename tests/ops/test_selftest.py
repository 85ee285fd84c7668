"""``vllm-bi100-patch selftest`` on CPU: the command in both compute modes (small internal
configurations: the full checks run in ``tests/attention/kernels/test_device.py``, the ``--quick`` run
in ``test_bench_script.py``'s dry run of ``scripts/gpu_kernels_check.sh``), its JSON schema,
its exit codes, the native V1 never called above its limit (through the CoreX stand-in's fake
ixformer kernel), the per-rank shape of a model's config.json, and the projection and
recommendations from synthetic timings."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import types

import pytest
import torch

from vllm_bi100_patch import __main__ as cli_main
from vllm_bi100_patch.attention.native import RouteTable, Routing
from vllm_bi100_patch.attention.native.probe import OpsProfile
from vllm_bi100_patch.ops.selftest import checks, cli, native, plan, timing
from vllm_bi100_patch.ops.selftest.shape import Shape, ShapeError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = ["--heads", "4", "--kv-heads", "1", "--head-size", "64", "--layers", "3",
         "--dtype", "bf16", "--lengths", "256,512,1024", "--contexts", "0,256",
         "--chunk-size", "64", "--repeats", "1", "--max-len", "2048",
         "--check", "check_formulation", "--check", "check_unattended_slots"]


def _json(capsys, argv):
    rc = cli_main.main(["selftest", "--json", *argv])
    captured = capsys.readouterr()
    return rc, json.loads(captured.out), captured.err


@pytest.mark.parametrize("formulation", ["device", "gpu"])
def test_selftest_json_schema_in_both_compute_modes(capsys, formulation):
    rc, out, err = _json(capsys, SMALL + ["--formulation", formulation])
    assert rc == 0, out["checks"]
    assert {"device", "shape", "checks", "timings", "projection", "recommendations",
            "ok"} <= set(out)
    assert out["ok"] is True
    assert out["device"]["type"] == "cpu"
    assert out["device"]["formulation"] == ("gpu" if formulation == "gpu" else "cpu")
    assert {k: out["shape"][k] for k in ("heads", "kv_heads", "head_size", "layers", "dtype",
                                         "block_size")} == {
        "heads": 4, "kv_heads": 1, "head_size": 64, "layers": 3, "dtype": "bfloat16",
        "block_size": 16}
    assert [c["name"] for c in out["checks"]] == ["check_formulation",
                                                  "check_unattended_slots"]
    assert all(c["ok"] is True and c["seconds"] >= 0 for c in out["checks"])
    decode = [t for t in out["timings"] if t["kernel"] == "decode"]
    prefix = [t for t in out["timings"] if t["kernel"] == "prefix"]
    assert [t["tokens"] for t in decode] == [256, 512, 1024]
    assert [(t["context"], t["chunk"]) for t in prefix] == [(0, 64), (256, 64)]
    for t in out["timings"]:
        assert {"kernel", "route", "tokens", "ms", "launches", "bytes"} <= set(t)
        assert t["route"] == "fallback" and t["ms"] > 0
        assert t["launches"] > 0 and t["bytes"] >= timing.cache_bytes(
            Shape(4, 1, 64, 3, "bfloat16"), t["tokens"]) // 2
    # The projection: measured lengths plus --max-len (extrapolated), layers x per layer.
    proj = out["projection"]
    assert [p["tokens"] for p in proj] == [256, 512, 1024, 2048]
    assert proj[-1]["source"] == "extrapolated"
    for p in proj:
        assert p["token_ms"] == pytest.approx(3 * p["layer_ms"])
        assert p["tokens_per_s"] == pytest.approx(1e3 / p["token_ms"])
    assert out["prefill"][-1]["context"] == 2048 - 64
    names = [r["setting"] for r in out["recommendations"]]
    assert names == ["VLLM_BI100_DECODE_FALLBACK_ABOVE", "VLLM_BI100_PREFIX_BUDGET_MB",
                     "VLLM_ENGINE_ITERATION_TIMEOUT_S"]
    assert out["native"]["native_v1"] is None and out["native"]["prefix_prefill"] == "absent"
    assert "check_formulation" in err  # progress goes to stderr


def test_selftest_table_and_exit_1_when_a_check_fails(capsys, monkeypatch):
    def check_always_fails(device):
        raise AssertionError("wrong on purpose")

    monkeypatch.setattr(checks, "CHECKS", [checks.check_formulation, check_always_fails])
    argv = [a for a in SMALL if not a.startswith("check_") and a != "--check"]
    rc = cli_main.main(["selftest", *argv, "--lengths", "256", "--contexts", "0"])
    text = capsys.readouterr().out
    assert rc == cli.EXIT_FAILED
    assert "| check_always_fails | FAIL |" in text and "wrong on purpose" in text
    assert "| check_formulation | ok |" in text
    assert text.rstrip().endswith("RESULT: FAIL")
    assert "| decode | fallback | 256 |" in text


def test_selftest_reports_the_logit_precision_results(capsys):
    """Issue 34's rows (logit std 1-30, sinks 10-200) and issue 41's two worst diffuse rows
    at the model's shape in the GPU formulation: decode, prefix and dense, then the diffuse
    rows on the prefix after 16,384 tokens (``--quick``), each within twice the
    float32-score reference, in the JSON's ``precision`` section and the table's."""
    argv = [a for a in SMALL if not a.startswith("check_") and a != "--check"]
    argv += ["--check", "check_logit_precision", "--quick", "--formulation", "gpu",
             "--lengths", "256", "--contexts", "0"]
    rc, out, _ = _json(capsys, argv)
    assert rc == 0, out["checks"]
    rows = out["precision"]
    assert [(r["kernel"], r["row"]) for r in rows[:3]] == [
        ("decode", "sigma 1"), ("prefix", "sigma 1"), ("dense", "sigma 1")]
    assert len(rows) == 3 * 10 + 2 and {r["dtype"] for r in rows} == {"bfloat16"}
    assert [(r["kernel"], r["variant"], r["row"]) for r in rows[-2:]] == [
        ("prefix", "ctx 16384", "diffuse0.1 4.5"), ("prefix", "ctx 16384", "diffuse0.3 3")]
    assert all(0 < r["error"] and r["ratio"] <= 2.0 for r in rows), rows
    rc = cli_main.main(["selftest", *argv])
    text = capsys.readouterr().out
    assert "## precision: median relative error against float64" in text
    assert "| dense | plain | bfloat16 | sink 200 |" in text


def test_selftest_fails_where_the_precision_is_not_kept(capsys, monkeypatch):
    """A kernel at 3x the float32-score reference fails the check (exit 1), its row named."""
    def imprecise(*args, **kwargs):
        return [{"kernel": "decode", "variant": "plain", "dtype": "bfloat16",
                 "row": "sink 100", "error": 3e-3, "reference": 1e-3, "ratio": 3.0}]

    monkeypatch.setattr(checks, "precision_results", imprecise)
    argv = [a for a in SMALL if not a.startswith("check_") and a != "--check"]
    rc, out, _ = _json(capsys, argv + ["--check", "check_logit_precision", "--lengths", "256",
                                       "--contexts", "0"])
    assert rc == cli.EXIT_FAILED
    check = out["checks"][0]
    assert check["ok"] is False and "sink 100" in check["detail"], check
    assert out["precision"][0]["ratio"] == 3.0


def test_selftest_refuses_without_memory_for_the_smallest_case(capsys):
    rc = cli_main.main(["selftest", "--memory-mb", "64", *SMALL])
    assert rc == cli.EXIT_REFUSED
    assert "refused: not enough memory" in capsys.readouterr().err


def test_selftest_skips_a_case_above_the_memory_limit(capsys):
    # 512 MiB of checks + a 256 MiB working set fit in 900 MiB, a 262,144-token cache
    # (4 KV heads of 256, fp16: 1 GiB) does not.
    rc, out, _ = _json(capsys, ["--heads", "4", "--kv-heads", "4", "--head-size", "256",
                                "--dtype", "float16", "--lengths", "256,262144",
                                "--contexts", "0", "--chunk-size", "16", "--repeats", "1",
                                "--max-len", "262144", "--memory-mb", "900",
                                "--check", "none"])
    assert rc == 0
    assert [t["tokens"] for t in out["timings"] if t["kernel"] == "decode"] == [256]
    assert out["not_run"][0]["tokens"] == 262144
    assert "memory limit" in out["not_run"][0]["why"]


def test_usage_errors_exit_2(capsys, tmp_path):
    assert cli_main.main(["selftest", "--check", "check_nothing", *SMALL]) == 2
    assert "unknown check" in capsys.readouterr().err
    assert cli_main.main(["selftest", "--model", str(tmp_path)]) == 2
    assert "cannot read" in capsys.readouterr().err
    assert cli_main.main(["selftest", "--heads", "6", "--kv-heads", "4"]) == 2
    assert "multiple of kv_heads" in capsys.readouterr().err


def _fake_ixformer():
    path = os.path.join(ROOT, "tests", "harness", "corex", "fake_ixformer", "ixformer", "functions.py")
    spec = importlib.util.spec_from_file_location("selftest_fake_ixformer_functions", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _vendor_v1(limit=None):
    """CoreX 3.2.3's ``paged_attention_v1`` (11 positional arguments to ixformer) over the
    stand-in's fake ixformer kernel, which raises ``BI100Hang`` above 32,768 tokens."""
    fake = _fake_ixformer()

    def paged_attention_v1(output, query, key_cache, value_cache, head_mapping, scale,
                           block_tables, context_lens, block_size, max_context_len,
                           alibi_slopes=None, kv_cache_dtype=None):
        fake.vllm_single_query_cached_kv_attention(
            output, query, key_cache, value_cache, head_mapping, scale, block_tables,
            context_lens, block_size, max_context_len, alibi_slopes)

    def paged_attention_v2(out, exp_sum, max_logits, tmp_out, *args):
        raise NotImplementedError()

    ops = types.SimpleNamespace(paged_attention_v1=paged_attention_v1,
                                paged_attention_v2=paged_attention_v2)
    profile = OpsProfile(ops)
    table = RouteTable(profile, Routing(iluvatar=True, v1_max_seq_len=limit))
    return native.NativeV1(table, profile.v1), fake


def test_native_v1_is_never_called_above_its_limit():
    v1, fake = _vendor_v1(limit=1024)
    assert v1.limit == 1024 and v1.build == "vendor"
    shape = Shape(2, 1, 64, 2, "bfloat16", max_len=4096)
    p = timing.Plan([512, 1024, 2048], [], 64, 1, 16, 1 << 30, float("inf"))
    rows = timing.Recorder(shape, torch.device("cpu"), p, lambda line: None).run(v1)
    assert [(r["route"], r["tokens"]) for r in rows] == [
        ("fallback", 512), ("native_v1", 512), ("fallback", 1024), ("native_v1", 1024),
        ("fallback", 2048)]
    assert max(v1.calls) == 1024 and fake.CALLS["vllm_single_query_cached_kv_attention"] > 0
    before = dict(fake.CALLS)
    q, kc, vc, bt, sl = timing.decode_case(shape, 2048, torch.device("cpu"))
    with pytest.raises(native.HazardRefused, match="max_seq_len=2048 > its limit 1024"):
        v1.call(q, kc, vc, bt, sl, 2048, 0.125)
    assert fake.CALLS == before  # refused before any kernel saw it


def test_native_checks_on_the_vendor_kernel():
    v1, _ = _vendor_v1()
    assert v1.limit == 32768
    found = native.native_checks(v1, torch.bfloat16, 128)
    with checks.device_formulation(torch.device("cpu"), gpu=False):
        for check in found:
            check(torch.device("cpu"))
    assert max(v1.calls) == 700  # the reference check; the route check calls nothing
    with pytest.raises(checks.Skip):
        native.native_checks(None, torch.bfloat16, 128)[0](torch.device("cpu"))


def test_shape_from_a_model_config(tmp_path):
    cfg = {"num_attention_heads": 16, "num_key_value_heads": 2, "hidden_size": 4096,
           "num_hidden_layers": 40, "torch_dtype": "bfloat16", "max_position_embeddings": 262144}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    s = Shape.from_config(str(tmp_path), tensor_parallel_size=4)
    assert (s.heads, s.kv_heads, s.head_size, s.layers, s.dtype, s.max_len) == (
        4, 1, 256, 40, "bfloat16", 262144)  # KV heads replicated: one per rank
    nested = {"text_config": dict(cfg, head_dim=128), "architectures": ["X"]}
    assert Shape.from_dict(nested, 2).head_size == 128
    with pytest.raises(ShapeError, match="does not divide 16 query heads"):
        Shape.from_dict(cfg, 3)
    with pytest.raises(ShapeError, match="cannot read"):
        Shape.from_config(str(tmp_path / "missing"))


def _timings(v1, fb):
    rows = [{"kernel": "decode", "route": "native_v1", "tokens": n, "ms": ms}
            for n, ms in v1.items()]
    return rows + [{"kernel": "decode", "route": "fallback", "tokens": n, "ms": ms}
                   for n, ms in fb.items()]


def test_crossover_found_where_the_fallback_becomes_faster():
    # V1 grows 4x faster with length; the lines cross near 10,923 tokens.
    v1 = {n: 1.0 + n / 2048 for n in (4096, 8192, 16384, 32768)}
    fb = {n: 5.0 + n / 8192 for n in v1}
    got = plan.crossover(_timings(v1, fb))
    assert got["first_fallback"] == 16384 and got["last_v1"] == 8192
    assert got["estimate"] == pytest.approx(10923, abs=2)
    rec = plan.recommendations(_timings(v1, fb), [], 32768, 256)
    assert rec[0]["setting"] == "VLLM_BI100_DECODE_FALLBACK_ABOVE" and rec[0]["value"] == 8192


def test_no_crossover_where_v1_is_always_faster_and_noise_is_not_one():
    v1 = {n: 1.0 + n / 8192 for n in (4096, 8192, 16384, 32768)}
    fb = {n: 2.0 + n / 4096 for n in v1}
    fb[4096] = 0.5  # one noisy short-context win does not make a crossover
    assert plan.crossover(_timings(v1, fb)) is None
    rec = plan.recommendations(_timings(v1, fb), [], 32768, 256)
    assert "faster at every length" in rec[0]["why"] and rec[0]["value"] is None
    assert plan.crossover(_timings({}, fb)) is None  # nothing measured on both routes
    always = plan.crossover(_timings(v1, {n: 0.1 for n in v1}))
    assert always == {"first_fallback": 4096, "last_v1": None, "estimate": 4096}


def test_calibration_recovers_launch_cost_and_bandwidth():
    # 10 us per launch, 500 GB/s: ms = launches * 0.01 + bytes / 5e8.
    rows = [{"kernel": "decode", "route": "fallback", "account": "counted", "tokens": 0,
             "launches": n, "bytes": b, "ms": n * 0.01 + b / 5e8}
            for n, b in ((14, 1 << 20), (14, 64 << 20), (60, 8 << 20), (120, 256 << 20))]
    got = plan.calibration(rows)
    assert got["launch_us"] == pytest.approx(10.0) and got["bandwidth_gb_per_s"] == \
        pytest.approx(500.0)
    assert plan.calibration(rows[:1])["launch_us"] is None  # one row cannot separate them


def test_projection_routes_and_the_timeout_from_the_longest_chunk():
    rows = _timings({1024: 1.0, 32768: 4.0}, {n: n * 6 / 65536 for n in (1024, 32768, 65536)})
    proj = plan.projection(rows, 10, [1024, 32768, 65536, 131072], v1_limit=32768)
    assert [(p["tokens"], p["route"], p["source"]) for p in proj] == [
        (1024, "native_v1", "measured"), (32768, "native_v1", "measured"),
        (65536, "fallback", "measured"), (131072, "fallback", "extrapolated")]
    assert proj[2]["token_ms"] == 60.0 and proj[2]["tokens_per_s"] == pytest.approx(1e3 / 60)
    assert proj[3]["layer_ms"] == pytest.approx(12.0)  # the fallback's line, extended
    forced = plan.projection(rows, 10, [1024], v1_limit=32768, fallback_above=0)
    assert forced[0]["route"] == "fallback"
    prefix = [{"kernel": "prefix", "route": "fallback", "context": c, "chunk": 512,
               "tokens": c + 512, "ms": 1.0 + c / 1000} for c in (0, 100000)]
    steps = plan.prefill(prefix, 40, 262144, 512)
    assert steps[-1]["context"] == 262144 - 512 and steps[-1]["source"] == "extrapolated"
    assert steps[-1]["step_s"] == pytest.approx(40 * (1 + 261632 / 1000) / 1e3)  # ~10.5 s
    rec = plan.recommendations(rows, steps, 32768, 256)[-1]
    assert rec["setting"] == "VLLM_ENGINE_ITERATION_TIMEOUT_S" and rec["value"] == 60
    rec = plan.recommendations(rows, [dict(steps[-1], step_s=100.0)], 32768, 256)[-1]
    assert rec["value"] == 420  # 4 x 100 s, in whole minutes


def test_selftest_imports_no_vllm_and_the_status_command_no_torch():
    code = ("import sys, vllm_bi100_patch.ops.selftest.cli, vllm_bi100_patch.ops.selftest.native;"
            "assert not [m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')]")
    env = dict(os.environ, PYTHONPATH=ROOT)
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)
    code = ("import sys, vllm_bi100_patch.__main__, vllm_bi100_patch.ops.selftest;"
            "assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


def test_timing_rows_carry_the_calibrated_model_beside_the_measurement(capsys, monkeypatch):
    """The projected column comes from the constants that ship with the package: with
    distinctive constants (1 ms per launch, every byte and FLOP free) each counted row's
    ``projected_ms`` is its launch count in milliseconds, and the table prints it."""
    from vllm_bi100_patch.ops.selftest import calibrated, fitted

    shipped = calibrated.load()
    assert shipped.launch_s > 0 and set(shipped.bandwidth) == set(calibrated.CLASSES)
    monkeypatch.setattr(fitted, "CONSTANTS", {
        "launch_us": 1000.0, "bandwidth_gb_per_s": dict.fromkeys(calibrated.CLASSES, 1e12),
        "tflops": 1e9, "source": "test"})
    rc, out, _ = _json(capsys, SMALL)
    assert rc == 0
    for t in out["timings"]:
        assert t["projected_ms"] == pytest.approx(t["launches"], rel=1e-6), t
        assert t["ms"] > 0  # the measurement is kept beside it
    assert out["calibration"]["fitted_model"]["launch_us"] == 1000.0
    rc = cli_main.main(["selftest", *SMALL])
    table = capsys.readouterr().out
    assert rc == 0 and "| kernel | route | tokens | ms | projected ms | launches |" in table
    assert "projected ms: the model calibrated on BI-V100's published timings, 1000.00 us" \
        in table

"""The shim's counters as Prometheus series (docs/metrics-operators.md): what is counted, the names,
and how they reach prometheus_client's multiprocess files or an in-process registry.

vLLM's own /metrics app is driven in tests/patching/counting/test_metrics_real.py; here fake vLLM trees
and prometheus_client itself (a test dependency of the unit session, never of the package)."""

from __future__ import annotations

import glob
import os
import shutil
import textwrap

import pytest
import torch
from helpers.probes import reports
from helpers.shim import ROOT, run_python

from fakes.fake_vllm import write_fake_vllm
from vllm_bi100_patch.activation import config
from vllm_bi100_patch.ops import doctor
from vllm_bi100_patch.patching.counting import metrics, export
from vllm_bi100_patch.patching import registry, versions
from vllm_bi100_patch.attention import native
from vllm_bi100_patch.attention.native import Routing, routes
from vllm_bi100_patch.attention import paged_attention

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client.multiprocess import MultiProcessCollector  # noqa: E402

ON = config.load({config.MODE: "1"})


def scraped(path):
    """{(sample name, sorted labels): value} as vLLM's multiprocess /metrics adds them up."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for m in MultiProcessCollector(None, path=path).collect() for s in m.samples}


def total(samples, name, **labels):
    return sum(v for (n, lab), v in samples.items()
               if n == name and all(dict(lab).get(k) == w for k, w in labels.items()))


# ------------------------------------------------------------------------- what is counted


def test_every_route_row_and_kernel_rule_has_a_reason_label():
    names = {r.name for r in routes.ROUTES} | {r.name for r in routes.KERNEL_RULES}
    assert names | {"kernel_absent"} <= set(metrics.REASONS)


class _V1Only:
    def __init__(self):
        self.calls = 0

    def paged_attention_v1(self, out, *args):
        self.calls += 1
        out.fill_(1.0)


class _Both(_V1Only):
    def paged_attention_v2(self, out, *args):
        out.fill_(2.0)


def _call(max_seq_len, lens=(5, 30)):
    from helpers.reference import make_cache, make_tables

    g = torch.Generator().manual_seed(0)
    kc, vc = make_cache(8, 2, 64, 16, torch.float32, gen=g)
    bt = make_tables(list(lens), 16, 2, 8, g)
    values = dict(query=torch.randn(len(lens), 4, 64, generator=g), key_cache=kc,
                  value_cache=vc, block_tables=bt, seq_lens=torch.tensor(lens, dtype=torch.int32),
                  max_seq_len=max_seq_len, kv_cache_dtype="auto", num_kv_heads=2, scale=0.125,
                  alibi_slopes=None)
    return paged_attention.decode_call(values)


@pytest.mark.parametrize("ops, routing, max_seq_len, seen", [
    (_Both(), Routing(), 30, ("native_v1", "occupancy_v1", 30)),
    (_V1Only(), Routing(v1_max_seq_len=64), 30, ("native_v1", "v1", 30)),
    (_V1Only(), Routing(v1_max_seq_len=64), 100, ("fallback", "v1_length", 100)),
    (None, Routing(), 30, ("fallback", "no_ops", 30)),
    (_Both(), Routing(fallback_above=0), 40, ("fallback", "forced", 40)),
])
def test_the_decoder_reports_route_reason_and_max_seq_len(ops, routing, max_seq_len, seen):
    decoder = native.build(ops, routing)
    got = []
    decoder.observer = lambda *a: got.append(a)
    decoder.decode(_call(max_seq_len))
    assert got == [seen]


def test_a_stub_kernel_falls_back_as_kernel_absent():
    class Stub:
        def paged_attention_v1(self, *args):
            raise NotImplementedError("stub")

    decoder = native.build(Stub(), Routing())
    got = []
    decoder.observer = lambda *a: got.append(a)
    decoder.decode(_call(30))
    assert got == [("fallback", "kernel_absent", 30)]


def test_every_counter_a_row_declares_is_on_metrics():
    """The counters come from the one registry (``counters.snapshot()``): a row's counter
    without a series of its own (the engine rows' tp_empty_logits, stream_delta,
    mrope_positions) is exported as ``calls_total{counter=...}``."""
    from vllm_bi100_patch.patching import table
    from vllm_bi100_patch.patching import factories

    declared = {name for row in table.PATCHES for name in row.counters}
    assert {"tp_empty_logits", "stream_delta", "mrope_positions"} <= set(metrics.GENERIC_COUNTS)
    routes = {"decode_native_v1", "decode_native_v2", "decode_fallback"}  # the decoder's own
    assert declared == (set(metrics.NAMED_COUNTS) - routes | set(metrics.TOLD_ELSEWHERE)
                        | set(metrics.GENERIC_COUNTS))
    for name in sorted(declared):
        factories.counter(name).add(3)
    fams = {f[0]: f[3] for f in metrics.families(metrics.snapshot(), None)}
    for name in metrics.GENERIC_COUNTS:
        assert ("vllm_bi100:calls_total", (("counter", name),), 3) in fams["vllm_bi100:calls"]
        assert name in metrics.HELP["calls"]
    for name, (series, labels) in metrics.NAMED_COUNTS.items():
        if name not in routes:
            assert (metrics.PREFIX + series + "_total", labels, 3) in fams[metrics.PREFIX + series]


def test_histogram_buckets_around_the_v1_limit():
    tally = metrics.Tally()
    for n in (512, 32768, 32768):
        tally.decode("native_v1", "v1", n)
    tally.decode("fallback", "v1_length", 32769)
    fams = {f[0]: f for f in metrics.families(tally.snapshot(), None)}
    samples = {(s, lab): v for s, lab, v in fams["vllm_bi100:decode_max_seq_len"][3]}
    bucket = "vllm_bi100:decode_max_seq_len_bucket"
    assert samples[(bucket, (("route", "native_v1"), ("le", "512.0")))] == 1
    assert samples[(bucket, (("route", "native_v1"), ("le", "32768.0")))] == 2
    assert samples[(bucket, (("route", "fallback"), ("le", "32768.0")))] == 0
    assert samples[(bucket, (("route", "fallback"), ("le", "65536.0")))] == 1
    assert samples[("vllm_bi100:decode_max_seq_len_sum", (("route", "native_v1"),))] == 66048
    reasons = {lab: v for s, lab, v in fams["vllm_bi100:decode_route_reasons"][3]}
    assert reasons == {(("route", "native_v1"), ("reason", "only_kernel")): 3,
                       (("route", "fallback"), ("reason", "above_v1_limit")): 1}


def test_fixed_series_exist_from_zero_and_every_series_is_documented():
    info = {"shim_version": "9", "vllm_version": "0.6.3", "family": "v0.5.5", "rows": "decode"}
    fams = {f[0]: f for f in metrics.families({("count", "new_row_calls"): 2}, info)}
    kinds = {metrics.PREFIX + n: k for n, k, _, _ in metrics.SERIES}
    assert all(kinds[name] == kind for name, kind, _, _ in fams.values())
    calls = {lab: v for _, lab, v in fams["vllm_bi100:decode_calls"][3]}
    assert calls == {(("route", r),): 0 for r in metrics.ROUTES}
    assert {"vllm_bi100:prefix_calls", "vllm_bi100:block_moves", "vllm_bi100:fp8_cache_writes",
            "vllm_bi100:prefix_fp32_reruns", "vllm_bi100:dense_prefill_calls"} <= set(fams)
    assert "vllm_bi100:refused_calls" not in fams  # only once something was refused
    assert fams["vllm_bi100:calls"][3] == [("vllm_bi100:calls_total",
                                            (("counter", "new_row_calls"),), 2.0)]
    assert fams["vllm_bi100:info"][3] == [("vllm_bi100:info", tuple(sorted(info.items())), 1.0)]
    readme = open(os.path.join(ROOT, "docs", "metrics-operators.md")).read()
    for name in metrics.names():
        assert f"`{name}`" in readme, name


@pytest.fixture
def patched(paged_attn_module):
    mod = paged_attn_module("0.6.3.post1")
    assert registry.apply_to(mod, ON).reason is None
    return mod


def test_patched_calls_are_counted_by_route_path_and_refusal(patched):
    from attention.test_patched_calls import _prefix_values

    fam = versions.family_for(versions.VersionInfo("0.6.3.post1"))
    call = _call(30)
    patched.PagedAttention.forward_decode(call.query, call.key_cache, call.value_cache,
                                          call.block_tables, call.seq_lens, 30, "auto", 2,
                                          0.125, None, 1.0, 1.0)
    with pytest.raises(ValueError, match="max_seq_len=10 is below"):
        patched.PagedAttention.forward_decode(call.query, call.key_cache, call.value_cache,
                                              call.block_tables, call.seq_lens, 10, "auto", 2,
                                              0.125, None, 1.0, 1.0)
    values = _prefix_values(fam)
    patched.PagedAttention.forward_prefix(*[values[p] for p in fam.prefix_params])
    got = metrics.snapshot()
    assert got[("count", "decode_fallback")] == 1 and got[("count", "forward_decode")] == 2
    assert got[("reason", "fallback", "no_ops")] == 1 and got[("len_sum", "fallback")] == 30
    assert got[("refused", "decode", "ValueError")] == 1
    path = "sdpa" if got.get(("prefix_calls", "sdpa")) else "tiled"
    assert got[("prefix_calls", path)] == 1
    assert got[("prefix_tokens", path)] == 9  # new tokens 5 + 1 + 3
    assert got[("prefix_context", path)] == int(values["context_lens"].sum())


def test_interval_zero_leaves_the_decode_path_without_an_observer(paged_attn_module):
    mod = paged_attn_module("0.6.3.post1")
    off = config.load({config.MODE: "1", config.METRICS_INTERVAL: "0"})
    assert registry.apply_to(mod, off).reason is None
    assert paged_attention._patched["decoder"].observer is None
    registry.revert_all()
    assert registry.apply_to(mod, ON).reason is None
    assert paged_attention._patched["decoder"].observer.__qualname__.endswith("observe")


# --------------------------------------------------------------------------- the exporter


def test_files_hold_the_counts_and_old_info_is_zeroed(tmp_path, monkeypatch):
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    exporter = export.Exporter(5)
    exporter.info = {"shim_version": "1", "vllm_version": "v", "family": "f", "rows": "decode"}
    metrics.TALLY.decode("native_v2", "occupancy_v2", 40000)
    metrics.TALLY.refused("prefix", ValueError("x"))
    exporter.tick()
    exporter.info = dict(exporter.info, rows="decode,prefix")
    metrics.TALLY.decode("native_v2", "occupancy_v2", 100)
    exporter.tick()
    got = scraped(str(tmp_path))
    assert total(got, "vllm_bi100:decode_max_seq_len_count", route="native_v2") == 2
    assert total(got, "vllm_bi100:decode_max_seq_len_bucket", route="native_v2",
                 le="65536.0") == 2  # cumulative, as /metrics shows them
    assert total(got, "vllm_bi100:refused_calls_total", row="prefix", error="ValueError") == 1
    assert total(got, "vllm_bi100:info", rows="decode,prefix") == 1
    assert total(got, "vllm_bi100:info", rows="decode") == 0
    names = [os.path.basename(p) for p in glob.glob(str(tmp_path / "*.db"))]
    assert sorted(n.split("_", 1)[0] for n in names) == ["counter", "gauge", "histogram"]
    assert all(n.endswith(f"vllm-bi100-{os.getpid()}.db") for n in names)


@pytest.mark.parametrize("how", ["recreated", "emptied", "another"])
def test_a_recreated_emptied_or_other_directory_gets_every_series_again(tmp_path, monkeypatch,
                                                                        how, caplog):
    """vLLM's front end (or an operator) may remove and recreate the directory: the files the
    exporter mapped are gone, and the next flush writes every series into the new ones."""
    first = tmp_path / "prom"
    first.mkdir()
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(first))
    exporter = export.Exporter(5)
    exporter.info = {"shim_version": "1", "vllm_version": "v", "family": "f", "rows": "decode"}
    metrics.TALLY.decode("native_v1", "fits_v1", 100)
    exporter.tick()
    assert total(scraped(str(first)), "vllm_bi100:decode_route_reasons_total", route="native_v1") == 1
    now = first
    if how == "recreated":
        shutil.rmtree(first)
        first.mkdir()
    elif how == "emptied":
        for name in os.listdir(first):
            os.remove(first / name)
    else:
        now = tmp_path / "other"
        now.mkdir()
        monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(now))
    for _ in range(2):  # the second flush finds everything in place: no second reopen
        exporter.tick()
    got = scraped(str(now))
    assert total(got, "vllm_bi100:decode_route_reasons_total", route="native_v1") == 1
    assert total(got, "vllm_bi100:info", rows="decode") == 1
    assert exporter.mode == "files" and exporter.reopened == 1 and exporter.last_error is None
    assert export.state.__doc__  # status() reads the same fields (test_status_edges)
    assert exporter.directory == str(now)
    assert "writing every series again" in caplog.text


def test_a_failing_flush_is_reported_until_one_succeeds(tmp_path, monkeypatch):
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    exporter = export.Exporter(5)
    real = metrics.families

    def broken(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(metrics, "families", broken)
    exporter.tick()
    assert exporter.mode == "failed" and "No space left" in exporter.last_error
    monkeypatch.setattr(metrics, "families", real)
    exporter.tick()
    assert exporter.mode == "files" and exporter.flushes == 1 and exporter.last_error is None


def test_a_process_where_no_row_applied_exports_nothing_until_one_does():
    """vLLM 0.6.3's front end imports vllm.sequence (a target module) and, on the official
    wheel, applies no row there: no exporter, no info series of no rows on /metrics."""
    from types import SimpleNamespace

    report = SimpleNamespace(vllm_version="0.6.3.post1", family="v0.5.5", applied=[])
    export.start(1, report)
    assert export.exporter() is None and export.state()["export"] == "not started"
    export.start(1, SimpleNamespace(**dict(vars(report), applied=["stream_delta"])))
    assert export.exporter() is not None
    assert export.exporter().info["rows"] == "stream_delta"


def test_a_directory_that_does_not_exist_is_not_created(tmp_path, monkeypatch):
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path / "missing"))
    exporter = export.Exporter(5)
    exporter.tick()
    assert exporter.mode == "no directory" and not (tmp_path / "missing").exists()


def _fake(tmp_path):
    return write_fake_vllm(str(tmp_path / "fake"), "0.6.3.post1")


def _env(fake_root, **extra):
    env = {"PYTHONPATH": os.pathsep.join([ROOT, fake_root, os.path.join(ROOT, "tests")]),
           "VLLM_BI100_PATCH": "1"}
    env.update(extra)
    return env


#: Defines ``work(n)``: n patched decode calls (fake vLLM 0.6.3: the pure-PyTorch fallback).
WORK = """
    import os, sys, threading
    import torch
    torch.set_num_threads(1)  # no OpenMP pool in a parent: a forked child would hang in it

    def work(n):
        import vllm.attention.ops.paged_attn as pa
        from helpers.reference import make_cache, make_tables
        g = torch.Generator().manual_seed(0)
        kc, vc = make_cache(8, 2, 64, 16, torch.float32, gen=g)
        bt = make_tables([20, 5], 16, 2, 8, g)
        q = torch.randn(2, 4, 64, generator=g)
        lens = torch.tensor([20, 5], dtype=torch.int32)
        for _ in range(n):
            pa.PagedAttention.forward_decode(q, kc, vc, bt, lens, 20, "auto", 2, 0.125, None,
                                             1.0, 1.0)
"""


def test_processes_add_up_forked_children_count_from_zero_and_exits_flush(tmp_path):
    """A parent, a forked child (multiprocessing's fork: it leaves through os._exit) and a
    spawned child each decode, with an interval far longer than the run: the files vLLM's
    /metrics reads hold every call once (3 + 5 + 7 + 2), the fork's inherited 3 not twice."""
    code = WORK + """
    import multiprocessing as mp

    def spawned(n):
        import vllm_bi100_patch
        vllm_bi100_patch.apply()
        work(n)

    if __name__ == "__main__":
        import vllm_bi100_patch as shim
        shim.apply()
        work(3)
        for method, target, n in (("fork", work, 5), ("spawn", spawned, 7)):
            p = mp.get_context(method).Process(target=target, args=(n,))
            p.start(); p.join(120)
            assert p.exitcode == 0, (method, p.exitcode)
        work(2)
        report(metrics=shim.status()["metrics"], threads=[t.name for t in threading.enumerate()])
    """
    out = reports(run_python(code, env=_env(_fake(tmp_path), PROMETHEUS_MULTIPROC_DIR=str(tmp_path),
                                            VLLM_BI100_METRICS_INTERVAL_S="600"),
                             script=True, timeout=400))[0]
    assert out["metrics"]["export"] == "files" and "vllm-bi100-metrics" in out["threads"]
    got = scraped(str(tmp_path))
    assert total(got, "vllm_bi100:decode_calls_total") == 17
    assert total(got, "vllm_bi100:decode_calls_total", route="fallback") == 17
    assert total(got, "vllm_bi100:decode_max_seq_len_count") == 17
    assert total(got, "vllm_bi100:decode_route_reasons_total", reason="no_native_ops") == 17
    assert total(got, "vllm_bi100:info") == 1  # max over the three processes, one config
    assert len(glob.glob(str(tmp_path / "counter_vllm-bi100-*.db"))) == 3


def test_without_a_directory_nothing_is_written_until_a_registry_is_in_use(tmp_path):
    code = WORK + """
    import vllm_bi100_patch as shim
    from vllm_bi100_patch.patching.counting import export
    shim.apply()
    work(2)
    e = export.exporter()
    e.tick()
    before = dict(mode=e.mode, imported="prometheus_client" in sys.modules)
    import prometheus_client
    e.tick()
    work(1)
    text = prometheus_client.generate_latest().decode()
    report(before=before, mode=e.mode,
           lines=[ln for ln in text.splitlines() if ln.startswith("vllm_bi100:")])
    """
    out = reports(run_python(code, env=_env(_fake(tmp_path)), timeout=300))[0]
    assert out["before"] == {"mode": "idle", "imported": False}
    assert out["mode"] == "registry"
    lines = out["lines"]
    assert 'vllm_bi100:decode_calls_total{route="fallback"} 3.0' in lines  # live at scrape
    assert 'vllm_bi100:decode_max_seq_len_count{route="fallback"} 3.0' in lines
    assert 'vllm_bi100:decode_max_seq_len_bucket{le="+Inf",route="fallback"} 3.0' in lines
    assert os.listdir(tmp_path) == ["fake"]


@pytest.mark.parametrize("extra", [{"VLLM_BI100_PATCH": "0"},
                                   {"VLLM_BI100_METRICS_INTERVAL_S": "0"}])
def test_kill_switch_and_interval_zero_export_nothing(tmp_path, extra):
    prom = tmp_path / "prom"
    prom.mkdir()
    code = textwrap.dedent("""
        import sys, threading
        import vllm_bi100_patch as shim
        shim.apply()
        import vllm.attention.ops.paged_attn
        import prometheus_client
        report(threads=[t.name for t in threading.enumerate()], status=shim.status(),
               loaded="vllm_bi100_patch.patching.counting.export" in sys.modules)
    """)
    out = reports(run_python(code, env=_env(_fake(tmp_path), PROMETHEUS_MULTIPROC_DIR=str(prom),
                                            **extra)))[0]
    assert "vllm-bi100-metrics" not in out["threads"] and os.listdir(prom) == []
    if extra.get("VLLM_BI100_PATCH") == "0":
        assert out["loaded"] is False and out["status"]["metrics"] == {"export": "not started"}
    else:
        assert out["status"]["patched"] and out["status"]["metrics"]["export"] == "not started"


# --------------------------------------------------------------------------------- doctor


@pytest.mark.parametrize("environ, version, state, words", [
    ({"PROMETHEUS_MULTIPROC_DIR": "{tmp}"}, "0.6.3.post1", "ok", "multiprocess files in"),
    ({"PROMETHEUS_MULTIPROC_DIR": "{tmp}/nope"}, "0.6.3.post1", "WARN", "is not a directory"),
    ({}, "0.6.3+corex.3.2.3", "ok", "multiprocessing front end"),
    ({}, "0.11.0", "WARN", "V1 engine"),
    ({"VLLM_USE_V1": "0"}, "0.8.5", "ok", "multiprocessing front end"),
    ({config.METRICS_INTERVAL: "0"}, "0.6.3.post1", "info", "none: "),
    ({config.MODE: "0"}, "0.6.3.post1", "info", "stock vLLM's"),
])
def test_doctor_says_whether_and_how_metrics_are_exported(tmp_path, environ, version, state,
                                                          words):
    env = {k: v.replace("{tmp}", str(tmp_path)) for k, v in environ.items()}
    env.setdefault(config.MODE, "1")
    checks = doctor.metrics_checks(config.load(env), versions.VersionInfo(version), env)
    assert checks[0][:2] == (state, "export") and words in checks[0][2], checks
    if state != "info":
        assert checks[1][1] == "names" and "vllm_bi100:decode_calls_total" in checks[1][2]


def test_doctor_warns_of_a_directory_it_cannot_write(tmp_path, monkeypatch):
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, m: False if p == str(tmp_path) else real(p, m))
    checks = doctor.metrics_checks(ON, versions.VersionInfo("0.6.3.post1"),
                                   {"PROMETHEUS_MULTIPROC_DIR": str(tmp_path)})
    assert checks[0][0] == "WARN" and "not writable" in checks[0][2]


def test_doctor_exports_nothing_itself_and_has_a_metrics_section():
    sections, _ = doctor.doctor_sections()
    assert export.suppressed and export.state() == {"export": "off"}
    assert "metrics (vLLM's /metrics)" in [s.title for s in sections]


def test_the_metrics_doc_and_the_grafana_panel_name_only_series_that_exist():
    import json
    import re

    known = set(metrics.names())
    known |= {n + s for n in known for s in ("_bucket", "_count", "_sum")}
    panel = open(os.path.join(ROOT, "docs", "grafana-bi100-panel.json")).read()
    exprs = [t["expr"] for p in json.loads(panel)["panels"] for t in p["targets"]]
    readme = open(os.path.join(ROOT, "docs", "metrics-operators.md")).read()
    used = set(re.findall(r"vllm_bi100:[a-z0-9_]+", readme + "\n".join(exprs)))
    assert used and used <= known, used - known
    assert any('route="fallback"' in e and "/ sum by (instance)" in e for e in exprs)


def test_prometheus_client_is_no_runtime_dependency():
    import configparser

    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(ROOT, "setup.cfg"))
    assert "prometheus" not in cfg["options"]["install_requires"]

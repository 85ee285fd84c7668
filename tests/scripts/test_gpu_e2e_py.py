"""scripts/gpu_e2e.py without vLLM or a GPU: the server command of each profile, merging the
status dumps of a run's processes, the checks of the summary, and one whole ``run_mode`` +
``summary`` against a stub server process on 127.0.0.1 (start, readiness, requests, status dumps
at exit, stop)."""

from __future__ import annotations

import json
import os
import sys
import textwrap

import pytest

from scripts import gpu_e2e

SCRIPTS = os.path.dirname(os.path.abspath(gpu_e2e.__file__))


def test_server_command_of_each_profile():
    gpu = gpu_e2e.server_command("/v/bin/python", "/m", 8000, "gpu", "float16")
    assert gpu[:4] == ["/v/bin/python", os.path.join(SCRIPTS, "gpu_e2e.py"), "serve", "/m"]
    assert gpu[gpu.index("--host") + 1] == "127.0.0.1"
    for flag in ("--enable-chunked-prefill", "--enable-prefix-caching",
                 "--disable-frontend-multiprocessing"):
        assert flag in gpu
    assert gpu_e2e.PROFILES["gpu"]["env"] == {"VLLM_USE_V1": "0", "VLLM_ATTENTION_BACKEND": "XFORMERS"}
    smoke = gpu_e2e.server_command("/v/bin/python", "/m", 8000, "cpu-smoke", "float32")
    assert "--no-enable-prefix-caching" in smoke and "--enable-chunked-prefill" not in smoke
    with pytest.raises(ValueError, match="profile='tpu'"):
        gpu_e2e.server_command("/v/bin/python", "/m", 8000, "tpu", "float32")


def test_merge_status_over_processes():
    assert gpu_e2e.merge_status([]) is None
    merged = gpu_e2e.merge_status([
        {"pid": 1, "patched": ["forward_decode"], "counts": {"forward_decode": 3},
         "prefix_prefill_module": "absent"},
        {"pid": 2, "patched": ["forward_prefix", "forward_decode"],
         "counts": {"forward_decode": 4, "forward_prefix": 1}, "prefix_prefill_module": "substitute"},
        {"pid": 3, "error": "ImportError('vllm_bi100_patch')", "prefix_prefill_module": "absent"},
    ])
    assert merged["pids"] == [1, 2, 3]
    assert merged["patched"] == ["forward_decode", "forward_prefix"]
    assert merged["counts"] == {"forward_decode": 7, "forward_prefix": 1}
    assert merged["prefix_prefill_module"] == "substitute"
    assert merged["errors"] == ["ImportError('vllm_bi100_patch')"]
    real = gpu_e2e.merge_status([{"prefix_prefill_module": "real:/x/prefix_prefill.py"},
                                 {"prefix_prefill_module": "substitute"}])
    assert real["prefix_prefill_module"].startswith("real"), "one real module anywhere counts"


def _run(ids_first, status, error=""):
    comps = None if ids_first is None else {
        "first": [{"ids": ids, "logprobs": [-1.0] * len(ids)} for ids in ids_first],
        "again": [{"ids": ids_first[-1], "logprobs": [-1.0] * len(ids_first[-1])}],
        "seconds": 1.0}
    return {"completions": comps, "status": status, "meta": {"error": error}}


GOOD_SHIM = {"patched": ["forward_decode", "forward_prefix"],
             "counts": {"forward_decode": 5, "forward_prefix": 2},
             "prefix_prefill_module": "substitute"}
STOCK = {"patched": [], "counts": {}, "prefix_prefill_module": "absent"}


def _failed(checks):
    return [name for name, ok, _ in checks if not ok]


def test_evaluate_passes_a_good_run():
    checks = gpu_e2e.evaluate(_run([[1, 2], [3, 4]], STOCK), _run([[1, 2], [3, 4]], GOOD_SHIM))
    assert _failed(checks) == [] and len(checks) == 8


@pytest.mark.parametrize("shim, stock_status, failed", [
    (_run([[1, 2], [3, 5]], GOOD_SHIM), STOCK, ["greedy tokens identical (stock vs shim)"]),
    (_run([[1, 2], [3, 4]], dict(GOOD_SHIM, counts={"forward_decode": 5})), STOCK,
     ["shim forward_prefix called"]),
    (_run([[1, 2], [3, 4]], dict(GOOD_SHIM, prefix_prefill_module="real:/p.py")), STOCK,
     ["Triton prefix_prefill never imported (shim run)"]),
    (_run([[1, 2], [3, 4]], GOOD_SHIM), dict(STOCK, patched=["forward_decode"]),
     ["stock run unpatched"]),
    (_run(None, None, error="ServerError: not ready"), STOCK,
     ["shim server answered", "shim active in the engine process", "shim forward_decode called",
      "shim forward_prefix called", "Triton prefix_prefill never imported (shim run)"]),
])
def test_evaluate_fails_what_went_wrong(shim, stock_status, failed):
    assert _failed(gpu_e2e.evaluate(_run([[1, 2], [3, 4]], stock_status), shim)) == failed


def test_stock_run_without_any_status_is_not_called_unpatched():
    checks = gpu_e2e.evaluate(_run([[1]], None), _run([[1]], GOOD_SHIM))
    assert _failed(checks) == ["stock run unpatched"]


# --- one whole run against a stub server ----------------------------------------------------

STUB = textwrap.dedent('''
    """A stand-in for `vllm serve` on 127.0.0.1: /health after 0.3 s, greedy-looking answers
    (VLLM_BI100_PATCH=1 and STUB_DIFFER=1 change them), the status dumps of gpu_e2e.py."""
    import http.server, json, os, signal, sys, time, types
    sys.path.insert(0, os.environ["STUB_SCRIPTS"])
    import gpu_e2e
    shim = os.environ["VLLM_BI100_PATCH"] == "1"
    counts = {"forward_decode": 0, "forward_prefix": 0}
    sys.modules["vllm_bi100_patch"] = types.SimpleNamespace(status=lambda: {
        "patched": ["forward_decode", "forward_prefix"] if shim else [], "counts": dict(counts)})
    gpu_e2e._start_dumping(os.environ[gpu_e2e.STATUS_ENV], interval=0.2)
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))  # as uvicorn: atexit hooks run
    argv = sys.argv[1:]
    assert argv[0] == "serve" and argv[argv.index("--host") + 1] == "127.0.0.1", argv
    t0 = time.time()

    class H(http.server.BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass
        def do_GET(self):
            self.send_response(200 if time.time() - t0 > 0.3 else 503)
            self.send_header("Content-Length", "0")
            self.end_headers()
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            n = len(body["prompt"].split())
            ids = [(n + i) % 50 for i in range(body["max_tokens"])]
            if shim and os.environ.get("STUB_DIFFER") == "1" and n > 400:
                ids[-1] += 1
            if shim:
                counts["forward_prefix"] += 1
                counts["forward_decode"] += len(ids) - 1
            out = {"choices": [{"text": "", "logprobs": {
                       "tokens": ["token_id:%d" % i for i in ids],
                       "token_logprobs": [-0.25] * len(ids)}}],
                   "usage": {"completion_tokens": len(ids), "prompt_tokens": n}}
            data = json.dumps(out).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    port = int(argv[argv.index("--port") + 1])
    http.server.ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
''')


@pytest.fixture
def stub_server(tmp_path, monkeypatch):
    stub = tmp_path / "stub_serve.py"
    stub.write_text(STUB)
    real = gpu_e2e.server_command

    def command(python, model_dir, port, profile, dtype):
        return [sys.executable, str(stub)] + real(python, model_dir, port, profile, dtype)[2:]

    monkeypatch.setattr(gpu_e2e, "server_command", command)
    monkeypatch.setenv("STUB_SCRIPTS", SCRIPTS)
    return tmp_path


@pytest.mark.parametrize("differ", [False, True])
def test_run_mode_and_summary_against_a_stub_server(stub_server, monkeypatch, capsys, differ):
    monkeypatch.setenv("STUB_DIFFER", "1" if differ else "0")
    out = stub_server / "out"
    out.mkdir()
    for mode, patch in gpu_e2e.MODES:
        meta = gpu_e2e.run_mode(mode, patch, python=sys.executable, model_dir="/m", out=str(out),
                                profile="gpu", dtype="float32", ready_timeout=30, max_tokens=6,
                                meta={"vllm": "stub", "torch": "stub", "gpu": "none"}, settle_s=0.3)
        assert meta["error"] == "" and meta["ready_s"] is not None, meta
        assert meta["shutdown_rc"] == 0, "SIGTERM should end the stub cleanly"
    saved = json.loads((out / "shim.meta.json").read_text())
    assert saved["mode"] == "shim" and saved["gpu"] == "none"
    comps = json.loads((out / "shim.completions.json").read_text())
    assert len(comps["first"]) == len(gpu_e2e.PROMPT_WORDS) and len(comps["again"]) == gpu_e2e.REPEATS
    shim = gpu_e2e.load_run(str(out), "shim")["status"]
    assert shim["counts"]["forward_prefix"] == len(gpu_e2e.PROMPT_WORDS) + gpu_e2e.REPEATS, \
        "the dump at exit holds every request's counts"
    capsys.readouterr()
    rc = gpu_e2e.summary(str(out), bench="skipped", total_s=3)
    text = capsys.readouterr().out
    assert "[PASS] shim forward_prefix called" in text and "[PASS] stock run unpatched" in text
    if differ:
        assert rc == 1 and "[FAIL] greedy tokens identical (stock vs shim)" in text
        # the 420- and 700-word prompts, first and again
        assert "differing: [6, 7, 10, 11]" in text
    else:
        assert rc == 0 and "[PASS] greedy tokens identical (stock vs shim)" in text


def test_run_mode_records_a_server_that_never_comes_up(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_e2e, "server_command",
                        lambda *a: [sys.executable, "-c", "print('boom'); raise SystemExit(4)"])
    meta = gpu_e2e.run_mode("stock", "0", python=sys.executable, model_dir="/m",
                            out=str(tmp_path), profile="gpu", dtype="float32", ready_timeout=30)
    assert "exited with 4" in meta["error"] and meta["ready_s"] is None
    assert not (tmp_path / "stock.completions.json").exists()
    assert json.loads((tmp_path / "stock.meta.json").read_text())["error"] == meta["error"]

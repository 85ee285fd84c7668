#!/usr/bin/env python3
"""Per-call cost of the patched ``forward_decode`` path: this tree against another (``--base``:
a checkout of the commit before the metrics), timed alternately in one run.

Two worker interpreters, one per tree, each patch a fake vLLM 0.6.3 (``tests/fakes``) whose
native ``paged_attention_v1`` does nothing, so a call is the shim's whole wrapper path and
nothing else: argument reading, the ``DecodeCall``, the route choice, the counters (and, in
this tree, the metrics' observer and refusal counting).  Rounds alternate A B B A; each round
times ``--calls`` calls; the table gives the median ns per call of each tree and the median
of the paired differences.

    python3 scripts/bench_metrics_overhead.py --base DIR [--rounds 20]
        [--multiproc-dir]   # with PROMETHEUS_MULTIPROC_DIR set (the exporter writes files)
        [--interval S]      # VLLM_BI100_METRICS_INTERVAL_S with --multiproc-dir (default 5)
        [--cpu N]           # pin both workers to one CPU
        [--same]            # both workers run the other tree: the method's noise floor
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

WORKER = r"""
import json, os, sys, time, collections
if os.environ.get("BENCH_CPU"):
    os.sched_setaffinity(0, {int(os.environ["BENCH_CPU"])})
import torch
torch.set_num_threads(1)
from vllm_bi100_patch.patching import hardware
hardware.ixformer_present = lambda: True  # take the fake ops as native kernels
import vllm._custom_ops as ops
ops._ref = lambda *a: None                 # the kernel does nothing: time the wrapper path
ops.CALLS = collections.deque(maxlen=1)
import vllm_bi100_patch as shim
shim.apply()
import vllm.attention.ops.paged_attn as pa
from vllm_bi100_patch.patching import registry
assert registry.is_ours(vars(pa.PagedAttention)["forward_decode"])
kc = torch.zeros(4, 2, 16, 16, 4); vc = torch.zeros(4, 2, 64, 16)
bt = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
lens = torch.tensor([20, 5], dtype=torch.int32)
q = torch.zeros(2, 4, 64)
fd = pa.PagedAttention.forward_decode
def batch(n):
    t0 = time.perf_counter_ns()
    for _ in range(n):
        fd(q, kc, vc, bt, lens, 20, "auto", 2, 0.125, None, 1.0, 1.0)
    return (time.perf_counter_ns() - t0) / n
batch(2000)
route = [k for k, v in shim.status()["counts"].items() if k.startswith("decode_") and v]
print(json.dumps({"ready": True, "route": route}), flush=True)
for line in sys.stdin:
    print(json.dumps({"ns": batch(int(line))}), flush=True)
"""


def _fake_vllm(where: str) -> str:
    sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
    from fakes.fake_vllm import write_fake_vllm

    return write_fake_vllm(os.path.join(where, "fake"), "0.6.3.post1")


def _worker(tree: str, fake: str, env_extra: dict) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_BI100", "PYTHONPATH"))}
    env.update(PYTHONPATH=os.pathsep.join([tree, fake]), VLLM_BI100_PATCH="1", **env_extra)
    proc = subprocess.Popen([sys.executable, "-c", WORKER], env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, cwd=tree)
    ready = json.loads(proc.stdout.readline())  # type: ignore[union-attr]
    assert ready.get("ready"), ready
    proc.route = ready["route"]  # type: ignore[attr-defined]
    return proc


def _time(proc: subprocess.Popen, calls: int) -> float:
    proc.stdin.write(f"{calls}\n")  # type: ignore[union-attr]
    proc.stdin.flush()  # type: ignore[union-attr]
    return float(json.loads(proc.stdout.readline())["ns"])  # type: ignore[union-attr]


def main(argv: list) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="the other tree (a checkout)")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--calls", type=int, default=5000)
    ap.add_argument("--cpu", type=int, default=None,
                    help="pin both workers to this CPU (less noise on a loaded machine)")
    ap.add_argument("--same", action="store_true",
                    help="both workers run --base (an A/A run: the noise floor of the method)")
    ap.add_argument("--multiproc-dir", action="store_true",
                    help="set PROMETHEUS_MULTIPROC_DIR (this tree's exporter writes files)")
    ap.add_argument("--interval", default="5",
                    help="VLLM_BI100_METRICS_INTERVAL_S with --multiproc-dir (the default: 5)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bi100-bench-") as tmp:
        fake = _fake_vllm(tmp)
        extra = {} if args.cpu is None else {"BENCH_CPU": str(args.cpu)}
        if args.multiproc_dir:
            os.mkdir(os.path.join(tmp, "prom"))
            extra.update(PROMETHEUS_MULTIPROC_DIR=os.path.join(tmp, "prom"),
                         VLLM_BI100_METRICS_INTERVAL_S=args.interval)
        procs = {"base": _worker(os.path.abspath(args.base), fake, extra),
                 "this": _worker(os.path.abspath(args.base) if args.same else ROOT, fake,
                                 extra)}
        times: dict = {"base": [], "this": []}
        try:
            for r in range(args.rounds):
                order = ("base", "this") if r % 2 == 0 else ("this", "base")
                for name in order:
                    times[name].append(_time(procs[name], args.calls))
        finally:
            for p in procs.values():
                p.stdin.close()  # type: ignore[union-attr]
                p.wait(30)
        files = sorted(os.listdir(os.path.join(tmp, "prom"))) if args.multiproc_dir else []
    diffs = [t - b for t, b in zip(times["this"], times["base"])]
    base, this = statistics.median(times["base"]), statistics.median(times["this"])
    print(f"patched forward_decode, native V1 route (no-op kernel), {args.rounds} rounds x "
          f"{args.calls} calls, alternating; PROMETHEUS_MULTIPROC_DIR "
          f"{'set' if args.multiproc_dir else 'unset'}; routes {procs['this'].route}")  # type: ignore[attr-defined]
    print("| tree | median ns/call | min | max |")
    print("|---|---|---|---|")
    for name, label in (("base", args.base),
                        ("this", args.base + " again" if args.same else "this tree")):
        t = times[name]
        print(f"| {label} | {statistics.median(t):.0f} | {min(t):.0f} | {max(t):.0f} |")
    print(f"| difference (this - base) | {this - base:+.0f} | {min(times['this']) - min(times['base']):+.0f} "
          f"| |")
    print(f"median of the {len(diffs)} paired differences (this - base, same round): "
          f"{statistics.median(diffs):+.0f} ns per call")
    if files:
        print("files written:", ", ".join(files))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

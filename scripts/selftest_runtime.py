#!/usr/bin/env python3
"""How long ``vllm-bi100-patch selftest`` takes here: the command run ``--runs`` times in
fresh interpreters, one after the other, the median wall time (interpreter start, imports,
checks, timings) and the median of the run's own ``elapsed_s``, with the CPU named.  A
benchmark, not a test: the bound (``--quick`` within 90 s on the project's 2-core CPU) is
checked by reading this table, never by a timed assertion.

    python scripts/selftest_runtime.py                      # --quick, 3 runs
    python scripts/selftest_runtime.py --runs 5 -- --formulation gpu
    python scripts/selftest_runtime.py --full               # the default run (a card's)

Everything after ``--`` goes to ``selftest``.  Needs torch; the repository goes on
PYTHONPATH.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as fh:
            info = fh.read()
    except OSError:
        return platform.processor() or "unknown CPU"
    name = next((ln.split(":", 1)[1].strip() for ln in info.splitlines()
                 if ln.startswith("model name")), "unknown CPU")
    flags = next((ln for ln in info.splitlines() if ln.startswith("flags")), "")
    ext = [f for f in ("avx512f", "amx_tile", "avx512_bf16", "avx512_fp16") if f" {f}" in flags]
    return f"{name} ({os.cpu_count()} CPUs; {', '.join(ext) or 'no AVX-512'})"


def main(argv: list) -> int:
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--full", action="store_true", help="without --quick")
    a = p.parse_args(own)
    cmd = [sys.executable, "-m", "vllm_bi100_patch", "selftest", "--json",
           *([] if a.full else ["--quick"]), *extra]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    walls, inner, results = [], [], []
    for i in range(a.runs):
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
        walls.append(time.perf_counter() - t0)
        try:
            out = json.loads(proc.stdout)
        except ValueError:
            print(proc.stderr[-3000:], file=sys.stderr)
            return 1
        inner.append(out["elapsed_s"])
        results.append(f"rc {proc.returncode}, ok {out['ok']}")
        print(f"run {i + 1}: {walls[-1]:.1f} s wall, {inner[-1]:.1f} s selftest "
              f"({results[-1]})", file=sys.stderr)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"## selftest run time, {datetime.date.today().isoformat()}, {cpu_name()}, "
          f"load {load:.1f}")
    print(f"command: {' '.join(['vllm-bi100-patch'] + cmd[3:])}")
    print("| runs | median wall s | min | max | median selftest elapsed_s | results |")
    print("|---|---|---|---|---|---|")
    print(f"| {a.runs} | {statistics.median(walls):.1f} | {min(walls):.1f} | {max(walls):.1f} "
          f"| {statistics.median(inner):.1f} | {'; '.join(sorted(set(results)))} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

#!/usr/bin/env python3
"""Start-up cost of the shim's bootstrap: ``python -c pass`` with and without the shim
installed, measured side by side (interleaved runs, medians), for each VLLM_BI100_PATCH mode.

    python scripts/startup_cost.py [--runs 40]

Builds the shim's wheel and two throw-away venvs in a temporary directory.
"""

from __future__ import annotations

import argparse
import glob
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _venv(path: str, wheel: str = "") -> str:
    subprocess.run([sys.executable, "-m", "venv", path], check=True)
    python = os.path.join(path, "bin", "python")
    if wheel:
        subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", wheel],
                       check=True)
    subprocess.run([python, "-c", "pass"], check=True)  # compile .pyc files once
    return python


def _time(python: str, env: dict) -> float:
    t0 = time.perf_counter()
    subprocess.run([python, "-c", "pass"], env=env, check=True)
    return (time.perf_counter() - t0) * 1000


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=40)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", tmp, ROOT],
                       check=True)
        wheel = glob.glob(os.path.join(tmp, "vllm_bi100_patch-*.whl"))[0]
        plain = _venv(os.path.join(tmp, "plain"))
        shim = _venv(os.path.join(tmp, "shim"), wheel)
        base_env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_BI100")}
        print(f"{'VLLM_BI100_PATCH':18} {'without shim ms':>16} {'with shim ms':>13} "
              f"{'extra ms':>9} {'ratio':>6}")
        for mode in ("auto", "1", "0"):
            env = dict(base_env, VLLM_BI100_PATCH=mode)
            a, b = [], []
            for _ in range(args.runs):
                a.append(_time(plain, env))
                b.append(_time(shim, env))
            ma, mb = statistics.median(a), statistics.median(b)
            print(f"{mode:18} {ma:16.1f} {mb:13.1f} {mb - ma:9.1f} {mb / ma:6.2f}")
        print(f"(medians of {args.runs} interleaved runs of `python -c pass`; no vLLM installed, "
              "so `auto` stops after looking for vllm; `1` installs the import guard and hooks)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

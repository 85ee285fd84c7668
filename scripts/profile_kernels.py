#!/usr/bin/env python3
"""The kernels' real launches and time per call on a device, next to the account's model.

For every case (the field's per-rank shape of issue 19, and the benchmark's GPU cases), on
``--device`` (the kernels' own formulation there; on CPU the GPU compute mode is forced):

- the account of one call on the device's tensors (``tools/bench_cases.account_row``):
  modelled launches, host reads, and the modelled H200 time (``tools.account.DEVICES``);
- on a GPU, also the budget convention's launches (the same call on CPU tensors with the
  GPU compute mode forced: what the kernel budget tests count), for the field shape;
- ``torch.profiler`` over ``--calls`` calls: CUDA kernels per call and memcpy/memset per call
  (device events), and the runtime's launch calls per call (``cudaLaunchKernel``...); on
  CPU (``--dry-run`` of ``gpu_kernels_check.sh``) leaf aten ops per call (views and
  allocations left out, as the account does): the same code path, nothing to calibrate;
- the measured median time per call (synchronised), measured / modelled, and the host cost
  per launch the measurement implies: (measured - the model's bandwidth/FLOP time) / launches.

The first GPU run calibrates the model: the implied cost per launch replaces the stated one
(``tools/account.py``) and measured / modelled says how far the bandwidth term is from the
card.  Needs only torch and this repository.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from typing import Any, Dict, List, Optional, Sequence

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE)]

from tools.account import DEVICES, FREE_OPS  # noqa: E402
from tools.bench_cases import BENCH, FIELD, Case, account_row, build, call, this_package  # noqa: E402

KERNELS = this_package()
_RUNTIME_LAUNCHES = {"cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC",
                     "cuLaunchKernelEx", "cudaMemcpyAsync", "cudaMemsetAsync"}


def cases(quick: bool, gpu: bool) -> List[Case]:
    kind = "default" if gpu else "native"
    if quick:
        return [Case("decode", 1, 1024, 1, kind, FIELD), Case("decode", 4, 256, 1, kind, FIELD),
                Case("prefix", 1, 512, 64, kind, FIELD), Case("dense", 1, 0, 256, kind, FIELD)]
    field = [Case("decode", b, c, 1, kind, FIELD)
             for b, c in ((1, 32768), (1, 65536), (1, 131072), (8, 4096), (32, 1024))]
    field += [Case("prefix", 1, c, n, kind, FIELD) for c, n in ((16384, 512), (32768, 256))]
    field += [Case("dense", 1, 0, 2048, kind, FIELD)]
    bench = [Case("decode", 1, c, 1, kind, BENCH) for c in (32768, 131072)]
    bench += [Case("prefix", b, c, n, kind, BENCH) for b, c, n in ((1, 32768, 512),
                                                                   (4, 8192, 256))]
    return field + bench


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def profiled(fn: Any, device: str, calls: int) -> Dict[str, float]:
    """Per call: device kernels, device memcpy/memset, runtime launch calls (CUDA), or leaf
    aten ops (CPU)."""
    from torch.profiler import ProfilerActivity, profile

    gpu = device.startswith("cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    sync(device)
    with profile(activities=activities) as prof:
        for _ in range(calls):
            fn()
        sync(device)
    counts = {"kernels": 0, "copies": 0, "runtime": 0, "cpu_ops": 0}
    for evt in prof.events():
        name = evt.name
        if str(getattr(evt, "device_type", "")).endswith("CUDA"):
            counts["copies" if name.startswith(("Memcpy", "Memset")) else "kernels"] += 1
        elif name in _RUNTIME_LAUNCHES:
            counts["runtime"] += 1
        elif name.startswith("aten::") and not _free(name[6:]) and not any(
                c.name.startswith("aten::") for c in evt.cpu_children):
            counts["cpu_ops"] += 1
    return {k: v / calls for k, v in counts.items()}


def _free(op: str) -> bool:
    """An aten op that launches nothing by the account's rules (views, allocations)."""
    packet = getattr(torch.ops.aten, op, None)
    default = getattr(packet, "default", None)
    return op in FREE_OPS or bool(getattr(default, "is_view", False))


def measure(fn: Any, device: str, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run_case(case: Case, device: str, calls: int, repeats: int) -> Dict[str, Any]:
    gpu = device.startswith("cuda")
    inp = build(case, device)
    fn = call(inp, KERNELS)
    fn()
    fn()  # warm-up (allocator, first-call setup)
    acc = account_row(inp, KERNELS)
    res: Dict[str, Any] = {"case": case.name, "shape": case.shape.describe(), "account": acc}
    if gpu and case.shape == FIELD:
        cpu_case = dataclasses.replace(case, kind="native")
        res["convention_launches"] = account_row(build(cpu_case, "cpu"), KERNELS)["launches"]
        del cpu_case
    res["profile"] = profiled(fn, device, calls)
    res["measured_s"] = measure(fn, device, repeats)
    h200 = DEVICES["h200"]
    res["model_h200_s"] = acc["model_s"]["h200"]
    transfer = res["model_h200_s"] - acc["launches"] * h200.launch_s
    res["implied_launch_s"] = (res["measured_s"] - transfer) / max(1, acc["launches"])
    del inp, fn
    if gpu:
        torch.cuda.empty_cache()
    return res


def table(rows: List[Dict[str, Any]], gpu: bool) -> str:
    prof = ("profiled kernels / call | memcpy+memset / call | runtime launch calls / call"
            if gpu else "profiled leaf aten ops / call (CPU, no views)")
    head = (f"| case | modelled launches (this device) | budget convention launches | {prof} | "
            "host reads | model H200 ms | measured ms | measured / model | implied us per "
            "launch |")
    out = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        p = r["profile"]
        counts = (f"{p['kernels']:g} | {p['copies']:g} | {p['runtime']:g}" if gpu
                  else f"{p['cpu_ops']:g}")
        out.append(
            f"| {r['case']} | {r['account']['launches']} | {r.get('convention_launches', '-')} | "
            f"{counts} | {r['account']['host_reads']} | {r['model_h200_s'] * 1e3:.3f} | "
            f"{r['measured_s'] * 1e3:.3f} | {r['measured_s'] / r['model_h200_s']:.2f}x | "
            f"{r['implied_launch_s'] * 1e6:.1f} |")
    return "\n".join(out)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda[:N] or cpu")
    parser.add_argument("--quick", action="store_true", help="small field-shape cases")
    parser.add_argument("--calls", type=int, default=3, help="calls under the profiler")
    parser.add_argument("--repeats", type=int, default=10, help="timed calls (median)")
    args = parser.parse_args(argv)
    device, gpu = args.device, args.device.startswith("cuda")
    where = torch.cuda.get_device_name(device) if gpu else "cpu (GPU compute mode forced)"
    print(f"profile_kernels: device {where}, torch {torch.__version__}, {args.calls} profiled "
          f"calls, median of {args.repeats} timed calls")
    h200 = DEVICES["h200"]
    print(f"model (not a measurement): H200 {h200.bandwidth / 1e12:g} TB/s, "
          f"{h200.flops / 1e12:g} TFLOPS, {h200.launch_s * 1e6:g} us per launch (stated)")
    rows = []
    for case in cases(args.quick, gpu):
        rows.append(run_case(case, device, args.calls, args.repeats))
        print(f"  {rows[-1]['case']} ({rows[-1]['shape']}): done", flush=True)
    print(table(rows, gpu))
    implied = statistics.median(r["implied_launch_s"] for r in rows)
    print(f"calibration: median implied host cost per launch {implied * 1e6:.1f} us "
          f"(the model states {h200.launch_s * 1e6:g} us for an H200)"
          + ("" if gpu else "; CPU dry run: not a calibration"))
    return 0


if __name__ == "__main__":
    status = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)

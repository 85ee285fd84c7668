"""``vllm-bi100-patch selftest``: the shim measures itself on this machine's device.

Run it on the card before serving: correctness (the device checks against a float64
reference), decode and prefix timings at the model's per-rank shape with their account, the
projection for the model and the settings that follow (printed, never applied).  Needs torch
only; vLLM (for the build's native V1 kernel) is used where installed.  It never runs a
known hazard: no Triton, no native V1 above its limit, no vendor flash attention (the dense
check is the shim's own kernel), and it stays inside a memory limit it measures first.

Exit status: 0 every check passed (skips allowed), 1 a check failed, 4 refused (not enough
free memory for the smallest case), 5 the card did not answer in time (a wedged card: the first
contact and the run are child processes under hard time-outs; docs/operating.md), 2 a usage
error (argparse).  docs/selftest.md explains every number.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import sys
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ...activation import config
from ...patching import hardware
from ..._version import __version__
from . import checks, native, plan, report, timing
from .shape import DTYPES, Shape, ShapeError

__all__ = ["EXIT_FAILED", "EXIT_OK", "EXIT_REFUSED", "main", "run"]

EXIT_OK, EXIT_FAILED, EXIT_REFUSED = 0, 1, 4
MiB = 1 << 20
#: Without --model or --heads: a BI-V100 field deployment's per-rank shape (TP 4: 4 query / 1
#: KV heads of 256, fp16) and the 10 attention layers of its per-token figure
#: (docs/bi100-limits.md, "Field performance").
FIELD_SHAPE = dict(heads=4, kv_heads=1, head_size=256, layers=10, dtype="float16")
#: Decode lengths and prefix contexts (each capped at --max-len), default and --quick.
DECODE_LENGTHS = (1024, 4096, 8192, 16384, 32768, 65536, 131072, 262144)
PREFIX_CONTEXTS = (0, 8192, 32768, 131072)
QUICK_DECODE, QUICK_PREFIX = (1024, 4096, 16384), (1024, 8192)
#: Memory the checks themselves may hold (small inputs; the CUDA budget check's 8K cache).
CHECKS_MIB = 512


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vllm-bi100-patch selftest", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("shape (per rank)")
    g.add_argument("--model", metavar="DIR", help="model directory with config.json")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    g.add_argument("--heads", type=int)
    g.add_argument("--kv-heads", type=int)
    g.add_argument("--head-size", type=int)
    g.add_argument("--layers", type=int)
    g.add_argument("--dtype", choices=sorted(DTYPES))
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--max-len", type=int, help="longest context to measure (default: the "
                   "model's max_position_embeddings, else 32768; --quick: 16384 at most)")
    g.add_argument("--chunk-size", type=int, default=512,
                   help="the server's prefill chunk (--max-num-batched-tokens), default 512")
    r = p.add_argument_group("run")
    r.add_argument("--device", default="auto", help="auto (cuda when present, else cpu)")
    r.add_argument("--formulation", choices=("device", "gpu"), default="device",
                   help="gpu: on CPU, force the kernels' GPU formulation (half-precision "
                        "products, the card's layouts); device: the device's own")
    r.add_argument("--quick", action="store_true", help="fewer checks and lengths (CPU: "
                   "within 90 s)")
    r.add_argument("--check", action="append", metavar="NAME",
                   help="run only this check (repeatable); `none`: no checks")
    r.add_argument("--lengths", help="decode lengths, comma-separated (default by mode)")
    r.add_argument("--contexts", help="prefix contexts, comma-separated (default by mode)")
    r.add_argument("--repeats", type=int, help="timed calls per case (default 10; quick 3)")
    r.add_argument("--budget-mb", type=int, help="the kernels' working set per call "
                   "(default: VLLM_BI100_PREFIX_BUDGET_MB, 256)")
    r.add_argument("--memory-mb", type=int, default=4096,
                   help="most memory the selftest holds (default 4096; never more than 90%% "
                        "of the free memory it measures)")
    r.add_argument("--time-limit", type=float, help="seconds (default 300; quick 90): no "
                   "case starts after it")
    r.add_argument("--contact-timeout", type=float, metavar="S", help="seconds for the first "
                   "contact with the card, a child process (default VLLM_BI100_CONTACT_TIMEOUT_S, "
                   "15); past it: a wedged card, exit 5")
    r.add_argument("--hard-limit", type=float, metavar="S", help="seconds the run itself, a "
                   "child process on a card, may take before it is stopped (default 2 x "
                   "--time-limit + 60); past it: a wedged card, exit 5")
    r.add_argument("--no-native", action="store_true", help="do not look for vLLM's kernels")
    r.add_argument("--json", action="store_true", help="one JSON object on stdout")
    r.add_argument("--json-out", metavar="FILE", help="also write the JSON object to FILE")
    return p


def _ints(text: Optional[str]) -> Optional[List[int]]:
    return None if text is None else [int(v) for v in text.split(",") if v.strip()]


def shape_of(a: argparse.Namespace) -> Shape:
    max_len = a.max_len
    if a.model:
        shape = Shape.from_config(a.model, a.tensor_parallel_size, a.dtype, a.block_size,
                                  max_len)
    else:
        given = {k: getattr(a, k) for k in ("heads", "kv_heads", "head_size", "layers", "dtype")
                 if getattr(a, k) is not None}
        if "dtype" in given:
            given["dtype"] = DTYPES[given["dtype"]]
        base = dict(FIELD_SHAPE, **given)
        if "kv_heads" not in given and "heads" in given:
            base["kv_heads"] = given["heads"]
        shape = Shape(block_size=a.block_size, max_len=max_len or 32768,
                      source="explicit" if given else "default: a BI-V100 field "
                      "deployment's rank (TP 4)", **base)  # type: ignore[arg-type]
    if a.quick and a.max_len is None and shape.max_len > 16384:
        shape = Shape(**dict(shape.as_dict(), max_len=16384))
    return shape


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ShapeError(f"--device {name}: torch sees no CUDA device")
    return device


def _mem_available() -> Optional[int]:
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def memory_limit(device: torch.device, wanted_mb: int) -> Tuple[int, str]:
    """The most the selftest may hold: ``wanted_mb``, never above 90% of the free memory
    measured now (the card's, or the host's on CPU); the sentence that says so."""
    limit = wanted_mb * MiB
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        others = total - free - torch.cuda.memory_reserved(device)
        note = f"{free / MiB:,.0f} MiB free of {total / MiB:,.0f} MiB"
        if others > max(1 << 30, total // 20):
            note += (f"; {others / MiB:,.0f} MiB held by other processes (a running "
                     "server?): the selftest stays within the free memory")
    else:
        free = _mem_available() or limit
        note = f"host memory available {free / MiB:,.0f} MiB"
    limit = min(limit, int(0.9 * free))
    return limit, f"{note}; limit {limit / MiB:,.0f} MiB"


def _run_check(fn: Callable[[torch.device], None], device: torch.device) -> Dict[str, Any]:
    t0 = time.perf_counter()
    row: Dict[str, Any] = {"name": fn.__name__, "ok": True,
                           "doc": (fn.__doc__ or "").strip().split("\n")[0]}
    try:
        fn(device)
    except checks.Skip as why:
        row.update(ok=None, detail=f"skipped: {why}")
    except Exception as exc:  # a failed check: reported, the others still run
        row.update(ok=False, detail=f"{type(exc).__name__}: {exc}",
                   traceback=traceback.format_exc(limit=4))
    row["seconds"] = time.perf_counter() - t0
    return row


def run(a: argparse.Namespace, progress: Callable[[str], None]) -> Tuple[int, Dict[str, Any]]:
    """The whole selftest: (exit status, report)."""
    start = time.monotonic()
    shape = shape_of(a)
    device = _device(a.device)
    settings = config.load()
    budget = a.budget_mb or settings.prefix_budget_mb
    limit, mem_note = memory_limit(device, a.memory_mb)
    lengths = _ints(a.lengths) or list(QUICK_DECODE if a.quick else DECODE_LENGTHS)
    lengths = sorted({n for n in lengths if n <= shape.max_len} | (
        set() if a.lengths or a.quick else {shape.max_len}))
    contexts = _ints(a.contexts) or list(QUICK_PREFIX if a.quick else PREFIX_CONTEXTS)
    contexts = sorted({c for c in contexts if c + a.chunk_size <= shape.max_len})
    dtype = getattr(torch, shape.dtype)
    facts = hardware.device_facts() if device.type == "cuda" else {}
    dev: Dict[str, Any] = {
        "type": device.type, "torch": torch.__version__, "memory": mem_note,
        "name": facts.get("device_name") or ("CPU" if device.type == "cpu" else str(device)),
        "iluvatar": bool(facts.get("iluvatar")) or hardware.looks_like_iluvatar(),
        "formulation": "gpu" if device.type != "cpu" or a.formulation == "gpu" else "cpu",
        "threads": torch.get_num_threads()}
    out: Dict[str, Any] = {"version": __version__, "date": datetime.datetime.now(
        datetime.timezone.utc).strftime("%Y-%m-%d"), "device": dev, "shape": shape.as_dict(),
        "checks": [], "precision": [], "timings": [], "projection": [], "prefill": [],
        "recommendations": [],
        "not_run": [], "ok": False}
    smallest = timing.cache_bytes(shape, min(lengths or [1024])) + budget * MiB
    if limit < smallest + CHECKS_MIB * MiB:
        out["refused"] = (f"not enough memory: the smallest case needs "
                          f"{(smallest + CHECKS_MIB * MiB) / MiB:,.0f} MiB, the limit is "
                          f"{limit / MiB:,.0f} MiB ({mem_note})")
        return EXIT_REFUSED, out
    v1, why = native.find(device, shape.head_size, not a.no_native)
    out["native"] = native.describe(v1, why)
    progress(f"selftest on {dev['name']}: {shape.heads}/{shape.kv_heads} heads of "
             f"{shape.head_size}, {shape.dtype}; native: {why}")
    with checks.device_formulation(device, a.formulation == "gpu",
                                   [dtype] if a.quick else None,
                                   (shape.heads, shape.kv_heads, shape.head_size),
                                   a.quick):
        checks.PRECISION_RESULTS.clear()
        peak = [0]
        every = list(checks.CHECKS) + native.native_checks(v1, dtype, shape.head_size)
        wanted = set(a.check or [])
        chosen = [c for c in every if not wanted or c.__name__ in wanted]
        unknown = wanted - {c.__name__ for c in every} - {"none"}
        if unknown:
            raise ShapeError(f"unknown check(s) {sorted(unknown)}; known: "
                             f"{[c.__name__ for c in every]}")
        for fn in chosen:
            progress(f"check {fn.__name__} ...")
            out["checks"].append(_run_check(fn, device))
        out["precision"] = list(checks.PRECISION_RESULTS)
        deadline = start + (a.time_limit or (90.0 if a.quick else 300.0)) * 0.85
        p = timing.Plan(lengths, contexts, a.chunk_size, a.repeats or (3 if a.quick else 10),
                        budget, limit, deadline)
        rec = timing.Recorder(shape, device, p, progress)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        out["timings"] = rec.run(v1)
        out["not_run"] = rec.skipped
        peak[0] = int(max([r.get("peak_mib", 0) for r in rec.timings] or [0]) * MiB)
    if device.type == "cuda" and (not wanted or "check_memory_within_limit" in wanted):
        ok = peak[0] <= limit
        out["checks"].append({"name": "check_memory_within_limit", "ok": ok, "seconds": 0.0,
                              "detail": f"peak {peak[0] / MiB:,.0f} MiB, limit "
                                        f"{limit / MiB:,.0f} MiB"})
    if v1 is not None:
        out["native"]["calls_max_seq_len"] = max(v1.calls, default=None)
    out["native"]["prefix_prefill"] = _prefix_prefill_state()
    timings = out["timings"]
    v1_limit = v1.limit if v1 is not None else None
    out["projection"] = plan.projection(timings, shape.layers, lengths + [shape.max_len],
                                        v1_limit, settings.decode_fallback_above)
    out["prefill"] = plan.prefill(timings, shape.layers, shape.max_len, a.chunk_size)
    out["crossover"] = plan.crossover(timings)
    out["calibration"] = dict(plan.calibration(timings), model=_model_note(timings),
                              fitted_model=_fitted_note())
    out["recommendations"] = plan.recommendations(timings, out["prefill"], v1_limit, budget,
                                                  settings.decode_fallback_above)
    out["ok"] = all(c["ok"] is not False for c in out["checks"])
    out["elapsed_s"] = time.monotonic() - start
    return (EXIT_OK if out["ok"] else EXIT_FAILED), out


def _prefix_prefill_state() -> str:
    """vLLM's Triton prefix module in this process: absent, the shim's substitute, or real."""
    from ...attention import import_guard

    module = sys.modules.get(import_guard.TARGET)
    if module is None:
        return "absent"
    return "substitute" if import_guard.is_substitute(module) else "real (imported, never called)"


def _model_note(timings: Sequence[Dict[str, Any]]) -> str:
    """The account's BI-V100 model (a model, not a measurement) next to the measured timings."""
    from .account import DEVICES

    m = DEVICES["bi-v100"]
    ratios = [r["ms"] / (1e3 * (r["launches"] * m.launch_s + r["bytes"] / m.bandwidth))
              for r in timings if r.get("account") == "counted" and r.get("bytes")]
    if not ratios:
        return "no counted rows"
    ratios.sort()
    return (f"{m.bandwidth / 1e9:,.0f} GB/s, {m.launch_s * 1e6:.0f} us per launch; measured / "
            f"modelled {ratios[len(ratios) // 2]:.2f} (median)")


def _fitted_note() -> Dict[str, Any]:
    """The calibrated model's constants (``projected_ms`` of every counted row)."""
    from .calibrated import load

    return load().as_dict()


def main(argv: Optional[Sequence[str]] = None) -> int:
    a = parser().parse_args(argv)

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    try:
        # vLLM's logger (and the shim's line through it) writes to stdout: keep stdout for
        # the table or the one JSON object.
        with contextlib.redirect_stdout(sys.stderr):
            status, out = run(a, progress)
    except ShapeError as exc:
        print(f"vllm-bi100-patch selftest: {exc}", file=sys.stderr)
        return 2
    if "refused" in out:
        print(f"vllm-bi100-patch selftest refused: {out['refused']}", file=sys.stderr)
    text = json.dumps(out, indent=1, default=str)
    if a.json_out:
        with open(a.json_out, "w", encoding="utf-8") as fh:
            fh.write(text + "\n")
    if a.json:
        print(text)
    elif "refused" not in out:
        print(report.table(out))
    return status


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

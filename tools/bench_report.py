"""The attention benchmark's printed tables: timings, the account, the targets, and what
this CPU's timings mean (``cpu_note``).  Used by ``scripts/bench_attention.py`` and
``scripts/profile_kernels.py``; not part of the package."""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from tools.account import DEVICES

__all__ = ["ACCOUNT_HEAD", "account_table", "cpu_note", "model_note", "plot", "targets",
           "timing_table"]

_HALF_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def cpu_flags() -> Dict[str, bool]:
    """This CPU's half-precision matrix instructions (from ``/proc/cpuinfo``; Linux)."""
    flags: set = set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    return {f: f in flags for f in ("avx512_bf16", "avx512_fp16", "amx_bf16", "amx_fp16")}


def cpu_note() -> str:
    """One line: which half-precision GEMMs are native on this CPU, and measured rates."""
    have = cpu_flags()
    rates = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: a loaded machine's scheduling delays stay out
    try:
        for name, dtype in _HALF_DTYPES.items():
            a = torch.ones(256, 256, dtype=dtype)
            best = float("inf")
            for _ in range(4):  # the best of a few: load only ever slows a run
                t0 = time.perf_counter()
                a @ a
                best = min(best, time.perf_counter() - t0)
            rates.append(f"{name} {2 * 256 ** 3 / max(best, 1e-9) / 1e9:.1f}")
    finally:
        torch.set_num_threads(threads)
    bf16 = "native" if have["avx512_bf16"] or have["amx_bf16"] else "NOT native"
    fp16 = "native" if have["avx512_fp16"] or have["amx_fp16"] else "NOT native"
    return (f"this CPU: bf16 GEMMs {bf16}, fp16 GEMMs {fp16} ("
            + ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in have.items())
            + f"; 256x256 GEMM GFLOP/s on one thread: {', '.join(rates)})")


def model_note() -> str:
    devs = "; ".join(f"{d.name} {d.bandwidth / 1e12:g} TB/s, {d.flops / 1e12:g} TFLOPS, "
                     f"{d.launch_s * 1e6:g} us per launch" for d in DEVICES.values())
    return ("model (a model, not a measurement): per launch max(bytes / bandwidth, FLOPs / "
            f"peak) + a stated host cost per launch; {devs}")


def _ms(seconds: Optional[float]) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def timing_table(rows: List[Dict[str, Any]], bandwidth: float) -> str:
    base = any("baseline" in r for r in rows)
    head = ("| case | paged ms | SDPA ms | seed ms | native ms | paged/SDPA | seed/paged | "
            "KV GB/s (of copy bw) | peak extra MiB paged / seed | max err vs SDPA |"
            + (" baseline ms | paged/baseline |" if base else ""))
    out = [head, "|" + "---|" * (12 if base else 10)]
    for r in rows:
        tail = f" {_ms(r['baseline'])} | {r['paged'] / r['baseline']:.2f}x |" if base else ""
        seed = f"{r['seed'] / r['paged']:.2f}x" if "seed" in r else "-"
        gbs = r["kv_bytes"] / r["paged"] / 1e9
        out.append(
            f"| {r['case']} | {_ms(r['paged'])} | {_ms(r['sdpa'])} | {_ms(r.get('seed'))} | "
            f"{_ms(r.get('native'))} | {r['paged'] / r['sdpa']:.2f}x | {seed} | "
            f"{gbs:.2f} ({gbs * 1e9 / bandwidth:.0%}) | "
            f"{r.get('peak_paged', 0) / 2**20:.1f} / {r.get('peak_seed', 0) / 2**20:.1f} | "
            f"{r['max_abs_err_vs_sdpa']:.1e} |" + tail)
    return "\n".join(out)


ACCOUNT_HEAD = ("| case | launches | host reads | MiB moved | minimal MiB | bytes / minimal | "
                "GFLOP | model BI-V100 ms | model H200 ms |")


def _account_cells(acc: Dict[str, Any]) -> str:
    return (f" {acc['launches']} | {acc['host_reads']} | {acc['bytes'] / 2**20:.1f} | "
            f"{acc['minimal'] / 2**20:.1f} | {acc['bytes'] / acc['minimal']:.2f}x | "
            f"{acc['flops'] / 1e9:.2f} | {acc['model_s']['bi-v100'] * 1e3:.3f} | "
            f"{acc['model_s']['h200'] * 1e3:.3f} |")


def account_table(rows: List[Dict[str, Any]]) -> str:
    """Every row's account; with ``--baseline`` the baseline's launches, bytes / minimal and
    modelled BI-V100 time beside it; the field's figures (issue 19) where they exist."""
    base = any("base_account" in r for r in rows)
    field = any(r.get("field") for r in rows)
    head = ACCOUNT_HEAD + (" baseline launches | baseline bytes / minimal | baseline model "
                           "BI-V100 ms |" if base else "")
    head += " field launches | field bytes / minimal |" if field else ""
    out = [head, "|" + "---|" * (9 + 3 * base + 2 * field)]
    for r in rows:
        line = f"| {r['case']} |" + _account_cells(r["account"])
        if base:
            b = r["base_account"]
            line += (f" {b['launches']} | {b['bytes'] / b['minimal']:.2f}x | "
                     f"{b['model_s']['bi-v100'] * 1e3:.3f} |")
        if field:
            f = r.get("field")
            line += f" {f[0]} | {f[1]:.2f}x |" if f else " - | - |"
        out.append(line)
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
                           lambda r: r["op"] == "decode", [("bw share", "bw", 0.30)]),
                ratio_line("tiled prefix <= 2x dense SDPA",
                           lambda r: r["op"] == "prefix", [("x SDPA", "sdpa", 2.0)])]
    return [ratio_line("decode <= 1.0x dense SDPA",
                       lambda r: r["op"] == "decode" and not r["case"].endswith(" native"),
                       [("x SDPA", "sdpa", 1.0)]),
            ratio_line("tiled prefix, GPU compute mode, <= 1.2x SDPA and >= 2x seed",
                       lambda r: r["case"].endswith(" native") and r["op"] == "prefix",
                       [("x SDPA", "sdpa", 1.2), ("seed/paged", "seed", 2.0)])]


def plot(curve: List[Dict[str, Any]], path: str, title: str) -> Optional[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key, label in (("paged", "fallback (paged_decode)"), ("sdpa", "dense SDPA"),
                       ("seed", "seed-style baseline"), ("native", "vLLM native v1/v2")):
        if all(key in r for r in curve):
            ax.plot([r["ctx"] for r in curve], [r[key] * 1e3 for r in curve], marker="o",
                    label=label)
    ax.set(xscale="log", yscale="log", xlabel="context length (tokens)",
           ylabel="median time per call (ms)", title=title)
    ax.set_xscale("log", base=2)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path

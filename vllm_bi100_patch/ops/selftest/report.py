"""The selftest's readable table (the JSON object is the report itself)."""

from __future__ import annotations

from typing import Any, Dict, List, Sequence

__all__ = ["table"]


def _fmt(value: Any, spec: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and spec:
        return format(value, spec)
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value)


def _md(header: Sequence[str], rows: Sequence[Sequence[str]]) -> List[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return lines + ["| " + " | ".join(r) + " |" for r in rows]


def table(report: Dict[str, Any]) -> str:
    d, s = report["device"], report["shape"]
    out = [f"# vllm-bi100-patch {report['version']} selftest, {report['date']}",
           f"device: {d['name']} ({d['type']}; formulation {d['formulation']}; "
           f"torch {d['torch']})" + ("; " + d["memory"] if d.get("memory") else ""),
           f"shape per rank: {s['heads']} query / {s['kv_heads']} KV heads of "
           f"{s['head_size']}, {s['layers']} layers, {s['dtype']}, block {s['block_size']}, "
           f"max length {s['max_len']:,} ({s['source']})",
           f"native: {report['native'].get('native_v1') or report['native'].get('why')}"
           + (f"; V1 limit {report['native']['v1_limit']:,} tokens"
              if report["native"].get("v1_limit") else ""), "", "## checks"]
    out += _md(["check", "result", "s", "detail"],
               [[c["name"], "ok" if c["ok"] else ("skip" if c["ok"] is None else "FAIL"),
                 _fmt(c["seconds"], ".1f"), c.get("detail", "")[:160]]
                for c in report["checks"]])
    if report.get("precision"):
        out += ["", "## precision: median relative error against float64 (bar: 2x the "
                "float32-score reference, vLLM's kernel's numerics)"]
        out += _md(["kernel", "variant", "dtype", "logits", "error", "float32-score ref.",
                    "ratio"],
                   [[p["kernel"], p["variant"], p["dtype"], p["row"], _fmt(p["error"], ".2e"),
                     _fmt(p["reference"], ".2e"), _fmt(p["ratio"], ".2f")]
                    for p in report["precision"]])
    out += ["", "## timings (median per call, one layer; projected: the BI-V100 model "
            "calibrated on the card's published measurements, for this call's account)"]
    out += _md(["kernel", "route", "tokens", "ms", "projected ms", "launches", "MiB moved",
                "GB/s", "account"],
               [[t["kernel"], t["route"], _fmt(t["tokens"]), _fmt(t["ms"], ".3f"),
                 _fmt(t.get("projected_ms"), ".3f"), _fmt(t["launches"]),
                 _fmt((t["bytes"] or 0) / 2**20, ".1f"), _fmt(t.get("gb_per_s"), ".1f"),
                 t["account"]] for t in report["timings"]])
    for skip in report.get("not_run", []):
        out.append(f"not run: {skip['kernel']} {skip['route']} {skip['tokens']:,} tokens "
                   f"({skip['why']})")
    c = report["calibration"]
    out += ["", f"calibration (counted rows: {c['rows']}): effective "
            f"{_fmt(c['effective_gb_per_s'], '.1f')} GB/s (median); fitted "
            f"{_fmt(c['bandwidth_gb_per_s'], '.1f')} GB/s and {_fmt(c['launch_us'], '.1f')} "
            f"us per launch; BI-V100 model: {c['model']}"]
    f = c.get("fitted_model")
    if f:
        bw = f["bandwidth_gb_per_s"]
        out.append(f"projected ms: the model calibrated on BI-V100's published timings, "
                   f"{f['launch_us']:.2f} us per launch, GB/s " + ", ".join(
                       f"{k} {v:,.0f}" for k, v in bw.items()) + f", {f['tflops']:.1f} "
                   "TFLOP/s (docs/performance.md)")
    out += ["", "## projection: decode, one sequence, attention only"]
    out += _md(["tokens", "route", "ms per layer", "ms per token (all layers)",
                "tokens/s bound", "source"],
               [[_fmt(p["tokens"]), p["route"], _fmt(p["layer_ms"], ".3f"),
                 _fmt(p["token_ms"], ".2f"), _fmt(p["tokens_per_s"], ".1f"), p["source"]]
                for p in report["projection"]])
    out += ["", "## projection: prefill, one chunk per engine step, attention only"]
    out += _md(["context", "chunk", "ms per layer", "s per step (all layers)", "source"],
               [[_fmt(p["context"]), _fmt(p["chunk"]), _fmt(p["layer_ms"], ".2f"),
                 _fmt(p["step_s"], ".2f"), p["source"]] for p in report["prefill"]])
    out += ["", "## recommendations (printed only: nothing is changed)"]
    out += [f"- {r['setting']}={_fmt(r['value'])}: {r['why']}"
            for r in report["recommendations"]]
    n_ok = sum(1 for c in report["checks"] if c["ok"])
    n_fail = sum(1 for c in report["checks"] if c["ok"] is False)
    n_skip = sum(1 for c in report["checks"] if c["ok"] is None)
    out += ["", f"selftest on {d['type']}: {n_ok} checks passed, {n_fail} failed, {n_skip} "
            f"skipped; {len(report['timings'])} timings in {report['elapsed_s']:.0f} s; "
            f"RESULT: {'PASS' if report['ok'] else 'FAIL'}"]
    return "\n".join(out)

"""From timings to what an operator sets: pure functions of the timings (no torch, no
device), so each can be tested with synthetic timings.

- ``crossover``: the measured length from which the pure-PyTorch decode is at least as fast
  as native V1 at every longer measured length (None: V1 is faster wherever both ran);
- ``calibration``: the effective bandwidth and host cost per launch the timings imply
  (least squares ``ms = launches * t_launch + bytes / bandwidth`` over the counted timings);
- ``projection``: per context length, the attention time per generated token of the whole
  model (layers x the per-layer time of the route the shim takes) and the decode tokens/s it
  bounds; ``prefill``: per chunk, the attention time of one engine step and the engine
  iteration time-out the longest chunk needs;
- ``recommendations``: the settings that follow; printed, never applied.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

__all__ = ["calibration", "crossover", "linear_fit", "prefill", "projection",
           "recommendations", "ENGINE_TIMEOUT_DEFAULT_S", "TIMEOUT_MARGIN"]

Record = Dict[str, Any]

#: vLLM's default ``VLLM_ENGINE_ITERATION_TIMEOUT_S``.
ENGINE_TIMEOUT_DEFAULT_S = 60
#: The time-out recommended: this many times the longest step's measured attention time
#: (attention is not all of a step; a server is busier than a selftest).
TIMEOUT_MARGIN = 4


def _decode(timings: Sequence[Record], route: str) -> Dict[int, float]:
    return {int(r["tokens"]): float(r["ms"]) for r in timings
            if r["kernel"] == "decode" and r["route"] == route}


def crossover(timings: Sequence[Record]) -> Optional[Dict[str, Any]]:
    """Where native V1 should give way to the fallback, from the decode timings measured on
    both routes: ``{"first_fallback": n, "last_v1": m or None, "estimate": e}`` with ``n``
    the shortest measured length from which the fallback is at least as fast at every longer
    length measured on both, ``m`` the measured length before it (V1 faster there) and ``e``
    the length where the two lines cross between them (linear interpolation); None when V1 is
    faster at the longest length measured on both (or nothing was measured on both)."""
    v1, fb = _decode(timings, "native_v1"), _decode(timings, "fallback")
    both = sorted(set(v1) & set(fb))
    first = None
    for n in reversed(both):
        if fb[n] <= v1[n]:
            first = n
        else:
            break
    if first is None:
        return None
    i = both.index(first)
    if i == 0:
        return {"first_fallback": first, "last_v1": None, "estimate": first}
    last = both[i - 1]
    gap_last, gap_first = fb[last] - v1[last], fb[first] - v1[first]  # > 0, <= 0
    frac = gap_last / (gap_last - gap_first) if gap_last != gap_first else 1.0
    return {"first_fallback": first, "last_v1": last,
            "estimate": int(round(last + frac * (first - last)))}


def linear_fit(points: Sequence[Tuple[float, float]]) -> Optional[Tuple[float, float]]:
    """Least-squares ``y = a + b x`` (None with fewer than two distinct x)."""
    if len({x for x, _ in points}) < 2:
        return None
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    b = sum((x - mx) * (y - my) for x, y in points) / sxx
    return my - b * mx, b


def calibration(timings: Sequence[Record]) -> Dict[str, Any]:
    """What the counted timings (the pure-PyTorch kernels) imply about the device: the median
    effective bandwidth (bytes / time), and the least-squares split of time into a cost per
    launch and a bandwidth (None where the timings cannot separate them, or a term comes out
    negative: noise, or the time is neither)."""
    counted = [r for r in timings if r.get("account") == "counted" and r.get("bytes")]
    out: Dict[str, Any] = {"rows": len(counted), "bandwidth_gb_per_s": None,
                           "launch_us": None, "effective_gb_per_s": None}
    if not counted:
        return out
    eff = sorted(r["bytes"] / (r["ms"] * 1e-3) / 1e9 for r in counted)
    out["effective_gb_per_s"] = eff[len(eff) // 2]
    # Normal equations of ms = L * t + B * s (t: ms per launch, s: ms per byte).
    sll = sum(r["launches"] ** 2 for r in counted)
    sbb = sum(float(r["bytes"]) ** 2 for r in counted)
    slb = sum(r["launches"] * float(r["bytes"]) for r in counted)
    slm = sum(r["launches"] * r["ms"] for r in counted)
    sbm = sum(float(r["bytes"]) * r["ms"] for r in counted)
    det = sll * sbb - slb * slb
    if len(counted) < 2 or det <= 1e-12 * sll * sbb:
        return out
    t = (slm * sbb - sbm * slb) / det
    s = (sll * sbm - slb * slm) / det
    if t > 0 and s > 0:
        out["launch_us"] = t * 1e3
        out["bandwidth_gb_per_s"] = 1e-6 / s
    return out


def _at(measured: Dict[int, float], tokens: int) -> Tuple[Optional[float], str]:
    """The time at ``tokens``: measured; between two measured lengths, interpolated; past
    the longest, the least-squares line of all of them, never below the longest's time
    (noise must not make a longer context look faster); before the shortest, its time."""
    if tokens in measured:
        return measured[tokens], "measured"
    points = sorted(measured.items())
    if not points:
        return None, "not measured"
    if tokens < points[0][0]:
        return points[0][1], "extrapolated"
    if tokens > points[-1][0]:
        fit = linear_fit(points)
        line = fit[0] + fit[1] * tokens if fit is not None else points[-1][1]
        return max(points[-1][1], line), "extrapolated"
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x0 < tokens < x1:
            return y0 + (y1 - y0) * (tokens - x0) / (x1 - x0), "interpolated"
    raise AssertionError("unreachable")  # pragma: no cover


def server_route(tokens: int, v1_limit: Optional[int], fallback_above: Optional[int]) -> str:
    """The decode route of a sequence of ``tokens`` on a build with only V1 (BI-V100's): V1
    up to its limit (and ``VLLM_BI100_DECODE_FALLBACK_ABOVE``), the fallback above."""
    if v1_limit is None or tokens > v1_limit:
        return "fallback"
    if fallback_above is not None and tokens > fallback_above:
        return "fallback"
    return "native_v1"


def projection(timings: Sequence[Record], layers: int, lengths: Sequence[int],
               v1_limit: Optional[int] = None,
               fallback_above: Optional[int] = None) -> List[Record]:
    """Per length: the route the shim takes, the per-layer time, ``token_ms`` (layers x
    it: attention only) and the ``tokens_per_s`` bound of one sequence decoding alone."""
    routes = {"fallback": _decode(timings, "fallback"), "native_v1": _decode(timings, "native_v1")}
    out = []
    for n in sorted(set(lengths)):
        route = server_route(n, v1_limit if routes["native_v1"] else None, fallback_above)
        ms, source = _at(routes[route], n)
        if ms is None:
            continue
        token_ms = layers * ms
        out.append({"tokens": n, "route": route, "layer_ms": ms, "token_ms": token_ms,
                    "tokens_per_s": 1e3 / token_ms if token_ms > 0 else math.inf,
                    "source": source})
    return out


def prefill(timings: Sequence[Record], layers: int, max_len: int, chunk: int) -> List[Record]:
    """Per measured chunk, and for the last chunk of a ``max_len`` prompt: the attention
    time of one engine step (layers x the chunk's time)."""
    measured = {int(r["context"]): float(r["ms"]) for r in timings if r["kernel"] == "prefix"}
    contexts = sorted(set(measured) | ({max(0, max_len - chunk)} if measured else set()))
    out = []
    for c in contexts:
        ms, source = _at(measured, c)
        if ms is not None:
            out.append({"context": c, "chunk": chunk, "layer_ms": ms,
                        "step_s": layers * ms / 1e3, "source": source})
    return out


def recommendations(timings: Sequence[Record], steps: Sequence[Record], v1_limit: Optional[int],
                    budget_mb: int, fallback_above: Optional[int] = None) -> List[Record]:
    """What to set, each with why: the decode route (from ``crossover``), the kernels'
    working set, the engine iteration time-out (from the longest ``prefill`` step)."""
    out: List[Record] = []
    cross = crossover(timings)
    if v1_limit is None:
        out.append({"setting": "VLLM_BI100_DECODE_FALLBACK_ABOVE", "value": None,
                    "why": "no native V1 measured here: every decode takes the pure-PyTorch "
                           "kernel; nothing to choose"})
    elif cross is None:
        out.append({"setting": "VLLM_BI100_DECODE_FALLBACK_ABOVE", "value": fallback_above,
                    "why": f"native V1 was faster at every length measured on both routes: "
                           f"keep V1 up to its limit ({v1_limit:,} tokens; the fallback above)"})
    else:
        value = cross["last_v1"] or 0
        out.append({"setting": "VLLM_BI100_DECODE_FALLBACK_ABOVE", "value": value,
                    "why": f"the fallback was at least as fast as native V1 from "
                           f"{cross['first_fallback']:,} tokens on (crossing near "
                           f"{cross['estimate']:,}); V1 stays below "
                           + (f"{value:,}" if value else "nothing: fallback always")})
    out.append({"setting": "VLLM_BI100_PREFIX_BUDGET_MB", "value": budget_mb,
                "why": "the pure-PyTorch kernels' working set per call the timings used; each "
                       "layer's call holds it on top of the KV cache (leave room for it in "
                       "--gpu-memory-utilization)"})
    if steps:
        longest = max(steps, key=lambda s: s["step_s"])
        need = TIMEOUT_MARGIN * longest["step_s"]
        value = max(ENGINE_TIMEOUT_DEFAULT_S, int(math.ceil(need / 60.0)) * 60)
        out.append({"setting": "VLLM_ENGINE_ITERATION_TIMEOUT_S", "value": value,
                    "why": f"the longest prefill chunk ({longest['chunk']:,} tokens after "
                           f"{longest['context']:,}) spends {longest['step_s']:.1f} s in "
                           f"attention over the model's layers ({longest['source']}); "
                           f"{TIMEOUT_MARGIN}x that, in whole minutes, at least vLLM's "
                           f"default {ENGINE_TIMEOUT_DEFAULT_S} s"})
    return out

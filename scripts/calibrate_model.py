"""Fit the BI-V100 model to the card's published measurements, and project the shim's kernels.

1. Replays the PyTorch formulations a team serving on BI-V100 measured, at the shapes and
   lengths they measured, under the project's account (``Account``, inside ``Uncomputed``: the
   ops are counted, not computed): their decode fallback and the same with their CoreX paged-KV
   gather kernel (6 query / 1 KV heads of 256, fp16; `docs/performance.md` names the files and
   commits), and their prefix fallback per 256-query chunk (4 / 1 heads of 256, fp16; 512-token
   key tiles, the strict prefix-cache split);
2. fits the model of ``vllm_bi100_patch.ops.selftest.calibrated`` (a host cost per launch, a
   bandwidth per op class, a matrix-product rate) to the measured times: least squares on the
   log of modelled / measured time, with a prior that holds each constant near its start
   (584 GB/s for every class, 6.2 us per launch, 147 TFLOPS) within a factor of about 4 (one
   standard deviation), so that what the points cannot tell apart stays where the card's own
   measurements put it;
3. projects the shim's kernels (GPU formulation) with the fitted constants at the field's
   deployment shape (4 / 1 heads of 256, fp16), beside the field's figures.

Writes ``vllm_bi100_patch/ops/selftest/fitted.py`` (the constants the selftest prints beside its
measurements) with ``--write``, and prints the tables of ``docs/performance.md``.
Deterministic (no timing, no random numbers); 13 minutes or more on a 2-core CPU (the shim's
2,048-query chunks at 235K tokens are most of it).

    python scripts/calibrate_model.py            # the tables
    python scripts/calibrate_model.py --write    # and the shipped constants
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT]

from tools.account import Account, Launch  # noqa: E402
from tools.uncomputed import Uncomputed  # noqa: E402
from vllm_bi100_patch.attention.kernels import paged_decode, paged_prefix  # noqa: E402
from vllm_bi100_patch.attention.kernels.forced import forced  # noqa: E402
from vllm_bi100_patch.ops.selftest.calibrated import CLASSES, Calibrated, op_class  # noqa: E402

FITTED = os.path.join(ROOT, "vllm_bi100_patch", "selftest", "fitted.py")
F16 = torch.float16
BLOCK = 16
#: The field's prefix fallback's key tile: 32 blocks of 16 (``BI100_PREFIX_BLOCKS_PER_TILE``).
FIELD_TILE = 512
#: Attention layers of the field's model (its per-token figures count ten).
LAYERS = 10
#: Start of the fit: the card's measured copy bandwidth and launch cost, the data sheet's fp16.
PRIOR = {"launch_s": 6.2e-6, "matmul": 584e9, "gather": 584e9, "elementwise": 584e9,
         "reduction": 584e9, "flops": 147e12}
PARAMS = ("launch_s",) + CLASSES + ("flops",)
#: One standard deviation of a measured point (log) and of the prior (log: a factor of 4).
SIGMA_DATA, SIGMA_PRIOR = 0.10, math.log(4.0)

# (label, formulation, query heads, KV heads, tokens or context, chunk, measured ms, source)
DECODE_SRC = "E_ATTN_05 production probe (46959b4)"
PREFIX_SRC = "the field's notes of 2026-10 (issue 43)"
POINTS: List[Tuple[str, str, int, int, int, int, float, str]] = [
    ("decode fallback 65,536", "field_decode", 6, 1, 65536, 1, 10.7258, DECODE_SRC),
    ("decode fallback 98,304", "field_decode", 6, 1, 98304, 1, 20.3227, DECODE_SRC),
    ("decode fallback 99,500", "field_decode", 6, 1, 99500, 1, 19.1004, DECODE_SRC),
    ("decode fallback 100,000", "field_decode", 6, 1, 100000, 1, 18.6604, DECODE_SRC),
    ("decode gather kernel 65,536", "field_gather", 6, 1, 65536, 1, 7.1363, DECODE_SRC),
    ("decode gather kernel 98,304", "field_gather", 6, 1, 98304, 1, 10.0553, DECODE_SRC),
    ("decode gather kernel 99,500", "field_gather", 6, 1, 99500, 1, 9.4184, DECODE_SRC),
    ("decode gather kernel 100,000", "field_gather", 6, 1, 100000, 1, 9.2576, DECODE_SRC),
    ("prefix fallback 74K + 256", "field_prefix", 4, 1, 74 * 1024, 256, 56.9, PREFIX_SRC),
    ("prefix fallback 128K + 256", "field_prefix", 4, 1, 128 * 1024, 256, 100.8, PREFIX_SRC),
    ("prefix fallback 235K + 256", "field_prefix", 4, 1, 235 * 1024, 256, 180.2, PREFIX_SRC),
]


# --- inputs (zeros: only shapes, block tables and lengths matter to the account) -----------

def _cache(kv: int, d: int, tokens: int):
    blocks = -(-tokens // BLOCK)
    kc = torch.zeros(blocks, kv, d // 8, BLOCK, 8, dtype=F16)
    vc = torch.zeros(blocks, kv, d, BLOCK, dtype=F16)
    return kc, vc, torch.arange(blocks, dtype=torch.int32).view(1, blocks)


def _decode_args(heads: int, kv: int, tokens: int, d: int = 256):
    kc, vc, bt = _cache(kv, d, tokens)
    return (torch.zeros(1, heads, d, dtype=F16), kc, vc, bt,
            torch.tensor([tokens], dtype=torch.int32))


def _prefix_args(heads: int, kv: int, context: int, chunk: int, d: int = 256):
    kc, vc, bt = _cache(kv, d, context + chunk)
    i32 = torch.int32
    return (torch.zeros(chunk, heads, d, dtype=F16), torch.zeros(chunk, kv, d, dtype=F16),
            torch.zeros(chunk, kv, d, dtype=F16), kc, vc, bt,
            torch.tensor([0, chunk], dtype=i32), torch.tensor([context + chunk], dtype=i32),
            torch.tensor([context], dtype=i32))


# --- the field's formulations, re-implemented from their public description ---------------
# Repository wudixzy/competition, qwen3_6_scripts/paged_attn.py at commit 32ead7f
# (``_forward_decode_pytorch``, ``_forward_prefix_pytorch``, the strict prefix split and the
# absolute key tiles) and, for the gather kernel, docs/experiments/E_ATTN_04 (one CoreX
# kernel reads the fp16 blocks and writes the fp32 K [kv, d, n] and V [kv, n, d]).

def field_decode(query, key_cache, value_cache, block_tables, seq_lens, scale,
                 acc: Optional[Account] = None) -> torch.Tensor:
    """Per sequence: gather K and V into fp32 (layout copies, or one gather kernel when
    ``acc`` is given: logged as one launch), two fp32 products around a softmax."""
    n, heads, d = query.shape
    kv, bs = key_cache.shape[1], value_cache.shape[3]
    out = torch.empty_like(query)
    for i in range(n):
        length = int(seq_lens[i].item())
        ids = block_tables[i, :-(-length // bs)]
        if acc is None:
            k = key_cache[ids].permute(0, 3, 1, 2, 4).contiguous().view(-1, kv, d)[:length]
            k = k.permute(1, 2, 0).contiguous().float()
            v = value_cache[ids].permute(0, 3, 1, 2).contiguous().view(-1, kv, d)[:length]
            v = v.permute(1, 0, 2).contiguous().float()
        else:
            k = torch.empty(kv, d, length, dtype=torch.float32)
            v = torch.empty(kv, length, d, dtype=torch.float32)
            read = 2 * ids.numel() * bs * kv * d * key_cache.element_size()
            acc.log.append(Launch("corex_paged_kv_gather",
                                  read + ids.numel() * 4 + 2 * k.numel() * 4, 0))
        q = query[i].float().view(kv, heads // kv, d).unsqueeze(2)
        w = torch.softmax(torch.matmul(q * scale, k.unsqueeze(1)), dim=-1)
        out[i] = torch.matmul(w, v.unsqueeze(1)).view(heads, d).to(query.dtype)
    return out


def _online(scores, value, m, l_sum, o) -> None:
    top = torch.maximum(m, scores.amax(dim=-1))
    p = scores - top.unsqueeze(-1)
    p.exp_()
    corr = torch.exp(m - top)
    m.copy_(top)
    l_sum.mul_(corr).add_(p.sum(dim=-1))
    o.mul_(corr.unsqueeze(-1)).add_(torch.matmul(p, value))


def _field_segment(q, k_new, v_new, k_pre, v_pre, kc, vc, bt, seq, cached, tile, scale):
    n, heads, d = q.shape
    kv, bs = kc.shape[1], vc.shape[3]
    qs = q.permute(1, 0, 2).float().view(kv, heads // kv, n, d).mul(scale)
    m = torch.full((kv, heads // kv, n), float("-inf"))
    l_sum = torch.zeros_like(m)
    o = torch.zeros((kv, heads // kv, n, d))
    total = cached + k_pre.shape[0]
    for t0 in range(0, total, tile):  # absolute key tiles over the cache, then earlier keys
        t1 = min(t0 + tile, total)
        b0, b1 = min(t0, cached), min(t1, cached)
        p0, p1 = max(0, t0 - cached), max(0, t1 - cached)
        ks, vs = [], []
        if b1 > b0:
            ids = bt[seq, b0 // bs:-(-b1 // bs)]
            off = b0 - (b0 // bs) * bs
            ks.append(kc[ids].permute(0, 3, 1, 2, 4).contiguous().view(-1, kv, d)[off:off + b1 - b0])
            vs.append(vc[ids].permute(0, 3, 1, 2).contiguous().view(-1, kv, d)[off:off + b1 - b0])
        if p1 > p0:
            ks.append(k_pre[p0:p1])
            vs.append(v_pre[p0:p1])
        k = ks[0] if len(ks) == 1 else torch.cat(ks, dim=0)
        v = vs[0] if len(vs) == 1 else torch.cat(vs, dim=0)
        _online(torch.matmul(qs, k.permute(1, 0, 2).unsqueeze(1).transpose(-1, -2).float()),
                v.permute(1, 0, 2).unsqueeze(1).float(), m, l_sum, o)
    for t0 in range(0, n, tile):  # the segment's own keys, causal
        t1 = min(t0 + tile, n)
        s = torch.matmul(qs, k_new[t0:t1].permute(1, 0, 2).unsqueeze(1).transpose(-1, -2).float())
        mask = torch.arange(t0, t1).unsqueeze(0) > torch.arange(n).unsqueeze(1)
        s.masked_fill_(mask.unsqueeze(0).unsqueeze(0), float("-inf"))
        _online(s, v_new[t0:t1].permute(1, 0, 2).unsqueeze(1).float(), m, l_sum, o)
    o.div_(l_sum.unsqueeze(-1))
    return o.view(heads, n, d).permute(1, 0, 2).to(q.dtype)


def field_prefix(query, key, value, kc, vc, bt, qsl, seq_lens, ctx_lens, scale,
                 tile: int = FIELD_TILE) -> torch.Tensor:
    """Per sequence, per strict-prefix segment (a chunk is split where the prefix cache's last
    full block ends: the second segment reads the whole cache again), an online softmax over
    absolute key tiles."""
    out = torch.empty_like(query)
    bs = vc.shape[3]
    for i in range(seq_lens.shape[0]):
        cached, q0, q1 = int(ctx_lens[i].item()), int(qsl[i].item()), int(qsl[i + 1].item())
        n = q1 - q0
        split = ((cached + n - 1) // bs) * bs - cached
        segments = [(0, split), (split, n)] if 0 < split < n else [(0, n)]
        for s0, s1 in segments:
            out[q0 + s0:q0 + s1] = _field_segment(
                query[q0 + s0:q0 + s1], key[q0 + s0:q0 + s1], value[q0 + s0:q0 + s1],
                key[q0:q0 + s0], value[q0:q0 + s0], kc, vc, bt, i, cached, tile, scale)
    return out


# --- counting ---------------------------------------------------------------------------

def count(fn: Callable[[Optional[Account]], Any]) -> List[Launch]:
    with Uncomputed(), Account() as acc:
        fn(acc)
    return list(acc.log)


def field_account(formulation: str, heads: int, kv: int, tokens: int, chunk: int):
    scale = 256 ** -0.5
    if formulation == "field_prefix":
        args = _prefix_args(heads, kv, tokens, chunk)
        return count(lambda acc: field_prefix(*args, scale))
    args = _decode_args(heads, kv, tokens)
    gather = formulation == "field_gather"
    return count(lambda acc: field_decode(*args, scale, acc if gather else None))


def shim_account(kernel: str, heads: int, kv: int, tokens: int, chunk: int = 1,
                 budget_mb: int = 256) -> List[Launch]:
    """The shim's kernel in the GPU formulation (half products, the card's tile layout)."""
    scale = 256 ** -0.5
    with forced(compute="native", layout="generic", path=None):
        if kernel == "decode":
            args = _decode_args(heads, kv, tokens)
            return count(lambda acc: paged_decode(*args, scale, max_seq_len=tokens,
                                                  budget_mb=budget_mb))
        pargs = _prefix_args(heads, kv, tokens, chunk)
        return count(lambda acc: paged_prefix(*pargs, scale=scale, budget_mb=budget_mb))


# --- the fit ----------------------------------------------------------------------------

def model_of(values: Dict[str, float], source: str = "") -> Calibrated:
    return Calibrated(values["launch_s"], {c: values[c] for c in CLASSES}, values["flops"],
                      source)


def _summary(log: Sequence[Launch]):
    """Per class: launches and bytes; the products' (bytes, flops) one by one."""
    n = {c: 0 for c in CLASSES}
    b = {c: 0 for c in CLASSES}
    mm = []
    for x in log:
        c = op_class(x.name)
        n[c] += 1
        b[c] += x.bytes
        if c == "matmul":
            mm.append((x.bytes, x.flops))
    return n, b, mm


def _predict(summary, v: Dict[str, float]) -> float:
    n, b, mm = summary
    t = sum(n.values()) * v["launch_s"]
    t += sum(b[c] / v[c] for c in CLASSES if c != "matmul")
    t += sum(max(nb / v["matmul"], f / v["flops"]) for nb, f in mm)
    return t


def fit(summaries: Sequence[Any], measured_s: Sequence[float], iters: int = 200
        ) -> Dict[str, float]:
    """Levenberg-Marquardt on log parameters (numeric Jacobian, float64): deterministic."""
    p0 = torch.tensor([math.log(PRIOR[k]) for k in PARAMS], dtype=torch.float64)

    def residuals(p: torch.Tensor) -> torch.Tensor:
        v = {k: math.exp(float(x)) for k, x in zip(PARAMS, p)}
        data = [math.log(_predict(s, v) / m) / SIGMA_DATA for s, m in zip(summaries, measured_s)]
        prior = ((p - p0) / SIGMA_PRIOR).tolist()
        return torch.tensor(data + prior, dtype=torch.float64)

    p, lam = p0.clone(), 1e-2
    r = residuals(p)
    for _ in range(iters):
        jac = torch.stack([(residuals(p + 1e-6 * e) - r) / 1e-6
                           for e in torch.eye(len(PARAMS), dtype=torch.float64)], dim=1)
        a = jac.T @ jac
        g = jac.T @ r
        step = torch.linalg.solve(a + lam * torch.diag(torch.diag(a)), -g)
        r_new = residuals(p + step)
        if float(r_new @ r_new) < float(r @ r):
            p, r, lam = p + step, r_new, lam / 3
            if float(step.abs().max()) < 1e-9:
                break
        else:
            lam *= 4
    return {k: math.exp(float(x)) for k, x in zip(PARAMS, p)}


# --- tables -----------------------------------------------------------------------------

def _md(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return "\n".join(out + ["| " + " | ".join(r) + " |" for r in rows])


def write_constants(model: Calibrated) -> None:
    """``selftest/fitted.py`` from the fitted model."""
    d = model.as_dict()
    bw = ",\n".join(f"        \"{c}\": {d['bandwidth_gb_per_s'][c]:.2f}" for c in CLASSES)
    with open(FITTED, "w", encoding="utf-8") as fh:
        fh.write('"""The BI-V100 model\'s constants, fitted to the card\'s published '
                 'measurements.\n\nGenerated by ``python scripts/calibrate_model.py --write`` '
                 '(do not edit); read by\n``selftest.calibrated``. ``docs/performance.md`` has '
                 'every point, its fitted value and\nits residual.\n"""\n\n'
                 f"CONSTANTS = {{\n    \"launch_us\": {d['launch_us']:.4f},\n"
                 f"    \"bandwidth_gb_per_s\": {{\n{bw},\n    }},\n"
                 f"    \"tflops\": {d['tflops']:.4f},\n"
                 f"    \"source\": ({d['source'][:70]!r}\n               {d['source'][70:]!r}),\n}}\n")


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--write", action="store_true", help="write " + os.path.relpath(FITTED, ROOT))
    a = p.parse_args(argv)
    torch.manual_seed(0)
    logs = [field_account(f, h, kv, n, c) for _, f, h, kv, n, c, _, _ in POINTS]
    sums = [_summary(log) for log in logs]
    measured = [ms / 1e3 for *_, ms, _ in POINTS]
    values = fit(sums, measured)
    prior = model_of(PRIOR)
    model = model_of(values, "scripts/calibrate_model.py: 11 published BI-V100 timings (decode "
                             "fallback and gather kernel at 6/1 heads, prefix fallback at 4/1 "
                             "heads), docs/performance.md")
    rows = []
    for (label, _, h, kv, _n, _c, ms, src), log in zip(POINTS, logs):
        fitted = model.predict(log) * 1e3
        moved = sum(x.bytes for x in log) / 2**20
        rows.append([label, f"{h}/{kv}", f"{len(log):,}", f"{moved:,.0f}", f"{ms:.2f}",
                     f"{prior.predict(log) * 1e3:.2f}", f"{fitted:.2f}",
                     f"{(fitted / ms - 1) * 100:+.0f}%", src])
    print("## fit: each measured point, the model at its start and fitted\n")
    print(_md(["point", "heads", "launches", "MiB moved", "measured ms", "start ms",
               "fitted ms", "residual", "source"], rows))
    print("\n## constants\n")
    crow = [["per launch (us)", f"{PRIOR['launch_s'] * 1e6:.2f}", f"{values['launch_s'] * 1e6:.2f}"]]
    crow += [[f"bandwidth, {c} (GB/s)", f"{PRIOR[c] / 1e9:,.0f}", f"{values[c] / 1e9:,.0f}"]
             for c in CLASSES]
    crow += [["matrix-product rate (TFLOP/s)", f"{PRIOR['flops'] / 1e12:.0f}",
              f"{values['flops'] / 1e12:.1f}"]]
    print(_md(["constant", "start", "fitted"], crow))
    print("\n## projection of the shim's kernels (GPU formulation, fp16, budget 256 MiB)\n")
    drows = []
    for n in (32768, 65536, 131072, 235 * 1024):
        shim4 = model.predict(shim_account("decode", 4, 1, n)) * 1e3
        shim6 = model.predict(shim_account("decode", 6, 1, n)) * 1e3
        fb = model.predict(field_account("field_decode", 6, 1, n, 1)) * 1e3
        ga = model.predict(field_account("field_gather", 6, 1, n, 1)) * 1e3
        drows.append([f"{n:,}", f"{shim4:.2f}", f"{shim6:.2f}", f"{fb:.2f}", f"{ga:.2f}"])
    print(_md(["decode tokens", "shim 4/1 ms", "shim 6/1 ms", "field fallback 6/1 (model) ms",
               "field gather kernel 6/1 (model) ms"], drows))
    prows = []
    per_chunk: Dict[int, List[Tuple[int, float]]] = {256: [], 2048: []}
    for ctx in (0, 65536, 131072, 235 * 1024):
        for chunk in (256, 2048):
            t = model.predict(shim_account("prefix", 4, 1, ctx, chunk)) * 1e3
            per_chunk[chunk].append((ctx, t))
        if ctx:
            fb = model.predict(field_account("field_prefix", 4, 1, ctx, 256)) * 1e3
            prows.append([f"{ctx:,}", f"{per_chunk[256][-1][1]:.1f}",
                          f"{per_chunk[2048][-1][1]:.1f}", f"{fb:.1f}"])
    print()
    print(_md(["prefix context", "shim 256 queries ms", "shim 2,048 queries ms",
               "field fallback 256 (model) ms"], prows))
    # A 235K prompt in 2,048-token chunks: per chunk, linear in its context between the points.
    pts = per_chunk[2048]
    total, prompt = 0.0, 235 * 1024
    for start in range(0, prompt, 2048):
        for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
            if x0 <= start <= x1:
                total += y0 + (y1 - y0) * (start - x0) / (x1 - x0)
                break
    dec = model.predict(shim_account("decode", 4, 1, prompt)) * 1e3
    print(f"\n235K prompt (2,048-token chunks, {LAYERS} layers): attention {total * LAYERS / 1e3:.1f} s; "
          f"decode at 235K, attention alone: {LAYERS * dec:.1f} ms per token, "
          f"{1e3 / (LAYERS * dec):.1f} tokens/s")
    if a.write:
        write_constants(model)
        print(f"\nwrote {os.path.relpath(FITTED, ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

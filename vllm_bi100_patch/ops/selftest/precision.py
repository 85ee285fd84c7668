# mypy: disable-error-code="call-arg,arg-type,misc"
# (the checks unpack argument lists built by the reference helpers: *args then more positionals)
"""The logit-precision grid (issue 34): attention at ordinary and large logits, against float64
and against what vLLM's own CUDA paged-attention kernel computes.

Rows: ``("sigma", s)``, the attention logits (after the softmax scale) drawn with standard
deviation ``s`` (1, 5, 10, 30); ``("sink", x)``, std-1 logits plus four *sink* keys (positions
0-3, as real models' first tokens) whose logits are ``x`` (10, 50, 100, 200) above them, for
every query.  The error of a kernel's output is the median, over its elements, of
``|out - ref| / |ref|`` with ``ref`` the float64 attention of the same half-precision inputs
(``median_rel_error``); the bar is the same error of the *float32-score reference*
(``float32_score_reference``): float32 ``q.k`` and softmax, the probabilities rounded to the
half dtype, float32 ``P.V``, the output rounded to the half dtype (vLLM's
``paged_attention_v1`` kernel, ``csrc/attention/attention_kernels.cu``: float ``qk`` and
``logits``, ``from_float`` of the normalised logits before the value dot products, float
accumulators).  ``precision_results`` measures decode, the prefix (both key-group layouts) and
the dense kernel; ``check_logit_precision`` (``vllm-bi100-patch selftest``) requires every
ratio at most ``MAX_RATIO``.  Needs torch only.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ...attention.kernels import paged_decode, paged_prefix
from ...attention.kernels.prefill import dense

__all__ = ["ALL_LOGITS", "DIFFUSE_LOGITS", "LOGITS", "MAX_RATIO", "float32_score_reference", "logit_case",
           "median_rel_error", "precision_results"]

#: The rows of issue 34's table: logit standard deviations and sink heights.
LOGITS: Tuple[Tuple[str, float], ...] = (
    ("sigma", 1.0), ("sigma", 5.0), ("sigma", 10.0), ("sigma", 30.0),
    ("sink", 10.0), ("sink", 50.0), ("sink", 100.0), ("sink", 200.0))
#: Issue 41's rows besides: ``sigma`` 0.5, a sink of 1,000 and the *diffuse* rows, a bulk of
#: keys whose logits have standard deviation 0.1 (``diffuse0.1``) or 0.3 (``diffuse0.3``)
#: and one key 3, 4.5 or 7 above them (the bulk together carries most of the weight).
DIFFUSE_LOGITS: Tuple[Tuple[str, float], ...] = (
    ("diffuse0.1", 3.0), ("diffuse0.1", 4.5), ("diffuse0.1", 7.0),
    ("diffuse0.3", 3.0), ("diffuse0.3", 4.5), ("diffuse0.3", 7.0))
ALL_LOGITS: Tuple[Tuple[str, float], ...] = (
    (("sigma", 0.5),) + LOGITS[:4] + LOGITS[4:] + (("sink", 1000.0),) + DIFFUSE_LOGITS)
#: A kernel's median error may be at most this many times the float32-score reference's.
MAX_RATIO = 2.0
#: Positions of the sink keys.
SINKS = 4


def logit_case(dtype: torch.dtype, kind: str, size: float, *, ctx: int, new: int,
               heads: int = 4, kv_heads: int = 1, head_size: int = 128, seed: int = 0,
               device: Any = "cpu") -> List[torch.Tensor]:
    """One sequence of ``ctx`` cached and ``new`` new tokens (block 16, blocks in order) whose
    logits follow the row ``(kind, size)``; returns the ``paged_prefix`` arguments
    ``q, k, v, key_cache, value_cache, block_table, query_start_loc, seq_lens,
    context_lens`` (scale ``head_size ** -0.5``).

    Keys and values are standard normal; each query is a random direction of norm
    ``sigma * sqrt(head_size)`` (logits ``N(0, sigma**2)``).  Sinks: every query of a KV
    head's group gets a unit component along one direction ``u`` (its random part made
    orthogonal to ``u``) and the keys at positions 0-3 get ``size / scale`` along ``u``:
    their logits are ``size`` above std-1 logits for every query.  Diffuse
    (``diffuse<std>``): the same with logits of standard deviation ``std`` and one such key,
    the last cached one (the middle one without a cache): seen by every new query, inside
    any window."""
    g = torch.Generator().manual_seed(seed)
    total, d = ctx + new, head_size
    group, scale = heads // kv_heads, head_size ** -0.5
    diffuse = kind.startswith("diffuse")
    sigma = size if kind == "sigma" else float(kind[7:]) if diffuse else 1.0
    lifted = kind == "sink" or diffuse
    first = 0 if kind == "sink" else ctx - 1 if ctx else total // 2  # the lifted keys
    count = SINKS if kind == "sink" else 1
    k = torch.randn(total, kv_heads, d, generator=g, dtype=torch.float64)
    v = torch.randn(total, kv_heads, d, generator=g, dtype=torch.float64)
    q = torch.randn(new, heads, d, generator=g, dtype=torch.float64)
    if lifted:
        u = torch.randn(kv_heads, d, generator=g, dtype=torch.float64)
        u = (u / u.norm(dim=-1, keepdim=True)).repeat_interleave(group, 0)  # [heads, d]
        q = q - (q * u).sum(-1, keepdim=True) * u
    q = q / q.norm(dim=-1, keepdim=True) * sigma * math.sqrt(d)
    if lifted:
        q = q + u
        k[first:first + count] += size / scale * u[::group]
    elif kind != "sigma":
        raise ValueError(f"kind must be 'sigma', 'sink' or 'diffuse<std>', got {kind!r}")
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    blocks = max(1, math.ceil(total / 16))
    x = 16 // torch.empty((), dtype=dtype).element_size()
    kc = k.new_zeros(blocks * 16, kv_heads, d)
    vc = kc.clone()
    kc[:total], vc[:total] = k, v
    key_cache = kc.view(blocks, 16, kv_heads, d // x, x).permute(0, 2, 3, 1, 4).contiguous()
    value_cache = vc.view(blocks, 16, kv_heads, d).permute(0, 2, 3, 1).contiguous()
    bt = torch.arange(blocks, dtype=torch.int32).view(1, blocks)
    args = [q, k[ctx:], v[ctx:], key_cache, value_cache, bt,
            torch.tensor([0, new], dtype=torch.int32), torch.tensor([total], dtype=torch.int32),
            torch.tensor([ctx], dtype=torch.int32)]
    return [t.to(device) for t in args]


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: int, scale: float,
               dtype: torch.dtype, alibi: Optional[torch.Tensor], window: Optional[int],
               float32_scores: bool) -> torch.Tensor:
    """Causal attention of queries at positions ``ctx ..`` over keys ``0 ..``: float64
    throughout, or vLLM's kernel's numerics (``float32_scores``)."""
    work = torch.float32 if float32_scores else torch.float64
    new, heads, d = q.shape
    kv = k.shape[1]
    group = heads // kv
    # Per KV head (no copy of K/V per query head: a 131,072-token case stays small).
    s = torch.einsum("qcgd,tcd->cgqt", q.to(work).view(new, kv, group, d), k.to(work))
    s = s.reshape(heads, new, -1) * scale
    qp = torch.arange(ctx, ctx + new, dtype=work).view(1, new, 1)
    kp = torch.arange(k.shape[0], dtype=work).view(1, 1, -1)
    if alibi is not None:
        s = s + alibi.to(work).view(heads, 1, 1) * (kp - qp)
    hidden = kp > qp
    if window is not None:
        hidden = hidden | (kp <= qp - window)
    p = torch.softmax(s.masked_fill(hidden, -math.inf), dim=-1)
    if float32_scores:
        p = p.to(dtype).to(work)
    out = torch.einsum("cgqt,tcd->qcgd", p.view(kv, group, new, -1), v.to(work))
    out = out.reshape(new, heads, d)
    return out.to(dtype) if float32_scores else out


def float32_score_reference(case: Sequence[torch.Tensor], alibi: Optional[torch.Tensor] = None,
                            window: Optional[int] = None, last: int = 0) -> torch.Tensor:
    """What vLLM's CUDA kernel computes for a ``logit_case``'s new tokens (module
    docstring; ``last``: only the last so many), in the case's dtype."""
    return _case_attention(case, alibi, window, True, last)


def reference64(case: Sequence[torch.Tensor], alibi: Optional[torch.Tensor] = None,
                window: Optional[int] = None, last: int = 0) -> torch.Tensor:
    """The float64 attention of a ``logit_case``'s new tokens (``last``: only the last so
    many)."""
    return _case_attention(case, alibi, window, False, last)


def _case_attention(case, alibi, window, float32_scores, last=0):
    q, k_new, v_new, kc, vc = (t.cpu() for t in case[:5])
    ctx = int(case[8][0])
    d, kv = q.shape[2], kc.shape[1]
    k_old = kc.permute(0, 3, 1, 2, 4).reshape(-1, kv, d)[:ctx]
    v_old = vc.permute(0, 3, 1, 2).reshape(-1, kv, d)[:ctx]
    k = torch.cat([k_old, k_new])
    v = torch.cat([v_old, v_new])
    first = ctx  # position of the first query row measured
    if last:
        first, q = ctx + q.shape[0] - last, q[-last:]
    return _attention(q, k, v, first, d ** -0.5, q.dtype, alibi, window, float32_scores)


def median_rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """The median over elements of ``|out - ref| / |ref|`` (``ref`` float64)."""
    ref = ref.to(torch.float64)
    return ((out.cpu().to(torch.float64) - ref).abs() / ref.abs()).median().item()


def _run(kernel: str, case: List[torch.Tensor], alibi: Optional[torch.Tensor],
         window: Optional[int], budget_mb: int) -> torch.Tensor:
    q = case[0]
    scale = q.shape[2] ** -0.5
    slopes = None if alibi is None else alibi.to(q.device)
    if kernel == "decode":
        _, _, _, kc, vc, bt, _, sl, _ = case
        return paged_decode(q[-1:], kc, vc, bt, sl, scale, alibi_slopes=slopes,
                            budget_mb=budget_mb)
    if kernel == "prefix":
        return paged_prefix(*case, scale=scale, alibi_slopes=slopes, sliding_window=window,
                            budget_mb=budget_mb)
    raise ValueError(kernel)


def precision_results(device: torch.device, dtypes: Sequence[torch.dtype],
                      kernels: Sequence[str] = ("decode", "prefix", "dense"),
                      logits: Sequence[Tuple[str, float]] = LOGITS, *, decode_len: int = 4096,
                      ctx: int = 512, new: int = 256, heads: int = 4, kv_heads: int = 1,
                      head_size: int = 128, variants: Sequence[str] = ("plain",),
                      seed: int = 0, dense_last: int = 0) -> List[Dict[str, Any]]:
    """Each kernel's median error on each row, beside the float32-score reference's.

    ``variants`` of the prefix and dense kernels: ``plain``, ``alibi`` (slopes ``2**-2``,
    ``2**-4``, ... per query head), ``window`` (a sliding window of ``ctx // 2``) and
    ``groups`` (the prefix under a budget of 1 MiB: keys staged in several groups, tiles
    spanning them).  The dense kernel runs a prompt of ``ctx + new`` tokens, measured on
    every row or, with ``dense_last``, on its last so many (they see the most keys).
    Returns dicts: ``kernel``, ``variant``, ``dtype``, ``row`` (e.g. ``sigma 5``),
    ``error``, ``reference``, ``ratio``."""
    out: List[Dict[str, Any]] = []
    for dtype in dtypes:
        for kind, size in logits:
            for kernel in kernels:
                for variant in (("plain",) if kernel == "decode" else variants):
                    out.append(_result(device, dtype, kind, size, kernel, variant, decode_len,
                                       ctx, new, heads, kv_heads, head_size, seed, dense_last))
    return out


def _result(device, dtype, kind, size, kernel, variant, decode_len, ctx, new, heads, kv_heads,
            head_size, seed, dense_last=0) -> Dict[str, Any]:
    alibi = window = None
    budget_mb = 256
    if variant == "alibi":
        alibi = torch.tensor([2.0 ** (-2 * (h + 1)) for h in range(heads)])
    elif variant == "window":
        window = ctx // 2
    elif variant == "groups":
        budget_mb = 1
    elif variant != "plain":
        raise ValueError(f"unknown variant {variant!r}")
    if kernel == "decode":
        case = logit_case(dtype, kind, size, ctx=decode_len - 1, new=1, heads=heads,
                          kv_heads=kv_heads, head_size=head_size, seed=seed, device=device)
    else:
        first = ctx if kernel == "prefix" else 0  # dense: the whole prompt's rows
        case = logit_case(dtype, kind, size, ctx=first, new=ctx + new - first, heads=heads,
                          kv_heads=kv_heads, head_size=head_size, seed=seed, device=device)
    last = dense_last if kernel == "dense" else 0
    ref = reference64(case, alibi, window, last)
    f32 = float32_score_reference(case, alibi, window, last)
    if kernel == "decode":
        got = _run("decode", case, alibi, window, budget_mb)
        ref, f32 = ref[-1:], f32[-1:]
    elif kernel == "prefix":
        got = _run("prefix", case, alibi, window, budget_mb)
    else:
        q, k, v = case[0], case[1], case[2]
        got = dense.varlen_attention(q, k, v, [q.shape[0]], head_size ** -0.5,
                                     alibi_slopes=None if alibi is None else alibi.to(q.device),
                                     sliding_window=window, budget_mb=budget_mb)
        got = got[-last:] if last else got
    err, bar = median_rel_error(got, ref), median_rel_error(f32, ref)
    return {"kernel": kernel, "variant": variant, "dtype": str(dtype).replace("torch.", ""),
            "row": f"{kind} {size:g}", "error": err, "reference": bar,
            "ratio": err / bar if bar > 0 else math.inf}

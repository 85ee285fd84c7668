# mypy: disable-error-code="call-arg,arg-type,misc"
# (the checks unpack argument lists built by the reference helpers: *args then more positionals)
"""The magnitude grid of the device checks: one sequence at magnitudes around and past
float16's range, decode, the tiled (and, on CPU, the SDPA) prefix and the dense kernel
against the float64 reference (``checks.check_large_magnitudes``; ``tests/attention/kernels/
test_overflow.py`` runs the same cases)."""

from __future__ import annotations

import math

import torch

from ...attention.kernels import paged_decode, paged_prefix
from ...attention.kernels.compute import compute_mode
from ...attention.kernels.prefill import dense
from ...attention.kernels.forced import forced
from .reference import TOLERANCE, ref_prefix, rel_error


def magnitude_case(dtype: torch.dtype, ctx: int, new: int, q_val: float, k_val: float,
                   v_val: float, *, constant: bool, head_size: int = 128, seed: int = 0):
    """One sequence of ``ctx`` cached tokens (block 16, blocks in order) and ``new`` new ones,
    two query heads on one KV head.  ``constant``: every q/k component is ``q_val``/``k_val``
    (all scores equal: the softmax is uniform whatever their size) and values are
    ``v_val``; else q/k are normal times ``q_val``/``k_val`` and values uniform in
    ``[-v_val, v_val]``.  Returns the prefix arguments (decode uses ``(q[-1:], kc, vc, bt,
    seq_lens)`` of a context of ``ctx + new`` tokens, see ``decode_from``)."""
    g = torch.Generator().manual_seed(seed)
    total, x = ctx + new, 16 // torch.empty((), dtype=dtype).element_size()
    blocks = max(1, math.ceil(total / 16))

    def draw(shape, val, uniform=False):
        if constant:
            return torch.full(shape, float(val))
        if uniform:
            return (torch.rand(shape, generator=g) * 2 - 1) * val
        return torch.randn(shape, generator=g) * val

    k_all = draw((total, 1, head_size), k_val).to(dtype)
    v_all = draw((total, 1, head_size), v_val, uniform=True).to(dtype)
    kc = k_all[:blocks * 16].new_zeros(blocks * 16, 1, head_size)
    vc = kc.clone()
    kc[:total], vc[:total] = k_all, v_all
    # Dense [tokens, 1, D] -> vLLM's layout: key [blocks, 1, D/x, 16, x], value [blocks, 1, D, 16].
    key_cache = kc.view(blocks, 16, 1, head_size // x, x).permute(0, 2, 3, 1, 4).contiguous()
    value_cache = vc.view(blocks, 16, 1, head_size).permute(0, 2, 3, 1).contiguous()
    q = draw((new, 2, head_size), q_val).to(dtype)
    bt = torch.arange(blocks, dtype=torch.int32).view(1, blocks)
    return (q, k_all[ctx:], v_all[ctx:], key_cache, value_cache, bt,
            torch.tensor([0, new], dtype=torch.int32),
            torch.tensor([total], dtype=torch.int32), torch.tensor([ctx], dtype=torch.int32))


def decode_from(case):
    """The decode call of a ``magnitude_case``: the last new token's query over all
    ``ctx + new`` tokens (the case's cache holds them all)."""
    q, _, _, kc, vc, bt, _, sl, _ = case
    return q[-1:], kc, vc, bt, sl


#: (ctx, new, q, k, v, constant): the issue's reproductions (values 128 / 300 over 4,096
#: tokens, q = k = 24 with head 128) and magnitudes around and past the float16 range:
#: unnormalised P.V sums up to 4,096 x 60,000, scores q.k up to 1.3e6 before scaling
#: (1.1e5 after: past float16 even when scaled first).
MAGNITUDES = [
    (4096, 8, 1.0, 0.0, 128.0, True),
    (4096, 8, 1.0, 1.0, 300.0, True),
    (4096, 8, 1.0, 1.0, 300.0, False),
    (4096, 8, 1.0, 1.0, 60000.0, False),
    (600, 8, 24.0, 24.0, 1.0, True),
    (600, 8, 64.0, 64.0, 50.0, True),
    (600, 8, 100.0, 100.0, 1000.0, True),
    (300, 8, 2.0, 2.0, 20000.0, False),
]


def large_magnitude_errors(device: torch.device, dtype: torch.dtype) -> list:
    """``MAGNITUDES`` for one dtype: the cases whose error against the float64 reference
    exceeds ``TOLERANCE`` (decode, the tiled prefix and, on CPU, the SDPA prefix path)."""
    failures = []
    bound = TOLERANCE[(compute_mode(device), dtype)]
    scale = 128 ** -0.5
    for ctx, new, qv, kv, vv, const in MAGNITUDES:
        case = magnitude_case(dtype, ctx, new, qv, kv, vv, constant=const)
        ref = ref_prefix(*case, scale)
        dev = [t.to(device) for t in case]
        for path in ["tiled"] + (["sdpa"] if device.type == "cpu" else []):
            with forced(path=path):
                out = paged_prefix(*dev, scale=scale).cpu()
            err = rel_error(out, ref)
            if not err <= bound:
                failures.append((f"prefix {path}", ctx, qv, kv, vv, const, err))
        err = rel_error(paged_decode(*decode_from(dev), scale).cpu(), ref[-1:])
        if not err <= bound:
            failures.append(("decode", ctx, qv, kv, vv, const, err))
        err = rel_error(dense_last_rows(case, dtype, ctx, qv, kv, vv, const, scale, device), ref)
        if not err <= bound:
            failures.append(("dense", ctx, qv, kv, vv, const, err))
    return failures


def dense_last_rows(case, dtype: torch.dtype, ctx: int, qv: float, kv: float, vv: float,
                    const: bool, scale: float, device: torch.device) -> torch.Tensor:
    """The dense kernel (row ``dense_prefill``) over the whole ``magnitude_case`` sequence as
    one prompt: its last ``new`` rows are the case's prefix rows (the same keys, values and
    last queries; the earlier queries are drawn like them)."""
    q = case[0]
    whole = magnitude_case(dtype, 0, ctx + q.shape[0], qv, kv, vv, constant=const)
    q_all = torch.cat([whole[0][:ctx], q])  # k and v: the same draws as the case's
    args = [t.to(device) for t in (q_all, whole[1], whole[2])]
    return dense.varlen_attention(*args, [q_all.shape[0]], scale)[ctx:].cpu()

"""doctor's audit of the installed ``vllm._custom_ops``, and its engine-timeout warning.

Iluvatar's CoreX 3.2.3 build routes its ops through ``ixformer.functions`` names that its
ixformer does not define (``docs/corex-3.2.3.md``): the first call crashes the engine with an
``AttributeError``.  ``audit`` reads the source of every function the ops module defines and
lists those whose body calls ``<module>.<name>(...)`` on a module global that has no such
name (calls guarded by ``hasattr`` and names a local shadows are not judged; a lookup that
raises is reported, never raised), each with the vLLM feature that calls it: ``ok`` where a
patch row applied in this process replaces every caller (the swap/copy/write rows), ``FAIL``
where nothing does (the feature will crash).  Calls into ``torch.ops`` are never judged
(stock wheels on a CPU torch have no kernels behind them; on their own hardware they do).
``timeout_check`` warns where vLLM's engine-iteration timeout is too short for long prompts on
the pure-PyTorch paths.

Imported by doctor only, after vLLM's ops were imported; never imports vLLM itself.
"""

from __future__ import annotations

import inspect
import os
import types
from typing import Any, Dict, List, Sequence, Tuple

from ..patching.missing_calls import missing_calls

#: (state, name, detail), as doctor's sections hold them.
Check = Tuple[str, str, str]

_MOE = "MoE models (FusedMoE)"
#: What in vLLM calls each ops function (names not listed: "whatever calls it").
FEATURES: Dict[str, str] = {
    "swap_blocks": "preemption by swapping KV blocks to CPU (n > 1, beam search under memory "
                   "pressure)",
    "copy_blocks": "copy-on-write of shared KV blocks (parallel sampling, beam search)",
    "reshape_and_cache": "every KV cache write (PagedAttention backends)",
    "reshape_and_cache_flash": "KV cache writes of the FlashAttention backend",
    "paged_attention_v1": "decode (PagedAttention V1)",
    "paged_attention_v2": "decode (PagedAttention V2)",
    "moe_align_block_size": _MOE + ": expert alignment",
    "topk_softmax": _MOE + ": top-k gating",
    "invoke_fused_moe_kernel": _MOE + ": expert GEMMs",
}
#: The patch rows that replace every caller of an ops function (any one applied suffices).
REPLACED_BY: Dict[str, Tuple[str, ...]] = {
    "swap_blocks": ("swap_blocks",), "copy_blocks": ("copy_blocks",),
    "reshape_and_cache": ("kv_write",), "paged_attention_v1": ("decode",),
    "paged_attention_v2": ("decode",),
}
_MOE_OPS = ("moe_align_block_size", "topk_softmax", "invoke_fused_moe_kernel")

#: vLLM's own default of ``VLLM_ENGINE_ITERATION_TIMEOUT_S`` (``vllm/envs.py``).
ENGINE_TIMEOUT = "VLLM_ENGINE_ITERATION_TIMEOUT_S"
VLLM_DEFAULT_TIMEOUT_S = 60
#: What the field ran long-context servers on the pure-PyTorch paths with.
FIELD_TIMEOUT_S = 3600


def broken_ops(ops: types.ModuleType) -> Dict[str, List[str]]:
    """The functions ``ops`` defines that call a missing function: name -> what they call."""
    out: Dict[str, List[str]] = {}
    for name, func in vars(ops).items():
        if inspect.isfunction(func) and func.__module__ == ops.__name__:
            missing = missing_calls(func)
            if missing:
                out[name] = missing
    return out


def audit(ops: types.ModuleType, applied: Sequence[str]) -> List[Check]:
    """doctor's checks for ``ops`` given the patch rows ``applied`` in this process."""
    checks: List[Check] = []
    broken = broken_ops(ops)
    for name, missing in broken.items():
        feature = FEATURES.get(name, f"whatever calls {ops.__name__}.{name}")
        calls = ", ".join(missing)
        rows = [r for r in REPLACED_BY.get(name, ()) if r in applied]
        if rows:
            checks.append(("ok", name, f"calls {calls} (absent); replaced by the shim's row "
                           f"{rows[0]}: {feature} works"))
        else:
            checks.append(("FAIL", name, f"calls {calls}, which does not exist: {feature} "
                           "will crash (no patch row replaces it)"))
    moe_broken = [n for n in _MOE_OPS if n in broken]
    if vars(ops).get("supports_moe_ops") is True and moe_broken:
        checks.append(("FAIL", "supports_moe_ops", f"True, but {', '.join(moe_broken)} call "
                       f"missing functions: {_MOE} will crash; serve dense models only"))
    if not broken:
        checks.append(("ok", ops.__name__, "every function calls only functions that exist"))
    return checks


def timeout_check(pure_paths: Sequence[str], environ: Any = None) -> Check:
    """Warn when vLLM's engine-iteration timeout is below what long prompts on the shim's
    pure-PyTorch paths (``pure_paths``: what runs there) need."""
    env = os.environ if environ is None else environ
    raw = env.get(ENGINE_TIMEOUT)
    where = ", ".join(pure_paths)
    try:
        value = VLLM_DEFAULT_TIMEOUT_S if raw is None else int(raw)
    except ValueError:
        return ("FAIL", ENGINE_TIMEOUT, f"{raw!r} is not an integer: vLLM fails at start-up")
    given = f"{value} s" + (" (vLLM's default)" if raw is None else "")
    if value < FIELD_TIMEOUT_S:
        return ("WARN", ENGINE_TIMEOUT, f"{given}: a long-context prompt on the pure-PyTorch "
                f"paths ({where}) can take minutes per engine step, and vLLM's API server "
                f"aborts the engine after this many seconds; set it far higher (the field ran "
                f"{FIELD_TIMEOUT_S}) for long-context serving")
    return ("ok", ENGINE_TIMEOUT, f"{given}: room for long prompts on the pure-PyTorch paths "
            f"({where})")


def doctor_checks(applied: Sequence[str]) -> List[Check]:
    """The audit of the ops module vLLM imported in this process, plus the timeout check
    where the shim patched something that runs in pure PyTorch (``applied``: the rows the
    registry applied in this process)."""
    import sys

    ops = sys.modules.get("vllm._custom_ops")
    checks = audit(ops, applied) if ops is not None else [
        ("info", "vllm._custom_ops", "not imported in this process: not audited")]
    pure = [what for row, what in (("prefix", "chunked prefill and prefix caching"),
                                   ("decode", "decode above the native V1 limit"),
                                   ("dense_prefill", "prompts above the dense head-size limit"))
            if row in applied]
    if pure:
        checks.append(timeout_check(pure))
    return checks

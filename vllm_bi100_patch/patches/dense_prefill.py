"""Replacement for ``XFormersImpl._run_memory_efficient_xformers_forward`` on ixformer builds.

Catalogue entry: row ``dense_prefill`` of ``vllm_bi100_patch.table``.

Iluvatar's CoreX 3.2.3 XFormers backend runs every prompt without a cached prefix, and vLLM's
memory-profiling run at start-up, through ``ixformer.contrib.xformers``' flash ``FwOp``, which
fails above head size 128: a causal bias raises, a mask returns wrong values silently
(``docs/corex-3.2.3.md``).  The row is conditional: ``dense_needed`` applies it only where the
backend's ``xops`` is ixformer's and the method builds ``xops.fmha.flash.FwOp()`` and passes it
as ``op=``; stock vLLM (xformers' own kernels) is never patched.  The wrapper sends head sizes
above ``VLLM_BI100_DENSE_HEAD_MAX`` to ``kernels.dense.varlen_attention`` (tiled under
``VLLM_BI100_PREFIX_BUDGET_MB``); smaller heads keep the vendor kernel.  Never imports vLLM.
"""

from __future__ import annotations

import ast
import types
from typing import Any, Callable, Dict, Optional, Tuple

from .. import config
from ..kernels import dense
from ..source import source_tree
from ..versions import Family
from ._common import ArgReader, Wrapper, counter

CLASS = "XFormersImpl"
METHOD = "_run_memory_efficient_xformers_forward"
#: The method's parameters after ``self`` (the row's code check includes ``self``).
PARAMS = ("query", "key", "value", "attn_metadata", "attn_type")

PREFILL_CALLS = counter("dense_prefill")
VENDOR_CALLS = counter("dense_vendor")


def _dotted(node: ast.AST) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def uses_ixformer_fwop(func: Callable[..., Any], xops: Any) -> Optional[str]:
    """None when ``func`` builds ``xops.fmha.flash.FwOp()`` and passes it (or the attribute
    it was stored in) as ``op=`` to ``xops.memory_efficient_attention_forward``, with ``xops``
    ixformer's module; else what differs."""
    name = getattr(xops, "__name__", None)
    if not isinstance(xops, types.ModuleType) or not str(name).startswith("ixformer"):
        return f"the backend's xops is {name or 'missing'}, not ixformer's"
    parsed = source_tree(func)
    if parsed is None:
        return f"the source of {METHOD} cannot be read"
    built = passed = False
    for node in ast.walk(parsed[0]):
        if isinstance(node, ast.Call) and _dotted(node.func) == "xops.fmha.flash.FwOp":
            built = True
        if isinstance(node, ast.Call) \
                and _dotted(node.func) == "xops.memory_efficient_attention_forward" \
                and any(k.arg == "op" for k in node.keywords):
            passed = True
    if not (built and passed):
        return (f"{METHOD} does not build xops.fmha.flash.FwOp() and pass it as op= "
                "(not the CoreX 3.2.3 shape)")
    return None


def dense_needed(module: types.ModuleType) -> Optional[str]:
    """None when this build's XFormers backend runs prompts through ixformer's flash FwOp,
    else why the patch is not needed."""
    cls = vars(module).get(CLASS)
    func = vars(cls).get(METHOD) if isinstance(cls, type) else None
    if func is None:
        return f"{module.__name__} has no {CLASS}.{METHOD}"
    return uses_ixformer_fwop(getattr(func, "__wrapped__", func), vars(module).get("xops"))


def _kind(attn_type: Any) -> str:
    return str(getattr(attn_type, "name", attn_type)).rsplit(".", 1)[-1].upper()


def make_dense_wrapper(family: Family, original: Callable[..., Any], module: types.ModuleType,
                       settings: config.Settings) -> Wrapper:
    defaults = ArgReader.for_function(original, ("self",) + PARAMS, METHOD).defaults
    reader = ArgReader(PARAMS, defaults, METHOD)
    limit, budget = settings.dense_head_max, settings.prefix_budget_mb

    def run_memory_efficient_xformers_forward(wrapped: Callable[..., Any], instance: Any,
                                              args: Tuple[Any, ...],
                                              kwargs: Dict[str, Any]) -> Any:
        query, key, value, meta, attn_type = reader.read(args, kwargs)
        kind = _kind(attn_type)
        window = getattr(instance, "sliding_window", None)
        if instance.head_size <= limit or (kind != "DECODER" and window is not None):
            VENDOR_CALLS.add()
            return wrapped(*args, **kwargs)
        PREFILL_CALLS.add()
        if kind == "DECODER":
            q_lens, kv_lens, causal = meta.seq_lens, None, True
        elif kind == "ENCODER":
            q_lens, kv_lens, causal = meta.encoder_seq_lens, None, False
        else:  # ENCODER_DECODER: decoder queries over the encoder's keys
            q_lens, kv_lens, causal = meta.seq_lens, meta.encoder_seq_lens, False
        if q_lens is None:
            raise ValueError(f"{METHOD}: attn_metadata has no sequence lengths for {kind} "
                             "attention")
        return dense.varlen_attention(
            query, key, value, list(q_lens), instance.scale,
            kv_lens=None if kv_lens is None else list(kv_lens), causal=causal,
            alibi_slopes=instance.alibi_slopes if causal else None,
            sliding_window=window if causal and window else None, budget_mb=budget)

    return run_memory_efficient_xformers_forward

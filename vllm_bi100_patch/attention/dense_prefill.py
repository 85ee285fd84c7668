"""Replacement for ``XFormersImpl._run_memory_efficient_xformers_forward`` (prompt attention).

Catalogue entry: row ``dense_prefill`` of ``vllm_bi100_patch.patching.table``.

Iluvatar's CoreX 3.2.3 XFormers backend runs every prompt without a cached prefix, and vLLM's
memory-profiling run at start-up, through ``ixformer.contrib.xformers``' flash ``FwOp``, which
fails above head size 128: a causal bias raises, a mask returns wrong values silently
(``docs/corex-3.2.3.md``).  The row is conditional (``dense_needed``):

- ``VLLM_BI100_PROMPT_ATTENTION=auto`` (default): applied only where the backend's ``xops`` is
  ixformer's and the method builds ``xops.fmha.flash.FwOp()`` and passes it as ``op=``; the
  wrapper sends head sizes above ``VLLM_BI100_DENSE_HEAD_MAX`` to
  ``kernels.prefill.dense.varlen_attention`` (tiled under ``VLLM_BI100_PREFIX_BUDGET_MB``), smaller
  heads keep the vendor kernel; stock vLLM (xformers' own kernels) is never patched.
- ``VLLM_BI100_PROMPT_ATTENTION=shim`` (opt-in): applied also to stock XFormers backends whose
  method has the checked shape (``prompt_shape``: its parameters, the ``xops`` call with
  ``attn_bias=``, the sequence lengths and the attributes the wrapper reads), and every head
  size goes to ``kernels.prefill.dense``: every prompt and prefix attention of the backend is then the
  shim's, so the rows of a prompt are bit-identical however vLLM slices it.  Where the shape
  differs the row is skipped with the reason and one WARNING (the guarantee does not hold:
  ``invariance.verdict`` says so).

Never imports vLLM.
"""

from __future__ import annotations

import ast
import types
from typing import Any, Callable, Dict, Optional, Tuple

from ..activation import config
from .kernels.prefill import dense
from ..patching.source import function_def, source_tree
from ..patching.strict import warn_once
from ..patching.versions import Family
from ..patching.factories import ArgReader, Wrapper, counter

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


def prompt_shape(func: Callable[..., Any], xops: Any) -> Optional[str]:
    """None when ``func`` has the shape the opt-in was checked against (vLLM 0.6.3 and 0.7.3,
    stock and CoreX 3.2.3): the parameters ``(self, query, key, value, attn_metadata,
    attn_type)``, ``xops`` from xformers or ixformer, a call of
    ``xops.memory_efficient_attention_forward`` with ``attn_bias=``, and the reads the wrapper
    stands in for (``attn_metadata.seq_lens``, ``self.scale``, ``self.alibi_slopes``,
    ``self.sliding_window``); else what differs."""
    name = str(getattr(xops, "__name__", None))
    if not isinstance(xops, types.ModuleType) or not name.startswith(("xformers", "ixformer")):
        return f"the backend's xops is {name}, neither xformers' nor ixformer's"
    parsed = function_def(func)
    if parsed is None:
        return f"the source of {METHOD} cannot be read"
    params = tuple(a.arg for a in parsed.args.posonlyargs + parsed.args.args
                   + parsed.args.kwonlyargs)
    if params != ("self",) + PARAMS:
        return f"{METHOD} has the parameters {list(params)}, not {['self', *PARAMS]}"
    seen = {_dotted(node) for node in ast.walk(parsed) if isinstance(node, ast.Attribute)}
    calls = [node for node in ast.walk(parsed) if isinstance(node, ast.Call)
             and _dotted(node.func) == "xops.memory_efficient_attention_forward"]
    if not any(k.arg == "attn_bias" for c in calls for k in c.keywords):
        return f"{METHOD} does not call xops.memory_efficient_attention_forward(attn_bias=...)"
    wanted = ("attn_metadata.seq_lens", "self.scale", "self.alibi_slopes", "self.sliding_window")
    absent = [w for w in wanted if w not in seen]
    if absent:
        return f"{METHOD} does not read {', '.join(absent)}"
    return None


def dense_needed(module: types.ModuleType, settings: config.Settings) -> Optional[str]:
    """None when the row applies to this build's XFormers backend under ``settings``: the
    backend runs prompts through ixformer's flash FwOp, or the opt-in
    ``VLLM_BI100_PROMPT_ATTENTION=shim`` asks for every prompt and the method has the checked
    shape; else why not."""
    cls = vars(module).get(CLASS)
    func = vars(cls).get(METHOD) if isinstance(cls, type) else None
    if func is None:
        return f"{module.__name__} has no {CLASS}.{METHOD}"
    original = getattr(func, "__wrapped__", func)
    xops = vars(module).get("xops")
    vendor = uses_ixformer_fwop(original, xops)
    if settings.prompt_attention != config.PROMPT_SHIM:
        return vendor
    problem = prompt_shape(original, xops)
    if problem is None:
        return None
    reason = (f"{config.PROMPT_ATTENTION}={config.PROMPT_SHIM} cannot be applied to "
              f"{module.__name__}: {problem}")
    warn_once(reason + "; prompts keep the backend's own kernel (cached and uncached prompts "
              "may differ in the last bits)")
    return reason


#: Per attention type (vLLM's ``AttentionType``): the metadata field of the query lengths, of
#: the key lengths (None: the same), and whether it is causal.  ``ENCODER_ONLY`` (0.7) is
#: non-causal over ``seq_lens``; ``ENCODER_DECODER`` is decoder queries over the encoder's
#: keys.  Other types keep the backend's kernel.
KINDS = {"DECODER": ("seq_lens", None, True), "ENCODER": ("encoder_seq_lens", None, False),
         "ENCODER_ONLY": ("seq_lens", None, False),
         "ENCODER_DECODER": ("seq_lens", "encoder_seq_lens", False)}


def _kind(attn_type: Any) -> str:
    return str(getattr(attn_type, "name", attn_type)).rsplit(".", 1)[-1].upper()


def make_dense_wrapper(family: Family, original: Callable[..., Any], module: types.ModuleType,
                       settings: config.Settings) -> Wrapper:
    defaults = ArgReader.for_function(original, ("self",) + PARAMS, METHOD).defaults
    reader = ArgReader(PARAMS, defaults, METHOD)
    limit, budget = settings.dense_head_max, settings.prefix_budget_mb
    every_head = settings.prompt_attention == config.PROMPT_SHIM

    def run_memory_efficient_xformers_forward(wrapped: Callable[..., Any], instance: Any,
                                              args: Tuple[Any, ...],
                                              kwargs: Dict[str, Any]) -> Any:
        query, key, value, meta, attn_type = reader.read(args, kwargs)
        kind = _kind(attn_type)
        window = getattr(instance, "sliding_window", None)
        if (instance.head_size <= limit and not every_head) or kind not in KINDS \
                or (kind != "DECODER" and window is not None):
            VENDOR_CALLS.add()
            return wrapped(*args, **kwargs)
        PREFILL_CALLS.add()
        q_field, kv_field, causal = KINDS[kind]
        q_lens = getattr(meta, q_field)
        kv_lens = None if kv_field is None else getattr(meta, kv_field)
        if q_lens is None:
            raise ValueError(f"{METHOD}: attn_metadata has no sequence lengths for {kind} "
                             "attention")
        return dense.varlen_attention(
            query, key, value, list(q_lens), instance.scale,
            kv_lens=None if kv_lens is None else list(kv_lens), causal=causal,
            alibi_slopes=instance.alibi_slopes if causal else None,
            sliding_window=window if causal and window else None, budget_mb=budget)

    return run_memory_efficient_xformers_forward

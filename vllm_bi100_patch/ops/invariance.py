"""Whether the attention the shim computes is slicing-invariant here, and if not, why.

The guarantee (README, "Same prompt, same answer"): for every token of a prompt, the attention
row the XFormers backend returns is bit-identical however vLLM slices the prompt (uncached or a
prefix-cache hit, any chunk size, any other sequences in the batch), because every such row is
computed by the shim's kernels.  It holds only where both paths of the backend are the shim's:

- ``PagedAttention.forward_prefix`` (row ``prefix``): every chunk that has context (a
  prefix-cache hit, or a later chunk of chunked prefill);
- ``XFormersImpl._run_memory_efficient_xformers_forward`` (row ``dense_prefill``): every first
  chunk of a batch without context; at every head size only with
  ``VLLM_BI100_PROMPT_ATTENTION=shim``, else only above ``VLLM_BI100_DENSE_HEAD_MAX`` on
  builds whose backend uses ixformer's ``FwOp`` (CoreX 3.2.3);
- and, on vLLM before 0.6.4, ``prefix_block_table`` (else a chunk past a cached prefix reads
  the wrong blocks).

``verdict`` derives the answer from the configuration and the registry's report (the rows
applied or skipped, and why), the same way for ``status()`` (this process) and ``doctor`` (what
a server here would do).  Stdlib only; imports neither torch nor vLLM.
"""

from __future__ import annotations

from ..activation import config

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Mapping, Optional

__all__ = ["verdict", "YES", "NO", "PARTLY", "UNKNOWN"]

YES, NO, PARTLY, UNKNOWN = "yes", "no", "partly", "unknown"

#: The first vLLM release with the fix the ``prefix_block_table`` row stands in for.
_BLOCK_TABLE_FIX = (0, 6, 4)
_HINT = f"set {config.PROMPT_ATTENTION}={config.PROMPT_SHIM}"


def _before_block_table_fix(raw: Optional[str]) -> bool:
    from ..patching import versions

    parsed = versions.normalise(raw) if raw else None
    release = parsed.release if parsed is not None else None
    return release is None or tuple(release[:3]) < _BLOCK_TABLE_FIX


def _counts_note(counts: Optional[Mapping[str, int]]) -> str:
    if not counts or not (counts.get("dense_prefill") or counts.get("dense_vendor")):
        return ""
    return (f" (this process so far: {counts.get('dense_prefill', 0)} prompt calls on the "
            f"shim's kernel, {counts.get('dense_vendor', 0)} on the backend's own)")


def verdict(settings: Optional[config.Settings], report: Optional[Mapping[str, Any]],
            counts: Optional[Mapping[str, int]] = None, inactive: Optional[str] = None) -> str:
    """``"yes: ..."``, ``"partly: ..."``, ``"no: ..."`` or ``"unknown: ..."``: whether every
    prompt and prefix attention row is the shim's (so bit-identical however vLLM slices the
    prompt), from ``settings`` and a report (``report.Report.as_dict()``: ``applied``,
    ``skipped``, ``reason``, ``vllm_version``); ``counts`` (the call counters) add what this
    process has run so far; ``inactive``: why the shim is not active in this process (its
    ``status()["decision"]``), None when it is."""
    if settings is None:
        return f"{UNKNOWN}: the shim has not activated in this process"
    if settings.off:
        return f"{NO}: the shim is off ({settings.mode_text()}); vLLM computes every attention"
    if inactive is not None:
        return f"{NO}: the shim is not active in this process ({inactive})"
    if report is None or not (report.get("applied") or report.get("skipped")
                              or report.get("reason")):  # no target module patched yet
        return (f"{UNKNOWN}: vLLM's attention is not imported in this process yet (the shim "
                "patches it when it is)")
    applied = list(report.get("applied") or [])
    skipped = dict(report.get("skipped") or {})
    if "prefix" not in applied:
        why = skipped.get("prefix") or report.get("reason") or "not patched"
        return (f"{NO}: the prefix row is not applied ({why}); chunks with context (prefix-"
                "cache hits, later chunks) are not computed by the shim")
    if skipped.get("prefix_block_table", "").startswith("disabled") \
            and _before_block_table_fix(report.get("vllm_version")):
        return (f"{NO}: the prefix_block_table row is disabled; on vLLM before 0.6.4 a chunk "
                "past a cached prefix reads the wrong blocks (vLLM pull request #9532)")
    note = _counts_note(counts)
    if "dense_prefill" in applied:
        if settings.prompt_attention == config.PROMPT_SHIM:
            return (f"{YES}: every prompt and prefix attention of the XFormers backend is the "
                    "shim's (rows bit-identical however vLLM slices a prompt)" + note)
        limit = settings.dense_head_max
        return (f"{PARTLY}: yes for head sizes above {limit} (every prompt and prefix attention "
                f"is the shim's); no for head sizes <= {limit}: prompts without a cached prefix "
                f"run on the vendor's FwOp; {_HINT}" + note)
    why = skipped.get("dense_prefill")
    if why is None:
        return (f"{UNKNOWN}: vLLM's XFormers backend is not imported in this process (it "
                "computes no prompt attention here)")
    if why.startswith("disabled"):
        return (f"{NO}: the dense_prefill row is {why}; prompts without a cached prefix run on "
                "the backend's own kernel")
    why = why.split(": ", 1)[1] if why.startswith("not needed: ") else why
    if settings.prompt_attention == config.PROMPT_SHIM:
        return f"{NO}: {why}"
    return (f"{NO}: prompts without a cached prefix run on the backend's own kernel, not the "
            f"shim's ({why}); {_HINT}")

"""Multimodal rotary positions of a prefill chunk: vLLM 0.6.x's MRoPE engine-killer.

Catalogue entry: row ``mrope_positions`` of ``vllm_bi100_patch.patching.table``.

For an MRoPE model (Qwen2-VL style: three position axes, t/h/w), vLLM's model-input builder
computes a prompt's positions in ``ModelInputForGPUBuilder._compute_multi_modal_input`` with
``MRotaryEmbedding.get_input_positions(token_ids, ..., context_len=...)``, which returns the
request's positions from ``context_len`` to the end of the prompt.  With chunked prefill a
chunk computes only ``[context_len, seq_len)``, and a prefix-cache hit inside a chunk leaves
fewer tokens still; the model then gets more positions than tokens and the rotary embedding
fails (``RuntimeError: shape '[26540, -1, 256]' is invalid for input of size 16384`` in the
field, the engine dead) or, where the position count is a multiple of the token count, views
the query heads as more tokens and rotates them with wrong positions, silently.  vLLM fixed
it in pull requests #10388 (slice ``[context_len:seq_len]``) and #10403 (the request's delta
computed before that slice), first released in 0.6.5 (``docs/corex-3.2.3.md``, "MRoPE
positions of a chunk").

The wrapper keeps, after the original ran, exactly the positions of the tokens the builder
kept: the builder's own (``get_input_positions``: they start at the chunk's context) are cut
to the chunk's token count, as 0.6.5 slices them; positions made earlier from the request's
delta (``_compute_lens``, for a sequence without multimodal data this step) before a
prefix-cache hit dropped tokens are cropped to the kept suffix, as the field's patch does, and
checked against the delta.  The delta 0.6.x computes is already the request's (its last token
holds the largest position), so it is left alone.  Applied only where the method calls
``get_input_positions`` without ``seq_len`` (``mrope_needed``), on the code shapes in ``KNOWN``.
Never imports vLLM.
"""

from __future__ import annotations

import ast
import types
from typing import Any, Callable, Dict, List, Optional, Tuple

from ..activation import config
from ..patching.versions import Family
from ..patching import code_shapes
from ..patching.factories import ArgReader, Wrapper, counter

OWNER = "ModelInputForGPUBuilder"
ATTR = "_compute_multi_modal_input"
PARAMS = ("self", "inter_data", "seq_group_metadata")
CALLS = counter("mrope_positions")
PRS = "vLLM pull requests #10388 and #10403"

#: Code shapes (``block_tables.fingerprint``) this row was checked against, read in the
#: official wheels named (the CoreX stand-in's file is the official 0.6.3.post1 one).
KNOWN: Dict[str, str] = {
    "d2e91c9f44e44e5b": "vLLM 0.6.1.post2, 0.6.2",
    "fbeebf2e22429594": "vLLM 0.6.3.post1; CoreX 3.2.3's vendored tree",
    "67e3d7f7ab51c657": "vLLM 0.6.4.post1",
}


def _position_calls(fn: ast.FunctionDef) -> List[ast.Call]:
    return [n for n in ast.walk(fn) if isinstance(n, ast.Call)
            and isinstance(n.func, ast.Attribute) and n.func.attr == "get_input_positions"]


def mrope_needed(module: types.ModuleType, settings: config.Settings) -> Optional[str]:
    """None when this build's builder computes a chunk's MRoPE positions without its end
    (``get_input_positions`` without ``seq_len``); else why the row is not needed."""
    fn, why = code_shapes.definition(module, OWNER, ATTR)
    if fn is None:
        return why
    calls = _position_calls(fn)
    if not calls:
        return f"the build's {OWNER}.{ATTR} computes no MRoPE positions"
    if all(any(k.arg == "seq_len" for k in c.keywords) for c in calls):
        return f"this build has the upstream fix ({PRS}: positions sliced to [context_len:seq_len])"
    return None


def check(func: Callable[..., Any]) -> Optional[str]:
    """The row's code check: the parameters and one of the ``KNOWN`` code shapes."""
    return code_shapes.shape_check(func, f"{OWNER}.{ATTR}", PARAMS, KNOWN)


def _delta_positions(meta: Any, seq_id: Any, start: int, stop: int) -> Optional[List[range]]:
    delta = getattr(meta.seq_data[seq_id], "mrope_position_delta", None)
    return None if delta is None else [range(start + delta, stop + delta)] * 3


def make_wrapper(family: Family, original: Callable[..., Any], module: types.ModuleType,
                 settings: config.Settings) -> Wrapper:
    reader = ArgReader.for_function(original, PARAMS[1:], ATTR)

    def _compute_multi_modal_input(wrapped: Callable[..., Any], instance: Any,
                                   args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        inter_data, meta = reader.read(args, kwargs)
        before = inter_data.mrope_input_positions
        result = wrapped(*args, **kwargs)
        positions = inter_data.mrope_input_positions
        if positions is None:
            return result
        made_here = positions is not before  # the original computed them (a new list)
        for i, seq_positions in enumerate(positions):
            if seq_positions is None:
                continue
            n = len(inter_data.input_tokens[i])
            if all(len(axis) == n for axis in seq_positions):
                continue
            if made_here:  # [context_len:] of the request's map: keep the chunk's n
                kept = [list(axis[:n]) for axis in seq_positions]
            else:  # the delta's [old context, seq_len) before a prefix-cache hit: the suffix
                kept = [list(axis[len(axis) - n:]) for axis in seq_positions]
                seq_len = inter_data.seq_lens[i]
                want = _delta_positions(meta, inter_data.seq_ids[i], seq_len - n, seq_len)
                if want is None or kept != [list(r) for r in want]:
                    raise RuntimeError(
                        f"{ATTR}: sequence {inter_data.seq_ids[i]} has {n} tokens and MRoPE "
                        f"positions of lengths {[len(a) for a in seq_positions]} that are not "
                        "its request's delta positions; row mrope_positions cannot align them")
            if any(len(axis) != n for axis in kept):
                raise RuntimeError(
                    f"{ATTR}: sequence {inter_data.seq_ids[i]} has {n} tokens but only "
                    f"{[len(a) for a in kept]} MRoPE positions; row mrope_positions cannot "
                    "align them")
            positions[i] = kept
            CALLS.add()
        return result

    return _compute_multi_modal_input

"""Streaming (delta) outputs of a step without a new token: CoreX 3.2.3 returns the prompt.

Catalogue entry: row ``stream_delta`` of ``vllm_bi100_patch.patching.table``.

``Sequence.get_output_token_ids_to_return(delta=True)`` returns the tokens produced since its
last call: ``_cached_all_token_ids[-num_new_tokens:]``.  vLLM 0.6.2 had no case for
``num_new_tokens == 0``, so a step that produced no token (every non-final chunk of a prompt
under chunked prefill) returns ``_cached_all_token_ids[-0:]``, the whole list: the prompt, as
new tokens of a streamed (``RequestOutputKind.DELTA``) request, with the usage counts built
from it.  vLLM 0.6.3 returns ``[]`` there; CoreX 3.2.3 ships 0.6.2's method
(``docs/corex-3.2.3.md``).

The wrapper returns ``[]`` when the sequence's output length equals its last returned offset
(exactly 0.6.3's case: the offset is already that length), and runs the original otherwise.
Applied only where the method still slices ``[-num_new_tokens:]`` without that case
(``delta_needed``), and only on the code shapes in ``KNOWN``.  Never imports vLLM.
"""

from __future__ import annotations

import ast
import types
from typing import Any, Callable, Dict, List, Optional, Tuple

from ..activation import config
from ..patching.versions import Family
from ..patching import code_shapes
from ..patching.factories import ArgReader, Wrapper, counter

OWNER = "Sequence"
ATTR = "get_output_token_ids_to_return"
PARAMS = ("self", "delta")
CALLS = counter("stream_delta")

#: Code shapes (``block_tables.fingerprint``) this row was checked against.
KNOWN: Dict[str, str] = {
    "0724e6dc181b9876": "vLLM 0.6.2; CoreX 3.2.3's vendored tree (wudixzy/competition@5a1c8c79)",
}


def _guards(fn: ast.FunctionDef) -> List[str]:
    """The tests of the ``if`` statements on ``num_new_tokens`` (as source text)."""
    return [ast.unparse(n.test) for n in ast.walk(fn) if isinstance(n, ast.If)
            and "num_new_tokens" in ast.unparse(n.test)]


def _slices_new_tokens(fn: ast.FunctionDef) -> bool:
    return any(isinstance(n, ast.Return) and n.value is not None
               and ast.unparse(n.value).endswith("[-num_new_tokens:]") for n in ast.walk(fn))


def delta_needed(module: types.ModuleType, settings: config.Settings) -> Optional[str]:
    """None when this build's ``Sequence.get_output_token_ids_to_return`` returns
    ``[-num_new_tokens:]`` with no case for 0 new tokens; else why the row is not needed."""
    fn, why = code_shapes.definition(module, OWNER, ATTR)
    if fn is None:
        return why
    if not _slices_new_tokens(fn):
        return (f"the build's {OWNER}.{ATTR} does not return [-num_new_tokens:] (not the code "
                "this fix is for)")
    if "num_new_tokens == 0" in _guards(fn):
        return "this build returns [] for a step without new tokens (vLLM 0.6.3's guard)"
    return None


def check(func: Callable[..., Any]) -> Optional[str]:
    """The row's code check: the parameters and one of the ``KNOWN`` code shapes."""
    return code_shapes.shape_check(func, f"{OWNER}.{ATTR}", PARAMS, KNOWN)


def make_wrapper(family: Family, original: Callable[..., Any], module: types.ModuleType,
                 settings: config.Settings) -> Wrapper:
    reader = ArgReader.for_function(original, PARAMS[1:], ATTR)

    def get_output_token_ids_to_return(wrapped: Callable[..., Any], instance: Any,
                                       args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        delta = reader.read(args, kwargs)[0]
        if delta and instance.get_output_len() == instance._last_output_token_ids_offset:
            CALLS.add()
            return []  # vLLM 0.6.3: no new token, nothing to return
        return wrapped(*args, **kwargs)

    return get_output_token_ids_to_return

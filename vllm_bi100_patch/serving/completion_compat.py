"""What today's OpenAI clients send to ``/v1/completions``, served by vLLM 0.6.3: lossless
mappings (row ``completion_request_compat`` of ``vllm_bi100_patch.patching.table``; the chat
endpoint's are ``serving/chat_compat.py``; each with its public source in
``docs/serving-compat.md``).

vLLM 0.6.3's ``CompletionRequest`` (``vllm/entrypoints/openai/protocol.py``, byte-identical in
CoreX 3.2.3) is validated by FastAPI before any of vLLM's code runs, like the chat request; the
row replaces it by a subclass whose wrap validator (``request_body.request_class``) maps:

- ``stream_options.include_usage``: usage on the final chunk only unless
  ``continuous_usage_stats`` is asked for (0.6.3 streams it on every chunk; vLLM 0.6.4's
  default), ``stream_options.include_obfuscation`` dropped;
- ``response_format: {"type": "json_schema", ...}``: 0.6.3 accepts it and ignores the schema
  (``to_sampling_params`` reads only ``json_object``): the schema goes to ``guided_json``,
  0.6.3's own guided decoding (vLLM 0.6.4, #9530, did the same for chat), its schema given as
  an object or as JSON text;
- ``prompt_cache_retention``, ``prompt_cache_options``: dropped, each named once in a WARNING.

Never imports vLLM (pydantic is imported when the class is built).
"""

from __future__ import annotations

import types
from typing import Any, Dict, FrozenSet, List, Optional, Tuple

from ..activation import config
from ..patching.versions import Family
from ..patching import code_shapes
from . import request_body
from ..patching.factories import counter

OWNER = "CompletionRequest"
ENDPOINT = "completion"
REWRITES = counter("completion_request_compat")
IGNORED_CALLS = counter("completion_fields_ignored")


def rewrite(data: Dict[str, Any], fields: FrozenSet[str]) -> Tuple[Dict[str, Any], bool, None]:
    """The body mapped onto vLLM 0.6.3's completion request (a new dict; what it changes
    inside is copied), and whether anything changed.  Raises ``RequestRefused`` naming the
    field for what cannot be served as asked."""
    data = dict(data)
    changed = request_body.drop_ignored(data, fields, request_body.IGNORED_BOTH,
                                        IGNORED_CALLS, ENDPOINT)
    changed |= request_body.stream_options(data, IGNORED_CALLS, ENDPOINT)
    changed |= request_body.guided_json(data)
    changed |= request_body.response_format(data)
    return data, changed, None


#: The validators and method whose code the mappings rely on, and their code shapes
#: (``code_shapes.fingerprint`` of each, joined) as read in the releases named.
SHAPE_OF = ("check_guided_decoding_count", "check_logprobs", "validate_stream_options",
            "to_sampling_params")
KNOWN: Dict[str, str] = {
    "df7cceaa79b1814d-feb26a9d9aa18d9a-ce47ff2def4c18ba-60e9f391f2b1d3a2":
        "vLLM 0.6.3.post1; CoreX 3.2.3's vendored tree (byte-identical protocol.py)",
}


def check(cls: Any) -> Optional[str]:
    """The row's code check: the fields the mappings write, and the code shapes of 0.6.3's
    validators they run before (and of ``to_sampling_params``, which reads ``guided_json``
    and not ``response_format.json_schema``)."""
    fields = getattr(cls, "model_fields", {})
    missing = [f for f in ("prompt", "stream_options", "response_format", "guided_json")
               if f not in fields]
    if missing:
        return f"{OWNER} lacks the fields {missing}"
    if getattr(cls, "model_config", {}).get("extra") != "forbid":
        return f"{OWNER} accepts unknown fields: not the model this row was checked against"
    shape = code_shapes.class_shape(cls, SHAPE_OF)
    if shape is None:
        return f"the source of {OWNER}'s validators cannot be read"
    return code_shapes.unknown_shape(f"{OWNER}'s validators", shape, KNOWN)


def make_request_class(family: Family, original: Any, module: types.ModuleType,
                       settings: config.Settings) -> type:
    """The subclass of ``original`` (0.6.3's ``CompletionRequest``) that ``rewrite``s the body
    inside its own validation."""
    fields = request_body.field_names(original)

    def mapping(data: Dict[str, Any]) -> Tuple[Dict[str, Any], bool, None]:
        return rewrite(data, fields)

    return request_body.request_class(original, mapping, REWRITES)


__all__: List[str] = ["check", "make_request_class", "rewrite"]

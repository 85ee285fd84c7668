"""What today's OpenAI clients send, served by vLLM 0.6.3's chat front end: lossless mappings.

Catalogue entry: row ``chat_request_compat`` of ``vllm_bi100_patch.patching.table`` (its companion row
``error_message_cause`` is ``serving/error_cause.py``); each mapping with its public source in
``docs/serving-compat.md``.

vLLM 0.6.3's ``ChatCompletionRequest`` (``vllm/entrypoints/openai/protocol.py``, byte-identical
in CoreX 3.2.3) is a pydantic model with ``extra="forbid"``: FastAPI validates the request body
with it before any of vLLM's code runs, so the only place to map a body is inside that
validation.  The row replaces the module's class with a subclass carrying one pydantic *wrap*
validator (``request_body.request_class``: it runs before 0.6.3's own ``before`` validators, on
the raw body, and turns what they crash on into a 400) that applies ``rewrite``; everything
else is 0.6.3's class.  ``rewrite`` is plain Python on dicts, copying only what it changes: it
maps only what maps losslessly, drops only fields that change nothing a self-hosted server
does (each named once per process in a WARNING over a bounded set of names), and refuses,
naming the field and why, what it cannot serve.  A field it does not know stays refused by
0.6.3 itself, by name.  The tool fields are ``tool_choice.tools``; the tool plan it returns
rides on the validated request to row ``chat_tool_calls`` (``serving/tool_calls.py``).

Never imports vLLM (pydantic is imported when the class is built: vLLM's front end has it).
"""

from __future__ import annotations

import json
import sys
import types
import typing
from typing import Any, Dict, FrozenSet, List, Optional, Tuple

from ..activation import config
from ..patching import versions
from ..patching.patch_row import SERVING_CHAT
from ..patching.versions import Family
from ..patching import code_shapes
from . import request_body, tool_choice
from ..patching.factories import counter
from .refusal import RequestRefused, shown

OWNER = "ChatCompletionRequest"
ENDPOINT = "chat"
REWRITES = counter("chat_request_compat")
IGNORED_CALLS = counter("chat_fields_ignored")

#: Request fields that change nothing this server does: dropped, named once in a WARNING.
IGNORED: Dict[str, str] = {
    "store": "OpenAI's storage of the completion for its dashboard; this server stores nothing",
    "metadata": "tags for OpenAI's stored completions",
    "service_tier": "OpenAI's processing tier; this server has one",
    "prompt_cache_key": "OpenAI's cache-routing hint; vLLM's prefix cache needs none",
    "safety_identifier": "an end-user identifier for OpenAI's abuse monitoring, like `user`",
    "prediction": "a predicted output: a latency hint, the answer does not depend on it",
    **request_body.IGNORED_BOTH,
}
#: Request fields that would change the answer and that vLLM 0.6.3 cannot honour: a 400 that
#: says so (0.6.3 itself refuses them as unknown fields).
REFUSED: Dict[str, str] = {
    "reasoning_effort": "it sets how much a reasoning model thinks; vLLM 0.6.3 has no such "
                        "control",
    "verbosity": "it asks for shorter or longer answers; vLLM 0.6.3 has no such control",
    "audio": "audio output is not served by vLLM 0.6.3",
}
TEXT_ONLY = ["text"]
#: Message keys clients are known to echo back (warned about by name); any other key no
#: message type has is a made-up name (warned about escaped, under a cap: request_body).
KNOWN_MESSAGE_KEYS = ("reasoning_content", "reasoning", "thinking", "annotations", "refusal",
                      "audio", "function_call", "id", "prefix", "partial")
WHY_KEY = "not a key of any message type vLLM 0.6.3 reads; upstream ignores it from 0.6.5 (#10463)"


def _warn(what: str, why: str, made_up: str = "") -> None:
    request_body.warn_once(IGNORED_CALLS, ENDPOINT, what, why, made_up)


def _is_json(text: str, where: str) -> Optional[str]:
    try:
        json.loads(text)
    except ValueError as exc:
        return str(exc)
    except RecursionError:
        raise RequestRefused(f"{where} nests deeper than this server parses") from None
    return None


def _tool_calls(i: int, calls: List[Any]) -> Optional[List[Any]]:
    """The message's tool calls with object arguments as their JSON text (a new list), None
    when none changes; invalid JSON text a 400 naming where."""
    new = None
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or "arguments" not in function:
            continue
        where = f"messages[{i}].tool_calls[{j}].function.arguments"
        args = function["arguments"]
        if isinstance(args, (dict, list)):
            try:
                text = json.dumps(args, ensure_ascii=False)
            except RecursionError:
                raise RequestRefused(f"{where} nests deeper than this server handles") from None
            new = new if new is not None else list(calls)
            new[j] = dict(call, function=dict(function, arguments=text))
        elif isinstance(args, str):
            problem = _is_json(args, where)
            if problem is not None:
                raise RequestRefused(f"{where} is not valid JSON ({problem})")
    return new


def _message(i: int, message: Dict[str, Any], message_keys: FrozenSet[str]) -> Dict[str, Any]:
    """The message mapped (a copy when anything changes)."""
    out = message
    if message.get("role") == "developer":  # OpenAI's name for system since o1
        out = dict(out, role="system")
    extra = [k for k in message if k not in message_keys]
    if extra:
        out = {k: v for k, v in out.items() if k in message_keys}
        for key in extra:
            if key in KNOWN_MESSAGE_KEYS:
                _warn(f"message key `{key}`", WHY_KEY)
            else:
                _warn("message key", WHY_KEY, made_up=str(key))
    calls = out.get("tool_calls")
    if isinstance(calls, list):
        new = _tool_calls(i, calls)
        if new is not None:
            out = dict(out, tool_calls=new)
    return out


def _messages(data: Dict[str, Any], message_keys: FrozenSet[str]) -> bool:
    messages = data.get("messages")
    if not isinstance(messages, list):
        return False  # 0.6.3 refuses it by name
    if not messages:
        raise RequestRefused("`messages` is empty: a chat completion needs at least one message")
    new = [_message(i, m, message_keys) if isinstance(m, dict) else m
           for i, m in enumerate(messages)]
    if any(a is not b for a, b in zip(new, messages)):
        data["messages"] = new
        return True
    return False


def _max_completion_tokens(data: Dict[str, Any]) -> None:
    """OpenAI's current name for ``max_tokens``; it wins when both are given (#9837).  An
    invalid value is refused under the name the client sent."""
    value = data.pop("max_completion_tokens")
    if value is None:
        return
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # what pydantic accepts for max_tokens, accepted here too
    elif isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestRefused(f"`max_completion_tokens` must be an integer, not {shown(value)}")
    if value < 1:
        raise RequestRefused(f"`max_completion_tokens` must be at least 1, got {value}")
    data["max_tokens"] = value


def rewrite(data: Dict[str, Any], fields: FrozenSet[str], message_keys: FrozenSet[str],
            serve_required: bool = True) -> Tuple[Dict[str, Any], bool,
                                                  Optional[tool_choice.ToolPlan]]:
    """The body with today's clients' fields mapped onto vLLM 0.6.3's (a new dict; what it
    changes inside is copied), whether anything changed, and the tool plan (or None).

    ``fields``: the request model's own fields (a field the model has is never touched);
    ``message_keys``: every key of a message type it reads; ``serve_required``: whether row
    ``chat_tool_calls`` is live.  Raises ``RequestRefused`` naming the field for what cannot
    be served as asked."""
    data = dict(data)
    before = set(data)
    changed = False
    for name, why in REFUSED.items():
        if name in data and name not in fields:
            if data[name] is not None:
                raise RequestRefused(f"`{name}` is not supported by this server: {why} "
                                     "(refused rather than ignored)")
            del data[name]  # null: the default, which is what this server does
            _warn(f"field `{name}: null`", "null asks for the default")
    modalities = data.get("modalities")
    if "modalities" not in fields and "modalities" in data:
        if modalities not in (None, TEXT_ONLY):
            raise RequestRefused(f"`modalities` {shown(modalities)}: this server answers in "
                                 "text only (send [\"text\"] or leave it out)")
        del data["modalities"]
        _warn("field `modalities`", "[\"text\"] is what this server answers anyway")
    request_body.drop_ignored(data, fields, IGNORED, IGNORED_CALLS, ENDPOINT)
    if "max_completion_tokens" in data and "max_completion_tokens" not in fields:
        _max_completion_tokens(data)
    if data.get("top_logprobs") == 0 and not data.get("logprobs"):
        del data["top_logprobs"]  # zero alternatives of no logprobs: nothing to return
    changed |= request_body.stream_options(data, IGNORED_CALLS, ENDPOINT)
    changed |= _messages(data, message_keys)
    changed |= request_body.guided_json(data)
    watched = ("tools", "tool_choice", "guided_json")
    seen = [data.get(k) for k in watched]
    plan = tool_choice.tools(data, serve_required)
    changed |= any(data.get(k) is not v for k, v in zip(watched, seen))  # never compared deep
    changed |= request_body.response_format(data)
    return data, changed or set(data) != before, plan


def _typed_dict_keys(tp: Any, out: set) -> None:
    args = typing.get_args(tp)
    if args and typing.get_origin(tp) is typing.Union:
        for arg in args:
            _typed_dict_keys(arg, out)
        return
    keys = getattr(tp, "__required_keys__", None)
    if keys is not None:
        out.update(keys, getattr(tp, "__optional_keys__", ()))


def message_keys_of(cls: type) -> FrozenSet[str]:
    """Every key of the message types of ``cls.messages`` (a list of a union of TypedDicts)."""
    field = getattr(cls, "model_fields", {}).get("messages")
    out: set = set()
    if field is not None:
        for arg in typing.get_args(field.annotation):
            _typed_dict_keys(arg, out)
    return frozenset(out)


#: The validators and method whose code the mappings rely on, and their code shapes
#: (``code_shapes.fingerprint`` of each, joined) as read in the releases named.
SHAPE_OF = ("check_tool_usage", "check_logprobs", "validate_stream_options",
            "check_guided_decoding_count", "to_sampling_params", "_get_guided_json_from_tool")
KNOWN: Dict[str, str] = {
    "e6f5136b49ca9d28-bc54de9cef019cae-ce47ff2def4c18ba-e7321ac0d7818453-b4842109b58cc4a2-"
    "c88a2f856248af0e": "vLLM 0.6.3.post1; CoreX 3.2.3's vendored tree (byte-identical protocol.py)",
}


def compat_needed(module: types.ModuleType, settings: config.Settings) -> Optional[str]:
    """None where the build's chat request lacks ``max_completion_tokens`` and forbids extra
    fields (vLLM 0.6.3's); else why the row is not needed."""
    cls = vars(module).get(OWNER)
    fields = getattr(cls, "model_fields", None)
    if not isinstance(cls, type) or fields is None:
        return f"{module.__name__} has no pydantic {OWNER} (the code this fixes is absent)"
    if "max_completion_tokens" in fields:
        return ("this build's chat request has max_completion_tokens and the mappings of "
                "vLLM 0.6.4 (#9837, #10000, #9530)")
    if getattr(cls, "model_config", {}).get("extra") != "forbid":
        return f"this build's {OWNER} accepts unknown fields"
    return versions.only_063()


def check(cls: Any) -> Optional[str]:
    """The row's code check: the fields the mappings write, and the code shapes of 0.6.3's
    validators they run before."""
    fields = getattr(cls, "model_fields", {})
    missing = [f for f in ("messages", "max_tokens", "tools", "tool_choice", "top_logprobs",
                           "logprobs", "response_format", "stream_options", "guided_json")
               if f not in fields]
    if missing:
        return f"{OWNER} lacks the fields {missing}"
    if not {"role", "content", "tool_calls"} <= message_keys_of(cls):
        return f"{OWNER}.messages is not a list of the message types it was checked against"
    shape = code_shapes.class_shape(cls, SHAPE_OF)
    if shape is None:
        return f"the source of {OWNER}'s validators cannot be read"
    return code_shapes.unknown_shape(f"{OWNER}'s validators", shape, KNOWN)


#: Where row ``chat_tool_calls`` wraps ``OpenAIServingChat.create_chat_completion``.


def tool_calls_live() -> bool:
    """Whether row ``chat_tool_calls`` is installed in this process now (it serves the
    ``tool_choice: "required"`` answers this row maps)."""
    module = sys.modules.get(SERVING_CHAT)
    cls = vars(module).get("OpenAIServingChat") if module is not None else None
    if not isinstance(cls, type):
        return False
    from ..patching import registry

    return registry.is_ours(vars(cls).get("create_chat_completion"))


def make_request_class(family: Family, original: Any, module: types.ModuleType,
                       settings: config.Settings) -> type:
    """The subclass of ``original`` (0.6.3's ``ChatCompletionRequest``) that ``rewrite``s
    the body inside its own validation (``request_body.request_class``)."""
    fields = request_body.field_names(original)
    keys = message_keys_of(original)

    def mapping(data: Dict[str, Any]) -> Tuple[Dict[str, Any], bool, Any]:
        return rewrite(data, fields, keys, tool_calls_live())

    return request_body.request_class(original, mapping, REWRITES)


__all__: List[str] = ["IGNORED", "REFUSED", "RequestRefused", "rewrite", "compat_needed",
                      "check", "make_request_class", "tool_calls_live"]

"""What today's OpenAI clients send, served by vLLM 0.6.3's chat front end: lossless mappings.

Catalogue entry: row ``chat_request_compat`` of ``vllm_bi100_patch.table`` (its companion row
``error_message_cause`` is ``patches/error_cause.py``); each mapping with its public source in
``docs/serving-compat.md``.

vLLM 0.6.3's ``ChatCompletionRequest`` (``vllm/entrypoints/openai/protocol.py``, byte-identical
in CoreX 3.2.3) is a pydantic model with ``extra="forbid"``: FastAPI validates the request body
with it before any of vLLM's code runs, so the only place to map a body is inside that
validation.  The row replaces the module's class with a subclass carrying one pydantic *wrap*
validator (it runs before 0.6.3's own ``before`` validators, on the raw body) that applies
``rewrite``; everything else is 0.6.3's class.  ``rewrite`` is plain Python on dicts: it maps
only what maps losslessly, drops only fields that change nothing a self-hosted server does
(each named once per process in a WARNING), and refuses, naming the field and why, what it
cannot serve.  A field it does not know stays refused by 0.6.3 itself, by name.

Never imports vLLM (pydantic is imported when the class is built: vLLM's front end has it).
"""

from __future__ import annotations

import copy
import json
import threading
import types
import typing
from typing import Any, Callable, Dict, FrozenSet, List, Optional

from .. import config
from .._log import log
from ..versions import Family
from . import code_shapes
from ._common import counter
from .block_tables import fingerprint
from .seq_limit import only_063

OWNER = "ChatCompletionRequest"
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
#: The body's values ``rewrite`` changes in place (copied first).
MUTATED = ("messages", "tools", "stream_options")

_warned: set = set()
_warned_lock = threading.Lock()


def _warn_once(what: str, why: str) -> None:
    IGNORED_CALLS.add()
    with _warned_lock:
        if what in _warned:
            return
        _warned.add(what)
    log.warning("vllm-bi100-patch: chat requests' %s accepted and ignored (%s); logged once "
                "per process", what, why)


class RequestRefused(ValueError):
    """A body the server cannot serve as asked (pydantic turns it into a 400 naming it)."""


def _is_json(text: str) -> Optional[str]:
    try:
        json.loads(text)
    except ValueError as exc:
        return str(exc)
    return None


def _messages(data: Dict[str, Any], message_keys: FrozenSet[str]) -> None:
    messages = data.get("messages")
    if not isinstance(messages, list):
        return  # 0.6.3 refuses it by name
    if not messages:
        raise RequestRefused("`messages` is empty: a chat completion needs at least one message")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            continue
        if message.get("role") == "developer":  # OpenAI's name for system since o1
            message["role"] = "system"
        for key in [k for k in message if k not in message_keys]:
            del message[key]
            _warn_once(f"message key `{key}`", "not a key of any message type vLLM 0.6.3 "
                       "reads; upstream ignores it from 0.6.5 (#10463)")
        calls = message.get("tool_calls")
        if not isinstance(calls, list):
            continue
        for j, call in enumerate(calls):
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict) or "arguments" not in function:
                continue
            where = f"messages[{i}].tool_calls[{j}].function.arguments"
            args = function["arguments"]
            if isinstance(args, (dict, list)):
                function["arguments"] = json.dumps(args, ensure_ascii=False)
            elif isinstance(args, str):
                problem = _is_json(args)
                if problem is not None:
                    raise RequestRefused(f"{where} is not valid JSON ({problem})")


def _tools(data: Dict[str, Any]) -> None:
    choice = data.get("tool_choice")
    if choice == "none":  # vLLM 0.6.4 (#10000): no tool is called, the tools are dropped
        data.pop("tool_choice")
        data.pop("tools", None)
        return
    if choice == "required":
        raise RequestRefused("`tool_choice: \"required\"` is not supported by this server "
                             "(vLLM 0.6.3 cannot force a tool call); name the tool in "
                             "`tool_choice` or use \"auto\"")
    tools = data.get("tools")
    if not isinstance(tools, list):
        return
    named = None
    if isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        named = choice["function"].get("name")
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or "strict" not in function:
            continue
        strict = function["strict"]
        if strict is True and function.get("name") != named:
            raise RequestRefused(
                f"tools[{i}].function.strict is true, but this server enforces a tool's "
                "parameters only when `tool_choice` names that tool (guided decoding); name "
                f"it in `tool_choice` or send `strict: false`")
        if strict not in (True, False, None):
            continue  # 0.6.3 refuses it by name
        del function["strict"]  # false: nothing to enforce; true: guided by tool_choice


def _response_format(data: Dict[str, Any]) -> None:
    fmt = data.get("response_format")
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        return
    spec = fmt.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if not isinstance(schema, dict):
        raise RequestRefused("`response_format.json_schema.schema` is missing: a json_schema "
                             "response format needs the schema")
    guided = data.get("guided_json")
    if guided is not None and guided != schema:
        raise RequestRefused("`guided_json` and `response_format.json_schema` give two "
                             "different schemas")
    data["guided_json"] = schema  # vLLM 0.6.4 (#9530): the schema is enforced


def rewrite(data: Dict[str, Any], fields: FrozenSet[str], message_keys: FrozenSet[str]
            ) -> Dict[str, Any]:
    """The body with today's clients' fields mapped onto vLLM 0.6.3's (in place).

    ``fields``: the request model's own fields (a field the model has is never touched);
    ``message_keys``: every key of a message type it reads.  Raises ``RequestRefused``
    naming the field for what cannot be served as asked."""
    for name, why in REFUSED.items():
        if name in data and name not in fields:
            if data[name] is not None:
                raise RequestRefused(f"`{name}` is not supported by this server: {why} "
                                     "(refused rather than ignored)")
            del data[name]  # null: the default, which is what this server does
            _warn_once(f"field `{name}: null`", "null asks for the default")
    modalities = data.get("modalities")
    if "modalities" not in fields and "modalities" in data:
        if modalities not in (None, TEXT_ONLY):
            raise RequestRefused(f"`modalities` {modalities!r}: this server answers in text "
                                 "only (send [\"text\"] or leave it out)")
        del data["modalities"]
        _warn_once("field `modalities`", "[\"text\"] is what this server answers anyway")
    for name, why in IGNORED.items():
        if name in data and name not in fields:
            del data[name]
            _warn_once(f"field `{name}`", why)
    if "max_completion_tokens" in data and "max_completion_tokens" not in fields:
        value = data.pop("max_completion_tokens")
        if value is not None:  # OpenAI's current name for max_tokens; it wins (#9837)
            data["max_tokens"] = value
    if data.get("top_logprobs") == 0 and not data.get("logprobs"):
        del data["top_logprobs"]  # zero alternatives of no logprobs: nothing to return
    options = data.get("stream_options")
    if isinstance(options, dict) and "continuous_usage_stats" not in options:
        options["continuous_usage_stats"] = False  # usage on the final chunk only (0.6.4)
    _messages(data, message_keys)
    _tools(data)
    _response_format(data)
    return data


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
#: (``block_tables.fingerprint`` of each, joined) as read in the releases named.
SHAPE_OF = ("check_tool_usage", "check_logprobs", "validate_stream_options",
            "check_guided_decoding_count", "to_sampling_params", "_get_guided_json_from_tool")
KNOWN: Dict[str, str] = {
    "e6f5136b49ca9d28-bc54de9cef019cae-ce47ff2def4c18ba-e7321ac0d7818453-b4842109b58cc4a2-"
    "c88a2f856248af0e": "vLLM 0.6.3.post1; CoreX 3.2.3's vendored tree (byte-identical protocol.py)",
}


def _shape(cls: type) -> Optional[str]:
    parts = []
    for name in SHAPE_OF:
        desc = vars(cls).get(name)
        func = getattr(desc, "__func__", desc)
        if func is None:
            return None
        shape = fingerprint(func)
        if shape is None:
            return None
        parts.append(shape)
    return "-".join(parts)


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
    return only_063()


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
    shape = _shape(cls)
    if shape is None:
        return f"the source of {OWNER}'s validators cannot be read"
    return code_shapes.unknown_shape(f"{OWNER}'s validators", shape, KNOWN)


def make_request_class(family: Family, original: Any, module: types.ModuleType,
                       settings: config.Settings) -> type:
    """The subclass of ``original`` (0.6.3's ``ChatCompletionRequest``) that ``rewrite``s
    the body inside its own validation."""
    from pydantic import model_validator

    fields = frozenset(original.model_fields)
    for field in original.model_fields.values():
        if field.alias:
            fields |= {field.alias}
    keys = message_keys_of(original)

    class ChatCompletionRequest(original):  # type: ignore[misc, valid-type]
        @model_validator(mode="wrap")
        @classmethod
        def _vllm_bi100_compat(cls, data: Any, handler: Callable[[Any], Any]) -> Any:
            if isinstance(data, dict):
                body = dict(data)
                for key in MUTATED:  # the caller's own objects are never changed
                    if key in body:
                        body[key] = copy.deepcopy(body[key])
                body = rewrite(body, fields, keys)
                if body != data:
                    REWRITES.add()
                data = body
            return handler(data)

    ChatCompletionRequest.__module__ = original.__module__
    ChatCompletionRequest.__qualname__ = original.__qualname__
    ChatCompletionRequest.__doc__ = original.__doc__
    return ChatCompletionRequest


__all__: List[str] = ["IGNORED", "REFUSED", "RequestRefused", "rewrite", "compat_needed",
                      "check", "make_request_class"]

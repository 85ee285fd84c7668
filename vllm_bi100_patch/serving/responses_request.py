"""A Responses API request (``POST /v1/responses``) read as the chat completion vLLM 0.6.3
serves: ``chat_body`` maps each field the first upstream release served (vLLM 0.10.0,
stateless) onto the chat request's, or refuses it by name (``RequestRefused``, a 400).

One concept: the request's mapping, field by field and item by item (one table of what each
field does, docs/serving-compat.md's, lives here whole).

Function tools become chat tools, the function tools of a ``namespace`` too (their calls
answered with the namespace); hosted tools (``HOSTED``: OpenAI runs them) are left out of what
the model sees.  An ``item_reference`` is read as the item it names, from the items this
server answered (``responses_store``).

Every field of OpenAI's request is in exactly one of ``MAPPED``, ``ECHOED``, ``IGNORED`` or
``REFUSED``; a field in none of them is refused by name, as 0.6.3's chat request refuses an
unknown field.  The input's items become chat messages in order: ``message`` (roles user,
system, developer, assistant; text parts, images), ``function_call`` (an assistant message's
``tool_calls``, consecutive calls in one message), ``function_call_output`` (a ``tool``
message), ``reasoning`` (left out of the prompt: 0.6.3's chat row drops an echoed
``reasoning_content`` the same way, and the models' templates do not show past thinking).
Any other item type, a custom tool, and stored state other than items are refused by name.
The result is the body the chat row (``chat_compat``) validates next: what it maps or
refuses there (``strict``, ``tool_choice`` forms, ``json_schema``, the client-schema limits)
happens as for a chat request.

Work is bounded by the body: one pass over ``input`` and ``tools``, no schema read here.
Stdlib only; never imports vLLM.
"""

from __future__ import annotations

import json
from typing import Any, Dict, List, Optional, Tuple

from . import responses_store
from .refusal import RequestRefused, shown

ENDPOINT = "/v1/responses"

#: Fields mapped onto the chat request.
MAPPED = frozenset({"model", "input", "instructions", "tools", "tool_choice",
                    "parallel_tool_calls", "max_output_tokens", "temperature", "top_p", "text",
                    "stream", "user", "reasoning", "include", "stream_options", "store"})
#: Fields copied into the response object and otherwise without effect on the answer.
ECHOED = frozenset({"metadata", "service_tier", "truncation"})
#: Fields that change nothing the server answers (caching and abuse-tracking hints).
IGNORED = frozenset({"prompt_cache_key", "safety_identifier", "prompt_cache_retention",
                     "client_metadata"})
#: Fields the server cannot serve, each with why (a 400 naming it).
REFUSED: Dict[str, str] = {
    "previous_response_id": "this server keeps no responses (send the whole conversation as "
                            "`input`; `store` is accepted and nothing is stored)",
    "conversation": "this server keeps no conversations (send the whole conversation as "
                    "`input`)",
    "background": "background responses are not served (vLLM 0.10.0's first Responses API "
                  "did not serve them either)",
    "prompt": "reusable prompts are stored by OpenAI, not on this server",
    "max_tool_calls": "a limit on hosted tool calls: this server runs no hosted tools",
    "top_logprobs": "log probabilities are not served by this endpoint (use "
                    "/v1/chat/completions with `logprobs`)",
    "context_management": "server-side compaction is not served",
}
#: ``include`` values that ask for nothing this server has (no hosted tools, no encrypted
#: reasoning): accepted, nothing added.
INCLUDE_NOTHING = frozenset({"reasoning.encrypted_content", "web_search_call.action.sources",
                             "web_search_call.results", "code_interpreter_call.outputs",
                             "computer_call_output.output.image_url",
                             "file_search_call.results", "message.input_image.image_url"})
#: Tools OpenAI runs on its own servers: offered ones are left out of what the model sees (it
#: could never call them here; Codex offers ``web_search`` at its defaults, and a 400 stops
#: it), named in one WARNING; a ``tool_choice`` forcing one is refused by name.
HOSTED = frozenset({"web_search", "web_search_preview", "web_search_preview_2025_03_11",
                    "web_search_2025_08_26", "file_search", "code_interpreter",
                    "computer_use_preview", "computer_use", "image_generation", "mcp"})
#: Roles of a message item and the chat role each becomes.
ROLES = {"user": "user", "system": "system", "developer": "developer",
         "assistant": "assistant"}
#: Content part types of a message item: text (each becomes chat text).
TEXT_PARTS = frozenset({"input_text", "output_text", "text", "summary_text", "reasoning_text"})


def refuse(what: str, why: str) -> RequestRefused:
    return RequestRefused(f"{ENDPOINT}: {what} is not served: {why}")


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise RequestRefused(f"{ENDPOINT}: {where} must be a string, got "
                             f"{type(value).__name__}")
    return value


def _content(parts: Any, where: str, role: str) -> Any:
    """A message item's content as chat content: a string stays one; a list of parts becomes
    chat parts (text, image_url)."""
    if isinstance(parts, str):
        return parts
    if not isinstance(parts, list):
        raise RequestRefused(f"{ENDPOINT}: {where} must be a string or a list of parts")
    out: List[Dict[str, Any]] = []
    for i, part in enumerate(parts):
        at = f"{where}[{i}]"
        if not isinstance(part, dict):
            raise RequestRefused(f"{ENDPOINT}: {at} must be an object")
        kind = part.get("type")
        if kind in TEXT_PARTS:
            out.append({"type": "text", "text": _text(part.get("text"), at + ".text")})
        elif kind == "refusal" and role == "assistant":
            out.append({"type": "text", "text": _text(part.get("refusal"), at + ".refusal")})
        elif kind == "input_image" and isinstance(part.get("image_url"), str):
            image = {"url": part["image_url"]}
            if part.get("detail") not in (None, "auto"):
                image["detail"] = part["detail"]
            out.append({"type": "image_url", "image_url": image})
        else:
            raise refuse(f"{at} of type {shown(kind)}",
                         "this server reads text parts (input_text, output_text) and images "
                         "given by URL (input_image with image_url); files and file ids "
                         "are stored by OpenAI")
    if all(p["type"] == "text" for p in out):
        return "".join(p["text"] for p in out)  # one string: every 0.6.3 chat template reads it
    return out


def _arguments(value: Any, where: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        return json.dumps(value, ensure_ascii=False)
    raise RequestRefused(f"{ENDPOINT}: {where} must be a JSON text")


def _output_text(value: Any, where: str) -> str:
    """A ``function_call_output``'s output: a string, or a list of text parts joined."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        content = _content(value, where, "tool")
        if isinstance(content, str):
            return content
    raise RequestRefused(f"{ENDPOINT}: {where} must be a string or a list of text parts")


def messages(data: Dict[str, Any]) -> Tuple[List[Dict[str, Any]], int]:
    """The chat messages of ``instructions`` and ``input``, and how many reasoning items were
    left out of the prompt."""
    out: List[Dict[str, Any]] = []
    instructions = data.get("instructions")
    if instructions is not None:
        out.append({"role": "system", "content": _text(instructions, "instructions")})
    items = data.get("input")
    if items is None:
        raise RequestRefused(f"{ENDPOINT}: `input` is required")
    if isinstance(items, str):
        out.append({"role": "user", "content": items})
        return out, 0
    if not isinstance(items, list):
        raise RequestRefused(f"{ENDPOINT}: `input` must be a string or a list of items")
    if not items:
        raise RequestRefused(f"{ENDPOINT}: `input` has no items")
    reasoning = 0
    for i, item in enumerate(items):
        at = f"input[{i}]"
        if not isinstance(item, dict):
            raise RequestRefused(f"{ENDPOINT}: {at} must be an object")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "item_reference":
            found = responses_store.find(item.get("id"))
            if found is None:
                raise refuse(f"{at} (an item_reference to {shown(item.get('id'))})",
                             "this server does not hold that item (" + responses_store.LIMITS
                             + "); send the item itself")
            item, kind = found, found["type"]  # read as if sent inline
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise refuse(f"{at}.role {shown(role)}",
                             "roles are user, system, developer and assistant")
            out.append({"role": ROLES[role],
                        "content": _content(item.get("content"), at + ".content", role)})
        elif kind == "function_call":
            call = {"id": _text(item.get("call_id"), at + ".call_id"), "type": "function",
                    "function": {"name": _text(item.get("name"), at + ".name"),
                                 "arguments": _arguments(item.get("arguments"),
                                                         at + ".arguments")}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and (
                    "tool_calls" in last or isinstance(last.get("content"), str)):
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append({"role": "tool",
                        "tool_call_id": _text(item.get("call_id"), at + ".call_id"),
                        "content": _output_text(item.get("output"), at + ".output")})
        elif kind == "reasoning":
            reasoning += 1
        else:
            raise refuse(f"{at} of type {shown(kind)}",
                         "input items are messages, function_call, function_call_output and "
                         "reasoning; this server runs no hosted or custom tools")
    if not out:
        raise RequestRefused(f"{ENDPOINT}: `input` has no message for the model to answer "
                             "(reasoning items only)")
    return out, reasoning


def _function(tool: Dict[str, Any], at: str) -> Dict[str, Any]:
    fn: Dict[str, Any] = {"name": _text(tool.get("name"), at + ".name")}
    for key in ("description", "parameters", "strict"):
        if tool.get(key) is not None:
            fn[key] = tool[key]
    return {"type": "function", "function": fn}


def tools_of(tools: Any) -> Tuple[List[Dict[str, Any]], Dict[str, str], List[str]]:
    """The chat tools of a Responses ``tools`` list: function tools, and the function tools of
    each ``namespace`` (their calls come back with that ``namespace``); with the namespace of
    each such name, and the hosted tool types left out (``HOSTED``)."""
    if not isinstance(tools, list):
        raise RequestRefused(f"{ENDPOINT}: `tools` must be a list")
    out: List[Dict[str, Any]] = []
    namespaces: Dict[str, str] = {}
    hosted: List[str] = []
    for i, tool in enumerate(tools):
        at = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise RequestRefused(f"{ENDPOINT}: {at} must be an object")
        kind = tool.get("type")
        if kind == "function":
            out.append(_function(tool, at))
        elif kind == "namespace" and isinstance(tool.get("tools"), list):
            space = _text(tool.get("name"), at + ".name")
            for j, inner in enumerate(tool["tools"]):
                where = f"{at}.tools[{j}]"
                if not isinstance(inner, dict) or inner.get("type", "function") != "function":
                    what = inner.get("type") if isinstance(inner, dict) else inner
                    raise refuse(f"{where} of type {shown(what)}",
                                 "a namespace's tools must be function tools")
                out.append(_function(inner, where))
                namespaces[out[-1]["function"]["name"]] = space
        elif kind in HOSTED:
            if kind not in hosted:
                hosted.append(kind)
        else:
            raise refuse(f"{at} of type {shown(kind)}",
                         "this server serves function tools (and namespaces of them); "
                         "custom (freeform) and local_shell tools need a model format it "
                         "does not have")
    names = [t["function"]["name"] for t in out]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise refuse(f"tools named {', '.join(map(shown, twice))} more than once",
                     "every function tool, within a namespace or not, needs a name of its own")
    return out, namespaces, hosted


def _format(text: Any) -> Optional[Dict[str, Any]]:
    """``text.format`` as the chat request's ``response_format`` (None: plain text)."""
    if not isinstance(text, dict):
        raise RequestRefused(f"{ENDPOINT}: `text` must be an object")
    for key in text:
        if key not in ("format", "verbosity"):
            raise refuse(f"text.{shown(key)}", "`text` has `format` (and `verbosity`)")
    if text.get("verbosity") not in (None, "medium"):
        raise refuse(f"text.verbosity {shown(text['verbosity'])}",
                     "the model's length is not steered by this server; leave it unset")
    fmt = text.get("format")
    if fmt is None or (isinstance(fmt, dict) and fmt.get("type") == "text"):
        return None
    if not isinstance(fmt, dict):
        raise RequestRefused(f"{ENDPOINT}: text.format must be an object")
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        schema = {k: fmt[k] for k in ("name", "description", "schema", "strict") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    raise refuse(f"text.format of type {shown(fmt.get('type'))}",
                 "formats are text, json_object and json_schema")


def _reasoning(value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, dict):
        raise RequestRefused(f"{ENDPOINT}: `reasoning` must be an object")
    for key, setting in value.items():
        if key in ("summary", "generate_summary"):
            continue  # the model's own thinking is returned as it is, never summarised
        if key == "effort" and setting in (None, "medium"):
            continue
        raise refuse(f"reasoning.{shown(key)} {shown(setting)}",
                     "a model served by vLLM 0.6.3 has no reasoning effort to set; leave it "
                     "unset")


def chat_body(data: Any) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """The chat completion body of the Responses request ``data`` and what the response object
    echoes (``echo``).  Raises ``RequestRefused`` naming the first field it cannot serve."""
    if not isinstance(data, dict):
        raise RequestRefused(f"{ENDPOINT}: the body must be a JSON object")
    for key in data:
        if key in REFUSED and data[key] not in (None, False):
            raise refuse(f"`{key}`", REFUSED[key])
        if key not in MAPPED and key not in ECHOED and key not in IGNORED and key not in REFUSED:
            raise RequestRefused(f"{ENDPOINT}: unknown field {shown(key)}")
    if data.get("truncation") not in (None, "disabled"):
        raise refuse(f"truncation {shown(data['truncation'])}",
                     "a prompt over the model's length is refused, never cut")
    include = data.get("include") or []
    if not isinstance(include, list):
        raise RequestRefused(f"{ENDPOINT}: `include` must be a list")
    for value in include:
        if not isinstance(value, str) or value not in INCLUDE_NOTHING:
            raise refuse(f"include {shown(value)}", "log probabilities are not served by this "
                         "endpoint" if "logprobs" in str(value) else "unknown value")
    _reasoning(data.get("reasoning"))
    chat_messages, reasoning_items = messages(data)
    body: Dict[str, Any] = {"model": data.get("model"), "messages": chat_messages}
    for src, dst in (("temperature", "temperature"), ("top_p", "top_p"),
                     ("max_output_tokens", "max_tokens"), ("user", "user"),
                     ("parallel_tool_calls", "parallel_tool_calls"),
                     ("tool_choice", "tool_choice")):
        if data.get(src) is not None:
            body[dst] = data[src]
    namespaces: Dict[str, str] = {}
    hosted: List[str] = []
    if data.get("tools"):
        chat_tools, namespaces, hosted = tools_of(data["tools"])
        if chat_tools:
            body["tools"] = chat_tools
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") not in ("function", "allowed_tools"):
        raise refuse(f"tool_choice of type {shown(choice.get('type'))}",
                     "this server runs no hosted tools; it can force a function tool")
    if "tools" not in body and choice in ("auto", "none"):
        del body["tool_choice"]  # no tools: nothing to choose (0.6.3 refuses auto without tools)
    if data.get("text") is not None:
        fmt = _format(data["text"])
        if fmt is not None:
            body["response_format"] = fmt
    if data.get("stream"):
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    elif data.get("stream_options") is not None:
        raise RequestRefused(f"{ENDPOINT}: `stream_options` is only for streams")
    echo = {k: data.get(k) for k in ("instructions", "metadata", "parallel_tool_calls",
                                      "tool_choice", "tools", "temperature", "top_p",
                                      "max_output_tokens", "user", "text", "service_tier",
                                      "reasoning")}
    echo["reasoning_items_dropped"] = reasoning_items
    echo["namespaces"] = namespaces
    echo["hosted_tools_dropped"] = hosted
    echo["store"] = data.get("store") is not False
    return body, echo


__all__ = ["ECHOED", "HOSTED", "IGNORED", "MAPPED", "REFUSED", "chat_body", "messages",
           "tools_of"]

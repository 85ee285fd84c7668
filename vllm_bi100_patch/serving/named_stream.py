"""A streamed tool call forced by a named ``tool_choice``, as clients read it (row
``named_tool_stream`` of ``vllm_bi100_patch.patching.table``; docs/serving-compat.md, "Streamed tool
calls").

With ``stream: true`` and ``tool_choice: {"type": "function", "function": {"name": ...}}``,
vLLM 0.6.3's ``OpenAIServingChat.chat_completion_stream_generator`` (its
``tool_choice_function_name`` branch; CoreX 3.2.3's vendored file has the same branch) sends
every delta of the guided output as ``DeltaToolCall(function=DeltaFunctionCall(name=...,
arguments=delta_text), index=i)`` dumped with ``exclude_unset``: the name in every delta, no
``id``, no ``type``, and ``index`` the choice's index (``1`` for choice 1 with ``n=2``).  The
openai SDK's stream helpers then join the name six times over with ``id=None`` (and raise
``IndexError`` for choice 1's call ``index: 1``), LangChain reads one tool called
``WeatherWeather...``, strands-agents finds no call id.

``Rewrite`` reads the stream's chunks (``data: {...}`` lines) of such a request: in each
choice, the call's first delta gets an ``id`` (``chatcmpl-tool-...``, 0.6.3's own form) and
``"type": "function"`` beside the name, later deltas carry only the arguments, and ``index`` is
the call's index within its choice (0: a named request asks for one call), as upstream streams
it since pull request #41876 (name and id once on the first tool-call chunk).  ``finish_reason``
is left as 0.6.3 sends it, the engine's (``stop``, ``length`` when cut): upstream and OpenAI
answer a named call with ``stop``, ``tool_calls`` being for ``auto`` and ``required``.  The text
of the arguments is not touched.

The rewriting runs in the wrapper of the stream generator that row ``stream_finish_reason``
installs (``tool_stream.make_stream_wrapper``): one wrapper per method, each row one behaviour
of it with its own kill switch.  Never imports vLLM.
"""

from __future__ import annotations

import json
from typing import Any, Dict, List, Optional

from ..patching.factories import counter
from .tool_args import call_id

CALLS = counter("named_tool_stream")
NAMED = "ChatCompletionNamedToolChoiceParam"


def forced_name(request: Any) -> Optional[str]:
    """The tool a request forces by name (0.6.3's ``tool_choice_function_name``), or None."""
    choice = getattr(request, "tool_choice", None)
    if type(choice).__name__ != NAMED:
        return None
    function = getattr(choice, "function", None)
    name = getattr(function, "name", None)
    return name if isinstance(name, str) else None


class Rewrite:
    """One named stream's chunks, rewritten: per choice, the call's id and type on its first
    delta, the name once, index 0."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.ids: Dict[int, str] = {}  # choice index -> the call's id, once sent

    def line(self, data: str) -> str:
        if not data.startswith("data: {") or '"tool_calls":[' not in data:
            return data
        try:
            chunk = json.loads(data[len("data: "):])
        except (ValueError, RecursionError):
            return data
        if not isinstance(chunk, dict) or not isinstance(chunk.get("choices"), list):
            return data
        changed = False
        for choice in chunk["choices"]:
            if not isinstance(choice, dict):
                continue
            delta = choice.get("delta")
            calls = delta.get("tool_calls") if isinstance(delta, dict) else None
            if not isinstance(calls, list):
                continue
            index = choice.get("index", 0)
            for call in calls:
                if isinstance(call, dict):
                    self._call(index, call)
                    changed = True
        if not changed:
            return data
        return f"data: {json.dumps(chunk, ensure_ascii=False, separators=(',', ':'))}\n\n"

    def _call(self, choice: int, call: Dict[str, Any]) -> None:
        fn = call.get("function")
        if not isinstance(fn, dict):
            fn = call["function"] = {}
        call["index"] = 0
        if choice not in self.ids:
            self.ids[choice] = call.get("id") or call_id()
            call["id"] = self.ids[choice]
            call["type"] = "function"
            fn["name"] = fn.get("name") or self.name
            fn.setdefault("arguments", "")
            CALLS.add()
        else:
            call.pop("id", None)
            call.pop("type", None)
            fn.pop("name", None)
        # the keys in OpenAI's order: index, id, type, function
        ordered: Dict[str, Any] = {k: call.pop(k) for k in ("index", "id", "type", "function")
                                   if k in call}
        ordered.update(call)
        call.clear()
        call.update(ordered)


__all__: List[str] = ["Rewrite", "forced_name"]

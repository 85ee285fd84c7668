"""The answer of ``POST /v1/responses``: vLLM 0.6.3's chat answer (after the serving rows)
written as a Responses API response object (``response``) or as its event stream
(``Events``).

Output items, in the order the model wrote them: ``reasoning`` (the thinking a reasoning
parser split off: ``content`` of one ``reasoning_text``, ``summary`` empty), ``message`` (one
``output_text`` part), ``function_call`` (``call_id`` the chat call's id, ``arguments`` its
JSON text).  ``status`` is ``completed``, or ``incomplete`` with ``incomplete_details.reason``
``max_output_tokens`` where the chat answer's ``finish_reason`` is ``length``; usage is the
chat usage renamed (``input_tokens``, ``output_tokens``, ``total_tokens``; reasoning tokens are
not counted apart: 0.6.3 does not count them).

The stream (``Events.feed`` for each chat chunk's JSON, ``Events.end``) follows OpenAI's event
sequence: ``response.created``, ``response.in_progress``; per item
``response.output_item.added``, its deltas (``response.reasoning_text.delta``,
``response.content_part.added`` / ``response.output_text.delta`` / ``.done`` /
``response.content_part.done``, ``response.function_call_arguments.delta`` / ``.done``),
``response.output_item.done``; then ``response.completed`` (or ``response.incomplete``) with
the whole response and its usage; every event has its ``sequence_number``.  A chat error chunk
becomes an ``error`` event followed by ``response.failed``.

Stdlib only; never imports vLLM.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Dict, Iterator, List, Optional


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _usage(chat: Optional[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    if not chat:
        return None
    prompt = int(chat.get("prompt_tokens") or 0)
    completion = int(chat.get("completion_tokens") or 0)
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + completion}


def shell(response_id: str, model: str, echo: Dict[str, Any], created: int) -> Dict[str, Any]:
    """The response object before any output (``status`` in_progress)."""
    text = echo.get("text") or {}
    return {
        "id": response_id, "object": "response", "created_at": created,
        "status": "in_progress", "background": False, "error": None,
        "incomplete_details": None, "instructions": echo.get("instructions"),
        "max_output_tokens": echo.get("max_output_tokens"), "max_tool_calls": None,
        "metadata": echo.get("metadata") or {}, "model": model, "output": [],
        "parallel_tool_calls": echo.get("parallel_tool_calls") is not False,
        "previous_response_id": None,
        "reasoning": {"effort": (echo.get("reasoning") or {}).get("effort"), "summary": None},
        "service_tier": echo.get("service_tier") or "auto",
        "store": bool(echo.get("store")),  # its items kept for item_reference (not the response)
        "temperature": echo.get("temperature"),
        "text": {"format": text.get("format") or {"type": "text"}, "verbosity": "medium"},
        "tool_choice": echo.get("tool_choice") or "auto", "tools": echo.get("tools") or [],
        "top_logprobs": 0, "top_p": echo.get("top_p"), "truncation": "disabled",
        "usage": None, "user": echo.get("user"),
    }


def _finish(obj: Dict[str, Any], finish_reason: Optional[str],
            usage: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    if finish_reason == "length":
        obj["status"] = "incomplete"
        obj["incomplete_details"] = {"reason": "max_output_tokens"}
    else:
        obj["status"] = "completed"
    obj["usage"] = _usage(usage)
    return obj


def reasoning_item(text: str, item_id: Optional[str] = None) -> Dict[str, Any]:
    return {"id": item_id or new_id("rs"), "type": "reasoning", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "encrypted_content": None,
            "status": "completed"}


def message_item(text: str, item_id: Optional[str] = None,
                 status: str = "completed") -> Dict[str, Any]:
    return {"id": item_id or new_id("msg"), "type": "message", "role": "assistant",
            "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [],
                         "logprobs": []}]}


def call_item(call_id: str, name: str, arguments: str, item_id: Optional[str] = None,
              status: str = "completed", namespace: Optional[str] = None) -> Dict[str, Any]:
    item = {"id": item_id or new_id("fc"), "type": "function_call", "call_id": call_id,
            "name": name, "arguments": arguments, "status": status}
    if namespace is not None:
        item["namespace"] = namespace  # a tool of a namespace (Codex's multi_agent_v1)
    return item


def response(chat: Dict[str, Any], response_id: str, echo: Dict[str, Any]) -> Dict[str, Any]:
    """The response object of a whole chat answer (``ChatCompletionResponse.model_dump()``)."""
    obj = shell(response_id, chat.get("model") or "", echo, int(chat.get("created") or
                                                                   time.time()))
    choice = (chat.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    items: List[Dict[str, Any]] = []
    if message.get("reasoning_content"):
        items.append(reasoning_item(message["reasoning_content"]))
    if message.get("content"):
        items.append(message_item(message["content"]))
    for call in message.get("tool_calls") or []:
        fn = call.get("function") or {}
        name = fn.get("name") or ""
        items.append(call_item(call.get("id") or new_id("call"), name, fn.get("arguments") or "",
                               namespace=(echo.get("namespaces") or {}).get(name)))
    obj["output"] = items
    return _finish(obj, choice.get("finish_reason"), chat.get("usage"))


class Events:
    """The Responses event stream of one streamed chat answer (choice 0; ``n`` is 1)."""

    def __init__(self, response_id: str, model: str, echo: Dict[str, Any]) -> None:
        self.obj = shell(response_id, model, echo, int(time.time()))
        self.namespaces: Dict[str, str] = echo.get("namespaces") or {}
        self.seq = 0
        self.items: List[Dict[str, Any]] = []
        self.open: Optional[Dict[str, Any]] = None  # the item being streamed
        self.calls: Dict[int, Dict[str, Any]] = {}  # chat tool-call index -> its item
        self.finish_reason: Optional[str] = None
        self.usage: Optional[Dict[str, Any]] = None
        self.failed = False

    def _event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

    def start(self) -> Iterator[str]:
        yield self._event("response.created", response=dict(self.obj))
        yield self._event("response.in_progress", response=dict(self.obj))

    # --- items -------------------------------------------------------------------------

    def _index(self) -> int:
        return len(self.items) - 1

    def _close(self) -> Iterator[str]:
        item, self.open = self.open, None
        if item is None:
            return
        index = self.items.index(item)
        if item["type"] == "reasoning":
            text = item["content"][0]["text"]
            yield self._event("response.reasoning_text.done", item_id=item["id"],
                              output_index=index, content_index=0, text=text)
        elif item["type"] == "message":
            part = item["content"][0]
            yield self._event("response.output_text.done", item_id=item["id"],
                              output_index=index, content_index=0, text=part["text"],
                              logprobs=[])
            yield self._event("response.content_part.done", item_id=item["id"],
                              output_index=index, content_index=0, part=dict(part))
        else:
            yield self._event("response.function_call_arguments.done", item_id=item["id"],
                              output_index=index, name=item["name"],
                              arguments=item["arguments"])
        item["status"] = "completed"
        yield self._event("response.output_item.done", output_index=index, item=_copy(item))

    def _open(self, item: Dict[str, Any]) -> Iterator[str]:
        yield from self._close()
        self.items.append(item)
        self.open = item
        added = _copy(item)
        if item["type"] == "reasoning":
            added["content"] = []
        elif item["type"] == "message":
            added["content"] = []
        yield self._event("response.output_item.added", output_index=self._index(),
                          item=added)
        if item["type"] == "message":
            yield self._event("response.content_part.added", item_id=item["id"],
                              output_index=self._index(), content_index=0,
                              part={"type": "output_text", "text": "", "annotations": [],
                                    "logprobs": []})

    def _reasoning(self, delta: str) -> Iterator[str]:
        if self.open is None or self.open["type"] != "reasoning":
            yield from self._open(dict(reasoning_item(""), status="in_progress"))
        assert self.open is not None
        self.open["content"][0]["text"] += delta
        yield self._event("response.reasoning_text.delta", item_id=self.open["id"],
                          output_index=self._index(), content_index=0, delta=delta)

    def _text(self, delta: str) -> Iterator[str]:
        if self.open is None or self.open["type"] != "message":
            yield from self._open(message_item("", status="in_progress"))
        assert self.open is not None
        self.open["content"][0]["text"] += delta
        yield self._event("response.output_text.delta", item_id=self.open["id"],
                          output_index=self._index(), content_index=0, delta=delta,
                          logprobs=[])

    def _call(self, call: Dict[str, Any]) -> Iterator[str]:
        index = call.get("index", 0)
        fn = call.get("function") or {}
        item = self.calls.get(index)
        if item is None:
            name = fn.get("name") or ""
            item = call_item(call.get("id") or new_id("call"), name, "", status="in_progress",
                             namespace=self.namespaces.get(name))
            self.calls[index] = item
            yield from self._open(item)
        elif fn.get("name") and not item["name"]:
            item["name"] = fn["name"]
        arguments = fn.get("arguments")
        if arguments:
            if self.open is not item:  # calls are streamed one after another
                yield from self._close()
                self.open = item
            item["arguments"] += arguments
            yield self._event("response.function_call_arguments.delta", item_id=item["id"],
                              output_index=self.items.index(item), delta=arguments)

    # --- the chat chunks -----------------------------------------------------------------

    def feed(self, chunk: Dict[str, Any]) -> Iterator[str]:
        """The events of one chat chunk (the JSON of one ``data:`` line)."""
        if "error" in chunk or chunk.get("object") == "error":
            error: Dict[str, Any] = (chunk["error"] if isinstance(chunk.get("error"), dict)
                                     else chunk)
            yield from self.fail(str(error.get("message") or error),
                                 str(error.get("type") or "server_error"))
            return
        if chunk.get("model"):
            self.obj["model"] = chunk["model"]
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            if choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                yield from self._reasoning(delta["reasoning_content"])
            if delta.get("content"):
                yield from self._text(delta["content"])
            for call in delta.get("tool_calls") or []:
                yield from self._call(call)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]

    def fail(self, message: str, code: str) -> Iterator[str]:
        self.failed = True
        yield self._event("error", code=code, message=message, param=None)
        self.obj["status"] = "failed"
        self.obj["error"] = {"code": code, "message": message}
        self.obj["output"] = [_copy(i) for i in self.items]
        yield self._event("response.failed", response=dict(self.obj))

    def end(self) -> Iterator[str]:
        """After the chat stream's last chunk: every open item closed, the final event."""
        if self.failed:
            return
        yield from self._close()
        for item in self.items:
            item["status"] = "completed"
        self.obj["output"] = [_copy(i) for i in self.items]
        _finish(self.obj, self.finish_reason, self.usage)
        kind = "response.incomplete" if self.obj["status"] == "incomplete" else \
            "response.completed"
        yield self._event(kind, response=self.obj)

    def final(self) -> Dict[str, Any]:
        return self.obj


def _copy(item: Dict[str, Any]) -> Dict[str, Any]:
    return json.loads(json.dumps(item))


__all__ = ["Events", "call_item", "message_item", "new_id", "reasoning_item", "response",
           "shell"]

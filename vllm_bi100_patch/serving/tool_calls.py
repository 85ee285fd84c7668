"""The answers of vLLM 0.6.3's chat front end to the tool plans of ``chat_request_compat``
(row ``chat_tool_calls`` of ``vllm_bi100_patch.patching.table``; docs/serving-compat.md).

``OpenAIServingChat.create_chat_completion`` is wrapped; a request without a plan
(``tool_choice.ToolPlan``, attached by the chat row's validation) passes through untouched.
With one, the answer 0.6.3 built (a ``ChatCompletionResponse``, or the stream of
``data: {...}`` lines) is rewritten:

- ``tool_choice: "required"`` (0.6.3 saw "none" and a ``guided_json`` of the calls' schema,
  so its answer is the guided text): the text read as the call array (``tool_args.CallArray``)
  and returned as ``tool_calls`` (ids ``chatcmpl-tool-...``, arguments the JSON text of each
  call's parameters), content null, ``finish_reason: "tool_calls"``, as upstream serves it from
  vLLM 0.8.3 (#13483).  Streamed, each call goes out in one delta (index, id, type, name,
  arguments) as soon as its object is complete.  An answer that is not a complete array (cut by
  ``max_tokens``) keeps its complete calls as calls and the rest as content, with 0.6.3's
  ``finish_reason``; one that stopped by itself without being one is logged and counted;
- tools sent with ``strict: true``: every call of such a tool in the answer (the tool parser's
  under automatic tool choice, 0.6.3's named-tool call, the required calls), streamed or not,
  is checked against the tool's schema when its choice finishes (``tool_args.check_call``: a
  violation is logged with the request id and tool, and counted), in a thread of its own
  (``_off_loop``: a check may take up to its time budget, the event loop serves every other
  request meanwhile).  The answer is not changed:
  upstream serves strict tools under automatic tool choice unchecked.

Never imports vLLM: the response classes are read from the response's own module.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import json
import sys
import threading
import types
from typing import Any, AsyncIterator, Callable, Dict, List, Optional, Tuple

from ..activation import config
from ..patching.versions import Family
from . import chat_compat, tool_args
from ..patching import code_shapes
from ..patching.factories import Wrapper, counter
from .request_body import plan_of

OWNER = "OpenAIServingChat"
PROTOCOL = "vllm.entrypoints.openai.protocol"
REQUIRED = counter("tool_choice_required")

#: The methods whose behaviour the rewriting relies on (for tool_choice "none": the text as
#: content, the stream's chunks of ``DeltaMessage(content=...)``) and their code shapes.
SHAPE_OF = ("create_chat_completion", "chat_completion_full_generator",
            "chat_completion_stream_generator")
KNOWN: Dict[str, str] = {
    "d00edc163dd53656-1fa5c91dcc2ff517-0f98633082c2606b": "vLLM 0.6.3.post1",
    # Read in Iluvatar's vendored tree (wudixzy/competition at 5a1c8c79,
    # vllm/entrypoints/openai/serving_chat.py): 0.6.3's answer paths for tool_choice "none"
    # (text as content, content deltas), with a beam-search assert and per-chunk usage code
    # of its own.
    "85d74cefd4034dcb-267c86d716d5ed2a-b95781b586b13715": "CoreX 3.2.3's vendored tree",
}


def tool_calls_needed(module: types.ModuleType, settings: config.Settings) -> Optional[str]:
    """None where the chat row makes the plans this row serves (vLLM 0.6.3, the chat row
    enabled); else why this row is not needed."""
    if "chat_request_compat" in settings.disabled:
        return ("row chat_request_compat is disabled: it makes the tool plans this row serves "
                "(tool_choice \"required\" stays refused by vLLM 0.6.3, strict by name)")
    protocol = sys.modules.get(PROTOCOL)
    if protocol is None:
        return f"{PROTOCOL} is not imported: no chat request to map"
    return chat_compat.compat_needed(protocol, settings)


def check_create(func: Callable[..., Any]) -> Optional[str]:
    """The row's code check: the code shapes of ``create_chat_completion`` and the two
    generators it returns the answer of."""
    module = sys.modules.get(getattr(func, "__module__", ""))
    cls = vars(module).get(OWNER) if module is not None else None
    if not isinstance(cls, type):
        return f"{OWNER} is not found beside create_chat_completion"
    shape = code_shapes.class_shape(cls, SHAPE_OF, "__wrapped__")
    if shape is None:
        return f"the source of {OWNER}'s answer methods cannot be read"
    return code_shapes.unknown_shape(f"{OWNER}'s answer methods", shape, KNOWN)


# --- the whole answer --------------------------------------------------------------------


def _all_calls(names: Tuple[str, ...], text: str) -> Tuple[List[Tuple[str, str]], str, bool]:
    """Every complete call of ``text``, the rest, and whether it was a complete array."""
    array = tool_args.CallArray(names)
    calls = array.feed(text)
    more, rest, complete = array.finish()
    return calls + more, rest, complete


def _full(response: Any, plan: Any, checks: List[Callable[[], None]]) -> Any:
    """The answer rewritten for ``plan``; its strict checks appended to ``checks`` (run off
    the event loop by the caller)."""
    protocol = sys.modules[type(response).__module__]
    for choice in response.choices:
        message = choice.message
        if plan.required is not None:
            calls, rest, complete = _all_calls(plan.required, message.content or "")
            message.tool_calls = [protocol.ToolCall(
                id=tool_args.call_id(), function=protocol.FunctionCall(name=n, arguments=a))
                for n, a in calls]
            message.content = rest or None
            if complete:
                choice.finish_reason = "tool_calls"
            elif choice.finish_reason != "length":
                tool_args.malformed(response.id, rest, choice.finish_reason)
        if plan.strict:
            checks.append(functools.partial(
                tool_args.check_calls, response.id, [(c.function.name, c.function.arguments)
                                                     for c in message.tool_calls], plan.strict))
    return response


_pool: Optional[concurrent.futures.ThreadPoolExecutor] = None
_pool_lock = threading.Lock()
#: Threads that run strict checks (each within ``strict_schema.BUDGET_S``).
CHECK_THREADS = 4


async def _off_loop(checks: List[Callable[[], None]]) -> None:
    """Run the strict checks in the check threads: a check may take up to its time budget,
    and the event loop serves every other request meanwhile (their patterns run with the GIL
    released)."""
    global _pool
    if not checks:
        return
    with _pool_lock:
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(
                CHECK_THREADS, thread_name_prefix="vllm-bi100-strict-check")
    pending = list(checks)
    checks.clear()
    await asyncio.get_running_loop().run_in_executor(
        _pool, lambda: [check() for check in pending])


# --- the stream --------------------------------------------------------------------------


class _Choice:
    """One streamed choice: its call array (required) and the calls seen (strict)."""

    __slots__ = ("array", "calls", "done")

    def __init__(self, plan: Any) -> None:
        self.array = tool_args.CallArray(plan.required) if plan.required is not None else None
        self.calls: Dict[int, List[Optional[str]]] = {}  # index -> [name, arguments]
        self.done = False


def _delta_call(index: int, name: str, arguments: str) -> Dict[str, Any]:
    return {"index": index, "id": tool_args.call_id(), "type": "function",
            "function": {"name": name, "arguments": arguments}}


class _Stream:
    """Rewrites 0.6.3's streamed chunks (``data: {...}``) for one plan."""

    def __init__(self, plan: Any) -> None:
        self.plan = plan
        self.choices: Dict[int, _Choice] = {}
        self.request_id = ""
        self.last: Optional[Dict[str, Any]] = None  # the latest chunk (for a closing one)
        self.checks: List[Callable[[], None]] = []  # strict checks to run off the loop

    def line(self, piece: str) -> List[str]:
        if not piece.startswith("data: "):
            return [piece]
        payload = piece[len("data: "):].strip()
        if payload == "[DONE]":
            return self.end() + [piece]
        if self.plan.required is None and "tool_calls" not in payload \
                and '"finish_reason":null' in payload:
            return [piece]  # strict only: nothing to read in a plain content chunk
        try:
            chunk = json.loads(payload)
        except (ValueError, RecursionError):
            return [piece]
        if not isinstance(chunk, dict) or not isinstance(chunk.get("choices"), list):
            return [piece]
        self.request_id = chunk.get("id", self.request_id)
        self.last = chunk
        changed = False
        kept = []
        for choice in chunk["choices"]:
            changed |= self._choice(choice)
            if choice.get("delta") or choice.get("finish_reason") is not None \
                    or choice.get("logprobs") is not None or chunk.get("usage") is not None:
                kept.append(choice)
        if not changed:
            return [piece]
        if not kept and chunk.get("usage") is None:
            return []
        chunk["choices"] = kept
        return [f"data: {json.dumps(chunk, ensure_ascii=False, separators=(',', ':'))}\n\n"]

    def _choice(self, choice: Dict[str, Any]) -> bool:
        state = self.choices.setdefault(choice.get("index", 0), _Choice(self.plan))
        delta = choice.get("delta")
        if not isinstance(delta, dict):
            return False
        changed = False
        finished = choice.get("finish_reason") is not None
        if state.array is not None and "role" not in delta and ("content" in delta or finished):
            calls = state.array.feed(delta.pop("content", None) or "")
            changed = True
            out = [_delta_call(state.array.calls - len(calls) + k, n, a)
                   for k, (n, a) in enumerate(calls)]
            if finished:
                more, rest, complete = state.array.finish()
                out += [_delta_call(state.array.calls - len(more) + k, n, a)
                        for k, (n, a) in enumerate(more)]
                if rest:
                    delta["content"] = rest
                if complete:
                    choice["finish_reason"] = "tool_calls"
                elif choice["finish_reason"] != "length":
                    tool_args.malformed(self.request_id, rest, choice["finish_reason"])
            if out:
                delta["tool_calls"] = out
        for call in delta.get("tool_calls") or ():
            seen = state.calls.setdefault(call.get("index", 0), [None, ""])
            fn = call.get("function") or {}
            seen[0] = fn.get("name") or seen[0]
            seen[1] = (seen[1] or "") + (fn.get("arguments") or "")
        if choice.get("finish_reason") is not None:
            self._checked(state)
        return changed

    def _checked(self, state: _Choice) -> None:
        if not state.done:
            state.done = True
            if self.plan.strict:
                self.checks.append(functools.partial(
                    tool_args.check_calls, self.request_id,
                    [(c[0], c[1]) for c in state.calls.values()], self.plan.strict))

    def end(self) -> List[str]:
        """Before ``[DONE]``: what a choice that never finished still holds (the stream was
        cut): its text as content, its calls checked."""
        out = []
        for index, state in self.choices.items():
            if state.done:
                continue
            if state.array is not None:
                calls, rest, _ = state.array.finish()
                delta: Dict[str, Any] = {}
                if calls:
                    delta["tool_calls"] = [_delta_call(state.array.calls - len(calls) + k, n, a)
                                           for k, (n, a) in enumerate(calls)]
                if rest:
                    delta["content"] = rest
                if delta and self.last is not None:
                    chunk = dict(self.last, choices=[{"index": index, "delta": delta}])
                    chunk.pop("usage", None)
                    out.append(f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n")
                for call in delta.get("tool_calls", ()):
                    state.calls[call["index"]] = [call["function"]["name"],
                                                  call["function"]["arguments"]]
            self._checked(state)
        return out


async def _stream(pieces: AsyncIterator[str], plan: Any) -> AsyncIterator[str]:
    stream = _Stream(plan)
    async for piece in pieces:
        outs = stream.line(piece)
        await _off_loop(stream.checks)
        for out in outs:
            yield out


async def _served(answer: Any, plan: Any) -> Any:
    result = await answer
    if hasattr(result, "__aiter__"):
        return _stream(result, plan)
    if type(result).__name__ == "ChatCompletionResponse":
        checks: List[Callable[[], None]] = []
        result = _full(result, plan, checks)
        await _off_loop(checks)
        return result
    return result  # an error response


def make_create_wrapper(family: Family, original: Callable[..., Any], module: types.ModuleType,
                        settings: config.Settings) -> Wrapper:
    def create_chat_completion(wrapped: Callable[..., Any], instance: Any,
                               args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        request = args[0] if args else kwargs.get("request")
        plan = plan_of(request)
        if plan is None:
            return wrapped(*args, **kwargs)
        if plan.required is not None:
            REQUIRED.add()
        return _served(wrapped(*args, **kwargs), plan)

    return create_chat_completion


__all__: List[str] = ["check_create", "make_create_wrapper", "tool_calls_needed"]

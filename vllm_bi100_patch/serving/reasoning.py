"""Reasoning output on vLLM 0.6.3, as upstream serves it from 0.7 (``--enable-reasoning
--reasoning-parser deepseek_r1``; ``qwen3`` later): the thinking a model writes before its
answer (``<think>...</think>``) is returned as ``reasoning_content`` (``delta.reasoning_content``
in streams), the answer after it as ``content``, and the tool parser reads the answer only.

One concept: splitting the thinking off the engine's output, for the servers that ask for it.

- Which servers: ``reasoning_flags`` adds upstream's two flags to ``vllm serve``'s parser;
  ``reasoning_parser`` reads them (or ``VLLM_BI100_REASONING_PARSER`` where a flag cannot be
  added) when ``init_app_state`` builds the serving classes and remembers the parser of that
  app's ``OpenAIServingChat`` (``parser_of``).  Off by default, as upstream.
- ``Split``: the text state machine, fed each output's text as it comes (whole or in deltas);
  a tag split over deltas is held back until it is whole.  ``deepseek_r1``: everything before
  ``</think>`` is thinking (a leading ``<think>`` dropped: the R1 distills' templates open it
  in the prompt), an answer without ``</think>`` is all thinking.  ``qwen3``: thinking only
  between a leading ``<think>`` and ``</think>``; an unstreamed answer without both is all
  content, as upstream's parser reads it.
- ``outputs``: the engine's outputs with the thinking taken out of their text (token ids and so
  usage unchanged), for both of 0.6.3's answer generators; what was taken is kept per choice.
- The answers: an unstreamed one gets ``reasoning_content`` on each choice's message
  (``with_reasoning``: the response re-typed as subclasses with that field, so the app's
  ``model_dump()`` writes it); a stream's chunks get it in their delta (``Chunks``).
- Guided decoding (``response_format`` json_schema/json_object, a named or ``required`` tool,
  ``guided_*``): 0.6.3's guide applies from the first token, so the model writes no thinking:
  such a request is not split (its answer is the guided text, no ``reasoning_content``).

Never imports vLLM: classes are read from the modules of the objects handed in.
"""

from __future__ import annotations

import json
import sys
from typing import Any, AsyncIterator, Callable, Dict, List, Optional, Tuple

from ..patching import code_shapes
from ..patching.factories import counter
from .reasoning_config import parser_of

START, END = "<think>", "</think>"
SPLIT = counter("reasoning_output")
STREAMED = counter("reasoning_stream")


def guided(request: Any) -> bool:
    """Whether 0.6.3 guides ``request``'s output from its first token."""
    if any(getattr(request, k, None) is not None for k in
           ("guided_json", "guided_regex", "guided_choice", "guided_grammar")):
        return True
    fmt = getattr(request, "response_format", None)
    if fmt is not None and getattr(fmt, "type", "text") != "text":
        return True
    choice = getattr(request, "tool_choice", None)
    return choice is not None and not isinstance(choice, str)


def _held(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag`` (a tag cut by a delta)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


class Split:
    """One choice's text, split into thinking and answer as it comes."""

    def __init__(self, parser: str) -> None:
        self.parser = parser
        self.state = "start"
        self.held = ""
        self.seen = ""  # everything fed (qwen3's unstreamed rule needs the whole text)

    def feed(self, text: str) -> Tuple[str, str]:
        """(thinking, answer) of ``text``, the next piece of the output."""
        self.seen += text
        buf, self.held = self.held + text, ""
        thinking, answer = "", ""
        while True:
            if self.state == "start":
                stripped = buf.lstrip()
                if stripped.startswith(START):
                    self.state, buf = "think", stripped[len(START):]
                elif START.startswith(stripped):  # empty, or a cut "<think>"
                    self.held = buf
                    return thinking, answer
                else:
                    self.state = "think" if self.parser == "deepseek_r1" else "answer"
            elif self.state == "think":
                end = buf.find(END)
                if end >= 0:
                    thinking += buf[:end]
                    self.state, buf = "answer", buf[end + len(END):]
                    continue
                k = _held(buf, END)
                thinking += buf[:len(buf) - k]
                self.held = buf[len(buf) - k:]
                return thinking, answer
            else:
                return thinking, answer + buf

    def finish(self) -> Tuple[str, str]:
        """What was held back, at the end of the output."""
        held, self.held = self.held, ""
        if self.state == "think" or (self.state == "start" and self.parser == "deepseek_r1"):
            return held, ""
        return "", held

    def whole(self, text: str) -> Tuple[Optional[str], Optional[str]]:
        """(reasoning_content, content) of a whole answer, as upstream's parser reads it."""
        thinking, answer = self.feed(text)
        more, rest = self.finish()
        if self.parser == "qwen3" and self.state != "answer":
            return None, text or None  # no closed <think>: all content (upstream's qwen3)
        return (thinking + more) or None, (answer + rest) or None


class Taken:
    """The thinking taken out of one request's outputs, per choice."""

    def __init__(self, parser: str, whole: bool) -> None:
        self.parser, self.whole = parser, whole
        self.splits: Dict[int, Split] = {}
        self.thinking: Dict[int, str] = {}   # unstreamed: the choice's reasoning_content
        self.pending: Dict[int, str] = {}    # streamed: thinking not sent yet

    async def outputs(self, results: AsyncIterator[Any]) -> AsyncIterator[Any]:
        async for res in results:
            for out in res.outputs:
                if self.whole:  # each output holds the whole text so far: read it afresh
                    thinking, answer = Split(self.parser).whole(out.text)
                    if thinking is not None:
                        self.thinking[out.index] = thinking
                    out.text = answer or ""
                    continue
                split = self.splits.setdefault(out.index, Split(self.parser))
                thinking, answer = split.feed(out.text)
                if out.finish_reason is not None:
                    more, rest = split.finish()
                    thinking, answer = thinking + more, answer + rest
                if thinking:
                    self.pending[out.index] = self.pending.get(out.index, "") + thinking
                out.text = answer
            yield res

    def take(self, index: int) -> str:
        return self.pending.pop(index, "")


# --- the unstreamed answer ---------------------------------------------------------------

_typed: Dict[str, Any] = {}


def _response_type(response: Any) -> Any:
    """``ChatCompletionResponse`` re-typed so that its messages have ``reasoning_content``."""
    protocol = sys.modules[type(response).__module__]
    if protocol.__name__ not in _typed:
        from pydantic import create_model

        message = create_model("ChatMessage", __base__=protocol.ChatMessage,
                               reasoning_content=(Optional[str], None))
        choice = create_model("ChatCompletionResponseChoice",
                              __base__=protocol.ChatCompletionResponseChoice,
                              message=(message, ...))
        whole = create_model("ChatCompletionResponse", __base__=protocol.ChatCompletionResponse,
                             choices=(List[choice], ...))  # type: ignore[valid-type]
        _typed[protocol.__name__] = (whole, choice, message)
    return _typed[protocol.__name__]


def with_reasoning(response: Any, taken: Taken) -> Any:
    """``response`` with each choice's thinking as its message's ``reasoning_content``."""
    if not taken.thinking or not hasattr(response, "choices"):
        return response
    whole, choice_type, message_type = _response_type(response)
    choices = []
    for choice in response.choices:
        data = choice.model_dump(exclude={"message"})
        fields = choice.message.model_dump()
        thinking = taken.thinking.get(choice.index)
        if thinking is not None and fields.get("content") == "":
            fields["content"] = None  # all thinking: no answer (upstream's content None)
        message = message_type(**fields, reasoning_content=thinking)
        choices.append(choice_type(**data, message=message))
    SPLIT.add()
    return whole(**response.model_dump(exclude={"choices"}), choices=choices)


FULL_PARAMS = ("self", "request", "result_generator", "request_id", "conversation", "tokenizer",
               "request_metadata")
FULL_KNOWN = {"1fa5c91dcc2ff517": "vLLM 0.6.3.post1",
              "267c86d716d5ed2a": "CoreX 3.2.3's vendored tree"}


def check_full(func: Callable[..., Any]) -> Optional[str]:
    return code_shapes.shape_check(func, "OpenAIServingChat.chat_completion_full_generator",
                                   FULL_PARAMS, FULL_KNOWN)


def make_full_wrapper(family: Any, original: Callable[..., Any], module: Any,
                      settings: Any) -> Callable[..., Any]:
    def chat_completion_full_generator(wrapped: Callable[..., Any], instance: Any,
                                       args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        parser = parser_of(instance)
        request = args[0] if args else kwargs.get("request")
        if parser is None or guided(request):
            return wrapped(*args, **kwargs)
        taken = Taken(parser, whole=True)
        if len(args) > 1:
            args = (args[0], taken.outputs(args[1])) + tuple(args[2:])
        else:
            kwargs = dict(kwargs, result_generator=taken.outputs(kwargs["result_generator"]))

        async def answer() -> Any:
            return with_reasoning(await wrapped(*args, **kwargs), taken)

        return answer()

    return chat_completion_full_generator


# --- the stream --------------------------------------------------------------------------


class Chunks:
    """A stream's chunks with the thinking taken from its outputs (``Taken``) in their deltas:
    in the next chunk of the same choice (the role chunk left as it is), or in chunks of their
    own before the usage chunk and ``[DONE]``."""

    def __init__(self, taken: Taken) -> None:
        self.taken = taken
        self.head: Optional[Dict[str, Any]] = None
        self.sent = False

    def line(self, data: str) -> str:
        if not data.startswith("data: {") or not self.taken.pending:
            if self.head is None and data.startswith('data: {"id"'):
                self._head(json.loads(data[len("data: "):]))
            return data
        chunk = json.loads(data[len("data: "):])
        self._head(chunk)
        changed = False
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta")
            if not isinstance(delta, dict) or "role" in delta:
                continue
            thinking = self.taken.take(choice.get("index", 0))
            if thinking:
                delta["reasoning_content"] = thinking
                if delta.get("content") == "":
                    del delta["content"]
                changed = True
        if not changed:
            return data
        self._count()
        return f"data: {json.dumps(chunk, ensure_ascii=False, separators=(',', ':'))}\n\n"

    def _head(self, chunk: Dict[str, Any]) -> None:
        if self.head is None and "id" in chunk:
            self.head = {k: chunk.get(k) for k in ("id", "object", "created", "model")}

    def _count(self) -> None:
        if not self.sent:
            self.sent = True
            STREAMED.add()

    def rest(self) -> str:
        """Chunks of the thinking not sent yet (before the usage chunk or ``[DONE]``)."""
        if self.head is None or not self.taken.pending:
            return ""
        out = []
        for index in sorted(self.taken.pending):
            thinking = self.taken.take(index)
            chunk = dict(self.head, choices=[{"index": index, "delta": {
                "reasoning_content": thinking}, "logprobs": None, "finish_reason": None}])
            out.append(f"data: {json.dumps(chunk, ensure_ascii=False, separators=(',', ':'))}"
                       "\n\n")
        self._count()
        return "".join(out)


def stream_taken(instance: Any, request: Any) -> Optional[Taken]:
    """The ``Taken`` of a streamed request whose server has a reasoning parser (None: not
    split)."""
    parser = parser_of(instance)
    if parser is None or guided(request):
        return None
    return Taken(parser, whole=False)


__all__ = ["Chunks", "Split", "Taken", "check_full", "guided", "make_full_wrapper", "stream_taken",
           "with_reasoning"]

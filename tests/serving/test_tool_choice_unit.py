"""The tool fields of today's clients and agent frameworks without vLLM (docs/serving-compat.md):
``tool_choice`` objects, "required" as one guided schema (the shape of vLLM #13483), ``strict``,
and row ``chat_tool_calls``'s reading of the answers (``tool_args.CallArray``, the whole answer
and the stream, as vLLM 0.6.3 builds them).  Through vLLM 0.6.3's own server app and the
``openai`` client: tests/serving/test_serving_tools.py."""

from __future__ import annotations

import json
import sys
import types

import pytest

from vllm_bi100_patch.activation import config
from vllm_bi100_patch.serving import chat_compat, tool_args, tool_calls, tool_choice
from vllm_bi100_patch.serving.refusal import RequestRefused

FIELDS = frozenset({"messages", "model", "max_tokens", "tools", "tool_choice", "logprobs",
                    "top_logprobs", "response_format", "stream", "stream_options",
                    "guided_json", "guided_regex", "n"})
KEYS = frozenset({"role", "content", "name", "tool_calls", "tool_call_id"})
USER = {"role": "user", "content": "hi"}
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def tool(name="get_weather", params=WEATHER, **extra):
    return {"type": "function", "function": dict({"name": name, "parameters": params}, **extra)}


def rewrite(serve_required=True, **body):
    return chat_compat.rewrite(dict({"model": "m", "messages": [USER]}, **body), FIELDS, KEYS,
                               serve_required)


def refused(**body):
    with pytest.raises(RequestRefused) as err:
        rewrite(**body)
    return str(err.value)


NAMED = {"type": "function", "function": {"name": "get_weather"}}
TWO = [tool(), tool("final_result", {"type": "object", "properties": {"a": {"type": "integer"}}})]


def test_tool_choice_objects_map_onto_the_forms_063_knows():
    # the Responses API's named form
    body, _, plan = rewrite(tools=TWO, tool_choice={"type": "function", "name": "get_weather"})
    assert body["tool_choice"] == NAMED and plan is None
    # allowed_tools, chat form and Responses form, both modes
    refs = [{"type": "function", "function": {"name": "final_result"}}]
    body, _, plan = rewrite(tools=TWO, tool_choice={"type": "allowed_tools", "allowed_tools": {
        "mode": "auto", "tools": refs}})
    assert body["tool_choice"] == "auto" and body["tools"] == [TWO[1]] and plan is None
    body, _, plan = rewrite(tools=TWO, tool_choice={"type": "allowed_tools", "mode": "required",
                                                    "tools": [{"type": "function",
                                                               "name": "get_weather"}]})
    assert body["tools"] == [TWO[0]] and plan.required == ("get_weather",)
    assert body["guided_json"] == tool_choice.required_schema([TWO[0]])


@pytest.mark.parametrize("choice, message", [
    ({}, "`tool_choice` {} is not a tool choice this server serves"),
    ({"type": "custom", "name": "x"}, "`tool_choice` {'type': 'custom', 'name': 'x'} is not"),
    ({"type": "function"}, "is not a tool choice this server serves"),
    ({"type": "function", "function": "get_weather"}, "`tool_choice.function` must name a tool"),
    ({"type": "function", "function": {}}, "`tool_choice.function` must name a tool"),
    ({"type": "function", "name": "get_weather", "x": 1}, "`tool_choice.x` is not a field"),
    ({"type": "allowed_tools", "allowed_tools": {"mode": "any", "tools": []}},
     "`tool_choice.allowed_tools.mode` 'any'"),
    ({"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": []}},
     "must list at least one tool"),
    ({"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": ["get_weather"]}},
     "`tool_choice.allowed_tools.tools[0]` 'get_weather' is not a reference"),
    ({"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [
        {"type": "function", "name": "nope"}]}}, "names 'nope', which is not in `tools`"),
    ("any", "`tool_choice` 'any' is not a tool choice"),
    (3, "`tool_choice` 3 is not a tool choice"),
])
def test_every_other_tool_choice_is_a_400_naming_it(choice, message):
    """0.6.3 answered `{}` and the other objects with a 500 (KeyError: 'function')."""
    assert message in refused(tools=TWO, tool_choice=choice)


@pytest.mark.parametrize("tools, message", [
    ({"get_weather": {}}, "`tools` must be a list of tools, not a dict"),
    (["get_weather"], "`tools[0]` must be a function tool with a name"),
    ([{"type": "function"}], "`tools[0]` must be a function tool with a name"),
    ([{"type": "function", "function": {"name": ""}}], "`tools[0]` must be a function tool"),
])
def test_malformed_tools_are_a_400_naming_them(tools, message):
    """0.6.3's check_tool_usage indexes every tool beside a named tool_choice (a 500)."""
    assert message in refused(tools=tools, tool_choice=NAMED)


def test_strict_true_false_or_null_is_served_any_other_value_refused():
    """strict: true under automatic tool choice is served as upstream does (#10463), its
    schema kept in the plan; strict: 1 was dropped silently while true was refused."""
    for choice in (None, "auto"):
        extra = {} if choice is None else {"tool_choice": choice}
        body, _, plan = rewrite(tools=[tool(strict=True), tool("f", {}, strict=False)], **extra)
        assert body["tools"] == [tool(), tool("f", {})]
        assert plan.required is None and plan.strict == {"get_weather": WEATHER}
    body, _, plan = rewrite(tools=[tool(strict=None)], tool_choice=NAMED)
    assert body["tools"] == [tool()] and plan is None
    assert rewrite(tools=[tool("f", None, strict=True)])[2].strict == {"f": {"type": "object"}}
    for value in (1, 0, "true", 1.0, {}):
        assert refused(tools=[tool(strict=value)]) == (
            f"`tools[0].function.strict` must be true or false, not {ascii(value)}")


def test_required_is_one_guided_schema_of_upstreams_shape():
    defs = {"Unit": {"enum": ["c", "f"]}}
    with_defs = tool("temp", {"type": "object", "$defs": defs,
                              "properties": {"unit": {"$ref": "#/$defs/Unit"}}})
    body, changed, plan = rewrite(tools=TWO + [with_defs, tool("noargs", None)],
                                  tool_choice="required")
    assert changed and plan.required == ("get_weather", "final_result", "temp", "noargs")
    assert body["tool_choice"] == "auto"  # for 0.6.3's validators; attach() says "none"
    assert body["guided_json"] == {
        "type": "array", "minItems": 1,
        "items": {"type": "object", "anyOf": [
            {"properties": {"name": {"type": "string", "enum": ["get_weather"]},
                            "parameters": WEATHER}, "required": ["name", "parameters"]},
            {"properties": {"name": {"type": "string", "enum": ["final_result"]},
                            "parameters": TWO[1]["function"]["parameters"]},
             "required": ["name", "parameters"]},
            {"properties": {"name": {"type": "string", "enum": ["temp"]},
                            "parameters": {"type": "object", "$defs": defs, "properties": {
                                "unit": {"$ref": "#/items/anyOf/2/properties/parameters/$defs/"
                                                 "Unit"}}}},
             "required": ["name", "parameters"]},
            {"properties": {"name": {"type": "string", "enum": ["noargs"]},
                            "parameters": {"type": "object", "properties": {}}},
             "required": ["name", "parameters"]}]}}
    # the request's tool is unchanged
    assert with_defs["function"]["parameters"]["properties"]["unit"] == {"$ref": "#/$defs/Unit"}
    # two tools defining one name differently: each keeps its own (the shim before: a 400)
    other = tool("other", {"$defs": {"Unit": {"enum": ["k"]}}, "properties": {
        "u": {"$ref": "#/$defs/Unit"}}})
    body, _, _ = rewrite(tools=[with_defs, other], tool_choice="required")
    assert body["guided_json"]["items"]["anyOf"][1]["properties"]["parameters"]["properties"][
        "u"] == {"$ref": "#/items/anyOf/1/properties/parameters/$defs/Unit"}
    request = types.SimpleNamespace(tool_choice="auto")
    plan.attach(request)
    assert request.tool_choice == "none" and request._vllm_bi100_plan is plan


def test_required_without_parallel_calls_allows_one_call():
    body, _, _ = rewrite(tools=TWO, tool_choice="required", parallel_tool_calls=False)
    assert body["guided_json"]["maxItems"] == 1 and body["guided_json"]["minItems"] == 1
    assert "maxItems" not in rewrite(tools=TWO, tool_choice="required",
                                     parallel_tool_calls=True)[0]["guided_json"]


def test_required_edge_cases():
    assert rewrite(tools=[], tool_choice="required")[0] == {"model": "m", "messages": [USER]}
    assert refused(tool_choice="required") == '`tool_choice: "required"` needs `tools`'
    assert "row `chat_tool_calls` of vllm-bi100-patch is off" in refused(
        tools=TWO, tool_choice="required", serve_required=False)
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": WEATHER}}
    assert refused(tools=TWO, tool_choice="required", response_format=fmt).startswith(
        "`response_format` json_schema and `tool_choice: \"required\"` both constrain")
    assert refused(tools=TWO, tool_choice="required", guided_regex="a+").startswith(
        "`guided_regex` and `tool_choice: \"required\"` both constrain")


def test_a_forced_tool_beside_a_schema_is_refused_by_name():
    """Defect 10: 0.6.3 let the named tool's parameters replace the json_schema silently."""
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    assert refused(tools=TWO, tool_choice=NAMED, response_format=fmt).startswith(
        "`response_format` json_schema and a named `tool_choice` both constrain the answer")
    assert refused(tools=TWO, tool_choice=NAMED, guided_json={"type": "object"}).startswith(
        "`guided_json` and a named `tool_choice` both constrain")
    body, _, _ = rewrite(tools=TWO, tool_choice="auto", response_format=fmt)
    assert body["guided_json"] == {"type": "object"}  # auto: the schema as 0.6.4 applies it


CALLS = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, ' \
        '{"name": "final_result", "parameters": {"a": 1}}]'
#: What is left of CALLS cut after 70 characters once its first call is read.
CUT = CALLS[CALLS.index("}},") + 2:70]


def test_the_call_array_is_read_as_it_grows():
    array = tool_args.CallArray(("get_weather", "final_result"))
    got = []
    for k in range(0, len(CALLS), 7):
        got.append(array.feed(CALLS[k:k + 7]))
    flat = [c for part in got for c in part]
    assert flat == [("get_weather", '{"city": "Paris"}'), ("final_result", '{"a": 1}')]
    first = next(i for i, part in enumerate(got) if part)
    assert first < len(got) - 2  # the first call went out before the answer was complete
    assert array.finish() == ([], "", True)


@pytest.mark.parametrize("text, calls, rest, complete", [
    (CALLS, 2, "", True),
    (CALLS[:70], 1, CUT, False),             # cut by max_tokens after one call
    ("[]", 0, "[]", False),                           # minItems 1
    ("hello", 0, "hello", False),                     # not guided at all
    ('[{"name": "nope", "parameters": {}}]', 0, '[{"name": "nope", "parameters": {}}]', False),
    ('[{"name": "final_result", "parameters": {}}] x', 1, " x", False),
    ("[" + "[" * 5000, 0, "[" + "[" * 5000, False),  # nested too deep for the parser
])
def test_what_is_no_complete_call_stays_text(text, calls, rest, complete):
    array = tool_args.CallArray(("get_weather", "final_result"))
    got = array.feed(text)
    more, left, done = array.finish()
    assert (len(got + more), left, done) == (calls, rest, complete)


def _protocol():
    """A stand-in of the response classes 0.6.3's protocol module defines."""
    mod = types.ModuleType("bi100_fake_protocol")

    class Obj(types.SimpleNamespace):
        pass

    class ChatCompletionResponse(Obj):
        pass

    mod.ChatCompletionResponse = ChatCompletionResponse
    mod.ToolCall = lambda id, function: Obj(id=id, type="function", function=function)
    mod.FunctionCall = Obj
    ChatCompletionResponse.__module__ = mod.__name__
    return mod, Obj


def _response(text, finish="stop"):
    mod, obj = _protocol()
    sys.modules[mod.__name__] = mod
    message = obj(role="assistant", content=text, tool_calls=[])
    return mod.ChatCompletionResponse(id="chat-1", choices=[obj(index=0, message=message,
                                                                finish_reason=finish)])


def test_the_whole_answer_to_required_becomes_tool_calls():
    plan = tool_choice.ToolPlan(("get_weather", "final_result"), {})
    out = tool_calls._full(_response(CALLS), plan, [])
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == [
        ("get_weather", '{"city": "Paris"}'), ("final_result", '{"a": 1}')]
    assert all(c.id.startswith("chatcmpl-tool-") for c in choice.message.tool_calls)
    cut = tool_calls._full(_response(CALLS[:70], "length"), plan, []).choices[0]
    assert cut.finish_reason == "length" and cut.message.content == CUT
    assert len(cut.message.tool_calls) == 1


def _chunks(pieces, finish="stop", usage=False):
    """The lines 0.6.3's stream generator writes for tool_choice "none" (compact JSON)."""
    def line(obj):
        return "data: " + json.dumps(obj, separators=(",", ":")) + "\n\n"
    out = [line({"id": "chat-1", "object": "chat.completion.chunk", "choices": [
        {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]})]
    for k, piece in enumerate(pieces):
        last = k == len(pieces) - 1
        out.append(line({"id": "chat-1", "object": "chat.completion.chunk", "choices": [
            {"index": 0, "delta": {"content": piece}, "finish_reason": finish if last else None}]}))
    if usage:
        out.append(line({"id": "chat-1", "choices": [], "usage": {"total_tokens": 9}}))
    return out + ["data: [DONE]\n\n"]


def _read(lines):
    chunks = [json.loads(ln[6:]) for ln in lines if ln.startswith("data: {")]
    calls = [c for ch in chunks for choice in ch["choices"]
             for c in choice["delta"].get("tool_calls", [])]
    content = "".join(choice["delta"].get("content") or "" for ch in chunks
                      for choice in ch["choices"])
    finish = [choice["finish_reason"] for ch in chunks for choice in ch["choices"]
              if choice.get("finish_reason")]
    return chunks, calls, content, finish


def _stream(plan, lines):
    stream = tool_calls._Stream(plan)
    return [out for ln in lines for out in stream.line(ln)]


def test_the_streamed_answer_to_required_becomes_tool_call_deltas():
    plan = tool_choice.ToolPlan(("get_weather", "final_result"), {})
    pieces = [CALLS[k:k + 9] for k in range(0, len(CALLS), 9)]
    lines = _stream(plan, _chunks(pieces, usage=True))
    chunks, calls, content, finish = _read(lines)
    assert [(c["index"], c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        (0, "get_weather", '{"city": "Paris"}'), (1, "final_result", '{"a": 1}')]
    assert all(c["type"] == "function" and c["id"].startswith("chatcmpl-tool-") for c in calls)
    assert content == "" and finish == ["tool_calls"] and lines[-1] == "data: [DONE]\n\n"
    assert chunks[-1]["usage"] == {"total_tokens": 9}
    assert len(chunks) < len(pieces)  # chunks that completed no call are left out
    # cut by max_tokens: the complete call, then the rest as content, finish "length"
    lines = _stream(plan, _chunks([CALLS[:40], CALLS[40:70]], finish="length"))
    _, calls, content, finish = _read(lines)
    assert len(calls) == 1 and content == CUT and finish == ["length"]
    # a finish chunk without content (delta {}): the calls still go out with it
    lines = _chunks([CALLS[:40], CALLS[40:]], finish=None)[:-1]
    lines.append("data: " + json.dumps({"id": "chat-1", "choices": [
        {"index": 0, "delta": {}, "finish_reason": "stop"}]}) + "\n\n")
    _, calls, content, finish = _read(_stream(plan, lines + ["data: [DONE]\n\n"]))
    assert len(calls) == 2 and content == "" and finish == ["tool_calls"]
    # a stream cut before any finish_reason: what it held goes out before [DONE]
    lines = _stream(plan, _chunks([CALLS[:40], CALLS[40:70]])[:-2] + ["data: [DONE]\n\n"])
    _, calls, content, finish = _read(lines)
    assert len(calls) == 0 and content == CALLS[:40] and finish == []


def test_strict_plans_pass_the_stream_through_unchanged():
    plan = tool_choice.ToolPlan(None, {"get_weather": WEATHER})
    lines = _chunks(["hello", " world"])
    assert _stream(plan, lines) == lines


def test_the_calls_row_is_not_needed_where_the_chat_row_is_disabled():
    off = config.load({config.MODE: "1", config.DISABLE: "chat_request_compat"})
    assert "row chat_request_compat is disabled" in tool_calls.tool_calls_needed(
        types.ModuleType("m"), off)
    assert chat_compat.tool_calls_live() is False  # no serving_chat here


def test_strict_checks_run_off_the_event_loop(monkeypatch):
    """Issue 39: a strict check may take up to its time budget; it runs in the check threads,
    never on the event loop that serves every other request (whole answers and streams)."""
    import asyncio
    import threading

    threads = []
    monkeypatch.setattr(tool_args, "check_calls",
                        lambda *a: threads.append(threading.current_thread().name))
    plan = tool_choice.ToolPlan(("get_weather", "final_result"), {"get_weather": WEATHER})

    async def whole():
        async def answer():
            return _response(CALLS)
        return await tool_calls._served(answer(), plan)

    async def streamed():
        async def pieces():
            for line in _chunks([CALLS[:40], CALLS[40:]]):
                yield line
        async def answer():
            return pieces()
        return [line async for line in await tool_calls._served(answer(), plan)]

    out = asyncio.run(whole())
    assert out.choices[0].finish_reason == "tool_calls"
    lines = asyncio.run(streamed())
    assert lines[-1] == "data: [DONE]\n\n"
    assert len(threads) == 2 and all(t.startswith("vllm-bi100-strict-check") for t in threads)

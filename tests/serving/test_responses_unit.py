"""The Responses API without vLLM (docs/serving-compat.md, "The Responses API"): a request read
as a chat completion (``responses_request.chat_body``: each field mapped, echoed, ignored or
refused by name) and a chat answer written as a response object or event stream
(``responses_answer``).  Through vLLM 0.6.3's own app and the clients:
tests/serving/test_responses.py, tests/serving/frameworks."""

from __future__ import annotations

import json
import os

import pytest
from hypothesis import given, settings, strategies as st

from vllm_bi100_patch.serving import responses_answer as answer
from vllm_bi100_patch.serving import responses_request as rr
from vllm_bi100_patch.serving.refusal import RequestRefused

TOOL = {"type": "function", "name": "get_weather", "description": "d",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        "strict": True}


def body(**fields):
    return rr.chat_body(dict({"model": "m", "input": "hi"}, **fields))[0]


def refused(**fields):
    with pytest.raises(RequestRefused) as err:
        rr.chat_body(dict({"model": "m", "input": "hi"}, **fields))
    assert isinstance(err.value, ValueError)
    return str(err.value)


def test_a_string_input_with_instructions_is_a_system_and_a_user_message():
    got = body(instructions="be brief", max_output_tokens=7, temperature=0.2, top_p=0.9,
               user="u1")
    assert got == {"model": "m", "messages": [{"role": "system", "content": "be brief"},
                                              {"role": "user", "content": "hi"}],
                   "max_tokens": 7, "temperature": 0.2, "top_p": 0.9, "user": "u1"}


def test_items_become_messages_in_order():
    items = [{"role": "developer", "content": "rules"},
             {"type": "message", "role": "user",
              "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
             {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": None},
             {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
              "content": [{"type": "output_text", "text": "let me look", "annotations": []}]},
             {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "f",
              "arguments": "{\"x\": 1}"},
             {"type": "function_call", "call_id": "call_2", "name": "g", "arguments": {"y": 2}},
             {"type": "function_call_output", "call_id": "call_1", "output": "one"},
             {"type": "function_call_output", "call_id": "call_2",
              "output": [{"type": "input_text", "text": "two"}]},
             {"role": "user", "content": [{"type": "input_image", "image_url": "http://x/i.png"}]}]
    got, echo = rr.chat_body({"model": "m", "input": items})
    assert got["messages"] == [
        {"role": "developer", "content": "rules"},
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": "let me look", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}},
            {"id": "call_2", "type": "function", "function": {"name": "g", "arguments": "{\"y\": 2}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "one"},
        {"role": "tool", "tool_call_id": "call_2", "content": "two"},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/i.png"}}]}]
    assert echo["reasoning_items_dropped"] == 1


def test_a_call_after_a_tool_result_opens_a_new_assistant_message():
    items = [{"role": "user", "content": "q"},
             {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "c1", "output": "r"},
             {"type": "function_call", "call_id": "c2", "name": "f", "arguments": "{}"}]
    roles = [m["role"] for m in rr.chat_body({"model": "m", "input": items})[0]["messages"]]
    assert roles == ["user", "assistant", "tool", "assistant"]


def test_function_tools_tool_choice_and_formats_map_to_the_chat_fields():
    got = body(tools=[TOOL], tool_choice={"type": "function", "name": "get_weather"},
               parallel_tool_calls=False,
               text={"format": {"type": "json_schema", "name": "W", "strict": True,
                                "schema": {"type": "object"}}})
    assert got["tools"] == [{"type": "function", "function": {
        "name": "get_weather", "description": "d", "parameters": TOOL["parameters"],
        "strict": True}}]
    # the chat row maps the Responses form of a named tool (chat_compat)
    assert got["tool_choice"] == {"type": "function", "name": "get_weather"}
    assert got["parallel_tool_calls"] is False
    assert got["response_format"] == {"type": "json_schema", "json_schema": {
        "name": "W", "strict": True, "schema": {"type": "object"}}}
    assert body(text={"format": {"type": "json_object"}})["response_format"] == {
        "type": "json_object"}
    assert "response_format" not in body(text={"format": {"type": "text"}, "verbosity": "medium"})
    assert "tool_choice" not in body(tool_choice="auto")  # no tools: nothing to choose


def test_a_stream_asks_for_usage_and_harmless_fields_are_accepted():
    got = body(stream=True, store=True, metadata={"a": "b"}, prompt_cache_key="k",
               safety_identifier="s", service_tier="auto", truncation="disabled",
               include=["reasoning.encrypted_content"], reasoning={"summary": "auto"},
               stream_options={"include_obfuscation": False})
    assert got["stream"] is True and got["stream_options"] == {"include_usage": True}
    for key in ("store", "metadata", "prompt_cache_key", "include", "reasoning"):
        assert key not in got


@pytest.mark.parametrize("fields, named", [
    ({"previous_response_id": "resp_1"}, "`previous_response_id` is not served"),
    ({"conversation": "conv_1"}, "`conversation` is not served"),
    ({"background": True}, "`background` is not served"),
    ({"prompt": {"id": "p"}}, "`prompt` is not served"),
    ({"tools": [{"type": "web_search"}], "tool_choice": {"type": "web_search"}},
     "tool_choice of type 'web_search' is not served"),
    ({"tools": [{"type": "custom", "name": "apply_patch"}]}, "tools[0] of type 'custom'"),
    ({"tools": [TOOL, {"type": "namespace", "name": "ns", "tools": [TOOL]}]},
     "tools named 'get_weather' more than once"),
    ({"input": [{"type": "item_reference", "id": "msg_unknown"}]},
     "input[0] (an item_reference to 'msg_unknown') is not served: this server does not hold"),
    ({"input": [{"type": "local_shell_call", "id": "x"}]}, "input[0] of type 'local_shell_call'"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
     "input[0].content[0] of type 'input_file'"),
    ({"truncation": "auto"}, "truncation 'auto' is not served"),
    ({"include": ["message.output_text.logprobs"]}, "log probabilities"),
    ({"reasoning": {"effort": "high"}}, "reasoning.'effort' 'high' is not served"),
    ({"text": {"verbosity": "low"}}, "text.verbosity 'low'"),
    ({"text": {"format": {"type": "grammar"}}}, "text.format of type 'grammar'"),
    ({"top_logprobs": 3}, "`top_logprobs` is not served"),
    ({"frobnicate": 1}, "unknown field 'frobnicate'"),
    ({"input": 3}, "`input` must be a string or a list"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role 'tool'"),
])
def test_what_cannot_be_served_is_refused_by_name(fields, named):
    assert named in refused(**fields)


def test_hosted_tools_are_left_out_and_namespaced_ones_flattened():
    """Codex offers ``web_search`` and a ``namespace`` of function tools at its defaults."""
    space = {"type": "namespace", "name": "multi_agent_v1", "description": "d", "tools": [
        {"type": "function", "name": "spawn_agent", "parameters": {"type": "object"}}]}
    got, echo = rr.chat_body({"model": "m", "input": "hi", "tools": [
        TOOL, {"type": "web_search", "external_web_access": False}, space]})
    assert [t["function"]["name"] for t in got["tools"]] == ["get_weather", "spawn_agent"]
    assert echo["namespaces"] == {"spawn_agent": "multi_agent_v1"}
    assert echo["hosted_tools_dropped"] == ["web_search"]
    only, echo = rr.chat_body({"model": "m", "input": "hi", "tool_choice": "auto",
                               "tools": [{"type": "web_search"}]})
    assert "tools" not in only and "tool_choice" not in only
    chat = {"model": "m", "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
        "content": None, "tool_calls": [{"id": "call_1", "function": {
            "name": "spawn_agent", "arguments": "{}"}}]}}]}
    item = answer.response(chat, "resp_1", {"namespaces": echo["namespaces"] or {
        "spawn_agent": "multi_agent_v1"}})["output"][0]
    assert item["namespace"] == "multi_agent_v1" and item["name"] == "spawn_agent"


def test_an_item_reference_is_the_item_this_server_answered():
    from vllm_bi100_patch.serving import responses_store

    responses_store.clear()
    kept = answer.message_item("the earlier answer")
    responses_store.keep([kept, answer.call_item("call_1", "f", "{}")])
    got = body(input=[{"role": "user", "content": "q"}, {"type": "item_reference",
                                                         "id": kept["id"]},
                      {"role": "user", "content": "again"}])
    assert got["messages"][1] == {"role": "assistant", "content": "the earlier answer"}
    assert responses_store.size()[0] == 2
    responses_store.keep([answer.message_item("late")], now=10**9)  # an hour later: expired
    assert responses_store.find(kept["id"]) is None and responses_store.size()[0] == 1
    responses_store.clear()


def test_the_item_store_is_bounded(monkeypatch):
    from vllm_bi100_patch.serving import responses_store

    responses_store.clear()
    monkeypatch.setattr(responses_store, "MAX_ITEMS", 3)
    items = [answer.message_item(str(i)) for i in range(5)]
    responses_store.keep(items)
    assert responses_store.size()[0] == 3 and responses_store.find(items[0]["id"]) is None
    assert responses_store.find(items[4]["id"])["content"][0]["text"] == "4"
    monkeypatch.setattr(responses_store, "MAX_BYTES", 1000)
    responses_store.keep([answer.message_item("x" * 600) for _ in range(2)])
    assert responses_store.size()[1] <= 1000
    responses_store.clear()


def test_without_input_is_refused():
    with pytest.raises(RequestRefused, match="`input` is required"):
        rr.chat_body({"model": "m"})


# --- the answer ----------------------------------------------------------------------------

CHAT = {"id": "chatcmpl-1", "model": "m", "created": 5, "choices": [{
    "index": 0, "finish_reason": "tool_calls", "message": {
        "role": "assistant", "content": "looking", "reasoning_content": "hmm",
        "tool_calls": [{"id": "call_9", "type": "function",
                        "function": {"name": "f", "arguments": "{\"a\": 1}"}}]}}],
    "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}}


def test_a_whole_answer_is_a_response_object_with_items_in_order():
    got = answer.response(CHAT, "resp_1", {"metadata": {"k": "v"}, "max_output_tokens": 9})
    assert got["id"] == "resp_1" and got["object"] == "response" and got["status"] == "completed"
    assert [i["type"] for i in got["output"]] == ["reasoning", "message", "function_call"]
    assert got["output"][0]["content"] == [{"type": "reasoning_text", "text": "hmm"}]
    assert got["output"][1]["content"][0]["text"] == "looking"
    call = got["output"][2]
    assert (call["call_id"], call["name"], call["arguments"]) == ("call_9", "f", "{\"a\": 1}")
    assert got["usage"]["input_tokens"] == 3 and got["usage"]["output_tokens"] == 4 and \
        got["usage"]["total_tokens"] == 7
    assert got["store"] is False and got["metadata"] == {"k": "v"} and \
        got["max_output_tokens"] == 9 and got["incomplete_details"] is None


def test_an_answer_cut_by_max_output_tokens_is_incomplete():
    chat = json.loads(json.dumps(CHAT))
    chat["choices"][0]["finish_reason"] = "length"
    got = answer.response(chat, "resp_1", {})
    assert got["status"] == "incomplete" and got["incomplete_details"] == {
        "reason": "max_output_tokens"}


def _events(chunks):
    events = answer.Events("resp_1", "m", {})
    out = list(events.start())
    for chunk in chunks:
        out += list(events.feed(chunk))
    out += list(events.end())
    parsed = []
    for text in out:
        head, data = text.split("\n", 1)
        payload = json.loads(data[len("data: "):])
        assert head == "event: " + payload["type"] and text.endswith("\n\n")
        parsed.append(payload)
    return parsed


def _chunk(delta=None, finish=None, usage=None):
    return {"id": "c", "model": "m", "choices": [] if delta is None and finish is None else [
        {"index": 0, "delta": delta or {}, "finish_reason": finish}], "usage": usage}


def test_a_stream_follows_openais_event_sequence():
    chunks = [_chunk({"role": "assistant", "content": ""}),
              _chunk({"reasoning_content": "th"}), _chunk({"reasoning_content": "ink"}),
              _chunk({"content": "an"}), _chunk({"content": "swer"}),
              _chunk({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                      "function": {"name": "f", "arguments": ""}}]}),
              _chunk({"tool_calls": [{"index": 0, "function": {"arguments": "{\"a\""}}]}),
              _chunk({"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}),
              _chunk({"tool_calls": [{"index": 1, "id": "call_2", "type": "function",
                                      "function": {"name": "g", "arguments": "{}"}}]}),
              _chunk({}, finish="tool_calls"),
              _chunk(usage={"prompt_tokens": 2, "completion_tokens": 5, "total_tokens": 7})]
    events = _events(chunks)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    assert kinds == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.reasoning_text.delta",
        "response.reasoning_text.delta", "response.reasoning_text.done",
        "response.output_item.done",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed"]
    final = events[-1]["response"]
    assert final["status"] == "completed" and final["usage"]["total_tokens"] == 7
    assert [(i["type"], i.get("arguments")) for i in final["output"]] == [
        ("reasoning", None), ("message", None), ("function_call", "{\"a\": 1}"),
        ("function_call", "{}")]
    assert final["output"][1]["content"][0]["text"] == "answer"
    assert all(i["status"] == "completed" for i in final["output"])
    assert events[2]["item"]["content"] == [] and events[0]["response"]["status"] == "in_progress"
    done = [e for e in events if e["type"] == "response.output_item.done"]
    assert [e["output_index"] for e in done] == [0, 1, 2, 3]


def test_a_cut_stream_ends_incomplete_and_an_error_chunk_fails_it():
    events = _events([_chunk({"content": "a"}), _chunk({}, finish="length")])
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    failed = _events([_chunk({"content": "a"}), {"error": {"message": "boom", "type": "E"}}])
    assert [e["type"] for e in failed[-2:]] == ["error", "response.failed"]
    assert failed[-1]["response"]["error"] == {"code": "E", "message": "boom"}


@settings(max_examples=60, deadline=None)
@given(st.lists(st.text(min_size=1, max_size=5), min_size=1, max_size=8))
def test_the_streamed_text_is_the_sum_of_its_deltas(pieces):
    events = _events([_chunk({"content": p}) for p in pieces] + [_chunk({}, finish="stop")])
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == "".join(pieces)
    assert events[-1]["response"]["output"][0]["content"][0]["text"] == text


WORDS = st.sampled_from(["message", "function_call", "function_call_output", "reasoning",
                         "item_reference", "input_text", "output_text", "input_image", "user",
                         "assistant", "developer", "system", "function", "namespace",
                         "web_search", "json_schema", "json_object", "text", "auto", "none",
                         "required", "medium", "disabled"])
JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False)
                    | st.text(max_size=8) | WORDS,
                    lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.sampled_from(
                        ["type", "role", "content", "text", "name", "call_id", "arguments",
                         "output", "id", "tools", "format", "parameters", "x"]), inner,
                        max_size=4), max_leaves=20)
FIELDS = sorted(rr.MAPPED | rr.ECHOED | rr.IGNORED | set(rr.REFUSED)) + ["bogus"]


@settings(max_examples=400, deadline=None)
@given(st.dictionaries(st.sampled_from(FIELDS), JSON, max_size=6))
def test_any_body_is_mapped_or_refused_by_name(data):
    """Fuzz: whatever a client sends, the mapping answers a chat body or a 400 naming what it
    cannot serve; nothing else escapes (no TypeError, KeyError, ...)."""
    try:
        chat, echo = rr.chat_body(data)
    except RequestRefused as exc:
        assert str(exc).startswith("/v1/responses: ")
        return
    assert isinstance(chat["messages"], list) and chat["messages"]
    assert all(m["role"] in ("system", "developer", "user", "assistant", "tool")
               for m in chat["messages"])
    json.dumps(chat)


CLIENTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data",
                       "responses_clients.json")


def _bodies():
    """What each client sent to ``/v1/responses`` at its defaults, captured on 2026-12-06 (the
    openai SDK 3.51.0, openai-agents 0.24.0, pydantic-ai 2.62.0, langchain-openai 1.7.4, the AI
    SDK 3.0.141, Codex 0.171.0; strings over 300 characters cut)."""
    with open(CLIENTS) as fh:
        data = json.load(fh)
    return [(f"{name}[{i}]", body) for name, entry in sorted(data.items())
            for i, body in enumerate(entry["bodies"])]


@pytest.mark.parametrize("name, sent", _bodies())
def test_every_body_a_client_sent_at_its_defaults_is_served(name, sent):
    from vllm_bi100_patch.serving import responses_store

    responses_store.clear()
    for item in sent.get("input") if isinstance(sent.get("input"), list) else ():
        if item.get("type") == "item_reference":  # the AI SDK's earlier answer, kept here
            responses_store.keep([answer.message_item("earlier", item_id=item["id"])])
    chat, echo = rr.chat_body(sent)
    responses_store.clear()
    offered = [t for t in sent.get("tools") or () if t["type"] == "function"]
    spaces = [f for t in sent.get("tools") or () if t["type"] == "namespace"
              for f in t["tools"]]
    assert len(chat.get("tools") or ()) == len(offered) + len(spaces)
    assert echo["hosted_tools_dropped"] == [t["type"] for t in sent.get("tools") or ()
                                            if t["type"] in rr.HOSTED]
    assert bool(chat.get("stream")) == bool(sent.get("stream"))
    assert echo["store"] == (sent.get("store") is not False)

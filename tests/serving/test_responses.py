"""The Responses API and reasoning output through vLLM 0.6.3's own OpenAI app
(tests/harness/real/tool_stream_app.py ``serve``: ``build_app`` + ``init_app_state``, hermes
auto tool choice, the default front end's ``MQLLMEngineClient``, scripted model outputs split
into deltas at will):
rows ``responses_api``, ``reasoning_flags``, ``reasoning_parser``, ``reasoning_output``,
``reasoning_stream`` (docs/serving-compat.md, "The Responses API", "Reasoning output").

Servers: the shim; the shim started with upstream's ``--enable-reasoning --reasoning-parser
deepseek_r1``; the shim with ``VLLM_BI100_REASONING_PARSER=qwen3`` (no flag); stock 0.6.3
(which answers ``/v1/responses`` with a 404 and has no reasoning flags).  On the official
0.6.3.post1 wheel and on the CoreX 3.2.3 stand-in (``nox -s real-0.6.3.post1``,
``real-corex-3.2.3``).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers.probes import clean_env, installed_vllm
from hypothesis import HealthCheck, given, settings, strategies as st

pytestmark = pytest.mark.real_vllm

#: Of conftest.TOOL_STREAM_SERVERS (started once per session, shared with
#: test_hermes_stream.py: ERROR records are read as deltas).
SERVERS = ("shim", "r1", "qwen3", "stock")
ROWS = ("responses_api", "reasoning_flags", "reasoning_parser", "reasoning_output",
        "reasoning_stream")
TOOL = {"type": "function", "name": "get_weather", "description": "weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
CHAT_TOOL = {"type": "function", "function": {k: v for k, v in TOOL.items() if k != "type"}}


@pytest.fixture(scope="module")
def servers(tool_stream_servers):
    return {name: tool_stream_servers[name] for name in SERVERS}


def _http():
    import httpx

    return httpx.Client(timeout=60)


def script(port, pieces, finish="stop"):
    """A user message that makes the stand-in answer exactly ``pieces`` (one delta each)."""
    with _http() as http:
        key = http.post(f"http://127.0.0.1:{port}/standin/split",
                        json={"pieces": pieces, "finish": finish}).json()["key"]
    return f"split:{key}"


def post(port, path, body):
    """(status, JSON) or, streamed, (status, [(event name, data)])."""
    with _http() as http:
        url = f"http://127.0.0.1:{port}{path}"
        if not body.get("stream"):
            resp = http.post(url, json=body)
            try:
                return resp.status_code, resp.json()
            except ValueError:
                return resp.status_code, {"text": resp.text}
        with http.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                resp.read()
                return resp.status_code, resp.json()
            events, name = [], None
            for line in resp.iter_lines():
                if line.startswith("event: "):
                    name = line[len("event: "):]
                elif line.startswith("data: "):
                    data = line[len("data: "):]
                    events.append((name, data if data == "[DONE]" else json.loads(data)))
                    name = None
            return resp.status_code, events


def errors(port):
    with _http() as http:
        return http.get(f"http://127.0.0.1:{port}/standin/errors").json()


def respond(port, pieces, finish="stop", **body):
    return post(port, "/v1/responses",
                dict({"model": "tiny", "input": script(port, pieces, finish)}, **body))


def test_the_rows_apply_with_the_shim_only(servers):
    for name in ("shim", "r1", "qwen3"):
        assert set(ROWS) <= set(servers[name]["applied"]), servers[name]
    assert not servers["stock"]["applied"]


def test_stock_063_has_no_responses_route_and_the_shim_serves_it(servers):
    logged = len(errors(servers["shim"]["port"]))
    pieces = ["Hello", " there"]
    status, body = respond(servers["stock"]["port"], pieces)
    assert status == 404, body
    status, body = respond(servers["shim"]["port"], pieces, instructions="be kind",
                           metadata={"run": "1"}, store=True)
    assert status == 200, body
    assert body["object"] == "response" and body["status"] == "completed", body
    assert body["store"] is True and body["metadata"] == {"run": "1"}
    assert [i["type"] for i in body["output"]] == ["message"]
    assert body["output"][0]["content"][0]["text"] == "Hello there"
    usage = body["usage"]
    assert usage["output_tokens"] > 0 and usage["input_tokens"] > 0 and \
        usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert errors(servers["shim"]["port"])[logged:] == []


def test_a_tool_call_is_a_function_call_item_and_its_result_goes_back(servers):
    port = servers["shim"]["port"]
    status, body = respond(port, ["<tool_call>", CALL, "</tool_call>", ""], tools=[TOOL])
    assert status == 200, body
    [item] = body["output"]
    assert item["type"] == "function_call" and item["name"] == "get_weather"
    assert json.loads(item["arguments"]) == {"city": "Paris"} and item["call_id"]
    follow = [{"role": "user", "content": script(port, ["It is sunny."])},
              item, {"type": "function_call_output", "call_id": item["call_id"],
                     "output": "sunny"}]
    status, body = post(port, "/v1/responses", {"model": "tiny", "input": follow,
                                                "tools": [TOOL]})
    assert status == 200 and body["output"][0]["content"][0]["text"] == "It is sunny.", body


def _streamed(events):
    """What a client reads off a Responses stream: the final response, the text, each call's
    arguments joined, the event types in order."""
    kinds = [name for name, _ in events]
    for name, data in events:
        assert data["type"] == name
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    text = "".join(d["delta"] for n, d in events if n == "response.output_text.delta")
    thinking = "".join(d["delta"] for n, d in events if n == "response.reasoning_text.delta")
    args = {}
    for n, d in events:
        if n == "response.function_call_arguments.delta":
            args[d["item_id"]] = args.get(d["item_id"], "") + d["delta"]
    return {"final": events[-1][1]["response"], "text": text, "thinking": thinking,
            "arguments": args, "kinds": kinds}


@pytest.mark.parametrize("pieces", [
    ["<tool_call>", CALL, "</tool_call>", ""],
    ["Let me check.", "<tool_call>", '{"name": "get_', 'weather", "arguments": {"ci', 'ty": "Par',
     'is"}}', "</tool_call>", ""],
])
def test_a_streamed_call_follows_the_event_sequence(servers, pieces):
    status, events = respond(servers["shim"]["port"], pieces, tools=[TOOL], stream=True)
    assert status == 200, events
    got = _streamed(events)
    assert got["kinds"][:2] == ["response.created", "response.in_progress"]
    assert got["kinds"][-1] == "response.completed"
    final = got["final"]
    calls = [i for i in final["output"] if i["type"] == "function_call"]
    assert len(calls) == 1 and json.loads(calls[0]["arguments"]) == {"city": "Paris"}
    assert got["arguments"] == {calls[0]["id"]: calls[0]["arguments"]}
    assert "response.function_call_arguments.done" in got["kinds"]
    if pieces[0] == "Let me check.":
        assert got["text"] == "Let me check." and final["output"][0]["type"] == "message"
    assert final["usage"]["output_tokens"] > 0


def test_max_output_tokens_makes_it_incomplete(servers):
    port = servers["shim"]["port"]
    status, body = respond(port, ["Hel", "lo"], finish="length", max_output_tokens=2)
    assert status == 200 and body["status"] == "incomplete", body
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}
    status, events = respond(port, ["Hel", "lo"], finish="length", max_output_tokens=2,
                             stream=True)
    assert events[-1][0] == "response.incomplete", events[-1]


def test_structured_output_and_a_named_tool_go_through_guided_decoding(servers):
    port = servers["shim"]["port"]
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}
    status, body = respond(port, ['{"a": 1}'], text={"format": {
        "type": "json_schema", "name": "A", "schema": schema, "strict": True}})
    assert status == 200 and json.loads(body["output"][0]["content"][0]["text"]) == {"a": 1}
    status, body = respond(port, ['{"city": "Paris"}'], tools=[TOOL],
                           tool_choice={"type": "function", "name": "get_weather"})
    assert status == 200, body
    [item] = body["output"]
    assert item["type"] == "function_call" and json.loads(item["arguments"]) == {
        "city": "Paris"}


@pytest.mark.parametrize("fields, named", [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"background": True}, "background"),
    ({"tool_choice": {"type": "web_search"}, "tools": [{"type": "web_search"}]}, "web_search"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "item_reference"),
    ({"reasoning": {"effort": "high"}}, "effort"),
    ({"max_output_tokens": "many"}, "max_tokens"),
])
def test_what_is_not_served_is_a_400_naming_it(servers, fields, named):
    port = servers["shim"]["port"]
    status, body = post(port, "/v1/responses", dict({"model": "tiny", "input": "hi"}, **fields))
    assert status == 400 and named in body["message"], body
    status, body = post(port, "/v1/responses", {"model": "tiny", "input": "hi", "stream": True,
                                                **fields})
    assert status == 400, body


def test_a_body_that_is_not_json_or_too_deep_is_a_400(servers):
    import httpx

    logged = len(errors(servers["shim"]["port"]))
    url = f"http://127.0.0.1:{servers['shim']['port']}/v1/responses"
    for raw in (b"{", b"[" * 100000 + b"]" * 100000, b'"text"'):
        resp = httpx.post(url, content=raw, headers={"content-type": "application/json"},
                          timeout=60)
        assert resp.status_code == 400, resp.text
    assert errors(servers["shim"]["port"])[logged:] == []


# --- reasoning ---------------------------------------------------------------------------

THINK = ["<think>", "The user asks. I could ", "<tool_call>", '{"name": "nope", "arguments": {}}',
         "</tool_call>", " but no.</th", "ink>", "\n\nSunny", " today."]


def chat(port, pieces, **body):
    messages = [{"role": "user", "content": script(port, pieces)}]
    return post(port, "/v1/chat/completions", dict({"model": "tiny", "messages": messages},
                                                   **body))


def _chat_stream(events):
    content, thinking, calls, finish = "", "", {}, None
    for _, chunk in events:
        if chunk == "[DONE]":
            continue
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            assert not (delta.get("role") and delta.get("reasoning_content"))
            content += delta.get("content") or ""
            thinking += delta.get("reasoning_content") or ""
            for c in delta.get("tool_calls") or ():
                slot = calls.setdefault(c["index"], "")
                calls[c["index"]] = slot + ((c.get("function") or {}).get("arguments") or "")
            finish = choice.get("finish_reason") or finish
    return content, thinking, calls, finish


def test_stock_and_the_shim_without_a_parser_keep_the_thinking_in_content(servers):
    whole = "".join(THINK)
    for name in ("stock", "shim"):
        status, body = chat(servers[name]["port"], THINK)
        message = body["choices"][0]["message"]
        assert status == 200 and message["content"] == whole and \
            "reasoning_content" not in message, (name, body)


@pytest.mark.parametrize("server", ["r1", "qwen3"])
def test_the_thinking_is_reasoning_content_and_tools_read_the_answer_only(servers, server):
    port = servers[server]["port"]
    logged = len(errors(port))
    thinking = "The user asks. I could <tool_call>" + THINK[3] + "</tool_call> but no."
    status, body = chat(port, THINK, tools=[{"type": "function", "function": {
        "name": "nope", "parameters": {"type": "object"}}}])
    message = body["choices"][0]["message"]
    assert status == 200 and message["reasoning_content"] == thinking, body
    assert message["content"] == "\n\nSunny today." and not message.get("tool_calls"), body
    status, events = chat(port, THINK, stream=True, stream_options={"include_usage": True})
    content, streamed, calls, finish = _chat_stream(events)
    assert (content, streamed, calls, finish) == ("\n\nSunny today.", thinking, {}, "stop")
    assert events[-1][1] == "[DONE]" and events[-2][1]["usage"]["completion_tokens"] > 0
    status, body = respond(port, THINK)
    assert [i["type"] for i in body["output"]] == ["reasoning", "message"], body
    assert body["output"][0]["content"][0]["text"] == thinking
    status, events = respond(port, THINK, stream=True)
    got = _streamed(events)
    assert (got["thinking"], got["text"]) == (thinking, "\n\nSunny today.")
    assert [i["type"] for i in got["final"]["output"]] == ["reasoning", "message"]
    assert errors(port)[logged:] == []


def test_a_call_after_the_thinking_is_a_call(servers):
    port = servers["r1"]["port"]
    pieces = ["Weather needed.", "</think>", "\n\n", "<tool_call>", CALL, "</tool_call>", ""]
    status, body = chat(port, pieces, tools=[CHAT_TOOL])
    message = body["choices"][0]["message"]
    assert message["reasoning_content"] == "Weather needed.", body
    assert [json.loads(c["function"]["arguments"]) for c in message["tool_calls"]] == [
        {"city": "Paris"}]
    status, events = respond(port, pieces, tools=[TOOL], stream=True)
    got = _streamed(events)
    assert got["thinking"] == "Weather needed."
    kinds = [i["type"] for i in got["final"]["output"]]
    assert kinds[0] == "reasoning" and kinds[-1] == "function_call", kinds


def test_a_guided_answer_is_not_split(servers):
    port = servers["r1"]["port"]
    status, body = chat(port, ['{"a": 1}'], response_format={"type": "json_object"})
    message = body["choices"][0]["message"]
    assert message["content"] == '{"a": 1}' and "reasoning_content" not in message, body


def test_an_answer_cut_in_its_thinking(servers):
    status, body = chat(servers["r1"]["port"], ["<think>", "still thinking"], max_tokens=3)
    message = body["choices"][0]["message"]
    assert message["reasoning_content"] == "still thinking" and message["content"] is None
    status, body = chat(servers["qwen3"]["port"], ["<think>", "still thinking"])
    message = body["choices"][0]["message"]  # upstream's qwen3: no closed block, no split
    assert message["content"] == "<think>still thinking" and \
        message.get("reasoning_content") is None


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(st.integers(1, 60), max_size=8))
def test_any_split_of_the_output_streams_the_same(servers, cuts):
    """However the engine cuts the output into deltas (inside ``</think>`` too), the stream
    gives the unstreamed answer's thinking and content."""
    port = servers["r1"]["port"]
    text = "Plan: <b>go</b>.</think>\n\nDone."
    points = sorted({min(c, len(text)) for c in cuts})
    pieces = [p for p in (text[i:j] for i, j in zip([0] + points, points + [len(text)])) if p]
    status, events = chat(port, pieces, stream=True)
    content, thinking, _, _ = _chat_stream(events)
    assert (thinking, content) == ("Plan: <b>go</b>.", "\n\nDone."), pieces


def test_vllm_serve_takes_upstreams_reasoning_flags():
    """``vllm serve``'s own command line (``vllm.scripts.main``) lists the flags with the shim,
    and 0.6.3's does not."""
    installed = installed_vllm()
    if not installed.startswith("0.6.3"):
        pytest.skip(f"the reasoning rows are for vLLM 0.6.3; this is {installed}")
    code = "import sys; sys.argv = ['vllm', 'serve', '--help']; from vllm.scripts import main; main()"
    procs = {name: subprocess.Popen([sys.executable, "-c", code],
                                    env=clean_env({"VLLM_BI100_PATCH": mode}),
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name, mode in (("shim", "1"), ("stock", "0"))}  # both at once
    out = {}
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr[-3000:]
        out[name] = stdout
    assert "--reasoning-parser {deepseek_r1,qwen3}" in out["shim"]
    assert "--enable-reasoning" in out["shim"]
    assert "--reasoning-parser" not in out["stock"]

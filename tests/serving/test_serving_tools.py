"""Agent frameworks' tool paths and the serving rows' defects of issue 35, through vLLM 0.6.3's
own server app (``--enable-auto-tool-choice --tool-call-parser hermes``) driven by the
``openai`` client, stock and with the shim (serving_app.py, the runs of conftest.py), on the
official 0.6.3.post1 wheel and on the CoreX 3.2.3 stand-in.  The engine stand-in answers what
fits the request (standin_answers.py).  Without vLLM: tests/serving/test_tool_choice_unit.py."""

from __future__ import annotations

import json
import re

import pytest
from helpers.probes import installed_vllm
from harness.real.serving_app import CITY, SCHEMA, TOOL

pytestmark = pytest.mark.real_vllm

WEATHER_CALL = [["get_weather", '{"city": "Paris"}']]
FINAL_CALL = [["final_result", '{"answer": "text"}']]


def _variant(name, params):
    return {"properties": {"name": {"type": "string", "enum": [name]}, "parameters": params},
            "required": ["name", "parameters"]}


def _metric(runs, name):
    lines = [ln for ln in runs["shim"]["metrics"]["lines"] if ln.startswith(name + " ")
             or ln.startswith(name + "{")]
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in lines)


def test_strict_tools_under_automatic_tool_choice_are_served(serving_runs):
    """openai-agents and pydantic-ai send every tool with strict: true and no tool_choice: the
    shim refused them (and 0.6.3 itself refuses `strict`), upstream serves them (#10463)."""
    shim, stock = serving_runs["shim"], serving_runs["stock"]
    for case in ("strict_true_auto", "strict_auto_absent", "strict_auto_stream"):
        assert shim[case]["status"] == 200, shim[case]
        assert shim[case]["tool_calls"] == WEATHER_CALL, shim[case]
        assert shim[case]["finish"] == ["tool_calls"], shim[case]
        assert stock[case]["status"] == 400 and "strict" in stock[case]["message"]
        assert shim[case]["queued"][0]["guided_json"] is None  # automatic: not guided
    assert "`tools[0].function.strict` must be true or false, not 1" in \
        shim["strict_one"]["message"]


def test_a_strict_tools_bad_arguments_are_logged_and_counted(serving_runs):
    shim, log = serving_runs["shim"], serving_runs["shim_log"]
    for case in ("strict_violation", "strict_violation_stream"):
        assert shim[case]["status"] == 200 and shim[case]["finish"] == ["tool_calls"]
        assert shim[case]["tool_calls"] == [["bad_weather", '{"city": 7}']]  # unchanged
    lines = [ln for ln in log.splitlines() if "do not match its schema" in ln]
    assert len(lines) == 2, lines  # the two bad_weather calls; no valid call is flagged
    for ln in lines:
        assert re.search(r"request 'chat-[0-9a-f]+': the arguments of a call of tool "
                         r"'bad_weather' do not match its schema \(strict: true\): \"7 is not "
                         r"of type 'string' \(at city\)\"", ln), ln
    assert f"request '{shim['strict_violation']['id']}'" in lines[0]
    assert _metric(serving_runs, "vllm_bi100:tool_arguments_invalid_total") == 2
    assert CITY["required"] == ["city"]


def test_required_is_served_through_guided_decoding(serving_runs):
    """pydantic-ai's output_type: tool_choice "required" with a strict final_result tool."""
    shim, stock = serving_runs["shim"], serving_runs["stock"]
    schema = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": [
        _variant("final_result", SCHEMA), _variant("get_weather", TOOL["function"]["parameters"])]}}
    for case in ("required", "required_stream"):
        assert shim[case]["status"] == 200, shim[case]
        assert shim[case]["tool_calls"] == FINAL_CALL and shim[case]["finish"] == ["tool_calls"]
        assert shim[case]["text"] in (None, ""), shim[case]
        queued = shim[case]["queued"][0]
        assert queued["guided_json"] == schema
        assert queued["prompt"].endswith("<|tools|>final_result;get_weather;<|assistant|>")
        assert stock[case]["status"] == 400
    cut = shim["required_cut"]  # max_tokens cut the array: its text stays, finish "length"
    assert cut["status"] == 200 and cut["finish"] == ["length"] and cut["tool_calls"] == []
    assert cut["text"].startswith('[{"name": "final_result"')
    assert shim["tool_choice_required"]["tool_calls"] == [["get_weather", '{"city": "text"}']]
    assert _metric(serving_runs, 'vllm_bi100:calls_total{counter="tool_choice_required"}') == 5


def test_tool_choice_objects(serving_runs):
    shim, stock = serving_runs["shim"], serving_runs["stock"]
    auto = shim["allowed_tools_auto"]
    assert auto["status"] == 200 and auto["tool_calls"] == [["final_result",
                                                             '{"answer": "forty-two"}']]
    assert auto["queued"][0]["prompt"].endswith("<|tools|>final_result;<|assistant|>")
    required = shim["allowed_tools_required"]
    assert required["tool_calls"] == FINAL_CALL and required["finish"] == ["tool_calls"]
    assert required["queued"][0]["guided_json"]["items"]["anyOf"] == [
        _variant("final_result", SCHEMA)]
    named = shim["responses_named"]  # the Responses API's {"type": "function", "name": ...}
    assert named["tool_calls"] == [["get_weather", '{"city": "text"}']]
    assert named["queued"][0]["guided_json"] == TOOL["function"]["parameters"]
    for case in ("allowed_tools_auto", "allowed_tools_required", "responses_named"):
        assert stock[case]["status"] == 500, stock[case]
    # (vLLM's validation handler answers the repr of pydantic's errors: quotes come escaped)
    expect = {"tool_choice_empty_object": "`tool_choice` {} is not a tool choice this server",
              "tool_choice_custom": "custom\\', \\'name\\': \\'x\\'} is not a tool choice",
              "malformed_tool_named": "`tools[0]` must be a function tool with a name",
              "top_logprobs_text": "validation raised TypeError"}
    for case, text in expect.items():
        assert stock[case]["status"] == 500, stock[case]  # 0.6.3: Internal Server Error
        assert shim[case]["status"] == 400 and text in shim[case]["message"], shim[case]
        assert shim[case]["queued"] == []


def test_json_schema_as_text_and_beside_a_forced_tool(serving_runs):
    shim, stock = serving_runs["shim"], serving_runs["stock"]
    for case in ("json_schema_text", "json_schema_text_and_object"):
        assert shim[case]["status"] == 200 and shim[case]["queued"][0]["guided_json"] == SCHEMA
        assert json.loads(shim[case]["text"]) == {"answer": "text"}
        assert stock[case]["status"] == 400
    # 0.6.3 lets the named tool's parameters replace the schema silently; the shim says so
    beside = shim["json_schema_beside_named"]
    assert beside["status"] == 400 and beside["message"].startswith(
        "[{'type': 'value_error'") and "`response_format` json_schema and a named " \
        "`tool_choice` both constrain the answer" in beside["message"]
    assert stock["json_schema_beside_named"]["queued"][0]["guided_json"] == \
        TOOL["function"]["parameters"]


def test_the_serving_rows_defects(serving_runs):
    shim, stock, log = serving_runs["shim"], serving_runs["stock"], serving_runs["shim_log"]
    # 9: the refusal names the field the client sent
    message = shim["max_completion_tokens_invalid"]["message"]
    assert "`max_completion_tokens` must be an integer, not 'abc'" in message
    assert "max_tokens'" not in message
    # 2: a client's key name is logged escaped, never as a line of its own
    assert shim["message_key_newline"]["status"] == 200
    assert "message key 'x\\nINFO forged line' accepted and ignored" in log
    assert not [ln for ln in log.splitlines() if ln.startswith("INFO forged line")]
    # 1: bodies nested 900 deep: a tool schema is served as stock serves it, deep arguments
    # get as far as the prompt (which this 512-token model cannot hold): no 500 either way
    assert shim["deep_tool_parameters"]["status"] == stock["deep_tool_parameters"]["status"] \
        == 200
    assert shim["deep_arguments"]["status"] == 400
    assert "maximum context length is 512 tokens" in shim["deep_arguments"]["message"]


def test_completions(serving_runs):
    shim, stock, log = serving_runs["shim"], serving_runs["stock"], serving_runs["shim_log"]
    every = stock["completion_stream_usage"]["chunk_usage"]
    assert len(every) >= 3 and all(u is not None for u in every), every
    final = shim["completion_stream_usage"]["chunk_usage"]
    assert final[-1] == every[-1] and all(u is None for u in final[:-1]), final
    assert shim["completion_stream_usage"]["text"] == stock["completion_stream_usage"]["text"]
    for case in ("completion_json_schema", "completion_json_schema_text"):
        assert shim[case]["status"] == 200 and shim[case]["queued"][0]["guided_json"] == SCHEMA
        assert json.loads(shim[case]["text"]) == {"answer": "text"}
    assert stock["completion_json_schema"]["queued"][0]["guided_json"] is None  # ignored
    assert stock["completion_json_schema_text"]["status"] == 400
    assert stock["completion_logprobs_text"]["status"] == 500  # check_logprobs: TypeError
    assert shim["completion_logprobs_text"]["status"] == 400
    assert "validation raised TypeError" in shim["completion_logprobs_text"]["message"]
    assert shim["completion_ignored_fields"]["status"] == 200
    assert stock["completion_ignored_fields"]["status"] == 400
    for field in ("prompt_cache_retention", "prompt_cache_options",
                  "stream_options.include_obfuscation"):
        assert log.count(f"completion requests' field `{field}` accepted and ignored") == 1


def test_outlines_of_063_builds_the_calls_schema():
    """The schema "required" guides by is one vLLM 0.6.3's outlines (0.0.46) compiles: its regex
    takes a call of each tool (a $defs reference resolved at the top), and no empty array,
    unknown name, wrong parameters or second call where parallel_tool_calls is false."""
    installed = installed_vllm()
    if not installed.startswith("0.6.3"):  # later vLLMs pin outlines 0.1, another regex builder
        pytest.skip(f"the schema is built for vLLM 0.6.3's outlines; this is vLLM {installed}")
    build = pytest.importorskip("outlines.fsm.json_schema").build_regex_from_schema
    from vllm_bi100_patch.serving import tool_choice

    unit = {"type": "object", "$defs": {"U": {"enum": ["c", "f"]}},
            "properties": {"u": {"$ref": "#/$defs/U"}}, "required": ["u"]}
    tools = [{"type": "function", "function": {"name": "temp", "parameters": unit}},
             {"type": "function", "function": {"name": "final_result", "parameters": SCHEMA}},
             {"type": "function", "function": {"name": "noargs"}}]
    schema = tool_choice.required_schema(tools)
    one = dict(schema, maxItems=1)
    calls = {"temp": {"u": "c"}, "final_result": {"answer": "x"}, "noargs": {}}

    def ok(sch, value):
        return re.fullmatch(build(json.dumps(sch)), json.dumps(value)) is not None

    for name, params in calls.items():
        assert ok(schema, [{"name": name, "parameters": params}]), name
    both = [{"name": n, "parameters": p} for n, p in calls.items()]
    assert ok(schema, both) and not ok(one, both) and ok(one, both[:1])
    assert not ok(schema, [])
    assert not ok(schema, [{"name": "other", "parameters": {}}])
    assert not ok(schema, [{"name": "temp", "parameters": {"u": "k"}}])
    assert not ok(schema, [{"name": "final_result", "parameters": {}}])

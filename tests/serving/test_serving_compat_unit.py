"""The serving rows without vLLM (docs/serving-compat.md): the request body's mappings
(``chat_compat.rewrite``), the n/best_of limit (``seq_limit.too_many``) and the table's
``replace_class`` kind through the registry.  Against vLLM 0.6.3's own server app, scheduler
and the ``openai`` client: tests/serving/test_serving_compat.py."""

from __future__ import annotations

import importlib
import logging
import types

import pytest

from vllm_bi100_patch.activation import config
from vllm_bi100_patch.patching import registry, specs, table
from vllm_bi100_patch.serving import chat_compat, completion_compat, refusal, request_body, seq_limit
from vllm_bi100_patch.patching import patch_row

ON = config.load({config.MODE: "1"})
FIELDS = frozenset({"messages", "model", "max_tokens", "tools", "tool_choice", "logprobs",
                    "top_logprobs", "response_format", "stream", "stream_options",
                    "guided_json", "n", "best_of", "user"})
KEYS = frozenset({"role", "content", "name", "tool_calls", "tool_call_id", "function_call",
                  "refusal", "audio"})
USER = {"role": "user", "content": "hi"}


def rewrite(**body):
    return chat_compat.rewrite(dict({"model": "m", "messages": [dict(USER)]}, **body), FIELDS,
                               KEYS)[0]


def refused(**body):
    with pytest.raises(chat_compat.RequestRefused) as err:
        rewrite(**body)
    assert isinstance(err.value, ValueError)  # pydantic turns it into a 400 naming it
    return str(err.value)


def test_max_completion_tokens_is_max_tokens_and_wins():
    assert rewrite(max_completion_tokens=5)["max_tokens"] == 5
    both = rewrite(max_completion_tokens=5, max_tokens=9)
    assert both["max_tokens"] == 5 and "max_completion_tokens" not in both
    assert "max_tokens" not in rewrite(max_completion_tokens=None)
    # a build whose model has the field keeps it as it is
    kept = chat_compat.rewrite({"messages": [USER], "max_completion_tokens": 5},
                               FIELDS | {"max_completion_tokens"}, KEYS)
    assert kept == ({"messages": [USER], "max_completion_tokens": 5}, False, None)


@pytest.mark.parametrize("value", ["abc", "-", 2.5, True, [3]])
def test_an_invalid_max_completion_tokens_is_refused_by_that_name(value):
    """Defect 9: it was mapped to max_tokens first, so 0.6.3 refused `max_tokens`, a field
    the client never sent."""
    message = refused(max_completion_tokens=value)
    assert message.startswith("`max_completion_tokens` must be an integer") and \
        "max_tokens`" not in message
    assert refused(max_completion_tokens=0) == "`max_completion_tokens` must be at least 1, got 0"
    assert rewrite(max_completion_tokens="7")["max_tokens"] == 7  # as pydantic reads max_tokens
    assert rewrite(max_completion_tokens=7.0)["max_tokens"] == 7


def test_harmless_fields_are_dropped_and_the_rest_stays():
    body = rewrite(store=True, metadata={"a": "b"}, service_tier="auto", prompt_cache_key="k",
                   safety_identifier="u", prediction={"type": "content"}, modalities=["text"],
                   prompt_cache_retention="24h", prompt_cache_options={"x": 1},
                   user="u2", frobnicate=1)
    assert body == {"model": "m", "messages": [USER], "user": "u2", "frobnicate": 1}


@pytest.mark.parametrize("field, value", [("reasoning_effort", "low"), ("verbosity", "low"),
                                          ("audio", {"voice": "x"}),
                                          ("modalities", ["text", "audio"])])
def test_fields_that_change_the_answer_are_refused_by_name(field, value):
    assert f"`{field}`" in refused(**{field: value})
    if field != "modalities":
        assert field not in rewrite(**{field: None})  # null asks for the default


def test_messages():
    assert "`messages` is empty" in refused(messages=[])
    body = rewrite(messages=[{"role": "developer", "content": "x", "reasoning_content": "r"},
                             {"role": "assistant", "content": None, "tool_calls": [
                                 {"id": "1", "type": "function",
                                  "function": {"name": "f", "arguments": {"a": [1, "é"]}}}]}])
    assert body["messages"][0] == {"role": "system", "content": "x"}
    assert body["messages"][1]["tool_calls"][0]["function"]["arguments"] == '{"a": [1, "é"]}'
    bad = [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}]}]
    assert refused(messages=[USER] + bad).startswith(
        "messages[1].tool_calls[0].function.arguments is not valid JSON")


def _tool(**extra):
    return {"type": "function", "function": dict({"name": "f", "parameters": {}}, **extra)}


def test_tools_and_tool_choice():
    none = rewrite(tools=[_tool()], tool_choice="none")
    assert "tools" not in none and "tool_choice" not in none  # vLLM 0.6.4
    named = {"type": "function", "function": {"name": "f"}}
    # the named tool's empty parameters are guided as an object with no properties (item 4)
    assert rewrite(tools=[_tool(strict=True)], tool_choice=named)["tools"] == [
        _tool(parameters={"type": "object", "properties": {}})]
    assert rewrite(tools=[_tool(strict=False)])["tools"] == [_tool()]
    # strict: true under automatic tool choice is served, as upstream serves it (0.6.5, #10463)
    assert rewrite(tools=[_tool(strict=True)], tool_choice="auto")["tools"] == [_tool()]
    assert rewrite(tools=[_tool(strict=True)])["tools"] == [_tool()]


def test_logprobs_usage_and_json_schema():
    assert "top_logprobs" not in rewrite(top_logprobs=0)
    assert rewrite(top_logprobs=0, logprobs=True)["top_logprobs"] == 0
    assert rewrite(top_logprobs=2)["top_logprobs"] == 2  # 0.6.3 then refuses it, naming logprobs
    assert rewrite(stream=True, stream_options={"include_usage": True})["stream_options"] == {
        "include_usage": True, "continuous_usage_stats": False}
    asked = {"include_usage": True, "continuous_usage_stats": True}
    assert rewrite(stream=True, stream_options=dict(asked))["stream_options"] == asked
    schema = {"type": "object"}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    assert rewrite(response_format=fmt)["guided_json"] == schema
    assert "two different schemas" in refused(response_format=fmt, guided_json={"type": "array"})
    assert "schema` is missing" in refused(response_format={"type": "json_schema",
                                                            "json_schema": {"name": "x"}})


def test_a_json_schema_given_as_text_is_parsed():
    """Defect 10 / the misnamed cause: a schema sent as JSON text was refused as "missing",
    and beside the same schema as an object as "two different schemas"."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    text = '{"type": "object", "properties": {"a": {"type": "integer"}}}'
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": text}}
    body = rewrite(response_format=fmt)
    assert body["guided_json"] == schema
    assert body["response_format"]["json_schema"] == {"name": "x", "schema": schema}
    assert fmt["json_schema"]["schema"] == text  # the caller's body is not changed
    assert rewrite(response_format=fmt, guided_json=schema)["guided_json"] == schema
    obj = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    assert rewrite(response_format=obj, guided_json=text)["guided_json"] == schema
    assert refused(response_format=dict(fmt, json_schema={"name": "x", "schema": "{x"})) \
        .startswith("`response_format.json_schema.schema` is a string but not JSON text")
    assert "JSON text of a list, not of an object" in refused(
        response_format=dict(fmt, json_schema={"name": "x", "schema": "[1]"}))
    assert "must be a JSON schema (an object), not a int" in refused(
        response_format=dict(fmt, json_schema={"name": "x", "schema": 5}))


def _nested(depth, leaf=None):
    value = leaf if leaf is not None else {}
    for _ in range(depth):
        value = {"a": value}
    return value


def test_deeply_nested_bodies_are_served_or_refused_by_name_never_a_crash():
    """Defect 1: the mappings deep-copied and dumped recursively (a RecursionError, a 500).
    Now nothing they do not change is copied or walked; what they must walk is refused by
    name."""
    deep = _nested(5000)
    tool = {"type": "function", "function": {"name": "f", "parameters": deep}}
    body, changed, plan = chat_compat.rewrite(
        {"model": "m", "messages": [dict(USER)], "tools": [tool]}, FIELDS, KEYS)
    assert body["tools"][0]["function"]["parameters"] is deep and plan is None
    call = {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": deep}}]}
    assert refused(messages=[USER, call]) == (
        "messages[1].tool_calls[0].function.arguments nests deeper than this server handles")
    text = "[" * 100000 + "]" * 100000
    call = {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": text}}]}
    assert "nests deeper than this server parses" in refused(messages=[USER, call])
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": _nested(5000)}}
    assert "`guided_json` nests deeper than 64 levels" in refused(response_format=fmt,
                                                                  guided_json=_nested(5000))
    assert "`response_format.json_schema.schema` nests deeper than 64 levels" in refused(
        response_format=fmt)


def test_the_callers_body_is_never_changed():
    message = {"role": "developer", "content": "x", "reasoning_content": "r",
               "tool_calls": [{"function": {"name": "f", "arguments": {"a": 1}}}]}
    tools = [_tool(strict=True)]
    data = {"model": "m", "messages": [message], "tools": tools,
            "stream_options": {"include_usage": True}, "stream": True}
    before = repr(data)
    body, changed, _ = chat_compat.rewrite(data, FIELDS, KEYS)
    assert changed and repr(data) == before and body["messages"][0]["role"] == "system"
    assert chat_compat.rewrite({"model": "m", "messages": [USER]}, FIELDS, KEYS)[1] is False


def test_dropped_keys_are_warned_about_over_a_bounded_set_of_names(caplog):
    """Defect 2: one WARNING and one set entry per made-up key name (unbounded), the name
    logged raw (a newline in it forged a log line)."""
    request_body.reset_warnings()
    caplog.set_level(logging.WARNING, logger="vllm.bi100_patch")
    for r in range(50):
        message = {"role": "user", "content": "hi", "reasoning_content": "r"}
        message.update({f"k{r}_{i}": 1 for i in range(200)})
        rewrite(messages=[message])
    rewrite(messages=[{"role": "user", "content": "hi", "x\nINFO forged": 1}])
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 + request_body.MADE_UP_CAP + 1, len(lines)
    assert lines.count(lines[0]) == 1 and "message key `reasoning_content`" in lines[0]
    assert "message key 'k0_0' accepted and ignored" in lines[1]
    assert "further ones are dropped without a WARNING" in lines[-1]
    assert all("\n" not in line for line in lines)
    assert len(request_body._made_up) <= request_body.MADE_UP_CAP + 1
    request_body.reset_warnings()
    caplog.clear()
    rewrite(messages=[{"role": "user", "content": "hi", "x\nINFO forged": 1}])
    assert [r.getMessage() for r in caplog.records] == [
        "vllm-bi100-patch: chat requests' message key 'x\\nINFO forged' accepted and ignored "
        "(" + chat_compat.WHY_KEY + "); logged once per process"]


COMPLETION_FIELDS = frozenset({"model", "prompt", "max_tokens", "stream", "stream_options",
                               "response_format", "guided_json", "guided_regex"})


def complete(**body):
    return completion_compat.rewrite(dict({"model": "m", "prompt": "hi"}, **body),
                                     COMPLETION_FIELDS)


def test_completions_usage_json_schema_and_harmless_fields(caplog):
    request_body.reset_warnings()
    caplog.set_level(logging.WARNING, logger="vllm.bi100_patch")
    body, changed, _ = complete(stream=True, stream_options={"include_usage": True,
                                                              "include_obfuscation": True},
                                prompt_cache_retention="24h", prompt_cache_options={})
    assert changed and body == {"model": "m", "prompt": "hi", "stream": True, "stream_options": {
        "include_usage": True, "continuous_usage_stats": False}}
    asked = {"include_usage": True, "continuous_usage_stats": True}
    assert complete(stream=True, stream_options=dict(asked))[0]["stream_options"] == asked
    schema = {"type": "object"}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    assert complete(response_format=fmt)[0]["guided_json"] == schema
    text = dict(fmt, json_schema={"name": "x", "schema": '{"type": "object"}'})
    assert complete(response_format=text)[0]["guided_json"] == schema
    with pytest.raises(refusal.RequestRefused, match="two different schemas"):
        complete(response_format=fmt, guided_json={"type": "array"})
    assert complete(response_format={"type": "json_object"}) == (
        {"model": "m", "prompt": "hi", "response_format": {"type": "json_object"}}, False, None)
    logged = " | ".join(r.getMessage() for r in caplog.records)
    for name in ("stream_options.include_obfuscation", "prompt_cache_retention",
                 "prompt_cache_options"):
        assert logged.count(f"completion requests' field `{name}` accepted and ignored") == 1


def test_the_limit_names_n_best_of_and_max_num_seqs():
    assert seq_limit.too_many(2, None, 2) is None
    assert seq_limit.too_many(2, None, None) is None  # limit unknown: the engine refuses
    assert seq_limit.too_many(4, None, 1, use_beam_search=True) is None
    assert seq_limit.too_many(2, None, 1).startswith(
        "n=2 asks for 2 parallel sequences, but this server runs at most max_num_seqs=1")
    assert seq_limit.too_many(1, 3, 2).startswith("n=1 and best_of=3 asks for 3 parallel")


def test_a_class_row_replaces_checks_and_reverts(paged_attn_module, monkeypatch):
    """The ``replace_class`` kind: the module's class replaced by the factory's subclass,
    never twice, disabled by name, and the original put back by revert."""
    paged_attn_module("0.6.3.post1")  # an installed vLLM version for the decision
    module = types.ModuleType("bi100_test_models")

    class Model:
        value = 1

    module.Model = Model
    factories = types.ModuleType("bi100_test_class_factories")

    def factory(family, original, mod, settings):
        return type("Model", (original,), {"value": 2})

    factories.factory = factory
    factories.check = lambda cls: None if cls.value == 1 else f"value {cls.value}"
    monkeypatch.setitem(importlib.sys.modules, "bi100_test_models", module)
    monkeypatch.setitem(importlib.sys.modules, "bi100_test_class_factories", factories)
    row = patch_row.Patch("model_compat", patch_row.REPLACE_CLASS, "bi100_test_models:Model",
                      "bi100_test_class_factories:factory",
                      params="code:bi100_test_class_factories:check", why="w", how="h",
                      vllm="v", upstream="u", removal="r")
    monkeypatch.setattr(table, "PATCHES", table.PATCHES + (row,))
    monkeypatch.setattr(specs, "SPECS", tuple(specs.PatchSpec(r) for r in table.methods()))
    assert row.owner == row.attr == "Model" and "bi100_test_models" in table.hooked_modules()
    report = registry.apply_to(module, ON)
    assert report.reason is None and report.applied == ["model_compat"], report
    new = module.Model
    assert new is not Model and issubclass(new, Model) and new.value == 2
    assert registry.apply_to(module, ON).applied == ["model_compat"] and module.Model is new
    assert "Model" in registry.patched_attributes()
    assert "| `model_compat` (class) |" in table.catalogue()
    registry.revert_all()
    assert module.Model is Model
    off = config.load({config.MODE: "1", config.DISABLE: "model_compat"})
    assert registry.apply_to(module, off).skipped["model_compat"].startswith("disabled")
    assert module.Model is Model

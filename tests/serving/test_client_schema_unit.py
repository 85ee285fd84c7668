"""A client's JSON schema taken as data, without vLLM (issue 39; docs/serving-compat.md, "What the
shim does with a client schema"): references resolved only within the schema (anything else a
400 naming it, on every path that reads a client schema), size/depth/pattern limits, the
``required`` schema keeping each tool's references, empty schemas guided as objects, the
formats of OpenAI's strict mode, and the strict check's validator (no retrieval, patterns under
a time budget: needs jsonschema and regex, which vLLM installs; skipped where they are absent).
Through vLLM 0.6.3's own app: tests/serving/test_hostile_bodies.py."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from vllm_bi100_patch.serving import (chat_compat, client_schema, completion_compat,
                                      json_formats, tool_choice)
from vllm_bi100_patch.serving.refusal import RequestRefused

FIELDS = frozenset({"messages", "model", "max_tokens", "tools", "tool_choice", "logprobs",
                    "top_logprobs", "response_format", "stream", "stream_options",
                    "guided_json", "guided_regex", "n", "prompt"})
KEYS = frozenset({"role", "content", "name", "tool_calls", "tool_call_id"})
USER = {"role": "user", "content": "hi"}
REMOTE = ["http://169.254.169.254/latest/meta-data", "https://example.com/s.json",
          "file:///etc/passwd", "other.json", "/abs/path.json", "urn:x:y", "//host/x"]


def chat(**body):
    return chat_compat.rewrite(dict({"model": "m", "messages": [USER]}, **body), FIELDS, KEYS)


def completion(**body):
    return completion_compat.rewrite(dict({"model": "m", "prompt": "hi"}, **body), FIELDS)


def fn(name, params, **extra):
    return {"type": "function", "function": dict({"name": name, "parameters": params}, **extra)}


def refused(call, **body):
    with pytest.raises(RequestRefused) as err:
        call(**body)
    return str(err.value)


def _paths(schema):
    """Every body that puts ``schema`` where something on the server reads it, and the name
    the refusal must give."""
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    return [
        (chat, {"tools": [fn("f", schema, strict=True)]}, "tools[0].function.parameters"),
        (chat, {"tools": [fn("g", {}), fn("f", schema)], "tool_choice": "required"},
         "tools[1].function.parameters"),
        (chat, {"tools": [fn("f", schema)], "tool_choice": {"type": "function",
                                                              "function": {"name": "f"}}},
         "tools[0].function.parameters"),
        (chat, {"response_format": fmt}, "response_format.json_schema.schema"),
        (chat, {"guided_json": schema}, "guided_json"),
        (completion, {"response_format": fmt}, "response_format.json_schema.schema"),
        (completion, {"guided_json": schema}, "guided_json"),
    ]


@pytest.mark.parametrize("ref", REMOTE)
def test_a_reference_outside_the_schema_is_a_400_naming_it_on_every_path(ref):
    schema = {"type": "object", "properties": {"a": {"$ref": ref}}}
    for call, body, where in _paths(schema):
        message = refused(call, **body)
        assert message.startswith(f"`{where}` refers to {ascii(ref)} ($ref at "
                                  "'/properties/a')"), message
        assert "never retrieves a document a request names" in message


def test_references_in_every_schema_position_are_found_and_data_is_not_a_reference():
    for schema in ({"items": {"$ref": "http://x"}}, {"anyOf": [{}, {"$ref": "http://x"}]},
                   {"$defs": {"A": {"$dynamicRef": "http://x"}}},
                   {"properties": {"const": {"$ref": "http://x"}}},
                   {"not": {"additionalProperties": {"$recursiveRef": "http://x"}}}):
        assert "refers to 'http://x'" in refused(chat, guided_json=schema)
    assert "is not a string" in refused(chat, guided_json={"$ref": 5})
    # data that looks like a reference is data (const, enum, default, examples)
    for data in ({"const": {"$ref": "http://x"}}, {"enum": [{"$ref": "file:///x"}]},
                 {"default": {"$ref": "http://x"}}, {"examples": [{"$ref": "http://x"}]}):
        assert chat(guided_json=data)[0]["guided_json"] == data
    # a guided_json as JSON text is checked too
    assert "refers to 'file:///etc/passwd'" in refused(
        chat, guided_json='{"$ref": "file:///etc/passwd"}')


def test_a_schema_over_the_limits_is_a_400_naming_the_limit():
    wide = {"type": "object", "properties": {f"p{k}": {"type": "string"}
                                             for k in range(client_schema.MAX_NODES)}}
    assert "holds more than 20000 JSON values" in refused(chat, guided_json=wide)
    deep: dict = {"type": "object"}
    for _ in range(40):
        deep = {"type": "object", "properties": {"a": deep}}
    assert "nests deeper than 64 levels" in refused(
        chat, tools=[fn("f", deep, strict=True)])
    long = "a" * (client_schema.MAX_PATTERN + 1)
    assert "a pattern of 2001 characters" in refused(chat, guided_json={"pattern": long})
    assert "a pattern of 2001 characters" in refused(
        chat, guided_json={"patternProperties": {long: {}}})
    # a tool under automatic tool choice and without strict: nothing reads its schema
    body, _, plan = chat(tools=[fn("f", {"$ref": "http://x"})])
    assert plan is None and body["tools"][0]["function"]["parameters"] == {"$ref": "http://x"}


def test_a_requests_schemas_together_stay_within_the_request_limit():
    big = {"type": "object", "properties": {f"p{k}": {"type": "string"} for k in range(9000)}}
    tools = [fn(f"t{i}", big) for i in range(3)]  # 18,002 values each: each within its limit
    assert chat(tools=tools[:2], tool_choice="required")[2].required == ("t0", "t1")
    with client_schema.request():
        chat(tools=tools[:2], tool_choice="required")
    with client_schema.request():
        message = refused(chat, tools=tools, tool_choice="required")
    assert message.startswith("the request's schemas hold more than 50000 JSON values "
                              "together (at `tools[2].function.parameters`)"), message


def test_the_walk_is_linear_and_cheap():
    wide = {"type": "object", "properties": {f"p{k}": {"type": "string", "pattern": "^a+$"}
                                             for k in range(6000)}}
    start = time.perf_counter()
    client_schema.check(wide, "x")
    assert time.perf_counter() - start < 2.0  # 18,000 values: a correctness bound, not timing


def _resolve(root, ref):
    """What ``ref`` (a fragment) points at in ``root`` (JSON pointer, RFC 6901 + URI)."""
    from urllib.parse import unquote
    fragment = ref[1:]
    node = root
    if fragment:
        assert fragment.startswith("/"), ref
        for part in unquote(fragment).split("/")[1:]:
            part = part.replace("~1", "/").replace("~0", "~")
            node = node[int(part)] if isinstance(node, list) else node[part]
    return node


POINTER = {"type": "object", "properties": {"a": {"type": "string"}, "b": {
    "$ref": "#/properties/a"}, "a/b~c d%": {"type": "integer"}, "c": {
    "$ref": "#/properties/a~1b~0c%20d%25"}}}
NESTED_DEFS = {"type": "object", "properties": {"x": {"type": "object", "$defs": {
    "In": {"type": "integer"}}, "properties": {"y": {"$ref": "#/properties/x/$defs/In"}}}},
    "$defs": {"Out": {"type": "string"}}, "required": ["x"]}
RECURSIVE = {"type": "object", "properties": {"name": {"type": "string"}, "children": {
    "type": "array", "items": {"$ref": "#"}}}}
ANCHORED = {"type": "object", "$defs": {"T": {"$anchor": "temp", "type": "number"}},
            "properties": {"t": {"$ref": "#temp"}}}


def _parameters(tools, i):
    return tool_choice.required_schema(tools)["items"]["anyOf"][i]["properties"]["parameters"]


def test_required_rewrites_each_tools_references_to_resolve_as_in_its_own_schema():
    tools = [fn("pointer", POINTER), fn("nested", NESTED_DEFS), fn("recursive", RECURSIVE),
             fn("anchored", ANCHORED)]
    combined = tool_choice.required_schema(tools)
    assert "$defs" not in combined  # nothing hoisted: each tool keeps its definitions in place
    p = _parameters(tools, 0)
    assert _resolve(combined, p["properties"]["b"]["$ref"]) == {"type": "string"}
    assert _resolve(combined, p["properties"]["c"]["$ref"]) == {"type": "integer"}
    n = _parameters(tools, 1)["properties"]["x"]["properties"]["y"]["$ref"]
    assert _resolve(combined, n) == {"type": "integer"}
    r = _parameters(tools, 2)
    assert r["properties"]["children"]["items"] == {
        "$ref": "#/items/anyOf/2/properties/parameters"}
    assert _resolve(combined, r["properties"]["children"]["items"]["$ref"]) == r
    a = _parameters(tools, 3)
    assert a["$defs"]["T"]["$anchor"] == a["properties"]["t"]["$ref"][1:] == "t3r0_temp"
    # embedded resources ($id below the top): their references are relative to them
    embedded = {"type": "object", "$id": "urn:root", "properties": {"e": {
        "$id": "urn:e", "$defs": {"D": {"type": "boolean"}}, "$ref": "#/$defs/D"}}}
    e = _parameters([fn("e", embedded)], 0)
    assert "$id" not in e and "$id" not in e["properties"]["e"]
    assert _resolve(tool_choice.required_schema([fn("e", embedded)]),
                    e["properties"]["e"]["$ref"]) == {"type": "boolean"}


def test_the_required_schema_validates_as_each_tools_own_schema():
    jsonschema = pytest.importorskip("jsonschema")
    tools = [fn("pointer", POINTER), fn("nested", NESTED_DEFS), fn("recursive", RECURSIVE),
             fn("anchored", ANCHORED)]
    combined = tool_choice.required_schema(tools)
    cases = [("pointer", {"b": "s", "c": 1}, True), ("pointer", {"b": 1}, False),
             ("pointer", {"c": "s"}, False), ("nested", {"x": {"y": 3}}, True),
             ("nested", {"x": {"y": "s"}}, False),
             ("recursive", {"name": "a", "children": [{"name": "b", "children": []}]}, True),
             ("recursive", {"children": [{"name": 5}]}, False),
             ("anchored", {"t": 1.5}, True), ("anchored", {"t": "x"}, False)]
    own = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    for name, args, valid in cases:
        assert jsonschema.Draft202012Validator(own[name]).is_valid(args) is valid, name
        calls = [{"name": name, "parameters": args}]
        assert jsonschema.Draft202012Validator(combined).is_valid(calls) is valid, (name, args)


def test_empty_schemas_are_guided_as_json_objects():
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}
    for call in (chat, completion):
        assert call(response_format=fmt)[0]["guided_json"] == {"type": "object"}
        assert call(guided_json={})[0]["guided_json"] == {"type": "object"}
        assert call(guided_json="{}")[0]["guided_json"] == {"type": "object"}
        assert call(response_format=fmt, guided_json={})[0]["guided_json"] == {"type": "object"}
    named = {"type": "function", "function": {"name": "f"}}
    for params in (None, {}):
        tool = {"type": "function", "function": {"name": "f"}}
        if params is not None:
            tool["function"]["parameters"] = params
        body, _, _ = chat(tools=[tool, fn("g", {})], tool_choice=named)
        assert body["tools"][0]["function"]["parameters"] == {"type": "object",
                                                                "properties": {}}
        assert body["tools"][1]["function"]["parameters"] == {}  # not named: as sent
        assert tool["function"].get("parameters") == params  # the caller's tool unchanged


FORMATS = {
    "date": (["2024-02-29", "1999-12-31"], ["2023-02-29", "2024-13-01", "24-01-01", "x",
                                             "2024-01-01T00:00:00Z"]),
    "time": (["23:59:60Z", "08:30:00.25+05:30", "00:00:00z"], ["24:00:00Z", "08:30:00",
                                                              "8:30:00Z", "08:30:00+25:00"]),
    "date-time": (["2024-01-01T08:30:00Z", "2024-01-01t08:30:00.1-01:00"],
                  ["2024-01-01 08:30:00Z", "2024-01-01T08:30:00", "2024-02-30T00:00:00Z"]),
    "duration": (["P1Y", "P1Y2M3D", "PT1H", "P1DT2H3M4S", "P2W", "PT36H"],
                 ["P", "PT", "P1H", "1Y", "P1Y1D", "PT1S2M", "P2W1D"]),
    "email": (["a@example.com", "first.last+tag@sub.example.org", '"a b"@x.io',
               "u@[192.0.2.1]", "u@[IPv6:2001:db8::1]"],
              ["a", "a@", "@x.com", "a..b@x.com", "a@-x.com", "a b@x.com"]),
    "hostname": (["example.com", "a-b.c", "localhost", "x" * 63 + ".com"],
                 ["-a.com", "a_b.com", "x" * 64 + ".com", "", "a..b"]),
    "ipv4": (["192.0.2.1", "0.0.0.0"], ["256.0.0.1", "01.2.3.4", "1.2.3", "::1"]),
    "ipv6": (["::1", "2001:db8::1", "::ffff:192.0.2.1"], ["1.2.3.4", "fe80::1%eth0", ":::1"]),
    "uuid": (["123e4567-e89b-12d3-a456-426614174000"],
             ["123e4567e89b12d3a456426614174000", "123e4567-e89b-12d3-a456-42661417400g"]),
}


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_the_formats_openais_strict_mode_lists_are_checked(fmt):
    good, bad = FORMATS[fmt]
    for value in good:
        assert json_formats.check(fmt, value) is True, value
    for value in bad:
        assert json_formats.check(fmt, value) is False, value
    assert json_formats.check(fmt, 7) is True  # formats apply to strings only
    assert json_formats.check("uri", "x") is None  # not one checked here


def test_the_formats_take_linear_time_on_long_hostile_strings():
    start = time.perf_counter()
    for fmt in json_formats.FORMATS:
        for text in ("a" * 100_000 + "!", "a." * 50_000, "P" + "1Y" * 50_000, '"' + "\\" * 99_999):
            json_formats.check(fmt, text)
    assert time.perf_counter() - start < 2.0  # a correctness bound (no backtracking)


# --- the strict check's validator (jsonschema, regex: vLLM's dependencies) ---------------


def _needs_validator():
    pytest.importorskip("jsonschema")
    pytest.importorskip("regex")
    pytest.importorskip("referencing")
    from vllm_bi100_patch.serving import strict_schema
    return strict_schema


def test_the_strict_check_never_retrieves_a_reference(monkeypatch):
    strict_schema = _needs_validator()
    from vllm_bi100_patch.serving import tool_args
    opened = []
    monkeypatch.setattr(socket.socket, "connect", lambda *a: opened.append(a))
    import urllib.request
    monkeypatch.setattr(urllib.request, "urlopen", lambda *a, **k: opened.append(a))
    for ref in REMOTE:
        schema = {"type": "object", "properties": {"a": {"$ref": ref}}}
        problem, unchecked = tool_args._violation({"a": 1}, schema, strict_schema.deadline())
        assert problem is None and "cannot use" in unchecked, (ref, unchecked)
    assert opened == []


def test_a_backtracking_pattern_is_bounded_and_leaves_other_threads_running():
    strict_schema = _needs_validator()
    from vllm_bi100_patch.serving import tool_args
    schema = {"type": "object", "properties": {"s": {"type": "string", "pattern": "^(a|a)*$"}}}
    ticks = []
    stop = threading.Event()

    def loop():  # an event loop's stand-in: must keep running during the check
        while not stop.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.005)

    tool_args._violation({"s": "a"}, schema, strict_schema.deadline())  # imports, compiled
    thread = threading.Thread(target=loop)
    thread.start()
    start, cpu = time.perf_counter(), time.thread_time()
    try:
        problem, unchecked = tool_args._violation({"s": "a" * 40 + "!"}, schema,
                                                  strict_schema.deadline(3.0))
    finally:
        elapsed, cpu = time.perf_counter() - start, time.thread_time() - cpu
        stop.set()
        thread.join()
    assert problem is None and unchecked.startswith("over budget"), unchecked
    # stopped at its budget (Python's re: minutes); the regex module counts its time-out in
    # the thread's CPU time, so on a loaded machine the wall time is longer
    assert cpu < 4.5 and elapsed < 60, (cpu, elapsed)
    gaps = [b - a for a, b in zip(ticks, ticks[1:])]
    # the other thread ran throughout: holding the GIL would give one gap of the whole match
    assert len(ticks) > 20 and max(gaps) < elapsed / 2, (len(ticks), max(gaps), elapsed)
    # a matching and a failing pattern are still checked
    ok = {"type": "object", "properties": {"s": {"pattern": "^[a-z]+$"}}, "required": ["s"]}
    assert tool_args._violation({"s": "abc"}, ok, strict_schema.deadline()) == (None, None)
    problem, _ = tool_args._violation({"s": "ABC"}, ok, strict_schema.deadline())
    assert "does not match" in problem


def test_the_strict_check_honours_formats_and_patterns_of_properties():
    strict_schema = _needs_validator()
    from vllm_bi100_patch.serving import tool_args
    schema = {"type": "object", "properties": {f: {"type": "string", "format": f}
                                               for f in json_formats.FORMATS}}
    for fmt, (good, bad) in FORMATS.items():
        assert tool_args._violation({fmt: good[0]}, schema, strict_schema.deadline()) == (
            None, None)
        problem, _ = tool_args._violation({fmt: bad[0]}, schema, strict_schema.deadline())
        assert problem is not None and f"is not a '{fmt}'" in problem, (fmt, problem)
    pp = {"type": "object", "patternProperties": {"^x_": {"type": "integer"}},
          "additionalProperties": False}
    assert tool_args._violation({"x_a": 1}, pp, strict_schema.deadline()) == (None, None)
    assert "x_a" in tool_args._violation({"x_a": "s"}, pp, strict_schema.deadline())[0]
    assert "not allowed" in tool_args._violation({"y": 1}, pp, strict_schema.deadline())[0]
    both = {"patternProperties": {"^x": {}}, "unevaluatedProperties": False}
    assert "unevaluatedProperties" in tool_args._violation({}, both, strict_schema.deadline())[1]

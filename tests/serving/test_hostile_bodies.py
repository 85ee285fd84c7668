"""Hostile request bodies against vLLM 0.6.3's own OpenAI app with the shim (issue 39: a request
is data, never an action), on the official 0.6.3.post1 wheel and on the CoreX 3.2.3 stand-in.

The server (hostile_app.py: serving_app.py's app around the engine stand-in, in a process of
its own) runs under a socket guard that records and refuses every connection, name lookup and
URL opening it attempts.  Bodies drawn by Hypothesis (seeded: ``derandomize``, a fixed number
of examples) go to ``/v1/chat/completions`` and ``/v1/completions``, streamed and not: schemas
with remote, ``file:``, relative, recursive and anchor references in every place a schema is
read (strict tools, ``required``, a named tool, ``response_format``, ``guided_json``), huge and
deep schemas, pathological patterns, formats, invalid UTF-8, lone surrogates, deep nesting,
wrong types.  While they run, a thread sends plain requests and times them.  Then: no answer
is a 5xx (nor a stream's error event of one), the server logged no traceback and no ERROR, the
guard recorded nothing, and no plain request took longer than ``STALL_S`` (a bound against a
stall, not a benchmark).  Named cases: a strict tool whose pattern backtracks without bound
under Python's ``re``, called by the model, streamed and not: its check stops at its budget,
counted as unchecked; many tools each within one schema's limit and together over one
request's: a 400 naming it.  Without vLLM: tests/test_client_schema_unit.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest
from helpers.probes import HARNESS, TAG, clean_env, installed_vllm

pytestmark = pytest.mark.real_vllm

REAL = os.path.join(HARNESS, "real")
#: The longest a plain request may take while hostile ones run (seconds): against a stall.
STALL_S = 2.0
EXAMPLES = 120
USER = {"role": "user", "content": "hi"}
REFS = ["http://169.254.169.254/latest/meta-data/", "https://example.com/s.json#/a",
        "file:///etc/passwd", "file:///proc/self/environ", "other.json", "//evil/x",
        "urn:uuid:1", "#", "#/properties", "#/$defs/A", "#nowhere", "#/a~1b%25", "#/x/0/y", ""]
PATTERNS = ["^(a+)+$", "^(a|a)*$", "(x+x+)+y", "^(([a-z])+.)+[A-Z]([a-z])+$", "[", "(?<=a)b",
            "\\p{L}+", "a{1000000}", "(?i)abc", ".*" * 40]
FORMATS = ["date-time", "time", "date", "duration", "email", "hostname", "ipv4", "ipv6",
           "uuid", "uri", "regex", "made-up"]
SLOW = {"type": "object", "properties": {"s": {"type": "string", "pattern": "^(a|a)*$"}},
        "required": ["s"]}


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    installed = installed_vllm()
    if not installed.startswith("0.6.3"):
        pytest.skip(f"the serving rows are for vLLM 0.6.3; this is {installed}")
    log = str(tmp_path_factory.mktemp("hostile") / "server.log")
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, os.path.join(REAL, "hostile_app.py")],
                                env=clean_env({"VLLM_BI100_PATCH": "1"}), cwd=REAL,
                                stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600
    port = None
    while port is None:
        with open(log) as fh:
            for line in fh:
                if line.startswith(TAG) and json.loads(line[len(TAG):])["case"] == "ready":
                    port = json.loads(line[len(TAG):])["port"]
        if port is None and (proc.poll() is not None or time.monotonic() > deadline):
            proc.kill()
            with open(log) as fh:
                pytest.fail(f"the server did not start (rc={proc.poll()}):\n{fh.read()[-6000:]}")
        time.sleep(0.2)
    state = {"port": port, "log": log, "proc": proc}
    try:
        yield state
    finally:
        if proc.poll() is None:
            proc.stdin.close()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()


def _finish(state):
    """Stop the server; its log and the guard's report."""
    proc = state["proc"]
    if proc.poll() is None:
        proc.stdin.close()
        proc.wait(timeout=60)
    with open(state["log"]) as fh:
        text = fh.read()
    guard = [json.loads(ln[len(TAG):]) for ln in text.splitlines() if ln.startswith(TAG)
             and json.loads(ln[len(TAG):])["case"] == "guard"]
    return text, guard


# --- the bodies ---------------------------------------------------------------------------


def _deep(depth, leaf="{}"):
    return '{"a": ' * depth + leaf + "}" * depth


def strategies():
    from hypothesis import strategies as st

    text = st.text(st.sampled_from(list("ab!Z0\"\\é\U0001f600")), max_size=6)
    refs = st.sampled_from(REFS)
    leaf = st.one_of(
        st.builds(lambda t: {"type": t}, st.sampled_from(
            ["string", "integer", "number", "boolean", "null", "object", "array", "bogus", 5])),
        st.builds(lambda r: {"$ref": r}, refs),
        st.builds(lambda p: {"type": "string", "pattern": p}, st.sampled_from(PATTERNS)),
        st.builds(lambda f: {"type": "string", "format": f}, st.sampled_from(FORMATS)),
        st.builds(lambda v: {"enum": v}, st.lists(text, min_size=1, max_size=3)),
        st.just({}), st.just(True), st.just({"$ref": 7}))
    schemas = st.recursive(leaf, lambda inner: st.one_of(
        st.builds(lambda props: {"type": "object", "properties": props},
                  st.dictionaries(text, inner, max_size=3)),
        st.builds(lambda items: {"type": "array", "items": items}, inner),
        st.builds(lambda xs: {"anyOf": xs}, st.lists(inner, min_size=1, max_size=3)),
        st.builds(lambda d, r: {"$defs": {"A": d}, "$ref": r}, inner, refs),
        st.builds(lambda s: {"$id": "http://evil.example/s.json", **s}
                  if isinstance(s, dict) else s, inner)), max_leaves=8)
    big = st.sampled_from([
        {"type": "object", "properties": {f"p{k}": {"type": "string"} for k in range(25_000)}},
        json.loads(_deep(200)), {"type": "string", "pattern": "a" * 5000},
        {"type": "object", "properties": {"a": {"$ref": "#"}}}])
    schema = st.one_of(schemas, big)
    where = st.sampled_from(["strict_auto", "strict_named", "required", "named",
                             "json_schema", "json_schema_text", "guided_json",
                             "guided_json_text", "completion_json_schema",
                             "completion_guided_json"])
    bodies = st.builds(_schema_body, where, schema, st.booleans())
    raw = st.sampled_from([
        b'{"model": "tiny", "messages": [{"role": "user", "content": "\xff\xfe"}]}',
        b'{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}]}',
        b'{"model": "tiny", "prompt": "\\udfff x", "max_tokens": 3}',
        b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "tools": [{"type":'
        b' "function", "function": {"name": "f\\ud800", "strict": true, "parameters": {"type":'
        b' "object", "properties": {"\\udc00": {"pattern": "\\ud800"}}}}}]}',
        ('{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "guided_json": '
         + _deep(5000) + "}").encode(),
        ('{"model": "tiny", "messages": ' + "[" * 5000 + "]" * 5000 + "}").encode(),
        b'{"model": "tiny", "messages": "hi"}', b'{"model": "tiny", "messages": [5]}',
        b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "tools": 5}',
        b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "tools": [5]}',
        b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "tool_choice": []}',
        b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], '
        b'"response_format": "json"}',
        b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], '
        b'"response_format": {"type": "json_schema", "json_schema": {"schema": "{\\"$ref\\": '
        b'\\"file:///etc/passwd\\"}"}}}',
        b'{"model": "tiny", "prompt": 5, "guided_json": []}', b'[]', b'"x"', b'{',
        b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "n": "x"}',
        b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "guided_json": 5}',
    ])
    return st.one_of(bodies, st.builds(lambda r, s: (r, s, "chat" if b"messages" in r
                                                     else "completions"), raw, st.booleans()))


def _schema_body(where, schema, stream):
    """(raw body, streamed, endpoint) with ``schema`` placed ``where``."""
    chat = {"model": "tiny", "messages": [USER], "stream": stream}
    if where.startswith("strict"):
        chat["tools"] = [{"type": "function", "function": {
            "name": "hostile", "strict": True, "parameters": schema}}]
        if where == "strict_named":
            chat["tool_choice"] = {"type": "function", "function": {"name": "hostile"}}
    elif where in ("required", "named"):
        chat["tools"] = [{"type": "function", "function": {"name": "other", "parameters": {}}},
                         {"type": "function", "function": {"name": "hostile",
                                                           "parameters": schema}}]
        chat["tool_choice"] = "required" if where == "required" else {
            "type": "function", "function": {"name": "hostile"}}
    elif where.startswith("json_schema"):
        chat["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "x", "schema": json.dumps(schema) if where.endswith("text") else schema}}
    elif where.startswith("guided_json"):
        chat["guided_json"] = json.dumps(schema) if where.endswith("text") else schema
    else:
        body = {"model": "tiny", "prompt": "hi", "stream": stream, "max_tokens": 5}
        if where == "completion_json_schema":
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "x", "schema": schema}}
        else:
            body["guided_json"] = schema
        return json.dumps(body).encode(), stream, "completions"
    return json.dumps(chat).encode(), stream, "chat"


# --- sending ------------------------------------------------------------------------------


def send(client, raw, stream, endpoint):
    """(status, problems) of one body; a stream is read to its end."""
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    headers = {"content-type": "application/json"}
    if not stream:
        response = client.post(path, content=raw, headers=headers)
        return response.status_code, []
    problems = []
    with client.stream("POST", path, content=raw, headers=headers) as response:
        status = response.status_code
        for line in response.iter_lines():
            if line.startswith("data: {") and '"error"' in line[:40]:
                event = json.loads(line[6:])
                code = (event.get("error") or event).get("code", 0)
                if isinstance(code, int) and code >= 500:
                    problems.append(f"stream error event {line[:200]}")
    return status, problems


class Plain(threading.Thread):
    """Plain chat requests, one after another, timed, while hostile ones run."""

    def __init__(self, port):
        super().__init__(daemon=True)
        self.port, self.stop, self.latencies, self.failures = port, threading.Event(), [], []

    def run(self):
        import httpx

        with httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=60) as client:
            while not self.stop.is_set():
                start = time.perf_counter()
                response = client.post("/v1/chat/completions", json={
                    "model": "tiny", "messages": [USER], "max_tokens": 3})
                self.latencies.append(time.perf_counter() - start)
                if response.status_code != 200:
                    self.failures.append(response.status_code)
                time.sleep(0.02)


def test_hostile_bodies_never_act_never_stall_never_crash(hostile):
    import httpx
    from hypothesis import HealthCheck, given, settings

    plain = Plain(hostile["port"])
    plain.start()
    seen = {"statuses": {}, "problems": []}
    client = httpx.Client(base_url=f"http://127.0.0.1:{hostile['port']}", timeout=60)
    try:
        # the named case: the model calls a strict tool whose pattern backtracks forever
        slow = {"model": "tiny", "messages": [USER], "tools": [{"type": "function", "function": {
            "name": "slow_pattern", "strict": True, "parameters": SLOW}}]}
        for stream in (False, True):
            start = time.perf_counter()
            status, problems = send(client, json.dumps(dict(slow, stream=stream)).encode(),
                                    stream, "chat")
            assert status == 200 and problems == [], (status, problems)
            assert time.perf_counter() - start < 10  # the check's budget is 0.5 s
        # many tools, each within the limit of one schema, over the limit of one request
        big = {"type": "object", "properties": {f"p{k}": {"type": "string"}
                                                for k in range(9000)}}
        many = {"model": "tiny", "messages": [USER], "tool_choice": "required", "tools": [
            {"type": "function", "function": {"name": f"t{i}", "parameters": big}}
            for i in range(3)]}
        response = client.post("/v1/chat/completions", json=many)
        assert response.status_code == 400 and "the request's schemas hold more than 50000 " \
            "JSON values together (at `tools[2].function.parameters`)" in response.text, \
            response.text[:500]

        @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(strategies())
        def check(case):
            raw, stream, endpoint = case
            status, problems = send(client, raw, stream, endpoint)
            seen["statuses"][status] = seen["statuses"].get(status, 0) + 1
            assert status < 500 and problems == [], (status, problems, raw[:300])

        check()
    finally:
        plain.stop.set()
        plain.join(timeout=60)
        client.close()
    log, guard = _finish(hostile)
    assert guard and guard[0]["attempts"] == [], guard  # nothing left the server process
    errors = [ln for ln in log.splitlines() if "Traceback" in ln or " ERROR " in ln
              or ln.startswith("ERROR")]
    assert errors == [], "\n".join(errors[:10]) + "\n" + log[-3000:]
    assert "tool call arguments not checked against their schema: over budget" in log
    assert plain.failures == [] and plain.latencies, plain.failures
    assert max(plain.latencies) < STALL_S, sorted(plain.latencies)[-5:]
    print(f"plain requests: {len(plain.latencies)}, slowest {max(plain.latencies):.3f} s; "
          f"hostile answers by status: {seen['statuses']}")
    assert seen["statuses"].get(400, 0) > 10 and seen["statuses"].get(200, 0) > 10, seen

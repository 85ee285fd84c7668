"""Streamed hermes tool calls through vLLM 0.6.3's own OpenAI app (tool_stream_app.py ``serve``:
``build_app`` + ``init_app_state``, ``--enable-auto-tool-choice --tool-call-parser hermes``,
its ``OpenAIServingChat`` and ``Hermes2ProToolParser``, the default front end's
``MQLLMEngineClient``), however the model's output is split into deltas.

The model's output is drawn (Hypothesis): text before the calls or none, one to three
``<tool_call>``s whose JSON is written in several ways (key order, spacing, indentation, escaped
or raw non-ASCII), argument values of every JSON kind (strings with quotes, backslashes,
braces, ``<``), then split into deltas every way an engine delivers them: one token at a time,
n tokens, ``<tool_call>`` with or without JSON in the same delta, a call or the whole output in
one delta, ``</tool_call>`` in the finishing chunk or an end-of-sequence delta after it; some
are cut short (``finish_reason: "length"``).  The stream must give, per call, the name once
(with its id, in the first delta of its index; indexes 0, 1, ... in order), arguments whose
concatenation parses to what the model wrote (and to the unstreamed answer's), the text
before the calls as content, ``finish_reason: "tool_calls"`` (``"length"`` when cut, where
each call's arguments are a prefix of what the model wrote), and no ERROR in the server log.

With the shim (``hermes_tool_args`` and the hermes rows); vLLM 0.6.3 as released and the shim
without ``hermes_tool_args`` (main before it) fail the named splits of ``NAMED``.

On the same servers: a stream forced by a named ``tool_choice`` (row ``named_tool_stream``:
per choice, id, type and name once on the first delta, later deltas only arguments, index 0,
``finish_reason`` the engine's), and an unstreamed hermes call cut by ``max_tokens`` (row
``hermes_cut_call``: the same answer, no ERROR, one INFO line; a malformed call still logs its
ERROR).  vLLM 0.6.3 as released and the shim with those rows' kill switches show the faults.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
from helpers.probes import HARNESS

pytestmark = pytest.mark.real_vllm

REAL = os.path.join(HARNESS, "real")
sys.path.insert(0, REAL)

START, END = "<tool_call>", "</tool_call>"
#: args_off: the shim with the kill switches of the rows these tests prove (hermes_tool_args,
#: named_tool_stream, hermes_cut_call), the other rows on.
SERVERS = ("shim", "stock", "args_off")  # of conftest.TOOL_STREAM_SERVERS
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "weather",
                                         "parameters": {"type": "object"}}}


@pytest.fixture(scope="module")
def servers(tool_stream_servers):
    """The ports of the shim, stock and args_off apps (conftest.py), each checked to have the
    rows it claims."""
    ports = {}
    for name in SERVERS:
        info = tool_stream_servers[name]
        applied = info["applied"] or []
        for row in ("hermes_tool_args", "named_tool_stream", "hermes_cut_call"):
            assert (row in applied) == (name == "shim"), (name, row, info)
        ports[name] = info["port"]
    return ports


# --- the model's outputs and their splits -----------------------------------------------


class Output:
    """A model's output: the text before the calls, the calls (name, arguments, the call's
    JSON text, the arguments' JSON text as written), the whole text."""

    def __init__(self, before, calls, joiner="\n", pad=("", "")):
        self.before, self.calls = before, calls
        bodies = [f"{START}{pad[0]}{call[2]}{pad[1]}{END}" for call in calls]
        self.text = before + joiner.join(bodies)

    def __repr__(self):
        return f"Output({self.text!r})"

    @staticmethod
    def call(name, arguments, style="spaced", name_first=True):
        """A call written in one of the ways models write it (``style``: spaced, compact,
        indented, raw: non-ASCII unescaped)."""
        if style == "compact":
            args = json.dumps(arguments, separators=(",", ":"))
        elif style == "indented":
            args = json.dumps(arguments, indent=2)
        else:
            args = json.dumps(arguments, ensure_ascii=style != "raw")
        space = "" if style == "compact" else " "
        parts = [f'"name":{space}{json.dumps(name)}', f'"arguments":{space}{args}']
        if not name_first:
            parts.reverse()
        if style == "indented":
            return name, arguments, "{\n  " + ",\n  ".join(parts) + "\n}", args
        return name, arguments, "{" + f",{space}".join(parts) + "}", args


def units(text):
    """The output as the engine's tokens come (the tags are one token each): (start, end)."""
    out, i = [], 0
    while i < len(text):
        for tag in (START, END):
            if text.startswith(tag, i):
                out.append((i, i + len(tag)))
                i += len(tag)
                break
        else:
            out.append((i, i + 1))
            i += 1
    return out


def cut_points(text):
    """Where a delta may end: between tokens."""
    return [end for _, end in units(text)[:-1]]


def pieces_at(text, cuts):
    bounds = [0, *sorted(set(cuts)), len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


def every(text, n, tags_alone=False):
    """n tokens per delta (a tag alone in its delta with ``tags_alone``)."""
    cuts, count = [], 0
    for start, end in units(text):
        tag = end - start > 1
        if tags_alone and tag and count:
            cuts.append(start)
            count = 0
        count += 1
        if count == n or (tags_alone and tag):
            cuts.append(end)
            count = 0
    return pieces_at(text, [c for c in cuts if 0 < c < len(text)])


def by_call(text, json_alone=False):
    """Each call in one delta (``json_alone``: the tags alone, the JSON in one delta)."""
    cuts, i = [], 0
    while True:
        i = text.find(START, i)
        if i == -1:
            break
        j = text.index(END, i) + len(END)
        cuts += [i, i + len(START), j - len(END), j] if json_alone else [i, j]
        i = j
    return pieces_at(text, [c for c in cuts if 0 < c < len(text)])


# --- one stream, read as a client reads it ------------------------------------------------


def post(port, pieces, finish, stream=True):
    import httpx

    with httpx.Client(timeout=60) as http:
        key = http.post(f"http://127.0.0.1:{port}/standin/split",
                        json={"pieces": pieces, "finish": finish}).json()["key"]
        body = {"model": "tiny", "tools": [TOOL], "stream": stream,
                "messages": [{"role": "user", "content": f"split:{key}"}]}
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        if not stream:
            resp = http.post(url, json=body)
            return resp.status_code, resp.json()
        with http.stream("POST", url, json=body) as resp:
            lines = [ln[len("data: "):] for ln in resp.iter_lines() if ln.startswith("data: ")]
            return resp.status_code, lines


def errors(port):
    import httpx

    return httpx.get(f"http://127.0.0.1:{port}/standin/errors", timeout=60).json()


def problems(port, output, pieces, finish):
    """What is wrong with the stream (and the unstreamed answer) of ``output`` split into
    ``pieces``: [] when nothing."""
    seen = len(errors(port))
    status, lines = post(port, pieces, finish)
    out = []
    if status != 200 or lines[-1:] != ["[DONE]"]:
        return [f"HTTP {status}, last line {lines[-1:]}"]
    content, calls, order, finishes = "", {}, [], []
    for line in lines[:-1]:
        chunk = json.loads(line)
        if "error" in chunk:
            out.append(f"error chunk {chunk['error']}")
            continue
        for choice in chunk.get("choices", ()):
            delta = choice.get("delta") or {}
            content += delta.get("content") or ""
            for tc in delta.get("tool_calls") or ():
                index = tc.get("index")
                fn = tc.get("function") or {}
                if index not in calls:
                    order.append(index)
                    calls[index] = {"name": fn.get("name"), "id": tc.get("id"),
                                    "type": tc.get("type"), "arguments": ""}
                    if not (fn.get("name") and tc.get("id") and tc.get("type") == "function"):
                        out.append(f"call {index}: first delta without name, id or type: {tc}")
                elif fn.get("name") or tc.get("id"):
                    out.append(f"call {index}: name or id sent again: {tc}")
                calls[index]["arguments"] += fn.get("arguments") or ""
            if choice.get("finish_reason"):
                finishes.append(choice["finish_reason"])
    if order != list(range(len(order))):
        out.append(f"indexes in order of appearance: {order}")
    if len({c["id"] for c in calls.values()}) != len(calls):
        out.append("two calls with one id")
    cut = finish == "length"
    shown = output.text if not cut else "".join(pieces)
    first = shown.find(START)
    want_content = shown if first == -1 else shown[:first]
    if content != want_content:
        out.append(f"content {content!r}, the model wrote {want_content!r} before the calls")
    got = [calls[i] for i in order]
    if not cut:
        if [c["name"] for c in got] != [c[0] for c in output.calls]:
            out.append(f"names {[c['name'] for c in got]}")
        for k, (call, (_, arguments, _, _)) in enumerate(zip(got, output.calls)):
            try:
                if json.loads(call["arguments"]) != arguments:
                    out.append(f"call {k}: arguments {call['arguments']!r} parse to another "
                               f"value than the model's {arguments!r}")
            except ValueError:
                out.append(f"call {k}: the streamed arguments are not JSON: "
                           f"{call['arguments']!r}")
        want_finish = ["tool_calls"] if output.calls else ["stop"]
    else:
        for k, call in enumerate(got):
            if k >= len(output.calls) or call["name"] != output.calls[k][0]:
                out.append(f"call {k}: name {call['name']!r}, not the model's")
            elif not output.calls[k][3].startswith(call["arguments"]):
                out.append(f"call {k}: arguments {call['arguments']!r} are not a prefix of what "
                           f"the model wrote ({output.calls[k][3]!r})")
        want_finish = ["length"]
    if finishes != want_finish:
        out.append(f"finish_reason {finishes}, not {want_finish}")
    if not cut:
        out += unstreamed(port, output, pieces, finish)
    logged = errors(port)[seen:]
    if logged:
        out.append(f"the server logged {logged[:2]}")
    return out


def unstreamed(port, output, pieces, finish):
    status, body = post(port, pieces, finish, stream=False)
    if status != 200:
        return [f"unstreamed: HTTP {status} {body}"]
    message = body["choices"][0]["message"]
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"]))
             for c in message.get("tool_calls") or ()]
    if calls != [(c[0], c[1]) for c in output.calls]:
        return [f"unstreamed: calls {calls}, not the model's"]
    return []


# --- the named splits -----------------------------------------------------------------------

WEATHER = Output("", [Output.call("get_weather", {"city": "Paris"})])
TWO = Output("Let me look.\n", [Output.call("get_weather", {"city": "Paris", "days": 3}),
                                Output.call("get_time", {"zone": "Europe/Paris", "dst": True},
                                            style="compact")])
NESTED = Output("", [Output.call("plan", {"steps": [{"do": "a \"quoted\" {x}"}, 2, None],
                                          "when": 1.5}, style="indented", name_first=False)])
#: name -> (output, pieces, finish): the splits the frameworks meet and the reported ones.
NAMED = {
    "four_tokens_tags_alone": (WEATHER, every(WEATHER.text, 4, tags_alone=True), "stop"),
    "one_token": (WEATHER, every(WEATHER.text, 1), "stop"),
    "json_in_one_delta": (WEATHER, by_call(WEATHER.text, json_alone=True), "stop"),
    "call_in_one_delta": (WEATHER, by_call(WEATHER.text), "stop"),
    "end_tag_in_finishing_chunk": (WEATHER, every(WEATHER.text, 3), "stop"),
    "end_of_sequence_after": (WEATHER, every(WEATHER.text, 3) + [""], "stop"),
    "two_calls_text_before": (TWO, every(TWO.text, 5), "stop"),
    "nested_arguments_first": (NESTED, every(NESTED.text, 2) + [""], "stop"),
    "all_in_one_delta": (TWO, [TWO.text], "stop"),
    "cut_in_arguments": (WEATHER, every(WEATHER.text[:WEATHER.text.index("Par") + 2], 1),
                         "length"),
}


def test_named_splits(servers):
    """Every named split is right with the shim; vLLM 0.6.3 as released, and the shim with
    ``hermes_tool_args`` disabled, get the arguments wrong."""
    found = {name: {case: problems(port, output, pieces, finish)
                    for case, (output, pieces, finish) in NAMED.items()}
             for name, port in servers.items()}
    assert found["shim"] == {case: [] for case in NAMED}, found["shim"]
    for name in ("stock", "args_off"):
        wrong = {case for case, p in found[name].items() if p}
        assert {"four_tokens_tags_alone", "one_token", "json_in_one_delta",
                "end_tag_in_finishing_chunk", "cut_in_arguments"} <= wrong, (name, found[name])


# --- every split --------------------------------------------------------------------------


def strategies():
    from hypothesis import strategies as st

    chars = st.sampled_from(list('ab Z09"\\{}[]:,</>\n\té\u4e2d\U0001f600'))
    text = st.text(chars, max_size=8)
    scalars = (st.none() | st.booleans() | st.integers(-10**9, 10**9)
               | st.floats(allow_nan=False, allow_infinity=False) | text)
    values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                          | st.dictionaries(text, inner, max_size=3), max_leaves=6)
    names = st.from_regex(r"[a-z_][a-z0-9_]{0,10}", fullmatch=True)
    calls = st.builds(Output.call, names, st.dictionaries(text, values, max_size=4),
                      st.sampled_from(["spaced", "compact", "indented", "raw"]), st.booleans())

    @st.composite
    def split(draw):
        before = draw(st.sampled_from(["", "Sure.", "Let me check {x}.\n"]))
        output = Output(before, draw(st.lists(calls, min_size=1, max_size=3)),
                        joiner=draw(st.sampled_from(["\n", ""])),
                        pad=draw(st.sampled_from([("", ""), ("\n", "\n")])))
        text = output.text
        finish = "stop"
        if draw(st.integers(0, 9)) == 0:  # cut by max_tokens
            text = text[:draw(st.sampled_from(cut_points(text)))]
            finish = "length"
        how = draw(st.sampled_from(["every", "tags_alone", "random", "call", "json", "one"]))
        if how in ("every", "tags_alone"):
            pieces = every(text, draw(st.integers(1, 8)), tags_alone=how == "tags_alone")
        elif how == "random":
            points = cut_points(text)
            pieces = pieces_at(text, draw(st.sets(st.sampled_from(points), max_size=12))
                               if points else [])
        elif how == "call" and finish == "stop":
            pieces = by_call(text)
        elif how == "json" and finish == "stop":
            pieces = by_call(text, json_alone=True)
        else:
            pieces = [text]
        if finish == "stop" and draw(st.booleans()):
            pieces.append("")  # the end-of-sequence token in a delta of its own
        return output, pieces, finish

    return split()


def test_every_split(servers):
    """The property, for outputs and splits Hypothesis draws (deterministically: the same
    examples on every machine with the pinned Hypothesis), through the shim's server."""
    from hypothesis import HealthCheck, given, settings

    @settings(max_examples=150, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(strategies())
    def check(case):
        output, pieces, finish = case
        assert problems(servers["shim"], output, pieces, finish) == [], (output, pieces)

    check()


# --- a stream forced by a named tool_choice (row named_tool_stream) -------------------------

ARGUMENTS = ['{"', "city", '":', ' "', "Paris", '"}']


def named(port, pieces, finish, n=1):
    """The chunks of a streamed request forcing ``get_weather`` by name: per choice, its
    tool-call deltas and its finish reasons."""
    import httpx

    with httpx.Client(timeout=60) as http:
        key = http.post(f"http://127.0.0.1:{port}/standin/split",
                        json={"pieces": pieces, "finish": finish}).json()["key"]
        body = {"model": "tiny", "tools": [TOOL], "stream": True, "n": n,
                "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
                "messages": [{"role": "user", "content": f"split:{key}"}]}
        with http.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions",
                         json=body) as resp:
            assert resp.status_code == 200, resp.read()
            lines = [ln[len("data: "):] for ln in resp.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]", lines
    calls, finishes = {}, {}
    for line in lines[:-1]:
        for choice in json.loads(line).get("choices", ()):
            index = choice["index"]
            calls.setdefault(index, []).extend((choice.get("delta") or {}).get("tool_calls")
                                               or ())
            if choice.get("finish_reason"):
                finishes.setdefault(index, []).append(choice["finish_reason"])
    return calls, finishes


def named_problems(calls, finishes, n, finish, arguments):
    """What a client reading the stream finds wrong: [] when nothing."""
    out = []
    if sorted(calls) != list(range(n)):
        out.append(f"choices with calls: {sorted(calls)}")
    for choice, deltas in sorted(calls.items()):
        first, rest = deltas[0], deltas[1:]
        if not (first.get("id") and first.get("type") == "function"
                and (first.get("function") or {}).get("name") == "get_weather"):
            out.append(f"choice {choice}: first delta without id, type or name: {first}")
        again = [d for d in rest if d.get("id") or d.get("type")
                 or (d.get("function") or {}).get("name")]
        if again:
            out.append(f"choice {choice}: id, type or name sent again: {again[:2]}")
        if {d.get("index") for d in deltas} != {0}:
            out.append(f"choice {choice}: call indexes {[d.get('index') for d in deltas]}")
        joined = "".join((d.get("function") or {}).get("arguments") or "" for d in deltas)
        if joined != arguments:
            out.append(f"choice {choice}: arguments {joined!r}, the model wrote {arguments!r}")
        if finishes.get(choice) != [finish]:
            out.append(f"choice {choice}: finish_reason {finishes.get(choice)}, not {finish}")
    return out


def test_named_tool_stream(servers):
    """Each choice's forced call is streamed as OpenAI streams it with the shim (n=1 and 2,
    whole and cut); vLLM 0.6.3 as released and the row's kill switch repeat the name, send no
    id and give choice 1's call index 1."""
    cases = {"whole": (ARGUMENTS, "stop", 1), "two_choices": (ARGUMENTS, "stop", 2),
             "cut": (ARGUMENTS[:4], "length", 2)}
    found = {}
    for name in ("shim", "stock", "args_off"):
        found[name] = {}
        for case, (pieces, finish, n) in cases.items():
            calls, finishes = named(servers[name], pieces, finish, n)
            found[name][case] = named_problems(calls, finishes, n, finish, "".join(pieces))
    assert found["shim"] == {case: [] for case in cases}, found["shim"]
    for name in ("stock", "args_off"):
        for case, (_, _, n) in cases.items():
            text = " ".join(found[name][case])
            assert "first delta without id" in text and "sent again" in text, (name, case)
            assert ("call indexes [1" in text) == (n == 2), (name, case, text)


# --- an unstreamed hermes call cut by max_tokens (row hermes_cut_call) -----------------------


def shim_log(port):
    import httpx

    return httpx.get(f"http://127.0.0.1:{port}/standin/shim_log", timeout=60).json()


def test_cut_call_unstreamed(servers):
    """A call cut inside its JSON: the same answer (the text, no calls, ``length``) with and
    without the shim; 0.6.3 logs an ERROR with the JSONDecodeError, the shim one INFO line.
    A closed call whose JSON is broken still logs 0.6.3's ERROR with the shim."""
    cut = WEATHER.text[:WEATHER.text.index("Par") + 2]
    broken = '<tool_call>\n{"name": "get_weather", "arguments": {"city": }}\n</tool_call>'
    answers, logged, infos = {}, {}, {}
    for name in ("shim", "stock", "args_off"):
        port = servers[name]
        errors_before, shim_before = len(errors(port)), len(shim_log(port))
        status, body = post(port, every(cut, 3), "length", stream=False)
        assert status == 200, body
        choice = body["choices"][0]
        answers[name] = (choice["message"]["content"], choice["message"]["tool_calls"],
                         choice["finish_reason"])
        logged[name] = errors(port)[errors_before:]
        infos[name] = [r for r in shim_log(port)[shim_before:] if "hermes_cut_call" in
                       r["message"]]
        status, body = post(port, every(broken, 4), "stop", stream=False)
        assert status == 200 and body["choices"][0]["message"]["tool_calls"] == [], body
        malformed = errors(port)[errors_before + len(logged[name]):]
        assert [r["message"] for r in malformed] == [
            "Error in extracting tool call from response."], (name, malformed)
    assert answers["shim"] == answers["stock"] == (cut, [], "length"), answers
    assert logged["shim"] == [] and [r["level"] for r in infos["shim"]] == ["INFO"], (
        logged["shim"], infos["shim"])
    for name in ("stock", "args_off"):
        assert [(r["message"], (r["exception"] or "").split(":")[0]) for r in logged[name]] == [
            ("Error in extracting tool call from response.", "JSONDecodeError")], logged[name]
        assert infos[name] == [], infos[name]

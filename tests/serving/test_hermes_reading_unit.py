"""Row ``hermes_tool_args``'s reading of a streamed hermes output (``hermes_reading.Stream``)
without vLLM, over outputs and splits Hypothesis draws: each call's arguments streamed are
exactly the text the model wrote for them (a prefix of it while the output is cut), the name
once, in the first delta of its index, the text before the calls as content.  Through vLLM
0.6.3's own server app: tests/serving/test_hermes_stream.py.
"""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_bi100_patch.serving.hermes_reading import END, START, Stream

TEXT = st.text(st.sampled_from(list('ab Z09"\\{}[]:,</>\n\té\u4e2d\U0001f600')), max_size=8)
VALUES = st.recursive(st.none() | st.booleans() | st.integers(-10**9, 10**9)
                      | st.floats(allow_nan=False, allow_infinity=False) | TEXT,
                      lambda inner: st.lists(inner, max_size=3)
                      | st.dictionaries(TEXT, inner, max_size=3), max_leaves=6)
#: The arguments as written: any JSON value (hermes models write an object) in several styles.
WRITTEN = st.builds(lambda v, kw: json.dumps(v, **kw),
                    st.dictionaries(TEXT, VALUES, max_size=4) | VALUES,
                    st.sampled_from([{}, {"separators": (",", ":")}, {"indent": 2},
                                     {"ensure_ascii": False}]))


@st.composite
def outputs(draw):
    """(text, calls as (name, arguments text), text before the calls)."""
    calls = draw(st.lists(st.tuples(st.from_regex(r"[a-z_][a-z0-9_]{0,10}", fullmatch=True),
                                    WRITTEN), min_size=1, max_size=3))
    before = draw(st.sampled_from(["", "Sure.", "Let me check {x} <y>.\n"]))
    bodies = []
    for name, args in calls:
        parts = [f'"name": {json.dumps(name)}', f'"arguments": {args}']
        if draw(st.booleans()):
            parts.reverse()
        pad = draw(st.sampled_from(["", "\n", " "]))
        bodies.append(f"{START}{pad}{{{', '.join(parts)}}}{pad}{END}")
    return before + draw(st.sampled_from(["\n", ""])).join(bodies), calls, before


def _units(text):
    """Where a delta may end: between tokens (each tag one token)."""
    out, i = [], 0
    while i < len(text):
        tag = next((t for t in (START, END) if text.startswith(t, i)), None)
        i += len(tag) if tag else 1
        out.append(i)
    return out[:-1]


def _read(pieces):
    stream, content, calls = Stream(), "", {}
    for piece in pieces:
        got, deltas = stream.feed(piece)
        content += got
        for _, delta in deltas:
            fn = delta["function"]
            if delta["index"] not in calls:
                assert delta["index"] == len(calls) and "name" in fn and delta["id"] \
                    and delta["type"] == "function", delta
                calls[delta["index"]] = [fn["name"], ""]
            else:
                assert "name" not in fn and "id" not in delta, delta
            calls[delta["index"]][1] += fn.get("arguments", "")
    return content, [tuple(calls[i]) for i in range(len(calls))]


@settings(max_examples=400, deadline=None)
@given(outputs(), st.data())
def test_the_arguments_are_what_the_model_wrote(output, data):
    text, calls, before = output
    cuts = sorted(data.draw(st.sets(st.sampled_from(_units(text)), max_size=20)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    assert _read(pieces) == (before, calls)


@settings(max_examples=200, deadline=None)
@given(outputs(), st.data())
def test_a_cut_output_sends_a_prefix_of_what_the_model_wrote(output, data):
    text, calls, before = output
    text = text[:data.draw(st.sampled_from(_units(text)))]
    cuts = _units(text)[2::3]  # three tokens a delta
    content, got = _read([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])
    assert content == text[:len(before)]
    for (name, args), (want_name, written) in zip(got, calls):
        assert name == want_name and written.startswith(args), (name, args, written)


def test_text_between_calls_is_content_only_when_more_than_whitespace():
    call = f'{START}{{"name": "f", "arguments": {{}}}}{END}'
    assert _read([f"A{call}\n", f"{call}\n\n"]) == ("A", [("f", "{}"), ("f", "{}")])
    assert _read([call, "\nthen ", "more"]) == ("\nthen more", [("f", "{}")])


def test_a_number_at_the_end_of_a_call_ends_with_it():
    assert _read([f'{START}{{"name": "f", "arguments": 12', f"}}{END}"])[1] == [("f", "12")]
    assert _read([f'{START}{{"arguments": -1.5e3, "name": "g"}}{END}'])[1] == [("g", "-1.5e3")]


class _Delta:
    """A stand-in of 0.6.3's DeltaMessage (the fields it is given)."""

    def __init__(self, **fields):
        self.fields = fields


class _Parser:
    """The state 0.6.3's Hermes2ProToolParser keeps for the front end."""

    def __init__(self):
        self.prev_tool_call_arr, self.streamed_args_for_tool = [], []
        self.current_tool_id, self.current_tool_name_sent = -1, False


def test_the_parsers_state_and_the_finishing_chunk():
    """``stream`` keeps the parser's state as 0.6.3 does for the front end (a named call in
    ``prev_tool_call_arr``: finish reason "tool_calls"), each choice under its own token list;
    the finishing check answers False for its deltas only."""
    import types

    from vllm_bi100_patch.activation import config
    from vllm_bi100_patch.serving import hermes_args

    module = types.SimpleNamespace(DeltaMessage=_Delta)
    parser = _Parser()
    text = f'Hi{START}{{"name": "f", "arguments": {{"a": [1, 2]}}}}{END}'
    lists = {0: [], 1: []}
    out = {0: [], 1: []}
    for a, b in ((0, 2), (2, 20), (20, 40), (40, len(text))):
        for choice in (0, 1):  # two choices sharing the parser, as 0.6.3's generator does
            previous = lists[choice]
            lists[choice] = previous + [a]
            out[choice].append(hermes_args.stream(parser, module, text[:a], text[a:b], previous,
                                                  lists[choice]))
    assert out[0][0].fields == {"content": "Hi"}
    calls = [d.fields.get("tool_calls") for d in out[0] if d is not None]
    assert "".join(c[0]["function"].get("arguments", "") for c in calls if c) == '{"a": [1, 2]}'
    assert [d.fields if d else None for d in out[1]][0] == {"content": "Hi"}
    assert [c["name"] for c in parser.prev_tool_call_arr] == ["f", "f"]  # one per choice
    assert parser.prev_tool_call_arr[0]["arguments"] == {"a": [1, 2]}
    assert parser.streamed_args_for_tool == ['{"a": [1, 2]}'] * 2
    settings = config.load({config.MODE: "1"})
    check = hermes_args.make_finish_wrapper(None, None, module, settings)
    replaced = lambda delta_message, output: True  # noqa: E731  (0.6.3 would replace)
    assert check(replaced, None, (out[0][-1], None), {}) is False
    assert check(replaced, None, (_Delta(content="x"), None), {}) is True
    off = config.load({config.MODE: "1", config.DISABLE: "hermes_tool_start"})
    assert "hermes_tool_start is disabled" in hermes_args.args_needed(module, off)

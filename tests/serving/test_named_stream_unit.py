"""Rows ``named_tool_stream`` and ``hermes_cut_call`` without vLLM: a named stream's chunks as
0.6.3 writes them rewritten (id and type once, the name once, index 0 per choice; other chunks
untouched; each row's kill switch), and which hermes outputs are a call cut short.  Through
vLLM 0.6.3's own server app: tests/serving/test_hermes_stream.py.
"""

from __future__ import annotations

import asyncio
import json
import types

import pytest

from vllm_bi100_patch.activation import config
from vllm_bi100_patch.serving import hermes_cut, named_stream, tool_stream


def chunk(index, arguments, name="get_weather", finish=None):
    """A chunk as 0.6.3's named branch writes it (``exclude_unset``: no id, no type)."""
    choice = {"index": index, "delta": {"tool_calls": [
        {"index": index, "function": {"name": name, "arguments": arguments}}]},
        "finish_reason": finish}
    return "data: " + json.dumps({"id": "chatcmpl-1", "object": "chat.completion.chunk",
                                  "created": 1, "model": "tiny", "choices": [choice]},
                                 separators=(",", ":")) + "\n\n"


def calls_of(lines):
    out = {}
    for line in lines:
        if line.startswith("data: {"):
            for choice in json.loads(line[len("data: "):])["choices"]:
                out.setdefault(choice["index"], []).extend(choice["delta"].get("tool_calls")
                                                           or ())
    return out


STOCK = [chunk(i, a, finish="stop" if a == '"}' else None)
         for a in ('{"', 'city', '": "', 'Paris', '"}') for i in (0, 1)]


def test_rewrite_sends_id_type_and_name_once_per_choice():
    rewrite = named_stream.Rewrite("get_weather")
    calls = calls_of([rewrite.line(line) for line in STOCK])
    assert sorted(calls) == [0, 1]
    ids = set()
    for deltas in calls.values():
        first, rest = deltas[0], deltas[1:]
        assert list(first) == ["index", "id", "type", "function"]
        assert first["index"] == 0 and first["type"] == "function"
        assert first["id"].startswith("chatcmpl-tool-") and first["function"] == {
            "name": "get_weather", "arguments": '{"'}
        ids.add(first["id"])
        assert all(d == {"index": 0, "function": {"arguments": d["function"]["arguments"]}}
                   for d in rest), rest
        assert "".join(d["function"]["arguments"] for d in deltas) == '{"city": "Paris"}'
    assert len(ids) == 2


def test_rewrite_leaves_other_chunks_alone():
    rewrite = named_stream.Rewrite("get_weather")
    role = 'data: {"id":"x","choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
    for line in (role, "data: [DONE]\n\n", 'data: {"error": "tool_calls":[}\n\n'):
        assert rewrite.line(line) == line


class Request:
    def __init__(self, tool_choice):
        self.tool_choice = tool_choice
        self.stream_options = None


class ChatCompletionNamedToolChoiceParam:
    def __init__(self, name):
        self.function = types.SimpleNamespace(name=name)


def stream_of(disabled):
    """The stream generator's wrapper over 0.6.3's chunks, under ``disabled`` rows."""
    settings = config.load({config.MODE: "1", config.DISABLE: disabled})
    module = types.SimpleNamespace(ChatCompletionStreamResponse=None,
                                   ChatCompletionResponseStreamChoice=None, DeltaMessage=None,
                                   UsageInfo=None)
    wrapper = tool_stream.make_stream_wrapper(None, None, module, settings)  # type: ignore

    async def generator(request, results, *rest):
        async for _ in results:
            pass
        for line in STOCK + ["data: [DONE]\n\n"]:
            yield line

    async def results():
        return
        yield

    async def read():
        request = Request(ChatCompletionNamedToolChoiceParam("get_weather"))
        stream = wrapper(generator, None, (request, results(), "id", [], None, None), {})
        return [line async for line in stream]

    return asyncio.run(read())


@pytest.mark.parametrize("disabled", ["", "stream_finish_reason"])
def test_the_wrapper_rewrites_with_either_row_installing_it(disabled):
    calls = calls_of(stream_of(disabled))
    assert [[d.get("id") is not None for d in calls[i]] for i in (0, 1)] == [
        [True, False, False, False, False]] * 2


def test_kill_switch_leaves_the_chunks_as_0_6_3_sends_them():
    assert stream_of("named_tool_stream") == STOCK + ["data: [DONE]\n\n"]


START, END = "<tool_call>", "</tool_call>"
CALL = '{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2.5e3, true]}}'


def test_every_cut_of_a_call_is_a_cut_call():
    whole = f"Let me see.\n{START}\n{CALL}\n{END}"
    begin = whole.index(START) + len(START)
    for end in range(begin, whole.index(END)):
        text = whole[:end]
        complete = text[begin:].strip() == CALL
        assert hermes_cut.cut_inside_call(text, START, END) is not complete, text


@pytest.mark.parametrize("text", [
    f'{START}{{"name": "f", "arguments": {{"a": }}}}',           # a value missing
    f'{START}{{"name": "f"}}}} and more',                         # text after the JSON
    f'{START}{{"name" "f"',                                        # no colon
    f'{START}{{"name": "f", "arguments": {{"a": 1]',              # a wrong bracket
    f'{START}{{"name": "f", "arguments": {{"a": xyz',             # not a literal
    f'{START}{{bad}}{END}{START}{{"na',                            # a closed call broken
    f'{START}{{"name": "f", "arguments": {{}}}}{END}',             # closed: the original's
    f'{START}{{"name": "f", "arguments": {{}}}}',                  # complete: the original's
    "no call at all",
])
def test_what_is_not_a_cut_call_goes_to_the_original(text):
    assert not hermes_cut.cut_inside_call(text, START, END)


def test_the_cut_answer_is_the_originals():
    class Info:
        def __init__(self, **kw):
            self.kw = kw

    module = types.SimpleNamespace(ExtractedToolCallInformation=Info)
    wrapper = hermes_cut.make_wrapper(None, None, module, config.load({}))  # type: ignore
    parser = types.SimpleNamespace(tool_call_start_token=START, tool_call_end_token=END)

    def original(*args, **kwargs):
        return "the original"

    cut = f"Sure.{START}{CALL[:30]}"
    got = wrapper(original, parser, (cut,), {"request": None})
    assert got.kw == {"tools_called": False, "tool_calls": [], "content": cut}
    assert wrapper(original, parser, (f"{START}{{bad}}{END}", None), {}) == "the original"

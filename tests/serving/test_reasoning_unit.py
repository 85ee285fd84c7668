"""Reasoning output without vLLM (docs/serving-compat.md, "Reasoning output"): the split of
the thinking off an output (``reasoning.Split``), whole or in any deltas, the stream's chunks
(``reasoning.Chunks``), and how a server asks for a parser (``reasoning_config``).  Through
vLLM 0.6.3's own app: tests/serving/test_responses.py, tests/serving/frameworks."""

from __future__ import annotations

import argparse
import asyncio
import json
import types

import pytest
from hypothesis import given, settings, strategies as st

from vllm_bi100_patch.activation import config
from vllm_bi100_patch.serving import reasoning, reasoning_config

SETTINGS = config.load({config.MODE: "1"})


def whole(parser, text):
    return reasoning.Split(parser).whole(text)


@pytest.mark.parametrize("parser, text, want", [
    ("deepseek_r1", "<think>a</think>b", ("a", "b")),
    ("deepseek_r1", "a</think>\n\nb", ("a", "\n\nb")),       # the template opened <think>
    ("deepseek_r1", "  <think>a</think>", ("a", None)),
    ("deepseek_r1", "only thinking, cut", ("only thinking, cut", None)),
    ("deepseek_r1", "", (None, None)),
    ("qwen3", "<think>\na\n</think>\n\nb", ("\na\n", "\n\nb")),
    ("qwen3", "no thinking here", (None, "no thinking here")),
    ("qwen3", "<think>cut before the end", (None, "<think>cut before the end")),
    ("qwen3", "b <think>a</think>", (None, "b <think>a</think>")),  # not leading: content
])
def test_a_whole_answer_is_split_as_upstreams_parser_reads_it(parser, text, want):
    assert whole(parser, text) == want


def _fed(parser, pieces):
    split = reasoning.Split(parser)
    thinking, answer = "", ""
    for piece in pieces:
        t, a = split.feed(piece)
        thinking, answer = thinking + t, answer + a
    t, a = split.finish()
    return thinking + t, answer + a


TEXT = st.text(alphabet="ab<>/thinke \n", max_size=40)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(["deepseek_r1", "qwen3"]), TEXT, TEXT, TEXT,
       st.lists(st.integers(0, 60), max_size=6))
def test_any_deltas_split_as_the_whole_text(parser, before, thinking, after, cuts):
    """However vLLM cuts the output into deltas (a tag split over two of them included), the
    thinking and the answer streamed are the whole answer's."""
    text = before + "<think>" + thinking + "</think>" + after if thinking else before + after
    points = sorted({min(c, len(text)) for c in cuts})
    pieces = [text[i:j] for i, j in zip([0] + points, points + [len(text)])]
    streamed = _fed(parser, pieces)
    assert "".join(streamed) in (text, text.replace("<think>", "", 1).replace("</think>", "", 1),
                                 text.replace("</think>", "", 1),
                                 text.lstrip().replace("<think>", "", 1).replace("</think>", "", 1),
                                 text.lstrip().replace("<think>", "", 1))
    got = whole(parser, text)
    if parser == "deepseek_r1" or got[0] is not None:
        assert streamed == (got[0] or "", got[1] or "")
    assert streamed == _fed(parser, [text])


class Out:
    def __init__(self, text, index=0, finish=None):
        self.text, self.index, self.finish_reason = text, index, finish
        self.token_ids = [1] * len(text)


def _run(taken, texts):
    async def results():
        for i, text in enumerate(texts):
            yield types.SimpleNamespace(outputs=[Out(text, finish="stop" if i == len(texts) - 1
                                                     else None)])

    async def collect():
        return [[o.text for o in r.outputs] async for r in taken.outputs(results())]

    return asyncio.run(collect())


def test_outputs_lose_the_thinking_and_keep_their_token_ids():
    taken = reasoning.Taken("deepseek_r1", whole=False)
    assert _run(taken, ["<think>ab", "c</th", "ink>d", "e"]) == [[""], [""], ["d"], ["e"]]
    assert taken.take(0) == "abc" and taken.take(0) == ""
    whole_taken = reasoning.Taken("qwen3", whole=True)
    assert _run(whole_taken, ["<think>x</think>y"]) == [["y"]]
    assert whole_taken.thinking == {0: "x"}


def _line(chunk):
    return f"data: {json.dumps(chunk)}\n\n"


def test_chunks_carry_the_thinking_in_the_next_delta_of_their_choice():
    taken = reasoning.Taken("deepseek_r1", whole=False)
    chunks = reasoning.Chunks(taken)
    head = {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    role = _line(dict(head, choices=[{"index": 0, "delta": {"role": "assistant", "content": ""}}]))
    taken.pending[0] = "thought"
    assert chunks.line(role) == role  # never in the role chunk
    empty = _line(dict(head, choices=[{"index": 0, "delta": {"content": ""}}]))
    got = json.loads(chunks.line(empty)[len("data: "):])
    assert got["choices"][0]["delta"] == {"reasoning_content": "thought"}
    taken.pending[0] = "more"
    text = _line(dict(head, choices=[{"index": 0, "delta": {"content": "answer"}}]))
    got = json.loads(chunks.line(text)[len("data: "):])
    assert got["choices"][0]["delta"] == {"content": "answer", "reasoning_content": "more"}
    taken.pending[1] = "left"
    rest = chunks.rest()
    got = json.loads(rest[len("data: "):])
    assert got["id"] == "c1" and got["choices"][0] == {
        "index": 1, "delta": {"reasoning_content": "left"}, "logprobs": None,
        "finish_reason": None}
    assert chunks.rest() == "" and chunks.line("data: [DONE]\n\n") == "data: [DONE]\n\n"


@pytest.mark.parametrize("fields, guided", [
    ({}, False), ({"guided_json": {}}, True), ({"guided_choice": ["a"]}, True),
    ({"response_format": types.SimpleNamespace(type="json_object")}, True),
    ({"response_format": types.SimpleNamespace(type="text")}, False),
    ({"tool_choice": "auto"}, False), ({"tool_choice": object()}, True)])
def test_a_guided_request_is_not_split(fields, guided):
    assert reasoning.guided(types.SimpleNamespace(**fields)) is guided


def _parser():
    wrapper = reasoning_config.make_flags_wrapper(None, None, None, SETTINGS)
    return wrapper(lambda p: p, None, (argparse.ArgumentParser(),), {})


def test_the_flags_are_upstreams_and_the_parser_is_checked():
    args = _parser().parse_args(["--enable-reasoning", "--reasoning-parser", "qwen3"])
    assert args.enable_reasoning and args.reasoning_parser == "qwen3"
    assert reasoning_config.chosen(args, SETTINGS) == "qwen3"
    with pytest.raises(SystemExit):
        _parser().parse_args(["--reasoning-parser", "granite"])
    off = _parser().parse_args([])
    assert reasoning_config.chosen(off, SETTINGS) is None
    with pytest.raises(ValueError, match="--enable-reasoning needs --reasoning-parser"):
        reasoning_config.chosen(argparse.Namespace(enable_reasoning=True,
                                                   reasoning_parser=None), SETTINGS)
    env = config.load({config.MODE: "1", config.REASONING_PARSER: "deepseek_r1"})
    assert reasoning_config.chosen(off, env) == "deepseek_r1"
    assert reasoning_config.chosen(args, env) == "qwen3"  # the flag wins
    bad = config.load({config.MODE: "1", config.REASONING_PARSER: "granite"})
    assert bad.reasoning_parser is None and "VLLM_BI100_REASONING_PARSER='granite'" in \
        bad.errors[0]


def test_the_app_state_remembers_the_parser_of_its_chat_server():
    wrapper = reasoning_config.make_state_wrapper(None, None, None, SETTINGS)
    state = types.SimpleNamespace()

    class Serving:
        pass

    def init(engine_client, model_config, state, args):
        state.openai_serving_chat = Serving()

    wrapper(init, None, (None, None, state, argparse.Namespace(reasoning_parser="qwen3")), {})
    assert reasoning_config.parser_of(state.openai_serving_chat) == "qwen3"
    other = types.SimpleNamespace()
    wrapper(init, None, (None, None, other, argparse.Namespace()), {})
    assert reasoning_config.parser_of(other.openai_serving_chat) is None
    with pytest.raises(ValueError, match="not served"):
        wrapper(init, None, (None, None, types.SimpleNamespace(),
                             argparse.Namespace(reasoning_parser="granite")), {})

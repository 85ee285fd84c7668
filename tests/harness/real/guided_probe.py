"""vLLM 0.6.3's own guided decoding (its ``guided_decoding`` package and outlines, as its
engine builds it) without a model, one report line per case (``helpers.probes.report``).

``python guided_probe.py enforce``: for a ``json_schema`` response format, a named (forced)
tool and ``tool_choice: "required"``, the guide 0.6.3's request path gives (the chat request
class's ``to_sampling_params``, the shim's mappings included: for ``required`` the schema the
shim's chat row serves it with, an array of at least one ``{"name": <tool>, "parameters": <its
parameters>}``, each call's parameters then also checked against its own tool's), its logits
processor built by vLLM's ``get_local_guided_decoding_logits_processor`` over serving_app.py's
byte-level tokenizer, then ``RUNS`` decodes that sample from seeded random logits through the
processor until the end-of-sequence token: the texts, and whether each parses as JSON valid under the schema.

``python guided_probe.py guides``: what each kind of guide compiles to, as digests of the
finite-state machines (outlines' ``RegexGuide``: for every state, the allowed tokens and the
next states) of a JSON schema, a regex and a choice, and the size of outlines' airport-code
enum: run once with the shim's empty ``AIRPORT_LIST`` and once with a real-shaped
``pyairports.airports`` on the path, the test compares them.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # tests/: the helpers package
sys.path.insert(0, HERE)

import engine_harness  # noqa: E402
from helpers.probes import report  # noqa: E402

RUNS = 5
MAX_STEPS = 3000
ANSWER = {"type": "object", "properties": {"answer": {"type": "string"},
                                           "score": {"type": "integer"},
                                           "final": {"type": "boolean"}},
          "required": ["answer", "score", "final"]}
WEATHER = {"type": "object", "properties": {"city": {"type": "string"},
                                            "unit": {"enum": ["c", "f"]},
                                            "days": {"type": "integer"}},
           "required": ["city", "unit"]}
TIME = {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
#: Tools whose parameters refer within themselves (issue 39): a JSON pointer, ``$defs`` below
#: the top, an anchor; under ``required`` each is nested and its references rewritten.
REFS_TOOLS = [
    {"type": "function", "function": {"name": "pointer", "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "enum": ["x", "y"]},
                                         "b": {"$ref": "#/properties/a"}},
        "required": ["a", "b"]}}},
    {"type": "function", "function": {"name": "nested_defs", "parameters": {
        "type": "object", "properties": {"x": {
            "type": "object", "$defs": {"In": {"type": "integer"}},
            "properties": {"y": {"$ref": "#/properties/x/$defs/In"}}, "required": ["y"]}},
        "required": ["x"]}}},
    {"type": "function", "function": {"name": "anchored", "parameters": {
        "type": "object", "$defs": {"T": {"$anchor": "flag", "type": "boolean"}},
        "properties": {"t": {"$ref": "#flag"}}, "required": ["t"]}}},
]
#: A recursive tool ("#" inside it): outlines 0.0.46 builds no guide of recursion, named or
#: under required alike (the probe reports what each path raises).
RECURSIVE = {"type": "function", "function": {"name": "tree", "parameters": {
    "type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}}}}
REGEX = r"[a-c]{2}\d(x|yz)?"
CHOICE = ["yes", "no", "maybe"]


USER = [{"role": "user", "content": "hi"}]


def _required(tools=TOOLS):
    """``tool_choice: "required"`` as the front end serves it: the guided-decoding parameters
    the chat request class (the shim's, in these probes) gives, one schema accepting a call of
    any of the tools."""
    # The server imports serving_chat (where the shim's chat_tool_calls row turns the guided
    # answer into tool calls); without it the chat row refuses "required".
    import vllm.entrypoints.openai.serving_chat  # noqa: F401
    from vllm.entrypoints.openai.protocol import ChatCompletionRequest

    request = ChatCompletionRequest(model="tiny", messages=USER, tools=tools,
                                    tool_choice="required")
    return request.to_sampling_params(64).guided_decoding


def _calls_match(tools):
    """A check that each call of a ``required`` answer has parameters valid under its own
    tool's schema (as the tool was sent)."""
    def check(value):
        import jsonschema

        params = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
        for call in value:
            jsonschema.validate(call["parameters"], params[call["name"]])
    return check


def _is_object(value):
    if not isinstance(value, dict):
        raise ValueError(f"not a JSON object: {value!r}")


def _request_guides():
    """(name, guided-decoding parameters, schema, extra check) as 0.6.3's request path makes
    them."""
    from vllm.entrypoints.openai.protocol import ChatCompletionRequest

    schema_request = ChatCompletionRequest(model="tiny", messages=USER, response_format={
        "type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}})
    named = ChatCompletionRequest(model="tiny", messages=USER, tools=TOOLS, tool_choice={
        "type": "function", "function": {"name": "get_weather"}})
    required = _required()
    refs = _required(REFS_TOOLS)
    empty = ChatCompletionRequest(model="tiny", messages=USER, response_format={
        "type": "json_schema", "json_schema": {"name": "any", "schema": {}}})
    bare = ChatCompletionRequest(model="tiny", messages=USER, tools=[
        {"type": "function", "function": {"name": "ping"}}], tool_choice={
        "type": "function", "function": {"name": "ping"}})
    return [("json_schema", schema_request.to_sampling_params(64).guided_decoding, ANSWER,
             None),
            ("named_tool", named.to_sampling_params(64).guided_decoding, WEATHER, None),
            ("required", required, required.json if required else None, _calls_match(TOOLS)),
            ("required_refs", refs, refs.json if refs else None, _calls_match(REFS_TOOLS)),
            ("json_schema_empty", empty.to_sampling_params(64).guided_decoding, {},
             _is_object),
            ("named_tool_no_parameters", bare.to_sampling_params(64).guided_decoding, {},
             _is_object)]


def recursion():
    """What outlines does with a recursive tool, named and under ``required``: the exception
    type each build raises (or "built")."""
    from vllm.entrypoints.openai.protocol import ChatCompletionRequest
    from vllm.model_executor.guided_decoding import (
        get_local_guided_decoding_logits_processor)
    from vllm.transformers_utils.tokenizer import get_tokenizer

    tokenizer = get_tokenizer(engine_harness.model_path())
    named = ChatCompletionRequest(model="tiny", messages=USER, tools=[RECURSIVE], tool_choice={
        "type": "function", "function": {"name": "tree"}}).to_sampling_params(64)
    out = {}
    for name, guided in (("named", named.guided_decoding), ("required", _required([RECURSIVE]))):
        guided.backend = "outlines"
        try:
            get_local_guided_decoding_logits_processor(guided, tokenizer)
            out[name] = "built"
        except BaseException as exc:  # what the engine would meet
            out[name] = type(exc).__name__
    report(case="recursion", **out)


def enforce():
    import time

    import jsonschema
    import torch

    from vllm.model_executor.guided_decoding import (
        get_local_guided_decoding_logits_processor)
    from vllm.transformers_utils.tokenizer import get_tokenizer

    tokenizer = get_tokenizer(engine_harness.model_path())
    vocab = len(tokenizer)
    for name, guided, schema, check in _request_guides():
        if guided is None or guided.json is None:
            report(case=name, error="no guided json from the request", guided=str(guided))
            continue
        guided.backend = guided.backend or "outlines"
        t0 = time.perf_counter()
        processor = get_local_guided_decoding_logits_processor(guided, tokenizer)
        build_s = time.perf_counter() - t0
        texts, valid, steps = [], [], []
        for run in range(RUNS):
            gen = torch.Generator().manual_seed(1000 * run + 7)
            ids = []
            for _ in range(MAX_STEPS):
                scores = torch.randn(vocab, generator=gen)
                scores = processor(list(ids), scores)
                token = int(torch.multinomial(torch.softmax(scores, -1), 1, generator=gen))
                if token == tokenizer.eos_token_id:
                    break
                ids.append(token)
            text = tokenizer.decode(ids)
            texts.append(text)
            steps.append(len(ids))
            try:
                value = json.loads(text)
                jsonschema.validate(value, schema)
                if check is not None:
                    check(value)
                valid.append(True)
            except (ValueError, jsonschema.ValidationError, KeyError, TypeError) as exc:
                valid.append(f"{type(exc).__name__}: {str(exc)[:200]}")
        report(case=name, schema=guided.json, processor=type(processor).__name__,
               texts=texts, valid=valid, steps=steps, build_s=round(build_s, 1))
    recursion()


def _digest(guide):
    table = {str(k): sorted((str(t), str(s)) for t, s in v.items())
             for k, v in guide.states_to_token_maps.items()}
    return hashlib.sha256(json.dumps(table, sort_keys=True).encode()).hexdigest()[:16]


def guides():
    from outlines.fsm.guide import RegexGuide
    from outlines.fsm.json_schema import build_regex_from_schema
    from outlines.types import airports

    from vllm.model_executor.guided_decoding.outlines_decoding import _get_guide_and_mode
    from vllm.model_executor.guided_decoding.outlines_logits_processors import (
        _adapt_tokenizer)
    from vllm.sampling_params import GuidedDecodingParams
    from vllm.transformers_utils.tokenizer import get_tokenizer

    tokenizer = _adapt_tokenizer(get_tokenizer(engine_harness.model_path()))
    out = {}
    for name, params in (("json", GuidedDecodingParams(json=WEATHER)),
                         ("required", _required()),
                         ("regex", GuidedDecodingParams(regex=REGEX)),
                         ("choice", GuidedDecodingParams(choice=CHOICE))):
        guide, mode = _get_guide_and_mode(params)
        regex = build_regex_from_schema(guide) if mode.name == "JSON" else guide
        out[name] = {"regex": hashlib.sha256(regex.encode()).hexdigest()[:16],
                     "fsm": _digest(RegexGuide(regex, tokenizer))}
    import pyairports.airports as source

    report(case="guides", guides=out, iata=len(list(airports.IATA)),
           airport_list=len(source.AIRPORT_LIST),
           substitute=bool(getattr(source, "__vllm_bi100_substitute__", False)))


if __name__ == "__main__":
    {"enforce": enforce, "guides": guides, "recursion": recursion}[sys.argv[1]]()

"""vLLM 0.6.3's own OpenAI server app, met by the real ``openai`` client: what today's clients send.

``python serving_app.py`` builds the app as ``vllm serve`` does (``make_arg_parser``,
``build_app``, ``init_app_state``: vLLM's FastAPI routes, validation handler and serving
classes) around the smallest engine stand-in that returns real ``RequestOutput``s, serves it
with uvicorn on 127.0.0.1, sends each case of ``CASES`` with the ``openai`` client, and prints
one report line per case (``helpers.probes.report``; first those of
``scheduler_probe.main``, in the same interpreter, then the cases): the HTTP status, the error message, what
the engine was given (sampling parameters, the prompt the chat template rendered) and, for
streams, the usage of each chunk.  Run with the shim (``VLLM_BI100_PATCH=1``) and without.

The model is a local directory: a tiny Llama ``config.json`` (never loaded: nothing computes)
and a byte-level tokenizer with a chat template that shows roles, tool calls and tools.  The
engine stand-in answers what fits the request (``standin_answers.py``: an instance of the
schema when guided JSON reaches it, a hermes ``<tool_call>`` when tools reached the template,
else a fixed text); it is what the front end talks to, so the front end is what is tested
(``--enable-auto-tool-choice --tool-call-parser hermes``, as agent frameworks' servers run).
``--max-num-seqs 1``: a request with n=2 can never be scheduled by vLLM 0.6.3's scheduler
(tests/harness/real/scheduler_probe.py shows it).
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
import tempfile
import threading
import time
import types

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # tests/: the helpers package
sys.path.insert(0, HERE)

from helpers.probes import report  # noqa: E402
from standin_answers import ANSWER, answer  # noqa: E402

TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{% if m['content'] %}{{ m['content'] }}{% endif %}"
    "{% if m.get('tool_calls') %}{% for c in m['tool_calls'] %}<tool_call>"
    "{{ c['function']['name'] }} {{ c['function']['arguments'] | tojson }}</tool_call>"
    "{% endfor %}{% endif %}{% endfor %}"
    "{% if tools %}<|tools|>{% for t in tools %}{{ t['function']['name'] }};{% endfor %}"
    "{% endif %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
MAX_NUM_SEQS = 1


def build_model(path: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.add_special_tokens({"additional_special_tokens": ["<tool_call>", "</tool_call>"]})
    fast.chat_template = TEMPLATE
    fast.save_pretrained(path)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                   "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
                   "num_key_value_heads": 2, "num_hidden_layers": 1,
                   "vocab_size": len(fast), "max_position_embeddings": 512,
                   "torch_dtype": "float32"}, f)


class Engine:
    """The smallest engine client the front end runs against: real ``RequestOutput``s of the
    answer that fits the request (``standin_answers.answer``; delta outputs for streams, as
    vLLM's ``RequestOutputKind.DELTA``; ``finish_reason`` "stop" when the answer is complete,
    "length" when ``max_tokens`` pieces cut it), with the in-process engine's
    ``scheduler_config`` (as ``AsyncLLMEngine.engine`` has it)."""

    errored = False
    is_running = True
    is_stopped = False
    dead_error = RuntimeError("engine dead")

    def __init__(self, tokenizer, model_config, scheduler_config):
        self.tokenizer, self.model_config = tokenizer, model_config
        self.engine = types.SimpleNamespace(scheduler_config=scheduler_config)
        self.seen = []

    async def get_tokenizer(self, lora_request=None):
        return self.tokenizer

    async def get_model_config(self):
        return self.model_config

    async def get_decoding_config(self):
        from vllm.config import DecodingConfig
        return DecodingConfig()

    async def is_tracing_enabled(self):
        return False

    async def do_log_stats(self, *a, **k):
        return None

    async def check_health(self):
        return None

    async def abort(self, request_id):
        return None

    def generate(self, prompt, sampling_params, request_id, lora_request=None,
                 trace_headers=None, prompt_adapter_request=None, priority=0):
        from vllm.outputs import CompletionOutput, RequestOutput
        from vllm.sampling_params import RequestOutputKind

        ids = list(prompt["prompt_token_ids"])
        guided = sampling_params.guided_decoding
        text = self.tokenizer.decode(ids)
        self.seen.append({
            "prompt": text, "n": sampling_params.n,
            "max_tokens": sampling_params.max_tokens, "logprobs": sampling_params.logprobs,
            "guided_json": None if guided is None else guided.json})
        full = answer(text, None if guided is None else guided.json)
        pieces = [(piece, self.tokenizer.encode(piece, add_special_tokens=False))
                  if piece is not None else ("", [self.tokenizer.eos_token_id])
                  for piece in full][:sampling_params.max_tokens or len(ANSWER)]
        cut = len(pieces) < len(full)
        delta = sampling_params.output_kind == RequestOutputKind.DELTA
        n = sampling_params.n

        def output(step, finished):
            done = pieces[:step + 1]
            shown = [pieces[step]] if delta else done
            return RequestOutput(
                request_id, None, ids, None,
                [CompletionOutput(i, "".join(t for t, _ in shown),
                                  [x for _, tids in shown for x in tids], None, None,
                                  ("length" if cut else "stop") if finished else None)
                 for i in range(n)], finished)

        async def stream():
            steps = range(len(pieces)) if delta else [len(pieces) - 1]
            for step in steps:
                await asyncio.sleep(0)
                yield output(step, step == len(pieces) - 1)

        return stream()


def serve():
    import uvicorn

    from vllm.config import ModelConfig, SchedulerConfig
    from vllm.entrypoints.openai import api_server
    from vllm.entrypoints.openai.cli_args import make_arg_parser
    from vllm.transformers_utils.tokenizer import get_tokenizer
    from vllm.utils import FlexibleArgumentParser

    path = tempfile.mkdtemp(prefix="bi100-serving-")
    build_model(path)
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(
        ["--model", path, "--served-model-name", "tiny", "--max-num-seqs", str(MAX_NUM_SEQS),
         "--max-model-len", "512", "--disable-log-stats", "--disable-log-requests",
         "--enable-auto-tool-choice", "--tool-call-parser", "hermes"])
    model_config = ModelConfig(path, path, "auto", False, "float32", 0, max_model_len=512)
    engine = Engine(get_tokenizer(path), model_config,
                    SchedulerConfig(512, args.max_num_seqs, 512))
    app = api_server.build_app(args)
    api_server.init_app_state(engine, model_config, app.state, args)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    return engine, server, thread, sock.getsockname()[1]


USER = {"role": "user", "content": "hi"}
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "weather",
                                         "parameters": {"type": "object", "properties": {
                                             "city": {"type": "string"}}}}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}},
          "required": ["answer"]}


def _tool(**extra):
    return {"type": "function", "function": dict(TOOL["function"], **extra)}


def _fn(name, params, **extra):
    return {"type": "function", "function": dict(name=name, parameters=params, **extra)}


#: pydantic-ai's structured output tool; a tool whose calls the stand-in makes wrong.
FINAL = _fn("final_result", SCHEMA, strict=True)
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
BAD = _fn("bad_weather", CITY, strict=True)
ALLOWED = {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [
    {"type": "function", "function": {"name": "final_result"}}]}}
DEPTH = 900


def _deep(depth):
    """JSON text of an object nested ``depth`` deep (sent as it is: a client's encoder may
    refuse to build it)."""
    return '{"a": ' * depth + "{}" + "}" * depth


def _raw_chat(tool_params=None, arguments=None):
    """The JSON text of a chat body with a deep tool schema or deep tool-call arguments."""
    head = '{"model": "tiny", '
    if tool_params is not None:
        return (head + '"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": '
                '"function", "function": {"name": "deep_tool", "parameters": ' + tool_params
                + "}}]}")
    return (head + '"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", '
            '"tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", '
            '"arguments": ' + arguments + '}}]}, {"role": "tool", "tool_call_id": "c1", '
            '"content": "ok"}]}')


def _history(arguments):
    return [USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]


#: name -> keyword arguments of ``client.chat.completions.create`` (today's fields the 1.52
#: client has no parameter for go in ``extra_body``, exactly as newer clients put them on the
#: wire).
CASES = {
    "plain": {},
    "max_completion_tokens": {"max_completion_tokens": 2},
    "max_completion_tokens_wins": {"max_completion_tokens": 1, "max_tokens": 3},
    "ignored_fields": {"store": True, "metadata": {"team": "a"}, "service_tier": "auto",
                       "extra_body": {"prompt_cache_key": "k1", "safety_identifier": "u1",
                                      "prediction": {"type": "content", "content": "x"},
                                      "modalities": ["text"]}},
    "reasoning_effort": {"extra_body": {"reasoning_effort": "high"}},
    "unknown_field": {"extra_body": {"frobnicate": 1}},
    "message_extra_key": {"messages": [USER, {"role": "assistant", "content": "ok",
                                              "reasoning_content": "thought"}, USER]},
    "strict_false_named": {"tools": [_tool(strict=False)], "tool_choice": NAMED},
    "strict_true_named": {"tools": [_tool(strict=True)], "tool_choice": NAMED},
    "strict_true_auto": {"tools": [_tool(strict=True)], "tool_choice": "auto"},
    "tool_choice_none": {"tools": [TOOL], "tool_choice": "none"},
    "tool_choice_required": {"tools": [TOOL], "tool_choice": "required"},
    "object_arguments": {"messages": _history({"city": "Paris"})},
    "string_arguments": {"messages": _history('{"city": "Paris"}')},
    "invalid_arguments": {"messages": _history("{city: Paris")},
    "top_logprobs_0": {"top_logprobs": 0},
    "json_schema": {"response_format": {"type": "json_schema", "json_schema": {
        "name": "answer", "schema": SCHEMA}}},
    "developer_role": {"messages": [{"role": "developer", "content": "be brief"}, USER]},
    "empty_messages": {"messages": []},
    # an exception without a message on the path a remote image's TimeoutError() takes
    # (``create_error_response(str(e))``), raised here by the request's own chat template
    "error_without_message": {"extra_body": {"chat_template": "{{ raise_exception('') }}"}},
    "n_over_max_num_seqs": {"n": 2},
    "best_of_over_max_num_seqs": {"extra_body": {"best_of": 2}},
    "stream_usage": {"stream": True, "stream_options": {"include_usage": True}},
    "stream_usage_continuous": {"stream": True, "stream_options": {
        "include_usage": True, "continuous_usage_stats": True}},
    "stream_n_over_max_num_seqs": {"stream": True, "n": 2},
    # /v1/completions: the same n/best_of limit
    "completion_n_over_max_num_seqs": {"completions": True, "n": 2},
    # --- agent frameworks' tool paths (issue 35) ---
    # openai-agents, pydantic-ai: every tool strict, tool_choice absent (automatic)
    "strict_auto_absent": {"tools": [_tool(strict=True)]},
    "strict_auto_stream": {"tools": [_tool(strict=True)], "stream": True},
    "strict_violation": {"tools": [BAD]},
    "strict_violation_stream": {"tools": [BAD], "stream": True},
    "strict_one": {"tools": [_tool(strict=1)]},
    # pydantic-ai's output_type: "required" with a strict final_result tool
    "required": {"tools": [FINAL, _tool()], "tool_choice": "required"},
    "required_stream": {"tools": [FINAL, _tool()], "tool_choice": "required", "stream": True},
    "required_cut": {"tools": [FINAL], "tool_choice": "required", "max_tokens": 3},
    "allowed_tools_auto": {"tools": [_tool(), FINAL], "tool_choice": ALLOWED},
    "allowed_tools_required": {"tools": [_tool(), FINAL], "tool_choice": {
        "type": "allowed_tools", "allowed_tools": dict(ALLOWED["allowed_tools"],
                                                       mode="required")}},
    "responses_named": {"tools": [_tool(), FINAL],
                        "tool_choice": {"type": "function", "name": "get_weather"}},
    "tool_choice_empty_object": {"tools": [TOOL], "tool_choice": {}},
    "tool_choice_custom": {"tools": [TOOL], "tool_choice": {"type": "custom", "name": "x"}},
    "malformed_tool_named": {"tools": [{"type": "function"}], "tool_choice": NAMED},
    "top_logprobs_text": {"logprobs": True, "top_logprobs": "three"},
    "json_schema_beside_named": {"tools": [TOOL], "tool_choice": NAMED, "response_format": {
        "type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}},
    "json_schema_text": {"response_format": {"type": "json_schema", "json_schema": {
        "name": "answer", "schema": json.dumps(SCHEMA)}}},
    "json_schema_text_and_object": {"response_format": {"type": "json_schema", "json_schema": {
        "name": "answer", "schema": json.dumps(SCHEMA)}}, "extra_body": {"guided_json": SCHEMA}},
    "max_completion_tokens_invalid": {"extra_body": {"max_completion_tokens": "abc"}},
    "message_key_newline": {"messages": [{"role": "user", "content": "hi",
                                          "x\nINFO forged line": 1}]},
    "new_ignored_fields": {"stream": True, "extra_body": {"prompt_cache_retention": "24h",
                                          "prompt_cache_options": {"ttl": 1},
                                          "stream_options": {"include_usage": True,
                                                             "include_obfuscation": True}}},
    # bodies nested as deep as a client may send them (JSON text, posted as it is)
    "deep_tool_parameters": {"raw": _raw_chat(tool_params=_deep(DEPTH))},
    "deep_arguments": {"raw": _raw_chat(arguments=_deep(DEPTH))},
    # /v1/completions
    "completion_stream_usage": {"completions": True, "stream": True,
                                "stream_options": {"include_usage": True}},
    "completion_json_schema": {"completions": True, "extra_body": {"response_format": {
        "type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}}},
    "completion_json_schema_text": {"completions": True, "extra_body": {"response_format": {
        "type": "json_schema", "json_schema": {"name": "answer",
                                               "schema": json.dumps(SCHEMA)}}}},
    "completion_logprobs_text": {"completions": True, "extra_body": {"logprobs": "two"}},
    "completion_ignored_fields": {"completions": True, "stream": True, "extra_body": {
        "prompt_cache_retention": "24h", "prompt_cache_options": {"ttl": 1},
        "stream_options": {"include_usage": True, "include_obfuscation": False}}},
}


def _calls(tool_calls):
    return [[c.function.name, c.function.arguments] for c in tool_calls or ()]


def _stream_out(out, chunks):
    """What a streaming client puts together: text, tool calls (by index), finish reasons."""
    out["chunk_usage"] = [None if c.usage is None else c.usage.total_tokens for c in chunks]
    calls, finish = {}, []
    text = []
    for c in chunks:
        for choice in c.choices:
            delta = getattr(choice, "delta", None)
            text.append((delta.content if delta is not None else choice.text) or "")
            for call in (getattr(delta, "tool_calls", None) or ()):
                seen = calls.setdefault(call.index, [None, ""])
                seen[0] = (call.function.name if call.function else None) or seen[0]
                seen[1] += (call.function.arguments if call.function else None) or ""
            if choice.finish_reason:
                finish.append(choice.finish_reason)
    out.update(text="".join(text), tool_calls=[calls[k] for k in sorted(calls)],
               finish=finish)


def run_case(client, engine, name, kwargs, port):
    import httpx
    import openai

    kwargs = dict(kwargs)
    messages = kwargs.pop("messages", [USER])
    before = len(engine.seen)
    out = {"case": name}
    try:
        if "raw" in kwargs:
            resp = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions",
                              content=kwargs["raw"], timeout=60,
                              headers={"Content-Type": "application/json"})
            out["status"] = resp.status_code
            try:
                out["message"] = resp.json().get("message")
            except ValueError:
                out["message"] = resp.text[:300]
        elif kwargs.pop("completions", False):
            resp = client.completions.create(model="tiny", prompt="hi", **kwargs)
            out["status"] = 200
            if kwargs.get("stream"):
                _stream_out(out, list(resp))
            else:
                out["text"] = resp.choices[0].text
        elif kwargs.get("stream"):
            chunks = list(client.chat.completions.create(model="tiny", messages=messages,
                                                         **kwargs))
            out["status"] = 200
            _stream_out(out, chunks)
        else:
            resp = client.chat.completions.create(model="tiny", messages=messages, **kwargs)
            out["status"] = 200
            out["text"] = resp.choices[0].message.content
            out["tool_calls"] = _calls(resp.choices[0].message.tool_calls)
            out["finish"] = [resp.choices[0].finish_reason]
            out["id"] = resp.id
            out["usage"] = resp.usage.model_dump() if resp.usage else None
    except openai.APIStatusError as exc:
        out["status"] = exc.status_code
        body = exc.body if isinstance(exc.body, dict) else {}
        out["message"] = body.get("message", str(exc))
    except openai.APIConnectionError as exc:  # the server dropped the connection
        out["status"] = "connection lost"
        out["message"] = repr(exc.__cause__)
    out["queued"] = engine.seen[before:]
    return out


def metrics_lines(port):
    """The shim's series on the app's own /metrics (the in-process exporter registered)."""
    import httpx

    try:
        from vllm_bi100_patch.patching.counting import export
    except ImportError:
        return []
    exporter = export.exporter()
    if exporter is not None:
        exporter.tick()
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=60).text
    return [ln for ln in text.splitlines() if ln.startswith("vllm_bi100:") and
            ("tool_" in ln or "request_compat" in ln)]


def doctor_lines():
    """doctor's code-check lines of this process (the rows' checks, as ``doctor`` prints)."""
    from vllm_bi100_patch.ops import doctor

    sections, _ = doctor.doctor_sections()
    return [ln for s in sections for ln in s.render().splitlines() if "] code check " in ln]


def main():
    import openai

    import scheduler_probe

    scheduler_probe.main()  # vLLM's own Scheduler and add_request, in the same interpreter
    engine, server, thread, port = serve()
    try:
        for name, kwargs in CASES.items():
            # a client per case: a 500 (stock) ends its connection
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                                   max_retries=0, timeout=60)
            report(**run_case(client, engine, name, kwargs, port), openai=openai.__version__)
        report(case="metrics", lines=metrics_lines(port))
        try:
            import vllm_bi100_patch
            report(case="status", status=vllm_bi100_patch.status(), doctor=doctor_lines())
        except ImportError:
            report(case="status", status=None)
    finally:
        server.should_exit = True
        thread.join(timeout=30)


if __name__ == "__main__":
    main()

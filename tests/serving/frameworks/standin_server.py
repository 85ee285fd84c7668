"""vLLM 0.6.3's own OpenAI server, as ``vllm serve`` builds it, around an engine stand-in whose
answers fit the request: what agent frameworks meet on a BI-V100 server.

``python standin_server.py`` builds the app as ``vllm serve MODEL --enable-auto-tool-choice
--tool-call-parser hermes --max-num-seqs 4`` does (``make_arg_parser``, ``build_app``,
``init_app_state``: vLLM's routes, validation handler, serving classes, hermes tool parser),
serves it with uvicorn on 127.0.0.1, prints one report line ``{"port": N}`` and serves until its
stdin closes.  Run with the shim (``VLLM_BI100_PATCH=1``) and without.

The model is a local directory (a tiny Llama ``config.json``, never loaded; a byte-level
tokenizer with ``<tool_call>``/``</tool_call>`` as special tokens and a chat template that
shows roles, tool calls, tool results and the tools' JSON, as hermes templates do).  The engine
stand-in answers as a model that follows its request would:

* guided decoding reached the engine (``sampling_params.guided_decoding``: 0.6.3's
  ``to_sampling_params`` puts ``json_schema``'s schema, a named tool's parameters or
  ``guided_json`` in ``.json``, ``response_format: json_object`` in ``.json_object``): an
  instance of the schema (``schema_instance.instance``); for ``json_object``, of the first JSON
  schema the prompt shows (instructor's JSON mode puts it in the system message), else ``{}``;
* tools in the prompt and the last message not a tool result: a hermes call of the first tool,
  ``<tool_call>{"name": ..., "arguments": <instance of its parameters>}</tool_call>`` (the
  required parameters only: ``call_arguments``);
* otherwise text (after a tool result: the result quoted).

Streams come in deltas (``RequestOutputKind.DELTA``) of at most 4 tokens, each special token
its own delta, as an engine step delivers them; ``max_tokens`` cuts the answer (finish reason
``length``).  ``GET /standin/requests`` returns what the engine was given and answered, one
entry per request (prompt and output token counts, guided decoding, the text), the HTTP status
of every ``/v1/`` request with what it asked for (stream options, tool choice, tools' ``strict``,
response format), and every ERROR the server logged: the clients compare the
frameworks' results with them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
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
from schema_instance import instance  # noqa: E402

TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{% if m['content'] %}{{ m['content'] }}{% endif %}"
    "{% if m.get('tool_calls') %}{% for c in m['tool_calls'] %}<tool_call>"
    "{\"name\": {{ c['function']['name'] | tojson }}, \"arguments\": "
    "{{ c['function']['arguments'] }}}</tool_call>{% endfor %}{% endif %}{% endfor %}"
    "{% if tools %}<tools>{{ tools | tojson }}</tools>{% endif %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")
MAX_NUM_SEQS = 4
#: Codex's prompt (its instructions and tools) is about 30,000 bytes, a token each to this
#: byte-level tokenizer.
MAX_MODEL_LEN = 131072
#: Tokens per streamed delta (special tokens come alone).
DELTA_TOKENS = 4
TEXT = "Hello from the stand-in engine."
#: ``BI100_STANDIN_REASONING=<parser>``: the stand-in is a reasoning model (it thinks before
#: every unguided answer, in ``THINKING``, which mentions a tool call the answer must not
#: carry) and the server is started with ``--enable-reasoning --reasoning-parser <parser>``
#: where its command line has them (the shim's).
REASONING = os.environ.get("BI100_STANDIN_REASONING") or None
THINKING = ("<think>The user wants an answer. I could call <tool_call>{\"name\": \"not_a_call\", "
            "\"arguments\": {}}</tool_call> but I will answer as asked.</think>\n\n")
ROLE = re.compile(r"<\|(system|developer|user|assistant|tool)\|>")


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
                   "vocab_size": len(fast), "max_position_embeddings": MAX_MODEL_LEN,
                   "torch_dtype": "float32"}, f)


def _schemas_in(text: str):
    """The JSON objects in ``text`` that look like a JSON schema, in order."""
    decoder = json.JSONDecoder()
    i = text.find("{")
    while i != -1:
        try:
            obj, end = decoder.raw_decode(text, i)
        except ValueError:
            i = text.find("{", i + 1)
            continue
        if isinstance(obj, dict) and ("properties" in obj or "$defs" in obj):
            yield obj
        i = text.find("{", end)


def _last_message(prompt: str):
    """(role, content) of the last message before the generation prompt."""
    marks = list(ROLE.finditer(prompt))
    if prompt.endswith("<|assistant|>"):
        marks = marks[:-1]
    if not marks:
        return None, prompt
    last = marks[-1]
    end = prompt.find("<", last.end())
    return last.group(1), prompt[last.end():end if end != -1 else len(prompt)]


def _tools(prompt: str):
    start = prompt.rfind("<tools>")
    if start == -1:
        return []
    end = prompt.find("</tools>", start)
    return json.loads(prompt[start + len("<tools>"):end])


def call_arguments(schema: dict):
    """A tool call's arguments as a model that follows its tool writes them: the parameters
    the schema requires (an instance of each), the optional ones left to the tool's defaults.
    Codex's ``exec_command`` has one required parameter (``cmd``) and nine optional ones (a
    ``shell`` binary, a ``workdir``, token and time budgets typed ``number`` that Codex reads
    as integers): an instance of every one is a call no model makes and Codex refuses."""
    args = instance(schema)
    required = schema.get("required") if isinstance(schema, dict) else None
    if isinstance(args, dict) and isinstance(required, list):
        args = {k: v for k, v in args.items() if k in required}
    return args


def answer(prompt: str, guided) -> dict:
    """What the stand-in answers: ``{"kind", "text"}`` (kind: json, json_object, tool_call,
    text, tool_result); a reasoning stand-in thinks first (``THINKING``) when unguided."""
    got = _answer(prompt, guided)
    if REASONING and got["kind"] in ("tool_call", "tool_result", "text"):
        got = dict(got, text=THINKING + got["text"], thinking=THINKING)
    return got


def _answer(prompt: str, guided) -> dict:
    if guided is not None and guided.json is not None:
        schema = json.loads(guided.json) if isinstance(guided.json, str) else guided.json
        return {"kind": "json", "text": json.dumps(instance(schema))}
    if guided is not None and guided.json_object:
        schema = next(_schemas_in(prompt), {"type": "object"})
        return {"kind": "json_object", "text": json.dumps(instance(schema))}
    if guided is not None and guided.choice:
        return {"kind": "choice", "text": guided.choice[0]}
    role, content = _last_message(prompt)
    tools = _tools(prompt)
    if tools and role != "tool":
        fn = tools[0]["function"]
        call = {"name": fn["name"],
                "arguments": call_arguments(fn.get("parameters") or {"type": "object"})}
        return {"kind": "tool_call", "text": f"<tool_call>{json.dumps(call)}</tool_call>"}
    if role == "tool":
        return {"kind": "tool_result", "text": f"The tool said: {content.strip()}"}
    return {"kind": "text", "text": TEXT}


def _sent(body: bytes):
    """What a request asked for, in brief: the fields that decide how 0.6.3 serves it."""
    try:
        data = json.loads(body)
    except ValueError:
        return "not JSON"
    if not isinstance(data, dict):
        return "not an object"
    out = {k: data[k] for k in ("stream", "stream_options", "tool_choice", "max_tokens",
                                "max_completion_tokens") if k in data}
    tools = data.get("tools") or []
    if tools:
        out["tools"] = [{"name": (t.get("function") or {}).get("name"),
                         "strict": (t.get("function") or {}).get("strict")} for t in tools]
    fmt = data.get("response_format")
    if isinstance(fmt, dict):
        out["response_format"] = {"type": fmt.get("type"),
                                  "strict": (fmt.get("json_schema") or {}).get("strict")}
    return out


def pieces(tokenizer, text: str):
    """``text`` as the engine would stream it: (text, token ids) per delta."""
    out = []
    for part in re.split(r"(<tool_call>|</tool_call>)", text):
        if not part:
            continue
        ids = tokenizer.encode(part, add_special_tokens=False)
        step = 1 if part in ("<tool_call>", "</tool_call>") else DELTA_TOKENS
        for i in range(0, len(ids), step):
            out.append(ids[i:i + step])
    return out


class Engine:
    """The engine client the front end runs against: real ``RequestOutput``s of an answer that
    fits the request, with the in-process engine's ``scheduler_config``."""

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
        text = self.tokenizer.decode(ids)
        guided = sampling_params.guided_decoding
        got = answer(text, guided)
        chunks = pieces(self.tokenizer, got["text"])
        limit = sampling_params.max_tokens
        if limit is not None:
            kept, left = [], limit
            for c in chunks:
                if left <= 0:
                    break
                kept.append(c[:left])
                left -= len(kept[-1])
            cut = sum(map(len, kept)) < sum(map(len, chunks))
            chunks = kept
        else:
            cut = False
        out_ids = [x for c in chunks for x in c]
        out_text = self.tokenizer.decode(out_ids)
        self.seen.append({
            "request_id": request_id, "prompt_tokens": len(ids), "prompt": text,
            "n": sampling_params.n, "max_tokens": limit, "answer": got["kind"],
            "guided": None if guided is None else {
                k: getattr(guided, k) for k in ("json", "json_object", "choice", "regex")
                if getattr(guided, k) is not None} or None,
            "text": out_text, "thinking": got.get("thinking"),
            "completion_tokens": len(out_ids) * sampling_params.n,
            "finish_reason": "length" if cut else "stop"})
        delta = sampling_params.output_kind == RequestOutputKind.DELTA
        n = sampling_params.n
        reason = "length" if cut else "stop"

        def output(step, finished):
            shown = [chunks[step]] if delta else chunks[:step + 1]
            tids = [x for c in shown for x in c]
            return RequestOutput(
                request_id, None, ids, None,
                [CompletionOutput(i, self.tokenizer.decode(tids), tids, None, None,
                                  reason if finished else None) for i in range(n)],
                finished)

        async def stream():
            steps = range(len(chunks)) if delta else [len(chunks) - 1]
            for step in steps:
                await asyncio.sleep(0)
                yield output(step, step == len(chunks) - 1)

        return stream()


def serve():
    import uvicorn

    from vllm.config import ModelConfig, SchedulerConfig
    from vllm.entrypoints.openai import api_server
    from vllm.entrypoints.openai.cli_args import make_arg_parser
    from vllm.transformers_utils.tokenizer import get_tokenizer
    from vllm.utils import FlexibleArgumentParser

    path = tempfile.mkdtemp(prefix="bi100-frameworks-")
    build_model(path)
    parser = make_arg_parser(FlexibleArgumentParser())
    flags = (["--enable-reasoning", "--reasoning-parser", REASONING]
             if REASONING and "--reasoning-parser" in parser._option_string_actions else [])
    args = parser.parse_args(
        ["--model", path, "--served-model-name", "tiny", "--max-num-seqs", str(MAX_NUM_SEQS),
         "--max-model-len", str(MAX_MODEL_LEN), "--disable-log-stats",
         "--enable-auto-tool-choice", "--tool-call-parser", "hermes", *flags])
    model_config = ModelConfig(path, path, "auto", False, "float32", 0,
                               max_model_len=MAX_MODEL_LEN)
    engine = Engine(get_tokenizer(path), model_config,
                    SchedulerConfig(MAX_MODEL_LEN, args.max_num_seqs, MAX_MODEL_LEN))
    app = api_server.build_app(args)
    api_server.init_app_state(engine, model_config, app.state, args)

    http, errors = [], []

    @app.middleware("http")
    async def record_status(request, call_next):
        sent = _sent(await request.body()) if request.method == "POST" else None
        response = await call_next(request)
        if request.url.path.startswith("/v1/"):
            http.append({"path": request.url.path, "status": response.status_code,
                         "sent": sent})
        return response

    class Errors(logging.Handler):
        """ERROR records of the server's loggers (vLLM's, uvicorn's), numbered by the engine
        requests before them: a client attributes them to its case."""

        def emit(self, record):
            exc = record.exc_info[1] if record.exc_info else None
            errors.append({"after_request": len(engine.seen), "logger": record.name,
                           "message": record.getMessage()[:500],
                           "exception": None if exc is None else
                           f"{type(exc).__name__}: {str(exc)[:300]}"})

    handler = Errors(logging.ERROR)
    for name in ("", "vllm", "uvicorn", "uvicorn.error", "fastapi"):
        logging.getLogger(name).addHandler(handler)

    async def requests_seen():
        return {"requests": engine.seen, "http": http, "errors": errors}

    app.add_api_route("/standin/requests", requests_seen, methods=["GET"])
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("uvicorn stopped before it started")
        time.sleep(0.05)
    return server, thread, sock.getsockname()[1]


def main():
    server, thread, port = serve()
    try:
        import vllm_bi100_patch
        status = vllm_bi100_patch.status()
    except ImportError:
        status = None
    import importlib.metadata
    applied = ((status or {}).get("report") or {}).get("applied") or []
    report(port=port, vllm=importlib.metadata.version("vllm"), patched=applied)
    sys.stdin.read()  # until the test closes our stdin
    server.should_exit = True
    thread.join(timeout=30)


if __name__ == "__main__":
    main()

"""vLLM 0.6.3's own OpenAI server app as ``vllm serve --enable-auto-tool-choice
--tool-call-parser hermes --max-num-seqs 4`` builds it, in its default multiprocessing front
end: the engine client is vLLM's ``MQLLMEngineClient`` (its own ``__init__`` and
``generate``), whose request stream is served here by a stand-in that answers a scripted
sequence of deltas instead of talking to an engine process.  One report line per case
(``helpers.probes.report``).  Run with the shim (``VLLM_BI100_PATCH=1``), without, and with
single rows disabled.

Each script is what a hermes model's tokens look like in deltas: ``<tool_call>`` (a special
token, its own delta), then the JSON in small pieces, then ``</tool_call>`` and the end of
the turn (an empty delta with the end-of-sequence token), or cut short by ``max_tokens``
(``finish_reason: "length"``).  The user message names the script.

``python tool_stream_app.py in_process``: the front end with its engine in its own process
(``--disable-frontend-multiprocessing``): vLLM's ``AsyncLLMEngine`` (engine_harness.py), a
guide that cannot be built, a plain and a guided request after it, n over max_num_seqs.

``python tool_stream_app.py serve``: the app (default front end) served until stdin closes, its
port in one report line.  ``POST /standin/split`` with ``{"pieces": [...], "finish": ...}``
answers a key; a user message ``split:<key>`` is then answered with exactly those deltas (each
piece tokenized on its own: the special ``<tool_call>``/``</tool_call>`` tokens stay single
tokens; an empty piece is the end-of-sequence token alone), the last with that finish reason.
``GET /standin/errors`` lists every ERROR record the server logged (test_hermes_stream.py
splits model outputs every way and reads the streams back; test_responses.py serves the
Responses API and reasoning output from the same scripts).  ``BI100_APP_FLAGS``: more
``vllm serve`` flags for this app (a reasoning parser's).

``python tool_stream_app.py late``: the shim is taken off at start (``revert()``) and applied
(``vllm_bi100_patch.apply()``) only after vLLM's ``api_server`` was imported and a first app
built, as an activation through vLLM's plugin entry point does in a ``vllm serve`` front end; a
second app is built after it.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
import threading
import time
import types
import typing

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # tests/: the helpers package
sys.path.insert(0, HERE)

import engine_harness  # noqa: E402
from helpers.probes import report  # noqa: E402

CALL = ['{"', "name", '":', ' "', "get", "_weather", '",', ' "', "arguments", '":', ' {"',
        "city", '":', ' "', "Paris", '"}}']
#: name -> (the deltas' texts, the finish reason of the last)
SCRIPTS = {
    "complete": (["<tool_call>", "\n", *CALL, "\n", "</tool_call>", ""], "stop"),
    "cut_at_start": (["<tool_call>"], "length"),
    "cut_in_name": (["<tool_call>", "\n", '{"', "na"], "length"),
    "cut_in_arguments": (["<tool_call>", "\n", *CALL[:14], "Par"], "length"),
    "text": (["hello", " world"], "stop"),
}
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "weather",
                                         "parameters": {"type": "object", "properties": {
                                             "city": {"type": "string"}}}}}


SPLIT = "<|user|>split:"
#: key -> {"pieces": [...], "finish": ...} (``POST /standin/split``)
SPLITS: dict = {}


def script_of(prompt_text):
    if SPLIT in prompt_text:
        return "split"
    for name in SCRIPTS:
        if f"<|user|>{name}" in prompt_text:
            return name
    return "text"


def script(prompt_text):
    """(name, the deltas' texts, the finish reason of the last) the prompt asks for."""
    name = script_of(prompt_text)
    if name != "split":
        return (name, *SCRIPTS[name])
    key = prompt_text[prompt_text.index(SPLIT) + len(SPLIT):]
    key = key[:len(key) - len(key.lstrip("0123456789"))]
    data = SPLITS[key]
    return name, data["pieces"], data["finish"]


def client_class():
    """vLLM's ``MQLLMEngineClient`` whose request stream is the scripted stand-in."""
    from vllm.engine.multiprocessing.client import MQLLMEngineClient
    from vllm.outputs import CompletionOutput, RequestOutput

    class StandInClient(MQLLMEngineClient):
        tracing_flag = False
        seen: list = []

        async def _process_request(self, prompt, params, request_id, lora_request=None,
                                   trace_headers=None, prompt_adapter_request=None,
                                   priority=0):
            tokenizer = self.tokenizer.tokenizer
            ids = list(prompt["prompt_token_ids"])
            name, texts, reason = script(tokenizer.decode(ids))
            self.seen.append({"script": name, "n": params.n})
            eos = tokenizer.eos_token_id
            done_text, done_ids = "", []
            for step, text in enumerate(texts):
                last = step == len(texts) - 1
                tids = tokenizer.encode(text, add_special_tokens=False) if text else [eos]
                done_text += text
                done_ids += tids
                delta = params.output_kind.name == "DELTA"
                await asyncio.sleep(0)
                yield RequestOutput(request_id, None, ids, None, [CompletionOutput(
                    i, text if delta else done_text, tids if delta else list(done_ids),
                    None, None, reason if last else None) for i in range(params.n)], last)

        async def abort(self, request_id):
            return None

        async def check_health(self):
            return None

    return StandInClient


def build(args_list, late=False, in_process=False, routes=()):
    """The app, its client and its event loop, serving on 127.0.0.1 in a thread; with
    ``in_process``, the engine client is vLLM's ``AsyncLLMEngine`` (engine_harness.py: a
    stand-in executor), as ``--disable-frontend-multiprocessing`` serves; ``routes``: (path,
    methods, endpoint) added to every app."""
    import uvicorn

    from vllm.entrypoints.openai import api_server
    from vllm.entrypoints.openai.cli_args import make_arg_parser
    from vllm.utils import FlexibleArgumentParser

    path = engine_harness.model_path()
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(
        ["--model", path, "--served-model-name", "tiny", "--max-model-len", "512",
         "--disable-log-stats", "--disable-log-requests", *args_list])
    model, _, parallel, scheduler, *_ = engine_harness.configs(args.max_num_seqs)
    config = types.SimpleNamespace(model_config=model, scheduler_config=scheduler,
                                   parallel_config=parallel, lora_config=None,
                                   decoding_config=engine_harness.configs()[8])
    loop = asyncio.new_event_loop()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    out = {}

    async def start():
        out["client"] = engine_harness.async_engine(args.max_num_seqs) if in_process else \
            client_class()("ipc:///tmp/bi100-no-engine", config)
        apps = [api_server.build_app(args)]
        if late:  # the shim activates after the first app was built
            import vllm_bi100_patch

            vllm_bi100_patch.apply()
            apps.append(api_server.build_app(args))
        for app in apps:
            api_server.init_app_state(out["client"], model, app.state, args)
            for path, methods, endpoint in routes:
                app.add_api_route(path, endpoint, methods=methods)
        out["servers"] = [uvicorn.Server(uvicorn.Config(app, log_level="warning"))
                          for app in apps]
        socks = [sock] + [socket.socket() for _ in apps[1:]]
        for s in socks[1:]:
            s.bind(("127.0.0.1", 0))
        out["ports"] = [s.getsockname()[1] for s in socks]
        await asyncio.gather(*(srv.serve(sockets=[s]) for srv, s in zip(out["servers"],
                                                                        socks)))

    thread = threading.Thread(target=loop.run_until_complete, args=(start(),), daemon=True)
    thread.start()
    while "servers" not in out or not all(s.started for s in out["servers"]):
        time.sleep(0.05)
    return out, thread


def post(port, body):
    """POST a chat completion: (status, JSON body) or, streamed, (status, the SSE events)."""
    import httpx

    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    body = dict({"model": "tiny"}, **body)
    def parsed(resp):
        try:
            return resp.json()
        except ValueError:  # a 500's plain text
            return {"message": resp.text}

    with httpx.Client(timeout=60) as http:
        if not body.get("stream"):
            resp = http.post(url, json=body)
            return resp.status_code, parsed(resp)
        with http.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                resp.read()
                return resp.status_code, parsed(resp)
            events = [line[len("data: "):] for line in resp.iter_lines()
                      if line.startswith("data: ")]
            return resp.status_code, [e if e == "[DONE]" else json.loads(e) for e in events]


def summary(status, events):
    """What a client reads off a stream: content, tool calls (joined), finish reasons."""
    if not isinstance(events, list):
        return {"status": status, "body": events}
    content, calls, finish, usage = "", {}, [], []
    for e in events:
        if e == "[DONE]" or "error" in e:
            continue
        usage.append(e.get("usage"))
        for c in e.get("choices", ()):
            delta = c.get("delta") or {}
            content += delta.get("content") or ""
            for call in delta.get("tool_calls") or ():
                slot = calls.setdefault(call.get("index", 0), {"name": "", "arguments": ""})
                fn = call.get("function") or {}
                slot["name"] += fn.get("name") or ""
                slot["arguments"] += fn.get("arguments") or ""
            if c.get("finish_reason"):
                finish.append(c["finish_reason"])
    return {"status": status, "chunks": len(events), "done": events[-1:] == ["[DONE]"],
            "content": content, "tool_calls": [calls[i] for i in sorted(calls)],
            "finish": finish, "errors": [e["error"] for e in events if isinstance(e, dict)
                                         and "error" in e], "usage": usage}


def cases(port):
    user = lambda name: [{"role": "user", "content": name}]  # noqa: E731
    for name in SCRIPTS:
        for stream in (True, False):
            code, body = post(port, {"messages": user(name), "tools": [TOOL], "stream": stream})
            if stream:
                report(case=f"{name}_stream", **summary(code, body))
            else:
                choice = (body.get("choices") or [{}])[0]
                report(case=name, status=code, message=choice.get("message"),
                       finish=choice.get("finish_reason"), error=body.get("message"))
    code, body = post(port, {"messages": user("cut_in_name"), "tools": [TOOL], "stream": True,
                             "stream_options": {"include_usage": True,
                                                "continuous_usage_stats": True}})
    report(case="cut_in_name_usage", **summary(code, body))
    for n in (1, 2):  # the final usage chunk counts every choice's tokens
        code, body = post(port, {"messages": user("text"), "n": n, "stream": True,
                                 "stream_options": {"include_usage": True}})
        report(case=f"n{n}_usage", **summary(code, body))
    for stream in (True, False):
        code, body = post(port, {"messages": user("text"), "n": 5, "stream": stream})
        report(case=f"n5{'_stream' if stream else ''}", status=code,
               error=body.get("message") if isinstance(body, dict) else None,
               chunks=len(body) if isinstance(body, list) else None)


def in_process_cases(port):
    """The in-process front end (``AsyncLLMEngine``): a guide that cannot be built, then a
    plain request and a guided one (the engine must still run), n over max_num_seqs."""
    user = [{"role": "user", "content": "text"}]
    for stream in (False, True):
        code, body = post(port, {"messages": user, "guided_regex": "(?<=a)b", "stream": stream,
                                 "max_tokens": 2})
        report(case=f"bad_guide{'_stream' if stream else ''}", status=code,
               error=body.get("message") if isinstance(body, dict) else
               summary(code, body)["errors"])
    for name, extra in (("plain", {}), ("choice", {"guided_choice": ["yes", "no"]}),
                        ("n5", {"n": 5})):
        code, body = post(port, dict({"messages": user, "max_tokens": 2}, **extra))
        report(case=name, status=code, error=body.get("message"),
               text=[c["message"]["content"] for c in body.get("choices", ())])


def late_cases(out):
    import vllm_bi100_patch

    body = {"messages": [{"role": "user", "content": "text"}], "max_completion_tokens": 2}
    for which, port in zip(("before", "after"), out["ports"]):
        code, resp = post(port, body)
        report(case=f"late_{which}", status=code, error=resp.get("message"))
    st = vllm_bi100_patch.status()
    report(case="late_status", class_bindings=st.get("class_bindings"),
           applied=(st["report"] or {}).get("applied"))
    from vllm.entrypoints.openai import api_server, protocol

    replaced = {"api_server": api_server.ChatCompletionRequest,
                "annotation": api_server.create_chat_completion.__annotations__["request"],
                "batch": protocol.BatchRequestInput}
    vllm_bi100_patch.revert()
    original = protocol.ChatCompletionRequest
    report(case="late_revert", replaced_was_original={
        k: v is original for k, v in replaced.items() if k != "batch"},
        restored={"api_server": api_server.ChatCompletionRequest is original,
                  "annotation": api_server.create_chat_completion.__annotations__["request"]
                  is original,
                  "batch": protocol.BatchRequestInput is not replaced["batch"] and original in
                  typing.get_args(protocol.BatchRequestInput.model_fields["body"].annotation)},
        class_bindings=vllm_bi100_patch.status().get("class_bindings"))


def serve():
    """Serve until stdin closes: one report line with the port; ``GET /standin/errors``: the
    ERROR records logged so far (vLLM's logger does not propagate: it is hooked itself);
    ``GET /standin/shim_log``: the shim's own records (``vllm.bi100_patch``, every level)."""
    import logging

    errors, shim_log = [], []

    class Errors(logging.Handler):
        def __init__(self, level, into):
            super().__init__(level)
            self.into = into

        def emit(self, record):
            exc = record.exc_info[1] if record.exc_info else None
            self.into.append({"logger": record.name, "level": record.levelname,
                              "message": record.getMessage()[:500],
                              "exception": None if exc is None else
                              f"{type(exc).__name__}: {str(exc)[:300]}"})

    async def standin_errors():
        return errors

    async def standin_shim_log():
        return shim_log

    async def standin_split(body: dict):
        key = str(len(SPLITS))
        SPLITS[key] = {"pieces": [str(p) for p in body["pieces"]], "finish": body["finish"]}
        return {"key": key}

    flags = os.environ.get("BI100_APP_FLAGS", "").split()  # e.g. a reasoning parser's
    out, thread = build(["--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                         "--max-num-seqs", "4", *flags],
                        routes=[("/standin/errors", ["GET"], standin_errors),
                                ("/standin/shim_log", ["GET"], standin_shim_log),
                                ("/standin/split", ["POST"], standin_split)])
    handler = Errors(logging.ERROR, errors)  # after vLLM configured its loggers (at import)
    for name in ("", "vllm", "uvicorn", "uvicorn.error", "fastapi"):
        logging.getLogger(name).addHandler(handler)
    shim = logging.getLogger("vllm.bi100_patch")
    shim.addHandler(Errors(logging.DEBUG, shim_log))
    shim.setLevel(logging.DEBUG)
    try:
        import vllm_bi100_patch

        applied = (vllm_bi100_patch.status()["report"] or {}).get("applied")
    except ImportError:
        applied = None
    report(port=out["ports"][0], applied=applied)
    try:
        sys.stdin.read()
    finally:
        for server in out["servers"]:
            server.should_exit = True
        thread.join(timeout=30)


def main(mode):
    if mode == "serve":
        return serve()
    late = mode == "late"
    if late:  # as where the shim activates only later (vLLM's plugin entry point)
        import vllm_bi100_patch

        vllm_bi100_patch.revert()
    out, thread = build(["--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                         "--max-num-seqs", "4"], late=late, in_process=mode == "in_process")
    try:
        if late:
            late_cases(out)
        elif mode == "in_process":
            in_process_cases(out["ports"][0])
        else:
            cases(out["ports"][0])
            try:
                import vllm_bi100_patch

                st = vllm_bi100_patch.status()
                report(case="status", applied=(st["report"] or {}).get("applied"),
                       counts=st["counts"])
            except ImportError:
                report(case="status", applied=None)
    finally:
        for server in out["servers"]:
            server.should_exit = True
        thread.join(timeout=30)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "cases")

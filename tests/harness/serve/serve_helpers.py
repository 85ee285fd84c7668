"""Run a ``vllm serve`` on loopback and check what it answers: shared by the CPU serve tests
(tests/harness/serve/test_serve_cpu.py, ``nox -s serve_cpu``) and the GPU end-to-end run
(scripts/gpu_e2e.sh through scripts/gpu_e2e.py).

Stdlib only (it runs in whatever venv holds vLLM, and nox imports nothing heavy). Every server
listens on 127.0.0.1 and every request goes to 127.0.0.1: ``server_flags`` always sets
``--host 127.0.0.1`` and ``http_json`` refuses any other host.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import random
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence

LOOPBACK = "127.0.0.1"
MODEL_NAME = "tiny-llama"
#: The shim's INFO line when it patched vLLM, and its counters line at exit.
SHIM_INFO = "vllm-bi100-patch active:"
SHIM_COUNTERS = "vllm-bi100-patch counters (pid"

_WORDS = ("the model reads a cache block while every layer of the server writes one token "
          "after another river city garden stone paper engine signal number bright quiet "
          "morning evening winter summer").split()


class ServerError(RuntimeError):
    """A server did not come up, or a request to it failed; the message holds its log tail."""


def make_prompts(lengths: Iterable[int], seed: int = 1234) -> List[str]:
    """Deterministic prompts of ``lengths`` words each (tokens are about 1.3x words)."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(n)).capitalize() for n in lengths]


# --------------------------------------------------------------------------------------------
# Loopback HTTP.

def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def base_url(port: int) -> str:
    if not isinstance(port, int) or not 0 < port < 65536:
        raise ValueError(f"port={port!r} is not a TCP port")
    return f"http://{LOOPBACK}:{port}"


def http_text(url: str, timeout: float = 10) -> str:
    """GET ``url`` on 127.0.0.1 as text (e.g. ``/metrics``)."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "http" or parts.hostname != LOOPBACK:
        raise ValueError(f"url={url!r}: only http://{LOOPBACK} is ever contacted")
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.read().decode("utf-8", "replace")


def http_json(url: str, body: Optional[dict] = None, timeout: float = 10) -> Any:
    """GET (``body`` None) or POST JSON to ``url`` on 127.0.0.1; return the decoded answer."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "http" or parts.hostname != LOOPBACK:
        raise ValueError(f"url={url!r}: only http://{LOOPBACK} is ever contacted")
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        raw = resp.read()
    return json.loads(raw) if raw else None


# --------------------------------------------------------------------------------------------
# Starting, waiting for, stopping a server.

def server_flags(port: int, *, dtype: str, model_name: str = MODEL_NAME,
                 extra: Sequence[str] = ()) -> List[str]:
    """The ``vllm serve`` options after the model: loopback, our port and name, greedy-friendly
    determinism (``--seed 0``, ``--enforce-eager``), then ``extra``."""
    if any(a == "--host" or a.startswith("--host=") for a in extra):
        raise ValueError(f"extra={list(extra)!r}: the host is always {LOOPBACK}")
    return ["--host", LOOPBACK, "--port", str(port), "--served-model-name", model_name,
            "--dtype", dtype, "--max-model-len", "2048", "--seed", "0", "--enforce-eager",
            *extra]


def server_env(base: Mapping[str, str], *, drop_prefixes: Sequence[str] = (),
               **extra: str) -> Dict[str, str]:
    """``base`` without PYTHONPATH (the installed shim, not a checkout's) and keys starting
    with ``drop_prefixes``, offline (no hub, no usage stats), INFO logs, unbuffered, ``extra``."""
    env = {k: v for k, v in base.items()
           if k != "PYTHONPATH" and not (drop_prefixes and k.startswith(tuple(drop_prefixes)))}
    env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "VLLM_LOGGING_LEVEL": "INFO",
                "PYTHONUNBUFFERED": "1"})
    env.update(extra)
    return env


def start(cmd: Sequence[str], env: Mapping[str, str], log_path: str,
          cwd: Optional[str] = None) -> "subprocess.Popen[bytes]":
    """Start ``cmd`` in its own session (so ``stop`` can kill its whole process group), its
    output to ``log_path``."""
    with open(log_path, "wb") as log_file:
        return subprocess.Popen(list(cmd), stdout=log_file, stderr=subprocess.STDOUT, cwd=cwd,
                                env=dict(env), start_new_session=True)


def tail(path: str, n: int = 80) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return "(no log)"


def wait_ready(proc: "subprocess.Popen[Any]", base: str, timeout_s: float, *,
               interval: float = 1.0, health_timeout: float = 5.0, log_path: str = "",
               label: str = "server",
               clock: Callable[[], float] = time.monotonic,
               sleep: Callable[[float], None] = time.sleep) -> float:
    """Poll ``base``/health until it answers; return the seconds it took. Raises ServerError
    (with the log's tail) when the process exits first or ``timeout_s`` passes."""
    t0 = clock()
    deadline = t0 + timeout_s
    while True:
        if proc.poll() is not None:
            raise ServerError(f"[{label}] exited with {proc.returncode} before it was ready; "
                              f"log {log_path}:\n{tail(log_path)}")
        try:
            http_json(base + "/health", timeout=health_timeout)
            return round(clock() - t0, 1)
        except (urllib.error.URLError, ConnectionError, OSError, ValueError):
            pass
        if clock() >= deadline:
            raise ServerError(f"[{label}] not ready after {timeout_s} s; "
                              f"log {log_path}:\n{tail(log_path)}")
        sleep(interval)


def stop(proc: "subprocess.Popen[Any]", timeout: float = 60) -> Optional[int]:
    """SIGTERM the server (it shuts its engine down, whose atexit hooks log and dump), then
    SIGKILL its whole process group whatever happened. Returns its exit code."""
    try:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # engine subprocesses left behind, if any
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
    return proc.returncode


# --------------------------------------------------------------------------------------------
# Greedy completions.

def completion_body(prompt: str, max_tokens: int, model: str = MODEL_NAME) -> Dict[str, Any]:
    """Greedy, fixed length (``ignore_eos``), token ids and logprobs in the answer."""
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "logprobs": 1, "return_tokens_as_token_ids": True, "seed": 0}


def parse_completion(out: Mapping[str, Any]) -> Dict[str, Any]:
    """Token ids (``token_id:N`` strings as ints), logprobs, text and usage of one answer."""
    choice = out["choices"][0]
    tokens = choice["logprobs"]["tokens"]
    ids = [int(t.split(":", 1)[1]) if t.startswith("token_id:") else t for t in tokens]
    return {"ids": ids, "logprobs": choice["logprobs"]["token_logprobs"], "text": choice["text"],
            "completion_tokens": out["usage"]["completion_tokens"],
            "prompt_tokens": out["usage"]["prompt_tokens"]}


def complete(base: str, prompt: str, *, max_tokens: int, model: str = MODEL_NAME,
             timeout: float = 600) -> Dict[str, Any]:
    t0 = time.perf_counter()
    out = http_json(base + "/v1/completions", completion_body(prompt, max_tokens, model),
                    timeout=timeout)
    result = parse_completion(out)
    result["seconds"] = round(time.perf_counter() - t0, 2)
    return result


def complete_all(base: str, prompts: Sequence[str], **kwargs: Any) -> List[Dict[str, Any]]:
    """``complete`` every prompt at once (one thread each); results in prompt order."""
    with concurrent.futures.ThreadPoolExecutor(max(1, len(prompts))) as pool:
        futures = [pool.submit(complete, base, p, **kwargs) for p in prompts]
        return [f.result() for f in futures]


def compare(a: Sequence[Mapping[str, Any]], b: Sequence[Mapping[str, Any]]) -> Dict[str, Any]:
    """Per prompt: identical ids?, first differing position, max |logprob difference| over the
    common prefix. Different numbers of completions are never identical."""
    rows = []
    for x, y in zip(a, b):
        first = next((i for i, (p, q) in enumerate(zip(x["ids"], y["ids"])) if p != q), None)
        if first is None and len(x["ids"]) != len(y["ids"]):
            first = min(len(x["ids"]), len(y["ids"]))
        upto = len(x["ids"]) if first is None else first
        diffs = [abs(p - q) for p, q in zip(x["logprobs"][:upto], y["logprobs"][:upto])
                 if p is not None and q is not None]
        rows.append({"identical": first is None, "first_diff": first,
                     "max_logprob_diff": max(diffs) if diffs else 0.0})
    return {"all_identical": len(a) == len(b) and all(r["identical"] for r in rows),
            "count": (len(a), len(b)), "prompts": rows}


# --------------------------------------------------------------------------------------------
# The shim's evidence in a server log.

def counts_from_log(text: str) -> List[Dict[str, int]]:
    """The shim's ``vllm-bi100-patch counters (pid N): a=1, b=2`` lines, parsed (one dict
    per line, in order; values that are not integers are left out)."""
    found = []
    for line in text.splitlines():
        i = line.find(SHIM_COUNTERS)
        if i < 0:
            continue
        body = line[i:].split("):", 1)[-1]
        counts = {}
        for part in body.split(","):
            if "=" in part:
                k, v = part.strip().split("=", 1)
                try:
                    counts[k] = int(v)
                except ValueError:
                    pass
        found.append(counts)
    return found

"""vLLM 0.6.3's own /metrics app serving the shim's series from two processes
(``test_metrics_real.py``); runs in a fresh interpreter of the nox venv (the shim installed from
its wheel, activated at interpreter start).

As ``vllm serve`` does with its multiprocessing front end: the front end imports vLLM, sets
``PROMETHEUS_MULTIPROC_DIR`` and spawns the engine process, which forks a worker (vLLM's
multiprocessing executor forks its tensor-parallel workers); engine and worker each log one
``Stats`` through vLLM's own ``PrometheusStatLogger`` and, unless the kill switch is on, make
a known number of patched decode calls (one of them above 32,768 tokens).  The front end then
scrapes ``mount_metrics``' app (vLLM's ``/metrics``) until the shim's series add up, or 60 s.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # tests/

from helpers.probes import report  # noqa: E402

#: Patched decode calls per process: short ones, then one of LONG tokens.
CALLS = {"engine": 4, "worker": 6}
LONG = 33000


def _log_vllm_stats() -> None:
    """What vLLM's engine does at every step: one Stats through its Prometheus logger."""
    from vllm.engine.metrics import PrometheusStatLogger
    from vllm.engine.metrics_types import Stats

    values = {}
    for field in dataclasses.fields(Stats):
        kind = str(field.type)
        values[field.name] = (["stop"] if "str" in kind else [3] if "List[int]" in kind
                              else [0.5] if "List" in kind else None if "Optional" in kind
                              else time.time() if field.name == "now" else 1)
    logger = PrometheusStatLogger(local_interval=5.0, labels={"model_name": "tiny"},
                                  max_model_len=LONG + 1)
    logger.log(Stats(**values))


def _decode(n: int) -> None:
    import torch
    from helpers.reference import make_cache, make_tables

    import vllm.attention.ops.paged_attn as pa

    g = torch.Generator().manual_seed(0)
    for lens in [[20, 5]] * n + [[LONG]]:
        blocks = sum(-(-x // 16) for x in lens)
        kc, vc = make_cache(blocks + 1, 2, 64, 16, torch.float32, gen=g)
        bt = make_tables(lens, 16, max(-(-x // 16) for x in lens), blocks + 1, g)
        q = torch.randn(len(lens), 4, 64, generator=g)
        pa.PagedAttention.forward_decode(q, kc, vc, bt, torch.tensor(lens, dtype=torch.int32),
                                         max(lens), "auto", 2, 0.125, None, 1.0, 1.0)


def _process(who: str, q, done, shim_on: bool) -> None:
    import vllm.attention.ops.paged_attn  # noqa: F401  (patched at its import)

    import vllm_bi100_patch as shim

    _log_vllm_stats()
    if shim_on:
        _decode(CALLS[who])
    st = shim.status()
    q.put({"who": who, "pid": os.getpid(), "counts": st["counts"], "metrics": st["metrics"],
           "patched": st["patched"]})
    done.wait(180)


def engine(q, done, shim_on: bool) -> None:
    import vllm.attention.ops.paged_attn  # noqa: F401

    worker = mp.get_context("fork").Process(target=_process, args=("worker", q, done, shim_on))
    worker.start()  # forked before any compute, as vLLM's executor forks its workers
    _process("engine", q, done, shim_on)
    worker.join(60)


def scrape(app) -> dict:
    """The families of one GET /metrics (and the shim's lines as served, under "text")."""
    from fastapi.testclient import TestClient
    from prometheus_client.parser import text_string_to_metric_families

    text = TestClient(app).get("/metrics").text
    out = {f.name: {"type": f.type, "samples": [[s.name, s.labels, s.value] for s in f.samples]}
           for f in text_string_to_metric_families(text)}
    out["text"] = [ln for ln in text.splitlines() if "vllm_bi100:" in ln]
    return out


def shim_calls(families: dict) -> float:
    fam = families.get("vllm_bi100:decode_calls")
    return sum(s[2] for s in fam["samples"]) if fam else 0.0  # type: ignore[index]


def main() -> None:
    shim_on = os.environ.get("VLLM_BI100_PATCH") != "0"
    from fastapi import FastAPI

    from vllm.entrypoints.openai import api_server

    # vLLM's front end sets the directory after importing vLLM, before it starts the engine.
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="bi100-prom-")
    q, done = mp.get_context("spawn").Queue(), mp.get_context("spawn").Event()
    proc = mp.get_context("spawn").Process(target=engine, args=(q, done, shim_on))
    proc.start()
    workers = [q.get(timeout=600) for _ in range(2)]
    app = FastAPI()
    api_server.mount_metrics(app)
    expected = sum(n + 1 for n in CALLS.values()) if shim_on else 0
    deadline = time.time() + (60 if shim_on else 3)
    families = scrape(app)
    while shim_calls(families) < expected and time.time() < deadline:
        time.sleep(0.5)
        families = scrape(app)
    if not shim_on:
        time.sleep(2)  # longer than the interval: anything the shim wrote would be there
        families = scrape(app)
    done.set()
    proc.join(120)
    files = sorted(os.listdir(os.environ["PROMETHEUS_MULTIPROC_DIR"]))
    import vllm_bi100_patch as shim

    text = families.pop("text")
    report(workers=workers, families=families, text=text, files=files, expected=expected,
           front_end=shim.status()["metrics"], exitcode=proc.exitcode)


if __name__ == "__main__":
    main()

"""Runs in a fresh interpreter of a venv with vLLM, ray and the installed shim.

Starts a local Ray cluster on this machine, loopback only (node address 127.0.0.1, no
dashboard, no usage stats), runs one task in a Ray worker process, and stops the cluster.  The
task imports vLLM's ``paged_attn`` (and the backend utils the ``prefix_block_table`` row
targets), calls the patched ``forward_decode`` once and returns the shim's ``status()``, the
worker's pid and the addresses the cluster's processes listen on.  Prints one report line.

As vLLM 0.6.3's multiprocessing front end does before its engine process starts Ray,
``PROMETHEUS_MULTIPROC_DIR`` is set first: the Ray worker inherits it, and its shim writes its
``vllm_bi100:`` series there (the task waits for one flush); the probe reads them back as
vLLM's /metrics would.
"""

from __future__ import annotations

import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from helpers.probes import report  # noqa: E402

LOOPBACK = "127.0.0.1"
TASK_TIMEOUT_S = 300


def worker_task():
    import os

    import torch
    import vllm.attention.backends.utils  # noqa: F401  (the prefix_block_table row's module)
    from vllm.attention.ops.paged_attn import PagedAttention

    import vllm_bi100_patch
    from vllm_bi100_patch.patching import registry

    # One decode through the patched method: 1 sequence of 5 tokens in a 1-block cache.
    kv = torch.randn(PagedAttention.get_kv_cache_shape(2, 16, 2, 64))
    kc, vc = PagedAttention.split_kv_cache(kv, 2, 64)
    out = _decode(PagedAttention, torch.randn(1, 4, 64), kc, vc)
    import time

    from vllm_bi100_patch.patching.counting import export

    exporter, deadline = export.exporter(), time.time() + 20
    flushes = exporter.flushes if exporter is not None else 0
    while exporter is not None and exporter.flushes <= flushes and time.time() < deadline:
        time.sleep(0.1)  # one flush after the decode (VLLM_BI100_METRICS_INTERVAL_S=1)
    return {"pid": os.getpid(), "status": vllm_bi100_patch.status(),
            "is_ours": registry.is_ours(vars(PagedAttention)["forward_decode"]),
            "finite": bool(torch.isfinite(out).all()), "env": os.environ.get("VLLM_BI100_PATCH")}


def _decode(pa, query, kc, vc):
    import inspect

    import torch

    names = list(inspect.signature(pa.forward_decode).parameters)
    args = {"query": query, "key_cache": kc, "value_cache": vc,
            "block_tables": torch.tensor([[1]], dtype=torch.int32),
            "seq_lens": torch.tensor([5], dtype=torch.int32), "max_seq_len": 5,
            "kv_cache_dtype": "auto", "num_kv_heads": 2, "scale": 0.125,
            "alibi_slopes": None, "k_scale": 1.0, "v_scale": 1.0}
    return pa.forward_decode(**{n: args[n] for n in names if n in args})


def listening(pids):
    """(pid, name, address) of every listening inet socket of ``pids``."""
    import psutil

    out = []
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            for conn in proc.net_connections(kind="inet"):
                if conn.status == psutil.CONN_LISTEN:
                    out.append((pid, proc.name(), conn.laddr.ip))
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return out


def _describe(proc) -> str:
    """``pid name status cmdline``, as far as the process can still be read."""
    try:
        return f"{proc.pid} {proc.name()} {proc.status()} {' '.join(proc.cmdline())[:200]}"
    except Exception as exc:  # gone or unreadable meanwhile
        return f"{proc.pid} ({type(exc).__name__})"


def main() -> None:
    import psutil
    import ray

    tmp = tempfile.mkdtemp(prefix="bi100-ray-")
    prom = os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="bi100-prom-")
    os.environ["VLLM_BI100_METRICS_INTERVAL_S"] = "1"
    ray.init(_node_ip_address=LOOPBACK, include_dashboard=False, num_cpus=1,
             _temp_dir=tmp, configure_logging=False, log_to_driver=True)
    try:
        result = ray.get(ray.remote(worker_task).remote(), timeout=TASK_TIMEOUT_S)
        me = psutil.Process()
        pids = [p.pid for p in me.children(recursive=True)]
        sockets = listening(pids)
        nodes = [n["NodeManagerAddress"] for n in ray.nodes()]
    finally:
        children = psutil.Process().children(recursive=True)
        ray.shutdown()
    _, alive = psutil.wait_procs(children, timeout=60)  # Ray stops them by itself
    left = [_describe(p) for p in alive]  # what stayed, for the failure message
    for p in alive:  # never leave a cluster behind, even when the test then fails
        p.kill()
    from prometheus_client.multiprocess import MultiProcessCollector

    calls = sum(s.value for m in MultiProcessCollector(None, path=prom).collect()
                for s in m.samples if s.name == "vllm_bi100:decode_calls_total")
    files = [f for f in os.listdir(prom) if "vllm-bi100" in f]
    report(driver_pid=os.getpid(), worker=result, sockets=sockets, nodes=nodes,
           children_left=left, metrics_calls=calls, metrics_files=files)


if __name__ == "__main__":
    main()

"""Both ends of a probe: a script run in a fresh interpreter prints one report line per
result (``report``), the test that ran it reads them back (``run_probe``, ``reports``).

Stdlib only at import: the probes import this in the venvs they test.  ``report``,
``prefix_state`` and ``patched_state`` are self-contained (no module globals): their source
is also the prelude of ``shim.run_python``'s subprocesses.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from typing import Dict, Optional, Tuple

TAG = "@@REPORT@@"

#: tests/harness: the scripts, apps and stand-ins the harness-marked tests run in fresh
#: interpreters, one folder per harness kind (real, corex, engine, ray, serve).
HARNESS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "harness")


def installed_vllm() -> str:
    """The installed vLLM's version, as its metadata says; "" where none is installed (a
    real_vllm test module collected by the unit session)."""
    import importlib.metadata

    try:
        return importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return ""


def report(**kw):
    """Print one report line: the tag, then ``kw`` as JSON."""
    import json
    import sys

    sys.stdout.write("@@REPORT@@" + json.dumps(kw, default=str) + "\n")
    sys.stdout.flush()


def error_of(fn) -> str:
    """``"Type: message"`` of what ``fn()`` raised (anything, SystemExit included), or
    ``"no error"``."""
    try:
        fn()
    except BaseException as exc:  # noqa: B902 - we report whatever it is
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def prefix_state():
    """vLLM's Triton ``prefix_prefill`` module in this process: "absent", "substitute" (the
    shim's import-guard stand-in, marked ``__vllm_bi100_substitute__``) or "real"."""
    import sys

    m = sys.modules.get("vllm.attention.ops.prefix_prefill")
    if m is None:
        return "absent"
    return "substitute" if getattr(m, "__vllm_bi100_substitute__", False) else "real"


def patched_state(cls=None):
    """{method: whether the shim's wrapper is in place} for ``cls`` (default: vLLM's
    PagedAttention, imported)."""
    import vllm_bi100_patch.patching.registry as r

    if cls is None:
        from vllm.attention.ops.paged_attn import PagedAttention as cls
    return {n: r.is_ours(vars(cls)[n]) for n in ("forward_decode", "forward_prefix")}


#: Imports json and sys, defines ``report``, ``prefix_state``, ``patched_state`` and
#: ``patched`` (the same) in a subprocess's source.
PRELUDE = ("import json, sys\n\n"
           + "".join(inspect.getsource(f) + "\n\n" for f in (report, prefix_state, patched_state))
           + "patched = patched_state\n")


def clean_env(env: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """This process's environment without the shim's variables and PYTHONPATH, plus ``env``."""
    full = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_BI100", "PYTHONPATH"))}
    full.update(env or {})
    return full


def reports(proc: subprocess.CompletedProcess) -> list:
    """The report lines of a finished subprocess; fails (with its output) if it failed or
    reported nothing."""
    out = [json.loads(line[len(TAG):]) for line in proc.stdout.splitlines()
           if line.startswith(TAG)]
    if proc.returncode != 0 or not out:
        raise AssertionError(f"subprocess failed (rc={proc.returncode})\nstdout:\n"
                             f"{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-8000:]}")
    return out


def served(name: str, proc: subprocess.Popen, log_path: str, deadline: float) -> dict:
    """The first report line a server process writes to ``log_path`` (its port, ...), once it
    serves; the test fails with the log's tail if the process ends or ``deadline``
    (``time.monotonic()``) passes first."""
    import time

    import pytest

    while True:
        with open(log_path) as fh:
            for line in fh:
                if line.startswith(TAG):
                    return json.loads(line[len(TAG):])
        if proc.poll() is not None or time.monotonic() > deadline:
            with open(log_path) as fh:
                tail = fh.read()[-6000:]
            pytest.fail(f"the {name} server did not start (rc={proc.poll()}):\n{tail}")
        time.sleep(0.2)


def stop_servers(procs) -> None:
    """Close each server process's stdin (they serve until it closes) and wait for it; one
    that does not end within 60 s is killed."""
    for proc in procs:
        try:
            proc.stdin.close()
            proc.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            proc.kill()


def run_probe(script: str, mode: str, env: Optional[Dict[str, str]] = None,
              timeout: int = 900) -> Tuple[dict, str]:
    """Run ``python script mode`` in a fresh interpreter of this venv, in the script's folder,
    with a clean environment plus ``env``: its last report and the rest of its output."""
    proc = subprocess.run([sys.executable, script, mode], env=clean_env(env),
                          capture_output=True, text=True, timeout=timeout,
                          cwd=os.path.dirname(os.path.abspath(script)))
    last = reports(proc)[-1]
    log = "\n".join(ln for ln in (proc.stdout + proc.stderr).splitlines() if not ln.startswith(TAG))
    return last, log

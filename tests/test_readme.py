"""The README cannot drift: generated tables, the two set-up commands, CI running the same one."""

import os
import re
import subprocess
import sys

from scripts import readme_tables
from helpers.shim import ROOT

from vllm_bi100_patch import versions


def _readme():
    with open(os.path.join(ROOT, "README.md")) as fh:
        return fh.read()


def test_generated_tables_are_current():
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "readme_tables.py"),
                           "--check"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_every_family_is_tested_for_real_by_a_nox_session():
    matrix = readme_tables.nox_releases("MATRIX")
    default = readme_tables.nox_releases("DEFAULT_REAL")
    fams = {versions.family_for(versions.VersionInfo(v)) for v in matrix}
    assert set(versions.FAMILIES) <= fams
    assert None in fams  # a release without the methods is tested for the clean skip
    default_fams = {versions.family_for(versions.VersionInfo(v)) for v in default}
    assert len(default_fams - {None}) >= 3 and set(default) <= set(matrix)


def test_two_setup_commands_and_ci_runs_the_test_one():
    setup = _readme().split("## Set-up", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", setup, re.S)
    assert len(blocks) == 2
    test_cmd = blocks[1].strip()
    with open(os.path.join(ROOT, ".ci", "run")) as fh:
        ci = fh.read()
    assert test_cmd in ci.splitlines()


def test_doctor_exit_codes_and_server_check_are_documented():
    from vllm_bi100_patch import __main__ as cli

    text = _readme()
    for code in (cli.EXIT_OK, cli.EXIT_WONT_PATCH, cli.EXIT_CONFIG):
        assert re.search(rf"^\| {code} \| ", text, re.M), code
    assert "<vllm-bi100-patch wrapper of PagedAttention.forward_decode (vLLM" in text
    assert "vllm-bi100-patch active: vLLM" in text
    assert "Python 3.10" in text
    for heading in ("## Strict mode", "## Reverting", "## When it cannot patch"):
        assert heading in text

"""The README cannot drift: generated tables (README and docs/), the two set-up commands early on,
CI running the same one, a README a newcomer reads in minutes."""

import os
import re
import subprocess
import sys

from scripts import readme_tables
from helpers.shim import ROOT

from vllm_bi100_patch.patching import versions


def _read(rel):
    with open(os.path.join(ROOT, rel), encoding="utf-8") as fh:
        return fh.read()


def _readme():
    return _read("README.md")


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


def test_the_setup_commands_come_within_the_first_80_lines_with_their_python():
    lines = _readme().splitlines()
    fences = [i for i, line in enumerate(lines) if line.startswith("```bash")]
    setup = lines.index("## Set-up")
    commands = [i for i in fences if i > setup][:2]
    assert len(commands) == 2 and max(commands) < 80, commands
    head = "\n".join(lines[setup:commands[0]])
    assert f"Python {readme_tables.nox_string('PYTHON')}" in head  # what every session asks for


def test_the_readme_is_short_and_has_no_development_history():
    lines = _readme().splitlines()
    assert len(lines) <= 300, len(lines)
    long = [(n, len(line)) for n, line in enumerate(lines, 1) if len(line) > 400]
    assert not long, long
    text = _readme()
    history = re.findall(r"\bissues? #?\d+|\bthe field\b|\blent\b|starting commit", text, re.I)
    assert not history, history


def test_the_server_install_builds_the_wheel_and_installs_it():
    install = _readme().split("## Install on a server", 1)[1].split("\n## ", 1)[0]
    assert "python3 -m pip wheel --no-deps -w dist ." in install
    assert re.search(r"pip install \S*vllm_bi100_patch-[0-9.]+-py3-none-any\.whl", install)
    assert "PYTHONPATH" in install and ".pth" in install


def test_generated_blocks_live_where_the_readme_points():
    assert "<!-- BEGIN catalogue -->" in _read("docs/patches.md")
    assert "<!-- BEGIN catalogue -->" not in _readme()
    assert "<!-- BEGIN versions-table -->" in _readme()
    for rel, blocks in readme_tables.FILES.items():
        for name in blocks:
            assert f"<!-- BEGIN {name} -->" in _read(rel), (rel, name)
        if rel != "README.md":
            assert rel in _readme(), rel  # the README's map names every generated doc


def test_doctor_exit_codes_and_server_check_are_documented():
    from vllm_bi100_patch import __main__ as cli

    text = _readme()
    for code in (cli.EXIT_OK, cli.EXIT_WONT_PATCH, cli.EXIT_CONFIG, cli.EXIT_WEDGED):
        assert re.search(rf"^\| {code} \| ", text, re.M), code
    assert "<vllm-bi100-patch wrapper of PagedAttention.forward_decode (vLLM" in text
    assert "vllm-bi100-patch active: vLLM" in text
    assert "Python 3.10" in text
    assert "VLLM_BI100_PATCH=0" in text and "docs/operating.md" in text
    operating = _read("docs/operating.md")
    for heading in ("## Strict mode", "## Reverting", "## When it cannot patch"):
        assert heading in operating


def test_every_readme_command_has_a_runner_in_ci():
    """Every ```bash block of the README is run by the ``readme`` nox session (a default
    session, so CI): a new block without a runner fails here, before any install."""
    from tools import readme_commands

    found = readme_commands.blocks()
    assert len(found) >= 6
    plan = readme_commands.Plan(found)  # raises on a block without a runner
    assert plan["demo"].text == "python3 -m pip install -q 'nox==2026.10.20' 'uv==0.13.9' " \
                                "&& python3 -m nox -s demo"
    sessions = _nox_default_sessions()
    assert '"readme"' in sessions and re.search(r"^def readme\(session", _read("noxfile.py"), re.M)


def test_a_readme_block_without_a_runner_fails_the_plan():
    from tools import readme_commands

    text = _readme() + "\n## Something new\n\n```bash\nvllm-bi100-patch new-verb\n```\n"
    try:
        readme_commands.Plan(readme_commands.blocks(text))
    except SystemExit as exc:
        assert "Something new" in str(exc)
    else:
        raise AssertionError("a README block without a runner passed the plan")


def test_the_one_liner_check_compares_what_the_readme_prints():
    from tools import readme_commands

    plan = readme_commands.Plan(readme_commands.blocks())
    expected = plan["one-liner"].comments()[0]
    printed = ("WARNING vLLM logs first\n" + expected.replace("0x...", "0x7f21f44e6660"))
    readme_commands._expect(printed, expected, "wrapper")
    try:
        readme_commands._expect(printed.replace("vllm-bi100-patch wrapper", "plain"),
                                expected, "wrapper")
    except SystemExit:
        pass
    else:
        raise AssertionError("another printed line passed as the README's")


def _nox_default_sessions():
    import ast

    tree = ast.parse(_read("noxfile.py"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Attribute) and t.attr == "sessions" for t in node.targets):
            return ast.get_source_segment(_read("noxfile.py"), node.value)
    raise LookupError("nox.options.sessions not found")

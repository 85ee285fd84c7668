"""doctor and status in fresh interpreters (repo on PYTHONPATH, so the repo's sitecustomize
activates the shim at start-up as the installed one would): one verdict, documented exit codes,
status and doctor agreeing, --version, and status patching nothing."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from fakes.fake_vllm import write_fake_vllm
from helpers.shim import ROOT

from vllm_bi100_patch import __version__
from vllm_bi100_patch.patching import versions

FAM = versions.family_for(versions.VersionInfo("0.6.3"))


@pytest.fixture(scope="module")
def fakes(tmp_path_factory):
    base = tmp_path_factory.mktemp("doctor")
    renamed = tuple("seqlens" if p == "seq_lens" else p for p in FAM.decode_params)
    ixformer = base / "ixformer_site"
    (ixformer / "ixformer").mkdir(parents=True)
    (ixformer / "ixformer" / "__init__.py").write_text("raise ImportError('not at start-up')\n")
    corex = base / "corex_site"
    (corex / "torch-2.1.0+corex.3.2.3.dist-info").mkdir(parents=True)
    return {
        "none": None,
        "v063": write_fake_vllm(str(base / "v063"), "0.6.3.post1"),
        "v012": write_fake_vllm(str(base / "v012"), "0.12.0", with_methods=False),
        "corex43": write_fake_vllm(str(base / "corex43"), "0.8.3+corex.4.3.0"),
        "renamed": write_fake_vllm(str(base / "renamed"), "0.6.3", decode_params=renamed),
        "builder_fixed": write_fake_vllm(str(base / "builder_fixed"), "0.6.3.post1",
                                         metadata_builder="fixed"),
        "builder_unknown": write_fake_vllm(str(base / "builder_unknown"), "0.6.3.post1",
                                           metadata_builder="bug"),
        "xformers_backend": write_fake_vllm(str(base / "xformers_backend"), "0.6.3.post1",
                                            metadata_builder="fixed", xformers_backend=True),
        "fake_xformers": os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
            os.path.abspath(__file__)))), "tests", "fakes", "fake_xformers"),
        "ixformer": str(ixformer),
        "corex": str(corex),
    }


def cli(fakes, tree, *args, extra_path=(), **env):
    path = [ROOT] + ([fakes[tree]] if fakes[tree] else []) + [fakes[p] for p in extra_path]
    full = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_BI100", "PYTHONPATH"))}
    full.update(env, PYTHONPATH=os.pathsep.join(path))
    return subprocess.run([sys.executable, "-m", "vllm_bi100_patch", *args], env=full,
                          capture_output=True, text=True, timeout=300, cwd=ROOT)


def verdict_of(stdout):
    lines = [ln for ln in stdout.splitlines() if ln.startswith("verdict: ")]
    assert len(lines) == 1, stdout
    return lines[0]


# (tree, extra sys.path, env, exit code, verdict must contain)
CASES = {
    "no-vllm-auto": ("none", (), {}, 0, "will NOT patch: vLLM not installed in this environment"),
    "no-vllm-forced": ("none", (), {"VLLM_BI100_PATCH": "1"}, 1,
                       "will NOT patch: vLLM not installed in this environment"),
    "kill-switch": ("v063", (), {"VLLM_BI100_PATCH": "0"}, 0,
                    "will NOT patch: VLLM_BI100_PATCH=0 (kill switch)"),
    "invalid-mode": ("v063", (), {"VLLM_BI100_PATCH": "2"}, 3,
                     "VLLM_BI100_PATCH='2' is invalid; accepted: auto, 1, 0"),
    "invalid-budget": ("v063", (), {"VLLM_BI100_PATCH": "1", "VLLM_BI100_PREFIX_BUDGET_MB": "x"},
                       3, "WILL patch vLLM 0.6.3.post1 (family v0.5.5): forward_decode, "
                       "forward_prefix; import guard on; VLLM_BI100_PATCH=1; invalid "
                       "configuration: VLLM_BI100_PREFIX_BUDGET_MB='x' is invalid"),
    "auto-no-iluvatar": ("v063", (), {}, 0, "will NOT patch: VLLM_BI100_PATCH unset (auto) and "
                         "no Iluvatar stack detected"),
    "auto-ixformer": ("v063", ("ixformer",), {"VLLM_BI100_PATCH": "auto"}, 0,
                      "WILL patch vLLM 0.6.3.post1 (family v0.5.5): forward_decode, "
                      "forward_prefix; import guard on"),
    "auto-corex-torch": ("v063", ("corex",), {}, 0, "WILL patch vLLM 0.6.3.post1"),
    "forced": ("v063", (), {"VLLM_BI100_PATCH": "1"}, 0, "WILL patch vLLM 0.6.3.post1"),
    "disabled-all": ("v063", (), {"VLLM_BI100_PATCH": "1",
                                  "VLLM_BI100_PATCH_DISABLE": "decode,prefix,import_guard"},
                     0, "patches nothing: every patch is listed in VLLM_BI100_PATCH_DISABLE"),
    "unsupported": ("v012", (), {"VLLM_BI100_PATCH": "1"}, 1,
                    "will NOT patch: vLLM 0.12.0 is not a supported version"),
    "code-check": ("renamed", (), {"VLLM_BI100_PATCH": "1"}, 1,
                   "fails the code check (PagedAttention.forward_decode parameters"),
    # CoreX 4.x serves attention through ixformer FlashAttention: patched, but not protected.
    "corex-4x-off-path": ("corex43", ("ixformer",), {}, 1,
                          "patches forward_decode, forward_prefix but they are NOT on the "
                          "serving path: vLLM 0.8.3+corex.4.3.0 is an Iluvatar CoreX 4.x build"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_doctor_verdict_and_exit_code(fakes, case):
    tree, extra, env, code, text = CASES[case]
    proc = cli(fakes, tree, "doctor", extra_path=extra, **env)
    assert proc.returncode == code, proc.stdout + proc.stderr
    line = verdict_of(proc.stdout)
    assert text in line, line
    assert line.endswith(f"exit {code}]")
    assert ("[as configured;" in line) is (code == 0)
    assert "None is not supported" not in proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.parametrize("case", sorted(CASES))
def test_status_agrees_with_doctor(fakes, case):
    tree, extra, env, code, _ = CASES[case]
    doctor = verdict_of(cli(fakes, tree, "doctor", extra_path=extra, **env).stdout)
    status = cli(fakes, tree, "status", extra_path=extra, **env)
    assert status.returncode == 0, status.stderr
    said = verdict_of(status.stdout)
    if case == "code-check":  # status never imports vLLM: it cannot see the code
        assert said.startswith("verdict: WILL patch") and "code not checked: run doctor" in said
        return
    assert said.replace(" (code not checked: run doctor)", "") == doctor
    # the process line agrees with the verdict
    decision = re.search(r"^decision +(.*)$", status.stdout, re.M).group(1)
    if "WILL patch" in said or "patches nothing" in said or "NOT on the serving path" in said:
        assert decision.startswith("armed:")
    elif "not a supported version" in said:  # checked when vLLM is imported; status does not
        assert decision.startswith("armed:")
    else:
        assert decision.startswith("off:")


def test_doctor_shows_the_process_patched_after_the_import(fakes):
    out = cli(fakes, "v063", "doctor", VLLM_BI100_PATCH="1").stdout
    process = out.split("\nthis process (doctor", 1)[1]
    assert "[info] patched: ['forward_decode', 'forward_prefix']" in process
    assert "decision: patched: decode, prefix (vLLM 0.6.3.post1, family v0.5.5)" in process
    assert "'prefix_prefill': 'substitute'" in process


def test_doctor_failed_code_check_says_the_guard_stays_on(fakes):
    out = cli(fakes, "renamed", "doctor", VLLM_BI100_PATCH="1").stdout
    assert "the import guard stays on: stock forward_prefix raises TritonPrefixBlocked" in out
    assert "decision: not patched: vLLM 0.6.3 is in the range of family v0.5.5" in out
    assert "the import guard stays on on purpose" in out
    off = cli(fakes, "renamed", "doctor", VLLM_BI100_PATCH="1",
              VLLM_BI100_PATCH_DISABLE="import_guard").stdout
    assert "stock vLLM runs" in verdict_of(off)


def test_doctor_unsupported_version_shows_what_the_import_did(fakes):
    out = cli(fakes, "v012", "doctor", VLLM_BI100_PATCH="1").stdout
    assert "decision: not patched: vLLM 0.12.0 is not a supported version" in out
    assert "'installed': False" in out  # the guard came off at the import of vLLM


def test_version_flag(fakes):
    proc = cli(fakes, "none", "--version")
    assert proc.returncode == 0 and proc.stdout.strip() == f"vllm-bi100-patch {__version__}"


def test_status_patches_nothing_and_imports_no_vllm(fakes):
    code = ("import sys, io, contextlib\n"
            "from vllm_bi100_patch.__main__ import main\n"
            "buf = io.StringIO()\n"
            "with contextlib.redirect_stdout(buf):\n"
            "    rc = main(['status'])\n"
            "import vllm_bi100_patch as shim\n"
            "st = shim.status()\n"
            "print(rc, sorted(m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')),"
            " st['patched'])\n")
    full = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_BI100", "PYTHONPATH"))}
    full.update(VLLM_BI100_PATCH="1", PYTHONPATH=os.pathsep.join([ROOT, fakes["v063"]]))
    proc = subprocess.run([sys.executable, "-c", code], env=full, capture_output=True,
                          text=True, timeout=120, cwd=ROOT)
    assert proc.stdout.strip() == "0 [] []", proc.stdout + proc.stderr


def test_doctor_shows_the_native_decode_profile(fakes):
    out = cli(fakes, "v063", "doctor", VLLM_BI100_PATCH="1").stdout
    native = out.split("native decode kernels", 1)[1].split("\nthis process (doctor", 1)[0]
    # The fake tree's ops take stock arguments but have no kernels behind them on CPU.
    assert "[info] ops: no native kernels in this process" in native
    assert "route: every length: pure-PyTorch decode (no native ops)" in native


def test_status_names_the_serving_path_of_a_corex_4x_build(fakes):
    out = cli(fakes, "corex43", "status", extra_path=("ixformer",)).stdout
    line = re.search(r"^serving_path +(.*)$", out, re.M).group(1)
    assert "Iluvatar CoreX 4.x build" in line and "not on the serving path" in line
    plain = cli(fakes, "v063", "status").stdout
    assert re.search(r"^serving_path +None$", plain, re.M)


def test_doctor_shows_the_block_table_row(fakes):
    """The prefix_block_table row's code check: absent builder, upstream fix, unknown shape."""
    plain = cli(fakes, "v063", "doctor", VLLM_BI100_PATCH="1")
    assert "import vllm.attention.backends.utils" in plain.stdout
    assert "not in this build: prefix_block_table not needed" in plain.stdout
    fixed = cli(fakes, "builder_fixed", "doctor", VLLM_BI100_PATCH="1")
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    line = [ln for ln in fixed.stdout.splitlines() if "code check _add_seq_group" in ln]
    assert line and "not needed in this build: this build has the upstream fix (vLLM pull " \
        "request #9532" in line[0], fixed.stdout
    unknown = cli(fakes, "builder_unknown", "doctor", VLLM_BI100_PATCH="1")
    line = [ln for ln in unknown.stdout.splitlines() if "code check _add_seq_group" in ln]
    assert line and "FAIL" in line[0] and "fingerprint" in line[0], unknown.stdout


def _invariance_lines(stdout):
    server = [ln for ln in stdout.splitlines() if "] a server here: " in ln]
    process = re.findall(r"\[info\] slicing_invariant: (.*)$", stdout, re.M)
    assert len(server) == 1 and len(process) == 1, stdout
    return server[0].split("] a server here: ", 1)[1], process[0]


# env -> (a server here, this process): how each line starts
INVARIANCE = {
    "default": ({}, "no: prompts without a cached prefix run on the backend's own kernel, not "
                "the shim's (the backend's xops is xformers.ops, not ixformer's); set "
                "VLLM_BI100_PROMPT_ATTENTION=shim", "no: prompts without a cached prefix"),
    "opt-in": ({"VLLM_BI100_PROMPT_ATTENTION": "shim"}, "yes: every prompt and prefix "
               "attention of the XFormers backend is the shim's", "yes: every prompt"),
    "prefix-disabled": ({"VLLM_BI100_PROMPT_ATTENTION": "shim", "VLLM_BI100_PATCH_DISABLE":
                         "prefix"}, "no: the prefix row is not applied (disabled by "
                        "VLLM_BI100_PATCH_DISABLE)", "no: the prefix row is not applied"),
    "kill-switch": ({"VLLM_BI100_PATCH": "0"}, "no: the shim will not patch here "
                    "(VLLM_BI100_PATCH=0", "no: the shim is off"),
}


@pytest.mark.parametrize("case", sorted(INVARIANCE))
def test_doctor_says_whether_the_guarantee_holds(fakes, case):
    """A fake 0.6.3 tree with a stock-shaped XFormers backend: the server line (from the code
    checks) and doctor's own process (patched by doctor's imports) say the same."""
    env, server, process = INVARIANCE[case]
    env = dict({"VLLM_BI100_PATCH": "1"}, **env)
    proc = cli(fakes, "xformers_backend", "doctor", extra_path=("fake_xformers",), **env)
    said_server, said_process = _invariance_lines(proc.stdout)
    assert said_server.startswith(server), said_server
    assert said_process.startswith(process), said_process
    state = "ok" if case == "opt-in" else "info"
    assert f"[{state:4}] a server here: " in proc.stdout


def test_status_says_whether_the_guarantee_holds(fakes):
    """``status`` imports no vLLM: its process has not patched anything yet."""
    out = cli(fakes, "xformers_backend", "status", extra_path=("fake_xformers",),
              VLLM_BI100_PATCH="1").stdout
    assert re.search(r"^slicing_invariant +unknown: vLLM's attention is not imported in this "
                     r"process yet", out, re.M), out


def _hint_lines(stdout):
    return [ln for ln in stdout.splitlines() if "ENABLE_CUSTOM_IPC" in ln]


def test_doctor_advises_the_ixformer_ipc_all_reduce_on_the_vendor_stack_only(fakes):
    """A performance hint, never a FAIL (exit code as before); shown on an Iluvatar stack (a
    +corex torch, ixformer), silent where the variable is set or the stack is not Iluvatar."""
    vendor = cli(fakes, "v063", "doctor", extra_path=("corex",))
    assert vendor.returncode == 0, vendor.stdout + vendor.stderr
    lines = _hint_lines(vendor.stdout)
    assert len(lines) == 1 and lines[0].startswith("  [hint] ENABLE_CUSTOM_IPC: "), lines
    assert "tensor-parallel" in lines[0] and "+44.6%" in lines[0]
    assert "the shim never sets it" in lines[0]
    for env in ({"ENABLE_CUSTOM_IPC": "1"}, {"ENABLE_CUSTOM_IPC": "0"}):
        assert not _hint_lines(cli(fakes, "v063", "doctor", extra_path=("corex",), **env).stdout)
    assert not _hint_lines(cli(fakes, "v063", "doctor", VLLM_BI100_PATCH="1").stdout)


def test_the_ipc_hint_is_advice_and_reads_only_the_environment():
    from vllm_bi100_patch.ops import advice

    assert advice.ipc_hint(vendor=False, environ={}) is None
    assert advice.ipc_hint(vendor=True, environ={"ENABLE_CUSTOM_IPC": ""}) is None
    state, name, text = advice.ipc_hint(vendor=True, environ={})
    assert (state, name) == ("hint", "ENABLE_CUSTOM_IPC") and "ENABLE_CUSTOM_IPC=1" in text

"""Activation in fresh interpreters, on fake vLLM trees: the import/apply/revert ordering matrix
(ddtrace's habit), sitecustomize chaining and shadowing, the .pth line, the plugin entry point,
spawned and forked children, the kill switch, auto-detection, strict mode, ``-S``/``-I``."""

from __future__ import annotations

import itertools
import os
import textwrap

import pytest
from fakes.fake_vllm import write_fake_vllm
from helpers.probes import reports
from helpers.shim import ROOT, TEST_DEPS_SITE, run_python, venv_site_packages

PA = "vllm.attention.ops.paged_attn"


@pytest.fixture(scope="module")
def fake_root(tmp_path_factory):
    return write_fake_vllm(str(tmp_path_factory.mktemp("fake") / "v063"), "0.6.3.post1")


def _env(fake_root, **extra):
    """Environment for the repo's code on a plain interpreter (explicit API only)."""
    env = {"PYTHONPATH": os.pathsep.join([ROOT, fake_root]), "VLLM_BI100_PATCH": "1"}
    env.update(extra)
    return env


def _venv_env(fake_root, **extra):
    """Environment for the installed shim: only the fake vLLM on PYTHONPATH."""
    env = {"PYTHONPATH": fake_root, "VLLM_BI100_PATCH": "1"}
    env.update(extra)
    return env


# ---------------------------------------------------------------- ordering matrix (explicit API)

STEPS = {
    "import": "import vllm.attention.ops.paged_attn as pa",
    "apply": "import vllm_bi100_patch as shim; shim.apply()",
    "revert": "import vllm_bi100_patch as shim; shim.revert()",
}
ORDERS = [p for p in itertools.permutations(["import", "apply", "revert"])]
ORDERS += [p + ("apply",) for p in ORDERS]
ORDERS += [("apply", "apply", "import"), ("import", "apply", "apply", "revert", "revert")]


def _expected(order):
    """(patched, prefix_prefill state, what paged_attn's context_attention_fwd is)."""
    imported = active = False
    prefix, bound = "absent", None
    for step in order:
        if step == "import" and not imported:
            imported = True
            prefix = bound = "substitute" if active else "real"
        elif step == "apply":
            active = True
            if bound == "real":
                bound = "substitute"  # re-pointed at the substitute while the guard is on
        elif step == "revert":
            active = False
            if bound == "substitute":
                # re-pointed names get the real function back; a substitute vLLM imported
                # itself is unbound and leaves sys.modules (README: revert)
                bound = "real" if prefix == "real" else None
                prefix = "real" if prefix == "real" else "absent"
    return imported and active, prefix, bound


@pytest.mark.parametrize("order", ORDERS, ids=["-".join(o) for o in ORDERS])
def test_ordering_matrix(fake_root, order):
    code = "\n".join(STEPS[s] for s in order) + textwrap.dedent(f"""
        import sys
        pa = sys.modules.get("{PA}")
        state = patched() if pa else {{}}
        if pa:
            import vllm_bi100_patch.patching.registry as r
            from vllm_bi100_patch.attention import import_guard
            fn = vars(pa).get("context_attention_fwd")
            state["binding"] = (None if fn is None else "substitute"
                                if fn is import_guard.context_attention_fwd else "real")
            for n in ("forward_decode", "forward_prefix"):
                d = vars(pa.PagedAttention)[n]
                state[n + "_original"] = (not r.is_ours(d)) and d.__func__.__module__ == "{PA}"
        import vllm_bi100_patch as shim
        report(state=state, prefix=prefix_state(), status=shim.status(),
               finders=[type(f).__name__ for f in sys.meta_path],
               triton_imports=sys.modules.get("_fake_triton_log").imports
               if "_fake_triton_log" in sys.modules else [])
    """)
    # No sitecustomize here (plain interpreter, repo on PYTHONPATH): only the explicit API acts.
    result = reports(run_python(code, env=_env(fake_root, VLLM_BI100_PATCH="auto")))[-1]
    patched, prefix, bound = _expected(order)
    assert result["prefix"] == prefix
    if "import" in order:
        st = result["state"]
        assert st["forward_decode"] is patched and st["forward_prefix"] is patched
        assert st["forward_decode_original"] is (not patched)
        assert st["binding"] == bound
    switches = [s for s in order if s != "import"]
    active = switches[-1] == "apply"
    assert result["status"]["active"] is active
    # revert takes both finders off sys.meta_path; apply puts them back
    ours = {"PostImportFinder", "PrefixPrefillGuard"} & set(result["finders"])
    assert ours == ({"PostImportFinder", "PrefixPrefillGuard"} if active else set())
    assert (result["triton_imports"] != []) is (prefix == "real")


# ----------------------------------------------------------- installed shim: start-up activation

def test_sitecustomize_patches_on_import_and_logs_once(shim_venv, fake_root):
    code = """
        import logging; logging.basicConfig(level=logging.INFO)
        import vllm_bi100_patch as shim
        from vllm.attention.ops.paged_attn import PagedAttention
        import vllm.attention.ops.paged_attn
        report(patched=patched(), prefix=prefix_state(), status=shim.status())
    """
    proc = run_python(code, python=shim_venv, env=_venv_env(fake_root))
    result = reports(proc)[0]
    assert result["patched"] == {"forward_decode": True, "forward_prefix": True}
    assert result["prefix"] == "substitute"
    st = result["status"]
    assert st["active"] and st["family"] == "v0.5.5" and st["vllm_version"] == "0.6.3.post1"
    assert {"pth", "sitecustomize"} <= set(st["activated_by"])
    assert sorted(st["patched"]) == ["forward_decode", "forward_prefix"]
    assert st["import_guard"]["installed"]
    info = [line for line in proc.stderr.splitlines() if "vllm-bi100-patch active" in line]
    assert len(info) == 1 and "0.6.3.post1" in info[0] and "v0.5.5" in info[0]


def test_kill_switch_gives_stock_vllm(shim_venv, fake_root):
    code = """
        import sys
        import vllm_bi100_patch as shim
        st = shim.apply()
        import vllm.attention.ops.paged_attn as pa
        finders = [type(f).__module__ for f in sys.meta_path]
        loaded = sorted(m for m in sys.modules if m.startswith("vllm_bi100_patch"))
        report(patched=patched(), prefix=prefix_state(), status=st, finders=finders,
               loaded=loaded)
    """
    result = reports(run_python(code, python=shim_venv, env=_venv_env(fake_root, VLLM_BI100_PATCH="0")))[0]
    assert result["patched"] == {"forward_decode": False, "forward_prefix": False}
    assert result["prefix"] == "real"
    assert not any("vllm_bi100_patch" in f for f in result["finders"])
    assert not result["status"]["active"] and "kill switch" in result["status"]["decision"]
    assert "vllm_bi100_patch.patching.registry" not in result["loaded"]


def test_auto_mode_needs_iluvatar(shim_venv, fake_root, tmp_path):
    code = """
        import vllm.attention.ops.paged_attn
        report(patched=patched(), prefix=prefix_state())
    """
    off = reports(run_python(code, python=shim_venv, env=_venv_env(fake_root, VLLM_BI100_PATCH="auto")))
    assert off[0]["patched"]["forward_decode"] is False and off[0]["prefix"] == "real"
    ix = tmp_path / "ixformer_site"
    (ix / "ixformer").mkdir(parents=True)
    (ix / "ixformer" / "__init__.py").write_text("raise ImportError('never imported at start-up')\n")
    env = _venv_env(fake_root, VLLM_BI100_PATCH="auto")
    env["PYTHONPATH"] += os.pathsep + str(ix)
    on = reports(run_python(code, python=shim_venv, env=env))
    assert on[0]["patched"]["forward_decode"] is True and on[0]["prefix"] == "substitute"


def test_spawned_and_forked_children_are_patched(shim_venv, fake_root):
    code = """
        import multiprocessing as mp
        def child(q):
            import vllm.attention.ops.paged_attn
            import vllm_bi100_patch.patching.registry as r
            from vllm.attention.ops.paged_attn import PagedAttention
            q.put(r.is_ours(vars(PagedAttention)["forward_decode"]))
        if __name__ == "__main__":
            import vllm.attention.ops.paged_attn
            out = {}
            for method in ("spawn", "fork", "forkserver"):
                ctx = mp.get_context(method)
                q = ctx.Queue()
                p = ctx.Process(target=child, args=(q,))
                p.start(); out[method] = q.get(timeout=60); p.join(60)
            report(children=out, parent=patched())
    """
    proc = run_python(code, python=shim_venv, env=_venv_env(fake_root), script=True)
    result = reports(proc)[0]
    assert result["children"] == {"spawn": True, "fork": True, "forkserver": True}
    assert result["parent"]["forward_decode"] is True


@pytest.fixture(scope="module")
def user_sitecustomize(shim_venv, tmp_path_factory):
    """A user's sitecustomize in a directory a .pth adds after our site-packages."""
    later = tmp_path_factory.mktemp("user-site-later")
    (later / "sitecustomize.py").write_text(
        "import os\nif os.environ.get('USER_SITE_MARK'):\n"
        "    open(os.environ['USER_SITE_MARK'], 'w').write('ran')\n")
    pth = os.path.join(venv_site_packages(shim_venv), "zz_test_user_site.pth")
    with open(pth, "w") as fh:
        fh.write(str(later) + "\n")
    yield later
    os.remove(pth)


def test_user_sitecustomize_later_on_path_still_runs(shim_venv, fake_root, user_sitecustomize,
                                                      tmp_path):
    mark = tmp_path / "mark"
    code = """
        import sitecustomize, sys
        import vllm.attention.ops.paged_attn
        report(ours=sitecustomize.__file__, patched=patched(),
               chained="vllm_bi100_patch._chained_sitecustomize" in sys.modules)
    """
    result = reports(run_python(code, python=shim_venv,
                                env=_venv_env(fake_root, USER_SITE_MARK=str(mark))))[0]
    assert mark.read_text() == "ran" and result["chained"]
    assert result["ours"].startswith(os.path.dirname(venv_site_packages(shim_venv)))
    assert result["patched"]["forward_decode"] is True


def test_shadowing_sitecustomize_does_not_stop_activation(shim_venv, fake_root, tmp_path):
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "sitecustomize.py").write_text("SHADOW = True\n")
    env = _venv_env(fake_root)
    env["PYTHONPATH"] = os.pathsep.join([str(shadow), env["PYTHONPATH"]])
    code = """
        import sitecustomize, vllm_bi100_patch as shim
        import vllm.attention.ops.paged_attn
        report(shadow=getattr(sitecustomize, "SHADOW", False), patched=patched(),
               by=shim.status()["activated_by"])
    """
    result = reports(run_python(code, python=shim_venv, env=env))[0]
    assert result["shadow"] is True
    assert result["patched"]["forward_decode"] is True and result["by"] == ["pth"]


def test_plugin_entry_point(shim_venv, fake_root):
    code = """
        import importlib.metadata as md
        eps = [e for e in md.entry_points(group="vllm.general_plugins") if e.name == "bi100_patch"]
        eps[0].load()()
        import vllm_bi100_patch as shim
        import vllm.attention.ops.paged_attn
        report(n=len(eps), value=eps[0].value, patched=patched(), by=shim.status()["activated_by"])
    """
    # -S: no site, so neither sitecustomize nor .pth ran; only the plugin activates.
    env = _venv_env(fake_root)
    env["PYTHONPATH"] += os.pathsep.join(["", venv_site_packages(shim_venv), TEST_DEPS_SITE])
    result = reports(run_python(code, python=shim_venv, env=env, args=("-S",)))[0]
    assert result["n"] == 1 and result["value"] == "vllm_bi100_patch.activation.bootstrap:plugin"
    assert result["patched"]["forward_decode"] is True and result["by"] == ["plugin"]


def test_console_script_and_module_cli(shim_venv, fake_root):
    import subprocess

    script = os.path.join(os.path.dirname(shim_venv), "vllm-bi100-patch")
    env = dict(os.environ, **_venv_env(fake_root))
    out = subprocess.run([script, "status"], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "0.6.3.post1" in out.stdout and "v0.5.5" in out.stdout


@pytest.mark.parametrize("flag", ["-S", "-I"])
def test_no_site_and_isolated_interpreters_start(shim_venv, flag):
    proc = run_python("import sys; print('alive')", python=shim_venv, args=(flag,), prelude=False)
    assert proc.returncode == 0 and proc.stdout.strip() == "alive"
    assert proc.stderr == ""


def test_unknown_version_warns_once_and_strict_raises(shim_venv, tmp_path):
    fake = write_fake_vllm(str(tmp_path / "v040"), "0.4.0")
    code = """
        import vllm.attention.ops.paged_attn
        report(patched=patched())
    """
    proc = run_python(code, python=shim_venv, env=_venv_env(fake))
    assert reports(proc)[0]["patched"]["forward_decode"] is False
    warnings = [line for line in proc.stderr.splitlines() if "not a supported version" in line]
    assert len(warnings) == 1 and "0.4.0" in warnings[0]
    strict = run_python(code, python=shim_venv, env=_venv_env(fake, VLLM_BI100_PATCH_STRICT="1"))
    assert strict.returncode != 0 and "PatchError" in strict.stderr
    assert "not a supported version" in strict.stderr


def test_methods_gone_in_012_is_a_clean_skip(shim_venv, tmp_path):
    fake = write_fake_vllm(str(tmp_path / "v012"), "0.12.0", with_methods=False)
    code = """
        import vllm.attention.ops.paged_attn as pa
        import vllm_bi100_patch as shim
        report(attrs=sorted(vars(pa.PagedAttention)), status=shim.status())
    """
    proc = run_python(code, python=shim_venv, env=_venv_env(fake))
    result = reports(proc)[0]
    assert "forward_decode" not in result["attrs"] and result["status"]["patched"] == []
    assert result["status"]["supported"] is False
    assert sum("not a supported version" in line for line in proc.stderr.splitlines()) == 1


def test_invalid_configuration_never_breaks_the_host(shim_venv, fake_root):
    code = """
        import vllm.attention.ops.paged_attn
        report(patched=patched(), prefix=prefix_state())
    """
    proc = run_python(code, python=shim_venv, env=_venv_env(fake_root, VLLM_BI100_PATCH="maybe"))
    result = reports(proc)[0]
    assert result["patched"]["forward_decode"] is False and result["prefix"] == "real"
    assert "VLLM_BI100_PATCH='maybe' is invalid" in proc.stderr


def test_doctor_in_the_installed_venv(shim_venv, fake_root):
    """Every activation path is found, the code check runs, doctor's own process is patched
    (the proof), and the verdict and exit code follow the configuration."""
    import subprocess

    script = os.path.join(os.path.dirname(shim_venv), "vllm-bi100-patch")
    env = dict(os.environ, **_venv_env(fake_root))
    ok = subprocess.run([script, "doctor"], env=env, capture_output=True, text=True)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    for line in ("[ok  ] code check forward_decode: family v0.5.5", "[ok  ] .pth:",
                 "[ok  ] sitecustomize:", "[ok  ] entry point:",
                 "[info] patched: ['forward_decode', 'forward_prefix']",
                 "verdict: WILL patch vLLM 0.6.3.post1 (family v0.5.5)"):
        assert line in ok.stdout, ok.stdout
    off = subprocess.run([script, "doctor"], env=dict(env, VLLM_BI100_PATCH="0"),
                         capture_output=True, text=True)
    assert off.returncode == 0, off.stdout
    assert "verdict: will NOT patch: VLLM_BI100_PATCH=0 (kill switch)" in off.stdout
    assert "[as configured; exit 0]" in off.stdout and "[FAIL]" not in off.stdout


def _site_noise(stderr):
    return [ln for ln in stderr.splitlines() if ln.strip()]


def test_strict_mode_fails_the_vllm_process_once_and_leaves_others_alone(shim_venv, fake_root):
    env = _venv_env(fake_root, VLLM_BI100_PATCH_STRICT="1", VLLM_BI100_PREFIX_BUDGET_MB="lots")
    other = run_python("print('alive')", python=shim_venv, env=env, prelude=False)
    assert other.returncode == 0 and other.stdout.strip() == "alive"
    assert other.stderr == ""  # no traceback, no warning: this program does not run vLLM
    server = run_python("import vllm.attention.ops.paged_attn\nprint('started')",
                        python=shim_venv, env=env, prelude=False)
    assert server.returncode != 0 and "started" not in server.stdout
    assert server.stderr.count("Traceback") == 1, server.stderr
    last = server.stderr.strip().splitlines()[-1]
    assert last.startswith("vllm_bi100_patch.activation.config.ConfigError: "
                           "VLLM_BI100_PREFIX_BUDGET_MB='lots' is invalid"), last
    assert "VLLM_BI100_PATCH_STRICT=1" in last
    # strict with a valid configuration: the server starts, patched
    fine = run_python("import vllm.attention.ops.paged_attn\nreport(patched=patched())",
                      python=shim_venv, env=_venv_env(fake_root, VLLM_BI100_PATCH_STRICT="1"))
    assert reports(fine)[0]["patched"]["forward_decode"] is True


def test_invalid_value_warns_once_and_only_where_vllm_runs(shim_venv, fake_root):
    env = _venv_env(fake_root, VLLM_BI100_PREFIX_BUDGET_MB="lots")
    other = run_python("print('alive')", python=shim_venv, env=env, prelude=False)
    assert other.stderr == "" and other.stdout.strip() == "alive"
    proc = run_python("import vllm.attention.ops.paged_attn\nreport(patched=patched())",
                      python=shim_venv, env=env)
    assert reports(proc)[0]["patched"]["forward_decode"] is True  # default budget used
    lines = [ln for ln in proc.stderr.splitlines() if "'lots' is invalid" in ln]
    assert len(lines) == 1 and "using the default 256" in lines[0], proc.stderr
    # the kill switch silences the shim completely; status still reports the value
    killed = run_python("import vllm.attention.ops.paged_attn\nimport vllm_bi100_patch as s\n"
                        "report(errors=s.status()['config_errors'])", python=shim_venv,
                        env=dict(env, VLLM_BI100_PATCH="0"))
    assert "invalid" not in killed.stderr
    assert "'lots' is invalid" in reports(killed)[0]["errors"][0]


def test_invalid_mode_is_reported_with_its_value_and_keeps_the_shim_off(shim_venv, fake_root):
    code = """
        import vllm.attention.ops.paged_attn
        import vllm_bi100_patch as shim
        report(patched=patched(), prefix=prefix_state(), status=shim.status())
    """
    proc = run_python(code, python=shim_venv, env=_venv_env(fake_root, VLLM_BI100_PATCH="2"))
    result = reports(proc)[0]
    assert result["patched"]["forward_decode"] is False and result["prefix"] == "real"
    assert result["status"]["decision"] == ("off: VLLM_BI100_PATCH=2 is invalid (accepted: auto, "
                                            "1, 0); the shim stays off")
    assert result["status"]["mode_raw"] == "2"
    assert sum("VLLM_BI100_PATCH='2' is invalid" in ln for ln in proc.stderr.splitlines()) == 1


def test_active_bootstrap_imports_no_torch_no_vllm_no_wrapt(shim_venv, fake_root):
    code = """
        import sys
        import vllm_bi100_patch as shim
        heavy = sorted(m for m in sys.modules if m.split(".")[0] in
                       ("torch", "vllm", "wrapt", "logging", "importlib_metadata"))
        report(heavy=heavy, status=shim.status(), meta=("importlib.metadata" in sys.modules))
    """
    result = reports(run_python(code, python=shim_venv, env=_venv_env(fake_root)))[0]
    assert result["heavy"] == [] and result["status"]["active"] is True
    assert result["status"]["decision"].startswith("armed:")
    assert result["status"]["import_guard"]["installed"] is True


def test_pth_line_left_behind_without_the_package_is_silent(shim_venv, tmp_path):
    import shutil
    import subprocess
    import sys as _sys

    venv = tmp_path / "orphan"
    subprocess.run([_sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    shutil.copy(os.path.join(ROOT, "vllm_bi100_patch.pth"), venv_site_packages(python))
    proc = run_python("print('alive')", python=python, prelude=False)
    assert proc.returncode == 0 and proc.stdout.strip() == "alive" and proc.stderr == ""


def test_pip_uninstall_leaves_nothing_behind(shim_venv, tmp_path):
    import glob
    import subprocess
    import sys as _sys

    wheel = glob.glob(os.path.join(os.path.dirname(os.path.dirname(shim_venv)), "..", "wheel",
                                   "vllm_bi100_patch-*.whl"))
    assert wheel, "the shim_venv fixture builds the wheel"
    venv = tmp_path / "uninstall"
    subprocess.run([_sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    site_dir = venv_site_packages(python)
    with open(os.path.join(site_dir, "other_package.py"), "w") as fh:  # a non-empty site dir
        fh.write("")
    before = set(os.listdir(site_dir)) | set(os.listdir(venv / "bin"))
    pip = [_sys.executable, "-m", "pip", "--python", python]
    subprocess.run(pip + ["install", "--no-deps", "--no-index", "-q", wheel[0]], check=True,
                   capture_output=True)
    installed = set(os.listdir(site_dir))
    assert {"sitecustomize.py", "vllm_bi100_patch.pth", "vllm_bi100_patch"} <= installed
    subprocess.run(pip + ["uninstall", "-y", "-q", "vllm-bi100-patch"], check=True,
                   capture_output=True)
    after = set(os.listdir(site_dir)) | set(os.listdir(venv / "bin"))
    assert after - before - {"__pycache__"} == set(), after - before
    leftovers = [p for p in glob.glob(os.path.join(site_dir, "**", "*"), recursive=True)
                 if "bi100" in p or "sitecustomize" in p]
    assert leftovers == []
    proc = run_python("print('alive')", python=python, prelude=False)
    assert proc.stderr == "" and proc.stdout.strip() == "alive"

"""Activation in fresh interpreters, on fake vLLM trees: the import/apply/revert ordering matrix
(ddtrace's habit), sitecustomize chaining and shadowing, the .pth line, the plugin entry point,
spawned and forked children, the kill switch, auto-detection, strict mode, ``-S``/``-I``."""

from __future__ import annotations

import itertools
import os
import textwrap

import pytest
from shimtest import (
    ROOT,
    TEST_DEPS_SITE,
    reports,
    run_python,
    venv_site_packages,
    write_fake_vllm,
)

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
    imported = guard = active = False
    prefix = "absent"
    for step in order:
        if step == "import":
            imported = True
            prefix = "substitute" if guard else "real"
        elif step == "apply":
            active = guard = True
        elif step == "revert":
            active = guard = False
    patched = imported and active
    return patched, prefix


@pytest.mark.parametrize("order", ORDERS, ids=["-".join(o) for o in ORDERS])
def test_ordering_matrix(fake_root, order):
    code = "\n".join(STEPS[s] for s in order) + textwrap.dedent(f"""
        import sys
        pa = sys.modules.get("{PA}")
        state = patched() if pa else {{}}
        if pa:
            import vllm_bi100_patch.registry as r
            from vllm_bi100_patch import import_guard
            fn = vars(pa)["context_attention_fwd"]
            state["bound_substitute"] = fn is import_guard.context_attention_fwd
            for n in ("forward_decode", "forward_prefix"):
                d = vars(pa.PagedAttention)[n]
                state[n + "_original"] = (not r.is_ours(d)) and d.__func__.__module__ == "{PA}"
        report(state=state, prefix=prefix_state(),
               triton_imports=sys.modules.get("_fake_triton_log").imports
               if "_fake_triton_log" in sys.modules else [])
    """)
    # No sitecustomize here (plain interpreter, repo on PYTHONPATH): only the explicit API acts.
    result = reports(run_python(code, env=_env(fake_root, VLLM_BI100_PATCH="auto")))[-1]
    patched, prefix = _expected(order)
    assert result["prefix"] == prefix
    if "import" in order:
        st = result["state"]
        assert st["forward_decode"] is patched and st["forward_prefix"] is patched
        assert st["forward_decode_original"] is (not patched)
        # A real module imported before activation is neutralised while active, restored after.
        assert st["bound_substitute"] is (prefix == "substitute" or patched)
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
    assert "vllm_bi100_patch.registry" not in result["loaded"]


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
            import vllm_bi100_patch.registry as r
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
    assert result["n"] == 1 and result["value"] == "vllm_bi100_patch._bootstrap:plugin"
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


def test_doctor_reports_checks_and_exit_code(shim_venv, fake_root):
    import subprocess

    script = os.path.join(os.path.dirname(shim_venv), "vllm-bi100-patch")
    env = dict(os.environ, **_venv_env(fake_root))
    ok = subprocess.run([script, "doctor"], env=env, capture_output=True, text=True)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    for line in ("[ok  ] code check forward_decode: family v0.5.5", "[ok  ] .pth:",
                 "[ok  ] sitecustomize:", "[ok  ] entry point:", "would activate"):
        assert line in ok.stdout, ok.stdout
    off = subprocess.run([script, "doctor"], env=dict(env, VLLM_BI100_PATCH="0"),
                         capture_output=True, text=True)
    assert off.returncode == 1 and "[FAIL] mode" in off.stdout and "would NOT activate" in off.stdout
    fam = "0.6.3"
    renamed = os.path.join(os.path.dirname(fake_root), "renamed")
    from fakes.fake_vllm import write_fake_vllm as write
    from vllm_bi100_patch import versions

    params = tuple("seqlens" if p == "seq_lens" else p
                   for p in versions.family_for(versions.VersionInfo(fam)).decode_params)
    write(renamed, fam, decode_params=params)
    bad = subprocess.run([script, "doctor"], env=dict(env, PYTHONPATH=renamed),
                         capture_output=True, text=True)
    assert bad.returncode == 1 and "[FAIL] code check forward_decode" in bad.stdout


def test_strict_mode_reports_invalid_configuration_loudly(shim_venv, fake_root):
    env = _venv_env(fake_root, VLLM_BI100_PATCH_STRICT="1", VLLM_BI100_PREFIX_BUDGET_MB="lots")
    proc = run_python("print('alive')", python=shim_venv, env=env, prelude=False)
    # site.py reports the error of the .pth line / sitecustomize; the interpreter goes on.
    assert "ConfigError" in proc.stderr and "VLLM_BI100_PREFIX_BUDGET_MB='lots'" in proc.stderr
    assert proc.stdout.strip() == "alive"
    lenient = run_python("print('alive')", python=shim_venv, prelude=False,
                         env=_venv_env(fake_root, VLLM_BI100_PREFIX_BUDGET_MB="lots"))
    assert "ConfigError" not in lenient.stderr and "'lots' is invalid" in lenient.stderr

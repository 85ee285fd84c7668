"""The one bootstrap every activation path calls; cheap, idempotent, thread-safe, never raises.

Activation layer: imports neither torch nor vLLM, nor wrapt (whose import pulls
in ``importlib.metadata``, tens of milliseconds in every Python process). It reads the
configuration, installs the import guard for ``prefix_prefill`` and a post-import hook on
``vllm.attention.ops.paged_attn``, and returns. The patching itself runs when vLLM imports
that module (or at once, when it is already imported).
"""

from __future__ import annotations

import _thread
import os
import sys

from . import config, hooks
from .log import log
from ..patching import strict as _strict_mode, table
from .phase import Phase, State
from ..patching import patch_row

TYPE_CHECKING = False  # typing itself costs milliseconds at interpreter start

if TYPE_CHECKING:
    from typing import Any, Dict, Optional, Tuple

    from ..patching.decision import Decision

TARGET_MODULE = patch_row.PAGED_ATTN
_lock = _thread.RLock()


_state = State()


_finder = hooks.PostImportFinder()

#: Activation paths that run at interpreter start, in every Python process of the environment:
#: they never raise, not even under strict mode (strict fails the import of vLLM instead).
AT_START = ("sitecustomize", "pth")


def _guards(action: str, settings: Optional[config.Settings] = None) -> None:
    """``install`` the enabled import-guard rows of the patch table (their factory), or
    ``uninstall`` every one that was loaded (the same module's ``uninstall``)."""
    import importlib

    for row in table.guards():
        module_name, _, install = row.factory.partition(":")
        if action == "install":
            if settings is not None and row.name in settings.disabled:
                continue
            getattr(importlib.import_module(module_name), install)()
        elif module_name in sys.modules:
            sys.modules[module_name].uninstall()


def _ensure_finder() -> None:
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)


def _remove_finder() -> None:
    while _finder in sys.meta_path:
        sys.meta_path.remove(_finder)


def activation_decision() -> Optional[Decision]:
    """The activation's ``decision.Decision`` at the version stage: decided once at activation
    (``activate``), refined once with the installed vLLM version, then reused by every later
    step (the version hook, ``registry.apply_to`` for each target module, ``apply()``); refined
    again only if the installed version changes. The start-up decision itself when it
    closed the gate; None before any activation (and after ``revert()``)."""
    with _lock:
        start = _state.start
        if start is None or not start.open:
            return start
        from ..patching import decision, versions

        info = versions.installed_vllm_version()
        known = _state.decision
        if known is None or known.version != info.raw or known.kind == decision.ARMED:
            known = _state.decision = start.refine(info)
        return known


def check_config(settings: config.Settings, strict: bool) -> None:
    """The one check of the configuration: invalid variables (the kill switch aside) raise one
    ConfigError under ``strict`` (the import of vLLM, or ``apply(strict=True)``, fails), else
    get one WARNING each per process."""
    if settings.errors and not settings.kill_switch:
        _strict_mode.raise_or_log(
            "; ".join(settings.errors) + f" (strict mode, {config.STRICT}=1 or "
            "apply(strict=True): vLLM is not started with an invalid vllm-bi100-patch "
            "configuration)", strict, error=config.ConfigError, warnings=settings.errors)


def _failed(what: str, exc: Exception) -> None:
    """A step failed with ``exc``: recorded in ``last_error``; raised under strict mode, else
    logged with its traceback."""
    _state.last_error = f"{type(exc).__name__}: {exc}"
    _strict_mode.raise_or_log(what, _state.strict, exc=exc, traceback=True)


def _before_vllm() -> None:
    """Runs when ``vllm`` is about to be imported (or at activation, if it already is): invalid
    variables are reported (strict: raised) now; an unsupported version gets its one WARNING and
    no side effects at all (the import guard comes off again), even if vLLM never imports
    paged_attn (0.12+ has no such methods)."""
    with _lock:
        settings = _state.settings
        if settings is None:
            return
        check_config(settings, _state.strict)  # strict: raises, the import of vLLM fails
        if not _state.active:
            return
        try:
            from ..patching import decision, registry

            result = activation_decision()
            assert result is not None  # active: decided at activation
            if result.kind == decision.UNSUPPORTED:
                reason = result.reason
                _guards("uninstall")
                reason += "; " + registry.consequence()
                _state.enter(Phase.NOT_PATCHED, reason)
                _strict_mode.raise_or_log(reason, _state.strict)
        except Exception as exc:
            _failed("version check failed", exc)


def _on_target(module: Any) -> None:
    """Post-import callback of every module the patch table targets: patch it now. Never
    raises, except under strict mode."""
    with _lock:
        if not _state.active or _state.settings is None:
            return
        try:
            from ..patching import registry  # wrapt and the patch layer load here, not at start-up

            this = registry.apply_to(module, _state.settings, base=activation_decision())  # its rows
            report = registry.last_report()  # every target module patched so far, merged
        except Exception as exc:
            _state.enter(Phase.NOT_PATCHED, f"patching failed ({type(exc).__name__}: {exc})")
            _failed("patching failed", exc)
            return
        guard = "on" if table.guard_installed("import_guard") else "off"
        _state.enter(*_outcome(report, guard))
        _export_metrics(report)
        if this.reason is not None:
            _strict_mode.raise_or_log(this.reason, _state.strict)  # apply_to warned already
            return
        # Conditional rows this build does not need are in status()["report"], not here.
        skipped = _skipped(report)
        if not this.applied and this.skipped and all(
                v.startswith("not needed") for v in this.skipped.values()):
            return  # a module whose rows this build does not need: nothing to announce
        log.info("vllm-bi100-patch active: vLLM %s (family %s), patched %s%s; import "
                 "guard %s; activated by %s (pid %d)", report.vllm_version, report.family,
                 ", ".join(report.applied) or "nothing", skipped, guard,
                 ",".join(_state.sources), os.getpid())


def _export_metrics(report: Any) -> None:
    """The shim's series on vLLM's /metrics from this process (export.start: a
    daemon thread, nothing on the hot path); never raises into the host."""
    try:
        from ..patching.counting import export

        assert _state.settings is not None
        export.start(_state.settings.metrics_interval_s, report)
    except Exception as exc:
        log.warning("vllm-bi100-patch: metrics export not started (%s: %s)",
                    type(exc).__name__, exc)


def _skipped(report: Any) -> str:
    """The rows a report skipped, as the activation's line and state say them (conditional
    rows this build does not need are in status()["report"], not here)."""
    return "".join(f", skipped {k} ({v})" for k, v in report.skipped.items()
                   if not v.startswith("not needed"))


def _outcome(report: Any, guard: str) -> Tuple[Phase, str]:
    """The phase and its detail from the merged report of every module patched so far."""
    if not report.applied and report.reason is not None:
        return Phase.NOT_PATCHED, report.reason
    skipped = _skipped(report)
    text = (f"{', '.join(report.applied) or 'nothing'}{skipped} (vLLM "
            f"{report.vllm_version}, family {report.family}); import guard {guard}")
    return Phase.PATCHED, text + (f"; not patched: {report.reason}"
                                  if report.reason is not None else "")


def _configure_logging(settings: config.Settings) -> None:
    if settings.log_level:
        log.setLevel(settings.log_level)  # only then is logging imported


def _watch_vllm() -> None:
    _ensure_finder()
    if _before_vllm not in _finder.before.get("vllm", []):
        _finder.register_before("vllm", _before_vllm)
    elif "vllm" in sys.modules:
        _before_vllm()


def activate(source: str, *, force: bool = False, strict: Optional[bool] = None) -> None:
    """Activate the shim (idempotent). ``force`` skips hardware auto-detection (explicit
    ``apply()``); the kill switch always wins. Raises only under strict mode, and then only
    in a process that imports vLLM (or for an explicit ``apply()``)."""
    with _lock:
        if source not in _state.sources:
            _state.sources.append(source)
        if _state.active:
            return
        settings = config.load()
        _state.settings = settings
        _configure_logging(settings)
        _state.strict = settings.strict if strict is None else strict
        if _state.strict and source not in AT_START:
            check_config(settings, True)  # explicit apply()/plugin: raise now
        from ..patching import decision  # stdlib only, like config

        start = _state.start = decision.decide(settings, force=force)  # once per activation
        _state.decision = None
        if not start.open:
            _state.enter(Phase.OFF, start.reason)
            if settings.errors and not settings.kill_switch:
                _watch_vllm()  # report the invalid values where vLLM runs, and only there
            return
        _state.enter(Phase.ARMED, "patches when vLLM imports " + TARGET_MODULE)
        _guards("install", settings)
        _watch_vllm()
        for name in table.hooked_modules():
            if _on_target not in _finder.hooks.get(name, []):
                _finder.register(name, _on_target)
            else:
                module = sys.modules.get(name)
                if module is not None:
                    _on_target(module)


def apply(strict: Optional[bool]) -> None:
    """``vllm_bi100_patch.apply()``: activate on any hardware, then, under strict mode, raise
    what a strict vLLM process would meet: an invalid variable (``check_config``), an
    unsupported version or a failed code check (``PatchError``)."""
    with _lock:
        activate("apply", force=True, strict=strict)
        settings = config.load()
        if not (settings.strict if strict is None else strict):
            return
        check_config(settings, True)
        if not _state.active:
            return
        from ..patching import decision

        result = activation_decision()  # the activation's, decided once
        reason = result.reason if result is not None and result.kind == decision.UNSUPPORTED \
            else None
        if reason is None and "vllm_bi100_patch.patching.registry" in sys.modules:
            from ..patching import registry

            reason = registry.last_report().reason
        if reason is not None:
            _strict_mode.raise_or_log(reason, True)


def bootstrap(source: str) -> None:
    """Entry for sitecustomize, the .pth line and the vLLM plugin. Never raises at interpreter
    start (sitecustomize, .pth); from the plugin (a vLLM process) only under strict mode."""
    try:
        activate(source)
    except Exception as exc:  # the host process must go on, unpatched
        _state.last_error = f"{type(exc).__name__}: {exc}"
        _strict_mode.raise_or_log(
            f"activation from {source} failed ({_state.last_error}); stock vLLM runs",
            _state.strict and source not in AT_START, exc=exc)


def plugin() -> None:
    """``vllm.general_plugins`` entry point (front end, engine process, every worker)."""
    bootstrap("plugin")


def deactivate() -> None:
    """Stop patching new imports: take the post-import hook and the import guard off
    ``sys.meta_path`` (used by ``revert()``, which holds ``_lock`` around both its steps)."""
    with _lock:
        _state.enter(Phase.REVERTED, "stock vLLM (apply() patches again)")
        _state.start = _state.decision = None
        _remove_finder()
        _guards("uninstall")


def reset() -> None:
    """Forget this process's activation entirely (tests): back to ``not bootstrapped``."""
    global _state
    with _lock:
        _state = State()


def settings() -> Optional[config.Settings]:
    """The configuration this process's activation acted on (None before any activation)."""
    with _lock:
        return _state.settings


def state() -> Dict[str, Any]:
    with _lock:
        return {
            "active": _state.active,
            "decision": _state.text(),
            "activated_by": list(_state.sources),
            "strict": _state.strict,
            "last_error": _state.last_error,
            "config_errors": list(_state.settings.errors) if _state.settings else [],
        }

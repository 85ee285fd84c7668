"""The registry of patches: code checks, saved originals, all-or-nothing apply/revert.

The patches themselves are rows of ``vllm_bi100_patch.patching.table``; ``SPECS`` is derived from its
method rows (``rows.SPECS``), and whether to patch at all is ``decision.decide``'s answer.

Style: attributes are resolved through ``vars(cls)`` along the MRO, never
``getattr``, so a staticmethod stays one (and a plain method is wrapped as the function it is,
never as a bound method); the raw descriptor is saved only when it is not our own wrapper (so
patching twice never loses the original, gevent's concern) and restored as the very same object
on revert.  Rows of several modules each keep their report; ``last_report`` merges them.
"""

from __future__ import annotations

import dataclasses
import threading
import types
from typing import Any, Dict, List, Optional, Tuple

import wrapt

from ..activation import config
from . import decision, rebind, table, versions
from .counting import metrics
from .specs import SPECS as SPECS  # re-exported: specs.SPECS, specs.specs_for, ...
from .specs import PatchSpec as PatchSpec
from .specs import check_descriptor as check_descriptor
from .specs import missing_classes as missing_classes
from .specs import specs_for as specs_for
from ..activation.log import log
from .report import Report as Report  # re-exported: report.Report
from .report import merge
from .strict import PatchError as PatchError  # re-exported: strict.PatchError
from .strict import raise_or_log


class PatchWrapper(wrapt.FunctionWrapper):  # type: ignore[misc]
    """The shim's wrapper type; ``type(x) is PatchWrapper`` recognises our own patch (an
    attribute set on a wrapt proxy would land on the wrapped original, hence ``_self_``).

    Everything else (``__name__``, ``__module__``, ``__wrapped__``, the signature) is the
    original's, so vLLM and ``inspect`` see the same method; ``repr``/``str`` say what it is::

        <vllm-bi100-patch wrapper of PagedAttention.forward_decode (vLLM 0.6.3.post1, family
        v0.5.5), wrapping <function PagedAttention.forward_decode at 0x...>>
    """

    def __init__(self, wrapped: Any, wrapper: Any, label: str = "") -> None:
        super().__init__(wrapped, wrapper)
        self._self_label = label

    def __repr__(self) -> str:
        return (f"<vllm-bi100-patch wrapper of {self._self_label}, wrapping "
                f"{self.__wrapped__!r}>")

    __str__ = __repr__


_lock = threading.RLock()
#: (class, attribute) -> the raw descriptor found in vars(owner) before the first patch.
_originals: Dict[Tuple[type, str], Any] = {}
#: (class, attribute) -> the descriptor we installed (to recognise our own patch).
_installed: Dict[Tuple[type, str], Any] = {}
#: (module name, name) -> (module, the original, what the shim put there): the rows that
#: replace a class (``patch_row.REPLACE_CLASS``) or wrap a module's function
#: (``patch_row.REPLACE_FUNCTION``).
_classes: Dict[Tuple[str, str], Tuple[types.ModuleType, Any, Any]] = {}
_last_report = Report()
#: module name -> the report of its last apply (``_last_report`` is their merge).
_module_reports: Dict[str, Report] = {}


unsupported_reason = decision.unsupported_reason


def consequence() -> str:
    """What runs when nothing was patched, said exactly: with the import guard still on (kept
    on purpose after a failed code check: on Iluvatar a clear error beats a hang), stock
    forward_prefix refuses instead of launching Triton."""
    if table.guard_installed("import_guard"):
        return ("the import guard stays on on purpose: stock forward_decode runs, stock "
                "forward_prefix raises TritonPrefixBlocked instead of launching the Triton "
                f"kernel that hangs BI-V100 ({config.MODE}=0 runs stock vLLM throughout)")
    return "no import guard, stock vLLM runs"


def find_descriptor(cls: type, attr: str) -> Tuple[Optional[type], Any]:
    """The raw descriptor of ``attr`` along ``cls``'s MRO, and the class that holds it."""
    for klass in cls.__mro__:
        if attr in vars(klass):
            return klass, vars(klass)[attr]
    return None, None


def is_ours(descriptor: Any) -> bool:
    if isinstance(descriptor, staticmethod):
        return type(descriptor.__func__) is PatchWrapper
    return type(descriptor) is PatchWrapper


def check_code(cls: type, spec: PatchSpec, family: versions.Family) -> Optional[str]:
    """None when the code matches the family, else a sentence saying what differs. Where the
    shim already patched the method (or replaced the class), the original it saved is
    checked."""
    if spec.replaces_global:
        with _lock:
            for _, original, new in _classes.values():
                if new is cls:
                    cls = original
                    break
        return check_descriptor(cls, spec, family)
    owner, desc = find_descriptor(cls, spec.attr)
    if desc is None:
        return f"{spec.owner}.{spec.attr} is missing"
    if is_ours(desc):
        with _lock:
            desc = _originals.get((owner, spec.attr)) if owner is not None else None
        if desc is None:
            return None
    return check_descriptor(desc, spec, family)


#: The outcome of checking one row against a module: ``"unneeded"`` (a conditional row this
#: build does not need), ``"ok"`` or ``"fail"``, with the reason or the problem.
Check = Tuple[PatchSpec, str, str]


def check_rows(module: types.ModuleType, family: versions.Family, specs: List[PatchSpec],
               settings: config.Settings) -> List[Check]:
    """Check ``specs`` against ``module``: a conditional row is first asked whether this build
    needs it (only needed rows are code-checked), then each row's code is checked. The one loop
    both ``apply_to`` and doctor use; the owner classes must exist (see ``missing_classes``)."""
    out: List[Check] = []
    for spec in specs:
        unneeded = spec.not_needed(module, settings)
        if unneeded:
            out.append((spec, "unneeded", unneeded))
            continue
        problem = check_code(vars(module)[spec.owner], spec, family)
        out.append((spec, "fail", problem) if problem else (spec, "ok", ""))
    return out


def _enabled_specs(settings: config.Settings, module_name: str) -> List[PatchSpec]:
    return [s for s in specs_for(module_name) if s.name not in settings.disabled]


def apply_to(module: types.ModuleType, settings: config.Settings, strict: bool = False,
             base: Optional[decision.Decision] = None) -> Report:
    """Patch ``module`` (an imported target module of the table) all-or-nothing: every enabled
    row that is needed in this build, or none. Never raises unless strict. ``base``: the
    activation's decision at the version stage (the bootstrap's, made once; decided here when
    not given), refined here with the target module and the code check."""
    global _last_report
    with _lock:
        report = Report()
        info = versions.installed_vllm_version()
        report.vllm_version = info.raw
        for spec in specs_for(module.__name__):
            if spec.name in settings.disabled:
                report.skipped[spec.name] = "disabled by " + config.DISABLE
        verdict = _target_verdict(module, settings, info, base)
        report.family = verdict.family
        family = versions.family_for(info)
        todo: List[PatchSpec] = []
        if verdict.kind == decision.PATCH:
            assert family is not None
            todo, failures = _checked(module, family, settings, report)
            verdict = verdict.refine(code_problems=failures)
        if verdict.kind == decision.PATCH:
            assert family is not None
            try:
                _patch_all(module, family, todo, report, settings)
            except Exception as exc:
                report.applied.clear()
                report.reason = (f"patching failed and was rolled back "
                                 f"({type(exc).__name__}: {exc}); nothing patched")
        else:
            report.reason = verdict.reason
        if report.reason is not None:
            report.reason += "; " + consequence()
        _module_reports[module.__name__] = report
        _last_report = merge(_module_reports)
        if report.reason is not None:
            raise_or_log(report.reason, strict)
        return report


def _target_verdict(module: types.ModuleType, settings: config.Settings,
                    info: versions.VersionInfo, base: Optional[decision.Decision]
                    ) -> decision.Decision:
    """The activation's decision (``base``, or decided now for this version) refined with
    the target module: its rows' owner classes must exist."""
    if base is None or base.version != info.raw:
        base = decision.decide(settings, info, force=True)
    missing = missing_classes(module, settings)
    return base.refine(target_missing=(
        f"{module.__name__} has no {', '.join(missing)}" if missing else None))


def _checked(module: types.ModuleType, family: versions.Family, settings: config.Settings,
             report: Report) -> Tuple[List[PatchSpec], List[str]]:
    """The enabled rows of ``module`` checked (``check_rows``): the rows to patch and the
    code problems; ``report`` gets the rows this build does not need and each check."""
    todo: List[PatchSpec] = []
    failures: List[str] = []
    for spec, outcome, detail in check_rows(module, family,
                                            _enabled_specs(settings, module.__name__), settings):
        if outcome == "unneeded":
            report.skipped[spec.name] = "not needed: " + detail
            continue
        report.checks[spec.attr] = detail or "ok"
        if outcome == "fail":
            failures.append(detail)
        else:
            todo.append(spec)
    return todo, failures


def _patch_all(module: types.ModuleType, family: versions.Family, specs: List[PatchSpec],
               report: Report, settings: config.Settings) -> None:
    done: List[Tuple[type, str]] = []
    replaced: List[Tuple[str, str]] = []
    try:
        for spec in specs:
            if spec.replaces_global:
                if _replace_class(module, family, spec, settings):
                    replaced.append((module.__name__, spec.owner))
                report.applied.append(spec.name)
                continue
            owner, desc = find_descriptor(vars(module)[spec.owner], spec.attr)
            assert owner is not None  # check_code passed
            key = (owner, spec.attr)
            if is_ours(desc):
                report.applied.append(spec.name)  # already patched: never wrap twice
                continue
            # Not ours, so it is what revert must give back: the true original, or whatever
            # another tool installed after an earlier revert (never our own wrapper).
            _originals[key] = desc
            func = desc if spec.instance_method else desc.__func__
            wrapper = spec.factory()(family, func, module, settings)
            wrapper = metrics.count_refusals(spec.name, wrapper)  # metrics (issue 23)
            label = (f"{spec.owner}.{spec.attr} (vLLM {report.vllm_version}, family "
                     f"{family.name})")
            new: Any = PatchWrapper(func, wrapper, label)
            if not spec.instance_method:
                new = staticmethod(new)
            setattr(owner, spec.attr, new)
            _installed[key] = new
            done.append(key)
            report.applied.append(spec.name)
    except BaseException:
        for key in reversed(done):
            _restore(key)
        for ckey in reversed(replaced):
            _restore_class(ckey)
        raise


def _replace_class(module: types.ModuleType, family: versions.Family, spec: PatchSpec,
                   settings: config.Settings) -> bool:
    """Put the row's subclass of ``module``'s class (or its wrapper of ``module``'s function)
    in its place; False when the shim's own is there already (never replaced twice)."""
    key = (module.__name__, spec.owner)
    current = vars(module)[spec.owner]
    if key in _classes and _classes[key][2] is current:
        return False
    new: Any
    if spec.replaces_function:
        wrapper = metrics.count_refusals(spec.name, spec.factory()(family, current, module,
                                                                   settings))
        new = PatchWrapper(current, wrapper, f"{module.__name__}.{spec.owner} (vLLM "
                                             f"{versions.installed_vllm_version().raw}, family "
                                             f"{family.name})")
    else:
        new = spec.factory()(family, current, module, settings)
    setattr(module, spec.owner, new)
    _classes[key] = (module, current, new)  # type: ignore[assignment]
    rebind.rebind(module, spec.owner, current, new)  # wherever vLLM bound it already
    return True


def _restore_class(key: Tuple[str, str]) -> bool:
    module, original, new = _classes.pop(key)
    rebind.restore(key[1])  # what the shim re-pointed elsewhere comes back in any case
    if vars(module).get(key[1]) is not new:
        log.warning("vllm-bi100-patch: %s.%s was replaced by someone else after the shim "
                    "replaced it; left as it is", key[0], key[1])
        return False
    setattr(module, key[1], original)
    return True


def _restore(key: Tuple[type, str]) -> bool:
    cls, attr = key
    current = vars(cls).get(attr)
    if current is not _installed.get(key):
        log.warning("vllm-bi100-patch: %s.%s was replaced by someone else after the shim "
                    "patched it; left as it is", cls.__name__, attr)
        _installed.pop(key, None)
        return False
    setattr(cls, attr, _originals[key])
    del _installed[key]
    return True


def revert_all() -> List[str]:
    """Restore every original descriptor this process patched; returns the attributes."""
    with _lock:
        restored = []
        for key in list(_installed):
            if _restore(key):
                restored.append(key[1])
        for ckey in list(_classes):
            if _restore_class(ckey):
                restored.append(ckey[1])
        for rep in _module_reports.values():
            rep.applied.clear()
        _last_report.applied.clear()
        return restored


def get_original(cls: type, attr: str) -> Any:
    """The raw descriptor that was there before the shim patched it (None if never patched)."""
    return _originals.get((cls, attr))


def last_report() -> Report:
    with _lock:
        return dataclasses.replace(_last_report, applied=list(_last_report.applied),
                                   skipped=dict(_last_report.skipped),
                                   checks=dict(_last_report.checks))


def patched_attributes() -> List[str]:
    """The patched attributes, each once (after ``importlib.reload`` of a target module the
    wrappers of the old and the new class are both installed, so revert restores both)."""
    with _lock:
        return list(dict.fromkeys([attr for (_, attr) in _installed]
                                  + [name for (_, name) in _classes]))


"""The registry of patches: specs, code checks, saved originals, all-or-nothing apply/revert.

Style: attributes are resolved through ``vars(cls)`` along the MRO, never
``getattr``, so a staticmethod stays one; the raw descriptor is saved only when it is not our
own wrapper (so patching twice never loses the original, gevent's concern) and restored as the
very same object on revert.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import sys
import threading
import types
from typing import Any, Callable, Dict, List, Optional, Tuple

import wrapt

from . import config, versions

log = logging.getLogger("vllm.bi100_patch")

TARGET_MODULE = "vllm.attention.ops.paged_attn"
TARGET_CLASS = "PagedAttention"


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


class PatchError(RuntimeError):
    """Raised under strict mode when the shim cannot patch (unsupported version, failed check)."""


@dataclasses.dataclass(frozen=True)
class PatchSpec:
    """One patched method: where it lives, which family parameters it must have, and how to
    build its replacement. The catalogue entry (why/how/versions/removal) sits beside the
    replacement in ``patches/``."""

    name: str        # the name used in VLLM_BI100_PATCH_DISABLE
    attr: str        # method of PagedAttention
    params: Callable[[versions.Family], Tuple[str, ...]]
    factory: str     # name of the wrapper factory in patches.paged_attention


SPECS: Tuple[PatchSpec, ...] = (
    PatchSpec("decode", "forward_decode", lambda f: f.decode_params, "make_decode_wrapper"),
    PatchSpec("prefix", "forward_prefix", lambda f: f.prefix_params, "make_prefix_wrapper"),
)


@dataclasses.dataclass
class Report:
    """What the last apply did; ``status()`` and the INFO line are built from it."""

    vllm_version: Optional[str] = None
    family: Optional[str] = None
    applied: List[str] = dataclasses.field(default_factory=list)
    skipped: Dict[str, str] = dataclasses.field(default_factory=dict)
    checks: Dict[str, str] = dataclasses.field(default_factory=dict)
    reason: Optional[str] = None

    def as_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


_lock = threading.RLock()
#: (class, attribute) -> the raw descriptor found in vars(owner) before the first patch.
_originals: Dict[Tuple[type, str], Any] = {}
#: (class, attribute) -> the descriptor we installed (to recognise our own patch).
_installed: Dict[Tuple[type, str], Any] = {}
_last_report = Report()
_warned: set = set()


def warn_once(reason: str) -> None:
    """One WARNING line per reason per process, whichever activation path meets it first."""
    with _lock:
        if reason in _warned:
            return
        _warned.add(reason)
    log.warning("vllm-bi100-patch: %s", reason)


def unsupported_reason(info: versions.VersionInfo) -> str:
    if info.raw is None:
        return "vLLM not installed; nothing patched"
    return (f"vLLM {info.raw} is not a supported version (supported: "
            f"{versions.FAMILIES[0].first} to {versions.FAMILIES[-1].last}); nothing patched")


def consequence() -> str:
    """What runs when nothing was patched, said exactly: with the import guard still on (kept
    on purpose after a failed code check: on Iluvatar a clear error beats a hang), stock
    forward_prefix refuses instead of launching Triton."""
    if "vllm_bi100_patch.import_guard" in sys.modules:
        from . import import_guard

        if import_guard.installed():
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
    return isinstance(descriptor, staticmethod) and type(descriptor.__func__) is PatchWrapper


def check_code(cls: type, spec: PatchSpec, family: versions.Family) -> Optional[str]:
    """None when the code matches the family, else a sentence saying what differs. Where the
    shim already patched the method, the original it saved is checked."""
    owner, desc = find_descriptor(cls, spec.attr)
    if desc is None:
        return f"{TARGET_CLASS}.{spec.attr} is missing"
    if is_ours(desc):
        with _lock:
            desc = _originals.get((owner, spec.attr)) if owner is not None else None
        if desc is None:
            return None
    return check_descriptor(desc, spec, family)


def check_descriptor(desc: Any, spec: PatchSpec, family: versions.Family) -> Optional[str]:
    if not isinstance(desc, staticmethod):
        return f"{TARGET_CLASS}.{spec.attr} is a {type(desc).__name__}, not a staticmethod"
    try:
        params = tuple(inspect.signature(desc.__func__).parameters)
    except (TypeError, ValueError) as exc:
        return f"{TARGET_CLASS}.{spec.attr} has no readable signature ({exc})"
    expected = spec.params(family)
    if params != expected:
        return (f"{TARGET_CLASS}.{spec.attr} parameters {list(params)} differ from family "
                f"{family.name}'s {list(expected)}")
    return None


def _enabled_specs(settings: config.Settings) -> List[PatchSpec]:
    return [s for s in SPECS if s.name not in settings.disabled]


def apply_to(module: types.ModuleType, settings: config.Settings,
             strict: bool = False) -> Report:
    """Patch ``module`` (the imported paged_attn) all-or-nothing. Never raises unless strict."""
    global _last_report
    with _lock:
        report = Report()
        info = versions.installed_vllm_version()
        report.vllm_version = info.raw
        family = versions.family_for(info)
        cls = vars(module).get(TARGET_CLASS)
        if family is None:
            report.reason = unsupported_reason(info)
        elif not isinstance(cls, type):
            report.reason = f"{module.__name__} has no class {TARGET_CLASS}; nothing patched"
        report.family = family.name if family else None
        for spec in SPECS:
            if spec.name in settings.disabled:
                report.skipped[spec.name] = "disabled by " + config.DISABLE
        if report.reason is None:
            assert family is not None and isinstance(cls, type)
            failures = {}
            for spec in _enabled_specs(settings):
                problem = check_code(cls, spec, family)
                report.checks[spec.attr] = problem or "ok"
                if problem:
                    failures[spec.name] = problem
            if failures:
                report.reason = (f"vLLM {info.raw} is in the range of family {family.name} but its "
                                 "code does not match (" + "; ".join(failures.values()) +
                                 "); nothing patched")
        if report.reason is None:
            assert family is not None and isinstance(cls, type)
            try:
                _patch_all(cls, module, family, settings, report)
            except Exception as exc:
                report.applied.clear()
                report.reason = (f"patching failed and was rolled back "
                                 f"({type(exc).__name__}: {exc}); nothing patched")
        if report.reason is not None:
            report.reason += "; " + consequence()
        _last_report = report
        if report.reason is not None:
            warn_once(report.reason)
            if strict:
                raise PatchError(report.reason)
        return report


def _patch_all(cls: type, module: types.ModuleType, family: versions.Family,
               settings: config.Settings, report: Report) -> None:
    from .patches import paged_attention  # torch is loaded: the target module imported it

    done: List[Tuple[type, str]] = []
    try:
        for spec in _enabled_specs(settings):
            owner, desc = find_descriptor(cls, spec.attr)
            assert owner is not None  # check_code passed
            key = (owner, spec.attr)
            if is_ours(desc):
                report.applied.append(spec.name)  # already patched: never wrap twice
                continue
            # Not ours, so it is what revert must give back: the true original, or whatever
            # another tool installed after an earlier revert (never our own wrapper).
            _originals[key] = desc
            original = desc
            factory = getattr(paged_attention, spec.factory)
            wrapper = factory(family, original.__func__, module, settings)
            label = (f"{TARGET_CLASS}.{spec.attr} (vLLM {report.vllm_version}, family "
                     f"{family.name})")
            new = staticmethod(PatchWrapper(original.__func__, wrapper, label))
            setattr(owner, spec.attr, new)
            _installed[key] = new
            done.append(key)
            report.applied.append(spec.name)
    except BaseException:
        for key in reversed(done):
            _restore(key)
        raise


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
    with _lock:
        return [attr for (_, attr) in _installed]


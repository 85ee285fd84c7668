"""The one decision: does the shim patch this vLLM in this process, and if not, why.

``decide`` makes it, ``Decision.refine`` carries it through the later stages, and nobody
decides elsewhere.  In a server process it is decided once per activation:

- the bootstrap at interpreter start (configuration and hardware only: ``info=None``);
- refined with the installed version when vLLM is about to be imported;
- refined by the registry when a target module is imported (target class, code checks);
- ``apply(strict=True)`` reads the same object (``bootstrap.activation_decision``).

``status`` and ``doctor`` ask ``verdict``, the same decision in an operator's words with
doctor's exit code.  A stage never repeats the checks an earlier one passed, and the answer
does not depend on which caller asked.  Cheap at import (the bootstrap imports it at
interpreter start): stdlib only; ``versions`` (packaging, importlib.metadata) is used only when
a version is passed in, by callers that already imported it."""

from __future__ import annotations

from ..activation import config

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import List, Optional

    from .versions import VersionInfo

#: Kinds of decision, in the order they are checked.  ``armed``: the start-up checks pass and
#: the version is not known yet; ``patch``: every check passed.
INVALID = "invalid"
KILL_SWITCH = "kill_switch"
NO_VLLM = "no_vllm"
NOT_ILUVATAR = "not_iluvatar"
ARMED = "armed"
UNSUPPORTED = "unsupported"
NO_TARGET = "no_target"
CODE_MISMATCH = "code_mismatch"
PATCH = "patch"

#: Decisions that are what the configuration asked for (doctor's exit code 0).
AS_CONFIGURED = (KILL_SWITCH, NOT_ILUVATAR, ARMED, PATCH)
#: doctor's exit codes: as configured, will not patch, an invalid variable (2 is argparse's).
EXIT_OK, EXIT_WONT_PATCH, EXIT_CONFIG = 0, 1, 3


class Decision:
    """The one outcome type: ``kind`` (one of the constants above) and ``reason``, a sentence
    an operator can act on; ``family`` is set from the version stage on.  ``decide`` makes it,
    ``refine`` carries it through the later stages (never deciding the earlier ones again) and
    ``verdict`` adds doctor's wording: ``text`` and the exit ``code``."""

    __slots__ = ("kind", "reason", "family", "settings", "version", "text", "code")

    def __init__(self, kind: str, reason: str, family: Optional[str] = None,
                 settings: Optional[config.Settings] = None,
                 version: Optional[str] = None) -> None:
        self.kind, self.reason, self.family, self.settings = kind, reason, family, settings
        self.version = version  # the vLLM version, from the version stage on
        self.text, self.code = reason, EXIT_OK if kind in AS_CONFIGURED else EXIT_WONT_PATCH

    @property
    def patches(self) -> bool:
        return self.kind == PATCH

    @property
    def open(self) -> bool:
        """The start-up checks passed (``armed`` or later)."""
        return self.kind not in (INVALID, KILL_SWITCH, NO_VLLM, NOT_ILUVATAR)

    def refine(self, info: Optional[VersionInfo] = None, *,
               target_missing: Optional[str] = None,
               code_problems: Optional[List[str]] = None) -> Decision:
        """This decision after the later stages: the version (``info``, when this one is
        ``armed``), then the target module and the code check (when it is ``patch``)."""
        settings = self.settings
        assert settings is not None, "refine() needs a decision made by decide()"
        if self.kind == ARMED and info is not None:
            from . import hardware, versions

            if info.raw is None and not hardware.findable("vllm"):
                return Decision(NO_VLLM, _NO_VLLM, settings=settings)
            family = versions.family_for(info)
            if family is None:
                return Decision(UNSUPPORTED, unsupported_reason(info), settings=settings,
                                version=info.raw)
            result = Decision(PATCH, f"vLLM {info.raw} (family {family.name})", family.name,
                              settings, info.raw)
            return result.refine(target_missing=target_missing, code_problems=code_problems)
        if self.kind != PATCH:
            return self
        if target_missing:
            return Decision(NO_TARGET, f"{target_missing}; nothing patched", self.family,
                            settings, self.version)
        if code_problems:
            return Decision(CODE_MISMATCH, f"vLLM {self.version} is in the range of family "
                                           f"{self.family} but its code does not match ("
                            + "; ".join(code_problems) + "); nothing patched", self.family,
                            settings, self.version)
        return self

    def as_verdict(self, text: str, code: Optional[int] = None) -> Decision:
        """A copy with doctor's wording (and exit code)."""
        out = Decision(self.kind, self.reason, self.family, self.settings, self.version)
        out.text, out.code = text, self.code if code is None else code
        return out

    def line(self) -> str:
        asked = "as configured" if self.code == EXIT_OK else "a problem to fix"
        return f"verdict: {self.text} [{asked}; exit {self.code}]"

    def __repr__(self) -> str:
        return f"Decision({self.kind!r}, {self.reason!r})"


_NO_VLLM = "vLLM not installed in this environment (nothing to patch)"


def unsupported_reason(info: VersionInfo) -> str:
    from . import versions

    if info.raw is None:
        return "vLLM not installed; nothing patched"
    return (f"vLLM {info.raw} is not a supported version (supported: "
            f"{versions.FAMILIES[0].first} to {versions.FAMILIES[-1].last}); nothing patched")


def decide(settings: config.Settings, info: Optional[VersionInfo] = None, *,
           force: bool = False, target_missing: Optional[str] = None,
           code_problems: Optional[List[str]] = None) -> Decision:
    """The decision for ``settings`` (and, from the version stage on, ``info``).

    Args:
        settings: the parsed configuration.
        info: the installed vLLM's version; None at interpreter start (not read there).
        force: skip hardware auto-detection (an explicit ``apply()``).
        target_missing: why the target module has nothing to patch (e.g. no class), if so.
        code_problems: the failed code checks, if the code was checked.
    """
    if settings.mode == config.INVALID:
        return Decision(INVALID, f"{settings.mode_text()} is invalid (accepted: auto, 1, 0); "
                                 "the shim stays off", settings=settings)
    if settings.kill_switch:
        return Decision(KILL_SWITCH, f"{settings.mode_text()} (kill switch): nothing "
                                     "patched, stock vLLM", settings=settings)
    from . import hardware

    if info is None or info.raw is None:
        if not hardware.findable("vllm"):
            return Decision(NO_VLLM, _NO_VLLM, settings=settings)
    if settings.mode == "auto" and not force and not hardware.looks_like_iluvatar():
        return Decision(NOT_ILUVATAR, f"{settings.mode_text()} and no Iluvatar stack detected "
                                      f"(no ixformer, no +corex torch); set {config.MODE}=1 "
                                      "to force", settings=settings)
    armed = Decision(ARMED, "patches when vLLM imports its targets", settings=settings)
    return armed.refine(info, target_missing=target_missing, code_problems=code_problems)


def verdict(settings: config.Settings, info: VersionInfo,
            code_problems: Optional[List[str]] = None,
            activation_ok: Optional[bool] = None,
            conditional: Optional[List[str]] = None) -> Decision:
    """``decide``'s answer in doctor's words (``text``, exit ``code``), from the same steps the
    shim takes in a server process: configuration, hardware, vLLM present, the version family,
    the code check (``code_problems``; None: not checked) and the activation paths (None: not
    checked). ``conditional``: the conditional patches the code check found needed here."""
    result = _verdict(decide(settings, info, code_problems=code_problems), settings, info,
                      code_problems, activation_ok, conditional or [])
    if settings.errors:  # the shim ignores invalid values: always a problem to fix
        prefix = "" if settings.mode == config.INVALID else result.text + "; "
        result = result.as_verdict(prefix + "invalid configuration: "
                                   + "; ".join(settings.errors), EXIT_CONFIG)
    return result


def _verdict(result: Decision, settings: config.Settings, info: VersionInfo,
             code_problems: Optional[List[str]], activation_ok: Optional[bool],
             conditional: List[str]) -> Decision:
    import sys

    from . import hardware, table, versions

    if not result.open:
        why, code = result.reason, result.code
        if result.kind == NO_VLLM:
            why = f"vLLM not installed in this environment ({sys.executable}); nothing to patch"
            if settings.mode == "auto" and not hardware.looks_like_iluvatar():
                code = EXIT_OK  # auto on a machine without the Iluvatar stack asks for nothing
                why += f"; {settings.mode_text()} and no Iluvatar stack detected either"
        return result.as_verdict("will NOT patch: " + why, code)
    if result.kind == UNSUPPORTED:
        return result.as_verdict("will NOT patch: " + result.reason)
    if result.kind == CODE_MISMATCH:
        guard = ("the import guard stays on: stock forward_prefix raises TritonPrefixBlocked"
                 if "import_guard" not in settings.disabled else "stock vLLM runs")
        return result.as_verdict(f"will NOT patch: vLLM {info.raw} (family {result.family}) "
                                 f"fails the code check ({'; '.join(code_problems or [])}); "
                                 f"{guard}")
    if activation_ok is False:
        return result.as_verdict("will NOT patch at start-up: no activation path works "
                                 "(sitecustomize, .pth, vLLM plugin entry point); is the shim "
                                 "pip-installed into this environment?", EXIT_WONT_PATCH)
    names = [r.attr for r in table.methods()
             if r.name not in settings.disabled and r.when is None] + conditional
    guard = "off (disabled)" if "import_guard" in settings.disabled else "on"
    checked = "" if code_problems is not None else " (code not checked: run doctor)"
    if not names:
        return result.as_verdict(f"patches nothing: every patch is listed in {config.DISABLE}; "
                                 f"import guard {guard}", EXIT_OK)
    off_path = versions.serving_path_note(info)
    if off_path is not None:
        return result.as_verdict(f"patches {', '.join(names)} but they are NOT on the serving "
                                 f"path: {off_path}", EXIT_WONT_PATCH)
    return result.as_verdict(f"WILL patch vLLM {info.raw} (family {result.family}): "
                             f"{', '.join(names)}; import guard {guard}; "
                             f"{settings.mode_text()}{checked}", EXIT_OK)

"""The one decision: does the shim patch this vLLM in this process, and if not, why.

Every caller asks ``decide`` with what it knows at its stage, and nobody decides elsewhere:

- the bootstrap at interpreter start (configuration and hardware only: ``info=None``);
- the hook when vLLM is about to be imported (the installed version);
- the registry when the target module is imported (version, target class, code checks);
- ``apply(strict=True)``, ``status`` and ``doctor`` (everything they can know).

The stages are cumulative: a later stage repeats the earlier checks, so the answer never
depends on which caller asked.  Cheap at import (the bootstrap imports it at interpreter
start): stdlib only; ``versions`` (packaging, importlib.metadata) is used only when a version
is passed in, by callers that already imported it.
"""

from __future__ import annotations

from . import config

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


class Decision:
    """``kind`` (one of the constants above) and ``reason``, a sentence an operator can act
    on; ``family`` is set from the version stage on."""

    __slots__ = ("kind", "reason", "family")

    def __init__(self, kind: str, reason: str, family: Optional[str] = None) -> None:
        self.kind, self.reason, self.family = kind, reason, family

    @property
    def patches(self) -> bool:
        return self.kind == PATCH

    @property
    def open(self) -> bool:
        """The start-up checks passed (``armed`` or later)."""
        return self.kind not in (INVALID, KILL_SWITCH, NO_VLLM, NOT_ILUVATAR)

    def __repr__(self) -> str:
        return f"Decision({self.kind!r}, {self.reason!r})"


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
                                 "the shim stays off")
    if settings.kill_switch:
        return Decision(KILL_SWITCH, f"{settings.mode_text()} (kill switch): nothing "
                                     "patched, stock vLLM")
    from . import hardware

    if info is None or info.raw is None:
        if not hardware.findable("vllm"):
            return Decision(NO_VLLM, "vLLM not installed in this environment (nothing to "
                                     "patch)")
    if settings.mode == "auto" and not force and not hardware.looks_like_iluvatar():
        return Decision(NOT_ILUVATAR, f"{settings.mode_text()} and no Iluvatar stack detected "
                                      f"(no ixformer, no +corex torch); set {config.MODE}=1 "
                                      "to force")
    if info is None:
        return Decision(ARMED, "patches when vLLM imports its targets")
    from . import versions

    family = versions.family_for(info)
    if family is None:
        return Decision(UNSUPPORTED, unsupported_reason(info))
    if target_missing:
        return Decision(NO_TARGET, f"{target_missing}; nothing patched", family.name)
    if code_problems:
        return Decision(CODE_MISMATCH, f"vLLM {info.raw} is in the range of family "
                                       f"{family.name} but its code does not match ("
                                       + "; ".join(code_problems) + "); nothing patched",
                        family.name)
    return Decision(PATCH, f"vLLM {info.raw} (family {family.name})", family.name)

"""The bootstrap's activation state: the phase a process is in and what the activation acted
on (``bootstrap`` owns the one ``State`` and changes it under its lock).  Activation layer:
standard library only, read at interpreter start.
"""

from __future__ import annotations

import enum

from . import config

TYPE_CHECKING = False  # typing itself costs milliseconds at interpreter start

if TYPE_CHECKING:
    from typing import List, Optional

    from ..patching.decision import Decision


class Phase(enum.Enum):
    """Where this process stands; ``status()["decision"]`` is ``"<value>: <detail>"``."""

    NOT_BOOTSTRAPPED = "not bootstrapped"  # no activation path ran
    OFF = "off"                            # the start-up checks closed the gate
    ARMED = "armed"                        # hooks installed, vLLM's targets not imported yet
    PATCHED = "patched"                    # a target module was patched (detail: what)
    NOT_PATCHED = "not patched"            # active, but nothing could be patched (detail: why)
    REVERTED = "reverted"                  # revert(): stock vLLM until the next apply()


#: The phases in which the hooks are installed (``status()["active"]``).
ACTIVE = (Phase.ARMED, Phase.PATCHED, Phase.NOT_PATCHED)


class State:
    """The process's one activation state, changed only under ``_lock``; ``enter`` moves the
    phase (the one place ``status()["decision"]`` changes)."""

    __slots__ = ("phase", "detail", "settings", "strict", "sources", "last_error", "start",
                 "decision")
    phase: Phase
    detail: str
    settings: Optional[config.Settings]  # the configuration the activation acted on
    strict: bool
    sources: List[str]  # the activation paths that ran, in order
    last_error: Optional[str]
    #: The activation's decision at start-up (decided once per activation), and at the
    #: version stage (refined from it, see ``activation_decision``).
    start: Optional[Decision]
    decision: Optional[Decision]

    def __init__(self) -> None:
        self.phase, self.detail = Phase.NOT_BOOTSTRAPPED, ""
        self.settings, self.strict, self.sources = None, False, []
        self.last_error = self.start = self.decision = None

    @property
    def active(self) -> bool:
        return self.phase in ACTIVE

    def enter(self, phase: Phase, detail: str = "") -> None:
        self.phase, self.detail = phase, detail

    def text(self) -> str:
        return f"{self.phase.value}: {self.detail}" if self.detail else self.phase.value

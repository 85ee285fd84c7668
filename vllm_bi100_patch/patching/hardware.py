"""Iluvatar detection and the SM count.

``cheap_detection()`` runs at interpreter start and imports nothing heavy: it looks for the
``ixformer`` package without importing it, and for a ``+corex`` torch in the name of its
``dist-info`` directory.
``device_facts()`` is called only once torch is already imported (from the patch layer);
``remember()`` gives it facts read elsewhere (doctor's first contact, a child process under a
time-out), so that a process that must not touch the device (doctor) never does.
"""

from __future__ import annotations

import os
import sys
TYPE_CHECKING = False  # typing itself costs milliseconds at interpreter start

if TYPE_CHECKING:
    from typing import Dict, Optional

BI_V100_SM_COUNT = 16
#: Facts read by a child process (``remember``); None: read them from torch when asked.
_remembered = None  # type: Optional[Dict[str, object]]


def findable(name: str) -> bool:
    """True when top-level module ``name`` can be imported (found, not imported)."""
    if name in sys.modules:
        return True
    import importlib.machinery  # importlib.util would cost ~8 ms at interpreter start

    try:
        return importlib.machinery.PathFinder.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def ixformer_present() -> bool:
    """True when the ``ixformer`` package is importable (found, not imported)."""
    return findable("ixformer")


def torch_is_corex() -> bool:
    """True when the installed torch is an Iluvatar CoreX build (``+corex`` local version).

    Reads the ``torch-<version>.dist-info`` directory name beside torch rather than importing
    ``importlib.metadata`` (tens of milliseconds) at interpreter start."""
    for entry in sys.path:
        try:
            names = os.listdir(entry or ".")
        except OSError:
            continue
        for name in names:
            if name.startswith("torch-") and name.endswith(".dist-info"):
                return "corex" in name.lower()
    return False


def cheap_detection() -> Dict[str, bool]:
    """What can be known about the hardware without importing torch."""
    return {"ixformer": ixformer_present(), "torch_corex": torch_is_corex()}


def looks_like_iluvatar() -> bool:
    facts = cheap_detection()
    return facts["ixformer"] or facts["torch_corex"]


def remember(facts: Dict[str, object]) -> None:
    """From now on ``device_facts()`` returns ``facts`` and never touches the device."""
    global _remembered
    _remembered = dict(facts)


def device_facts() -> Dict[str, object]:
    """Device name and SM count of cuda:0, read only when torch is already imported (or the
    facts given to ``remember``)."""
    if _remembered is not None:
        return dict(_remembered)
    facts: Dict[str, object] = {"device_name": None, "sm_count": None, "iluvatar": False}
    torch = sys.modules.get("torch")
    if torch is None:
        return facts
    try:
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            facts["device_name"] = props.name
            facts["sm_count"] = int(props.multi_processor_count)
            facts["iluvatar"] = "iluvatar" in props.name.lower()
    except Exception as exc:  # a broken driver must not take the host process down
        facts["error"] = f"{type(exc).__name__}: {exc}"
    return facts


def sm_count(override: Optional[int]) -> int:
    """SM count for the V1/V2 decode rule: override, else the device's, else BI-V100's 16."""
    if override is not None:
        return override
    value = device_facts().get("sm_count")
    return value if isinstance(value, int) and value > 0 else BI_V100_SM_COUNT

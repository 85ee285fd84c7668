"""doctor's device check: the first contact, in a child process under a hard time-out.

Doctor never touches a device in its own process. Where one may exist (``selftest.contact.
device_may_exist``) and torch is installed, ``contact_check`` runs the first-contact probe
(``selftest.contact.probe``) under ``VLLM_BI100_CONTACT_TIMEOUT_S`` and hands its facts to
``hardware.remember``, so every later reading of the device in doctor (the native-kernel
section, the patch's Iluvatar detection) reuses them. A card that does not answer is a
``FAIL`` check, one line after the verdict and exit status 5
(``exit_code``: ``EXIT_WEDGED``), whatever the verdict's code.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

from ..activation import config
from ..patching import hardware
from .selftest.contact import EXIT_WEDGED

Check = Tuple[str, str, str]

#: Name of the hardware section's first-contact check.
CONTACT = "device (first contact)"
MiB = 1 << 20


def contact_checks(settings: config.Settings) -> List[Check]:
    """The device's first contact (none where no device can exist, or torch is missing)."""
    check = _contact(settings)
    return [] if check is None else [check]


def _contact(settings: config.Settings) -> Optional[Check]:
    from .selftest import contact

    if not hardware.findable("torch") or not contact.device_may_exist():
        return None
    seen = contact.probe(0, float(settings.contact_timeout_s))
    facts = seen.facts
    hardware.remember({"device_name": facts.get("name"), "sm_count": facts.get("sm_count"),
                       "iluvatar": bool(facts.get("iluvatar"))})
    if seen.wedged:
        return ("FAIL", CONTACT, seen.line("doctor").split(": ", 1)[1])
    if seen.error is not None:
        return ("WARN", CONTACT, f"the probe failed: {seen.error}")
    if not seen.cuda:
        return ("info", CONTACT, "no CUDA device visible to torch")
    return ("ok", CONTACT, f"cuda:0 {facts.get('name')} ({facts.get('sm_count')} SMs): "
            f"{facts.get('free', 0) / MiB:,.0f} MiB free of {facts.get('total', 0) / MiB:,.0f} "
            f"MiB, a small product synchronised, in {seen.seconds:.1f} s (a child process; "
            f"time-out {seen.timeout_s:g} s)")


def device_check() -> Check:
    """The device as torch sees it in doctor's process (only where no contact check ran: no
    device can exist there)."""
    facts = hardware.device_facts()
    return ("info", "device", f"{facts['device_name']} ({facts['sm_count']} SMs)"
            if facts.get("device_name") else "no CUDA device visible to torch")


def exit_code(checks: List[Check], verdict_code: int) -> int:
    """``EXIT_WEDGED`` after printing the one line naming a wedged card, when the first
    contact did not answer; else the verdict's code."""
    for state, name, detail in checks:
        if name == CONTACT and state == "FAIL":
            print(f"vllm-bi100-patch doctor: {detail}")
            return EXIT_WEDGED
    return verdict_code

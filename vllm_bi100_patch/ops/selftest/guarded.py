"""``vllm-bi100-patch selftest`` as the operator runs it: nothing it does can hang on a card
that does not answer.

1. where a device may exist (``contact.device_may_exist``) and ``--device`` is not ``cpu``,
   the first contact is a child process (``contact.probe``), stopped after
   ``--contact-timeout`` (default ``VLLM_BI100_CONTACT_TIMEOUT_S``, 15 s);
2. with a CUDA device that answered, the selftest itself runs in a child process
   (``python -m vllm_bi100_patch.ops.selftest.cli``, writing straight to this process's stdout and
   stderr), stopped after ``--hard-limit`` (default twice ``--time-limit`` plus 60 s);
3. on CPU (``--device cpu``, or no device to contact) it runs in this process, as before.

A card that does not answer in time gives one line on stderr naming the state (a wedged card,
what was seen, the remedy: ``contact.Contact.line``), with ``--json`` one JSON object
(``{"wedged": ..., "ok": false}``, also written to ``--json-out``), and exit status 5
(``contact.EXIT_WEDGED``).  Imports no torch (the parent never touches the device).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from typing import Any, Dict, List, Optional, Sequence

from ...activation import config
from ..._version import __version__
from . import child, contact

__all__ = ["main"]

#: Seconds added to twice ``--time-limit`` for the run's hard limit (interpreter start,
#: torch import, the checks that run before the time limit applies).
HARD_LIMIT_SLACK_S = 60.0


def _options(argv: Sequence[str]) -> argparse.Namespace:
    """The few options the guard needs (the rest is the selftest's own: ``selftest.cli``)."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--device", default="auto")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--time-limit", type=float)
    p.add_argument("--contact-timeout", type=float)
    p.add_argument("--hard-limit", type=float)
    p.add_argument("--json", action="store_true")
    p.add_argument("--json-out")
    p.add_argument("-h", "--help", action="store_true")
    return p.parse_known_args(list(argv))[0]


def _index(device: str) -> Optional[int]:
    """The CUDA index ``--device`` names (``auto`` and ``cuda``: 0); None for another type."""
    if device in ("auto", "cuda"):
        return 0
    if device.startswith("cuda:") and device[5:].isdigit():
        return int(device[5:])
    return None


def _wedged(a: argparse.Namespace, seen: contact.Contact, device: str, during: str) -> int:
    line = seen.line("selftest", device)
    print(line, file=sys.stderr, flush=True)
    if a.json or a.json_out:
        out: Dict[str, Any] = {
            "version": __version__, "ok": False,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
            "wedged": dict(seen.as_dict(), during=during, line=line, device=device)}
        text = json.dumps(out, indent=1, default=str)
        if a.json_out:
            with open(a.json_out, "w", encoding="utf-8") as fh:
                fh.write(text + "\n")
        if a.json:
            print(text, flush=True)
    return contact.EXIT_WEDGED


def main(argv: Optional[Sequence[str]] = None) -> int:
    args: List[str] = list(sys.argv[1:] if argv is None else argv)
    a = _options(args)
    index = _index(a.device)
    if a.help or index is None or not (a.device != "auto" or contact.device_may_exist()):
        from .cli import main as in_process  # torch: only now

        return in_process(args)
    settings = config.load()
    first = a.contact_timeout or float(settings.contact_timeout_s)
    seen = contact.probe(index, first)
    device = f"cuda:{index}"
    if seen.wedged:
        return _wedged(a, seen, device, "first contact")
    if not seen.cuda:  # no CUDA device answered (or no torch): the selftest says so itself
        from .cli import main as in_process

        return in_process(args)
    limit = a.hard_limit or (2 * (a.time_limit or (90.0 if a.quick else 300.0))
                             + HARD_LIMIT_SLACK_S)
    sys.stdout.flush()
    sys.stderr.flush()
    ended = child.run([sys.executable, "-m", "vllm_bi100_patch.ops.selftest.cli", *args], limit,
                      stdout=sys.stdout, stderr=sys.stderr, grace_s=10.0)
    if not ended.timed_out:
        return int(ended.returncode or 0)
    during = contact.Contact(False, seen.stages + [f"the selftest's device work (after "
                                                   f"{ended.seconds:.0f} s)"],
                             seen.facts, ended.seconds, limit, lingering=ended.lingering)
    return _wedged(a, during, device, "the run")

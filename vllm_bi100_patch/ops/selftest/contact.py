"""First contact with the device, in a child process under a hard time-out, and the one line
that names a card that does not answer (a wedged card).

A BI-V100 left behind by a killed service or an interrupted collective can show 257 MiB used,
100% utilisation and no process, and then ``torch.cuda.mem_get_info()`` (or the first kernel)
never returns; ``ixsmi --gpu-reset`` returns 255 and only a host restart recovers it
(``docs/operating.md``, "A wedged card", with the public sources).  So the shim's tools never
make their first device call in their own process: ``probe`` runs ``python -m
vllm_bi100_patch.ops.selftest.contact INDEX`` (the function ``_main`` below: ``import torch``,
``is_available``, ``device_count``, the device's properties, ``mem_get_info``, one small
product and a synchronisation, each announced before it starts) with its output in a
temporary file, and gives up after ``VLLM_BI100_CONTACT_TIMEOUT_S`` seconds
(``selftest.child``: the child's group is stopped, the parent never waits on it).

``device_may_exist`` says, without torch, whether there can be a device at all (a CoreX
torch, or a GPU device node): where there cannot, the tools skip the probe (nothing to
wedge) and behave as before.  Needs no torch; imports only ``hardware`` of the shim.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional

from ...patching import hardware
from . import child

__all__ = ["EXIT_WEDGED", "Contact", "DEVICE_NODES", "device_may_exist", "probe"]

#: Exit status of ``selftest`` and ``doctor`` when the device does not answer in time.
EXIT_WEDGED = 5
#: Device nodes of a GPU driver (NVIDIA's; Iluvatar's CoreX driver).
DEVICE_NODES = ("/dev/nvidia[0-9]*", "/dev/iluvatar[0-9]*")
#: Where an operator reads what a wedged card is and what to do.
DOC = 'docs/operating.md, "A wedged card"'
#: What the probe announces, in order (``_main``).
STAGES = ("import torch", "torch.cuda.is_available()", "torch.cuda.device_count()",
          "torch.cuda.get_device_properties()", "torch.cuda.mem_get_info()",
          "a 256x256 product and torch.cuda.synchronize()")


def device_may_exist() -> bool:
    """True where a GPU may be present: a CoreX (Iluvatar) torch, or a GPU device node."""
    return hardware.torch_is_corex() or any(glob.glob(p) for p in DEVICE_NODES)


@dataclasses.dataclass
class Contact:
    """What the probe saw: ``answered`` (every step returned in time), ``stages`` (the steps
    that started, in order), ``facts`` (``available``, ``count``, ``name``, ``sm_count``,
    ``free``, ``total`` where reached), ``seconds``, ``timeout_s`` and ``error`` (the
    child's own failure, e.g. no torch: not a wedged card)."""

    answered: bool
    stages: List[str]
    facts: Dict[str, Any]
    seconds: float
    timeout_s: float
    error: Optional[str] = None
    lingering: bool = False

    @property
    def wedged(self) -> bool:
        """The device did not answer within the time-out (the child was stopped)."""
        return not self.answered and self.error is None

    @property
    def cuda(self) -> bool:
        return bool(self.facts.get("available")) and int(self.facts.get("count") or 0) > 0

    def as_dict(self) -> Dict[str, Any]:
        out = dataclasses.asdict(self)
        out["wedged"] = self.wedged
        return out

    def line(self, tool: str, device: str = "cuda:0") -> str:
        """The one line naming a wedged card: what was seen, the remedy, where to read."""
        answered = [s for s in self.stages[:-1] if s != "import torch"]
        stuck = self.stages[-1] if self.stages else "starting the probe"
        return (f"vllm-bi100-patch {tool}: WEDGED CARD: {device} did not answer within "
                f"{self.timeout_s:g} s ({stuck} never returned"
                + (f"; {', '.join(answered)} answered" if answered else "")
                + "); a BI-V100 in this state (ixsmi: 257 MiB used, 100% utilisation, no "
                "process) is recovered only by a host restart (ixsmi --gpu-reset returns 255); "
                f"see {DOC}" + ("; the probe process is still alive, blocked in the driver"
                                if self.lingering else ""))


def probe(index: int = 0, timeout_s: float = 15.0) -> Contact:
    """First contact with device ``index`` in a child process, at most ``timeout_s`` s."""
    with tempfile.TemporaryFile("w+", encoding="utf-8") as out, \
            tempfile.TemporaryFile("w+", encoding="utf-8") as err:
        ended = child.run([sys.executable, "-m", __name__, str(index)], timeout_s,
                          stdout=out, stderr=err, grace_s=1.0)
        out.seek(0)
        err.seek(0)
        lines, tail = out.read().splitlines(), err.read()[-400:].strip()
    stages: List[str] = []
    facts: Dict[str, Any] = {}
    for line in lines:
        try:
            item = json.loads(line)
        except ValueError:
            continue
        if "stage" in item:
            stages.append(item["stage"])
        facts.update(item.get("facts", {}))
    if ended.timed_out:
        return Contact(False, stages, facts, ended.seconds, timeout_s, lingering=ended.lingering)
    if ended.returncode != 0:
        why = tail.splitlines()[-1] if tail else f"exit status {ended.returncode}"
        return Contact(False, stages, facts, ended.seconds, timeout_s, error=why)
    return Contact(True, stages, facts, ended.seconds, timeout_s)


def _say(**item: Any) -> None:
    print(json.dumps(item), flush=True)


def _main(index: int) -> int:  # pragma: no cover - runs in the probe's child process
    """The probe itself: each step announced before it starts (the parent reads how far it
    got), its facts after it returns."""
    start = time.monotonic()
    _say(stage=STAGES[0])
    import torch

    _say(stage=STAGES[1])
    available = bool(torch.cuda.is_available())
    _say(facts={"available": available})
    if not available:
        return 0
    _say(stage=STAGES[2])
    count = int(torch.cuda.device_count())
    _say(facts={"count": count})
    if index >= count:
        return 0
    _say(stage=STAGES[3])
    props = torch.cuda.get_device_properties(index)
    _say(facts={"name": props.name, "sm_count": int(props.multi_processor_count),
                "iluvatar": "iluvatar" in props.name.lower()})
    _say(stage=STAGES[4])
    free, total = torch.cuda.mem_get_info(index)
    _say(facts={"free": int(free), "total": int(total)})
    _say(stage=STAGES[5])
    a = torch.ones((256, 256), device=f"cuda:{index}", dtype=torch.float16)
    checksum = float((a @ a).float().sum().item())
    torch.cuda.synchronize(index)
    _say(facts={"checksum": checksum, "probe_s": time.monotonic() - start})
    return 0


if __name__ == "__main__":  # pragma: no cover - the probe's child process
    sys.exit(_main(int(sys.argv[1]) if len(sys.argv) > 1 else 0))

"""What an apply did (``Report``), per patched module and merged: ``status()``, doctor and
the INFO line are built from it.  State-free: ``registry`` keeps the reports."""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional

__all__ = ["Report", "merge"]


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


def merge(reports: Dict[str, Report]) -> Report:
    """One report for every module patched (module name -> its last report): the modules'
    rows together; a module's reason (why it was not patched) names the module when there
    are several."""
    if len(reports) == 1:
        return next(iter(reports.values()))
    out = Report()
    reasons = []
    for name, rep in reports.items():
        out.vllm_version = out.vllm_version or rep.vllm_version
        out.family = out.family or rep.family
        out.applied += rep.applied
        out.skipped.update(rep.skipped)
        out.checks.update(rep.checks)
        if rep.reason is not None:
            reasons.append(f"{name}: {rep.reason}")
    out.reason = "; ".join(reasons) if reasons else None
    return out

"""``status()``: the facts of this process, for the face (``vllm_bi100_patch.status``),
doctor and the probes.  Imported with the package's face at interpreter start: nothing heavy
at import (each part it reads is imported where it reports, when loaded already).
"""

from __future__ import annotations

import sys

from .._version import __version__

TYPE_CHECKING = False  # typing itself costs milliseconds at interpreter start

if TYPE_CHECKING:
    from typing import Any, Dict

__all__ = ["status"]


def status() -> Dict[str, Any]:
    """Facts about this process: configuration, vLLM version and family, what is patched,
    the import guard, the pyairports stand-in (``guided_imports``), where each replaced class
    was rebound and what it could not reach (``class_bindings``), call and route counters,
    where the metrics go, and
    ``slicing_invariant``: whether every prompt and prefix attention row is the shim's, hence
    bit-identical however vLLM slices a prompt (``invariance.verdict``). Imports nothing
    heavy, patches nothing.

    ``mode`` and ``disabled`` are the configuration this process acted on (read at its
    activation); when the environment says otherwise now, ``config_live`` holds what it says
    (it takes effect in new processes, or at the next ``apply()``)."""
    from ..activation import bootstrap, config
    from ..attention import import_guard
    from . import invariance
    from ..patching import versions

    info = versions.installed_vllm_version()
    family = versions.family_for(info)
    live = config.load()
    acted = bootstrap.settings()
    settings = acted if acted is not None else live
    data: Dict[str, Any] = {
        "shim_version": __version__,
        "mode": settings.mode,
        "mode_raw": settings.raw.get(config.MODE),
        "disabled": list(settings.disabled),
        "vllm_version": info.raw,
        "family": family.name if family else None,
        "supported": family is not None,
        "patched": [],
        "report": None,
        "counts": {},
        "native_ops": None,
        "serving_path": versions.serving_path_note(info),
        "config_live": None,
        "metrics": {"export": "not started"},
        "guided_imports": None,
        "class_bindings": {},
    }
    if (live.mode, live.raw.get(config.MODE), live.disabled) != (
            settings.mode, settings.raw.get(config.MODE), settings.disabled):
        data["config_live"] = {"mode": live.mode, "mode_raw": live.raw.get(config.MODE),
                               "disabled": list(live.disabled)}
    with bootstrap._lock:  # one consistent snapshot, never half an apply() or revert()
        data.update(bootstrap.state())
        if "vllm_bi100_patch.patching.registry" in sys.modules:
            from ..patching import registry

            data["patched"] = registry.patched_attributes()
            data["report"] = registry.last_report().as_dict()
        if "vllm_bi100_patch.patching.factories" in sys.modules:  # any patch module loaded
            from ..patching import factories

            data["counts"] = factories.call_counts()
        if "vllm_bi100_patch.attention.paged_attention" in sys.modules:
            from ..attention import paged_attention

            data["native_ops"] = paged_attention.native_profile()
        data["import_guard"] = import_guard.state()
        if "vllm_bi100_patch.serving.guided_imports" in sys.modules:
            from ..serving import guided_imports

            data["guided_imports"] = guided_imports.state()
        if "vllm_bi100_patch.patching.rebind" in sys.modules:
            from ..patching import rebind

            data["class_bindings"] = rebind.state()
        data["slicing_invariant"] = invariance.verdict(
            settings, data["report"], data["counts"],
            inactive=None if data["active"] else data["decision"])
        if "vllm_bi100_patch.patching.counting.export" in sys.modules:
            from ..patching.counting import export

            data["metrics"] = export.state()
    return data

"""vllm-bi100-patch: a runtime shim that makes stock vLLM safe on Iluvatar BI-V100.

Public API: ``apply()``, ``revert()``, ``status()``. Importing this package is cheap (no torch,
no vLLM, no wrapt): the ``.pth`` line and ``sitecustomize`` import it in every interpreter.
"""

from __future__ import annotations

import sys

from ._version import __version__

TYPE_CHECKING = False  # typing itself costs milliseconds at interpreter start

if TYPE_CHECKING:
    from typing import Any, Dict, Optional

__all__ = ["apply", "revert", "status", "__version__"]


def apply(strict: Optional[bool] = None) -> Dict[str, Any]:
    """Activate the shim explicitly, on any hardware (hardware auto-detection is skipped;
    ``VLLM_BI100_PATCH=0`` still wins). Patches now if vLLM's paged_attn is imported, else
    when it is. Idempotent. Returns ``status()``.

    With ``strict=True`` (or ``VLLM_BI100_PATCH_STRICT=1``) an invalid variable raises
    ``config.ConfigError``, and an unsupported vLLM version or a failed code check raises
    ``registry.PatchError`` (now if vLLM is installed, whether or not it is imported yet),
    instead of a WARNING.
    """
    from . import _bootstrap

    _bootstrap.apply(strict)
    return status()


def revert() -> Dict[str, Any]:
    """Undo everything ``apply()`` and the start-up activation did in this process, under one
    lock: the exact original descriptors of the patched methods come back, the post-import
    hook and the import guard leave ``sys.meta_path``, real ``context_attention_fwd``
    references the guard re-pointed are restored, and a substitute ``prefix_prefill`` module
    leaves ``sys.modules`` (its name is removed from the vLLM modules that imported it).
    Future imports are not patched until ``apply()``. Returns ``status()``."""
    from . import _bootstrap

    with _bootstrap._lock:
        _bootstrap.deactivate()
        if "vllm_bi100_patch.registry" in sys.modules:
            from . import registry

            registry.revert_all()
    return status()


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
    from . import _bootstrap, config, import_guard, invariance, versions

    info = versions.installed_vllm_version()
    family = versions.family_for(info)
    live = config.load()
    acted = _bootstrap.settings()
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
    with _bootstrap._lock:  # one consistent snapshot, never half an apply() or revert()
        data.update(_bootstrap.state())
        if "vllm_bi100_patch.registry" in sys.modules:
            from . import registry

            data["patched"] = registry.patched_attributes()
            data["report"] = registry.last_report().as_dict()
        if "vllm_bi100_patch.patches._common" in sys.modules:  # any patch module loaded
            from .patches import _common

            data["counts"] = _common.call_counts()
        if "vllm_bi100_patch.patches.paged_attention" in sys.modules:
            from .patches import paged_attention

            data["native_ops"] = paged_attention.native_profile()
        data["import_guard"] = import_guard.state()
        if "vllm_bi100_patch.guided_imports" in sys.modules:
            from . import guided_imports

            data["guided_imports"] = guided_imports.state()
        if "vllm_bi100_patch.rebind" in sys.modules:
            from . import rebind

            data["class_bindings"] = rebind.state()
        data["slicing_invariant"] = invariance.verdict(
            settings, data["report"], data["counts"],
            inactive=None if data["active"] else data["decision"])
        if "vllm_bi100_patch.metrics_export" in sys.modules:
            from . import metrics_export

            data["metrics"] = metrics_export.state()
    return data

"""``python -m vllm_bi100_patch`` (also the ``vllm-bi100-patch`` console script).

  status          what the shim would do in this environment; patches nothing, imports no vLLM
  doctor          status + hardware, activation paths, and the code check of each patch (imports
                  vLLM's paged_attn behind the import guard); exits 1 when the shim would not
                  activate
  env-table       the README's table of environment variables
  versions-table  the README's table of supported vLLM versions
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import site
import sys
from typing import Any, Dict, List, Tuple

from . import config, hardware, status, versions

Check = Tuple[str, bool, str]


def _print_status(data: Dict[str, Any]) -> None:
    keys = ["shim_version", "mode", "disabled", "vllm_version", "family", "supported", "active",
            "decision", "activated_by", "patched", "import_guard", "counts", "config_errors"]
    for key in keys:
        print(f"{key:14} {data.get(key)}")


def _activation_paths() -> List[Check]:
    checks: List[Check] = []
    spec = importlib.util.find_spec("sitecustomize")
    ours = spec is not None and spec.origin is not None and _is_our_sitecustomize(spec.origin)
    checks.append(("sitecustomize", ours,
                   spec.origin if spec and spec.origin else "no sitecustomize on sys.path"))
    dirs = list(site.getsitepackages()) if hasattr(site, "getsitepackages") else []
    user = site.getusersitepackages() if hasattr(site, "getusersitepackages") else None
    dirs += [user] if isinstance(user, str) else []
    pth = [os.path.join(d, "vllm_bi100_patch.pth") for d in dirs
           if os.path.exists(os.path.join(d, "vllm_bi100_patch.pth"))]
    checks.append((".pth", bool(pth), pth[0] if pth else "vllm_bi100_patch.pth not in "
                   + ", ".join(dirs)))
    import importlib.metadata as md

    eps = [e for e in md.entry_points(group="vllm.general_plugins") if e.name == "bi100_patch"]
    allowed = os.environ.get("VLLM_PLUGINS")
    filtered = allowed is not None and "bi100_patch" not in allowed.split(",")
    checks.append(("entry point", bool(eps) and not filtered,
                   "vllm.general_plugins:bi100_patch" + (" (excluded by VLLM_PLUGINS)"
                                                         if filtered else "")
                   if eps else "not registered (is the shim pip-installed?)"))
    return checks


def _is_our_sitecustomize(path: str) -> bool:
    try:
        with open(path, encoding="utf-8") as fh:
            return "vllm-bi100-patch activation at interpreter start" in fh.read(400)
    except OSError:
        return False


def _code_checks(settings: config.Settings) -> List[Check]:
    family = versions.family_for(versions.installed_vllm_version())
    if family is None:
        return []
    from . import import_guard, registry

    if not settings.off and "import_guard" not in settings.disabled:
        import_guard.install()  # importing paged_attn must not pull in the Triton module
    try:
        import vllm.attention.ops.paged_attn as module  # noqa: F401
    except Exception as exc:
        return [("import paged_attn", False, f"{type(exc).__name__}: {exc}")]
    cls = vars(module).get(registry.TARGET_CLASS)
    if not isinstance(cls, type):
        return [("PagedAttention", False, "class missing")]
    out: List[Check] = []
    for spec in registry.SPECS:
        problem = registry.check_code(cls, spec, family)
        out.append((f"code check {spec.attr}", problem is None, problem or f"family {family.name}"))
    return out


def doctor() -> int:
    settings = config.load()
    data = status()
    _print_status(data)
    checks: List[Check] = [("configuration", not settings.errors,
                            "; ".join(settings.errors) or "valid")]
    facts: Dict[str, Any] = dict(hardware.cheap_detection())
    facts.update(hardware.device_facts() if importlib.util.find_spec("torch") else {})
    iluvatar = bool(facts.get("ixformer") or facts.get("torch_corex") or facts.get("iluvatar"))
    print(f"{'hardware':14} {facts}")
    if settings.off:
        checks.append(("mode", False, f"{config.MODE}=0: kill switch, stock vLLM"))
    elif settings.mode == "auto":
        checks.append(("mode", iluvatar, "auto: Iluvatar detected" if iluvatar else
                       f"auto: no Iluvatar device or ixformer; set {config.MODE}=1 to force"))
    else:
        checks.append(("mode", True, f"{config.MODE}=1: forced on"))
    supported = data["supported"]
    checks.append(("vLLM version", supported, f"{data['vllm_version']} family {data['family']}"
                   if supported else f"{data['vllm_version']} is not supported"))
    paths = _activation_paths()
    checks += paths
    checks += _code_checks(settings)
    for name, ok, detail in checks:
        print(f"[{'ok' if ok else 'FAIL':4}] {name}: {detail}")
    path_names = {name for name, _, _ in paths}
    would_activate = (any(ok for _, ok, _ in paths)
                      and all(ok for name, ok, _ in checks if name not in path_names))
    print("=> the shim " + ("would activate" if would_activate else "would NOT activate"))
    return 0 if would_activate else 1


def main(argv: Any = None) -> int:
    parser = argparse.ArgumentParser(prog="vllm-bi100-patch", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["status", "doctor", "env-table", "versions-table"])
    parser.add_argument("--json", action="store_true", help="status as JSON")
    args = parser.parse_args(argv)
    if args.command == "status":
        data = status()
        if args.json:
            print(json.dumps(data, indent=2, default=str))
        else:
            _print_status(data)
        return 0
    if args.command == "doctor":
        return doctor()
    if args.command == "env-table":
        print(config.env_table())
        return 0
    print(versions.support_table())
    return 0


if __name__ == "__main__":
    sys.exit(main())

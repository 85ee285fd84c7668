"""vllm-bi100-patch activation at interpreter start.

Installed as a top-level module. It first runs any other ``sitecustomize`` found further down
``sys.path`` (so installing the shim never disables a user's or a distribution's one), then
calls the shim's bootstrap. Neither step can raise into the host process. When another
``sitecustomize`` earlier on ``sys.path`` shadows this one, the ``vllm_bi100_patch.pth`` line
activates the shim instead.
"""


def _chain_next_sitecustomize():
    import importlib.machinery  # cheap; importlib.util would cost ~8 ms per interpreter
    import os
    import sys
    import types

    here = os.path.dirname(os.path.abspath(__file__))
    later = []
    seen_self = False
    for entry in sys.path:
        try:
            same = os.path.abspath(entry or os.getcwd()) == here
        except (OSError, TypeError, ValueError):
            continue
        if same:
            seen_self = True
        elif seen_self:
            later.append(entry)
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", later)
    if spec is None or spec.loader is None:
        return
    module = types.ModuleType("sitecustomize")
    module.__file__ = spec.origin
    module.__spec__ = spec
    module.__loader__ = spec.loader
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # the same leniency as site.py shows for a broken sitecustomize
        sys.stderr.write(f"Error in sitecustomize {spec.origin} (chained by vllm-bi100-patch): "
                         f"{type(exc).__name__}: {exc}\n")
    else:
        sys.modules["vllm_bi100_patch._chained_sitecustomize"] = module


def _activate():
    try:
        _chain_next_sitecustomize()
    except Exception:  # never break interpreter start
        pass
    try:
        from vllm_bi100_patch.activation import bootstrap
    except Exception:  # package half-installed or removed: stay out of the way
        return
    bootstrap.bootstrap("sitecustomize")


_activate()
del _activate

"""A class the shim replaces (``patch_row.REPLACE_CLASS``) is replaced wherever vLLM bound it.

Replacing ``protocol.ChatCompletionRequest`` in its module reaches only the code that reads the
name there later.  vLLM 0.6.3 binds it earlier in three more ways: other modules' globals
(``from ...protocol import ChatCompletionRequest``: ``api_server``, ``run_batch``, ...),
pydantic models whose fields name it (``BatchRequestInput.body``, built when ``protocol``
itself is executed, before any post-import hook runs: ``run_batch`` validated with 0.6.3's
class even when the shim patched ``protocol`` at its import), and the annotations of the
FastAPI endpoints (``api_server.create_chat_completion(request: ChatCompletionRequest)``),
from which every app built by ``build_app`` derives its body validation.

``rebind`` reaches all three in the vLLM modules loaded when the class is replaced (a module
imported later reads the name from ``protocol`` and gets the replacement): globals are
re-pointed, endpoint annotations rewritten, each such model replaced by a subclass whose
fields name the replacement (itself rebound the same way).  What it cannot reach is said in
``state()``: a FastAPI app built *before* the class was replaced (its routes compiled their
validators from the original class; found by ``gc``, only when ``api_server`` was loaded by
then).  ``restore`` undoes everything, in reverse order.

Patching layer: imports pydantic only when a model needs a new subclass (vLLM's front end has
it); never imports vLLM.
"""

from __future__ import annotations

import sys
import types
import typing
from typing import Any, Dict, List, Tuple

from ..activation.log import log

#: One undo step: (what, where, name, old value).  what: "global", "annotation".
Undo = Tuple[str, Any, str, Any]

#: class name -> what was rebound for it (``state()``).
_state: Dict[str, Dict[str, Any]] = {}
_undo: Dict[str, List[Undo]] = {}


def _mentions(annotation: Any, cls: type) -> bool:
    if annotation is cls:
        return True
    return any(_mentions(arg, cls) for arg in typing.get_args(annotation))


def _substitute(annotation: Any, old: type, new: type) -> Any:
    """``annotation`` with ``old`` replaced by ``new`` (through Union/Optional/List...)."""
    if annotation is old:
        return new
    args = typing.get_args(annotation)
    if not args:
        return annotation
    origin = typing.get_origin(annotation)
    subs = tuple(_substitute(a, old, new) for a in args)
    if origin is typing.Union:
        return typing.Union[subs]
    return annotation.copy_with(subs) if hasattr(annotation, "copy_with") else annotation


def _vllm_modules(skip: str) -> List[types.ModuleType]:
    return [m for name, m in list(sys.modules.items())
            if m is not None and name != skip and (name == "vllm" or name.startswith("vllm."))]


def rebind(module: types.ModuleType, name: str, old: Any, new: Any) -> None:
    """After ``module.name`` became ``new`` (a subclass of ``old``): re-point every loaded vLLM
    module's global bound to ``old``, rewrite module-level functions' annotations naming it,
    and replace pydantic models whose fields name it (in their module and wherever bound)."""
    undo: List[Undo] = []
    done: Dict[str, Any] = {"globals": [], "annotations": [], "models": []}
    for mod in _vllm_modules(module.__name__):
        for attr, value in list(vars(mod).items()):
            if value is old:
                undo.append(("global", mod, attr, old))
                setattr(mod, attr, new)
                done["globals"].append(f"{mod.__name__}.{attr}")
            elif isinstance(value, types.FunctionType) and value.__module__ == mod.__name__:
                ann = getattr(value, "__annotations__", None) or {}
                for key, hint in list(ann.items()):
                    if _mentions(hint, old):
                        undo.append(("annotation", ann, key, hint))
                        ann[key] = _substitute(hint, old, new)
                        done["annotations"].append(f"{mod.__name__}.{attr}({key})")
    for mod in [module] + _vllm_modules(module.__name__):
        for attr, value in list(vars(mod).items()):
            if _is_model(value) and value.__module__ == mod.__name__ and value is not new:
                fields = {f: _substitute(info.annotation, old, new)
                          for f, info in value.model_fields.items()
                          if _mentions(info.annotation, old)}
                if fields:
                    sub = _model_subclass(value, fields)
                    undo.append(("global", mod, attr, value))
                    setattr(mod, attr, sub)
                    done["models"].append(f"{mod.__name__}.{attr}")
                    for other in _vllm_modules(mod.__name__):
                        for oattr, ovalue in list(vars(other).items()):
                            if ovalue is value:
                                undo.append(("global", other, oattr, value))
                                setattr(other, oattr, sub)
                                done["globals"].append(f"{other.__name__}.{oattr}")
    done["stale_routes"] = _stale_routes(old) if "vllm.entrypoints.openai.api_server" in \
        sys.modules else 0
    if done["stale_routes"]:
        log.warning("vllm-bi100-patch: %d route(s) of a server app built before the shim "
                    "replaced %s validate request bodies with vLLM's original class: the "
                    "replacement does not reach them (activate the shim before the app is "
                    "built: its .pth or sitecustomize, not only vLLM's plugin entry point)",
                    done["stale_routes"], name)
    _undo.setdefault(name, []).extend(undo)
    _state[name] = done


def _is_model(value: Any) -> bool:
    return isinstance(value, type) and hasattr(value, "model_fields") and hasattr(
        value, "model_validate")


def _model_subclass(model: Any, fields: Dict[str, Any]) -> type:
    """A subclass of the pydantic ``model`` whose ``fields`` have the given annotations (their
    defaults, validators and configuration are ``model``'s)."""
    ns: Dict[str, Any] = {"__annotations__": dict(fields), "__module__": model.__module__,
                          "__qualname__": model.__qualname__, "__doc__": model.__doc__}
    for f in fields:
        info = model.model_fields[f]
        if not info.is_required():
            ns[f] = info
    return type(model.__name__, (model,), ns)


def _stale_routes(old: type) -> int:
    """FastAPI routes alive in this process whose body validation was compiled from ``old``
    (an app built before the replacement), the api_server router's own templates left out
    (``build_app`` derives every app's routes anew from the endpoints)."""
    import gc

    router = getattr(sys.modules.get("vllm.entrypoints.openai.api_server"), "router", None)
    templates = {id(r) for r in getattr(router, "routes", ())}
    count = 0
    for obj in gc.get_objects():
        if type(obj).__name__ != "APIRoute" or id(obj) in templates:
            continue
        field = getattr(obj, "body_field", None)
        kind = getattr(field, "type_", None) or getattr(
            getattr(field, "field_info", None), "annotation", None)
        if kind is old:
            count += 1
    return count


def restore(name: str) -> None:
    """Undo ``rebind`` for the class ``name`` (each global and annotation back, where it still
    holds what ``rebind`` put there)."""
    for what, where, key, value in reversed(_undo.pop(name, [])):
        if what == "annotation":
            where[key] = value
        else:
            setattr(where, key, value)
    _state.pop(name, None)


def state() -> Dict[str, Dict[str, Any]]:
    """Per replaced class: the globals re-pointed, the endpoint annotations rewritten, the
    models replaced, and ``stale_routes``: routes of an app built before, which it does not
    reach (0: none)."""
    return {k: dict(v) for k, v in _state.items()}

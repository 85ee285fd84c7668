"""The method rows of the patch table, ready for the registry: ``PatchSpec`` (one row),
``SPECS`` (all of them), and the check of a saved or found descriptor against its row.

Patching layer: no state here (the registry keeps the saved originals and the reports).
"""

from __future__ import annotations

import dataclasses
import inspect
import types
from typing import TYPE_CHECKING, Any, Callable, List, Optional, Tuple

from ..activation import config
from . import table, versions
from . import patch_row

if TYPE_CHECKING:
    from .factories import Factory


@dataclasses.dataclass(frozen=True)
class PatchSpec:
    """A method row of ``table.PATCHES``, ready for the registry."""

    row: patch_row.Patch

    @property
    def name(self) -> str:  # the name used in VLLM_BI100_PATCH_DISABLE
        return self.row.name

    @property
    def module(self) -> str:
        return self.row.module

    @property
    def owner(self) -> str:
        return self.row.owner

    @property
    def attr(self) -> str:
        return self.row.attr

    def params(self, family: versions.Family) -> Tuple[str, ...]:
        """The parameter names the code check expects in ``family``."""
        how, _, what = (self.row.params or "").partition(":")
        if how == "code":
            return ()
        if how == "family":
            return tuple(getattr(family, what))
        if how == "names":
            return tuple(n for n in what.split(",") if n)
        raise ValueError(f"table row {self.name}: unknown params check {self.row.params!r}")

    @property
    def replaces_class(self) -> bool:
        """The row replaces its module's class (``patch_row.REPLACE_CLASS``)."""
        return self.row.kind == patch_row.REPLACE_CLASS

    @property
    def replaces_function(self) -> bool:
        """The row wraps its module's function (``patch_row.REPLACE_FUNCTION``)."""
        return self.row.kind == patch_row.REPLACE_FUNCTION

    @property
    def replaces_global(self) -> bool:
        """The row puts a new object in its module's namespace (a class or a function) and
        wherever vLLM bound the old one (``rebind``)."""
        return self.replaces_class or self.replaces_function

    @property
    def instance_method(self) -> bool:
        """A plain function of the class (bound to the instance), not a staticmethod."""
        return self.row.kind == patch_row.WRAP_INSTANCE

    def code_check(self) -> Optional[Callable[[Any], Optional[str]]]:
        """The row's own check of the code (``params="code:module:function"``), if any."""
        how, _, what = (self.row.params or "").partition(":")
        return table.resolve(what) if how == "code" else None  # type: ignore[return-value]

    def factory(self) -> "Factory":
        """The row's factory (``patching.factories.Factory``)."""
        return table.resolve(self.row.factory)  # type: ignore[return-value]

    def not_needed(self, module: types.ModuleType, settings: config.Settings) -> Optional[str]:
        """Why this (conditional) patch is not needed for ``module`` under ``settings``; None
        when it is."""
        if self.row.when is None:
            return None
        check: Callable[[types.ModuleType, config.Settings], Optional[str]] = (
            table.resolve(self.row.when))  # type: ignore[assignment]
        return check(module, settings)


SPECS: Tuple[PatchSpec, ...] = tuple(PatchSpec(row) for row in table.methods())


def check_descriptor(desc: Any, spec: PatchSpec, family: versions.Family) -> Optional[str]:
    where = f"{spec.owner}.{spec.attr}"
    func: Callable[..., Any]
    if spec.replaces_class:
        if not isinstance(desc, type):
            return f"{spec.owner} is a {type(desc).__name__}, not a class"
        func = desc
    elif spec.replaces_function:
        if not isinstance(desc, types.FunctionType):
            return f"{spec.owner} is a {type(desc).__name__}, not a function"
        func = desc
    elif spec.instance_method:
        if not isinstance(desc, types.FunctionType):
            return f"{where} is a {type(desc).__name__}, not a plain method"
        func = desc
    elif not isinstance(desc, staticmethod):
        return f"{where} is a {type(desc).__name__}, not a staticmethod"
    else:
        func = desc.__func__
    code_check = spec.code_check()
    if code_check is not None:
        return code_check(func)
    try:
        params = tuple(inspect.signature(func).parameters)
    except (TypeError, ValueError) as exc:
        return f"{where} has no readable signature ({exc})"
    expected = spec.params(family)
    if params != expected:
        return (f"{where} parameters {list(params)} differ from family "
                f"{family.name}'s {list(expected)}")
    return None


def missing_classes(module: types.ModuleType, settings: config.Settings) -> List[str]:
    """The owner classes (and functions) of ``module``'s rows that the module does not define
    (rows whose own check says this build does not need them are left out)."""
    owners = {s.owner: s.replaces_function for s in specs_for(module.__name__)
              if not s.not_needed(module, settings)}
    return [name for name, function in owners.items()
            if not isinstance(vars(module).get(name), types.FunctionType if function else type)]


def specs_for(module_name: str) -> List[PatchSpec]:
    """The method rows that target ``module_name``."""
    return [s for s in SPECS if s.module == module_name]

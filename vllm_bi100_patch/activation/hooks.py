"""A ``sys.meta_path`` finder that calls back around the import of named modules.

Activation layer (the bootstrap installs it at interpreter start): stdlib only, and
``importlib.util`` only once a hooked module is looked up.
"""

from __future__ import annotations

import sys

TYPE_CHECKING = False  # typing itself costs milliseconds at interpreter start

if TYPE_CHECKING:
    from typing import Any, Callable, Dict, List


class _HookLoader:
    """Wraps a module's loader; runs the post-import callbacks after the module executed."""

    def __init__(self, loader: Any, finder: "PostImportFinder", name: str) -> None:
        self._loader = loader
        self._finder = finder
        self._name = name

    def create_module(self, spec: Any) -> Any:
        create = getattr(self._loader, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module: Any) -> None:
        self._loader.exec_module(module)
        self._finder.fire(self._name, module)

    def __getattr__(self, name: str) -> Any:  # get_source, is_package, get_code, ...
        return getattr(self._loader, name)


class PostImportFinder:
    """A ``sys.meta_path`` entry that calls back around the import of named modules.

    ``before`` callbacks run when the module is looked up, before its code executes; ``after``
    callbacks run once it has executed. The same technique as wrapt's ``when_imported`` (find
    the real spec, wrap its loader), without importing wrapt at interpreter start.
    """

    def __init__(self) -> None:
        self.hooks: Dict[str, List[Callable[[Any], None]]] = {}
        self.before: Dict[str, List[Callable[[], None]]] = {}
        self._resolving: set = set()

    def register(self, name: str, hook: Callable[[Any], None]) -> None:
        """Call ``hook(module)`` after ``name`` is imported (at once if it already is)."""
        self.hooks.setdefault(name, []).append(hook)
        module = sys.modules.get(name)
        if module is not None:
            hook(module)

    def register_before(self, name: str, hook: Callable[[], None]) -> None:
        """Call ``hook()`` when ``name`` is about to be imported (at once if it already is)."""
        self.before.setdefault(name, []).append(hook)
        if name in sys.modules:
            hook()

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname in self._resolving:
            return None
        for hook in list(self.before.get(fullname, ())):
            hook()
        if fullname not in self.hooks:
            return None
        import importlib.util

        self._resolving.add(fullname)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._resolving.discard(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None
        spec.loader = _HookLoader(spec.loader, self, fullname)  # type: ignore[assignment]
        return spec

    def fire(self, name: str, module: Any) -> None:
        for hook in list(self.hooks.get(name, ())):
            hook(module)

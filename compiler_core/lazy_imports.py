"""Defer sympy's import to its first use.

onnx_ir imports sympy at module level (about half a second, most of a `qpcfarm compile`
process's start-up): `onnx_ir._core` for arithmetic on symbolic dimensions, and its
`_symbolic_shapes` parser, whose function table names sympy functions at import. A compile
binds every dimension before it shapes anything, so it never does that arithmetic (onnx_ir
builds sympy expressions only on demand).

`defer_heavy_imports` puts a module object for each of LAZY_MODULES in `sys.modules` that is
executed, in place, by the module's own loader on the first access to an attribute it does
not have yet, or when a submodule of it is imported. So whatever uses sympy (a symbolic-dim
expression, torch, another library) gets the real module, and the same object onnx_ir holds.
The standard library's `LazyLoader` is not enough here: on Python 3.11 it loads the module as
soon as an `import` statement reads the module's `__spec__`.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import threading
import types
from collections.abc import Sequence

LAZY_MODULES = ("sympy", "onnx_ir._symbolic_shapes")

_lock = threading.RLock()


class _DeferredModule(types.ModuleType):
    """A module whose code runs on first use of an attribute it lacks."""

    def __getattr__(self, attr: str) -> object:
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)  # probes such as __path__ or __wrapped__: not a use
        _load(self)
        return getattr(self, attr)


def _load(module: types.ModuleType) -> None:
    with _lock:
        if type(module) is not _DeferredModule:
            return  # loaded meanwhile
        module.__class__ = types.ModuleType  # type: ignore[assignment]
        spec = module.__spec__
        assert spec is not None and spec.loader is not None
        try:
            spec.loader.exec_module(module)
        except BaseException:
            sys.modules.pop(module.__name__, None)
            raise


class _LoadParentFirst(importlib.abc.MetaPathFinder):
    """Importing `sympy.core` runs `sympy` first, as it would without deferral."""

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: types.ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        parent = fullname.rpartition(".")[0]
        while parent:
            module = sys.modules.get(parent)
            if type(module) is _DeferredModule:
                _load(module)
            parent = parent.rpartition(".")[0]
        return None  # the ordinary finders find it


def defer_heavy_imports() -> None:
    """Register each module of LAZY_MODULES for deferred loading, unless it (or, for a
    submodule, its package) is already imported, or it is not installed: then importing it
    behaves as it would have."""
    with _lock:
        if not any(isinstance(f, _LoadParentFirst) for f in sys.meta_path):
            sys.meta_path.insert(0, _LoadParentFirst())
        for name in LAZY_MODULES:
            parent = name.rpartition(".")[0]
            if name in sys.modules or (parent and parent in sys.modules):
                continue
            spec = _find_spec_without_importing(name)
            if spec is None or spec.loader is None:
                continue
            module = importlib.util.module_from_spec(spec)
            module.__class__ = _DeferredModule
            sys.modules[name] = module


def _find_spec_without_importing(name: str) -> importlib.machinery.ModuleSpec | None:
    """`importlib.util.find_spec`, except that a submodule's package is not executed."""
    parent = name.rpartition(".")[0]
    if not parent:
        return importlib.util.find_spec(name)
    package = importlib.util.find_spec(parent)
    if package is None or package.submodule_search_locations is None:
        return None
    return importlib.machinery.PathFinder.find_spec(name, package.submodule_search_locations)


def loaded(name: str) -> bool:
    """Whether the module is imported for real (not only registered for deferred loading)."""
    module = sys.modules.get(name)
    return module is not None and type(module) is not _DeferredModule

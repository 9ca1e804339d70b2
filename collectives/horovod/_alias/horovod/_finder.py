"""How ``horovod.X`` resolves inside a ``dtrun --horovod`` job.

1. ``dtrun.collectives.horovod.X``, when dtrun has that (public) module: the very module
   object, under both names in ``sys.modules``, so classes, ``isinstance`` and module
   state are shared whichever name a script or library imports.
2. Else a shim of this folder, where Horovod's layout differs from dtrun's
   (``horovod/common/util.py`` for ``horovod.common.util``, and so on).
3. Else a ModuleNotFoundError that names what dtrun provides there.

Only names under ``horovod.`` are looked at; every other import is left to Python.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import pkgutil
import sys

ALIAS = "horovod"
TARGET = "dtrun.collectives.horovod"
HERE = os.path.dirname(os.path.abspath(__file__))


class _Alias(importlib.abc.Loader):
    """Loads ``horovod.X`` as the already importable module ``real``."""

    def __init__(self, real: str):
        self.real = real

    def create_module(self, spec):
        return None  # a stand-in: exec_module puts the real module in its place

    def exec_module(self, module) -> None:
        # The import system returns whatever sys.modules holds for the name once this
        # returns, and binds that as the parent's attribute: the real module, untouched.
        sys.modules[module.__name__] = importlib.import_module(self.real)


def _real_parent(parent):
    """The dtrun module behind ``parent`` (a module named horovod or horovod.*), or None
    when ``parent`` is one of this folder's shims."""
    if parent.__name__ == ALIAS:
        return importlib.import_module(TARGET)
    if parent.__name__ == TARGET or parent.__name__.startswith(TARGET + "."):
        return parent
    return None


def _shim_spec(fullname: str):
    """The spec of this folder's shim for ``fullname``, or None."""
    base = os.path.join(HERE, *fullname.split(".")[1:])
    init = os.path.join(base, "__init__.py")
    if os.path.isfile(init):
        return importlib.util.spec_from_file_location(fullname, init, submodule_search_locations=[base])
    if os.path.isfile(base + ".py"):
        return importlib.util.spec_from_file_location(fullname, base + ".py")
    return None


def provided(parent_name: str) -> list[str]:
    """The public modules under ``parent_name`` (horovod or horovod.*): dtrun's and the shims'."""
    parent = sys.modules.get(parent_name)
    real = _real_parent(parent) if parent is not None else None
    paths = list(getattr(real, "__path__", None) or []) + [os.path.join(HERE, *parent_name.split(".")[1:])]
    return sorted({f"{parent_name}.{m.name}" for m in pkgutil.iter_modules(paths) if not m.name.startswith("_")})


class HorovodFinder(importlib.abc.MetaPathFinder):
    """The meta-path finder of ``horovod.*`` (see the module's docstring)."""

    dtrun_horovod_alias = True  # how install() recognises one already in place

    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith(ALIAS + "."):
            return None
        parent_name, _, child = fullname.rpartition(".")
        parent = sys.modules.get(parent_name)
        if parent is None:  # the import system imports parents first: not an import
            return None
        real = _real_parent(parent)
        if real is not None and not child.startswith("_") and hasattr(real, "__path__"):
            found = importlib.machinery.PathFinder.find_spec(f"{real.__name__}.{child}", real.__path__)
            if found is not None:
                return importlib.machinery.ModuleSpec(
                    fullname, _Alias(found.name), origin=found.origin,
                    is_package=found.submodule_search_locations is not None)
        shim = _shim_spec(fullname)
        if shim is not None:
            return shim
        have = ", ".join(provided(parent_name)) or "nothing"
        raise ModuleNotFoundError(
            f"No module named {fullname!r}: under dtrun --horovod, horovod is dtrun's Horovod "
            f"adapter ({TARGET}), which provides {have} (run without --horovod to use an "
            "installed Horovod)", name=fullname)


def install() -> None:
    """Put the finder first on ``sys.meta_path``, once per process."""
    if not any(getattr(f, "dtrun_horovod_alias", False) for f in sys.meta_path):
        sys.meta_path.insert(0, HorovodFinder())

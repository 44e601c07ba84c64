"""Aliases for renamed public modules, kept for one release: importing one warns once and points to the new name."""

from __future__ import annotations

import importlib
import sys
import warnings
from types import ModuleType


def alias(old: str, new: str, submodules: tuple[str, ...] = ()) -> ModuleType:
    """Warn that ``old`` is now ``new`` and register ``old.<sub>`` as ``new.<sub>`` for each of ``submodules``."""
    warnings.warn(f"{old} is now {new}; the old name goes in the next release", DeprecationWarning, stacklevel=3)
    module = importlib.import_module(new)
    for sub in submodules:
        sys.modules[f"{old}.{sub}"] = importlib.import_module(f"{new}.{sub}")
    return module


def renamed(old: str, new: str):
    """A method ``old`` that warns and calls the method ``new`` (a renamed public method, kept for one release)."""
    def method(self, *args, **kwargs):
        warnings.warn(f"{old} is now .{new}; the old name goes in the next release", DeprecationWarning, stacklevel=2)
        return getattr(self, new)(*args, **kwargs)

    method.__name__ = old.rsplit(".", 1)[-1]
    return method


def renamed_attribute(old: str, new: str) -> property:
    """A read-only attribute ``old`` that warns and returns the attribute ``new`` (kept for one release)."""
    def getter(self):
        warnings.warn(f"{old} is now .{new}; the old name goes in the next release", DeprecationWarning, stacklevel=2)
        return getattr(self, new)

    return property(getter, doc=f"Deprecated name of :attr:`{new}`.")

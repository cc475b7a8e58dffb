"""Experiment kinds, registered by name (see :mod:`tracekit.experiments.base`).

Importing this package imports every module in it, and each module registers its kinds with
``@register``; a new kind is a new module here, with no list to edit.
"""

import importlib
import pkgutil

from .base import REGISTRY, Experiment, Expectation, Result, register  # noqa: F401

__all__ = ["REGISTRY", "Experiment", "Expectation", "Result", "register"]

for _m in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
    if _m.name.startswith("_") or _m.name == "base":
        continue
    _mod = importlib.import_module(f"{__name__}.{_m.name}")
    for _name in getattr(_mod, "__all__", []):
        globals()[_name] = getattr(_mod, _name)
        __all__.append(_name)

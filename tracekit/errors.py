"""Compatibility path: tracekit's errors live in :mod:`tracekit.core.errors` (one error root)."""

from .core.errors import *  # noqa: F401,F403
from .core.errors import __all__  # noqa: F401

"""Experiment kinds, registered by name (see :mod:`tracekit.experiments.base`).

Importing this package registers every built-in kind.
"""

from .base import REGISTRY, Experiment, Expectation, Result, register  # noqa: F401
from .logit_lens import LogitLens, LogitLensResult  # noqa: F401

__all__ = ["REGISTRY", "Experiment", "Expectation", "Result", "register", "LogitLens", "LogitLensResult"]

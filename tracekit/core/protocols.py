"""The structural types every layer names: :class:`HookedModel`, the type of every ``model``
argument (in ``core`` so that the site table's checks, :mod:`tracekit.core.sites`, can be typed
too; :mod:`tracekit.model.info` re-exports it beside :class:`~tracekit.model.info.ModelInfo`)."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

__all__ = ["HookedModel"]


_MEMBERS = ("cfg", "tokenizer", "hook_dict", "__call__", "run_with_cache", "run_with_hooks", "hooks")


def _has_static(obj: object, name: str) -> bool:
    """``name`` in ``obj``'s own ``__dict__`` or on its class, found without running a property or a
    ``__getattr__`` (Python 3.12's ``inspect.getattr_static`` rule for protocol checks)."""
    try:
        if name in object.__getattribute__(obj, "__dict__"):
            return True
    except AttributeError:
        pass
    return any(name in vars(c) for c in type(obj).__mro__)


class _StaticProtocolMeta(type(Protocol)):
    """``isinstance(x, HookedModel)`` without evaluating ``x``'s attributes.

    Python 3.11's protocol check calls ``hasattr`` on every member, and a TransformerBridge's
    ``hook_dict`` is a property that rebuilds every hook alias (~20 ms): run-time type checks
    (beartype, in the tests) on every typed ``model`` argument made the suite minutes slower. The
    members are looked up statically first (as Python 3.12 does); only an object that lacks one
    that way falls back to the ordinary check (a ``__getattr__``-provided member still counts).
    """

    def __instancecheck__(cls, obj: object) -> bool:
        if cls is HookedModel and all(_has_static(obj, m) for m in _MEMBERS):
            return True
        return super().__instancecheck__(obj)


@runtime_checkable
class HookedModel(Protocol, metaclass=_StaticProtocolMeta):
    """What tracekit reads on a model: the type of every ``model`` argument.

    A loaded TransformerLens ``TransformerBridge`` (from :func:`tracekit.load_model`) has all of it.
    A :class:`tracekit.model.ModelInfo` has the static part (``cfg``, ``tokenizer``, ``hook_dict``:
    what ``Experiment.check`` reads before any weights load) and refuses the running part with a
    clear :class:`~tracekit.errors.ModelLoadError`.
    """

    cfg: Any
    tokenizer: Any

    @property
    def hook_dict(self) -> dict: ...  # read-only: a bridge's is a property, a ModelInfo's an attribute

    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...

    def run_with_cache(self, *args: Any, **kwargs: Any) -> Any: ...

    def run_with_hooks(self, *args: Any, **kwargs: Any) -> Any: ...

    def hooks(self, *args: Any, **kwargs: Any) -> Any: ...

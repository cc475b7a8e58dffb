"""The structural types every layer names: :class:`HookedModel`, the type of every ``model``
argument (in ``core`` so that the site table's checks, :mod:`tracekit.core.sites`, can be typed
too; :mod:`tracekit.model.info` re-exports it beside :class:`~tracekit.model.info.ModelInfo`)."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

__all__ = ["HookedModel"]


@runtime_checkable
class HookedModel(Protocol):
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

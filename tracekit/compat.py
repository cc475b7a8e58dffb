"""The one place where tracekit meets differences between TransformerLens 3.9 and 4.x, and the
optional SAELens.

tracekit runs on TransformerLens' ``TransformerBridge`` from 3.9 through 4.x. The bridge's public
API (``boot_transformers``, ``enable_compatibility_mode``, hook names, ``run_with_cache``) is the
same; what moved or changed shape, and how each is handled here:

* ``build_alias_to_canonical_map`` (the bridge's alias -> canonical hook-name map) moved from
  ``transformer_lens.model_bridge.bridge`` (3.9) to ``transformer_lens.model_bridge.bridge_core``
  (4.x; ``bridge`` became a re-export shim of the classes only): :func:`hook_alias_map` imports
  it from wherever it is.
* ``TransformerBridge.check_hooks_to_add`` took the hook name (3.9) and takes
  ``(hook_point, name, hook_fn, dir=...)`` (4.x): :func:`check_hook_to_add` calls the form the
  installed version has (chosen by its signature, not by the version number).
* ``get_official_model_name`` moved from ``transformer_lens.loading_from_pretrained`` (3.9) to
  ``transformer_lens.supported_models`` (4.x): :func:`official_model_name`.
* SAELens (``sae-lens`` 6.x) pins ``transformer-lens<4`` (SAELens issue #738): ``import sae_lens``
  fails next to TransformerLens 4. It is the ``tracekit[sae]`` extra. The SAE kinds do not need it
  for SAEs given as a SAELens directory (``sae.path``: read by :mod:`tracekit.dictionaries` without
  ``sae_lens``) or trained here; :func:`require_sae_lens` is the one refusal for what only SAELens
  has (its pretrained registry, ``sae.release`` + ``id``; its training runner where tracekit uses
  it), raised when it is missing or cannot be imported.

Nothing here imports torch or TransformerLens at module import (``tracekit --help`` stays light).
"""

from __future__ import annotations

import functools
import importlib
import inspect
from importlib import metadata
from typing import Any, Callable

from .core.errors import SAEError

__all__ = ["tl_version", "tl_major", "hook_alias_map", "official_model_name", "check_hook_to_add", "sae_lens_status",
           "has_sae_lens", "require_sae_lens", "SAE_MISSING_FIX", "SAE_RELEASE_FIX"]

#: The fix named by every SAE refusal.
SAE_MISSING_FIX = ("use an environment with TransformerLens 3.x and SAELens: "
                   "pip install 'transformer-lens>=3.9,<4' 'tracekit[sae]' (the default `make install` env)")

#: The fix named when a SAELens pretrained release (``sae.release`` + ``id``) is refused: the
#: directory form runs without SAELens.
SAE_RELEASE_FIX = ("download the SAE's folder (cfg.json + sae_weights.safetensors, e.g. from its Hugging Face repo) "
                   "and give it as sae.path, which needs no SAELens; or " + SAE_MISSING_FIX)


@functools.lru_cache(maxsize=None)
def tl_version() -> str:
    """The installed TransformerLens version string (from the package metadata; nothing imported).

    Returns:
        e.g. ``"3.9.0"``, or ``"0"`` when TransformerLens is not installed.
    """
    try:
        return metadata.version("transformer-lens")
    except metadata.PackageNotFoundError:
        return "0"


def tl_major() -> int:
    """The major version of the installed TransformerLens (``3`` or ``4``; ``0`` if absent).

    Returns:
        The leading integer of :func:`tl_version`.
    """
    head = tl_version().split(".")[0]
    return int(head) if head.isdigit() else 0


@functools.lru_cache(maxsize=None)
def _moved(name: str, *modules: str) -> Any:
    """``name`` from the first of ``modules`` (newest location first) that has it.

    Raises:
        ImportError: none of them has it (a TransformerLens this module does not know).
    """
    for mod in modules:
        try:
            obj = getattr(importlib.import_module(mod), name, None)  # lazy: TransformerLens is heavy
        except ImportError:
            continue
        if obj is not None:
            return obj
    raise ImportError(f"TransformerLens {tl_version()} has no {name} in {', '.join(modules)}; "
                      "tracekit supports transformer-lens>=3.9,<5 (tracekit/compat.py)")


def hook_alias_map(hook_dict: dict) -> dict[str, str]:
    """The bridge's alias -> canonical hook-name map (TransformerLens' ``build_alias_to_canonical_map``).

    Args:
        hook_dict: ``model.hook_dict`` of a ``TransformerBridge``.

    Returns:
        ``{alias: canonical name}`` for every hook name whose hook point is named differently.
    """
    return _moved("build_alias_to_canonical_map", "transformer_lens.model_bridge.bridge_core",  # 4.x
                  "transformer_lens.model_bridge.bridge")(hook_dict)  # 3.9


def official_model_name(name: str) -> str:
    """TransformerLens' official name for a model alias (``get_official_model_name``).

    ``get_official_model_name`` lives in ``transformer_lens.supported_models`` (4.x) or
    ``transformer_lens.loading_from_pretrained`` (3.9).

    Args:
        name: a model name or TransformerLens alias (e.g. ``"gpt2-small"``).

    Returns:
        The Hugging Face name TransformerLens maps it to.

    Raises:
        ValueError: TransformerLens does not know the name (its own error).
        ImportError: neither module has the function.
    """
    return _moved("get_official_model_name", "transformer_lens.supported_models",  # 4.x
                  "transformer_lens.loading_from_pretrained")(name)  # 3.9


@functools.lru_cache(maxsize=None)
def _check_takes_hook_point(cls: type) -> bool:
    """Whether ``cls.check_hooks_to_add`` has the 4.x form ``(hook_point, name, hook_fn, ...)``."""
    params = list(inspect.signature(cls.check_hooks_to_add).parameters)
    return len(params) > 1 and params[1] == "hook_point"


def check_hook_to_add(model: Any, hook_point: Any, name: str, fn: Callable, direction: str = "fwd") -> None:
    """Run the bridge's own check before a hook is added (it refuses gated-off hook points, e.g.
    ``attn.hook_result`` without ``use_attn_result``), in the form the installed version has.

    Args:
        model: a ``TransformerBridge``.
        hook_point: the ``HookPoint`` the hook goes on.
        name: the canonical hook name.
        fn: the hook function.
        direction: ``"fwd"`` or ``"bwd"``.

    Raises:
        ValueError: the bridge's refusal (a gated-off hook point), unchanged.
    """
    if _check_takes_hook_point(type(model)):
        model.check_hooks_to_add(hook_point, name, fn, dir=direction)
    else:
        model.check_hooks_to_add(name)


def _sae_lens_metadata_problem() -> str | None:
    """Why SAELens cannot work here, from the installed packages' metadata alone (nothing imported)."""
    try:
        requires = metadata.requires("sae-lens") or []
    except metadata.PackageNotFoundError:
        return (f"SAELens (the sae-lens package) is not installed; it is the tracekit[sae] extra, and SAELens 6 "
                f"pins transformer-lens<4 (SAELens issue #738) while TransformerLens {tl_version()} is installed")
    from packaging.requirements import InvalidRequirement, Requirement  # lazy: only SAE configs need it

    for line in requires:
        try:
            req = Requirement(line)
        except InvalidRequirement:
            continue
        if req.name.lower().replace("_", "-") == "transformer-lens" and req.marker is None \
                and not req.specifier.contains(tl_version(), prereleases=True):
            return (f"the installed SAELens {metadata.version('sae-lens')} requires transformer-lens{req.specifier} "
                    f"but TransformerLens {tl_version()} is installed (SAELens issue #738)")
    return None


@functools.lru_cache(maxsize=None)
def sae_lens_status(import_check: bool = True) -> str | None:
    """Why SAELens cannot be used here, or ``None`` when it can.

    Args:
        import_check: also try ``import sae_lens`` (once per process; it imports torch and
            TransformerLens). ``False``: the package metadata only (config validation stays light).

    Returns:
        ``None`` if SAELens is usable; otherwise a sentence naming the reason.
    """
    problem = _sae_lens_metadata_problem()
    if problem is not None or not import_check:
        return problem
    try:
        import sae_lens  # noqa: F401  # lazy: sae_lens is heavy and optional
    except Exception as e:  # noqa: BLE001 - any import failure means the same refusal
        return (f"SAELens is installed but does not import next to TransformerLens {tl_version()} "
                f"({type(e).__name__}: {e}); SAELens 6 pins transformer-lens<4 (SAELens issue #738)")
    return None


def has_sae_lens() -> bool:
    """Whether SAELens can be imported in this environment.

    Returns:
        ``True`` when :func:`sae_lens_status` finds no problem.
    """
    return sae_lens_status() is None


def require_sae_lens(what: str, import_check: bool = True, needs: str = "SAE support",
                     fix: str = SAE_MISSING_FIX) -> None:
    """Refuse what only SAELens provides when SAELens is missing (one message everywhere).

    Args:
        what: what needs it, e.g. ``"sae.release"`` (the YAML field) or ``"sae.train"``; named first.
        import_check: also try ``import sae_lens`` (``False`` at config validation: metadata only).
        needs: the feature that needs SAELens, named in the message (e.g. ``"a SAELens pretrained
            release"``).
        fix: the fix named (default :data:`SAE_MISSING_FIX`; :data:`SAE_RELEASE_FIX` for a release).

    Raises:
        SAEError: SAELens is not usable; the message names the missing support and the fix.
    """
    reason = sae_lens_status(import_check)
    if reason is not None:
        raise SAEError(f"{what}: {needs} needs SAELens, which is not available here: {reason}. "
                       f"Fix: {fix}.")

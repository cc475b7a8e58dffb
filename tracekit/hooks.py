"""Hook names, gated hooks, and the guarantee that no call leaves state behind on a model.

Every kind reads or patches activations at TransformerLens hook points
(``blocks.{L}.hook_resid_pre``, ``blocks.{L}.attn.hook_z``, ``blocks.{L}.mlp.hook_post``, ...).
Three things are decided here, once:

* **names** -- :func:`check_hooks` refuses an unknown hook name (suggesting close ones) before any
  model work;
* **gated hooks** -- TransformerLens computes some hooks only when a setting is on
  (``hook_mlp_in``: ``use_hook_mlp_in``; ``attn.hook_result``: ``use_attn_result``;
  ``hook_attn_in``: ``use_attn_in``; ``attn.hook_{q,k,v}_input``: ``use_split_qkv_input``).
  A name filter silently skips them, so a probe on ``blocks.1.hook_mlp_in`` would extract nothing.
  :func:`enabled_hooks` turns on exactly the settings a step needs and restores them afterwards;
* **no leaks** -- :func:`state_guard` snapshots every forward/backward hook of every module, the
  gated settings, the tokenizer's padding side and train/eval mode, and restores them on exit
  *whatever is raised* (out-of-memory, ``KeyboardInterrupt``, a bad metric). Every experiment runs
  inside one (:meth:`tracekit.experiments.base.Experiment.run`), and every engine function that adds
  a hook removes it in a ``finally``.
"""

from __future__ import annotations

import contextlib
import difflib
import re
from typing import Any, Callable, Iterable, Iterator, cast

from .compat import check_hook_to_add, hook_alias_map
from .errors import HookError
from .model.info import HookedModel
from .model.state import state_of

__all__ = ["GATES", "hook_names", "gated_setting", "check_hooks", "enabled_hooks", "state_guard",
           "hook_layer", "fwd_hooks"]

#: TransformerLens setting that gates each hook-name suffix (see ``TransformerBridge._gated_hook_reason``).
GATES: dict[str, str] = {
    "attn.hook_result": "use_attn_result",
    "hook_q_input": "use_split_qkv_input",
    "hook_k_input": "use_split_qkv_input",
    "hook_v_input": "use_split_qkv_input",
    "mlp_in": "use_hook_mlp_in",
    "attn_in": "use_attn_in",
}

_LAYER = re.compile(r"^blocks\.(\d+)\.")


def hook_layer(name: str) -> int | None:
    """Block index of a ``blocks.{L}.…`` hook name (None for ``hook_embed``, ``ln_final.…``)."""
    m = _LAYER.match(name)
    return int(m.group(1)) if m else None


def hook_names(model: HookedModel) -> set[str]:
    """Every hook name the model accepts (TransformerLens names and their aliases)."""
    return set(model.hook_dict)


def gated_setting(model: HookedModel, name: str) -> str | None:
    """The ``cfg.use_*`` setting that must be on for hook ``name`` to fire, when it is off."""
    reason: Callable[[str], str | None] | None = getattr(model, "_gated_hook_reason", None)
    if callable(reason):
        return reason(name)
    for suffix, flag in GATES.items():
        if name.endswith(suffix) and not getattr(model.cfg, flag, False):
            return flag
    return None


def check_hooks(model: HookedModel, names: Iterable[str], field: str = "hooks", allow_gated: bool = True) -> list[str]:
    """Check hook names exist on the model (and, with ``allow_gated=False``, that they fire).

    Args:
        model: a hooked model (or a :class:`tracekit.model.ModelInfo`).
        names: TransformerLens hook names.
        field: config field quoted in the error.
        allow_gated: a gated hook is fine when the caller enables it with :func:`enabled_hooks`.

    Returns:
        The names, in order.

    Raises:
        HookError: an unknown name (with the closest known names) or, with ``allow_gated=False``,
            a gated one (naming the setting).
    """
    known = hook_names(model)
    out = []
    for i, n in enumerate(names):
        where = f"{field}[{i}]" if not isinstance(names, str) else field
        if not isinstance(n, str) or n not in known:
            close = difflib.get_close_matches(str(n), sorted(known), n=3, cutoff=0.6)
            n_layers = int(getattr(model.cfg, "n_layers", 0))
            hint = f"; did you mean {close}?" if close else ""
            raise HookError(f"{where}: unknown hook {n!r}{hint} Hook names are TransformerLens' "
                            f"(blocks.L.hook_resid_pre, blocks.L.attn.hook_z, blocks.L.mlp.hook_post, ...; "
                            f"L in 0..{n_layers - 1}).")
        gate = gated_setting(model, n)
        if gate is not None and not allow_gated:
            raise HookError(f"{where}: hook {n!r} never fires while model.cfg.{gate} is False; "
                            f"this step cannot enable it (call model.set_{gate}(True) yourself).")
        out.append(n)
    return out


@contextlib.contextmanager
def enabled_hooks(model: HookedModel, names: Iterable[str]) -> Iterator[list[str]]:
    """Turn on the TransformerLens settings the named hooks need; restore them on exit.

    Yields:
        The settings that were switched on (empty when none was needed).

    Raises:
        HookError: two needed settings are mutually exclusive (``use_attn_in`` and
            ``use_split_qkv_input``).
    """
    needed: list[str] = []
    for n in names:
        g = gated_setting(model, n)
        if g is not None and g not in needed:
            needed.append(g)
    if "use_attn_in" in needed and "use_split_qkv_input" in needed:
        raise HookError("hooks: attn_in and attn.hook_{q,k,v}_input cannot be read in one run (TransformerLens' "
                        "use_attn_in and use_split_qkv_input are mutually exclusive); use separate steps")
    before = {g: bool(getattr(model.cfg, g, False)) for g in needed}
    try:
        for g in needed:
            setter = getattr(model, f"set_{g}", None)
            if setter is None:
                raise HookError(f"hooks: the model cannot enable {g} (no set_{g})")
            setter(True)
        yield needed
    finally:
        for g, v in before.items():
            setter = getattr(model, f"set_{g}", None)
            if setter is not None and bool(getattr(model.cfg, g, False)) != v:
                setter(v)


_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
               "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called")


#: Modules whose hooks are the libraries' own machinery, installed lazily on a model's first forward
#: pass (TransformerLens' bridge wires capture hooks for hook_mlp_in / split-qkv once and remembers it
#: with a flag; transformers installs output recorders): never removed, or those hooks would stop
#: firing silently. User-facing hook points (``transformer_lens.hook_points``) are not in this list.
_INTERNAL = ("transformer_lens.model_bridge", "transformers.")


def _library_internal(fn) -> bool:
    mod = getattr(fn, "__module__", "") or ""
    return mod.startswith(_INTERNAL)


def _snapshot(model: HookedModel) -> dict[str, Any]:
    mods = list(cast(Any, model).modules())  # a loaded bridge's modules
    snap: dict[str, Any] = {
        "hooks": [(m, {d: set(getattr(m, d, {}) or {}) for d in _HOOK_DICTS}) for m in mods],
        "lens": [(m, list(getattr(m, "fwd_hooks", []) or []), list(getattr(m, "bwd_hooks", []) or []))
                 for m in mods if hasattr(m, "fwd_hooks")],
        "training": [(m, m.training) for m in mods],
        "flags": {g: getattr(model.cfg, g, None) for g in sorted(set(GATES.values()))},
    }
    tok = getattr(model, "tokenizer", None)
    if tok is not None:
        snap["padding_side"] = getattr(tok, "padding_side", None)
    return snap


def _restore(model: HookedModel, snap: dict[str, Any]) -> None:
    for m, fwd, bwd in snap["lens"]:
        keep_f, keep_b = {id(h) for h in fwd}, {id(h) for h in bwd}
        for h in list(m.fwd_hooks):
            if id(h) not in keep_f:
                h.hook.remove()
        for h in list(m.bwd_hooks):
            if id(h) not in keep_b:
                h.hook.remove()
        m.fwd_hooks = fwd
        m.bwd_hooks = bwd
    for m, before in snap["hooks"]:
        for d, keys in before.items():
            cur = getattr(m, d, None)
            if not cur:
                continue
            for k in [k for k in cur if k not in keys and not _library_internal(cur[k])]:
                del cur[k]
    for m, training in snap["training"]:
        if m.training != training:
            m.train(training)
    for g, v in snap["flags"].items():
        if v is not None and getattr(model.cfg, g, None) != v:
            setter = getattr(model, f"set_{g}", None)
            if setter is not None:
                setter(v)
    tok = getattr(model, "tokenizer", None)
    if tok is not None and snap.get("padding_side") is not None:
        tok.padding_side = snap["padding_side"]
    ctx = getattr(model, "context_level", None)
    if isinstance(ctx, int) and ctx != 0 and not snap.get("nested"):
        cast(Any, model).context_level = 0  # a bridge's hook nesting level


@contextlib.contextmanager
def state_guard(model: HookedModel) -> Iterator[None]:
    """Restore the model's hooks, gated-hook settings, padding side and train/eval modes on exit.

    Any hook added inside the block (through TransformerLens or directly with
    ``register_forward_hook``) is removed, whatever is raised, ``KeyboardInterrupt`` included;
    hooks that were there before are kept. Nested guards are cheap no-ops.
    """
    if state_of(model).guarded or not hasattr(model, "modules"):
        yield
        return
    snap = _snapshot(model)
    snap["nested"] = getattr(model, "context_level", 0) != 0
    state_of(model).guarded = True
    try:
        yield
    finally:
        state_of(model).guarded = False
        _restore(model, snap)


@contextlib.contextmanager
def fwd_hooks(model: HookedModel, hooks: Iterable[tuple[str, Any]]) -> Iterator[Any]:
    """Add forward hooks by exact hook name for the block, then remove exactly them.

    The same hooks, aliases and removal as TransformerLens' ``model.hooks(fwd_hooks=...)`` for
    string names, but the bridge's hook dictionary is resolved once per call: TransformerLens 3.9
    rebuilds it (with its tens of thousands of aliases, ~8 ms on SmolLM2) once per hook name, which
    made a 31-hook logit-lens batch pay ~0.27 s before any model work. Models without the bridge's
    hook machinery (``HookedTransformer``) go through ``model.hooks``.

    Yields:
        The model.

    Raises:
        Exception: whatever ``check_hooks_to_add`` raises for a hook that cannot be added (as ``model.hooks``).
    """
    hooks = list(hooks)
    if not hasattr(model, "check_hooks_to_add") or not hasattr(model, "compatibility_mode"):
        with model.hooks(fwd_hooks=hooks):
            yield model
        return
    bridge = cast(Any, model)  # a TransformerBridge (it has check_hooks_to_add and compatibility_mode)
    level = bridge.context_level + 1
    added = []
    try:
        bridge.context_level = level
        hd = model.hook_dict
        aliases = hook_alias_map(hd)
        for name, fn in hooks:
            actual = aliases.get(name, name)
            hp = hd.get(actual)
            if hp is None:
                continue  # as model.hooks in TL 3.9: an unknown name adds nothing (callers check names first)
            check_hook_to_add(model, hp, actual, fn)
            if bridge.compatibility_mode and actual != hp.name:
                alias_names = ([hp.name] if hp.name is not None else []) + [actual]
                hp.add_hook(fn, dir="fwd", alias_names=alias_names, level=level)
            else:
                hp.add_hook(fn, dir="fwd", level=level)
            added.append(hp)
        yield model
    finally:
        for hp in added:
            hp.remove_hooks(dir="fwd", level=level)
        bridge.context_level = level - 1

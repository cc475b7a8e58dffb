"""Activation sites: one table from a site's name to its TransformerLens hook and index axes, and
the layer / head / neuron checks every method calls (one wording, one error).

A **site** is a named kind of activation location with one hook per block (docs/glossary.md):

>>> hook("resid_post", 3)
'blocks.3.hook_resid_post'
>>> SITE_TABLE["head_out"].axes
('head',)
>>> hook("final_norm_in")
'ln_final.hook_in'

Hook names are built here (:func:`hook`), not by f-strings across the engines. The checks take a
:class:`~tracekit.core.protocols.HookedModel` (a loaded model or a :class:`tracekit.model.ModelInfo`);
where the model has weights, per-layer widths are read from them (families with per-layer head
counts or MLP widths), else from the config.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union, cast

from .errors import AttentionError, AttributionError, PatchingError, ProbingError
from .protocols import HookedModel

__all__ = ["SiteSpec", "SITE_TABLE", "BLOCK_HOOKS", "hook", "norm_hook", "SiteError", "check_layers", "check_layer",
           "check_heads", "check_neurons", "head_count", "mlp_width", "n_layers"]


@dataclass(frozen=True)
class SiteSpec:
    """A kind of activation location.

    Attributes:
        name: the site's name in configs and tables.
        template: the hook name, ``{layer}`` filled in.
        axes: index axes after ``layer`` (``pos``, ``head``, ``neuron``).
        description: what it is.
    """

    name: str
    template: str
    axes: tuple[str, ...]
    description: str = ""


def _table() -> dict[str, SiteSpec]:
    t: dict[str, SiteSpec] = {}
    for nm in ("resid_pre", "resid_mid", "resid_post"):
        t[nm] = SiteSpec(nm, f"blocks.{{layer}}.hook_{nm}", ("pos",), f"residual stream ({nm}) per layer x position")
    for nm in ("attn_out", "mlp_out"):
        t[nm] = SiteSpec(nm, f"blocks.{{layer}}.hook_{nm}", ("pos",), f"{nm.split('_')[0]} output per layer x position")
    for nm, act in (("head_out", "z"), ("head_q", "q"), ("head_k", "k"), ("head_v", "v")):
        t[nm] = SiteSpec(nm, f"blocks.{{layer}}.attn.hook_{act}", ("head",),
                         f"attention head {act} (hook_{act}), all positions, per layer x head")
    t["head_pattern"] = SiteSpec("head_pattern", "blocks.{layer}.attn.hook_pattern", ("head",),
                                 "attention pattern per layer x head")
    t["head_scores"] = SiteSpec("head_scores", "blocks.{layer}.attn.hook_attn_scores", ("head",),
                                "attention scores (before the softmax) per layer x head")
    for act in ("q", "k", "v"):
        t[f"head_{act}_input"] = SiteSpec(f"head_{act}_input", f"blocks.{{layer}}.attn.hook_{act}_input", ("head",),
                                          f"attention head {act} input (the residual stream read by the {act} "
                                          "projection, before the block's norm), per layer x head")
    t["mlp_in"] = SiteSpec("mlp_in", "blocks.{layer}.hook_mlp_in", ("pos",), "MLP input per layer x position")
    t["neuron"] = SiteSpec("neuron", "blocks.{layer}.mlp.hook_post", ("neuron",),
                           "MLP neuron activation (mlp.hook_post), all positions")
    t["mlp_pre"] = SiteSpec("mlp_pre", "blocks.{layer}.mlp.hook_pre", ("neuron",), "MLP pre-activation")
    # hooks outside the blocks
    t["embed"] = SiteSpec("embed", "hook_embed", ("pos",), "token embedding")
    t["pos_embed"] = SiteSpec("pos_embed", "hook_pos_embed", ("pos",), "learned position embedding")
    t["final_norm_in"] = SiteSpec("final_norm_in", "ln_final.hook_in", ("pos",), "the final norm's input")
    t["final_norm_out"] = SiteSpec("final_norm_out", "ln_final.hook_out", ("pos",), "the final norm's output")
    t["final_norm_scale"] = SiteSpec("final_norm_scale", "ln_final.hook_scale", ("pos",), "the final norm's scale")
    return t


#: Every site tracekit reads or patches: name -> :class:`SiteSpec`.
SITE_TABLE: dict[str, SiteSpec] = _table()
#: The sites with one hook per block that write to or are the residual stream (probing sites).
BLOCK_HOOKS = ("resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out")


def hook(site: str, layer: Optional[int] = None) -> str:
    """The TransformerLens hook name of ``site`` in block ``layer`` (None for the sites outside the
    blocks, ``embed`` / ``final_norm_in`` ...)."""
    return SITE_TABLE[site].template.format(layer=layer)


def norm_hook(layer: int, norm: str, point: str = "hook_scale") -> str:
    """The hook ``point`` of the norm module ``norm`` of block ``layer`` (a module name as a block
    names it, e.g. ``ln2_post`` from :func:`tracekit.model.writepath.write_path`), e.g.
    ``blocks.3.ln2_post.hook_scale``: the norms' names differ by family, so they are not sites.

    >>> norm_hook(3, "ln2_post")
    'blocks.3.ln2_post.hook_scale'
    """
    return f"blocks.{layer}.{norm}.{point}"


class SiteError(AttributionError, AttentionError, PatchingError, ProbingError):
    """A layer, head or neuron that does not exist. One class for every method: it is also each
    method's own error type, so ``except AttributionError`` and ``except PatchingError`` both catch it."""


def n_layers(model: HookedModel | int) -> int:
    """Blocks of a model (or a model config), or ``model`` itself when it is a count."""
    if _is_int(model):
        return int(cast(int, model))
    return int(cast(HookedModel, model).cfg.n_layers)


def _is_int(x: Any) -> bool:
    return not isinstance(x, bool) and hasattr(x, "__index__")


def _items(x: Any) -> list[Any]:
    """An int-like as a one-item list, anything else as the list of its items (checked by the caller)."""
    return [x] if _is_int(x) else list(x)


def check_layers(model: HookedModel | int, layers: Union[str, int, Sequence[int], None],
                 field: str = "layers") -> list[int]:
    """Block indices: ``"all"``/None -> every block; ints checked (negative counts from the end);
    sorted and unique. ``model`` may be a model, a ``ModelInfo`` or the number of blocks.

    Raises:
        SiteError: a layer outside ``[-n_layers, n_layers)`` or not an int, naming the field.
    """
    n = n_layers(model)
    if layers is None or layers == "all":
        return list(range(n))
    if isinstance(layers, str):
        raise SiteError(f"{field}: {layers!r} is not a layer list; give 'all' or block indices like [8, 9]")
    items = _items(layers)
    out = set()
    for i, L in enumerate(items):
        where = f"{field}[{i}]" if not _is_int(layers) else field
        if not _is_int(L) or not -n <= int(L) < n:
            raise SiteError(f"{where}: layer {L!r} out of range for a {n}-layer model (blocks "
                            f"0..{n - 1}, or -{n}..-1 from the end, or 'all')")
        out.add(int(L) % n)
    return sorted(out)


def check_layer(model: HookedModel | int, layer: int, field: str = "layer") -> int:
    """One block index (negative from the end). Raises :class:`SiteError` as :func:`check_layers`."""
    if not _is_int(layer):
        n = n_layers(model)
        raise SiteError(f"{field}: layer {layer!r} out of range for a {n}-layer model (blocks "
                        f"0..{n - 1}, or -{n}..-1 from the end)")
    return check_layers(model, int(layer), field)[0]


def head_count(model: HookedModel, layer: int, kv: bool = False) -> int:
    """Attention heads of block ``layer`` (key/value heads with ``kv``), read from its weights when
    the model has them (families with per-layer head counts), else from the config."""
    blocks = getattr(model, "blocks", None)
    if blocks is not None:
        try:
            W = blocks[int(layer)].attn.W_K if kv else blocks[int(layer)].attn.W_O
            return int(W.shape[0])
        except Exception:  # noqa: BLE001 - attention without per-head weights: the config's count
            pass
    return int(model.cfg.n_key_value_heads or model.cfg.n_heads) if kv else int(model.cfg.n_heads)


def mlp_width(model: HookedModel, layer: int) -> int:
    """Neurons of block ``layer``'s dense MLP (the rows of its ``W_out``; ``cfg.d_mlp`` for a model
    without weights, e.g. a :class:`tracekit.model.ModelInfo`)."""
    blocks = getattr(model, "blocks", None)
    if blocks is not None:
        try:
            return int(blocks[int(layer)].mlp.W_out.shape[0])
        except Exception:  # noqa: BLE001 - absent W_out: the methods refuse the model first
            pass
    return int(getattr(model.cfg, "d_mlp", 0) or 0)


def check_heads(model: HookedModel, heads: Union[str, int, Sequence[int], None], field: str = "heads",
                layer: int = 0, kv: bool = False) -> list[int]:
    """``"all"``/None -> every head of ``layer``; ints checked against its (query, or key/value
    with ``kv``) head count.

    Raises:
        SiteError: a head that does not exist, naming the field.
    """
    n = head_count(model, layer, kv)
    if heads is None or heads == "all":
        return list(range(n))
    items = _items(heads)
    for h in items:
        if not _is_int(h) or not 0 <= int(h) < n:
            what = "key/value" if kv else "(query)"
            raise SiteError(f"{field}: head {h!r} out of range: block {layer} has {n} {what} heads (0..{n - 1})")
    return [int(h) for h in items]


def check_neurons(model: HookedModel, layer: int, neurons: Optional[Sequence[int]],
                  field: str = "neurons") -> list[int]:
    """Neuron indices of block ``layer``'s MLP (None -> every one), checked against its width.

    Raises:
        SiteError: a neuron that does not exist, naming the field and the width.
    """
    width = mlp_width(model, layer)
    if neurons is None:
        return list(range(width))
    bad = [n for n in neurons if not _is_int(n) or not 0 <= int(n) < width]
    if bad:
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise SiteError(f"{field}: neuron {bad[0]}{more} out of range: the MLP of block {layer} has {width} neurons "
                        f"(0..{width - 1})")
    return [int(n) for n in neurons]

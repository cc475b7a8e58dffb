"""Patching sites: which slice of an activation a site is (the *setters*), the :class:`Site` table
built from :data:`tracekit.core.sites.SITE_TABLE`, and the site groups.

Every setter has the signature ``setter(act, rows, index, source, src_rows) -> act``: ``act`` is a
batched activation in TransformerLens' layout (``[batch, pos, ...]``, except attention patterns
``[batch, head, dest_pos, src_pos]``), ``rows`` ``[R]`` the rows of ``act`` written (one per
variant), ``index`` ``{axis: [R]}`` each variant's own position / head / neuron (LongTensors, one
element per row), ``source`` the activation patched in (same layout as ``act``, any batch size) and
``src_rows`` ``[R]`` the row of ``source`` each variant reads. Variant ``i`` writes row ``rows[i]``
from row ``src_rows[i]`` at its own index only; the setter modifies ``act`` in place and returns it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..core.sites import SITE_TABLE
from ..errors import PatchingError

__all__ = [
    "SITES",
    "SITE_GROUPS",
    "Site",
    "expand_sites",
    "layer_head_pattern_setter",
    "layer_head_pos_pattern_setter",
    "layer_head_vector_setter",
    "layer_neuron_setter",
    "layer_pos_head_vector_setter",
    "layer_pos_neuron_setter",
    "layer_pos_setter",
    "layer_setter",
]


def layer_setter(act, rows, index, source, src_rows):
    """Write the whole activation of each variant row: ``act[rows[i]] = source[src_rows[i]]``
    (every position and channel; ``index`` holds only the layer, which the hook already chose).

    ``act`` and ``source`` share their trailing shape (``[pos, ...]``). Returns ``act``, modified in place.
    """
    act[rows] = source[src_rows]
    return act


def layer_pos_setter(act, rows, index, source, src_rows):
    """Write one position per variant: ``act[rows[i], pos[i]] = source[src_rows[i], pos[i]]`` with
    ``pos = index["pos"]``; every other position of the row is left as it was.

    ``act`` is ``[batch, pos, d]`` (residual stream, attention / MLP output). Returns ``act``, modified in place.
    """
    act[rows, index["pos"]] = source[src_rows, index["pos"]]
    return act


def layer_head_vector_setter(act, rows, index, source, src_rows):
    """Write one head at every position per variant:
    ``act[rows[i], :, head[i]] = source[src_rows[i], :, head[i]]`` with ``head = index["head"]``.

    ``act`` is ``[batch, pos, head, d_head]`` (``hook_z``, ``hook_q/k/v``; k/v heads are key/value
    heads under grouped-query attention). Returns ``act``, modified in place.
    """
    act[rows, :, index["head"]] = source[src_rows, :, index["head"]]
    return act


def layer_pos_head_vector_setter(act, rows, index, source, src_rows):
    """Write one head at one position per variant:
    ``act[rows[i], pos[i], head[i]] = source[src_rows[i], pos[i], head[i]]``.

    ``act`` is ``[batch, pos, head, d_head]``. Returns ``act``, modified in place.
    """
    act[rows, index["pos"], index["head"]] = source[src_rows, index["pos"], index["head"]]
    return act


def layer_head_pattern_setter(act, rows, index, source, src_rows):
    """Write one head's whole attention pattern per variant (every destination and source position):
    ``act[rows[i], head[i]] = source[src_rows[i], head[i]]``.

    ``act`` is ``[batch, head, dest_pos, src_pos]`` (``hook_pattern``). Returns ``act``, modified in place.
    """
    act[rows, index["head"]] = source[src_rows, index["head"]]
    return act


def layer_head_pos_pattern_setter(act, rows, index, source, src_rows):
    """Write one row of one head's attention pattern per variant (destination ``pos[i]``, every source
    position): ``act[rows[i], head[i], pos[i]] = source[src_rows[i], head[i], pos[i]]``.

    ``act`` is ``[batch, head, dest_pos, src_pos]``. Returns ``act``, modified in place.
    """
    act[rows, index["head"], index["pos"]] = source[src_rows, index["head"], index["pos"]]
    return act


def layer_neuron_setter(act, rows, index, source, src_rows):
    """Write one MLP neuron at every position per variant:
    ``act[rows[i], :, neuron[i]] = source[src_rows[i], :, neuron[i]]`` with ``neuron = index["neuron"]``.

    ``act`` is ``[batch, pos, d_mlp]`` (``mlp.hook_post``). Returns ``act``, modified in place.
    """
    act[rows, :, index["neuron"]] = source[src_rows, :, index["neuron"]]
    return act


def layer_pos_neuron_setter(act, rows, index, source, src_rows):
    """Write one MLP neuron at one position per variant:
    ``act[rows[i], pos[i], neuron[i]] = source[src_rows[i], pos[i], neuron[i]]``.

    ``act`` is ``[batch, pos, d_mlp]``. Returns ``act``, modified in place.
    """
    act[rows, index["pos"], index["neuron"]] = source[src_rows, index["pos"], index["neuron"]]
    return act


@dataclass(frozen=True)
class Site:
    """A kind of patching site.

    Attributes:
        name: the site's name in configs and tables (``resid_pre``, ``head_out_by_pos``, ...).
        hook: hook-name template, ``{layer}`` filled in.
        axes: index axes after ``layer`` (``pos``, ``head``, ``neuron``).
        setter: the setter function.
        start: ``hook`` (replay from block L, patch in a hook inside it), ``input`` (patch block
            L's input directly: resid_pre) or ``next_input`` (patch block L+1's input: resid_post).
        kv_heads: the head axis counts key/value heads (k, v under grouped-query attention).
        description: what the site is (one line, for tables and docs).
    """

    name: str
    hook: str
    axes: tuple[str, ...]
    setter: Callable
    start: str = "hook"
    kv_heads: bool = False
    description: str = ""

    def hook_name(self, layer: int) -> str:
        """The hook name of this site at block ``layer``."""
        return self.hook.format(layer=layer)

    def start_layer(self, layer: int) -> int:
        """The block a replay of a patch at ``layer`` starts from (``layer + 1`` for ``next_input``)."""
        return layer + 1 if self.start == "next_input" else layer


def _site_table() -> dict[str, Site]:
    """Patching's sites: the sites of :data:`tracekit.core.sites.SITE_TABLE` (hook templates) with
    their setters, plus the ``_by_pos`` (one position) and ``_layer`` (a whole layer) variants."""
    t = SITE_TABLE
    s: dict[str, Site] = {}
    for nm, start in (("resid_pre", "input"), ("resid_mid", "hook"), ("resid_post", "next_input")):
        s[nm] = Site(nm, t[nm].template, ("pos",), layer_pos_setter, start, description=t[nm].description)
        s[nm + "_layer"] = Site(nm + "_layer", t[nm].template, (), layer_setter, start,
                                description=f"the whole {nm} residual stream of a layer (all positions)")
    for nm in ("attn_out", "mlp_out"):
        s[nm] = Site(nm, t[nm].template, ("pos",), layer_pos_setter, description=t[nm].description)
        s[nm + "_layer"] = Site(nm + "_layer", t[nm].template, (), layer_setter,
                                description=f"{nm} of a layer, all positions")
    for nm in ("head_out", "head_q", "head_k", "head_v"):
        kv = nm in ("head_k", "head_v")
        s[nm] = Site(nm, t[nm].template, ("head",), layer_head_vector_setter, kv_heads=kv,
                     description=t[nm].description)
        s[nm + "_by_pos"] = Site(nm + "_by_pos", t[nm].template, ("pos", "head"), layer_pos_head_vector_setter,
                                 kv_heads=kv, description=f"{t[nm].description.split(',')[0]} per layer x position x head")
    s["head_pattern"] = Site("head_pattern", t["head_pattern"].template, ("head",), layer_head_pattern_setter,
                             description=t["head_pattern"].description)
    s["head_pattern_by_pos"] = Site("head_pattern_by_pos", t["head_pattern"].template, ("pos", "head"),
                                    layer_head_pos_pattern_setter,
                                    description="attention pattern row per layer x destination position x head")
    s["neuron"] = Site("neuron", t["neuron"].template, ("neuron",), layer_neuron_setter,
                       description=t["neuron"].description)
    s["neuron_by_pos"] = Site("neuron_by_pos", t["neuron"].template, ("pos", "neuron"), layer_pos_neuron_setter,
                              description="MLP neuron activation per position")
    return s


#: Patching sites by name (see the table in :mod:`tracekit.patching`).
SITES: dict[str, Site] = _site_table()

#: Shorthands expanding to several sites (TransformerLens' ``get_act_patch_*_every``).
SITE_GROUPS: dict[str, list[str]] = {
    "block_every": ["resid_pre", "attn_out", "mlp_out"],
    "resid_every": ["resid_pre", "resid_mid", "resid_post"],
    "heads_every": ["head_out", "head_q", "head_k", "head_v", "head_pattern"],
    "heads_every_by_pos": ["head_out_by_pos", "head_q_by_pos", "head_k_by_pos", "head_v_by_pos",
                           "head_pattern_by_pos"],
}


def expand_sites(names: Sequence[str], field: str = "sites") -> list[str]:
    """Expand group names (``block_every``, ...) and check every site exists.

    Returns:
        The site names, groups expanded, each once, in order of first appearance.

    Raises:
        PatchingError: an unknown site; the message lists the known ones.
    """
    out: list[str] = []
    for i, n in enumerate(names):
        for m in SITE_GROUPS.get(n, [n]):
            if m not in SITES:
                raise PatchingError(
                    f"{field}[{i}]: unknown site {n!r}; use one of {sorted(SITES)} or a group {sorted(SITE_GROUPS)}"
                )
            if m not in out:
                out.append(m)
    return out

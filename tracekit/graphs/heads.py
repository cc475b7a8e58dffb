"""Attention in the attribution graph: edges split by head (OV) and attention scores split by node (QK).

An edge of an attribution graph is a direct effect in the local replacement model
(:class:`tracekit.graphs.replacement.LocalReplacementModel`: attention patterns and norm scales
frozen, MLPs replaced by transcoders with their errors held fixed), so it is a sum over paths made of
the residual stream and attention heads (OV circuits). circuit-tracer reports the edge only; here
attention is opened up (Ameisen et al. 2025 leave this to "attention attribution"; Kamath et al.
2025, "Tracing Attention Computation Through Attribution Graphs", do the QK side).

**OV: split by the last head on the path** (:func:`split_edges_by_head`). Let ``T`` be the target's
input (a feature's pre-activation, or the demeaned pre-transform logit) and ``g = dT / dr`` its read
vector on the residual stream ``r`` at the target's read site and position ``p_t`` (the frozen norm's
adjoint applied to the encoder column or the demeaned unembedding column). Every path from the source
to the target ends either in the residual stream at ``p_t`` (the source's own write, when the source
sits at ``p_t``) or in the output of one attention head ``h`` of a block between the source and the
target, written at ``p_t``. So

    edge = g . w_s [p_s == p_t]  +  sum_h  g . Delta o_h[p_t]

where ``w_s`` is the source's write and ``Delta o_h[p_t] = J_h w_s`` the total linear effect of the
source on head ``h``'s output at ``p_t`` in the frozen model (``o_h = z_h W_O[h]``; other heads and
the residual stream upstream of ``h`` included). A skip transcoder's skip term ``W_skip x`` is a
linear path too: a block's skip term at ``p_t`` is a last component like a head (``LxSKIP``). ``loading_h = g . J_h w_s`` is computed as a
gradient: one backward pass over a batch with one row per head, row ``h`` differentiating
``g . o_h[p_t]`` with respect to every source write. The loadings and the residual term sum to the
edge exactly (linear algebra, no approximation); grouped-query heads are named by their query head
(``LxHy``, ``y`` the query head). Blocks whose attention output is normalised before it reaches the
residual stream (a post-attention norm: Gemma 2/3) are refused: there the head's write is not
``o_h``.

**QK: the attention score split by node** (:func:`qk_attribution`). In the frozen model a head's
query at ``q`` and key at ``k`` are affine in the source writes (frozen norm, ``W_Q`` / ``W_K``,
biases, rotary embedding: all linear at fixed positions), so the score ``s = q . k / sqrt(d_head)``
is bilinear. Query side: ``s = sum_n (q_n . k) / sqrt(d_head) + (q_0 . k) / sqrt(d_head)``, where
``q_n`` is node ``n``'s part of the query (its write pushed through the frozen model, norm, ``W_Q``
and rotary) and ``q_0`` the query with every node write removed (biases, positional embeddings,
decoder biases: the ``bias`` row); key side the same with the roles swapped (the full query dotted
with each node's key part). Each side sums to the score exactly. Nodes are the graph's feature nodes,
its error nodes, its token nodes, and active features that are not graph nodes (``node_type``
``other``, when the graph was built with a feature budget).

Source: Ameisen et al. 2025, "Circuit Tracing" (methods; the local replacement model); Kamath et al.
2025, "Tracing Attention Computation Through Attribution Graphs" (QK attributions); Elhage et al.
2021 (OV and QK circuits).
"""

from __future__ import annotations

import re
from typing import Any, Optional, Sequence

import pandas as pd
import torch

from ..core.budget import chunk_rows
from ..core.errors import ConfigError, MethodRefused
from ..dictionaries.dictionary import DictionarySet
from ..hooks import state_guard
from ..model.info import HookedModel
from .attribution import backward_row_bytes
from .graph import AttributionGraph
from .replacement import LocalReplacementModel

__all__ = ["node_label", "parse_head", "qk_attribution", "split_edges_by_head"]

_HEAD = re.compile(r"^L(\d+)H(\d+)$")


def parse_head(name: str) -> tuple[int, int]:
    """``"L3H5"`` -> ``(3, 5)`` (layer, query head). Raises ConfigError: not of that form."""
    m = _HEAD.match(str(name).strip())
    if not m:
        raise ConfigError(f"head {name!r} is not of the form 'LxHy' (layer x, query head y), e.g. 'L2H1'")
    return int(m.group(1)), int(m.group(2))


def node_label(graph: AttributionGraph, i: int) -> str:
    """A short name of node ``i``: ``F{layer}.{feature}@{pos}``, ``E{layer}@{pos}``, ``T@{pos}``,
    ``logit:{token}``. Raises IndexError: out of range."""
    kind = graph.node_type(i)
    if kind == "feature":
        L, p, f = graph.features[i].tolist()
        return f"F{L}.{f}@{p}"
    if kind == "error":
        j = i - graph.error_offset
        return f"E{j // graph.n_pos}@{j % graph.n_pos}"
    if kind == "token":
        return f"T@{i - graph.token_offset}"
    return f"logit:{graph.logit_tokens[i - graph.logit_offset]!r}"


# -- shared machinery ------------------------------------------------------------------------
def _check_model(model: HookedModel, lrm: LocalReplacementModel) -> None:
    post = [s.name for s in lrm.norms if re.search(r"ln1_post|post_attention|attn_post", s.name)]
    if post:
        raise MethodRefused(f"attention heads in the graph: blocks with a post-attention norm ({post[:3]}...) write "
                            "a normalised attention output, not the heads' o_h; this split is not defined there")


def _lrm(model: HookedModel, dictionaries: DictionarySet, graph: AttributionGraph,
         replacement: Optional[LocalReplacementModel]) -> LocalReplacementModel:
    lrm = replacement if replacement is not None else LocalReplacementModel(model, dictionaries, graph.token_ids)
    if lrm.n_pos != graph.n_pos or not torch.equal(lrm.tokens[0].cpu(), graph.token_ids.cpu()):
        raise ConfigError("the replacement model was built on other tokens than the graph's")
    _check_model(model, lrm)
    return lrm


def _source_site(graph: AttributionGraph, lrm: LocalReplacementModel, s: int) -> tuple[Any, int, torch.Tensor, int]:
    """(leaf key, position, write vector, layer the write enters after: -1 for tokens) of source node ``s``."""
    kind = graph.node_type(s)
    if kind in ("error", "token") and graph.settings.get("bos_zeroed") and (
            (s - graph.error_offset) % graph.n_pos == 0 if kind == "error" else s == graph.token_offset):
        raise ConfigError(f"source {node_label(graph, s)} sits at the BOS position, which the graph leaves out "
                          "(zero_bos): its edges are 0 by construction; build the graph with zero_bos=False to split them")
    if kind == "feature":
        L, p, f = graph.features[s].tolist()
        d = lrm.dicts[L]
        return L, p, (graph.activations[s].float().to(lrm.device) * d.W_dec.detach()[f].float()), L
    if kind == "error":
        j = s - graph.error_offset
        L, p = j // graph.n_pos, j % graph.n_pos
        return L, p, lrm.errors[L][p].float(), L
    if kind == "token":
        p = s - graph.token_offset
        return "tokens", p, lrm.embed[p].float(), -1
    raise ConfigError(f"node {s} ({node_label(graph, s)}) is a logit node: it is never an edge's source")


def _read_vector(graph: AttributionGraph, lrm: LocalReplacementModel, t: int) -> tuple[torch.Tensor, int, int]:
    """(g [d_model] float32, position, layer of the read: n_layers for logits) of target node ``t``:
    ``dT/dr`` on the residual stream at the target's read site (module docstring)."""
    kind = graph.node_type(t)
    model: Any = lrm.model
    if kind == "feature":
        L, p, f = graph.features[t].tolist()
        d = lrm.dicts[L]
        u = d.W_enc.detach()[:, f].float()
        site = None
        if lrm.read_hooks[L].endswith("mlp.hook_in"):
            site = next((s for s in lrm.norms if s.name == f"blocks.{L}.ln2"), None)
            if site is None:
                raise MethodRefused(f"block {L}: the transcoder reads after a norm that is not blocks.{L}.ln2")
        layer = L
    elif kind == "logit":
        p = graph.n_pos - 1
        tid = int(graph.logit_ids[t - graph.logit_offset])
        W_U = model.W_U.detach().float()
        u = W_U[:, tid] - W_U.mean(1)
        site = next(s for s in lrm.norms if s.name == "ln_final")
        layer = lrm.n_layers
    else:
        raise ConfigError(f"node {t} ({node_label(graph, t)}) is a {kind} node: it has no inputs, so no edge ends there")
    u = u.to(lrm.device)
    if site is None:
        return u, p, layer
    v = torch.zeros(1, lrm.n_pos, u.shape[0], device=lrm.device, requires_grad=True)
    with torch.enable_grad():
        (g,) = torch.autograd.grad((site.linear(v)[0, p].float() * u).sum(), v)
    return g[0, p].detach(), p, layer


def _W_O(lrm: LocalReplacementModel, layer: int) -> torch.Tensor:
    W = getattr(lrm.model.blocks[layer].attn, "W_O", None)
    if W is None:
        raise MethodRefused(f"block {layer}'s attention exposes no W_O [heads, d_head, d_model]; heads cannot be split")
    return W.detach()


def _chunk(model: HookedModel, n_pos: int, n: int, what: str) -> int:
    return chunk_rows(backward_row_bytes(model, n_pos), n, what=what, unit="backward row",
                      fix="name fewer heads or edges")


# -- OV: split by head --------------------------------------------------------------------------
def split_edges_by_head(model: HookedModel, dictionaries: DictionarySet, graph: AttributionGraph,
                        edges: Sequence[tuple[int, int]], *,
                        replacement: Optional[LocalReplacementModel] = None) -> pd.DataFrame:
    """Each edge ``(target, source)`` split by the last attention head on its paths (module docstring).

    Args:
        model: the model the graph was built on.
        dictionaries: its transcoder set.
        graph: the graph (its adjacency gives each edge's value; its nodes name target and source).
        edges: ``[(target node, source node)]`` indices into the graph's node order.
        replacement: the prompt's local replacement model (built when not given).

    Returns:
        One row per edge and component: ``target, source, target_label, source_label, component``
        (``LxHy``, ``LxSKIP`` (a skip transcoder's skip term) or ``resid``), ``layer, head`` (``-1`` for ``resid``), ``loading`` (target units:
        feature pre-activation or demeaned logit), ``edge`` (the graph's ``adjacency[target,
        source]``), ``share`` (``loading / edge``). Heads in blocks the source cannot reach (at or
        before the source's layer) are left out: their loading is exactly 0. Per edge the loadings
        sum to the edge (to float error).

    Raises:
        ConfigError: a target that is a token or error node, a source that is a logit node or a
            node at the BOS position of a graph built with ``zero_bos`` (its edges are 0 by construction).
        MethodRefused: an architecture with post-attention norms or without ``W_O``; what the
            replacement model refuses.
        MemoryBudgetError: one backward row does not fit the budget.
    """
    lrm = _lrm(model, dictionaries, graph, replacement)
    H = int(model.cfg.n_heads)
    by_target: dict[int, list[int]] = {}
    for t, s in edges:
        by_target.setdefault(int(t), []).append(int(s))
    records = []
    for t, sources in by_target.items():
        g, p_t, L_t = _read_vector(graph, lrm, t)
        sites = [_source_site(graph, lrm, s) for s in sources]
        first = min(site[3] for site in sites) + 1
        last = L_t if graph.node_type(t) == "feature" else lrm.n_layers - 1
        heads = [(layer, h) for layer in range(max(first, 0), last + 1) for h in range(H)]
        heads += [(layer, -1) for layer in range(max(first, 0), min(last, L_t - 1) + 1)
                  if lrm.dicts[layer].W_skip is not None]  # skip terms (h = -1)
        loads = torch.zeros(len(heads), len(sources), dtype=torch.float64)
        chunk = _chunk(model, graph.n_pos, len(heads), "edge split by head")
        for start in range(0, len(heads), chunk):
            rows = heads[start:start + chunk]
            loads[start:start + len(rows)] = _head_loadings(lrm, rows, g, p_t, sites)
        for j, s in enumerate(sources):
            key, p_s, w, _ = sites[j]
            edge = float(graph.adjacency[t, s])
            base = {"target": t, "source": s, "target_label": node_label(graph, t),
                    "source_label": node_label(graph, s), "edge": edge}
            direct = float(g.double() @ w.double()) if p_s == p_t else 0.0
            records.append({**base, "component": "resid", "layer": -1, "head": -1, "loading": direct})
            for i, (layer, h) in enumerate(heads):
                if layer > sites[j][3]:
                    records.append({**base, "component": f"L{layer}H{h}" if h >= 0 else f"L{layer}SKIP",
                                    "layer": layer, "head": h,
                                    "loading": float(loads[i, j])})
    df = pd.DataFrame(records, columns=["target", "source", "target_label", "source_label", "component", "layer",
                                        "head", "loading", "edge"])
    df["share"] = df["loading"] / df["edge"].where(df["edge"] != 0)
    return df


def _head_loadings(lrm: LocalReplacementModel, heads: list[tuple[int, int]], g: torch.Tensor, p_t: int,
                   sites: list[tuple[Any, int, torch.Tensor, int]]) -> torch.Tensor:
    """``[rows, sources]``: ``g . J_h w_s`` for each head row and source (one batched backward)."""
    B = len(heads)
    zs: dict[int, torch.Tensor] = {}
    layers = sorted({layer for layer, _ in heads})

    def grab(L):
        def fn(act, hook):
            zs[L] = act
            return act
        return fn

    extra = [(f"blocks.{L}.attn.hook_z", grab(L)) for L in layers if any(h >= 0 for ll, h in heads if ll == L)]
    with state_guard(lrm.model):
        run = lrm.run(batch=B, grad=True, stop_at_final=True, extra_hooks=extra)
        total = torch.zeros((), dtype=torch.float32, device=lrm.device)
        for b, (layer, h) in enumerate(heads):
            if h < 0:  # the skip term of block `layer`
                W_skip = lrm.dicts[layer].W_skip
                assert W_skip is not None
                o = run.reads[layer][b, p_t].float() @ W_skip.detach().float().T
            else:
                o = zs[layer][b, p_t, h].float() @ _W_O(lrm, layer)[h].float()
            total = total + o @ g
        keys = list(dict.fromkeys(site[0] for site in sites))
        leaves = [run.leaves[k] for k in keys]
        grads = torch.autograd.grad(total, leaves, allow_unused=True)
    gmap = {k: gr for k, gr in zip(keys, grads)}
    out = torch.zeros(B, len(sites), dtype=torch.float64)
    for j, (key, p_s, w, _) in enumerate(sites):
        gr = gmap[key]
        if gr is not None:
            out[:, j] = (gr[:, p_s].double() @ w.double().to(gr.device)).cpu()
    return out


# -- QK: attention scores split by node ------------------------------------------------------------
def qk_attribution(model: HookedModel, dictionaries: DictionarySet, graph: AttributionGraph,
                   heads: Sequence[str], query_pos: int = -1, key_pos: Optional[int | Sequence[int]] = None, *,
                   replacement: Optional[LocalReplacementModel] = None) -> pd.DataFrame:
    """A named head's attention score at (query, key) split into node contributions (module docstring).

    Args:
        model: the model the graph was built on.
        dictionaries: its transcoder set.
        graph: the graph (its nodes are the contributions' names).
        heads: ``["LxHy", ...]`` (query heads).
        query_pos: the query position (negative counts from the end; default the last).
        key_pos: a key position, several, or ``None`` for every key ``<= query_pos``.
        replacement: the prompt's local replacement model (built when not given).

    Returns:
        One row per (head, key, side, part): ``head, layer, head_idx, query_pos, key_pos, side``
        (``query`` | ``key``), ``node`` (graph node index; -1 for ``bias``, -1 for ``other``),
        ``node_label``, ``node_type`` (``feature`` | ``error`` | ``token`` | ``other`` | ``bias``),
        ``node_layer, node_pos``, ``contribution`` (score units), ``score`` (the clean score);
        per (head, key, side) the contributions sum to the score (to float error). Exactly zero
        contributions (nodes after the query or key position, or in later blocks) are left out.

    Raises:
        ConfigError: a malformed head name, a head or position out of range.
        MethodRefused: the model's scores are not ``q . k / sqrt(d_head)`` of its ``hook_q`` /
            ``hook_k`` (or rotary ``hook_rot_q`` / ``hook_rot_k``); what the replacement model refuses.
        MemoryBudgetError: one backward row does not fit the budget.
    """
    lrm = _lrm(model, dictionaries, graph, replacement)
    n_pos, H = graph.n_pos, int(model.cfg.n_heads)
    qp = query_pos + n_pos if query_pos < 0 else query_pos
    if not 0 <= qp < n_pos:
        raise ConfigError(f"query_pos {query_pos} outside the prompt's {n_pos} positions")
    keys = list(range(qp + 1)) if key_pos is None else [key_pos] if isinstance(key_pos, int) else list(key_pos)
    keys = [k + n_pos if k < 0 else k for k in keys]
    if any(not 0 <= k <= qp for k in keys):
        raise ConfigError(f"key positions {keys} must lie in 0..{qp} (the query position; attention is causal)")
    parsed = [parse_head(h) for h in heads]
    for (layer, h), name in zip(parsed, heads):
        if not (0 <= layer < lrm.n_layers and 0 <= h < H):
            raise ConfigError(f"head {name}: the model has {lrm.n_layers} layers of {H} query heads")
    q_hook, k_hook = _qk_hooks(model)
    clean = _qk_values(lrm, sorted({layer for layer, _ in parsed}), q_hook, k_hook)
    d_head = int(clean[parsed[0][0]][0].shape[-1])
    scale = _check_scale(lrm, clean, parsed, qp, keys, d_head)

    nodes = _nodes(graph, lrm)
    rows = [(name, layer, h, k, side) for name, (layer, h) in zip(heads, parsed) for k in keys
            for side in ("query", "key")]
    store: dict[int, list] = {}  # q and k with every node write removed (the bias parts)
    lrm.run(batch=1, stop_at_final=True, token_scale=torch.zeros(n_pos), error_scale=torch.zeros(lrm.n_layers, n_pos),
            feature_scale={L: torch.zeros(len(lrm.active[L].acts)) for L in lrm.active},
            extra_hooks=_grab_qk(sorted({layer for layer, _ in parsed}), q_hook, k_hook, store))
    records = []
    chunk = _chunk(model, n_pos, len(rows), "QK attribution")
    for start in range(0, len(rows), chunk):
        part = rows[start:start + chunk]
        contrib = _qk_contributions(lrm, part, qp, clean, scale, q_hook, k_hook, nodes)
        for r, (name, layer, h, k, side) in enumerate(part):
            qc, kc = clean[layer]
            G = H // kc.shape[2]
            q_full, k_full = qc[0, qp, h].double(), kc[0, k, h // G].double()
            score = float(q_full @ k_full) / scale
            q0, k0 = store[layer]
            bias = (float(q0[0, qp, h].double() @ k_full) if side == "query"
                    else float(q_full @ k0[0, k, h // G].double())) / scale
            base = {"head": name, "layer": layer, "head_idx": h, "query_pos": qp, "key_pos": k, "side": side,
                    "score": score}
            for (n, label, kind, nl, npos, _), c in zip(nodes, contrib[r].tolist()):
                if c != 0.0:
                    records.append({**base, "node": n, "node_label": label, "node_type": kind, "node_layer": nl,
                                    "node_pos": npos, "contribution": c})
            records.append({**base, "node": -1, "node_label": "bias", "node_type": "bias", "node_layer": -1,
                            "node_pos": -1, "contribution": bias})
    return pd.DataFrame(records, columns=["head", "layer", "head_idx", "query_pos", "key_pos", "side", "node",
                                          "node_label", "node_type", "node_layer", "node_pos", "contribution",
                                          "score"])


def _qk_hooks(model: HookedModel) -> tuple[str, str]:
    hd = model.hook_dict
    if "blocks.0.attn.hook_rot_q" in hd and "blocks.0.attn.hook_rot_k" in hd:
        return "hook_rot_q", "hook_rot_k"
    return "hook_q", "hook_k"


def _grab_qk(layers: list[int], q_hook: str, k_hook: str, store: dict) -> list:
    def grab(L, which):
        def fn(act, hook):
            cur = store.setdefault(L, [None, None])
            cur[which] = act
            return act
        return fn
    out = []
    for L in layers:
        out += [(f"blocks.{L}.attn.{q_hook}", grab(L, 0)), (f"blocks.{L}.attn.{k_hook}", grab(L, 1))]
    return out


def _qk_values(lrm: LocalReplacementModel, layers: list[int], q_hook: str, k_hook: str) -> dict[int, list]:
    store: dict[int, list] = {}
    lrm.run(batch=1, stop_at_final=True, extra_hooks=_grab_qk(layers, q_hook, k_hook, store))
    missing = [L for L in layers if L not in store or store[L][0] is None or store[L][1] is None]
    if missing:
        raise MethodRefused(f"blocks {missing}: attn.{q_hook} / attn.{k_hook} did not fire; the QK split needs them")
    return {L: [store[L][0].detach(), store[L][1].detach()] for L in layers}


def _check_scale(lrm: LocalReplacementModel, clean: dict, parsed: list[tuple[int, int]], qp: int, keys: list[int],
                 d_head: int) -> float:
    """sqrt(d_head), checked against the model's own ``hook_attn_scores`` in the frozen clean run."""
    scores: dict[int, torch.Tensor] = {}

    def grab(L):
        def fn(act, hook):
            scores[L] = act.detach()
            return act
        return fn

    layers = sorted({layer for layer, _ in parsed})
    lrm.run(batch=1, stop_at_final=True, extra_hooks=[(f"blocks.{L}.attn.hook_attn_scores", grab(L)) for L in layers])
    scale = float(d_head) ** 0.5
    for layer, h in parsed:
        if layer not in scores:
            raise MethodRefused(f"block {layer}: attn.hook_attn_scores did not fire; the score cannot be checked")
        qc, kc = clean[layer]
        G = qc.shape[2] // kc.shape[2]
        for k in keys:
            mine = float(qc[0, qp, h].double() @ kc[0, k, h // G].double()) / scale
            theirs = float(scores[layer][0, h, qp, k])
            if abs(mine - theirs) > 1e-4 * max(1.0, abs(theirs)):
                raise MethodRefused(f"head L{layer}H{h}: the model's attention score {theirs:.6g} is not q.k/sqrt(d_head) "
                                    f"= {mine:.6g} (a soft-cap, a scale or a positional bias); the QK split assumes it is")
    return scale


def _nodes(graph: AttributionGraph, lrm: LocalReplacementModel) -> list[tuple[int, str, str, int, int, int]]:
    """(node index or -1, label, type, layer, position, index among the layer's active features or -1)
    of every write: the graph's feature, error and
    token nodes, plus active features that are not graph nodes."""
    out = []
    feats = {tuple(r): i for i, r in enumerate(graph.features.tolist())}
    for L in range(lrm.n_layers):
        af = lrm.active[L]
        for a, (p, f) in enumerate(zip(af.pos.tolist(), af.feat.tolist())):
            i = feats.get((L, p, f))
            out.append((i if i is not None else -1, f"F{L}.{f}@{p}", "feature" if i is not None else "other", L, p, a))
    for L in range(lrm.n_layers):
        for p in range(graph.n_pos):
            out.append((graph.error_index(L, p), f"E{L}@{p}", "error", L, p, -1))
    for p in range(graph.n_pos):
        out.append((graph.token_index(p), f"T@{p}", "token", -1, p, -1))
    return out


def _qk_contributions(lrm: LocalReplacementModel, rows: list, qp: int, clean: dict, scale: float, q_hook: str,
                      k_hook: str, nodes: list) -> torch.Tensor:
    """``[rows, nodes]`` float64 contributions of every write to each row's side of the score."""
    B = len(rows)
    store: dict[int, list] = {}
    layers = sorted({r[1] for r in rows})
    with state_guard(lrm.model):
        run = lrm.run(batch=B, grad=True, stop_at_final=True, extra_hooks=_grab_qk(layers, q_hook, k_hook, store))
        total = torch.zeros((), dtype=torch.float32, device=lrm.device)
        for b, (_, layer, h, k, side) in enumerate(rows):
            q_live, k_live = store[layer]
            qc, kc = clean[layer]
            G = qc.shape[2] // kc.shape[2]
            if side == "query":
                total = total + (q_live[b, qp, h].float() @ kc[0, k, h // G].float()) / scale
            else:
                total = total + (qc[0, qp, h].float() @ k_live[b, k, h // G].float()) / scale
        keys = list(run.leaves)
        grads = dict(zip(keys, torch.autograd.grad(total, [run.leaves[k] for k in keys], allow_unused=True)))
    out = torch.zeros(B, len(nodes), dtype=torch.float64)
    # group the writes by (leaf, position): one [B, d] @ [d, n] product per group
    groups: dict[tuple[Any, int], list[int]] = {}
    for j, (_, _, kind, L, p, _a) in enumerate(nodes):
        groups.setdefault(("tokens" if kind == "token" else L, p), []).append(j)
    for (key, p), js in groups.items():
        gr = grads.get(key)
        if gr is None:
            continue
        vecs = []
        for j in js:
            _, _, kind, L, _, a = nodes[j]
            if kind == "token":
                vecs.append(lrm.embed[p].float())
            elif kind == "error":
                vecs.append(lrm.errors[L][p].float())
            else:
                af = lrm.active[L]
                vecs.append(af.acts[a].float() * lrm.dicts[L].W_dec.detach()[int(af.feat[a])].float())
        W = torch.stack(vecs).to(gr.device).double()  # [n, d]
        out[:, js] = (gr[:, p].double() @ W.T).cpu()
    return out


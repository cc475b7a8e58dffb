"""Verification of an attribution graph by intervention: does the graph predict what the model does?

For the top-``k`` feature nodes by influence (:func:`tracekit.graphs.prune.compute_node_influence`)
and a seeded random sample of the other feature nodes, :func:`verify_graph` sets the feature's
activation at its position to ``scale * activation`` (``mode="ablate"``: ``scale = 0``) in the
**real model**, one intervention per batch row, and measures the change of the target metric; the
graph's prediction of the same change is the linear propagation of that change through the
adjacency. The two are compared with the circuit kinds' verification summary
(:func:`tracekit.circuits.verification.compare`: Pearson, Spearman, sign agreement, largest misses).

**The intervened run** (Ameisen et al. 2025, "Circuit Tracing", section "Validating with
interventions": error nodes held fixed): every MLP output (each dictionary's ``hook_out``) is
replaced by its transcoder's output on the run's own MLP input (``hook_in``) plus the clean run's
error vector ``mlp_out(clean) - transcoder(mlp_in(clean))``; the intervened feature's activation is
overwritten at its position. Everything else is the model's own computation: attention patterns,
normalisation scales and every downstream transcoder's features are recomputed from the intervened
inputs (the full nonlinearity). The baseline is the same run without an intervention (it reproduces
the clean logits up to float error: reported as ``baseline_max_abs_logit_error``); ``measured`` is
the metric of the intervened run minus the baseline's.

**The metric**: the logit difference ``logit[target] - logit[foil]`` at the last position when
``graph.target`` has a ``foil_id``, else the demeaned target logit ``logit[target] - mean(logits)``
(the logit nodes' own units).

**The prediction** (the exact rule): with ``A = graph.adjacency`` (``[target, source]``, feature
columns already multiplied by the source's activation ``a``), the per-unit weights are
``W[:, s] = A[:, s] / a_s`` for feature sources (error, token and logit columns never change in an
intervention). The intervention is the activation change ``e = (scale - 1) a_s`` at node ``s``; the
graph linearises every downstream feature's activation with slope 1 in its pre-activation (an
active ReLU / JumpReLU / TopK feature), so the change of every node is

    Delta = (I - W)^-1 e = e + W e + W^2 e + ...    (a finite sum: W is nilpotent)

and the prediction is ``Delta[target logit node] - Delta[foil logit node]`` (or
``Delta[target logit node]``). Features that are not graph nodes are held at their clean values in
this prediction. Where the model is linear (the frozen local replacement model with the active set
held fixed) prediction and measurement agree to float error; in the real model the gap is what the
graph misses (attention and norms that move, features switching on or off).

Source: Ameisen et al. 2025 (methods, "Validating with interventions"); circuit-tracer
``circuit_tracer/replacement_model.py`` (``feature_intervention`` with ``constrained_layers``
holding errors fixed).

**The frozen check** (``frozen`` column): the same intervention in the frozen local replacement
model (:class:`tracekit.graphs.replacement.LocalReplacementModel`) with the graph's features
linearised (:func:`frozen_changes`), where the graph is exact: ``frozen`` equals ``predicted`` to
float error on every checked node, so a gap between ``predicted`` and ``measured`` is the model's
nonlinearity, not a bug in the graph (``frozen_max_abs_miss`` says how exact).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import numpy as np
import torch
from jaxtyping import Float, Int

from ..circuits.verification import choose_checked, compare
from ..core.budget import chunk_rows
from ..core.errors import ConfigError, MethodRefused
from ..dictionaries.dictionary import DictionarySet
from ..hooks import fwd_hooks, state_guard
from ..model.info import HookedModel
from ..model.readout import forward_row_bytes
from .graph import AttributionGraph
from .prune import compute_node_influence, graph_scores, prune_graph
from .replacement import LocalReplacementModel

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["MODES", "TABLE_COLUMNS", "clean_errors", "frozen_changes", "verification_frame", "intervened_metric", "predict_changes", "target_metric",
           "verify_graph"]

#: Interventions :func:`verify_graph` runs.
MODES = ("ablate", "scale")
#: Columns of the intervention table (:func:`verification_frame`), one row per checked feature node.
TABLE_COLUMNS = ("node", "layer", "pos", "feature", "activation", "influence", "influence_rank", "checked_as",
                 "predicted", "frozen", "measured", "miss")


def verification_frame(result: dict[str, Any]) -> "pd.DataFrame":
    """The intervention table of a :func:`verify_graph` result as a DataFrame (columns
    :data:`TABLE_COLUMNS`, ordered by influence rank). Raises KeyError: not a verify_graph result."""
    import pandas as pd

    rows = result["intervention"]["table"]
    df = pd.DataFrame(rows, columns=list(TABLE_COLUMNS))
    return df.sort_values("influence_rank", kind="stable").reset_index(drop=True)


def target_metric(graph: AttributionGraph, logits: Float[torch.Tensor, "batch d_vocab"]) -> Float[torch.Tensor, " batch"]:
    """The verification metric of last-position logits (module docstring).

    Raises:
        ConfigError: ``graph.target`` has no ``id``.
    """
    tid = graph.target.get("id")
    if tid is None:
        raise ConfigError("graph.target has no 'id': build the graph with a target token to verify it")
    logits = logits.float()
    foil = graph.target.get("foil_id")
    if foil is not None:
        return logits[:, int(tid)] - logits[:, int(foil)]
    return logits[:, int(tid)] - logits.mean(-1)


def _target_nodes(graph: AttributionGraph) -> tuple[int, Optional[int]]:
    ids = graph.logit_ids.tolist()
    tid = graph.target.get("id")
    if tid is None:
        raise ConfigError("graph.target has no 'id': build the graph with a target token to verify it")
    foil = graph.target.get("foil_id")
    missing = [t for t in (tid, foil) if t is not None and int(t) not in ids]
    if missing:
        raise MethodRefused(f"the graph's logit nodes {ids} do not include the target/foil ids {missing}: the "
                            "prediction reads their rows of the adjacency; build the graph with target= (and foil=)")
    t_node = graph.logit_offset + ids.index(int(tid))
    f_node = graph.logit_offset + ids.index(int(foil)) if foil is not None else None
    return t_node, f_node


def predict_changes(graph: AttributionGraph, nodes: Int[torch.Tensor, " k"],
                    deltas: Float[torch.Tensor, " k"]) -> Float[torch.Tensor, " k"]:
    """The graph's prediction of the metric's change when feature node ``nodes[i]``'s activation
    changes by ``deltas[i]`` (one intervention per entry; module docstring, "The prediction").

    Args:
        graph: the unpruned graph (with the target, and foil, among its logit nodes).
        nodes: ``[k]`` feature node indices.
        deltas: ``[k]`` activation changes (feature units).

    Returns:
        ``[k]`` float64 predicted changes of the metric (logit units), computed in the adjacency's
        dtype on its device (``k`` columns at a time: no copy of the adjacency).

    Raises:
        MethodRefused: the target or foil is not a logit node.
        ValueError: a node is not a feature node; the adjacency is not acyclic.
    """
    t_node, f_node = _target_nodes(graph)
    nodes = torch.as_tensor(nodes, dtype=torch.long)
    if len(nodes) and (nodes.min() < 0 or nodes.max() >= graph.n_features):
        raise ValueError("predict_changes: every node must be a feature node (index < n_features)")
    A = graph.adjacency  # views only: no copy of the [n_nodes, n_nodes] matrix
    nf, dev = graph.n_features, graph.adjacency.device
    act = graph.activations.to(device=dev, dtype=A.dtype)
    inv = torch.where(act == 0, torch.zeros_like(act), 1.0 / torch.where(act == 0, torch.ones_like(act), act))
    A_ff, A_lf = A[:nf, :nf], A[graph.logit_offset:, :nf]  # feature <- feature, logit <- feature
    E = torch.zeros(nf, len(nodes), dtype=A.dtype, device=dev)
    E[nodes.to(dev), torch.arange(len(nodes), device=dev)] = deltas.to(device=dev, dtype=A.dtype)
    total, cur = E.clone(), E
    for _ in range(nf + 1):
        cur = A_ff @ (cur * inv[:, None])  # W = A / a_source: per unit of the source's activation
        if not cur.any():
            break
        total += cur
    else:
        raise ValueError("predict_changes: the feature adjacency is not acyclic")
    dl = (A_lf @ (total * inv[:, None])).double()  # [n_logits, k]
    out = dl[t_node - graph.logit_offset]
    if f_node is not None:
        out = out - dl[f_node - graph.logit_offset]
    return out.cpu()


def frozen_changes(model: HookedModel, dictionaries: DictionarySet, graph: AttributionGraph,
                   nodes: Int[torch.Tensor, " k"], factor: float, *,
                   replacement: Optional[LocalReplacementModel] = None,
                   batch_size: Optional[int] = None) -> Float[torch.Tensor, " k"]:
    """The metric's change when each feature node's activation is set to ``factor * activation`` in
    the **frozen local replacement model** with every graph feature linearised (its activation moves
    one for one with its pre-activation; active features that are not nodes keep their clean
    activation): the model in which the graph is exact, so this equals :func:`predict_changes` to
    float error. The metric reads the pre-transform logits (the logit nodes' units).

    Args:
        nodes: ``[k]`` feature node indices.
        factor: the new activation as a multiple of the clean one.
        replacement: the prompt's :class:`LocalReplacementModel` (built when not given).
        batch_size: rows per forward pass (default: what the memory budget allows).

    Returns:
        ``[k]`` float64 changes of the metric (logit units).

    Raises:
        MethodRefused: what the replacement model refuses; a graph feature that is not active.
        MemoryBudgetError: one row does not fit the budget.
    """
    lrm = replacement if replacement is not None else LocalReplacementModel(model, dictionaries, graph.token_ids)
    index = {L: {(p, f): i for i, (p, f) in enumerate(zip(lrm.active[L].pos.tolist(), lrm.active[L].feat.tolist()))}
             for L in lrm.active}
    feats = graph.features.tolist()
    where = []
    for L, p, f in feats:
        i = index.get(L, {}).get((p, f))
        if i is None:
            raise MethodRefused(f"graph feature {(L, p, f)} is not active in the replacement model's clean run: the graph "
                                "was built on another prompt, model or transcoder set")
        where.append((L, i))
    lin = {L: torch.zeros(len(lrm.active[L].acts), dtype=torch.bool) for L in lrm.active}
    for L, i in where:
        lin[L][i] = True
    nodes = torch.as_tensor(nodes, dtype=torch.long)
    runs = [-1, *nodes.tolist()]
    chunk = batch_size or chunk_rows(forward_row_bytes(model, graph.n_pos), len(runs), device=lrm.device,
                                     what="graph verification (frozen replacement model)", fix="shorten the prompt")
    out = torch.zeros(len(runs), dtype=torch.float64)
    for start in range(0, len(runs), chunk):
        part = runs[start:start + chunk]
        # row b's intervention: add (factor - 1) a_s W_dec[f] to its write. The feature is held
        # active (linearised) but its own pre-activation cannot move (same block), so its write
        # becomes factor * a_s W_dec[f] and everything downstream responds linearly.
        edits: dict[int, list[tuple[int, int, torch.Tensor]]] = {}
        for b, node in enumerate(part):
            if node >= 0:
                L, p, f = feats[node]
                vec = (factor - 1.0) * graph.activations[node].float() * lrm.dicts[L].W_dec.detach()[f].float()
                edits.setdefault(L, []).append((b, p, vec))

        def edit(rows):
            def fn(act, hook):
                act = act.clone()
                for b, p, vec in rows:
                    act[b, p] += vec.to(act)
                return act
            return fn

        extra = [(lrm.write_hooks[L], edit(rows)) for L, rows in edits.items()]
        run = lrm.run(batch=len(part), linear_features=lin, stop_at_final=True, extra_hooks=extra)
        out[start:start + len(part)] = target_metric(graph, run.pre_logits).double().cpu()
    return out[1:] - out[0]


def clean_errors(model: HookedModel, dictionaries: DictionarySet,
                 token_ids: Int[torch.Tensor, " n_pos"]) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
    """The clean run's error vectors ``hook_out - transcoder(hook_in)`` per layer and its logits.

    Returns:
        ``({layer: [n_pos, d_out]}, [n_pos, d_vocab] logits)``.

    Raises:
        MethodRefused: a dictionary's hook is not a hook of the model.
    """
    names = _check_hooks(model, dictionaries)
    cache: dict[str, torch.Tensor] = {}

    def grab(t, hook):
        cache[hook.name] = t.detach()
        return t

    with state_guard(model), torch.no_grad(), fwd_hooks(model, [(n, grab) for n in names]):
        logits = model(token_ids[None].to(_device(model)))
    errs = {}
    for L in dictionaries:
        d = dictionaries[L]
        x = _pick(cache, d.hook_in, model)
        y = _pick(cache, d.hook_out, model)
        errs[L] = (y[0].float() - d(x[0]).float()).detach()
    return errs, logits[0].detach()


def _device(model: HookedModel) -> torch.device:
    return next(iter(model.parameters())).device  # type: ignore[attr-defined]


def _pick(cache: dict[str, torch.Tensor], name: str, model: HookedModel) -> torch.Tensor:
    if name in cache:
        return cache[name]
    raise MethodRefused(f"hook {name!r} did not fire in a forward pass of {type(model).__name__}: the dictionaries' "
                        "hooks must be hooks the model calls (the transcoder's hook_in / hook_out)")


def _check_hooks(model: HookedModel, dictionaries: DictionarySet) -> list[str]:
    names = []
    hd = model.hook_dict
    for L in dictionaries:
        d = dictionaries[L]
        for n in (d.hook_in, d.hook_out):
            if n not in hd:
                raise MethodRefused(f"dictionary of layer {L}: hook {n!r} is not a hook of the model; a transcoder "
                                    "set for this model reads blocks.L.mlp.hook_in and writes blocks.L.hook_mlp_out")
            names.append(n)
    if len(set(names)) != len(names):
        raise MethodRefused("verify_graph needs transcoders (each layer's hook_in differs from every hook_out); "
                            "an SAE set reads and writes the same hook")
    return names


def intervened_metric(model: HookedModel, dictionaries: DictionarySet, graph: AttributionGraph,
                      interventions: list[tuple[int, int, int, float]], errors: dict[int, torch.Tensor],
                      *, batch_size: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The metric of the real model with MLPs replaced by transcoders plus the clean errors, without an
    intervention (entry 0) and with each of ``interventions`` (one per batch row; module docstring).

    Args:
        interventions: ``[(layer, pos, feature, new_activation)]``.
        errors: :func:`clean_errors`' error vectors.
        batch_size: rows per forward pass (default: what the memory budget allows).

    Returns:
        ``([1 + k] float64, [d_vocab])``: the baseline's metric then each intervention's, and the
        baseline's last-position logits.

    Raises:
        MemoryBudgetError: one row does not fit the memory budget.
        MethodRefused: a dictionary hook that does not fire.
    """
    dev = _device(model)
    ids = graph.token_ids.to(dev)
    runs: list[Optional[tuple[int, int, int, float]]] = [None, *interventions]
    n = len(runs)
    per_row = forward_row_bytes(model, graph.n_pos, logits=True) + sum(
        4 * graph.n_pos * (dictionaries[L].d_sae + 2 * dictionaries[L].d_out) for L in dictionaries) // max(
        1, len(dictionaries))
    chunk = batch_size or chunk_rows(per_row, n, what="graph verification (intervened runs)", device=dev,
                                     fix="shorten the prompt")
    out = torch.zeros(n, dtype=torch.float64)
    base = torch.empty(0)
    for start in range(0, n, chunk):
        rows = runs[start:start + chunk]
        last = _run_rows(model, dictionaries, ids, rows, errors)
        if start == 0:
            base = last[0].detach().cpu()
        out[start:start + len(rows)] = target_metric(graph, last).double().cpu()
    return out, base


def _run_rows(model: HookedModel, dictionaries: DictionarySet, ids: torch.Tensor,
              rows: list[Optional[tuple[int, int, int, float]]], errors: dict[int, torch.Tensor]) -> torch.Tensor:
    B = len(rows)
    inputs: dict[int, torch.Tensor] = {}
    fired: set[int] = set()

    def read_in(L):
        def fn(t, hook):
            inputs[L] = t
            return t
        return fn

    def write_out(L):
        d = dictionaries[L]
        edits = [(b, r[1], r[2], r[3]) for b, r in enumerate(rows) if r is not None and r[0] == L]

        def fn(t, hook):
            x = inputs.pop(L)
            acts = d.encode(x)
            for b, p, f, v in edits:
                acts[b, p, f] = v
            y = d.decode(acts) + d.skip_out(x) + errors[L].to(acts.dtype)
            fired.add(L)
            return y.to(t.dtype)
        return fn

    hooks = []
    for L in dictionaries:
        hooks += [(dictionaries[L].hook_in, read_in(L)), (dictionaries[L].hook_out, write_out(L))]
    with state_guard(model), torch.no_grad(), fwd_hooks(model, hooks):
        logits = model(ids[None].expand(B, -1))
    missing = [L for L in dictionaries if L not in fired]
    if missing:
        raise MethodRefused(f"the transcoders' output hooks of layers {missing} did not fire (or fired before their "
                            "input hooks): verify_graph needs hook_in before hook_out in each block")
    return logits[:, -1]


def verify_graph(model: HookedModel, dictionaries: DictionarySet, graph: AttributionGraph, *, top_k: int = 10,
                 n_random: int = 10, seed: int = 0, mode: str = "ablate", scale: float = 0.0,
                 batch_size: Optional[int] = None, node_threshold: float = 0.8,
                 edge_threshold: float = 0.98,
                 replacement: Optional[LocalReplacementModel] = None) -> dict[str, Any]:
    """Check the graph's predictions against interventions in the real model (module docstring).

    Args:
        model: the model the graph was built on.
        dictionaries: the transcoder set the graph was built with.
        graph: an unpruned graph whose ``target`` names the token (and foil) to follow; its
            ``verification`` gets ``intervention`` and ``scores`` (this return value's parts).
        top_k: feature nodes checked by influence rank.
        n_random: further feature nodes checked, sampled (without replacement, seeded) from the rest.
        seed: the sample's seed.
        mode: ``ablate`` (activation set to 0) or ``scale`` (activation set to ``scale * activation``).
        scale: the factor in ``scale`` mode (ignored by ``ablate``).
        batch_size: intervened rows per forward pass (default: what the memory budget allows).
        node_threshold: pruning's node threshold for the pruned graph's scores.
        edge_threshold: pruning's edge threshold for the pruned graph's scores.
        replacement: the prompt's :class:`LocalReplacementModel` (built when not given).

    Returns:
        ``{intervention: {mode, scale, metric, baseline_metric, baseline_max_abs_logit_error,
        frozen_max_abs_miss, table: [{node, layer, pos, feature, activation, influence,
        influence_rank, checked_as, predicted, frozen, measured, miss}], summary: compare()'s dict
        (pearson, spearman, sign_agreement, largest_errors, ...)}, scores: graph_scores(graph,
        prune_graph(graph, ...))}``. ``frozen`` is the change in the frozen local replacement model
        (:func:`frozen_changes`: equal to ``predicted`` to float error, a check of the graph itself;
        ``frozen_max_abs_miss`` its largest gap); ``measured`` the real model's; ``miss =
        measured - predicted``.

    Raises:
        ConfigError: an unknown mode, ``top_k``/``n_random`` negative, no target.
        MethodRefused: the target/foil is not a logit node; the dictionaries' hooks are not the model's.
        MemoryBudgetError: one intervened row does not fit the budget.

    Source: Ameisen et al. 2025 (methods, "Validating with interventions"); circuit-tracer.
    """
    if mode not in MODES:
        raise ConfigError(f"verify mode {mode!r} is not one of {list(MODES)}")
    if top_k < 0 or n_random < 0:
        raise ConfigError(f"verify top_k and n_random must be >= 0 (got top_k={top_k}, n_random={n_random})")
    factor = 0.0 if mode == "ablate" else float(scale)
    _target_nodes(graph)
    influence = compute_node_influence(graph.adjacency.float(), graph.logit_weights().to(graph.adjacency.device))
    feat_inf = influence[:graph.n_features].double().cpu().numpy()
    top, sample = choose_checked(feat_inf, top_k, n_random, seed)
    checked = np.concatenate([top, sample]).astype(np.int64)
    order = np.argsort(-np.abs(feat_inf), kind="stable")
    rank = np.empty(len(order), dtype=np.int64)
    rank[order] = np.arange(1, len(order) + 1)

    feats = graph.features.cpu()
    acts = graph.activations.double().cpu()
    nodes = torch.as_tensor(checked, dtype=torch.long)
    deltas = (factor - 1.0) * acts[nodes]
    predicted = predict_changes(graph, nodes, deltas).numpy()

    frozen = frozen_changes(model, dictionaries, graph, nodes, factor, replacement=replacement,
                            batch_size=batch_size).numpy()
    errors, clean_logits = clean_errors(model, dictionaries, graph.token_ids)
    interventions = [(int(feats[i, 0]), int(feats[i, 1]), int(feats[i, 2]), float(factor * acts[i])) for i in checked]
    metrics, baseline_logits = intervened_metric(model, dictionaries, graph, interventions, errors,
                                                 batch_size=batch_size)
    base_logits_err = float((baseline_logits.float() - clean_logits[-1].float()).abs().max())
    measured = (metrics[1:] - metrics[0]).numpy()

    table = []
    for j, i in enumerate(checked):
        table.append({"node": int(i), "layer": int(feats[i, 0]), "pos": int(feats[i, 1]), "feature": int(feats[i, 2]),
                      "activation": float(acts[i]), "influence": float(feat_inf[i]), "influence_rank": int(rank[i]),
                      "checked_as": "top" if j < len(top) else "random", "predicted": float(predicted[j]),
                      "frozen": float(frozen[j]), "measured": float(measured[j]),
                      "miss": float(measured[j] - predicted[j])})
    labels = [f"L{r['layer']}/p{r['pos']}/f{r['feature']}" for r in table]
    in_top = np.array([r["checked_as"] == "top" for r in table], dtype=bool)
    summary = compare(predicted, measured, labels, in_top, rank[checked], top_k)
    metric_name = ("logit_diff" if graph.target.get("foil_id") is not None else "demeaned_logit")
    result = {
        "intervention": {"mode": mode, "scale": factor, "metric": metric_name, "baseline_metric": float(metrics[0]),
                         "baseline_max_abs_logit_error": base_logits_err, "seed": seed,
                         "frozen_max_abs_miss": float(np.max(np.abs(frozen - predicted))) if len(table) else None,
                         "table": table,
                         "summary": summary},
        "scores": graph_scores(graph, prune_graph(graph, node_threshold, edge_threshold)),
    }
    graph.verification.update(result)
    return result

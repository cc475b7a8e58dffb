"""Influence, pruning and graph scores (tracekit.graphs.prune) on hand-built graphs.

The reference here is written independently of the code under test: influence as the dense inverse
``w @ ((I - A_n)^-1 - I)``, pruning and scores re-derived step by step from circuit-tracer's rules.
"""

from __future__ import annotations

import pytest
import torch

from tracekit.core.errors import ConfigError
from tracekit.graphs.graph import AttributionGraph
from tracekit.graphs.prune import compute_influence, graph_scores, normalize_matrix, prune_graph


def make_graph(adj: torch.Tensor, features: list[tuple[int, int, int]], n_layers: int, n_pos: int,
               probs: list[float]) -> AttributionGraph:
    n_logits = len(probs)
    n = len(features) + n_layers * n_pos + n_pos + n_logits
    assert adj.shape == (n, n)
    return AttributionGraph(
        prompt="x", token_ids=torch.arange(n_pos), tokens=[f"t{i}" for i in range(n_pos)], n_layers=n_layers,
        features=torch.tensor(features, dtype=torch.long).reshape(-1, 3),
        activations=torch.ones(len(features)), logit_ids=torch.arange(n_logits),
        logit_probs=torch.tensor(probs), logit_tokens=[f"l{i}" for i in range(n_logits)], adjacency=adj.float(),
        error_norms=torch.zeros(n_layers, n_pos))


def random_graph(seed: int, n_layers: int = 3, n_pos: int = 4, per: int = 2, n_logits: int = 3,
                 density: float = 0.6) -> AttributionGraph:
    """A random graph with the structure of an attribution graph: feature (L, p) reads features of
    lower layers at positions <= p, errors of lower layers, tokens; logits read everything."""
    g = torch.Generator().manual_seed(seed)
    feats = [(L, p, f) for L in range(n_layers) for p in range(n_pos) for f in range(per)]
    nf = len(feats)
    n = nf + n_layers * n_pos + n_pos + n_logits
    eo, to, lo = nf, nf + n_layers * n_pos, nf + n_layers * n_pos + n_pos
    adj = torch.zeros(n, n, dtype=torch.float64)

    def src_nodes(L, p):
        out = [j for j, (L2, p2, _) in enumerate(feats) if L2 < L and p2 <= p]
        out += [eo + L2 * n_pos + p2 for L2 in range(L) for p2 in range(p + 1)]
        out += [to + p2 for p2 in range(p + 1)]
        return out

    for i, (L, p, _) in enumerate(feats):
        for j in src_nodes(L, p):
            if torch.rand(1, generator=g) < density:
                adj[i, j] = torch.randn(1, generator=g, dtype=torch.float64)
    for k in range(n_logits):
        for j in src_nodes(n_layers, n_pos - 1):
            if torch.rand(1, generator=g) < density:
                adj[lo + k, j] = torch.randn(1, generator=g, dtype=torch.float64)
    probs = torch.rand(n_logits, generator=g)
    probs = (probs / probs.sum() * 0.9).tolist()
    return make_graph(adj, feats, n_layers, n_pos, probs)


def dense_influence(adj: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    a = adj.double().abs()
    a = a / a.sum(1, keepdim=True).clamp(min=1e-10)
    eye = torch.eye(len(a), dtype=torch.float64)
    return w.double() @ (torch.linalg.inv(eye - a) - eye)


def test_influence_by_hand():
    # 1 layer, 1 position, 1 feature; logit <- feature (2), logit <- error (-1), logit <- token (1);
    # feature <- token (3), feature <- error? no (same layer), so feature's input is all token.
    #   nodes: f0, e(0,0), t0, l0
    adj = torch.zeros(4, 4)
    adj[0, 2] = 3.0
    adj[3, 0], adj[3, 1], adj[3, 2] = 2.0, -1.0, 1.0
    g = make_graph(adj, [(0, 0, 0)], 1, 1, [0.5])
    an = normalize_matrix(adj)
    assert torch.allclose(an[3], torch.tensor([0.5, 0.25, 0.25, 0.0]))
    assert torch.allclose(an[0], torch.tensor([0.0, 0.0, 1.0, 0.0]))
    inf = compute_influence(an, g.logit_weights())
    # f0: 0.5 * 0.5 = 0.25; e: 0.5 * 0.25 = 0.125; t: 0.5 * 0.25 + 0.25 * 1 = 0.375
    assert torch.allclose(inf, torch.tensor([0.25, 0.125, 0.375, 0.0]), atol=1e-7)
    s = graph_scores(g)
    assert s["replacement"] == pytest.approx(0.375 / (0.375 + 0.125), abs=1e-6)
    # completeness: non-error shares: f0 1, e 1, t 1, l0 0.75; out influence f .25 e .125 t .375 l .5
    assert s["completeness"] == pytest.approx((0.25 + 0.125 + 0.375 + 0.75 * 0.5) / 1.25, abs=1e-6)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_influence_equals_dense_inverse(seed):
    g = random_graph(seed)
    w = g.logit_weights()
    inf = compute_influence(normalize_matrix(g.adjacency), w)
    ref = dense_influence(g.adjacency, w)
    assert torch.allclose(inf.double(), ref, atol=1e-6)


def test_cyclic_adjacency_raises():
    adj = torch.zeros(4, 4)
    adj[0, 1] = adj[1, 0] = 1.0
    adj[3, 0] = 1.0
    with pytest.raises(ValueError, match="acyclic"):
        compute_influence(normalize_matrix(adj), torch.tensor([0.0, 0.0, 0.0, 1.0]), max_iter=50)


def reference_prune(g: AttributionGraph, node_threshold: float, edge_threshold: float):
    """circuit-tracer's pruning, written out with the dense inverse and explicit loops."""
    adj = g.adjacency.double()
    n = g.n_nodes
    w = g.logit_weights().double()
    keep_always = list(range(g.token_offset, n))

    def threshold_value(scores, t):
        s = sorted(scores.tolist(), reverse=True)
        total = sum(s)
        acc = 0.0
        for v in s:
            acc += v
            if acc / total >= t - 1e-12:
                return v
        return s[-1]

    inf = dense_influence(adj, w)
    node = inf >= threshold_value(inf, node_threshold) - 1e-12
    node[keep_always] = True
    pruned = adj * node[:, None] * node[None, :]
    a = pruned.abs()
    a = a / a.sum(1, keepdim=True).clamp(min=1e-10)
    eye = torch.eye(n, dtype=torch.float64)
    out_inf = w @ (torch.linalg.inv(eye - a) - eye) + w
    scores = a * out_inf[:, None]
    edge = scores >= threshold_value(scores.flatten(), edge_threshold) - 1e-12
    while True:
        before = node.clone()
        edge = edge & node[:, None] & node[None, :]
        for j in range(g.token_offset):
            node[j] = bool(node[j] and edge[:, j].any())
        for j in range(g.n_features):
            node[j] = bool(node[j] and edge[j].any())
        if torch.equal(before, node):
            break
    edge = edge & node[:, None] & node[None, :]
    return node, edge, inf


@pytest.mark.parametrize("seed", [0, 3, 4])
@pytest.mark.parametrize("thresholds", [(0.8, 0.98), (0.5, 0.7), (0.95, 0.9)])
def test_prune_equals_reference(seed, thresholds):
    g = random_graph(seed)
    res = prune_graph(g, *thresholds)
    node, edge, inf = reference_prune(g, *thresholds)
    assert torch.allclose(res.node_influence.double(), inf, atol=1e-6)
    assert torch.equal(res.node_mask, node)
    assert torch.equal(res.edge_mask & res.node_mask[:, None] & res.node_mask[None, :], edge)
    # kept features have a kept incoming and a kept outgoing edge; tokens and logits are kept
    assert res.node_mask[g.token_offset:].all()
    for j in torch.nonzero(res.node_mask[:g.n_features]).flatten().tolist():
        assert res.edge_mask[j].any() and res.edge_mask[:, j].any()
    # fewer nodes than the graph (the threshold removes something on these random graphs)
    assert int(res.node_mask.sum()) < g.n_nodes


def test_prune_threshold_edges():
    g = random_graph(5)
    full = prune_graph(g, 1.0, 1.0)
    inf = full.node_influence
    # threshold 1 keeps (before the edge rules) every node but those of zero influence, so every
    # kept-or-not decision is the edge rules': a feature is dropped only without an incoming edge or
    # (transitively) without an outgoing one
    node, _, _ = reference_prune(g, 1.0, 1.0)
    assert torch.equal(full.node_mask, node)
    no_input = (g.adjacency[:g.n_features] == 0).all(1)
    assert not full.node_mask[:g.n_features][no_input].any()
    assert int(full.node_mask.sum()) > int(prune_graph(g, 0.8, 0.98).node_mask.sum())
    tiny = prune_graph(g, 0.0, 0.0)
    # threshold 0 keeps only the single most influential node before the edge rules, + tokens/logits
    assert int(tiny.node_mask[:g.token_offset].sum()) <= 1
    assert torch.equal(tiny.node_mask, reference_prune(g, 0.0, 0.0)[0])
    assert tiny.node_mask[g.token_offset:].all()
    # cumulative scores: 1.0 for the least influential node, increasing with rank
    order = torch.argsort(inf, descending=True)
    cs = full.cumulative_scores[order]
    assert torch.all(cs[1:] >= cs[:-1] - 1e-7) and cs[-1] == pytest.approx(1.0, abs=1e-6)


@pytest.mark.parametrize("name,kw", [("node_threshold", {"node_threshold": 1.5}),
                                     ("node_threshold", {"node_threshold": -0.1}),
                                     ("edge_threshold", {"edge_threshold": 2.0}),
                                     ("edge_threshold", {"edge_threshold": float("nan")})])
def test_invalid_thresholds(name, kw):
    g = random_graph(0)
    with pytest.raises(ConfigError, match=name):
        prune_graph(g, **kw)
    with pytest.raises(ValueError, match=name):
        prune_graph(g, **kw)


def reference_scores(adj: torch.Tensor, g: AttributionGraph) -> tuple[float, float]:
    w = g.logit_weights().double()
    a = adj.double().abs()
    a = a / a.sum(1, keepdim=True).clamp(min=1e-10)
    inf = dense_influence(adj, w)
    err = slice(g.error_offset, g.token_offset)
    tok = slice(g.token_offset, g.logit_offset)
    rep = inf[tok].sum() / (inf[tok].sum() + inf[err].sum())
    out = inf + w
    comp = ((1 - a[:, err].sum(1)) * out).sum() / out.sum()
    return float(rep), float(comp)


@pytest.mark.parametrize("seed", [0, 1, 6])
def test_scores_equal_reference(seed):
    g = random_graph(seed)
    res = prune_graph(g, 0.7, 0.9)
    s = graph_scores(g, res)
    rep, comp = reference_scores(g.adjacency, g)
    assert s["replacement"] == pytest.approx(rep, abs=1e-6)
    assert s["completeness"] == pytest.approx(comp, abs=1e-6)
    kept = g.adjacency * res.node_mask[:, None] * res.node_mask[None, :] * res.edge_mask
    rep_p, comp_p = reference_scores(kept, g)
    assert s["pruned"]["replacement"] == pytest.approx(rep_p, abs=1e-6)
    assert s["pruned"]["completeness"] == pytest.approx(comp_p, abs=1e-6)
    assert s["pruned"]["n_nodes"] == int(res.node_mask.sum())
    # folded: each dropped feature's outgoing edges move to its (layer, pos) error node, one at a time
    folded = g.adjacency.clone().double()
    for j in range(g.n_features):
        if not res.node_mask[j]:
            L, p, _ = g.features[j].tolist()
            e = g.error_index(L, p)
            folded[:, e] += folded[:, j]
            folded[j, :] = 0
            folded[:, j] = 0
    rep_f, comp_f = reference_scores(folded, g)
    assert s["pruned_folded"]["replacement"] == pytest.approx(rep_f, abs=1e-6)
    assert s["pruned_folded"]["completeness"] == pytest.approx(comp_f, abs=1e-6)
    assert 0 <= s["replacement"] <= 1 and 0 <= s["completeness"] <= 1


def test_scores_without_errors_are_one():
    """No error edges at all: every score is 1 (tokens explain everything through features)."""
    g = random_graph(2)
    adj = g.adjacency.clone()
    adj[:, g.error_offset:g.token_offset] = 0
    g.adjacency = adj
    s = graph_scores(g)
    assert s["replacement"] == pytest.approx(1.0, abs=1e-6)
    assert s["completeness"] == pytest.approx(1.0, abs=1e-6)


def test_scores_reject_mismatched_prune():
    g = random_graph(0)
    other = prune_graph(random_graph(0, n_pos=5))
    with pytest.raises(ValueError, match="prune_graph"):
        graph_scores(g, other)


def test_refuses_before_work_over_the_memory_budget():
    from tracekit.core.budget import memory_budget
    from tracekit.core.errors import MemoryBudgetError

    g = random_graph(0)
    with memory_budget(4 * g.n_nodes ** 2):  # one [n, n] float32: pruning needs several
        with pytest.raises(MemoryBudgetError, match="graph pruning"):
            prune_graph(g)
        with pytest.raises(MemoryBudgetError, match="graph scores"):
            graph_scores(g)
    with memory_budget(64 * g.n_nodes ** 2):
        assert prune_graph(g).node_mask.any()

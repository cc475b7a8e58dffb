"""The attribution graph's tables, its circuit-tracer / Neuronpedia JSON, its HTML page and its
feature cards (tracekit.graphs.tables / export / view / cards).

The graphs here are small synthetic :class:`AttributionGraph` s built by hand (known nodes,
edges and pruning masks), so every table cell and JSON field is checked against the graph it came
from; the JSON is validated against circuit-tracer's own pydantic models (re-declared below from
``circuit_tracer/frontend/graph_models.py``: circuit-tracer is not a dependency) and compared with a
port of its ``create_nodes`` / ``create_used_nodes_and_edges``. The cards run on tiny models with a
random transcoder set: their contexts' activations are recomputed by a forward pass, their logit
readout by hand from the final norm's weight and the unembedding.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import List

import numpy as np
import pytest
import torch
from pydantic import BaseModel

from tracekit.core.budget import memory_budget
from tracekit.core.errors import AttributionError, MemoryBudgetError
from tracekit.dictionaries.dictionary import Dictionary, DictionarySet
from tracekit.graphs import AttributionGraph
from tracekit.graphs.cards import READOUT_RULE, feature_cards
from tracekit.graphs.export import graph_json, process_token, write_graph_json
from tracekit.graphs.prune import prune_graph
from tracekit.graphs.tables import EDGE_COLUMNS, NODE_COLUMNS, graph_tables, node_ids
from tracekit.graphs.verify import verify_graph
from tracekit.graphs.view import render_graph_html, write_graph_html

# ---------------------------------------------------------------------------------------------
# circuit-tracer's pydantic models (circuit_tracer/frontend/graph_models.py, re-declared verbatim)


class Metadata(BaseModel):
    slug: str
    scan: str
    transcoder_list: List[str]
    prompt_tokens: List[str]
    prompt: str
    node_threshold: float | None = None


class QParams(BaseModel):
    pinnedIds: List[str]
    supernodes: List[List[str]]
    linkType: str
    clickedId: str
    sg_pos: str


class Node(BaseModel):
    node_id: str
    feature: int
    layer: str
    ctx_idx: int
    feature_type: str
    token_prob: float = 0.0
    is_target_logit: bool = False
    run_idx: int = 0
    reverse_ctx_idx: int = 0
    jsNodeId: str
    clerp: str = ""
    influence: float | None = None
    activation: float | None = None

    def __init__(self, **data):
        if "node_id" in data and "jsNodeId" not in data:
            data["jsNodeId"] = data["node_id"]
        super().__init__(**data)

    @classmethod
    def feature_node(cls, layer, pos, feat_idx, num_features=None, influence=None, activation=None):
        offset = 10 ** math.ceil(math.log10(num_features)) if num_features is not None else 0
        return cls(node_id=f"{layer}_{feat_idx}_{pos}", feature=feat_idx + offset * int(layer), layer=str(layer),
                   ctx_idx=pos, feature_type="cross layer transcoder", jsNodeId=f"{layer}_{feat_idx}-0",
                   influence=influence, activation=activation)

    @classmethod
    def error_node(cls, layer, pos, influence=None):
        return cls(node_id=f"0_{layer}_{pos}", feature=-1, layer=str(layer), ctx_idx=pos,
                   feature_type="mlp reconstruction error", jsNodeId=f"{layer}_{pos}-0", influence=influence)

    @classmethod
    def token_node(cls, pos, vocab_idx, influence=None):
        return cls(node_id=f"E_{vocab_idx}_{pos}", feature=pos, layer="E", ctx_idx=pos, feature_type="embedding",
                   jsNodeId=f"E_{vocab_idx}-{pos}", influence=influence)

    @classmethod
    def logit_node(cls, pos, vocab_idx, token, num_layers, target_logit=False, token_prob=0.0):
        layer = str(num_layers + 1)
        return cls(node_id=f"{layer}_{vocab_idx}_{pos}", feature=vocab_idx, layer=layer, ctx_idx=pos,
                   feature_type="logit", token_prob=token_prob, is_target_logit=target_logit,
                   jsNodeId=f"L_{vocab_idx}-{pos}", clerp=f'Output "{token}" (p={token_prob:.3f})')


class Link(BaseModel):
    source: str
    target: str
    weight: float


class Model(BaseModel):
    metadata: Metadata
    qParams: QParams
    nodes: List[Node]
    links: List[dict]



@dataclass
class StandInPrune:
    """What a PruneResult carries (tracekit.graphs.prune): masks and influence scores."""

    node_mask: torch.Tensor
    edge_mask: torch.Tensor
    cumulative_scores: torch.Tensor
    node_influence: torch.Tensor

def ct_nodes_and_links(graph: AttributionGraph, node_mask, edge_mask, cumulative_scores):
    """circuit-tracer's ``create_nodes`` + ``create_used_nodes_and_edges`` on our graph's fields
    (selected_features = every feature, input_tokens = token_ids, logit_tokens = logit_ids)."""
    nodes = {}
    n_features, layers = graph.n_features, graph.n_layers
    error_end_idx = n_features + graph.n_pos * layers
    token_end_idx = error_end_idx + graph.n_pos
    for node_idx in node_mask.nonzero().squeeze().tolist():
        if node_idx in range(n_features):
            layer, pos, feat_idx = graph.features[node_idx].tolist()
            nodes[node_idx] = Node.feature_node(layer, pos, feat_idx, influence=cumulative_scores[node_idx],
                                                activation=graph.activations[node_idx].item())
        elif node_idx in range(n_features, error_end_idx):
            layer, pos = divmod(node_idx - n_features, graph.n_pos)
            nodes[node_idx] = Node.error_node(layer, pos, influence=cumulative_scores[node_idx])
        elif node_idx in range(error_end_idx, token_end_idx):
            pos = node_idx - error_end_idx
            nodes[node_idx] = Node.token_node(pos, int(graph.token_ids[pos]), influence=cumulative_scores[node_idx])
        elif node_idx in range(token_end_idx, len(cumulative_scores)):
            pos = node_idx - token_end_idx
            nodes[node_idx] = Node.logit_node(pos=graph.n_pos - 1, vocab_idx=int(graph.logit_ids[pos]),
                                              token=process_token(graph.logit_tokens[pos]), target_logit=pos == 0,
                                              token_prob=float(graph.logit_probs[pos]), num_layers=layers)
    dsts, srcs = edge_mask.numpy().nonzero()
    weights = graph.adjacency.numpy()[dsts, srcs].tolist()
    used_edges = [{"source": nodes[s].node_id, "target": nodes[d].node_id, "weight": w}
                  for s, d, w in zip(srcs, dsts, weights) if s in nodes and d in nodes]
    connected = {e["source"] for e in used_edges} | {e["target"] for e in used_edges}
    used_nodes = [n for n in nodes.values() if n.node_id in connected or n.feature_type in ["embedding", "logit"]]
    return used_nodes, used_edges


# ---------------------------------------------------------------------------------------------
# synthetic graphs

TOKENS = ["<bos>", "The <b>", " capital", " & \"of\"", "\nFrance", " is"]


def toy_graph(features=None, seed=0, n_layers=3, tokens=TOKENS, target_id=464) -> AttributionGraph:
    """Feature rows take inputs from earlier features, tokens and errors at positions <= theirs;
    logit rows from everything; some entries exactly zero."""
    g = torch.Generator().manual_seed(seed)
    n_pos = len(tokens)
    feats = torch.tensor(features if features is not None else
                         [[0, 1, 5], [0, 3, 7], [0, 4, 8], [1, 2, 11], [1, 4, 3], [2, 4, 9], [2, 5, 12], [2, 5, 13]])
    nf, nl = feats.shape[0], 3
    n = nf + n_layers * n_pos + n_pos + nl
    tok0 = nf + n_layers * n_pos
    adj = torch.zeros(n, n)
    for i, (L, p, _) in enumerate(feats.tolist()):
        for s, (Ls, ps, _) in enumerate(feats.tolist()):
            if Ls < L and ps <= p:
                adj[i, s] = float(torch.randn(1, generator=g))
        for q in range(p + 1):
            adj[i, tok0 + q] = float(torch.randn(1, generator=g))
            for Le in range(L):
                adj[i, nf + Le * n_pos + q] = 0.3 * float(torch.randn(1, generator=g))
    for j in range(nl):
        r = tok0 + n_pos + j
        adj[r, :nf] = torch.randn(nf, generator=g)
        adj[r, nf:tok0] = 0.2 * torch.randn(n_layers * n_pos, generator=g)
        adj[r, tok0:tok0 + n_pos] = torch.randn(n_pos, generator=g)
    return AttributionGraph(
        prompt="".join(tokens[1:]), token_ids=torch.arange(n_pos) * 7 + 3, tokens=list(tokens), n_layers=n_layers,
        features=feats, activations=torch.rand(nf, generator=g) + 0.1, logit_ids=torch.tensor([464, 262, 9]),
        logit_probs=torch.tensor([0.6, 0.25, 0.1]), logit_tokens=[" Paris", " <Beijing>", "\n"], adjacency=adj,
        error_norms=torch.rand(n_layers, n_pos, generator=g), target={"id": target_id, "token": " Paris"},
        model={"name": "toy"})


def toy_prune(graph: AttributionGraph, drop=(2,), edge_cut=0.4, seed=1):
    """A stand-in PruneResult: some nodes dropped, edges above a weight cut kept, random scores."""
    n = graph.n_nodes
    nm = torch.ones(n, dtype=torch.bool)
    nm[list(drop)] = False
    infl = torch.rand(n, generator=torch.Generator().manual_seed(seed))
    order = torch.argsort(infl, descending=True)
    cum = torch.zeros(n)
    cum[order] = torch.cumsum(infl[order], 0) / infl.sum()
    return StandInPrune(node_mask=nm, edge_mask=graph.adjacency.abs() > edge_cut, cumulative_scores=cum,
                           node_influence=infl)


# ---------------------------------------------------------------------------------------------
# tables


def test_node_table_matches_the_graph():
    graph = toy_graph()
    prune = toy_prune(graph)
    nodes, _ = graph_tables(graph, prune)
    assert list(nodes.columns) == list(NODE_COLUMNS) and len(nodes) == graph.n_nodes
    assert nodes["node"].tolist() == list(range(graph.n_nodes))
    assert nodes["node_id"].is_unique
    assert nodes["kept"].tolist() == prune.node_mask.tolist()
    np.testing.assert_array_equal(nodes["influence"].to_numpy(), prune.node_influence.numpy().astype(np.float64))
    np.testing.assert_array_equal(nodes["cumulative_influence"].to_numpy(),
                                  prune.cumulative_scores.numpy().astype(np.float64))
    for i, (L, p, f) in enumerate(graph.features.tolist()):
        r = nodes.iloc[i].to_dict()
        assert (r["type"], r["layer"], r["position"], r["feature"]) == ("feature", L, p, f)
        assert r["node_id"] == f"{L}_{f}_{p}" and r["token"] == graph.tokens[p]
        assert r["activation"] == pytest.approx(float(graph.activations[i]), abs=0)
        assert math.isnan(r["error_norm"]) and r["logit_id"] == -1
    for L in range(graph.n_layers):
        for p in range(graph.n_pos):
            r = nodes.iloc[graph.error_index(L, p)].to_dict()
            assert (r["type"], r["layer"], r["position"], r["feature"]) == ("error", L, p, -1)
            assert r["error_norm"] == pytest.approx(float(graph.error_norms[L, p]), abs=0)
            assert r["node_id"] in (f"0_{L}_{p}", f"0_{L}_{p}_e") and math.isnan(r["activation"])
    for p in range(graph.n_pos):
        r = nodes.iloc[graph.token_index(p)].to_dict()
        assert (r["type"], r["layer"], r["position"], r["token_id"]) == ("token", -1, p, int(graph.token_ids[p]))
        assert r["node_id"] == f"E_{int(graph.token_ids[p])}_{p}"
    for j in range(graph.n_logits):
        r = nodes.iloc[graph.logit_index(j)].to_dict()
        assert (r["type"], r["layer"], r["position"]) == ("logit", graph.n_layers, graph.n_pos - 1)
        assert (r["logit_token"], r["logit_id"]) == (graph.logit_tokens[j], int(graph.logit_ids[j]))
        assert r["logit_prob"] == pytest.approx(float(graph.logit_probs[j]), abs=0)
        assert r["is_target_logit"] == (j == 0)
    assert int(nodes["is_target_logit"].to_numpy(bool).sum()) == 1


def test_target_logit_follows_graph_target():
    graph = toy_graph(target_id=262)  # the second logit node is the target
    nodes, _ = graph_tables(graph, None)
    assert nodes.loc[nodes["is_target_logit"], "logit_id"].tolist() == [262]


def test_node_id_collision_is_disambiguated():
    """circuit-tracer's ids collide for a layer-0 feature f and the error of layer f (same position)."""
    graph = toy_graph(features=[[0, 2, 1], [0, 3, 0], [1, 4, 5]])
    ids = node_ids(graph)
    assert len(set(ids)) == len(ids)
    assert ids[graph.error_index(1, 2)] == "0_1_2_e" and ids[0] == "0_1_2"
    assert ids[graph.error_index(0, 3)] == "0_0_3_e" and ids[1] == "0_0_3"
    assert ids[graph.error_index(1, 3)] == "0_1_3"  # no clash: circuit-tracer's id


@pytest.mark.parametrize("edges", ["kept", "nonzero"])
def test_edge_table_matches_the_adjacency(edges):
    graph = toy_graph()
    prune = toy_prune(graph)
    nodes, table = graph_tables(graph, prune, edges=edges)
    assert list(table.columns) == list(EDGE_COLUMNS)
    adj, nm = graph.adjacency, prune.node_mask
    kept = prune.edge_mask & nm[:, None] & nm[None, :] & (adj != 0)
    want = kept if edges == "kept" else adj != 0
    got = set(zip(table["target"].tolist(), table["source"].tolist()))
    assert got == {tuple(x) for x in torch.nonzero(want).tolist()} and len(got) == len(table)
    for s, t, w, k, sid, tid in table[["source", "target", "weight", "kept", "source_id", "target_id"]].itertuples(
            index=False):
        assert w == float(adj[t, s]) and w != 0
        assert k == bool(kept[t, s])
        assert (sid, tid) == (nodes["node_id"][s], nodes["node_id"][t])
    if edges == "nonzero":
        flags = table["kept"].to_numpy(bool)
        assert int(flags.sum()) == int(kept.sum()) and not flags.all()
    assert bool((np.diff(table["target"].to_numpy()) >= 0).all())  # sorted by target


def test_tables_without_pruning_keep_everything():
    graph = toy_graph()
    nodes, edges = graph_tables(graph, None)
    assert nodes["kept"].to_numpy(bool).all() and np.isnan(nodes["influence"].to_numpy(float)).all()
    assert len(edges) == int((graph.adjacency != 0).sum()) and edges["kept"].to_numpy(bool).all()


def test_tables_refuse_a_pruning_of_another_graph():
    graph = toy_graph()
    other = toy_prune(toy_graph(features=[[0, 1, 5]]))
    with pytest.raises(AttributionError, match="prune.node_mask"):
        graph_tables(graph, other)
    with pytest.raises(AttributionError, match="edges"):
        graph_tables(graph, None, edges="all")


def test_tables_round_trip_parquet_and_csv(tmp_path):
    import pandas as pd

    graph = toy_graph()
    nodes, edges = graph_tables(graph, toy_prune(graph))
    for df, name in ((nodes, "nodes"), (edges, "edges")):
        df.to_parquet(tmp_path / f"{name}.parquet")
        back = pd.read_parquet(tmp_path / f"{name}.parquet")
        pd.testing.assert_frame_equal(back, df, check_dtype=False)
        df.to_csv(tmp_path / f"{name}.csv", index=False)
        back = pd.read_csv(tmp_path / f"{name}.csv", keep_default_na=False, na_values=[""])
        assert len(back) == len(df) and list(back.columns) == list(df.columns)
        np.testing.assert_allclose(back["weight" if name == "edges" else "activation"].to_numpy(dtype=float),
                                   df["weight" if name == "edges" else "activation"].to_numpy(dtype=float),
                                   rtol=1e-12, equal_nan=True)


# ---------------------------------------------------------------------------------------------
# circuit-tracer / Neuronpedia JSON


def test_graph_json_validates_and_equals_circuit_tracers_output():
    graph = toy_graph()  # no id collision in this graph: circuit-tracer's ids throughout
    prune = toy_prune(graph)
    data = graph_json(graph, prune, slug="toy-graph", node_threshold=0.8)
    text = json.dumps(data, allow_nan=False)
    model = Model.model_validate_json(text)
    # every node is exactly what circuit-tracer's pydantic Node would dump (same keys, order, values)
    for n, m in zip(data["nodes"], model.nodes):
        assert list(n) == list(Node.model_fields) and n == m.model_dump()
    for link in data["links"]:
        Link.model_validate(link)
    assert data["metadata"] == Metadata(slug="toy-graph", scan="tracekit-toy-transcoders", transcoder_list=[],
                                        prompt_tokens=[process_token(t) for t in graph.tokens], prompt=graph.prompt,
                                        node_threshold=0.8).model_dump()
    assert data["qParams"] == QParams(pinnedIds=[], supernodes=[], linkType="both", clickedId="",
                                      sg_pos="").model_dump()
    # the same nodes and links as circuit-tracer's create_graph_files on the same masks
    nm, em = prune.node_mask, prune.edge_mask & prune.node_mask[:, None] & prune.node_mask[None, :]
    ct_nodes, ct_links = ct_nodes_and_links(graph, nm, prune.edge_mask, prune.cumulative_scores)
    assert [n.model_dump() for n in ct_nodes] == data["nodes"]
    assert ct_links == data["links"]
    assert em.sum() >= len(data["links"]) > 0


def test_graph_json_fields_follow_the_graph():
    graph = toy_graph()
    prune = toy_prune(graph, drop=(2, 5))
    data = graph_json(graph, prune, slug="s", cards={0: {"clerp": "→ ' Paris'"}})
    by_id = {n["node_id"]: n for n in data["nodes"]}
    assert len(by_id) == len(data["nodes"])
    assert all(link["source"] in by_id and link["target"] in by_id for link in data["links"])
    types = [n["feature_type"] for n in data["nodes"]]
    assert types.count("embedding") == graph.n_pos and types.count("logit") == graph.n_logits
    assert "0_8_4" not in by_id  # node 2 (layer 0, feature 8, position 4) was pruned
    assert by_id["0_5_1"]["clerp"] == "→ ' Paris'"
    logit = by_id[f"{graph.n_layers + 1}_464_{graph.n_pos - 1}"]
    assert logit["is_target_logit"] and logit["token_prob"] == pytest.approx(0.6)
    assert logit["clerp"] == 'Output " Paris" (p=0.600)' and logit["influence"] is None
    nl = by_id[f"{graph.n_layers + 1}_9_{graph.n_pos - 1}"]
    assert nl["clerp"] == 'Output "⏎" (p=0.100)'
    assert data["metadata"]["prompt_tokens"][4] == "⏎France"
    for link in data["links"]:  # weights are the adjacency's
        s = next(i for i, x in enumerate(node_ids(graph)) if x == link["source"])
        t = next(i for i, x in enumerate(node_ids(graph)) if x == link["target"])
        assert link["weight"] == float(graph.adjacency[t, s])
    with pytest.raises(AttributionError, match="slug"):
        graph_json(graph, prune, slug=" ")


def test_graph_json_without_pruning_has_no_nan():
    graph = toy_graph()
    data = graph_json(graph, None, slug="all")
    json.dumps(data, allow_nan=False)
    assert all(n["influence"] is None for n in data["nodes"])
    assert len(data["links"]) == int((graph.adjacency != 0).sum())


def test_write_graph_json_keeps_the_server_index(tmp_path):
    graph = toy_graph()
    prune = toy_prune(graph)
    p1 = write_graph_json(graph, prune, tmp_path, slug="one")
    p2 = write_graph_json(graph, prune, tmp_path / "two.json", slug="two")
    p3 = write_graph_json(graph, prune, tmp_path, slug="one", scan="my-scan")
    assert p1 == p3 == tmp_path / "one.json" and p2 == tmp_path / "two.json"
    Model.model_validate_json(p1.read_text(encoding="utf-8"))
    index = json.loads((tmp_path / "graph-metadata.json").read_text(encoding="utf-8"))
    assert [g["slug"] for g in index["graphs"]] == ["two", "one"]  # "one" replaced, not repeated
    assert index["graphs"][1]["scan"] == "my-scan"
    for g in index["graphs"]:
        Metadata.model_validate(g)


# ---------------------------------------------------------------------------------------------
# the HTML page (the browser test: tests/acceptance/test_graph_browser.py)


def _page_data(html: str) -> dict:
    m = re.search(r'<script type="application/json" id="graph-data">(.*?)</script>', html, re.S)
    assert m
    return json.loads(m.group(1))


def test_page_is_self_contained_and_escaped(tmp_path):
    tokens = ["<bos>", "</script><script>alert(1)</script>", " a&b", " \"q'", "\n<i>"]
    graph = toy_graph(features=[[0, 1, 5], [1, 3, 2], [2, 4, 9]], tokens=tokens)
    prune = toy_prune(graph, drop=())
    card = {"node": 2, "layer": 2, "position": 4, "feature": 9, "token": tokens[4], "activation": 1.0,
            "source": "corpus", "source_detail": "</script>", "readout_rule": READOUT_RULE, "clerp": "<b>",
            "contexts": [{"activation": 2.0, "tokens": ["</script>", "<x>"], "at": 1, "row": 0, "position": 1}],
            "top_tokens": [{"token": "<y>", "token_id": 1, "logit": 1.0}], "bottom_tokens": []}
    ver = {"logits_max_abs_error": 2e-6, "table": [{"feature": "<f>", "predicted": 0.1, "measured": 0.2}]}
    path = write_graph_html(graph, prune, tmp_path, cards={2: card}, verification=ver)
    html = path.read_text(encoding="utf-8")
    assert path.name == "graph.html"
    # nothing fetched: no external URL, no link/src/import (the SVG namespace is a name, not a fetch)
    assert re.findall(r"https?://[^\s\"')]+", html) == ["http://www.w3.org/2000/svg"]
    assert not re.search(r"<link|\ssrc=|@import|url\(", html)
    # exactly two scripts (the data, the code): no token text opened a script or a tag
    assert html.count("<script") == 2 and html.count("</script>") == 2
    assert "<i>" not in html and "<b>" not in html and "<x>" not in html
    data = _page_data(html)
    assert data["cards"]["2"]["contexts"][0]["tokens"] == ["</script>", "<x>"]
    assert {v["token"] for v in data["nodes"].values()} >= set(tokens)
    assert "&lt;f&gt;" in html  # the verification table's cell, escaped


def test_page_data_matches_the_tables():
    graph = toy_graph()
    prune = toy_prune(graph)
    data = _page_data(render_graph_html(graph, prune))
    nodes, edges = graph_tables(graph, prune)
    linked = set(edges["source"]) | set(edges["target"])
    keep = nodes["kept"].to_numpy(bool) & (np.isin(nodes["node"].to_numpy(), list(linked))
                                           | np.isin(nodes["type"].to_numpy(str), ["token", "logit"]))
    shown = {int(i) for i in nodes["node"].to_numpy()[keep]}
    assert {int(k) for k in data["nodes"]} == shown
    assert {(s, t, w) for s, t, w in data["edges"]} == set(zip(edges["source"], edges["target"], edges["weight"]))
    for k, v in data["nodes"].items():
        assert v["id"] == nodes["node_id"][int(k)]


# ---------------------------------------------------------------------------------------------
# feature cards


def _random_set(model, d_sae=24, seed=0, activation="relu") -> DictionarySet:
    g = torch.Generator().manual_seed(seed)
    d = int(model.cfg.d_model)
    out = {}
    for L in range(int(model.cfg.n_layers)):
        t = Dictionary(d, d_sae, d, activation=activation, k=4 if activation == "topk" else None,
                       hook_in=f"blocks.{L}.mlp.hook_in", hook_out=f"blocks.{L}.hook_mlp_out", layer=L)
        with torch.no_grad():
            t.W_enc.copy_(torch.randn(d, d_sae, generator=g) / math.sqrt(d))
            t.b_enc.copy_(0.1 * torch.randn(d_sae, generator=g))
            t.W_dec.copy_(torch.randn(d_sae, d, generator=g) / math.sqrt(d_sae))
        out[L] = t
    return DictionarySet(out)


def _hook_in(model, ids, hooks):
    cache = {}
    handles = []
    for h in hooks:
        def keep(act, hook, h=h):
            cache[h] = act.detach().clone()
        handles.append((h, keep))
    with torch.no_grad():
        model.run_with_hooks(torch.tensor([ids]), fwd_hooks=handles)
    return cache


def _prompt_graph(model, dset, prompt="The capital of France is Paris. The capital of China is"):
    from tracekit.tokens import encode

    ids = list(encode(model, prompt))
    cache = _hook_in(model, ids, [dset[L].hook_in for L in dset.layers])
    feats, acts = [], []
    for L in dset.layers:
        a = dset[L].encode(cache[dset[L].hook_in][0]).detach()
        for p, f in torch.nonzero(a > 0).tolist()[:6]:
            feats.append([L, p, f])
            acts.append(float(a[p, f]))
    n_pos, nf = len(ids), len(feats)
    n = nf + int(model.cfg.n_layers) * n_pos + n_pos + 1
    adj = torch.zeros(n, n)
    adj[-1, :nf] = 1.0  # every feature feeds the one logit
    return AttributionGraph(prompt=prompt, token_ids=torch.tensor(ids), tokens=[str(i) for i in ids],
                            n_layers=int(model.cfg.n_layers), features=torch.tensor(feats), activations=torch.tensor(acts),
                            logit_ids=torch.tensor([0]), logit_probs=torch.tensor([1.0]), logit_tokens=["!"],
                            adjacency=adj, error_norms=torch.zeros(int(model.cfg.n_layers), n_pos))


def _final_norm_weight(model) -> torch.Tensor:
    """The final RMSNorm's weight as stored (the HF module's parameter, not a measurement)."""
    mod = model.ln_final
    orig = getattr(mod, "original_component", None) or getattr(mod, "_original_component", None)
    assert orig is not None
    return orig.weight.detach().float()


def test_card_logit_readout_is_the_decoder_row_through_norm_weight_and_unembedding():
    from helpers import make_perturbed

    model = make_perturbed("llama", process_weights=False)  # final RMSNorm weight far from 1
    dset = _random_set(model)
    graph = _prompt_graph(model, dset)
    cards = feature_cards(model, dset, graph, [0, graph.n_features - 1], contexts=0, top_tokens=6)
    w = _final_norm_weight(model)
    assert (w - 1).abs().max() > 0.1
    W_U = model.W_U.detach().float()
    for node, card in cards.items():
        L, p, f = graph.features[node].tolist()
        assert (card["layer"], card["position"], card["feature"]) == (L, p, f)
        assert card["activation"] == pytest.approx(float(graph.activations[node]), abs=0)
        scores = (dset[L].W_dec[f].detach().float() * w) @ W_U
        scores = scores - scores.mean()
        up, down = torch.topk(scores, 6), torch.topk(-scores, 6)
        assert [t["token_id"] for t in card["top_tokens"]] == up.indices.tolist()
        assert [t["token_id"] for t in card["bottom_tokens"]] == down.indices.tolist()
        np.testing.assert_allclose([t["logit"] for t in card["top_tokens"]], up.values.numpy(), atol=1e-4)
        np.testing.assert_allclose([t["logit"] for t in card["bottom_tokens"]], -down.values.numpy(), atol=1e-4)
        assert card["readout_rule"] == READOUT_RULE and card["contexts"] == []


def test_card_contexts_from_a_corpus_pass_are_the_top_activations(tiny_gpt2):
    from tracekit.corpus import iter_documents, token_windows

    model = tiny_gpt2
    dset = _random_set(model, seed=1)
    graph = _prompt_graph(model, dset)
    nodes = list(range(graph.n_features))[:5]
    kw: dict = dict(contexts=3, top_tokens=4, seq_len=24, max_tokens=240, batch_size=4)
    cards = feature_cards(model, dset, graph, nodes, **kw)
    windows = [list(w.ids) for w in token_windows(model, iter_documents(None), seq_len=24, max_tokens=240)]
    hooks = [dset[L].hook_in for L in dset.layers]
    acts = {}
    for wi, ids in enumerate(windows):
        cache = _hook_in(model, ids, hooks)
        for L in dset.layers:
            acts[(L, wi)] = dset[L].encode(cache[dset[L].hook_in][0]).detach()
    bos = model.tokenizer.bos_token_id
    for n in nodes:
        L, _, f = graph.features[n].tolist()
        card = cards[n]
        assert card["source"] == "corpus" and 0 < len(card["contexts"]) <= 3
        allv = torch.cat([acts[(L, wi)][[i for i, t in enumerate(ids) if t != bos], f]
                          for wi, ids in enumerate(windows)])
        best = torch.sort(allv[allv > 0], descending=True).values[:len(card["contexts"])]
        got = [c["activation"] for c in card["contexts"]]
        np.testing.assert_allclose(got, best.numpy(), atol=1e-5)
        for c in card["contexts"]:
            ids = windows[c["row"]]
            assert c["activation"] == pytest.approx(float(acts[(L, c["row"])][c["position"], f]), abs=1e-5)
            from tracekit.tokens import token_texts

            assert c["tokens"][c["at"]] == token_texts(model, [ids[c["position"]]])[0]
    # a memory budget that runs the corpus pass one window at a time (batch_size 4): the same cards
    from tracekit.activations.chunking import forward_row_bytes

    per_window = forward_row_bytes(model, 24) + 3 * 4 * 24 * sum(dset[L].d_sae for L in dset.layers)
    with memory_budget(int(1.5 * per_window)):
        small = feature_cards(model, dset, graph, nodes, **kw)
    assert small == cards


def test_card_contexts_from_a_store(tiny_gpt2, tmp_path):
    from tracekit.activations import ActivationStore, corpus_rows, write_store

    model = tiny_gpt2
    dset = _random_set(model, seed=2)
    graph = _prompt_graph(model, dset)
    hooks = [dset[L].hook_in for L in dset.layers]
    write_store(model, corpus_rows(model, None, 16, 160, position="all"), hooks, tmp_path / "store",
                position="all", source={"kind": "corpus"}, dtype="float32")
    nodes = list(range(min(4, graph.n_features)))
    cards = feature_cards(model, dset, graph, nodes, store=tmp_path / "store", contexts=4, before=3, after=2)
    with ActivationStore(tmp_path / "store") as st:
        rows, positions, toks = st.rows, st.positions, st.token_ids
        for n in nodes:
            L, _, f = graph.features[n].tolist()
            card = cards[n]
            assert card["source"] == "store"
            a = dset[L].encode(st.get(dset[L].hook_in).float())[:, f].detach()
            best = torch.sort(a[a > 0], descending=True).values[:4]
            np.testing.assert_allclose([c["activation"] for c in card["contexts"]], best.numpy(), atol=1e-5)
            for c in card["contexts"]:
                same = np.nonzero((rows == c["row"]) & (positions >= c["position"] - 3)
                                  & (positions <= c["position"] + 2))[0]
                same = same[np.argsort(positions[same])]
                from tracekit.tokens import token_texts

                assert c["tokens"] == token_texts(model, [int(t) for t in toks[same]])
                assert c["tokens"][c["at"]] == token_texts(model, [int(toks[same][c["at"]])])[0]
                assert positions[same][c["at"]] == c["position"]
        # a budget that reads the store a few examples at a time: the same contexts
        from tracekit.graphs.cards import _store_contexts

        by_layer: dict = {}
        for n in nodes:
            by_layer.setdefault(int(graph.features[n, 0]), []).append(int(graph.features[n, 2]))
        whole = _store_contexts(model, dset, by_layer, st, 4, 3, 2)
        with memory_budget(4 * 5 * (64 + 2 * 24)):  # 5 examples per read
            assert _store_contexts(model, dset, by_layer, st, 4, 3, 2) == whole
        for n in nodes:
            L, _, f = graph.features[n].tolist()
            assert whole[(L, f)] == cards[n]["contexts"]


def test_cards_refuse_bad_input(tiny_gpt2, tmp_path):
    from tracekit.activations import StoreError, corpus_rows, write_store

    model = tiny_gpt2
    dset = _random_set(model)
    graph = _prompt_graph(model, dset)
    with pytest.raises(AttributionError, match="not a feature node"):
        feature_cards(model, dset, graph, [graph.n_features])  # the first error node
    partial = DictionarySet({0: dset[0]})
    later = [i for i in range(graph.n_features) if int(graph.features[i, 0]) > 0]
    with pytest.raises(AttributionError, match="no transcoder for layer"):
        feature_cards(model, partial, graph, later[:1])
    # a store without the transcoders' hook
    write_store(model, corpus_rows(model, None, 16, 48, position="all"), ["blocks.0.hook_resid_post"],
                tmp_path / "other", position="all", source={"kind": "corpus"})
    with pytest.raises(StoreError, match="has no"):
        feature_cards(model, dset, graph, [0], store=tmp_path / "other")
    with pytest.raises(MemoryBudgetError):
        with memory_budget("1KiB"):
            feature_cards(model, dset, graph, [0], contexts=0)
    # no state left behind: no hook on the model, gradients untouched
    assert all(not hp.fwd_hooks for hp in model.hook_dict.values())
    assert all(p.grad is None for p in model.parameters())


def test_cards_show_on_the_page_and_label_the_json(tiny_gpt2):
    model = tiny_gpt2
    dset = _random_set(model)
    graph = _prompt_graph(model, dset)
    cards = feature_cards(model, dset, graph, [0, 1], contexts=2, max_tokens=96, seq_len=16)
    data = graph_json(graph, None, slug="c", cards=cards)
    by_id = {n["node_id"]: n for n in data["nodes"]}
    assert by_id[node_ids(graph)[0]]["clerp"] == cards[0]["clerp"]
    assert by_id[node_ids(graph)[2]]["clerp"] == ""  # no card
    assert cards[0]["clerp"].startswith("→ ")
    json.dumps(cards, allow_nan=False)  # JSON-able as they are


# ---------------------------------------------------------------------------------------------
# a real graph (build_graph on a tiny model with a random transcoder set) through every output


def _real_graph(model, dset, prompt="The capital of France is"):
    from tracekit.graphs.attribution import build_graph
    from tracekit.tokens import encode

    ids = torch.tensor(encode(model, prompt))
    with torch.no_grad():
        target = int(model(ids[None])[0, -1].argmax())
    return build_graph(model, dset, ids, prompt=prompt, target=target)


def test_real_graph_tables_json_page_and_cards(tiny_gpt2, tmp_path):
    model = tiny_gpt2
    dset = _random_set(model, d_sae=32, seed=4)
    graph = _real_graph(model, dset)
    prune = prune_graph(graph)
    verification = verify_graph(model, dset, graph, top_k=3, n_random=2)
    nodes, edges = graph_tables(graph, prune)
    assert nodes["kept"].tolist() == prune.node_mask.tolist() and 0 < int(prune.node_mask.sum()) < graph.n_nodes
    assert len(nodes) == graph.n_nodes and nodes["node_id"].is_unique
    adj = graph.adjacency
    assert all(w == float(adj[t, s]) for s, t, w in zip(edges["source"], edges["target"], edges["weight"]))
    assert len(edges) > 0
    data = graph_json(graph, prune, slug="tiny-real")
    Model.model_validate_json(json.dumps(data, allow_nan=False))
    acts = {node_ids(graph)[i]: float(graph.activations[i]) for i in range(graph.n_features)}
    for n in data["nodes"]:
        if n["feature_type"] == "cross layer transcoder":
            assert n["activation"] == acts[n["node_id"]]
    feats = nodes.iloc[:graph.n_features]
    order = np.argsort(-np.nan_to_num(feats["influence"].to_numpy(float), nan=0.0), kind="stable")[:3]
    top = [int(i) for i in feats["node"].to_numpy()[order]]
    cards = feature_cards(model, dset, graph, top, contexts=2, seq_len=16, max_tokens=96)
    path = write_graph_html(graph, prune, tmp_path / "g.html", cards=cards, verification=verification)
    html = path.read_text(encoding="utf-8")
    page = _page_data(html)
    # the intervention table (one row per checked feature) is on the page
    n_checked = len(verification["intervention"]["table"])
    m = re.search(r'<h2>Verification: intervention.table</h2>\s*<table[^>]*>(.*?)</table>', html, re.S)
    assert m and m.group(1).count("<tr>") == n_checked + 1 and n_checked > 0
    assert set(page["cards"]) <= {str(i) for i in top}
    assert {int(k) for k in page["nodes"]} >= set(range(graph.token_offset, graph.n_nodes))  # tokens and logits


def test_layout_puts_layers_bottom_up_positions_left_to_right_inside_the_drawing():
    from tracekit.graphs.view import _BOTTOM, _COL_W, _LEFT, _RIGHT, _ROW_H, _TOP, graph_layout

    for graph in (toy_graph(), toy_graph(features=[[0, 0, 1], [1, 0, 2]], tokens=["<bos>"])):
        nodes, _ = graph_tables(graph, None)
        pos = graph_layout(nodes, graph.n_pos, graph.n_layers)
        assert set(pos) == set(range(graph.n_nodes))
        width = _LEFT + graph.n_pos * _COL_W + _RIGHT
        height = _TOP + (graph.n_layers + 2) * _ROW_H + _BOTTOM
        assert all(_LEFT <= x <= width - _RIGHT and _TOP <= y <= height - _BOTTOM for x, y in pos.values())
        layer = dict(zip(nodes["node"].tolist(), nodes["layer"].tolist()))
        where = dict(zip(nodes["node"].tolist(), nodes["position"].tolist()))
        for a in pos:
            for b in pos:
                if layer[a] < layer[b]:
                    assert pos[a][1] > pos[b][1]  # a lower layer is drawn lower (SVG y grows downwards)
                if layer[a] == layer[b] and layer[a] < graph.n_layers and where[a] < where[b]:
                    assert pos[a][0] < pos[b][0]  # left to right by position
        assert len(set(pos.values())) == len(pos)  # no two nodes on the same spot

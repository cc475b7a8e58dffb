"""Pieces of :mod:`tracekit.circuits` that need no model: the faithfulness measures (MIB's CPR and
CMD, bootstrap intervals), the verification statistics (:func:`compare`, :func:`choose_checked`)
and the graph (edges counted by hand, edge names, receivers and node circuits under grouped-query
attention). The graph is built from a config alone: a 3-layer model with 4 query heads, and 4
(GPT-2-like) or 2 (Llama-like, GQA) key/value heads.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tracekit.circuits.faithfulness import circuit_from_edges, circuit_from_nodes, faithfulness_measures, top_k_circuits
from tracekit.circuits.graph import build_graph
from tracekit.circuits.verification import choose_checked, compare
from tracekit.errors import CircuitError


def _graph(n_kv: int = 2, n_layers: int = 3, n_heads: int = 4):
    """The graph of a config-only tiny model (``build_graph`` reads ``model.cfg`` only)."""
    cfg = SimpleNamespace(n_layers=n_layers, n_heads=n_heads, n_key_value_heads=n_kv, parallel_attn_mlp=False)

    def refuse(*a, **k):
        raise AssertionError("build_graph does not run the model")

    return build_graph(SimpleNamespace(cfg=cfg, tokenizer=None, hook_dict={}, __call__=refuse, run_with_cache=refuse,
                                       run_with_hooks=refuse, hooks=refuse))


# -- faithfulness measures -------------------------------------------------------------------------------


def test_faithfulness_measures_on_a_hand_made_curve():
    # 2 rows: mean full 2, mean empty 0; circuits at fractions 0.1 and 0.5 with mean metric 0.5 and 1.5
    values = np.array([[0.4, 0.6], [1.0, 2.0]])
    full, empty = np.array([1.5, 2.5]), np.array([0.2, -0.2])
    out = faithfulness_measures(values, full, empty, [0.1, 0.5], n_boot=0)
    assert out["faithfulness"] == pytest.approx([0.25, 0.75], abs=1e-12)
    # trapezoids over x = [0, 0.1, 0.5, 1] with f = [0, 0.25, 0.75, 1] (the ends are added)
    cpr = 0.5 * (0.1 * 0.25) + 0.4 * (0.25 + 0.75) / 2 + 0.5 * (0.75 + 1) / 2
    cmd = 0.1 * (1 + 0.75) / 2 + 0.4 * (0.75 + 0.25) / 2 + 0.5 * (0.25 + 0) / 2
    assert out["cpr"] == pytest.approx(cpr, abs=1e-12) and out["cpr"] == pytest.approx(0.65, abs=1e-12)
    assert out["cmd"] == pytest.approx(cmd, abs=1e-12) and out["cmd"] == pytest.approx(0.3500, abs=1e-12)
    assert out["ci_low"] is None and out["ci_high"] is None and out["cpr_ci"] is None and out["cmd_ci"] is None


def test_faithfulness_measures_use_given_ends_and_a_ratio_of_means():
    # fraction 1 evaluated (f = 0.9, not forced to 1); no 0 point given: (0, 0) is added
    values = np.array([[1.0, 3.0], [1.8, 1.8]])  # row means 2 and 1.8
    full, empty = np.array([4.0, 0.0]), np.array([0.0, 0.0])  # mean full 2: ratio of means, not mean of ratios
    out = faithfulness_measures(values, full, empty, [0.5, 1.0], n_boot=0)
    assert out["faithfulness"] == pytest.approx([1.0, 0.9], abs=1e-12)
    assert out["cpr"] == pytest.approx(0.5 * (0 + 1.0) / 2 + 0.5 * (1.0 + 0.9) / 2, abs=1e-12)
    assert out["cmd"] == pytest.approx(0.5 * (1 + 0) / 2 + 0.5 * (0 + 0.1) / 2, abs=1e-12)
    # full == empty: faithfulness undefined
    same = faithfulness_measures(values, empty, empty, [0.5, 1.0], n_boot=0)
    assert np.isnan(same["faithfulness"]).all()


def test_bootstrap_intervals_contain_the_estimate():
    rng = np.random.default_rng(0)
    n = 40
    full = 2.0 + 0.3 * rng.standard_normal(n)
    empty = 0.3 * rng.standard_normal(n)
    values = np.stack([0.5 + 0.3 * rng.standard_normal(n), 1.5 + 0.3 * rng.standard_normal(n)])
    out = faithfulness_measures(values, full, empty, [0.1, 0.5], n_boot=300, seed=1)
    for f, lo, hi in zip(out["faithfulness"], out["ci_low"], out["ci_high"]):
        assert lo < f < hi and hi - lo < 0.5
    assert out["cpr_ci"][0] < out["cpr"] < out["cpr_ci"][1]
    assert out["cmd_ci"][0] < out["cmd"] < out["cmd_ci"][1]
    again = faithfulness_measures(values, full, empty, [0.1, 0.5], n_boot=300, seed=1)
    assert again["ci_low"] == out["ci_low"] and again["cpr_ci"] == out["cpr_ci"]  # seeded
    other = faithfulness_measures(values, full, empty, [0.1, 0.5], n_boot=300, seed=2)
    assert other["ci_low"] != out["ci_low"]
    # identical rows: every resample is the sample, the interval is the point
    flat = faithfulness_measures(np.ones((1, 5)), np.full(5, 2.0), np.zeros(5), [0.5], n_boot=50)
    assert flat["ci_low"] == pytest.approx([0.5]) and flat["ci_high"] == pytest.approx([0.5])
    # no bootstrap, or a single row: no intervals
    for vals, fu, em, nb in ((values, full, empty, 0), (values[:, :1], full[:1], empty[:1], 300)):
        none = faithfulness_measures(vals, fu, em, [0.1, 0.5], n_boot=nb)
        assert none["ci_low"] is None and none["ci_high"] is None and none["cpr_ci"] is None and none["cmd_ci"] is None
        assert none["cpr"] is not None


# -- verification statistics -----------------------------------------------------------------------------


def test_compare_identical_effects():
    e = np.array([0.5, -0.2, 0.1, 0.05, -0.01, 0.3])
    out = compare(e, e.copy(), [f"s{i}" for i in range(6)], np.array([True] * 3 + [False] * 3),
                  np.arange(1, 7), top_k=3)
    assert out["pearson"] == pytest.approx(1.0, abs=1e-12) and out["spearman"] == pytest.approx(1.0, abs=1e-12)
    assert out["sign_agreement"] == 1.0 and out["max_abs_error"] == 0.0
    assert out["n_checked"] == 6 and out["n_top"] == 3 and out["n_random"] == 3
    assert "checked sites only" in out["note"]


def test_compare_finds_a_planted_false_negative():
    labels = [f"s{i}" for i in range(8)]
    approx = np.array([4.0, 3.0, 2.0, 1.5, 0.1, -0.2, 0.05, 0.3])
    exact = np.array([4.1, 2.9, 2.0, 1.4, 1e-8, 0.25, 5.0, 0.3])  # s6: the largest exact effect, ranked 30th
    in_top = np.array([True] * 4 + [False] * 4)
    rank = np.array([1, 2, 3, 4, 20, 15, 30, 10])
    out = compare(approx, exact, labels, in_top, rank, top_k=4)
    # exact top-4: s6, s0, s1, s2; the approximation's top-4 has three of them
    assert out["top_k_recall"] == pytest.approx(3 / 4)
    # s4's exact effect (1e-8) has no sign; s5's is the wrong one: 6 of 7
    assert out["sign_agreement"] == pytest.approx(6 / 7)
    fn = out["worst_false_negatives"]
    assert [w["site"] for w in fn] == ["s6", "s7", "s5", "s4"]
    assert fn[0] == {"site": "s6", "exact": 5.0, "approx": 0.05, "approx_rank": 30}
    assert out["largest_errors"][0]["site"] == "s6" and out["max_abs_error"] == pytest.approx(4.95)
    assert [w["site"] for w in out["largest_errors"]][1] == "s5"  # |0.25 - -0.2| = 0.45, the next largest
    assert out["pearson"] == pytest.approx(np.corrcoef(approx, exact)[0, 1])
    # a NaN effect is left out of every number
    exact_nan = exact.copy()
    exact_nan[6] = np.nan
    out = compare(approx, exact_nan, labels, in_top, rank, top_k=4)
    assert out["n_checked"] == 7 and out["top_k_recall"] == 1.0 and "s6" not in [w["site"] for w in
                                                                                    out["worst_false_negatives"]]


def test_choose_checked_top_k_and_a_seeded_disjoint_sample():
    rng = np.random.default_rng(0)
    eff = rng.standard_normal(50)
    eff[7] = np.nan  # counts as 0
    top, sample = choose_checked(eff, 5, 10, seed=3)
    want = np.argsort(-np.abs(np.nan_to_num(eff)))[:5]
    assert list(top) == list(want)
    assert len(sample) == 10 and len(set(sample)) == 10 and list(sample) == sorted(sample)
    assert not set(top) & set(sample) and all(0 <= i < 50 for i in sample)
    assert list(choose_checked(eff, 5, 10, seed=3)[1]) == list(sample)
    assert list(choose_checked(eff, 5, 10, seed=4)[1]) != list(sample)
    # fewer sites than asked: everything is checked once
    top, sample = choose_checked(eff[:8], 5, 10, seed=3)
    assert sorted(list(top) + list(sample)) == list(range(8))
    top, sample = choose_checked(eff[:3], 5, 10, seed=3)
    assert sorted(top) == [0, 1, 2] and len(sample) == 0


# -- graph -------------------------------------------------------------------------------------------------


def _count_edges_by_hand(n_layers: int, n_heads: int, n_kv: int) -> int:
    """Edges ``u -> v`` with ``u`` writing before ``v`` reads, from the block structure: a block's
    attention inputs (q per head, k and v per key/value head) read the input and every earlier
    block's heads and MLP; its MLP reads those and its own heads; the logits read everything."""
    ups = [("input", -1)] + [(kind, L) for L in range(n_layers) for kind in ["head"] * n_heads + ["mlp"]]
    downs = [(kind, L) for L in range(n_layers) for kind in ["attn_in"] * (n_heads + 2 * n_kv) + ["mlp"]]
    downs.append(("logits", n_layers))
    n = 0
    for uk, ul in ups:
        for vk, vl in downs:
            same_block_head_to_mlp = uk == "head" and vk == "mlp" and ul == vl
            n += ul < vl or same_block_head_to_mlp
    return n


@pytest.mark.parametrize("n_kv,n_edges", [(4, 262), (2, 190)])
def test_graph_edges_counted_by_hand(n_kv, n_edges):
    g = _graph(n_kv)
    assert g.n_edges == _count_edges_by_hand(3, 4, n_kv) == n_edges
    assert len(g.upstream) == 1 + 3 * 5 and len(g.downstream) == 3 * (4 + 2 * n_kv + 1) + 1
    names = g.edge_names()
    assert len(names) == len(set(names)) == n_edges
    for e in ("input->a0.h0<q>", "a0.h1->a1.h0<q>", "a1.h0->m1", "m0->a1.h1<v>", "m2->logits", "a2.h3->logits"):
        assert e in names, e
    for e in ("a1.h0->a1.h1<q>", "m1->a1.h0<q>", "m1->m1", "a2.h0->m1", "m0->a0.h0<k>"):
        assert e not in names, e


def test_parse_edge_names_and_errors():
    g = _graph(2)
    assert g.parse_edge("a0.h1->a2.h1<k>") == (g.down_index["a2.h1<k>"], g.up_index["a0.h1"])
    assert g.parse_edge(" m0 -> logits ") == (g.down_index["logits"], g.up_index["m0"])
    cases = [("m0 logits", r"edges\[3\]: 'm0 logits' is not an edge; write 'upstream->downstream'"),
             ("x->logits", r"edges\[3\]: 'x' is not an upstream node"),
             ("a0.h4->logits", r"'a0.h4' is not an upstream node.*heads 0..3"),
             ("m0->m9", r"edges\[3\]: 'm9' is not a downstream node"),
             # 2 key/value heads (k0, k1) shared by 4 query heads: a query head's number is refused, naming the right node
             ("a0.h0->a1.h2<k>", r"'a1.h2<k>': query head 2's k input is key/value head 1: write 'a1.h1<k>'"),
             ("a1.h0->a1.h1<q>", r"edges\[3\]: 'a1.h0->a1.h1<q>' is not an edge: a1.h0 writes after a1.h1<q> reads")]
    for name, match in cases:
        with pytest.raises(CircuitError, match=match):
            g.parse_edge(name, "edges[3]")
    with pytest.raises(CircuitError, match=r"edges\[1\]: 'm2->m1'"):
        circuit_from_edges(g, ["m0->m1", "m2->m1"])


def test_receivers_under_grouped_query_attention():
    g = _graph(2)  # 4 query heads share 2 key/value heads: heads 0, 1 -> kv 0; heads 2, 3 -> kv 1
    assert g.receivers_of("a1.h3") == ["a1.h3<q>", "a1.h1<k>", "a1.h1<v>"]
    assert g.receivers_of("a1.h2") == ["a1.h2<q>", "a1.h1<k>", "a1.h1<v>"]
    assert g.receivers_of("a2.h1") == ["a2.h1<q>", "a2.h0<k>", "a2.h0<v>"]
    assert g.receivers_of("a1.h3<q>") == ["a1.h3<q>"] and g.receivers_of("m1") == ["m1"]
    assert g.receivers_of("logits") == ["logits"]
    assert _graph(4).receivers_of("a1.h3") == ["a1.h3<q>", "a1.h3<k>", "a1.h3<v>"]
    for bad in ("a9.h0", "input", "x"):
        with pytest.raises(CircuitError, match="receivers"):
            g.receivers_of(bad)


def _edges(g, circ: torch.Tensor) -> set[str]:
    v, u = circ.nonzero(as_tuple=True)
    return {f"{g.upstream[a]}->{g.downstream[b]}" for a, b in zip(u.tolist(), v.tolist())}


def test_circuit_from_nodes_includes_the_key_value_group_of_its_heads():
    g = _graph(2)
    got = _edges(g, circuit_from_nodes(g, ["a1.h3"]))
    assert got == {"input->a1.h3<q>", "input->a1.h1<k>", "input->a1.h1<v>", "a1.h3->logits", "input->logits"}
    got = _edges(g, circuit_from_nodes(g, ["a0.h0", "a1.h1", "m1"]))
    assert {"a0.h0->a1.h1<q>", "a0.h0->a1.h0<k>", "a0.h0->a1.h0<v>", "a1.h1->m1", "a0.h0->m1", "input->a0.h0<k>",
            "m1->logits"} <= got
    assert not {e for e in got if "a1.h1<k>" in e or "a0.h1" in e or "a1.h0<q>" in e}
    # every head and MLP: the whole graph
    nodes = [u for u in g.upstream if u != "input"]
    assert torch.equal(circuit_from_nodes(g, nodes), g.mask)
    assert _edges(g, circuit_from_nodes(g, [])) == {"input->logits"}
    for bad, i in ((["m0", "input"], 1), (["a0.h7"], 0), (["a1.h1<q>"], 0)):
        with pytest.raises(CircuitError, match=rf"nodes\[{i}\]"):
            circuit_from_nodes(g, bad)


def test_top_k_circuits_rank_edges_inside_the_graph():
    g = _graph(4)
    scores = torch.zeros(g.mask.shape)
    big = {"m0->logits": 3.0, "a1.h2->m1": -2.0, "input->a0.h0<q>": 1.0}
    for e, s in big.items():
        v, u = g.parse_edge(e)
        scores[v, u] = s
    scores[~g.mask] = 100.0  # not edges: never chosen
    c = top_k_circuits(g, scores, [1, 2, 3])
    assert [_edges(g, x) for x in c] == [{"m0->logits"}, {"m0->logits", "a1.h2->m1"}, set(big)]
    signed = top_k_circuits(g, scores, [2], rank_by="signed")[0]
    assert _edges(g, signed) == {"m0->logits", "input->a0.h0<q>"}


def test_a_curve_that_falls_is_flagged_and_its_negative_edges_named():
    """Issue 36 item 7: a faithfulness curve that falls as edges are added (0.991 at 5%, 0.972 at
    10% in the capitals study) is flagged, and the explanation names the added edges of negative
    score between the two sizes (and no edge of the smaller circuit)."""
    import pandas as pd

    from tracekit.circuits.curves import curve_drops, drop_text, ranked_candidates
    from tracekit.circuits.edges import EdgeScores

    g = _graph(4)
    scores = torch.zeros(g.mask.shape)
    planted = {"m0->logits": 3.0, "a1.h2->m1": 2.5,  # the first circuit (size 2)
               "a0.h1->m2": -2.0, "m1->logits": 1.5, "a0.h3->a2.h0<q>": -1.0}  # added for size 5
    for e, s in planted.items():
        v, u = g.parse_edge(e)
        scores[v, u] = s
    nan = torch.full((1,), float("nan"))
    es = EdgeScores(g, scores[None], nan, nan, "file", "denoising", "", 0)
    cand = ranked_candidates(g, es, "edges", [2, 5, 6], (), "abs")
    assert cand.counts == [2, 5, 6]
    curve = pd.DataFrame({"circuit_size": cand.counts, "fraction": [k / g.n_edges for k in cand.counts],
                          "faithfulness": [0.991, 0.972, 0.99], "ci_low": [0.985, 0.96, 0.98],
                          "ci_high": [0.995, 0.98, 1.0]})
    drops = curve_drops(curve, cand, g)
    assert len(drops) == 1
    d = drops[0]
    assert (d["from_size"], d["to_size"]) == (2, 5) and d["drop"] == pytest.approx(0.019)
    assert d["within_ci"] is False and d["n_added"] == 3 and d["n_negative"] == 2
    assert [x["edge"] for x in d["negative_edges"]] == ["a0.h1->m2", "a0.h3->a2.h0<q>"]  # most negative first
    assert d["negative_score_sum"] == pytest.approx(-3.0) and d["added_score_sum"] == pytest.approx(-1.5)
    text = drop_text(d)
    assert "NON-MONOTONE" in text and "a0.h1->m2" in text and "m0->logits" not in text
    # scores whose sign points away from the full model (m(full) < m(empty), or noising): the added
    # positive-score edge is the one that pushes away
    flipped = curve_drops(curve, cand, g, sign=-1.0)[0]
    assert [x["edge"] for x in flipped["negative_edges"]] == ["m1->logits"]
    # a monotone curve: nothing flagged
    assert curve_drops(curve.assign(faithfulness=[0.5, 0.8, 1.0]), cand, g) == []

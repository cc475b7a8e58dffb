"""The attribution-graph page in a real browser: headless Chromium opens ``graph.html`` from disk with
every non-file request blocked; the graph renders (every shown node and kept edge drawn) with no
console error and no failed request; clicking a feature node highlights exactly its incoming and
outgoing edges and shows its feature card (contexts with the activating token marked, logit
readout), with every token text shown literally (no markup injected); nothing is clipped; a
screenshot is saved next to the page. A tiny synthetic graph runs in the default suite.

Needs ``chromium`` (``apt-get install -y chromium``) and Playwright's Python package (``pip install
playwright``; no browser download: the system Chromium is used). Skips with the reason otherwise.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tracekit.graphs import AttributionGraph
from tracekit.graphs.tables import graph_tables
from tracekit.graphs.view import write_graph_html

CHROMIUM = os.environ.get("TRACEKIT_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser") \
    or "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--no-first-run"]
#: Tokens that would break a page that does not escape (tags, entities, quotes, a script end, newline).
NASTY = ["<bos>", "<b>bold</b>", " &amp; \"q\"", "</script><i>x", "\n'y'"]



@dataclass
class StandInPrune:
    """What a PruneResult carries (tracekit.graphs.prune): masks and influence scores."""

    node_mask: torch.Tensor
    edge_mask: torch.Tensor
    cumulative_scores: torch.Tensor
    node_influence: torch.Tensor

def _browser_or_skip():
    try:
        from playwright.sync_api import sync_playwright  # noqa: F401
    except ImportError:
        pytest.skip("playwright is not installed (pip install playwright)")
    if not Path(CHROMIUM).is_file():
        pytest.skip(f"no chromium at {CHROMIUM} (apt-get install -y chromium, or set TRACEKIT_CHROMIUM)")


def _graph() -> AttributionGraph:
    """Features at layers 0-2 with edges from tokens, earlier features and errors; two logits."""
    g = torch.Generator().manual_seed(3)
    n_pos, n_layers = len(NASTY), 3
    feats = torch.tensor([[0, 1, 4], [0, 3, 2], [1, 3, 9], [1, 4, 4], [2, 4, 1]])
    nf, nl = feats.shape[0], 2
    n = nf + n_layers * n_pos + n_pos + nl
    tok0 = nf + n_layers * n_pos
    adj = torch.zeros(n, n)
    for i, (L, p, _) in enumerate(feats.tolist()):
        for s, (Ls, ps, _) in enumerate(feats.tolist()):
            if Ls < L and ps <= p:
                adj[i, s] = float(torch.randn(1, generator=g)) + 0.5
        adj[i, tok0 + p] = 1.0 + float(torch.rand(1, generator=g))
        if L > 0:
            adj[i, nf + (L - 1) * n_pos + p] = -0.4
    for j in range(nl):
        adj[tok0 + n_pos + j, :nf] = torch.randn(nf, generator=g)
        adj[tok0 + n_pos + j, tok0 + n_pos - 1] = 0.7
    return AttributionGraph(
        prompt="".join(NASTY[1:]), token_ids=torch.tensor([0, 11, 22, 33, 44]), tokens=list(NASTY), n_layers=n_layers,
        features=feats, activations=torch.rand(nf, generator=g) + 0.5, logit_ids=torch.tensor([7, 8]),
        logit_probs=torch.tensor([0.7, 0.2]), logit_tokens=[" <Paris>", " Beijing&"], adjacency=adj,
        error_norms=torch.rand(n_layers, n_pos, generator=g), target={"id": 7, "token": " <Paris>"},
        model={"name": "synthetic"})


def _prune(graph: AttributionGraph):
    n = graph.n_nodes
    infl = torch.linspace(1.0, 0.1, n)
    return StandInPrune(node_mask=torch.ones(n, dtype=torch.bool), edge_mask=graph.adjacency != 0,
                           cumulative_scores=torch.cumsum(infl, 0) / infl.sum(), node_influence=infl)


def _card(node: int) -> dict:
    return {"node": node, "layer": 2, "position": 4, "feature": 1, "token": NASTY[4], "activation": 1.25,
            "source": "store", "source_detail": "activation store <s>", "readout_rule": "W_dec[f] @ W_U",
            "contexts": [{"activation": 3.5, "tokens": ["a", "<mark>", " Paris&"], "at": 2, "row": 0, "position": 2}],
            "top_tokens": [{"token": " <Paris>", "token_id": 7, "logit": 2.0}],
            "bottom_tokens": [{"token": " x\"y", "token_id": 9, "logit": -1.0}], "clerp": "→ ' <Paris>'"}


def _verification(graph: AttributionGraph) -> dict:
    """A verification dict shaped as tracekit.graphs.verify.verify_graph's (plus build_graph's checks)."""
    rows = [{"node": i, "layer": L, "pos": p, "feature": f, "activation": 1.0, "influence": 0.5, "influence_rank": i,
             "checked_as": "top" if i < 3 else "random", "predicted": -0.5 * i, "frozen": -0.5 * i,
             "measured": -0.45 * i, "miss": 0.05 * i} for i, (L, p, f) in enumerate(graph.features.tolist())]
    return {"logits_max_abs_error": 1.5e-6, "completeness_max_abs_error": 2e-5,
            "intervention": {"mode": "ablate", "scale": 0.0, "metric": "logit difference ' <Paris>' - ' Beijing&'",
                             "baseline_metric": 3.2, "table": rows,
                             "summary": {"pearson": 0.99, "spearman": 1.0, "sign_agreement": 1.0,
                                         "largest_errors": [{"node": 4, "miss": 0.2, "token": "</td><b>"}]}},
            "scores": {"replacement": 0.81, "completeness": 0.93,
                       "pruned": {"replacement": 0.7, "completeness": 0.9, "n_nodes": 20, "n_edges": 28}}}


def _render(page_path: Path, shot: Path, click: str) -> dict:
    from playwright.sync_api import sync_playwright

    errors, failed, blocked = [], [], []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=ARGS)
        try:
            page = browser.new_page(viewport={"width": 1200, "height": 900})

            def route(r):
                url = r.request.url
                if url.startswith(("file:", "data:")):
                    r.continue_()
                else:
                    blocked.append(url)
                    r.abort()

            page.route("**/*", route)
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.on("requestfailed", lambda r: failed.append(r.url))
            page.goto(page_path.resolve().as_uri(), wait_until="load")
            before = page.evaluate("""() => ({
                nodes: [...document.querySelectorAll('#graph .node')].map(g => Number(g.dataset.node)),
                edges: [...document.querySelectorAll('#graph .edge')].map(e => [Number(e.dataset.s), Number(e.dataset.t)]),
                svg_box: document.getElementById('graph').getBoundingClientRect().toJSON(),
                tokens: [...document.querySelectorAll('#graph text.tok title')].map(t => t.textContent),
                injected: document.querySelectorAll('b, i:not(.legend i)').length,
            })""")
            page.click(click)
            after = page.evaluate("""() => ({
                selected: document.getElementById('graph').classList.contains('selected'),
                hl: [...document.querySelectorAll('#graph .edge.hl')].map(e => [Number(e.dataset.s), Number(e.dataset.t)]),
                panel: document.getElementById('panel').innerText,
                marks: [...document.querySelectorAll('#panel .ctx mark')].map(m => m.textContent),
                card: !!document.querySelector('#panel .card'),
                doc_height: document.documentElement.scrollHeight,
                doc_width: document.documentElement.scrollWidth,
                view_width: document.documentElement.clientWidth,
                clipped: [...document.querySelectorAll('body *')].filter(e => {
                    const st = getComputedStyle(e);
                    const hides = [st.overflowX, st.overflowY].some(o => o !== 'visible');
                    return hides && (e.scrollHeight > e.clientHeight + 1 || e.scrollWidth > e.clientWidth + 1);
                }).map(e => e.tagName + (e.id ? '#' + e.id : '')),
                vtables: [...document.querySelectorAll('table[data-table^="verification"]')].map(
                    t => t.querySelectorAll('tbody tr').length),
                scores: [...document.querySelectorAll('table[data-table="scores"] th')].map(t => t.textContent),
                too_wide: [...document.querySelectorAll('table, svg#graph')].filter(
                    e => e.getBoundingClientRect().right > document.body.getBoundingClientRect().right + 1
                ).map(e => e.dataset.table || e.id),
            })""")
            page.screenshot(path=str(shot), full_page=True)
        finally:
            browser.close()
    from PIL import Image

    with Image.open(shot) as im:
        shot_height = im.size[1]
    return {"errors": errors, "failed": failed, "blocked": blocked, "before": before, "shot_height": shot_height,
            **after}


def test_graph_page_click_shows_card_in_chromium(tmp_path):
    _browser_or_skip()
    graph, target = _graph(), 4  # node 4: the layer-2 feature, inputs from features, a token and an error
    prune = _prune(graph)
    path = write_graph_html(graph, prune, tmp_path / "graph.html", cards={target: _card(target)},
                            verification=_verification(graph))
    out = _render(path, tmp_path / "screenshot.png", f"#n{target}")
    assert out["errors"] == [] and out["failed"] == [] and out["blocked"] == [], out
    nodes, edges = graph_tables(graph, prune)
    drawn = {tuple(e) for e in out["before"]["edges"]}
    assert drawn == set(zip(edges["source"].tolist(), edges["target"].tolist()))
    always = set(nodes.loc[nodes["type"].isin(["token", "logit"]), "node"])  # every token and logit is shown
    assert set(out["before"]["nodes"]) == set(edges["source"]) | set(edges["target"]) | always
    assert out["before"]["injected"] == 0  # no token text became markup
    assert out["before"]["tokens"] == [f"{p}: {t.replace(chr(10), '⏎')!r}" for p, t in enumerate(NASTY)]
    assert out["before"]["svg_box"]["width"] > 400 and out["before"]["svg_box"]["height"] > 200
    # the click: exactly the node's incoming and outgoing edges highlighted, its card shown
    assert out["selected"]
    want = {(s, t) for s, t in drawn if target in (s, t)}
    assert want and {tuple(e) for e in out["hl"]} == want
    assert out["card"] and out["marks"] == [" Paris&"]
    assert "Top activating contexts (store)" in out["panel"] and "<mark>" in out["panel"]
    assert "promotes" in out["panel"] and "\" <Paris>\"" in out["panel"]
    # the verification: its scalars in the side panel, its two tables below the graph
    assert out["vtables"] == [graph.n_features, 1]
    assert {"logits_max_abs_error", "intervention.summary.spearman", "scores.pruned.replacement"} <= set(out["scores"])
    # nothing clipped, nothing wider than the page, the screenshot is the whole document
    assert out["clipped"] == [] and out["too_wide"] == [], out
    assert out["doc_width"] <= out["view_width"]
    assert out["shot_height"] == out["doc_height"]
    keep = os.environ.get("TRACEKIT_SCREENSHOT_DIR")
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        shutil.copy(tmp_path / "screenshot.png", Path(keep) / "graph_page.png")


def test_real_tiny_graph_page_in_chromium(tmp_path):
    """build_graph + prune_graph on a tiny model with a random transcoder set: the page renders, a
    click on the most influential kept feature shows its card (a corpus pass), nothing is clipped."""
    from helpers import make_tiny
    from tracekit.dictionaries.dictionary import Dictionary, DictionarySet
    from tracekit.graphs.attribution import build_graph
    from tracekit.graphs.cards import feature_cards
    from tracekit.graphs.prune import prune_graph
    from tracekit.tokens import encode

    _browser_or_skip()
    model = make_tiny("llama")
    g = torch.Generator().manual_seed(0)
    d = int(model.cfg.d_model)
    dset = {}
    for L in range(int(model.cfg.n_layers)):
        t = Dictionary(d, 16, d, hook_in=f"blocks.{L}.mlp.hook_in", hook_out=f"blocks.{L}.hook_mlp_out", layer=L)
        with torch.no_grad():
            t.W_enc.copy_(torch.randn(d, 16, generator=g) / d ** 0.5)
            t.W_dec.copy_(torch.randn(16, d, generator=g) / 4)
        dset[L] = t
    dset = DictionarySet(dset)
    prompt = "The capital of France is"
    graph = build_graph(model, dset, torch.tensor(encode(model, prompt)), prompt=prompt)
    prune = prune_graph(graph)
    kept = torch.nonzero(prune.node_mask[:graph.n_features]).flatten()
    node = int(kept[torch.argmax(prune.node_influence[kept])])  # the most influential kept feature
    cards = feature_cards(model, dset, graph, [node], contexts=3, seq_len=16, max_tokens=96)
    path = write_graph_html(graph, prune, tmp_path / "graph.html", cards=cards)
    out = _render(path, tmp_path / "screenshot.png", f"#n{node}")
    assert out["errors"] == [] and out["failed"] == [] and out["blocked"] == [], out
    assert out["selected"] and out["hl"] and out["card"] and len(out["marks"]) == len(cards[node]["contexts"]) > 0
    assert "Top activating contexts (corpus)" in out["panel"]
    assert out["clipped"] == [] and out["too_wide"] == [], out
    assert out["doc_width"] <= out["view_width"] and out["shot_height"] == out["doc_height"]

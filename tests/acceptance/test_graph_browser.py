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
from pathlib import Path
from types import SimpleNamespace

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
    return SimpleNamespace(node_mask=torch.ones(n, dtype=torch.bool), edge_mask=graph.adjacency != 0,
                           cumulative_scores=torch.cumsum(infl, 0) / infl.sum(), node_influence=infl)


def _card(node: int) -> dict:
    return {"node": node, "layer": 2, "position": 4, "feature": 1, "token": NASTY[4], "activation": 1.25,
            "source": "store", "source_detail": "activation store <s>", "readout_rule": "W_dec[f] @ W_U",
            "contexts": [{"activation": 3.5, "tokens": ["a", "<mark>", " Paris&"], "at": 2, "row": 0, "position": 2}],
            "top_tokens": [{"token": " <Paris>", "token_id": 7, "logit": 2.0}],
            "bottom_tokens": [{"token": " x\"y", "token_id": 9, "logit": -1.0}], "clerp": "→ ' <Paris>'"}


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
                            verification={"logits_max_abs_error": 1.5e-6, "scores": {"replacement": 0.8},
                                          "interventions": [{"node": 4, "predicted": 0.5, "measured": 0.45}]})
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
    # nothing clipped, nothing wider than the page, the screenshot is the whole document
    assert out["clipped"] == [] and out["too_wide"] == [], out
    assert out["doc_width"] <= out["view_width"]
    assert out["shot_height"] == out["doc_height"]
    keep = os.environ.get("TRACEKIT_SCREENSHOT_DIR")
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        shutil.copy(tmp_path / "screenshot.png", Path(keep) / "graph_page.png")

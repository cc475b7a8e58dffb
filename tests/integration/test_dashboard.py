"""SAE feature dashboards (tracekit.sae.dashboard) on a tiny GPT-2 with a tiny random SAE: the
feature's activation on every token of the user's rows equals the decomposition's, the rows'
read-position activations are marked on the density plot, the SAE's identity is shown (training
hash and config), the title names the hook at most once, and any text renders escaped."""

from __future__ import annotations

import json
import re

import pandas as pd
import pytest
from test_sae import PROMPT, make_sae_dir

from tracekit import Result, SAEFeatures
from tracekit.sae import SAESpec, feature_decomposition, load_sae
from tracekit.sae.dashboard import (
    activation_svg,
    feature_dashboard_html,
    feature_dashboards,
    prompt_activations,
    sae_identity,
    visible_text,
)

HOOK = "blocks.2.hook_resid_pre"
# a row whose text holds a newline, HTML and a tab: rendered escaped, on one line
ODD = "Paris\n<script>alert(1)</script>\tis in"
PROMPTS = [PROMPT, ODD]
KEY = "0123456789abcdef"
TRAIN = {"hook": HOOK, "architecture": "topk", "k": 6, "d_sae": 64}
# the pages print activations with 6 significant digits: relative error <= 5e-6 (float32 activations
# are exact in the tables)
REL = 5e-6


@pytest.fixture(scope="module")
def sae_dir(tmp_path_factory, tiny_gpt2):
    d = make_sae_dir(tmp_path_factory.mktemp("dash"), tiny_gpt2, HOOK, arch="topk", d_sae=64)
    (d / "tracekit_train.json").write_text(json.dumps({"key": KEY, "train": TRAIN}))  # as a tracekit training
    return d


@pytest.fixture(scope="module")
def run(sae_dir, tiny_gpt2):
    exp = SAEFeatures(sae={"path": str(sae_dir)}, prompts=PROMPTS, target=" Paris", foil=" London", top_k=4,
                      dashboards={"features": 2, "max_tokens": 400, "seq_len": 32, "top_n": 3})
    return exp.run(tiny_gpt2, progress=False)


def _spans(page: str, table_class: str) -> list[tuple[int, float, bool]]:
    """``(position, activation, is_read)`` of every token span in the table of ``table_class``."""
    m = re.search(rf"<table class={table_class}>(.*?)</table>", page, re.S)
    assert m, f"no table {table_class}"
    return [(int(p), float(a), "read" in c) for c, p, a in
            re.findall(r'<span class="(tok[^"]*)" data-position="(\d+)" data-activation="([^"]+)"', m.group(1))]


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= REL * max(1.0, abs(b))


def test_prompt_activations_are_the_decompositions(sae_dir, tiny_gpt2):
    h = load_sae(SAESpec(path=str(sae_dir)), tiny_gpt2)
    decs = [feature_decomposition(tiny_gpt2, h, p, " Paris", " London") for p in PROMPTS]
    feats = [3, 17, 40]
    pa = prompt_activations(decs, [10, 11], feats)
    assert len(pa) == sum(len(d.ids) for d in decs) * len(feats)
    for rid, d in zip([10, 11], decs):
        for f in feats:
            g = pa[(pa["row_id"] == rid) & (pa["feature"] == f)].sort_values("position")
            assert g["activation"].tolist() == d.acts[:, f].tolist()  # copied, not recomputed: exact
            assert g["token"].tolist() == d.tokens and g["special"].tolist() == list(d.special)
            assert g[g["read"]]["position"].tolist() == [d.position]
    with pytest.raises(ValueError, match="row ids"):
        prompt_activations(decs, [0], feats)


def test_identity_of_a_trained_sae(sae_dir, tiny_gpt2):
    ident = sae_identity(load_sae(SAESpec(path=str(sae_dir)), tiny_gpt2))
    assert ident["source"] == "directory" and ident["path"] == str(sae_dir)
    assert ident["training_hash"] == KEY and ident["training_config"] == TRAIN
    assert ident["hook"] == HOOK and ident["d_sae"] == 64 and ident["d_in"] == tiny_gpt2.cfg.d_model
    assert ident["architecture"] == "topk"


def test_dashboard_page_prompt_strip_marker_identity(run, sae_dir, tiny_gpt2):
    """The page from the result's tables plus the rows' decompositions (what the kind records)."""
    h = load_sae(SAESpec(path=str(sae_dir)), tiny_gpt2)
    feats = run.meta["dashboard_features"]
    decs = [feature_decomposition(tiny_gpt2, h, p, " Paris", " London") for p in PROMPTS]
    tables = {**run.tables, "prompt_acts": prompt_activations(decs, [0, 1], feats)}
    meta = {**run.meta, "sae_identity": sae_identity(h)}
    pages = feature_dashboards(tables, meta)
    assert sorted(pages) == sorted(feats)
    for f, page in pages.items():
        spans = _spans(page, "prompts")
        want = [(p, float(d.acts[p, f])) for d in decs for p in range(len(d.ids))]
        assert len(spans) == len(want)
        assert all(p == q and _close(a, b) for (p, a, _), (q, b) in zip(spans, want))
        assert [p for p, _, r in spans if r] == [d.position for d in decs]  # read positions outlined
        marks = [float(x) for x in re.findall(r'class="prompt-mark" data-activation="([^"]+)"', page)]
        assert len(marks) == 2 and all(_close(a, float(d.acts[d.position, f])) for a, d in zip(marks, decs))
        h1 = re.search(r"<h1>(.*?)</h1>", page).group(1)
        assert h1 == f"Feature {f} of trained SAE {KEY}" and HOOK not in h1  # the hook is in the table, once
        ident = re.search(r"<table class=identity>(.*?)</table>", page, re.S).group(1)
        assert KEY in ident and "&quot;k&quot;: 6" in ident and HOOK in ident and str(sae_dir) in ident
        assert "<script" not in page and "http://" not in page and "https://" not in page  # self-contained


def test_any_text_renders_escaped():
    toks = ["a\nb", "<script>alert(1)</script>", "\t", "x" * 300, "&amp;", "\x07", '"q"']
    ctx = pd.DataFrame([{"rank": 1, "activation": 2.0, "tokens": json.dumps(toks),
                         "token_acts": json.dumps([0.0, 2.0, 0.5, 1.0, 0.0, 0.1, 0.2])}])
    vocab = pd.DataFrame([{"side": "promoted", "rank": 1, "token": "<b>\n", "logit": 1.5}])
    prompts = pd.DataFrame([{"row_id": 0, "position": i, "token": t, "read": i == 1, "activation": float(i)}
                            for i, t in enumerate(["\n<script>", "</td></tr>", "ok"])])
    rows = pd.DataFrame([{"row_id": 0, "target": "<Paris>", "foil": "\nLondon"}])
    page = feature_dashboard_html(5, "<title>\n", {"<i>": "a\nb"}, ctx, vocab, prompts=prompts, rows=rows,
                                  identity={"source": "directory", "path": "/x/<y>"},
                                  density_svg=activation_svg([0.5, 1.0, 2.0], [("row 0", 1.0)]))
    assert "<script" not in page and "<b>" not in page and "<i>" not in page and "<y>" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page and "&lt;/td&gt;&lt;/tr&gt;" in page
    for cell in re.findall(r"<td class=ctx>(.*?)</td>", page, re.S):
        assert "\n" not in cell and "\t" not in cell and "\x07" not in cell  # one line per row
    assert "<span class=ws>\\n</span>" in page and "<span class=ws>\\t</span>" in page
    assert "<span class=ws>\\x07</span>" in page and "x" * 300 in page
    assert "<title>&lt;title&gt;\\n</title>" in page
    assert visible_text("a\r\nb\u200d") == "a\\r\\nb\\u200d"


def test_density_svg_marks_and_inactive():
    svg = activation_svg([0.2, 0.4, 0.4, 3.0], [("row 0", 0.0), ("row 1", 5.0)], bins=4)
    assert svg.count('class="bar"') == 2  # bins [0,1.25) and [2.5,3.75) hold tokens
    marks = re.findall(r'class="prompt-mark" data-activation="([^"]+)" x1="([^"]+)"', svg)
    assert [float(a) for a, _ in marks] == [0.0, 5.0]
    assert float(marks[0][1]) < float(marks[1][1])  # 0 at the left edge, 5 (the maximum) at the right


def test_kind_records_prompt_acts_identity_and_reloads(run, sae_dir, tiny_gpt2, tmp_path):
    """The kind keeps the rows' per-token activations (``prompt_acts``) and the SAE identity, and
    a saved result renders the same pages."""
    pa = run.tables["prompt_acts"]
    feats = run.meta["dashboard_features"]
    assert sorted(set(pa["feature"])) == sorted(feats) and set(pa["row_id"]) == {0, 1}
    f_tab = run.tables["features"]
    for (rid, f), g in pa[pa["read"]].groupby(["row_id", "feature"]):
        hit = f_tab[(f_tab["row_id"] == rid) & (f_tab["feature"] == f)]["activation"].tolist()
        assert g["activation"].tolist() == (hit or [0.0])  # the same decomposition: exact
    h = load_sae(SAESpec(path=str(sae_dir)), tiny_gpt2)
    for rid, p in enumerate(PROMPTS):  # a row alone vs batched: float32 noise only
        d = feature_decomposition(tiny_gpt2, h, p, " Paris", " London")
        for f in feats:
            g = pa[(pa["row_id"] == rid) & (pa["feature"] == f)].sort_values("position")
            assert g["activation"].tolist() == pytest.approx(d.acts[:, f].tolist(), abs=1e-5)
    assert run.meta["sae_identity"]["training_hash"] == KEY
    out = run.save(tmp_path / "run" / "step")
    pages = {int(p.stem.rsplit("_", 1)[1]): p.read_text(encoding="utf-8") for p in out.glob("dashboard_feature_*.html")}
    assert pages == run.dashboards() == Result.load(out).dashboards()
    assert all('class="prompt-mark"' in p and "<table class=prompts>" in p for p in pages.values())

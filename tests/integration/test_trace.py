"""The token trace (kind ``token_trace``, ``tracekit trace``): every section present, its numbers equal
to the engines' results for the same prompt, and a report that opens offline."""

from __future__ import annotations

import json
import re
from html.parser import HTMLParser
from pathlib import Path

import pandas as pd
import pytest
import torch

import tracekit as tk
from tracekit.logit_lens import landmarks, logit_lens
from tracekit.tokens import forward_kwargs, tokenize
from tracekit.trace import SECTIONS, parse_head

PROMPT = "The capital of China is Beijing. The capital of France is"


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def traced(request, tmp_path_factory):
    from helpers import make_tiny

    model = make_tiny(request.param)
    res = tk.TokenTrace(prompts=PROMPT, target=" Paris", key_max_tokens=256, top_neurons=3).run(model, progress=False)
    d = res.save(tmp_path_factory.mktemp(f"trace-{request.param}") / "trace")
    return model, res, d


class _Collect(HTMLParser):
    def __init__(self):
        super().__init__()
        self.sections, self.tables, self.figures, self.imgs, self.refs = [], [], [], [], []
        self.styles: list[str] = []
        self._in_style = False

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "section":
            self.sections.append(a.get("id"))
        if tag == "table":
            self.tables.append(a.get("data-table"))
        if tag == "figure":
            self.figures.append(a.get("data-figure"))
        if tag == "img":
            self.imgs.append(a.get("src", ""))
        for k in ("src", "href", "data", "action", "poster"):
            if k in a and a[k] is not None:
                self.refs.append(a[k])
        self._in_style = tag == "style"

    def handle_endtag(self, tag):
        if tag == "style":
            self._in_style = False

    def handle_data(self, data):
        if self._in_style:
            self.styles.append(data)


def _parse(html: str) -> _Collect:
    p = _Collect()
    p.feed(html)
    p.close()
    return p


def test_report_has_every_section_with_figures_and_tables(traced):
    _, res, d = traced
    html = (d / "report.html").read_text()
    p = _parse(html)
    assert p.sections == [k for k, _ in SECTIONS]
    for name in ("tokens", "nearest", "analogies", "head_scores", "neurons", "neuron_contexts", "components",
                 "lens", "final_topk", "sampling", "params", "kv_cache"):
        assert name in p.tables, name
    for name in ("embedding_norms", "attention_last_position", "head_scores", "neurons", "components", "lens",
                 "lens_grid", "final_topk", "params"):
        assert name in p.figures, name
    assert p.imgs and all(s.startswith("data:image/png;base64,") and len(s) > 1000 for s in p.imgs)
    assert "No SAE is configured" in html
    md = (d / "report.md").read_text()
    for _, title in SECTIONS:
        assert f"## {title}" in md
    for name in p.figures:
        assert f"]({name}.png)" in md and (d / f"{name}.png").is_file()


def test_report_references_no_external_resource(traced):
    """Browser-free: every src/href is inline (data:) or an in-page anchor; no @import, no url() to the
    network; no script."""
    _, _, d = traced
    html = (d / "report.html").read_text()
    p = _parse(html)
    for r in p.refs:
        assert r.startswith("data:") or r.startswith("#"), r
    css = "\n".join(p.styles)
    assert "@import" not in css and "url(" not in css
    assert not re.search(r"<script|<link|<iframe", html, re.I)
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", html, re.I)


def test_lens_numbers_equal_the_lens_engine(traced):
    model, res, _ = traced
    pl = logit_lens(model, [PROMPT], [" Paris"], position="last")[0]
    probs = pl.target_prob[:, 0, 0].tolist()
    ranks = pl.target_rank[:, 0, 0].tolist()
    lens = res.tables["lens"]
    assert lens["hidden_state"].tolist() == [p.hidden_state for p in pl.points]
    assert (lens["prob"] - pd.Series(probs)).abs().max() < 1e-6
    assert lens["vocab_rank"].tolist() == [int(r) for r in ranks]
    lm = landmarks(lens["hidden_state"].tolist(), probs, ranks)
    s = res.summary()
    assert s["jump_layer"] == lm["jump_layer"] and s["emergence_hidden_state"] == lm["emergence_hidden_state"]
    assert abs(s["target_prob"] - float(pl.final_log_prob[0, 0].exp())) < 1e-6


def test_dla_sums_to_the_model_logit(traced):
    model, res, _ = traced
    comp = res.tables["components"]
    batch = tokenize(model, [PROMPT])
    with torch.no_grad():
        logits = model(batch.tokens, **forward_kwargs(batch)).float()[0, -1]
    tid = res.meta["target_id"]
    assert abs(float(comp["contribution"].sum()) - float(logits[tid])) < 1e-3
    assert abs(res.meta["logit"] - float(logits[tid])) < 1e-4
    n_layers = int(model.cfg.n_layers)
    assert sorted(comp[comp["kind"] == "attn"]["layer"]) == list(range(n_layers))
    assert sorted(comp[comp["kind"] == "mlp"]["layer"]) == list(range(n_layers))
    # the neurons shown are the jump block's and their contributions are part of that MLP's total
    neu = res.tables["neurons"]
    assert set(neu["layer"]) == {res.meta["ffn_layer"]}
    assert (neu["contribution"] - neu["activation"] * neu["logit_per_activation"]).abs().max() < 1e-4


def test_final_topk_and_sampling_match_the_model(traced):
    model, res, _ = traced
    batch = tokenize(model, [PROMPT])
    with torch.no_grad():
        probs = model(batch.tokens, **forward_kwargs(batch)).float()[0, -1].softmax(-1)
    v, i = probs.topk(10)
    fin = res.tables["final_topk"]
    assert fin["token_id"].tolist() == i.tolist()
    assert (fin["prob"] - pd.Series(v.tolist())).abs().max() < 1e-6
    samp = res.tables["sampling"].set_index("setting")
    assert samp.loc["greedy", "kept_tokens"] == 1
    assert samp.loc["top-k=10", "kept_tokens"] == 10
    tid = res.meta["target_id"]
    in_top10 = tid in i.tolist()
    expect = float(probs[tid] / v.sum()) if in_top10 else 0.0
    assert abs(samp.loc["top-k=10", "target_prob"] - expect) < 1e-5  # renormalised over the 10 kept
    assert abs(samp.loc["T=1", "target_prob"] - float(probs[tid])) < 1e-6


def test_tokenization_and_cost(traced):
    model, res, _ = traced
    toks = res.tables["tokens"]
    batch = tokenize(model, [PROMPT])
    assert toks["token_id"].tolist() == list(batch.ids[0])
    assert bool(toks["is_bos"].iloc[0]) == bool(res.meta["tokenization"]["prepend_bos"])
    assert toks[toks["token"] == " capital"]["leading_space"].all()
    c = res.meta["cost"]
    cfg = model.cfg
    kv = int(getattr(cfg, "n_key_value_heads", None) or cfg.n_heads)
    assert c["kv_bytes_per_token"] == 2 * cfg.n_layers * kv * cfg.d_head * 4
    assert res.tables["params"]["parameters"].sum() == c["parameters"]


@pytest.mark.parametrize("tied", [False, True])
def test_parameter_count_is_the_published_one(tied):
    """Llama without biases: embed + layers x (q, k, v, o, gate, up, down, 2 norms) + final norm
    (+ unembedding when untied); the copy and the zero bias that weight processing adds are not
    counted."""
    from helpers import make_tiny
    from tracekit.trace import _cost

    m = make_tiny("llama", tied=tied)
    c = m.cfg
    d, V, kv = c.d_model, c.d_vocab, c.n_key_value_heads * c.d_head
    layer = d * d * 2 + 2 * d * kv + 3 * d * c.d_mlp + 2 * d
    expect = V * d + c.n_layers * layer + d + (0 if tied else V * d)
    params, _, meta = _cost(m, 5, None)
    assert meta["parameters"] == expect and meta["tied_embeddings"] == tied
    assert ("unembed" in set(params["part"])) == (not tied)


def test_attention_rows_are_distributions_and_scores_match(traced):
    model, res, _ = traced
    att = res.tables["attention"]
    sums = att.groupby(["layer", "head_idx"])["weight"].sum()
    assert (sums - 1).abs().max() < 1e-5
    assert len(sums) == model.cfg.n_layers * model.cfg.n_heads
    hs = res.tables["head_scores"]
    assert (hs["weight"] - torch.tensor(hs["score"].to_numpy()).softmax(-1).numpy()).abs().max() < 1e-5
    assert set(res.tables["head_types"]["type"]) <= {"self", "first-token", "previous-token", "content", "diffuse"}


def test_attention_adapter_equals_the_engine_per_layer(tiny_model):
    """The trace reads every layer's last-position pattern row in one pass; it must equal that row of
    the engine's per-layer call."""
    from tracekit.attention import attention_pattern
    from tracekit.trace import _attention

    n = int(tiny_model.cfg.n_layers)
    for ap in _attention(tiny_model, PROMPT, range(n)):
        ref = attention_pattern(tiny_model, PROMPT, ap.layer)
        assert ap.tokens == ref.tokens
        q = len(ref.tokens) - 1
        assert torch.equal(ap.weights, ref.weights[:, q:q + 1, : q + 1])
        want = ref.scores[:, q:q + 1, : q + 1]
        fin = torch.isfinite(want)
        assert torch.equal(fin, torch.isfinite(ap.scores)) and torch.equal(ap.scores[fin], want[fin])


def test_loaded_result_renders_the_same_report(traced):
    _, res, d = traced
    loaded = tk.Result.load(d)
    assert isinstance(loaded, tk.TokenTraceResult)
    assert loaded.summary() == res.summary()
    assert loaded.markdown() == res.markdown()
    assert json.loads((d / "summary.json").read_text())["target"] == " Paris"


def test_bad_inputs_name_the_field(tiny_gpt2):
    with pytest.raises(tk.TokenizationError, match="target"):
        tk.TokenTrace(prompts=PROMPT, target=" Parisian metropolis").run(tiny_gpt2, progress=False)
    with pytest.raises(tk.AttentionError, match="head"):
        parse_head("L9H0", tiny_gpt2)
    with pytest.raises(ValueError, match="renamed to 'target'"):
        tk.TokenTrace(prompts=PROMPT, answer=" Paris")
    with pytest.raises(ValueError, match="renamed to 'prompts'"):
        tk.TokenTrace(prompt=PROMPT)
    with pytest.raises(ValueError, match="one prompt"):
        tk.TokenTrace(prompts=[PROMPT, "Hello"])


def test_config_step_and_cli(tmp_path, tiny_gpt2, monkeypatch):
    """``kind: token_trace`` validates from YAML; the ``trace`` subcommand writes the report."""
    from tracekit import cli
    from tracekit.config import parse_config

    cfg = parse_config({"model": {"name": "gpt2"}, "experiments": [
        {"kind": "token_trace", "prompts": PROMPT, "target": " Paris", "key_max_tokens": 0}]})
    assert cfg.experiments[0].kind == "token_trace"
    monkeypatch.setattr("tracekit.model.load_model", lambda *a, **k: tiny_gpt2)
    rc = cli.main(["trace", PROMPT, "--target", " Paris", "--key-max-tokens", "0", "--out", str(tmp_path / "t")])
    assert rc == 0
    assert (Path(tmp_path / "t") / "report.html").is_file()

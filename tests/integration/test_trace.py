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
from tracekit.experiments.trace import MAX_TABLE_ROWS, TOP_COMPONENTS
from tracekit.logit_lens import landmarks, logit_lens
from tracekit.tokens import forward_kwargs, tokenize
from tracekit.trace import SECTIONS, parse_head

PROMPT = "The capital of China is Beijing. The capital of France is"
FOIL = " Beijing"


@pytest.fixture(scope="module", params=[("gpt2", None), ("llama", FOIL)], ids=["gpt2", "llama-foil"])
def traced(request, tmp_path_factory):
    """A trace without a foil (GPT-2) and one with a foil (Llama, GQA)."""
    from helpers import make_tiny

    arch, foil = request.param
    model = make_tiny(arch)
    res = tk.TokenTrace(prompts=PROMPT, target=" Paris", foil=foil, key_max_tokens=256,
                        top_neurons=3).run(model, progress=False)
    d = res.save(tmp_path_factory.mktemp(f"trace-{arch}") / "trace")
    return model, res, d


def _model_metric(model, target_id, foil_id) -> float:
    """The model's own logit (difference) at the last position."""
    batch = tokenize(model, [PROMPT])
    with torch.no_grad():
        logits = model(batch.tokens, **forward_kwargs(batch)).float()[0, -1]
    return float(logits[target_id] - (logits[foil_id] if foil_id is not None else 0.0))


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
    for name in ("tokens", "nearest", "analogies", "top_heads", "head_scores", "neurons", "neuron_contexts",
                 "components", "lens", "final_topk", "sampling", "params", "kv_cache"):
        assert name in p.tables, name
    for name in ("embedding_norms", "attention_heads", "heads_dla", "head_scores", "neurons", "components", "lens",
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
    """Browser-free: every src/href is inline (data:), an in-page anchor, or a file saved beside the
    report (the linked CSV tables); no @import, no url() to the network; no script."""
    _, _, d = traced
    html = (d / "report.html").read_text()
    p = _parse(html)
    for r in p.refs:
        assert r.startswith("data:") or r.startswith("#") or ("/" not in r and (d / r).is_file()), r
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
    """The components add up to the model's logit difference with a foil, its target logit without."""
    model, res, _ = traced
    comp = res.tables["components"]
    want = _model_metric(model, res.meta["target_id"], res.meta["foil_id"])
    assert abs(float(comp["contribution"].sum()) - want) < 1e-3
    assert abs(res.meta["logit"] - want) < 1e-4
    assert abs(res.meta["target_logit"] - _model_metric(model, res.meta["target_id"], None)) < 1e-4
    n_layers = int(model.cfg.n_layers)
    assert sorted(comp[comp["kind"] == "attn"]["layer"]) == list(range(n_layers))
    assert sorted(comp[comp["kind"] == "mlp"]["layer"]) == list(range(n_layers))
    # the neurons shown are the jump block's and their contributions are part of that MLP's total
    neu = res.tables["neurons"]
    assert set(neu["layer"]) == {res.meta["ffn_layer"]}
    assert (neu["contribution"] - neu["activation"] * neu["logit_per_activation"]).abs().max() < 1e-4


def test_summary_names_a_logit_difference_logit_diff(traced):
    """With a foil the summary's attributed number is ``logit_diff`` (the model's logit difference),
    without one ``logit``; the saved summary and a loaded result say the same (#36)."""
    model, res, d = traced
    s = res.summary()
    want = _model_metric(model, res.meta["target_id"], res.meta["foil_id"])
    name = "logit_diff" if res.meta["foil"] is not None else "logit"
    other = "logit" if name == "logit_diff" else "logit_diff"
    assert abs(s[name] - want) < 1e-3 and other not in s
    assert f"attributed_{name}" in s and f"attributed_{other}" not in s
    assert (" - logit(" in s["metric"]) == (name == "logit_diff")
    saved = json.loads((Path(d) / "summary.json").read_text())
    assert saved[name] == s[name] and other not in saved
    assert tk.Result.load(d).summary()[name] == s[name]


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
    assert set(res.tables["head_types"]["measured_on"]) <= {"this prompt (last token)", "random tokens (2 x 2 x 20)",
                                                            "this prompt; random tokens (2 x 2 x 20) say not previous-token"}


SUBJ_PROMPT = "The capital of France is"  # GPT-2 BPE: BOS, The, capital, of, France, is: ' France' is index 4


def _forced_heads(model, layer: int, subj_head: int, prev_head: int):
    """A hook on ``blocks.{layer}.attn.hook_pattern``: ``subj_head`` puts all of the LAST query's
    attention on the token before it (on the prompt, the subject; on random tokens, one row of many),
    ``prev_head`` attends the previous token from every query (a previous-token head)."""
    def force(act, hook=None):
        act = act.clone()
        q = act.shape[-2]
        act[:, subj_head, -1, :] = 0
        act[:, subj_head, -1, q - 2] = 1
        idx = torch.arange(q)
        act[:, prev_head] = 0
        act[:, prev_head, idx, (idx - 1).clamp(min=0)] = 1
        return act

    model.add_hook(f"blocks.{layer}.attn.hook_pattern", force)


def test_head_on_the_subject_before_the_last_token_is_not_called_previous_token():
    """#36: a head moving the subject (the previous token in this template) to the last token is typed
    by the row's named position ("attends SUBJ"), or "content" without positions; "previous-token" only
    for a head that also attends the previous token on repeated random tokens; each type says what it
    was measured on (table column and report)."""
    from helpers import make_tiny
    from tracekit.trace import token_trace

    model = make_tiny("gpt2")
    L, SH, PH = 1, 2, 3
    _forced_heads(model, L, SH, PH)
    try:
        ids = tokenize(model, [SUBJ_PROMPT]).ids[0]
        subj = len(ids) - 2
        assert model.tokenizer.decode([int(ids[subj])]) == " France"
        with_pos = token_trace(model, SUBJ_PROMPT, " Paris", key_max_tokens=0, positions={"SUBJ": subj, "END": subj + 1})
        bare = token_trace(model, SUBJ_PROMPT, " Paris", key_max_tokens=0)
        row = {"prompt": SUBJ_PROMPT, "target": " Paris", "positions": {"SUBJ": {"text": " France"}, "END": -1}}
        res = tk.TokenTrace(dataset={"rows": [row]}, key_max_tokens=0, top_heads=12).run(model, progress=False)
    finally:
        model.reset_hooks()
    for tables in (with_pos.tables, bare.tables, res.tables):
        ht = tables["head_types"].set_index(["layer", "head_idx"])
        # the one-prompt reading alone says "previous" for both heads
        assert ht.loc[(L, SH), "previous_weight"] > 0.99 and ht.loc[(L, PH), "previous_weight"] > 0.99
        assert ht.loc[(L, SH), "prev_token_score_random"] < 0.4 <= ht.loc[(L, PH), "prev_token_score_random"]
        assert "previous-token" not in ht.loc[(L, SH), "type"]
        assert ht.loc[(L, PH), "type"].startswith("previous-token")
        assert ht.loc[(L, PH), "measured_on"].startswith("random tokens (")
        assert ht["measured_on"].str.len().min() > 0
    for tables in (with_pos.tables, res.tables):
        ht = tables["head_types"].set_index(["layer", "head_idx"])
        assert ht.loc[(L, SH), "type"] == "attends SUBJ" and ht.loc[(L, SH), "top_key_role"] == "SUBJ"
        assert "named positions" in ht.loc[(L, SH), "measured_on"]
        assert ht.loc[(L, PH), "type"] == "previous-token (attends SUBJ)"
    ht = bare.tables["head_types"].set_index(["layer", "head_idx"])
    assert ht.loc[(L, SH), "type"] == "content" and "random tokens" in ht.loc[(L, SH), "measured_on"]
    top = res.tables["top_heads"].set_index("component")
    assert top.loc[f"L{L}H{SH}", "type"] == "attends SUBJ" and "measured_on" in top.columns
    md = res.markdown()
    assert "attends SUBJ" in md and "measured on" in md and "measured_on" in md


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


def _section(html_text: str, sid: str) -> str:
    """The unescaped HTML of one report section."""
    from html import unescape

    m = re.search(rf'<section id="{sid}".*?</section>', html_text, re.S)
    assert m, sid
    return unescape(m.group(0))


def test_captions_name_target_and_foil(traced):
    """Every number that depends on the target/foil says which: the header names both, the FFN text,
    the DLA and head captions name ``logit(target) - logit(foil)`` (``logit(target)`` without a foil);
    the FFN text no longer claims "the target logit" when the numbers are a difference."""
    _, res, d = traced
    html = (d / "report.html").read_text()
    foil = res.meta["foil"]
    metric = "logit(' Paris')" + (f" - logit({foil!r})" if foil else "")
    header = _section(html.replace("<p class=\"meta\">", "<section id=\"header\">", 1), "header")
    assert "' Paris'" in header and ((repr(foil) in header) if foil else "foil" not in header.split("</p>")[0])
    for sid in ("attention", "ffn", "residual"):
        sec = _section(html, sid)
        assert metric in sec, sid
        if not foil:
            assert " - logit(" not in sec, sid
    ffn = _section(html, "ffn")
    assert "target logit" not in ffn
    assert ("contribution_target" in ffn) == bool(foil)
    for fig in ("heads_dla", "attention_heads", "components", "neurons"):
        cap = re.search(rf'data-figure="{fig}">.*?<figcaption>(.*?)</figcaption>', html, re.S)
        assert cap and metric in __import__("html").unescape(cap.group(1)), fig
    md = (d / "report.md").read_text()
    assert metric in md and (repr(foil) in md if foil else True)


def test_long_tables_are_cut_and_linked_not_scrolled(traced):
    """No scroll box (nothing clipped in print): no overflow rule, no fixed-height container; a long
    table shows its top rows and links the full table as a CSV file beside the report, which equals
    the result's table."""
    _, res, d = traced
    html = (d / "report.html").read_text()
    css = "\n".join(_parse(html).styles)
    assert "overflow:" not in css.replace("overflow-wrap", "") and "max-height" not in css
    assert 'class="scroll"' not in html
    for name, body in re.findall(r'<table data-table="(\w+)">(.*?)</table>', html, re.S):
        n_rows = body.count("<tr>") - 1
        assert n_rows <= 64, (name, n_rows)
    comp_rows = re.search(r'<table data-table="components">(.*?)</table>', html, re.S).group(1).count("<tr>") - 1
    assert comp_rows == min(TOP_COMPONENTS, len(res.tables["components"]))
    assert 'href="components.csv"' in html and 'href="heads_dla.csv"' in html
    for name in ("components", "heads_dla"):
        csv = pd.read_csv(d / f"{name}.csv")
        assert list(csv.columns) == list(res.tables[name].columns)
        assert (csv["contribution"] - res.tables[name]["contribution"]).abs().max() < 1e-6
    # the components shown are the largest by |contribution|, in that order
    shown = re.findall(r"<tr><td>([\w.]+)</td>", re.search(r'<table data-table="components">(.*?)</table>', html,
                                                          re.S).group(1))
    comp = res.tables["components"]
    want = comp.reindex(comp["contribution"].abs().sort_values(ascending=False).index)["component"].tolist()
    assert shown == want[:len(shown)]
    assert MAX_TABLE_ROWS >= 10


def test_top_heads_are_ranked_by_dla_and_patterns_equal_the_engine(traced):
    """The small multiples show the heads with the largest |DLA| (from ``heads_dla``), best first;
    each pattern equals the attention engine's; the raw-score head is the top head (no GPT-2 head 6
    here), and its DLA is the ``heads_dla`` entry."""
    from tracekit.attention import attention_pattern

    model, res, _ = traced
    hd, top, hp = res.tables["heads_dla"], res.tables["top_heads"], res.tables["head_patterns"]
    best = hd.reindex(hd["contribution"].abs().sort_values(ascending=False).index).head(len(top))
    assert top["component"].tolist() == best["component"].tolist()
    assert (top["dla"].to_numpy() - best["contribution"].to_numpy() == 0).all()
    assert len(top) == min(6, model.cfg.n_layers * model.cfg.n_heads)
    assert res.meta["head"] == top["component"].iloc[0] and res.meta["head_source"] == "top head by DLA"
    for r in top.itertuples():
        ref = attention_pattern(model, PROMPT, int(r.layer)).weights[int(r.head_idx)]
        sub = hp[hp["component"] == r.component]
        n = ref.shape[0]
        assert len(sub) == n * (n + 1) // 2  # the whole (short) prompt, causal half
        got = torch.tensor(sub["weight"].to_numpy(), dtype=torch.float32)
        want = ref[torch.tensor(sub["query_pos"].to_numpy()), torch.tensor(sub["key_pos"].to_numpy())]
        assert (got - want.float()).abs().max() < 1e-6
        last = res.tables["attention"]
        row = last[(last["layer"] == r.layer) & (last["head_idx"] == r.head_idx)]
        assert r.top_key_pos == int(row.loc[row["weight"].idxmax(), "key_pos"])


def test_shown_head_is_the_articles_only_on_gpt2(tiny_gpt2, tiny_llama):
    """L0H6 only on a GPT-2 with a head 6; a 4-head GPT-2 and a Llama get the prompt's top head; a
    given head wins."""
    from helpers import GPT2_BPE
    from tracekit.model.load import load_model
    from tracekit.model.spec import ModelSpec
    from tracekit.trace import is_gpt2, shown_head

    gpt2_8 = load_model(ModelSpec(name="gpt2", random_init=True, tokenizer=GPT2_BPE, device="cpu",
                                  config_overrides={"n_layer": 1, "n_embd": 64, "n_head": 8, "n_positions": 64}))
    ranked = [(1, 2), (0, 1)]
    assert is_gpt2(gpt2_8) and is_gpt2(tiny_gpt2) and not is_gpt2(tiny_llama)
    assert shown_head(gpt2_8, None, ranked) == ((0, 6), "article (GPT-2)")
    assert shown_head(tiny_gpt2, None, ranked) == ((1, 2), "top head by DLA")
    assert shown_head(tiny_llama, None, ranked) == ((1, 2), "top head by DLA")
    assert shown_head(tiny_llama, (0, 3), ranked) == ((0, 3), "given")
    assert parse_head(None, tiny_llama) is None and parse_head("L1H2", tiny_llama) == (1, 2)


def test_neurons_with_a_foil_show_the_difference_and_the_target_alone(traced):
    """With a foil the neurons are ranked by their contribution to the logit difference (the number
    the caption names); ``contribution_target`` is the target logit alone, and the two differ by the
    foil's own contribution (independent attribution calls)."""
    from tracekit.dla import logit_attribution

    model, res, _ = traced
    neu = res.tables["neurons"]
    L = res.meta["ffn_layer"]
    foil = res.meta["foil"]
    if foil is None:
        assert "contribution_target" not in neu
        return
    diff = logit_attribution(model, [PROMPT], " Paris", foil, neuron_layers=[L])[0].neuron_contrib[L]
    tgt = logit_attribution(model, [PROMPT], " Paris", None, neuron_layers=[L])[0].neuron_contrib[L]
    fo = logit_attribution(model, [PROMPT], foil, None, neuron_layers=[L])[0].neuron_contrib[L]
    ids = neu["neuron"].tolist()
    assert ids == diff.argsort(descending=True)[:len(ids)].tolist()
    assert (neu["contribution"].to_numpy() - diff[ids].numpy()).__abs__().max() < 1e-5
    assert (neu["contribution_target"].to_numpy() - tgt[ids].numpy()).__abs__().max() < 1e-5
    assert (neu["contribution"].to_numpy() - (tgt[ids] - fo[ids]).numpy()).__abs__().max() < 1e-4


def test_sampling_lists_only_kept_tokens(traced):
    """The runners-up of a setting are tokens it keeps: greedy lists one token (no special tokens at
    0.0%), every setting lists min(3, kept) tokens."""
    _, res, _ = traced
    samp = res.tables["sampling"].set_index("setting")

    def n_listed(s: str) -> int:
        return len(re.findall(r" \d+\.\d%(?:, |$)", s))

    assert n_listed(samp.loc["greedy", "top3"]) == 1
    for name, r in samp.iterrows():
        assert n_listed(r["top3"]) == min(3, int(r["kept_tokens"])), name


def test_pieces_of_a_character_show_their_bytes_in_both_reports(tmp_path):
    """A token that is only part of a UTF-8 character (GPT-2's byte-level BPE splits '巴黎') is shown
    as its bytes (``<bytes e5 b7>``) by one display function, in every table and text of report.md
    and report.html alike: never as U+FFFD, which loses which bytes they were."""
    from helpers import make_tiny

    model = make_tiny("gpt2")
    res = tk.TokenTrace(prompts="The capital of China is 北京. 巴黎 is the capital of", target=" France",
                        key_max_tokens=64, top_neurons=2).run(model, progress=False)
    d = res.save(tmp_path / "trace")
    md, html = (d / "report.md").read_text(encoding="utf-8"), (d / "report.html").read_text(encoding="utf-8")
    for name, df in res.tables.items():
        for c in df.columns:
            bad = [v for v in df[c] if isinstance(v, str) and "\ufffd" in v]
            assert not bad, f"table {name}.{c}: {bad[:3]}"
    assert "\ufffd" not in md and "\ufffd" not in html
    in_md = sorted(re.findall(r"<bytes ([0-9a-f ]+)>", md))
    in_html = sorted(re.findall(r"&lt;bytes ([0-9a-f ]+)&gt;", html))
    assert in_md and in_md == in_html  # one display: the same byte pieces in both reports
    keys = res.tables["head_scores"]["key_token"].tolist()
    assert sum(k.startswith("<bytes ") for k in keys) >= 2  # the attention table's keys, not only `tokens`


def test_display_text_shows_a_cut_character_as_bytes(tiny_gpt2):
    """A run of ids cut inside a character (a context window's edge) keeps its whole characters and
    shows the cut pieces as bytes; a run with no cut is the tokenizer's own decode."""
    from tracekit.tokens import display_text, encode, show_token, token_text

    tok = tiny_gpt2.tokenizer
    ids = encode(tiny_gpt2, " 巴黎 is", prepend_bos=False)
    assert display_text(tiny_gpt2, ids) == tok.decode(ids) == " 巴黎 is"
    cuts = [i for i in range(1, len(ids)) if "\ufffd" in tok.decode(ids[i:]) + tok.decode(ids[:i])]
    assert cuts  # GPT-2 splits these characters into byte pieces
    for i in cuts:
        for part in (ids[i:], ids[:i]):
            shown = display_text(tiny_gpt2, part)
            assert "\ufffd" not in shown
            assert shown.endswith(" is") or part == ids[:i]  # whole text after the cut stays text
    pieces = [token_text(tiny_gpt2, i) for i in ids if "\ufffd" in tok.decode([i])]
    assert pieces and all(show_token(p) == p and p.startswith("<bytes ") for p in pieces)
    assert show_token(" Paris") == "' Paris'"


def test_type_heads_on_synthetic_rows():
    """type_heads on hand-made last-token rows (4 keys, query = key 3): a name at the query itself
    (END) never types a self head; a named key that is also the previous token types the head by its
    name unless random tokens make it a previous-token head; without names it is content."""
    from tracekit.attention import classify_heads
    from tracekit.trace import type_heads

    w = torch.tensor([[0.05, 0.05, 0.05, 0.85],   # head 0: self
                      [0.02, 0.03, 0.90, 0.05],   # head 1: on key 2 (the previous token), not prev on random tokens
                      [0.02, 0.03, 0.90, 0.05]])  # head 2: the same here, previous-token on random tokens
    lab = classify_heads(w[:, None, :], queries=[3], rows=[0]).assign(layer=0)
    att = pd.DataFrame({"layer": 0, "head": [h for h in range(3) for _ in range(4)], "key_pos": list(range(4)) * 3,
                        "key_token": ["a", "b", "c", "d"] * 3, "weight": w.reshape(-1).tolist()})
    rand = pd.DataFrame({"layer": 0, "head_idx": [0, 1, 2], "prev_token_score": [0.1, 0.1, 0.9],
                         "induction_score": [0.0, 0.0, 0.0]})
    named = type_heads(lab, att, rand, "random tokens (x)", {"SUBJ": 2, "END": 3}).set_index("head")
    assert list(named["type"]) == ["self", "attends SUBJ", "previous-token (attends SUBJ)"]
    assert list(named["top_key_role"]) == ["", "SUBJ", "SUBJ"]
    assert named.loc[2, "measured_on"].startswith("random tokens (x)")
    bare = type_heads(lab, att, rand, "random tokens (x)").set_index("head")
    assert list(bare["type"]) == ["self", "content", "previous-token"]
    assert list(bare["measured_on"]) == ["this prompt (last token)", "this prompt; random tokens (x) say not previous-token",
                                         "random tokens (x)"]
    none = type_heads(lab, att, rand.iloc[:0], "no random tokens").set_index("head")  # context too short to check
    assert none.loc[1, "type"] == "previous (this prompt only)" and "no random-token check" in none.loc[1, "measured_on"]

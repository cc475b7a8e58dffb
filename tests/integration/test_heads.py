"""Attention pattern tools, head labels and induction / previous-token scores."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tracekit.heads import (
    HeadError,
    attention_pattern,
    classify_heads,
    head_scores,
    pattern_scores,
    resolve_query,
)

ROOT = Path(__file__).resolve().parents[2]


def test_rows_sum_to_one_and_future_is_zero(tiny_model):
    ap = attention_pattern(tiny_model, "The capital of France is a city", layer=1)
    H, Q, K = ap.weights.shape
    assert H == tiny_model.cfg.n_heads and Q == K == len(ap.tokens)
    torch.testing.assert_close(ap.weights.sum(-1), torch.ones(H, Q), atol=1e-5, rtol=0)  # float32 softmax
    future = torch.triu(torch.ones(Q, K, dtype=torch.bool), 1)
    assert (ap.weights[:, future] == 0).all()
    assert torch.isneginf(ap.scores[:, future]).all()
    # weights are the softmax of the scores over visible keys
    torch.testing.assert_close(ap.scores.softmax(-1), ap.weights, atol=1e-6, rtol=0)
    q = ap.query_frame(Q - 1)
    assert len(q) == H * Q and q.groupby("head")["weight"].sum().sub(1).abs().max() < 1e-5


def test_article_prompt_tokens_and_query(gpt2_tokenizer_dir):
    """GPT-2 tokenization of the article prompt (no BOS): ids [464, 3139, 286, 4881, 318], query ' is' at 4."""
    import tracekit as tk
    from helpers import make_tiny

    m = make_tiny("gpt2", gpt2_tokenizer_dir, prepend_bos=False)
    res = tk.AttentionPatterns(prompt="The capital of France is", layer=0, head=2, query=" is").run(m)
    s = res.summary()
    assert s["query_pos"] == 4 and s["query_token"] == " is"
    assert s["tokens"] == ["The", " capital", " of", " France", " is"]
    assert sum(s["weight_by_token"].values()) == pytest.approx(1.0, abs=1e-5)
    assert s["row_sum"] == pytest.approx(1.0, abs=1e-5)
    assert len(res.tables["heads"]) == m.cfg.n_heads
    assert "layer 0 head 2" in res.report()
    assert set(res.figures()) == {"query_row", "pattern", "all_heads"}


def test_resolve_query_and_errors(tiny_gpt2):
    toks = ["<bos>", "The", " cat", " sat", " cat"]
    assert resolve_query(toks, " cat") == 4
    assert resolve_query(toks, -1) == 4 and resolve_query(toks, 1) == 1 and resolve_query(toks, None) == 4
    with pytest.raises(HeadError, match="query: ' dog' is not a token"):
        resolve_query(toks, " dog")
    with pytest.raises(HeadError, match="query: position 9"):
        resolve_query(toks, 9)
    import tracekit as tk

    with pytest.raises(HeadError, match="layer: layer 3 does not exist"):
        tk.AttentionPatterns(prompt="a b", layer=3).run(tiny_gpt2)
    with pytest.raises(HeadError, match="head: head 4 does not exist"):
        tk.AttentionPatterns(prompt="a b", layer=0, head=4).run(tiny_gpt2)


def _synthetic(kind: str, n: int) -> torch.Tensor:
    w = torch.zeros(n, n)
    for q in range(n):
        if kind == "self":
            w[q, q] = 1
        elif kind == "first":
            w[q, 0] = 1
        elif kind == "previous":
            w[q, max(q - 1, 0)] = 1
        elif kind == "spread":
            w[q, : q + 1] = 1.0 / (q + 1)
        elif kind == "content":  # always the same mid-sequence key once visible
            k = 3 if q >= 3 else q
            w[q, k] = 0.7
            w[q, : q + 1] += 0.3 / (q + 1)
            w[q] /= w[q].sum()
    return w


def test_classify_heads_on_synthetic_patterns():
    kinds = ["self", "first", "previous", "spread", "content"]
    w = torch.stack([_synthetic(k, 8) for k in kinds])
    lab = classify_heads(w, queries=range(4, 8))
    assert lab["label"].tolist() == kinds
    one = classify_heads(w, queries=[6])
    assert one.loc[0, "self"] == pytest.approx(1.0) and one.loc[2, "previous"] == pytest.approx(1.0)


def test_pattern_scores_perfect_induction_and_prev_heads():
    half = 6
    r = torch.tensor([11, 12, 13, 14, 15, 16])
    toks = torch.cat([torch.tensor([0]), r, r])  # BOS + r + r
    n = len(toks)
    ind = torch.zeros(n, n)
    prev = torch.zeros(n, n)
    for q in range(n):
        prev[q, max(q - 1, 0)] = 1
        if q >= half + 1:
            ind[q, q - half + 1] = 1  # the token after the earlier copy of toks[q]
        else:
            ind[q, 0] = 1
    sc = pattern_scores(torch.stack([ind, prev]), toks, half + 1)
    assert sc[0, 1] == pytest.approx(1.0) and sc[1, 0] == pytest.approx(1.0)
    assert sc[1, 1] < 0.2 and sc[0, 0] < 0.5
    assert 0 < sc[0, 3] <= 0.5 + 1e-6  # TransformerLens' score divides by every row


def test_head_scores_table(tiny_llama):
    df = head_scores(tiny_llama, seq_len=10, n_seqs=2)
    assert len(df) == tiny_llama.cfg.n_layers * tiny_llama.cfg.n_heads
    for c in ("prev_token_score", "induction_score", "tl_prev_token_score", "tl_induction_score"):
        assert df[c].between(0, 1).all()
    with pytest.raises(HeadError, match="seq_len"):
        head_scores(tiny_llama, seq_len=10_000)


def test_head_scan_experiment(tiny_gpt2, tmp_path):
    import tracekit as tk

    res = tk.HeadScan(seq_len=8, n_seqs=2, prompts=["The capital of France is"]).run(tiny_gpt2)
    s = res.summary()
    assert len(s["top_induction_heads"]) == 5 and sum(s["label_counts"].values()) == 3 * 4
    res.save(tmp_path / "hs")
    assert tk.experiments.Result.load(tmp_path / "hs").summary() == s


@pytest.mark.parametrize("name", ["paris_attention.yaml", "paris_attention_gpt2.yaml", "paris_neurons.yaml",
                                  "paris_neurons_gpt2.yaml"])
def test_shipped_configs_validate(name):
    from tracekit.config import load_config

    cfg, _ = load_config(ROOT / "experiments" / name)
    assert cfg.experiments

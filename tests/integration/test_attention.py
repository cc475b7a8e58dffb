"""Attention (tracekit.attention): patterns, head labels, induction / previous-token scores, and
the attention_pattern / head_scan kinds."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tracekit.attention import (
    AttentionError,
    attention_pattern,
    classify_heads,
    head_scores,
    pattern_scores,
    resolve_position,
)
from tracekit.tokens import TokenizationError

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
    assert len(q) == H * Q and q.groupby("head_idx")["weight"].sum().sub(1).abs().max() < 1e-5


def test_article_prompt_tokens_and_query(gpt2_tokenizer_dir):
    """GPT-2 tokenization of the article prompt (no BOS): ids [464, 3139, 286, 4881, 318], query ' is' at 4."""
    import tracekit as tk
    from helpers import make_tiny

    m = make_tiny("gpt2", gpt2_tokenizer_dir, prepend_bos=False)
    res = tk.AttentionPattern(prompts="The capital of France is", layer=0, head=2, position="token: is").run(m)
    s = res.summary()
    assert s["query_pos_by_row"] == [4] and s["query_token_by_row"] == [" is"]
    assert res.tables["tokens"]["token"].tolist() == ["The", " capital", " of", " France", " is"]
    assert s["keys"] == ["0", "1", "2", "3", "4"]  # keys: all (the prompts have no named positions)
    assert sum(s["mean_attention_by_key"][k]["L0H2"] for k in s["keys"]) == pytest.approx(1.0, abs=1e-5)
    assert s["max_abs_row_sum_error"] < 1e-5 and s["shown_heads"] == [[0, 2]]
    assert len(res.tables["labels"]) == m.cfg.n_heads
    assert "L0H2" in res.report()
    assert set(res.figures()) == {"mean_attention", "patterns"}
    # named token keys: the article's view (GPT-2 Small L0H6: France 35%, capital 35%, The 22%)
    res = tk.AttentionPattern(prompts="The capital of France is", layer=0, head=2, position="token: is",
                              keys=["token:The", "token: capital", "token: France"], scores=True).run(m)
    s = res.summary()
    assert s["keys"] == ["token:The", "token: capital", "token: France"]
    pat = res.tables["pattern"].set_index(["head_idx", "key_pos"])
    assert s["mean_attention_by_key"]["token: France"]["L0H2"] == pytest.approx(pat.loc[(2, 3), "weight"], abs=1e-6)
    assert s["mean_score_by_key"]["token: capital"]["L0H2"] == pytest.approx(pat.loc[(2, 1), "score"], abs=1e-4)


def test_resolve_position_and_errors(tiny_gpt2):
    m = tiny_gpt2  # prepends BOS
    prompt = "The cat sat, the cat"
    n = len(tiny_gpt2.tokenizer(prompt)["input_ids"]) + 1
    assert resolve_position(m, prompt, "token: cat") == n - 1
    assert resolve_position(m, prompt, "token: sat") == 3
    assert resolve_position(m, prompt, -1) == resolve_position(m, prompt, "last") == n - 1
    assert resolve_position(m, prompt, 1) == 1
    with pytest.raises(TokenizationError, match="position: ' dog' does not occur"):
        resolve_position(m, prompt, "token: dog")
    with pytest.raises(TokenizationError, match="position: 9 is out of range"):
        resolve_position(m, prompt, 9)
    with pytest.raises(TokenizationError, match="token: cat"):
        resolve_position(m, prompt, " cat")
    with pytest.raises(TokenizationError, match="not accepted"):
        resolve_position(m, prompt, "all")
    import tracekit as tk

    with pytest.raises(AttentionError, match="layer: layer 3 out of range"):
        tk.AttentionPattern(prompts="a b", layer=3).run(tiny_gpt2)
    with pytest.raises(AttentionError, match="head: head 4 out of range"):
        tk.AttentionPattern(prompts="a b", layer=0, head=4).run(tiny_gpt2)


def test_retired_keys_name_the_new_ones():
    from pydantic import ValidationError

    import tracekit as tk

    with pytest.raises(ValidationError, match="'prompt' was renamed to 'prompts'"):
        tk.AttentionPattern(prompt="a b", layer=0)
    # `query` is the query position again (a dataset name, last, an index or token:<text>); a bare
    # token string is refused with the token: hint under either name
    with pytest.raises(ValidationError, match="query: ' is'.*token: is"):
        tk.AttentionPattern(prompts="a b", layer=0, query=" is")
    with pytest.raises(ValidationError, match="token: is"):
        tk.AttentionPattern(prompts="a is", layer=0, position=" is")
    with pytest.raises(ValidationError, match="query or position"):
        tk.AttentionPattern(prompts="a is", layer=0, position="last", query="last")


@pytest.mark.parametrize("field,value", [("induction_threshold", float("inf")), ("induction_threshold", float("nan")),
                                         ("induction_threshold", 1.5), ("dominance", float("nan")),
                                         ("spread_entropy", float("inf"))])
def test_non_finite_or_out_of_range_thresholds_are_config_errors(field, value):
    from pydantic import ValidationError

    import tracekit as tk

    kind = tk.HeadScan if field == "induction_threshold" else tk.AttentionPattern
    kw = {} if kind is tk.HeadScan else {"prompts": "a b", "layer": 0}
    with pytest.raises(ValidationError, match=field):
        kind(**kw, **{field: value})


def test_yaml_inf_threshold_is_a_config_error(tmp_path):
    from tracekit.config import load_config

    p = tmp_path / "c.yaml"
    p.write_text("model: {name: gpt2}\nexperiments:\n  - kind: head_scan\n    induction_threshold: .inf\n")
    with pytest.raises(ValueError, match="induction_threshold"):
        load_config(p)


def test_check_works_on_model_info(tiny_gpt2):
    import tracekit as tk
    from tracekit.model.info import ModelInfo

    m = tiny_gpt2
    info = ModelInfo(m.tracekit_spec, m.tokenizer, m.cfg, list(m.hook_dict), m._gated_hook_reason)
    tk.AttentionPattern(prompts=["The capital of France is"], layer=-1, head=1, position="token: is").check(info)
    with pytest.raises(TokenizationError, match="position"):
        tk.AttentionPattern(prompts=["The capital"], layer=0, position="token: is").check(info)
    with pytest.raises(AttentionError, match="layer"):
        tk.AttentionPattern(prompts=["The capital"], layer=5).check(info)
    tk.HeadScan(seq_len=8, layers=[0, -1]).check(info)
    tk.HeadScan(seq_len=63).check(info)  # BOS + 2 x 63 = 127 tokens <= 128
    with pytest.raises(AttentionError, match=r"^seq_len: a BOS and two copies of 64 random tokens need 129 positions, "
                                             r"more than model 'gpt2''s context of 128 tokens .*at most 63$"):
        tk.HeadScan(seq_len=64).check(info)
    with pytest.raises(AttentionError, match=r"^seq_len: .*at most 63$"):
        head_scores(m, seq_len=64)
    with pytest.raises(AttentionError, match=r"layers\[1\]"):
        tk.HeadScan(layers=[0, 9]).check(info)


def test_several_prompts(tiny_llama, tmp_path):
    import tracekit as tk

    prompts = ["The capital of France is", "Paris is the capital of France, it is"]
    res = tk.AttentionPattern(prompts=prompts, layer=1, position="token: is").run(tiny_llama)
    pat = res.tables["pattern"]
    assert sorted(pat["row_id"].unique()) == [0, 1]
    one = tk.AttentionPattern(prompts=prompts[1], layer=1, position="token: is").run(tiny_llama)
    q1 = pat[pat["row_id"] == 1].reset_index(drop=True)
    assert q1["weight"].to_numpy() == pytest.approx(one.tables["pattern"]["weight"].to_numpy(), abs=1e-6)
    assert q1["query_token"].iloc[0] == " is" and res.summary()["n_rows"] == 2
    res.save(tmp_path / "ap")
    assert tk.experiments.Result.load(tmp_path / "ap").summary() == res.summary()


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
    with pytest.raises(AttentionError, match="seq_len"):
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


def test_head_on_the_subject_gets_a_role_and_every_label_says_what_it_was_measured_on():
    """#36: at one query per row, a head on the subject that is also the previous token is labelled by
    the row's named position (``attends SUBJ``) beside its positional label; head_scan's previous-token
    type comes from repeated random tokens; labels and scores say what they were measured on."""
    import tracekit as tk
    from helpers import make_tiny

    model = make_tiny("gpt2")
    L, SH, PH = 1, 2, 3

    def force(act, hook=None):  # SH: the LAST query -> the token before it; PH: every query -> previous
        act = act.clone()
        q = act.shape[-2]
        act[:, SH, -1, :] = 0
        act[:, SH, -1, q - 2] = 1
        idx = torch.arange(q)
        act[:, PH] = 0
        act[:, PH, idx, (idx - 1).clamp(min=0)] = 1
        return act

    row = {"prompt": "The capital of France is", "target": " Paris",
           "positions": {"SUBJ": {"text": " France"}, "END": -1}}
    model.add_hook(f"blocks.{L}.attn.hook_pattern", force)
    try:
        ap = tk.AttentionPattern(dataset={"rows": [row, {**row, "prompt": "The capital of Spain is",
                                                         "positions": {"SUBJ": {"text": " Spain"}, "END": -1}}]},
                                 query="END", layers=[L], plot_heads=[[L, SH], [L, PH]]).run(model, progress=False)
        hs = tk.HeadScan(seq_len=8, n_seqs=2, layers=[L], dataset={"rows": [row]}).run(model, progress=False)
    finally:
        model.reset_hooks()
    lab = ap.tables["labels"].set_index(["layer", "head_idx"])
    sub = lab.loc[[(L, SH)]]
    assert (sub["label"] == "previous").all() and (sub["top_key_role"] == "SUBJ").all()
    assert (sub["role"] == "attends SUBJ").all() and (sub["measured_on"] != "").all()
    s = ap.summary()
    assert s["modal_label_by_head"][f"L{L}H{SH}"] == "previous"
    assert s["modal_role_by_head"][f"L{L}H{SH}"] == "attends SUBJ"
    assert s["labels_measured_on"].startswith("2 row(s), query END")
    rep = ap.report()
    assert "attends SUBJ" in rep and "measured on 2 row(s), query END" in rep
    sc = hs.tables["scores"].set_index(["layer", "head_idx"])
    assert "previous-token" in sc.loc[(L, PH), "type"] and "previous-token" not in sc.loc[(L, SH), "type"]
    assert sc["measured_on"].str.startswith("random tokens (2 x 2 x 8").all()
    hsum = hs.summary()
    assert f"L{L}H{PH}" in hsum["previous_token_heads"] and f"L{L}H{SH}" not in hsum["previous_token_heads"]
    assert hsum["labels_measured_on"].startswith("row 0: every query position")
    assert (hs.tables["labels"]["measured_on"] == "row 0, every query position >= 1").all()
    assert "measured on 2 sequences" in hs.report()

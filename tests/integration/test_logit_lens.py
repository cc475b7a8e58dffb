"""Invariants of the logit lens on tiny random GPT-2 and Llama models (offline)."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

import tracekit as tk
from helpers import make_tiny
from tracekit.logit_lens import emergence_hidden_state, landmarks, lens_points
from tracekit.tokens import encode, tokenize

PROMPTS = [
    "The capital of China is Beijing. The capital of France is",
    "The capital of France is",
    "The capital of Italy is",  # differs from the previous prompt by one token
    "Hello",
]
TARGETS = [" Paris", " Rome"]  # tracked on every prompt (track)
ROW_TARGETS = [" Paris", " Paris", " Rome", " Paris"]  # each prompt's own target (target)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("process_weights", [True, False])
@pytest.mark.parametrize("layers", ["hidden_states", "resid_post"])
def test_last_layer_lens_equals_model_output(arch, process_weights, layers, gpt2_tokenizer_dir):
    """The last layer's lens is the model's own softmax output (abs 1e-5, float32): the final norm
    is recomputed from the residual, so reading the last block's output reproduces the logits."""
    model = make_tiny(arch, gpt2_tokenizer_dir, process_weights=process_weights)
    res = tk.LogitLens(prompts=PROMPTS, target=ROW_TARGETS, track=TARGETS, position="all", layer_convention=layers,
                       top_k=5).run(model, progress=False)
    df = res.to_frame()
    last_layer = df["hidden_state"].max()
    batch = tokenize(model, PROMPTS)
    with torch.no_grad():
        logits = model(batch.tokens, **tk.tokens.forward_kwargs(batch))
    probs = logits.float().softmax(-1)
    checked = 0
    for r in df[df["hidden_state"] == last_layer].itertuples():
        pos = batch.real_index(r.prompt_idx)[r.position]
        assert r.target == ROW_TARGETS[r.prompt_idx]  # each prompt's own target
        assert abs(r.prob - probs[r.prompt_idx, pos, r.target_id].item()) < 1e-5
        assert abs(r.top1_prob - probs[r.prompt_idx, pos].max().item()) < 1e-5
        checked += 1
    assert checked == sum(batch.lengths)
    tr = res.tables["tracked"]
    checked = 0
    for r in tr[tr["hidden_state"] == last_layer].itertuples():
        pos = batch.real_index(r.prompt_idx)[r.position]
        assert abs(r.prob - probs[r.prompt_idx, pos, r.tracked_id].item()) < 1e-5
        checked += 1
    assert checked == sum(batch.lengths) * len(TARGETS)
    # and the lens' last layer matches the 'final' table (model output) exactly
    fin = res.tables["final"]
    merged = df[(df["hidden_state"] == last_layer)].merge(fin, on=["prompt_idx", "position", "target"])
    assert len(merged) == sum(batch.lengths)
    assert (merged["prob"] - merged["target_prob"]).abs().max() < 1e-5
    tfin = tr[tr["hidden_state"] == last_layer].merge(fin, on=["prompt_idx", "position"])
    fin_tracked = [p[TARGETS.index(t)] for p, t in zip(tfin["tracked_probs"], tfin["tracked_token"])]
    assert (tfin["prob"] - pd.Series(fin_tracked)).abs().max() < 1e-5


def test_resid_pre_last_layer_is_not_the_output(tiny_gpt2):
    """Sanity check that the comparison above can fail: block inputs miss the last block."""
    res = tk.LogitLens(prompts=PROMPTS[:1], target=" Paris", layer_convention="resid_pre").run(tiny_gpt2, progress=False)
    df = res.to_frame()
    fin = res.tables["final"]
    last = df[df["hidden_state"] == df["hidden_state"].max()]
    assert abs(last["prob"].iloc[0] - fin["target_prob"].iloc[0]) > 1e-9
    assert last["hook"].iloc[0] == f"blocks.{tiny_gpt2.cfg.n_layers - 1}.hook_resid_pre"


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("side", ["left", "right"])
def test_batched_equals_one_by_one(arch, side, gpt2_tokenizer_dir):
    model = make_tiny(arch, gpt2_tokenizer_dir, padding_side=side)
    exp = tk.LogitLens(prompts=PROMPTS, target=ROW_TARGETS, track=TARGETS, position="all", batch_size=len(PROMPTS))
    res = exp.run(model, progress=False)
    for table, key in (("main", ["prompt_idx", "position", "hidden_state"]),
                       ("tracked", ["prompt_idx", "position", "hidden_state", "tracked_token"])):
        batched = res.tables[table]
        singles = []
        for i, (p, t) in enumerate(zip(PROMPTS, ROW_TARGETS)):
            d = exp.model_copy(update={"prompts": [p], "target": t}).run(model, progress=False).tables[table]
            d["prompt_idx"] = i
            singles.append(d)
        single = pd.concat(singles, ignore_index=True)
        a = batched.sort_values(key).reset_index(drop=True)
        b = single.sort_values(key).reset_index(drop=True)
        assert len(a) == len(b) > 0
        if table == "main":
            assert (a["token"] == b["token"]).all() and (a["target"] == b["target"]).all()
            assert (a["entropy"] - b["entropy"]).abs().max() < 1e-4
        assert (a["prob"] - b["prob"]).abs().max() < 1e-5
        assert (a["log_prob"] - b["log_prob"]).abs().max() < 1e-4
        # ranks can differ only where two logits tie within float noise; require near-equality of rank too
        assert ((a["vocab_rank"] - b["vocab_rank"]).abs() <= 1).all()


def test_padding_side_does_not_change_results(gpt2_tokenizer_dir):
    left = make_tiny("llama", gpt2_tokenizer_dir, padding_side="left")
    right = make_tiny("llama", gpt2_tokenizer_dir, padding_side="right")
    exp = tk.LogitLens(prompts=PROMPTS, target=" Paris")
    a = exp.run(left, progress=False).to_frame()
    b = exp.run(right, progress=False).to_frame()
    assert (a["prob"].values - b["prob"].values).__abs__().max() < 1e-5


@pytest.mark.parametrize("prepend", [True, False])
def test_exactly_one_bos(prepend, gpt2_tokenizer_dir):
    model = make_tiny("gpt2", gpt2_tokenizer_dir, prepend_bos=prepend)
    bos = model.tokenizer.bos_token_id
    for text in ["The capital of France is", "Hello", "<|endoftext|> already"]:
        ids = encode(model, text)
        # prompt text is text: a special-token string inside it is split into ordinary tokens
        plain = model.tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        assert ids.count(bos) == (1 if prepend else 0)
        if prepend:
            assert ids[0] == bos and ids[1:] == plain
        else:
            assert ids == plain
    res = tk.LogitLens(prompts=["The capital of France is"], position="all").run(model, progress=False)
    toks = res.tables["tokens"]
    assert (toks["token_id"] == bos).sum() == (1 if prepend else 0)
    if not prepend:  # the article's ids for GPT-2 (no BOS)
        assert toks["token_id"].tolist() == [464, 3139, 286, 4881, 318]


@pytest.mark.parametrize("bad", [" Parisian capital", "Paris is", ""])
def test_multi_token_or_empty_target_is_an_error(tiny_gpt2, bad):
    with pytest.raises(tk.TokenizationError) as e:
        tk.LogitLens(prompts=["x"], target=bad).run(tiny_gpt2, progress=False)
    assert "target" in str(e.value)
    if bad:
        assert "tokens" in str(e.value) and "exactly one token" in str(e.value)


def test_target_without_space_suggests_leading_space(tiny_gpt2):
    # 'Paris' (no space) is one token in GPT-2 too, but ' Paris' is the one that follows 'is'.
    with pytest.raises(tk.TokenizationError, match="leading space"):
        tk.LogitLens(prompts=["x"], target="Beijing").run(tiny_gpt2, progress=False)


def test_save_load_roundtrip(tiny_llama, tmp_path):
    res = tk.LogitLens(prompts=PROMPTS[:2], target=TARGETS, track=TARGETS, position="all").run(tiny_llama,
                                                                                             progress=False)
    res.save(tmp_path / "r")
    back = tk.Result.load(tmp_path / "r")
    assert type(back) is type(res)
    for name, df in res.tables.items():
        pd.testing.assert_frame_equal(df.reset_index(drop=True), back.tables[name].reset_index(drop=True))
    assert back.summary() == res.summary()
    assert {p.name for p in (tmp_path / "r").glob("*.png")} == {"target_by_layer.png", "top1_grid.png", "emergence.png",
                                                                 "tracked_by_layer.png"}
    assert set(back.tables) == {"main", "rows", "topk", "tokens", "final", "tracked"}


def test_summary_fields_and_emergence(tiny_gpt2):
    res = tk.LogitLens(prompts=PROMPTS[:1], target=" Paris").run(tiny_gpt2, progress=False)
    s = res.summary()
    n = tiny_gpt2.cfg.n_layers + 1
    for key in ("target_prob_final", "target_prob_by_hidden_state", "target_rank_by_hidden_state",
                "emergence_hidden_state", "emergence_layer", "jump", "jump_layer"):
        assert key in s
    assert len(s["target_prob_by_hidden_state"]) == len(s["target_rank_by_hidden_state"]) == n
    assert s["hooks"] == [p.hook for p in lens_points(tiny_gpt2.cfg.n_layers, "hidden_states")]
    assert abs(s["target_prob_final"] - s["target_prob_by_hidden_state"][-1]) < 1e-6


def test_resid_post_summary_is_indexed_by_hidden_state(tiny_gpt2):
    """resid_post reads hidden states 1..n: the lists keep index = hidden state, None for h = 0."""
    s = tk.LogitLens(prompts=PROMPTS[:1], target=" Paris", layer_convention="resid_post").run(
        tiny_gpt2, progress=False).summary()
    assert s["target_prob_by_hidden_state"][0] is None and s["hidden_states"] == [1, 2, 3]
    full = tk.LogitLens(prompts=PROMPTS[:1], target=" Paris").run(tiny_gpt2, progress=False).summary()
    assert s["target_prob_by_hidden_state"][1:] == full["target_prob_by_hidden_state"][1:]


def test_emergence_and_jump_definitions():
    assert emergence_hidden_state([0, 1, 2, 3], [5, 1, 2, 1]) == 3
    assert emergence_hidden_state([0, 1, 2, 3], [5, 1, 1, 1]) == 1
    assert emergence_hidden_state([0, 1, 2, 3], [1, 1, 1, 2]) is None
    lm = landmarks([0, 1, 2, 3], [0.0, 0.1, 0.8, 0.9], [9, 5, 1, 1])
    assert lm["emergence_hidden_state"] == 2 and lm["emergence_layer"] == 1  # output of block 1
    assert lm["jump"]["from_hidden_state"] == 1 and lm["jump"]["to_hidden_state"] == 2 and lm["jump_layer"] == 1


def test_retired_keys_name_the_new_ones():
    for old, new in (("positions", "position"), ("layers", "layer_convention")):
        with pytest.raises(Exception, match=new):
            tk.LogitLens(prompts=["x"], **{old: "all" if old == "positions" else "hidden_states"})


def test_lens_invariants_on_perturbed_models(perturbed_model):
    """On models whose norm weights/biases are far from 1/0 (GPT-2, GQA Llama, tied-embedding Llama,
    weight processing on and off): the last hidden state's lens is the model's output (abs 1e-5),
    and batched equals one by one (abs 1e-5). A final-norm or folding bug changes these numbers."""
    m = perturbed_model
    exp = tk.LogitLens(prompts=PROMPTS, target=ROW_TARGETS, position="all", batch_size=len(PROMPTS))
    res = exp.run(m, progress=False)
    df = res.to_frame()
    last = df[df["hidden_state"] == df["hidden_state"].max()]
    batch = tokenize(m, PROMPTS)
    with torch.no_grad():
        logits = m(batch.tokens, **tk.tokens.forward_kwargs(batch)).float()
    lp = logits.log_softmax(-1)
    err = max(abs(r.log_prob - lp[r.prompt_idx, batch.real_index(r.prompt_idx)[r.position], r.target_id].item())
              for r in last.itertuples())
    assert err < 1e-4  # natural-log probabilities, float32
    assert logits.std(-1).min() > 0.3  # spread logits: the comparison is not between near-uniform vectors
    single = pd.concat([exp.model_copy(update={"prompts": [p], "target": t}).run(m, progress=False).to_frame()
                        .assign(prompt_idx=i) for i, (p, t) in enumerate(zip(PROMPTS, ROW_TARGETS))], ignore_index=True)
    key = ["prompt_idx", "position", "hidden_state"]
    a, b = df.sort_values(key).reset_index(drop=True), single.sort_values(key).reset_index(drop=True)
    assert (a["log_prob"] - b["log_prob"]).abs().max() < 1e-4

"""attention_pattern over datasets: every layer and head in one batched pass, named query/key
positions per row, per-row / per-head tables.

The reference is an independent ``transformers`` copy of the same (perturbed, so attention is far
from uniform) weights run with eager attention and ``output_attentions``, one unpadded row at a
time; the kind runs rows of different lengths batched with left or right padding, BOS on and off.
"""

from __future__ import annotations

import contextlib
import copy
import functools

import numpy as np
import pandas as pd
import pytest
import torch

import tracekit as tk
from helpers import GPT2_BPE, tiny_overrides
from tracekit.attention import attention_pattern, classify_heads, query_attention
from tracekit.errors import AttentionError, DatasetError
from tracekit.results import shadowing_columns
from tracekit.tokens import encode

#: Rows of different lengths with named positions (IO, S1, S2 as texts, END as an index).
ROWS = [
    {"prompt": "When Mary and John went to the store, John gave a drink to", "target": " Mary", "foil": " John",
     "positions": {"IO": " Mary", "S1": {"text": " John", "occurrence": 0}, "S2": {"text": " John"}, "END": -1},
     "group": "ABBA"},
    {"prompt": "Then, Bob and Alice had a long and loud argument. Afterwards Bob said to", "target": " Alice", "foil": " Bob",
     "positions": {"IO": " Alice", "S1": {"text": " Bob", "occurrence": 0}, "S2": {"text": " Bob"}, "END": -1},
     "group": "BABA"},
    {"prompt": "So Tom and Sue met; Tom waved to", "target": " Sue", "foil": " Tom",
     "positions": {"IO": " Sue", "S1": {"text": " Tom", "occurrence": 0}, "S2": {"text": " Tom"}, "END": -1},
     "group": "BABA", "template": "short"},
]
NAMES = {0: (" Mary", " John"), 1: (" Alice", " Bob"), 2: (" Sue", " Tom")}
KEYS = ["IO", "S1", "S2"]
SETTINGS = [(side, bos) for side in ("left", "right") for bos in (True, False)]
SETTING_IDS = [f"{side}-{'bos' if bos else 'nobos'}" for side, bos in SETTINGS]


@functools.cache
def _pair(arch: str):
    """(bridge, independent HF eager copy) of one tiny model with perturbed weights (peaked attention)."""
    from transformers import AutoModelForCausalLM

    from tracekit.model.load import wrap_hf_model
    from tracekit.model.source import _load_tokenizer, _random_config
    from tracekit.model.spec import ModelSpec

    spec = ModelSpec(name=arch, random_init=True, tokenizer=GPT2_BPE, config_overrides=tiny_overrides(arch, 2),
                     process_weights=True, device="cpu", seed=3)
    tok = _load_tokenizer(GPT2_BPE)
    torch.manual_seed(3)
    hf = AutoModelForCausalLM.from_config(_random_config(spec), dtype=torch.float32, attn_implementation="eager")
    if hf.config.vocab_size < len(tok):
        hf.resize_token_embeddings(len(tok), mean_resizing=False)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.ndim == 1 and ("ln" in name or "norm" in name) and "bias" not in name:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
            elif p.ndim == 1:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            else:
                p.mul_(4.0)
    ref = copy.deepcopy(hf).eval()
    bridge = wrap_hf_model(hf, tok, spec, bridge_name="gpt2" if arch == "gpt2" else "meta-llama/Llama-3.2-1B")
    return bridge, ref


@contextlib.contextmanager
def _setting(model, padding_side: str, prepend_bos: bool):
    """The model's spec with another padding side / BOS setting for the block."""
    old, old_bos = model.__dict__["tracekit_spec"], model.cfg.default_prepend_bos
    model.__dict__["tracekit_spec"] = old.model_copy(update={"padding_side": padding_side, "prepend_bos": prepend_bos})
    model.cfg.default_prepend_bos = prepend_bos
    try:
        yield model
    finally:
        model.__dict__["tracekit_spec"] = old
        model.cfg.default_prepend_bos = old_bos


@torch.no_grad()
def _hf_attentions(ref, ids, attention_mask=None):
    """transformers' eager attention weights of every layer (``[batch, head, q, k]`` each)."""
    kw = {"attention_mask": attention_mask} if attention_mask is not None else {}
    return ref(torch.as_tensor(ids), output_attentions=True, use_cache=False, **kw).attentions


def _kind(**kw) -> tk.AttentionPattern:
    return tk.AttentionPattern(**{"dataset": {"rows": ROWS}, "query": "END", "keys": KEYS, **kw})


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def pair(request):
    return _pair(request.param)


_BATCHED: dict = {}


def _batched(model, side: str, bos: bool):
    """The kind on the three rows in one padded batch (every layer, scores), once per setting."""
    key = (id(model), side, bos)
    if key not in _BATCHED:
        with _setting(model, side, bos):
            _BATCHED[key] = _kind(batch_size=8, scores=True).run(model, progress=False)
    return _BATCHED[key]


@pytest.mark.parametrize("side,bos", SETTINGS, ids=SETTING_IDS)
def test_all_layers_in_one_pass_equal_each_layer_alone_and_hf_eager(pair, side, bos):
    model, ref = pair
    n_layers = int(model.cfg.n_layers)
    res = _batched(model, side, bos)
    with _setting(model, side, bos):
        pat = res.tables["pattern"]
        assert sorted(pat["layer"].unique()) == list(range(n_layers))
        assert pat["head_idx"].nunique() == model.cfg.n_heads
        # each layer alone, each row alone (batch_size 1: no padding)
        for L in range(n_layers):
            one = _kind(layer=L, batch_size=1, scores=True).run(model, progress=False).tables["pattern"]
            mine = pat[pat["layer"] == L].reset_index(drop=True)
            assert mine[["row_id", "head_idx", "key_pos"]].equals(one[["row_id", "head_idx", "key_pos"]])
            np.testing.assert_allclose(mine["weight"], one["weight"], rtol=0, atol=1e-5)
            np.testing.assert_allclose(mine["score"], one["score"], rtol=0, atol=1e-4)
        # the per-layer engine (tokenizes the prompt itself) and transformers' eager attention
        for rid, row in enumerate(ROWS):
            ids = encode(model, row["prompt"])
            assert (ids[0] == model.tokenizer.bos_token_id) == bos
            atts = _hf_attentions(ref, [ids])
            q = len(ids) - 1
            mine = pat[pat["row_id"] == rid]
            for L in range(n_layers):
                got = mine[mine["layer"] == L].pivot(index="head_idx", columns="key_pos", values="weight").to_numpy()
                assert got.shape == (model.cfg.n_heads, q + 1)
                np.testing.assert_allclose(got, atts[L][0, :, q, : q + 1].numpy(), rtol=0, atol=1e-5)
                ap = attention_pattern(model, row["prompt"], L)
                np.testing.assert_allclose(got, ap.weights[:, q, : q + 1].numpy(), rtol=0, atol=1e-5)


@pytest.mark.parametrize("side,bos", SETTINGS, ids=SETTING_IDS)
def test_named_query_and_keys_read_each_rows_own_tokens(pair, side, bos):
    model, ref = pair
    res = _batched(model, side, bos)
    with _setting(model, side, bos):
        rows = res.tables["rows"]
        n_bos = 1 if bos else 0
        for rid, row in enumerate(ROWS):
            ids = encode(model, row["prompt"])
            r = rows[rows["row_id"] == rid]
            io, s = NAMES[rid]
            assert set(r["query_token"]) == {" to"} and set(r["query_pos"]) == {len(ids) - 1}
            tok = dict(zip(r["key"], r["key_token"]))
            assert tok == {"IO": io, "S1": s, "S2": s}
            pos = r.drop_duplicates("key").set_index("key")["key_pos"]
            assert pos["S1"] < pos["S2"] and pos["IO"] >= n_bos
            # the row's fields ride along
            assert set(r["prompt"]) == {row["prompt"]} and set(r["group"]) == {row["group"]}
            assert set(r[f"pos_{k}"].iloc[0] for k in KEYS) == set(pos)
            # weights at those keys: transformers on the unpadded row
            atts = _hf_attentions(ref, [ids])
            for x in r.itertuples():
                assert x.weight == pytest.approx(float(atts[x.layer][0, x.head_idx, len(ids) - 1, x.key_pos]), abs=1e-5)
        # the batch really was padded, and counting from the padded start would read other numbers
        lengths = [len(encode(model, r["prompt"])) for r in ROWS]
        assert len(set(lengths)) == 3
        short = int(np.argmin(lengths))
        if side == "left":
            from tracekit.tokens import pad_rows

            b = pad_rows(model, [encode(model, r["prompt"]) for r in ROWS])
            width = b.tokens.shape[1]
            padded = _hf_attentions(ref, b.tokens, b.attention_mask)
            q = lengths[short] - 1  # the row's own END, counted from the padded start (wrong)
            wrong = padded[0][short, :, q, : q + 1].numpy()
            right = res.tables["pattern"].query(f"row_id == {short} and layer == 0").pivot(
                index="head_idx", columns="key_pos", values="weight").to_numpy()
            assert np.abs(wrong - right).max() > 1e-3
            assert width - lengths[short] > 0


def test_heads_table_and_summary_equal_a_hand_computation(pair):
    model, _ = pair
    res = _kind(batch_size=2, plot_heads=[[1, 0], [0, 1]], top_k=3).run(model, progress=False)
    rows, heads = res.tables["rows"], res.tables["heads"]
    g = rows.groupby(["layer", "head_idx", "key"])["weight"]
    hand = pd.DataFrame({"n_rows": g.count(), "mean_weight": g.mean(), "std_weight": g.std(),
                         "q1_weight": g.quantile(0.25), "median_weight": g.median(), "q3_weight": g.quantile(0.75)})
    hand["iqr_weight"] = hand["q3_weight"] - hand["q1_weight"]
    mine = heads.set_index(["layer", "head_idx", "key"]).loc[hand.index]
    assert len(heads) == len(hand) == model.cfg.n_layers * model.cfg.n_heads * len(KEYS)
    assert (mine["n_rows"] == len(ROWS)).all()
    for c in hand.columns:
        np.testing.assert_allclose(mine[c].to_numpy(dtype=float), hand[c].to_numpy(dtype=float), rtol=0, atol=1e-9)
    s = res.summary()
    assert s["n_rows"] == 3 and s["keys"] == KEYS and s["query"] == "END"
    assert s["shown_heads"] == [[1, 0], [0, 1]]
    for key in KEYS:
        top = hand.xs(key, level="key")["mean_weight"].sort_values(ascending=False).head(3)
        assert [(L, H) for L, H, _ in s["top_heads_by_key"][key]] == list(top.index)
        assert [w for _, _, w in s["top_heads_by_key"][key]] == pytest.approx(top.to_numpy(), abs=1e-6)
        for L, H in s["shown_heads"]:
            assert s["mean_attention_by_key"][key][f"L{L}H{H}"] == pytest.approx(hand.loc[(L, H, key), "mean_weight"],
                                                                               abs=1e-6)
    lab = res.tables["labels"]
    for L, H in s["shown_heads"]:
        counts = lab[(lab["layer"] == L) & (lab["head_idx"] == H)]["label"].value_counts()
        assert counts[s["modal_label_by_head"][f"L{L}H{H}"]] == counts.max()
    sums = res.tables["pattern"].groupby(["row_id", "layer", "head_idx"])["weight"].sum()
    assert s["max_abs_row_sum_error"] == pytest.approx(float((sums - 1).abs().max()), abs=1e-6)
    assert s["max_abs_row_sum_error"] < 1e-5
    assert s["query_pos_by_row"] == [len(encode(model, r["prompt"])) - 1 for r in ROWS]


def test_default_shown_heads_are_the_top_heads_of_the_first_key(pair):
    model, _ = pair
    res = _kind(n_plot_heads=2).run(model, progress=False)
    h = res.tables["heads"]
    top = h[h["key"] == "IO"].sort_values("mean_weight", ascending=False).head(2)
    assert res.summary()["shown_heads"] == [[int(r.layer), int(r.head_idx)] for r in top.itertuples()]


def test_labels_equal_classify_heads_on_each_row(pair):
    model, _ = pair
    res = _kind(dominance=0.3, spread_entropy=0.8).run(model, progress=False)
    lab = res.tables["labels"].set_index(["row_id", "layer", "head_idx"])
    for rid, row in enumerate(ROWS):
        for L in range(int(model.cfg.n_layers)):
            ap = attention_pattern(model, row["prompt"], L)
            q = len(ap.tokens) - 1
            ref = classify_heads(ap.weights, [q], dominance=0.3, spread_entropy=0.8)
            for r in ref.itertuples():
                mine = lab.loc[(rid, L, r.head)]
                assert mine["label"] == r.label
                assert mine["self_weight"] == pytest.approx(r.self, abs=1e-6)
                assert mine["first_weight"] == pytest.approx(r.first, abs=1e-6)
                assert mine["previous_weight"] == pytest.approx(r.previous, abs=1e-6)
                assert mine["entropy_norm"] == pytest.approx(r.entropy_norm, abs=1e-5)
                assert mine["max_key_weight"] == pytest.approx(r.max_key_weight, abs=1e-6)
                assert mine["top_key_token"] == ap.tokens[int(mine["top_key_pos"])]


def test_one_forward_pass_for_every_layer_and_none_after_the_last_read(pair):
    model, _ = pair
    fired = {0: 0, 1: 0}

    def counter(L):
        def fn(act, hook=None):
            fired[L] += 1
        return fn

    hps = [model.blocks[L].attn.hook_pattern for L in (0, 1)]
    for L, hp in enumerate(hps):
        hp.add_hook(counter(L), level=99)
    try:
        ids = [encode(model, r["prompt"]) for r in ROWS]
        qa = query_attention(model, ids, [len(i) - 1 for i in ids], batch_size=16)
        assert fired == {0: 1, 1: 1}  # one forward pass for the 3 rows, every layer read in it
        assert qa.weights.shape == (3, 2, model.cfg.n_heads, max(len(i) for i in ids))
        query_attention(model, ids, [len(i) - 1 for i in ids], layers=[0], batch_size=2)
        assert fired == {0: 3, 1: 1}  # two batches; the pass stopped after layer 0
    finally:
        for hp in hps:
            hp.remove_hooks(level=99)


def test_keys_after_the_query_get_zero_and_all_keys_form(pair):
    model, _ = pair
    res = _kind(query="S1", keys=["IO", "S2", "END"]).run(model, progress=False)
    r = res.tables["rows"]
    assert (r[r["key"].isin(["S2", "END"])]["weight"] == 0).all()  # causal: the query cannot see them
    io = r[r["key"] == "IO"]  # before S1 in ABBA rows, after it in BABA rows
    assert ((io["key_pos"] <= io["query_pos"]) == (io["weight"] > 0)).all() and (io["weight"] > 0).any()
    res = _kind(keys="all").run(model, progress=False)
    s = res.summary()
    assert s["keys"] == [str(k) for k in range(max(s["query_pos_by_row"]) + 1)]
    h = res.tables["heads"]
    assert h[h["key"] == s["keys"][-1]]["n_rows"].eq(1).all()  # only the longest row has the last position
    assert set(res.figures()) == {"mean_attention", "patterns"}


def test_tables_have_no_shadowing_columns_and_round_trip(pair, tmp_path):
    import matplotlib.pyplot as plt

    model, _ = pair
    res = _kind(scores=True, full_pattern=True, plot_rows=2).run(model, progress=False)
    for name, df in res.tables.items():
        assert not shadowing_columns(df), (name, shadowing_columns(df))
    full = res.tables["full_pattern"]
    assert sorted(full["row_id"].unique()) == [0, 1]
    f0 = full[(full["row_id"] == 0)].groupby(["layer", "head_idx", "query_pos"])["weight"].sum()
    assert (f0 - 1).abs().max() < 1e-5
    res.save(tmp_path / "r", figures=False)  # the figures are drawn once, below, from the loaded result
    back = tk.Result.load(tmp_path / "r")
    assert back.summary() == res.summary()
    figs = back.figures()
    assert set(figs) == {"mean_attention", "patterns", "full_pattern"}
    for f in figs.values():
        f.canvas.draw()
        w, h = f.get_size_inches() * 110
        assert w <= 4400 and h <= 4400
    plt.close("all")
    hs = tk.HeadScan(seq_len=6, n_seqs=1, prompts=["The capital of France is"]).run(model, progress=False)
    for name, df in hs.tables.items():
        assert not shadowing_columns(df), (name, shadowing_columns(df))
    assert "head_idx" in hs.tables["scores"] and "first_weight" in hs.tables["labels"]


def test_errors_name_the_field(pair):
    from pydantic import ValidationError

    model, _ = pair
    with pytest.raises(DatasetError, match="keys\\[1\\]: 'XX' is not a named position"):
        _kind(keys=["IO", "XX"]).run(model, progress=False)
    with pytest.raises(DatasetError, match="query: 'END' names a dataset position.*token:END"):
        tk.AttentionPattern(prompts=["a b c"], query="END").run(model, progress=False)
    with pytest.raises(AttentionError, match="plot_heads\\[0\\]: L1H0 is not read"):
        _kind(layers=[0], plot_heads=[[1, 0]]).run(model, progress=False)
    with pytest.raises(ValidationError, match="layers .* or layer"):
        _kind(layers=[0], layer=1)
    with pytest.raises(ValidationError, match="head needs layer"):
        _kind(head=1)
    with pytest.raises(ValidationError, match="prompts or dataset, not both"):
        tk.AttentionPattern(prompts=["a"], dataset={"rows": ROWS})
    with pytest.raises(ValidationError, match="empty list selects nothing"):
        _kind(keys=[])


@pytest.mark.slow
def test_ioi_on_the_embedded_model_equals_each_layer_alone(embedded_model):
    res = tk.AttentionPattern(dataset={"generator": {"name": "ioi", "n": 4}}, query="END",
                              keys=["IO", "S1", "S2"]).run(embedded_model, progress=False)
    s = res.summary()
    assert s["n_rows"] == 4 and len(s["layers"]) == embedded_model.cfg.n_layers and s["max_abs_row_sum_error"] < 1e-4
    pat = res.tables["pattern"]
    prompts = res.tables["rows"].drop_duplicates("row_id")["prompt"].tolist()
    for rid, L in ((0, 0), (0, 17), (3, 17)):  # a few (row, layer) pairs: one forward pass each
        prompt, q = prompts[rid], s["query_pos_by_row"][rid]
        ap = attention_pattern(embedded_model, prompt, L)
        got = pat.query(f"row_id == {rid} and layer == {L}").pivot(index="head_idx", columns="key_pos",
                                                                   values="weight").to_numpy()
        np.testing.assert_allclose(got, ap.weights[:, q, : q + 1].numpy(), rtol=0, atol=1e-5)

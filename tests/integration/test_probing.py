"""Linear probing (tracekit.probing, kind linear_probe): planted-direction recovery, controls,
group splits, determinism, batched extraction, metrics against scikit-learn, saved directions."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch

import tracekit as tk
from helpers import make_tiny, start_child
from tracekit.probing import (
    EMBEDDING_HOOK,
    Activations,
    ProbingWarning,
    Split,
    SplitLeakError,
    bootstrap_metrics,
    bootstrap_weights,
    check_no_overlap,
    control_labels,
    country_dataset,
    extract_activations,
    fit_probe,
    group_kfold,
    group_split,
    held_out_units,
    inner_splits,
    load_countries,
    load_probe_dataset,
    load_probe_directions,
    probe_hooks,
    probe_layers,
    probe_metrics,
    split_bootstrap_weights,
)
from tracekit.tokens import parse_position

# float32 activations: padded vs unpadded forward passes differ by reduction order only (~1e-6);
# 1e-4 absolute leaves two orders of magnitude of margin on O(1) activations.
ACT_ATOL = 1e-4


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # On a busy 2-core box, 2 torch threads spin against each other (~7x slower for tiny models).
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# ---------------------------------------------------------------------------------------------
# planted direction
# ---------------------------------------------------------------------------------------------

# 24 + 24 single-token GPT-2 words; the class of a word is arbitrary, so nothing but the planted
# signal relates a held-out word to its label.
WORDS_A = [" cat", " dog", " tree", " car", " book", " spoon", " river", " chair", " table", " bird",
           " stone", " apple", " shoe", " door", " lamp", " ship", " coin", " bread", " horse", " glass",
           " cloud", " field", " wall", " bottle"]
WORDS_B = [" king", " road", " phone", " ring", " bell", " boat", " cake", " fish", " hill", " milk",
           " rope", " sand", " snow", " star", " tent", " wolf", " box", " pen", " cup", " key",
           " bag", " hat", " egg", " sun"]
PLANT_TEMPLATES = ["Yesterday I saw a{w} near the old house today", "My friend said the{w} was here today"]


def planted_dataset(tmp_path) -> str:
    for t in PLANT_TEMPLATES:  # the label must come from the word alone
        assert not any(w in t for w in WORDS_A + WORDS_B), t
    rows = []
    for lab, words in (("A", WORDS_A), ("B", WORDS_B)):
        for w in words:
            for j, t in enumerate(PLANT_TEMPLATES):
                rows.append({"sentence": t.format(w=w), "cls": lab, "word": w.strip(), "tpl": f"t{j}"})
    path = tmp_path / "planted.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return str(path)


def planting_hooks(model, k: int, alpha: float, seed: int = 0):
    """Forward hooks that write +/- alpha * u (u a fixed unit vector) into the residual stream at the
    output of block k's MLP (so blocks.L.hook_resid_post carries it for L >= k, not for L < k), with
    the sign given by whether the prompt contains a class-A word (read from the token embeddings)."""
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(model.cfg.d_model, generator=g)
    u = u / u.norm()
    ids_a = torch.tensor([model.tokenizer.encode(w)[0] for w in WORDS_A])
    state = {}

    def read_label(emb, hook):
        ref = model.W_E[ids_a].to(emb.dtype)  # [n_words, d]
        hit = (emb[:, :, None, :] - ref[None, None]).abs().amax(-1) == 0  # [batch, pos, n_words]
        state["sign"] = hit.flatten(1).any(-1).to(emb.dtype) * 2 - 1  # [batch]
        return emb

    def plant(out, hook):
        return out + alpha * state["sign"][:, None, None] * u.to(out.dtype)

    return [("hook_embed", read_label), (f"blocks.{k}.hook_mlp_out", plant)]


@pytest.fixture(scope="module")
def planted_model(gpt2_tokenizer_dir):
    return make_tiny("gpt2", gpt2_tokenizer_dir, n_layers=4, seed=3)


def _planted_probe(path, **kw):
    base = dict(dataset={"path": path, "text": "sentence", "label": "cls", "group": "word", "template": "tpl"},
                bootstrap=300, Cs=[0.01, 0.1, 1.0], test_size=0.35)
    return tk.LinearProbe(**{**base, **kw})


def test_planted_direction_found_at_k_and_not_before(planted_model, tmp_path):
    k = 1  # planted into block 1's MLP output: blocks.L.hook_resid_post carries it for L >= 1
    path = planted_dataset(tmp_path)
    with planted_model.hooks(fwd_hooks=planting_hooks(planted_model, k, 1.0)):  # a notebook user's hooks
        res = _planted_probe(path).run(planted_model, progress=False)
    f = res.to_frame()
    assert list(zip(f.site, f.layer, f.hook))[0] == ("resid_pre", 0, EMBEDDING_HOOK)  # the embedding baseline
    assert not f.iloc[0]["beats_controls"] and f.iloc[0]["accuracy"] <= 0.7
    d = f[f.site == "resid_post"].set_index("layer")
    assert list(d.index) == [0, 1, 2, 3]  # block indices
    assert list(d.hook) == [f"blocks.{L}.hook_resid_post" for L in range(4)]
    assert res.meta["n_comparisons"] == 4 and res.meta["correction"] == "bonferroni"
    for L in range(0, k):  # before k: at chance, and not reported as beating the controls
        assert not d.loc[L, "beats_controls"], (L, d.loc[L].to_dict())
        assert d.loc[L, "accuracy_lo"] <= 0.5 and d.loc[L, "accuracy"] <= 0.7, (L, d.loc[L].to_dict())
    for L in range(k, 4):  # from k on the planted direction is read off
        assert d.loc[L, "accuracy"] >= 0.95, (L, d.loc[L, "accuracy"])
        assert d.loc[L, "auroc"] >= 0.95
        assert d.loc[L, "beats_controls"]
        # the shuffled-label control stays at chance: its interval contains 0.5
        assert d.loc[L, "shuffled_accuracy_lo"] <= 0.5 <= d.loc[L, "shuffled_accuracy_hi"], d.loc[L].to_dict()
        assert d.loc[L, "vs_shuffled"] >= 0.3
        # the decision uses the Bonferroni-adjusted bounds, which are below the plain ones
        assert d.loc[L, "vs_shuffled_lo_adj"] <= d.loc[L, "vs_shuffled_lo"] + 1e-12
    s = res.summary()
    assert s["layers"] == [0, 1, 2, 3]
    assert s["layers_beating_controls"] == list(range(k, 4))
    assert s["best_layer"] >= k
    assert not any("lexical shortcut" in w for w in s["warnings"])
    # The split really held out words (groups) and templates stayed shared only by design.
    sp = res.tables["split"]
    assert not set(sp[sp.side == "train"].group) & set(sp[sp.side == "test"].group)

    # Same seed -> identical numbers (split, control labels, inner folds, bootstrap).
    with planted_model.hooks(fwd_hooks=planting_hooks(planted_model, k, 1.0)):
        res2 = _planted_probe(path).run(planted_model, progress=False)
    pd.testing.assert_frame_equal(res.to_frame(), res2.to_frame(), check_exact=True)
    pd.testing.assert_frame_equal(res.tables["split"], res2.tables["split"], check_exact=True)

    # Saved directions: in the activation basis, x @ W.T + b reproduces the probe's test predictions.
    dirs = load_probe_directions(res, bias=True)
    assert sorted(dirs) == [0, 1, 2, 3]
    W, b = dirs[k]
    assert W.shape == (1, planted_model.cfg.d_model)  # binary: one direction, for classes[1]
    acts = extract_activations(planted_model, sp.text.tolist(), [f"blocks.{k}.hook_resid_post"],
                               fwd_hooks=planting_hooks(planted_model, k, 1.0))
    x = acts.get(f"blocks.{k}.hook_resid_post")[torch.tensor(sp[sp.side == "test"].row.to_numpy())]
    pred = np.where(((x @ W.T + b)[:, 0] > 0).numpy(), res.meta["classes"][1], res.meta["classes"][0])
    p = res.tables["predictions"]
    p = p[(p.layer == k) & (p.site == "resid_post")].sort_values("row")
    assert (pred == p.y_pred.to_numpy()).mean() >= 0.97  # float32 vs float64 decision ties only
    # The recovered direction is the planted one (cosine, sign-agnostic).
    g = torch.Generator().manual_seed(0)  # the planted u (planting_hooks' seed 0)
    u = torch.randn(planted_model.cfg.d_model, generator=g)
    cos = torch.nn.functional.cosine_similarity(W[0], u, dim=0).abs()
    assert cos > 0.3, float(cos)  # random 64-d vectors: |cos| ~ 0.1


def test_no_plant_no_signal(planted_model, tmp_path):
    """Without the planted signal nothing beats the controls (the test above can fail)."""
    with planted_model.hooks(fwd_hooks=planting_hooks(planted_model, 1, 0.0)):
        res = _planted_probe(planted_dataset(tmp_path), bootstrap=200).run(planted_model, progress=False)
    d = res.to_frame()
    assert not d["beats_controls"].any(), d[["layer", "accuracy", "vs_shuffled_lo", "vs_baseline_lo"]]
    assert (d["accuracy"] <= 0.75).all()
    assert any("no layer beats" in w for w in res.summary()["warnings"])


# ---------------------------------------------------------------------------------------------
# splits
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("group_by", ["entity", "template", "both"])
def test_group_split_has_no_overlap_and_is_seeded(group_by):
    ds = country_dataset()
    s = group_split(ds, group_by, 0.3, seed=1)
    f = ds.frame
    tr, te = f.iloc[s.train], f.iloc[s.test]
    assert len(tr) and len(te)
    assert not set(s.train) & set(s.test)
    if group_by in ("entity", "both"):
        assert not set(tr.group) & set(te.group)
        assert set(te.label) == set(f.label)  # stratified: every continent is tested
    if group_by in ("template", "both"):
        assert not set(tr.template) & set(te.template)
    if group_by == "both":  # cross rows are dropped, never silently kept
        assert len(s.train) + len(s.test) + len(s.dropped) == len(f)
        assert len(s.dropped) > 0
    else:
        assert len(s.train) + len(s.test) == len(f)
    s2 = group_split(ds, group_by, 0.3, seed=1)
    assert np.array_equal(s.train, s2.train) and np.array_equal(s.test, s2.test)
    s3 = group_split(ds, group_by, 0.3, seed=2)
    assert not np.array_equal(s.test, s3.test)


def test_group_kfold_partitions_rows():
    ds = country_dataset()
    folds = group_kfold(ds, 5, "entity", seed=0)
    seen = np.concatenate([f.test for f in folds])
    assert sorted(seen.tolist()) == list(range(len(ds)))
    for f in folds:
        assert not set(ds.frame.group.iloc[f.train]) & set(ds.frame.group.iloc[f.test])
    with pytest.raises(ValueError, match="group_by: both"):
        group_kfold(ds, 5, "both")


def test_overlap_check_catches_a_leaky_split():
    ds = country_dataset()
    rows = np.arange(len(ds))
    leaky = Split(rows[rows % 2 == 0], rows[rows % 2 == 1], np.array([], dtype=np.int64), "entity")
    with pytest.raises(SplitLeakError, match="on both sides"):
        check_no_overlap(ds, leaky)
    ok = group_split(ds, "entity", 0.3, 0)
    bad_t = Split(ok.train, ok.test, ok.dropped, "template")  # entity split does share templates
    with pytest.raises(SplitLeakError, match="template"):
        check_no_overlap(ds, bad_t)


def test_control_labels_keep_groups_and_proportions():
    ds = country_dataset()
    yc, mode = control_labels(ds, "auto", seed=0)
    assert mode == "shuffle_groups"
    f = ds.frame.assign(yc=yc, y=ds.y())
    assert (f.groupby("group").yc.nunique() == 1).all()  # one random label per country
    assert sorted(f.drop_duplicates("group").yc) == sorted(f.drop_duplicates("group").y)
    assert (f.yc != f.y).mean() > 0.3
    # within the parts of a split, each side keeps its real class counts exactly
    sp = group_split(ds, "entity", 0.3, seed=0)
    yc2, _ = control_labels(ds, "auto", seed=0, parts=[sp.train, sp.test])
    for side in (sp.train, sp.test):
        assert np.array_equal(np.bincount(yc2[side], minlength=6), np.bincount(ds.y()[side], minlength=6))
    assert (f.assign(yc2=yc2).groupby("group").yc2.nunique() == 1).all()
    assert np.array_equal(control_labels(ds, "auto", 0, [sp.train, sp.test])[0], yc2)  # seeded


# ---------------------------------------------------------------------------------------------
# extraction
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch,side", [("gpt2", "right"), ("gpt2", "left"), ("llama", "right")])
def test_batched_extraction_equals_one_by_one(arch, side, gpt2_tokenizer_dir):
    model = make_tiny(arch, gpt2_tokenizer_dir, padding_side=side)
    ds = country_dataset()
    f = ds.frame.iloc[::23].reset_index(drop=True)  # 14 prompts of different lengths
    hooks = [h for _, _, h in probe_hooks(model.cfg.n_layers, ["resid_post", "attn_out", "mlp_out"])]
    for position in ("last", -2, "mean", "field:country", "token: is", "all"):
        sub = f[f.text.str.contains(" is")] if str(position).startswith("token:") else f
        fields = sub.country.tolist()
        one = extract_activations(model, sub.text.tolist(), hooks, position, batch_size=1, fields=fields)
        many = extract_activations(model, sub.text.tolist(), hooks, position, batch_size=5, fields=fields)
        assert np.array_equal(one.rows, many.rows) and np.array_equal(one.positions, many.positions)
        for h in hooks:
            a, b = one.get(h), many.get(h)
            assert a.shape == b.shape and a.shape[1] == model.cfg.d_model
            assert torch.allclose(a, b, atol=ACT_ATOL, rtol=0), (position, h, (a - b).abs().max())
    # position 'all' reads every real token but BOS; 'field:country' reads the country's last token
    all_ = extract_activations(model, f.text.tolist(), hooks[:1], "all")
    n_tok = [len(tk.tokens.encode(model, t)) - 1 for t in f.text]
    assert len(all_) == sum(n_tok)
    fld = extract_activations(model, f.text.tolist(), hooks[:1], "field:country", fields=f.country.tolist())
    ids = [tk.tokens.encode(model, t) for t in f.text]
    for i, (p, seq) in enumerate(zip(fld.positions, ids)):
        assert f.country[i].endswith(model.tokenizer.decode(seq[p]).strip()[-3:]), (f.country[i], seq[p])


def test_disk_chunks_stream_back_equal(tiny_gpt2, tmp_path):
    texts = country_dataset().texts[:40]
    hooks = [h for _, _, h in probe_hooks(tiny_gpt2.cfg.n_layers)]
    mem = extract_activations(tiny_gpt2, texts, hooks, batch_size=8)
    disk = extract_activations(tiny_gpt2, texts, hooks, batch_size=8, cache_dir=tmp_path / "acts", chunk_mb=0.01)
    assert disk.on_disk and len(disk.files) > 2  # several chunk files
    re = Activations.load(tmp_path / "acts")
    for h in hooks:
        assert torch.equal(mem.get(h), disk.get(h)) and torch.equal(mem.get(h), re.get(h))
    spill = extract_activations(tiny_gpt2, texts, hooks, batch_size=8, max_memory_mb=1e-3)  # forced spill
    assert spill.on_disk and torch.equal(spill.get(hooks[-1]), mem.get(hooks[-1]))
    spill.cleanup()
    assert not spill.directory.exists()


# ---------------------------------------------------------------------------------------------
# fitting and metrics
# ---------------------------------------------------------------------------------------------

def test_metrics_match_sklearn():
    from sklearn.metrics import accuracy_score, balanced_accuracy_score, f1_score, roc_auc_score

    rng = np.random.default_rng(0)
    for K in (2, 4):
        y = rng.integers(0, K, 200)
        proba = rng.dirichlet(np.ones(K), 200)
        proba[np.arange(200), y] += 0.3
        proba /= proba.sum(1, keepdims=True)
        pred = proba.argmax(1)
        m = probe_metrics(y, pred, proba, n_classes=K)
        auc = roc_auc_score(y, proba[:, 1]) if K == 2 else roc_auc_score(y, proba, multi_class="ovr")
        ref = {"accuracy": accuracy_score(y, pred), "balanced_accuracy": balanced_accuracy_score(y, pred),
               "macro_f1": f1_score(y, pred, average="macro"), "auroc": auc}
        for k, v in ref.items():
            assert abs(m[k] - v) <= 1e-12, (K, k, m[k], v)  # same arithmetic, float64
    # a bootstrap weight row equals the metric on the explicitly resampled rows
    groups = np.repeat(np.arange(40), 5)
    W = bootstrap_weights(groups, 50, seed=3)
    assert W.shape == (50, 200) and np.allclose(W.sum(1), 200)
    for g in range(40):  # whole groups are drawn together
        assert (W[:, groups == g] == W[:, [5 * g]]).all()
    idx = np.repeat(np.arange(200), W[7].astype(int))
    b = bootstrap_metrics(y, pred, proba, W, n_classes=K)
    assert abs(b["accuracy"][7] - accuracy_score(y[idx], pred[idx])) <= 1e-12
    assert abs(b["macro_f1"][7] - f1_score(y[idx], pred[idx], average="macro")) <= 1e-12
    assert abs(b["auroc"][7] - roc_auc_score(y[idx], proba[idx], multi_class="ovr")) <= 1e-12
    assert np.array_equal(bootstrap_weights(groups, 50, seed=3), W)


def test_ridge_regression_probe_and_direction():
    rng = np.random.default_rng(0)
    n, d = 150, 200  # d > n: exercises the row-space reduction
    Z = rng.normal(size=(n, 4))  # a low-dimensional latent, written into the activations
    X = Z @ rng.normal(size=(4, d)) * rng.uniform(0.5, 5, d) + 0.3 * rng.normal(size=(n, d)) + rng.normal(size=d)
    y = Z @ np.array([1.0, -2.0, 0.5, 0.0]) + 0.1 * rng.normal(size=n)
    groups = np.arange(n) // 3
    tr, te = groups < 35, groups >= 35
    fp = fit_probe(X[tr], y[tr], X[te], groups[tr], task="regression", alphas=[0.01, 0.1, 1, 10, 100])
    m = probe_metrics(y[te], fp.pred, task="regression")
    ctrl = fit_probe(X[tr], rng.permutation(y[tr]), X[te], groups[tr], task="regression",
                     alphas=[0.01, 0.1, 1, 10, 100])
    mc = probe_metrics(y[te], ctrl.pred, task="regression")
    assert m["r2"] >= 0.8 and m["r2"] - mc["r2"] >= 0.5, (m, mc)  # a control is not always 0: selectivity
    # weights are in the raw basis: x @ w + b == prediction
    assert np.allclose(X[te] @ fp.weight[0] + fp.bias[0], fp.pred, atol=1e-8)


def test_row_space_fit_equals_full_fit():
    """The d > n shortcut (fit in the training rows' span) gives sklearn's full-dimensional answer."""
    from sklearn.linear_model import LogisticRegression

    rng = np.random.default_rng(2)
    X = rng.normal(size=(80, 300)) * rng.uniform(0.5, 3, 300)
    y = (X[:, :3].sum(1) > 0).astype(int) + (X[:, 3] > 1)
    groups = np.arange(80) // 2
    fp = fit_probe(X[:60], y[:60], X[60:], groups[:60], n_classes=3, Cs=[0.05])
    mu, sd = X[:60].mean(0), X[:60].std(0)
    ref = LogisticRegression(C=0.05, tol=1e-10, max_iter=10000).fit((X[:60] - mu) / sd, y[:60])
    # both solve the same strictly convex problem; lbfgs stops at tol 1e-4 -> probabilities within 1e-3
    assert np.abs(fp.proba - ref.predict_proba((X[60:] - mu) / sd)).max() <= 1e-3


def test_logistic_weights_in_raw_basis():
    rng = np.random.default_rng(1)
    X = rng.normal(size=(90, 30)) * 10 + 3
    y = (X[:, 0] + X[:, 1] > 6).astype(int) + (X[:, 2] > 3)  # 3 classes
    groups = np.arange(90) // 3
    fp = fit_probe(X[:60], y[:60], X[60:], groups[:60], n_classes=3)
    logits = X[60:] @ fp.weight.T + fp.bias
    assert fp.weight.shape == (3, 30)
    assert np.array_equal(logits.argmax(1), fp.pred)
    p = np.exp(logits - logits.max(1, keepdims=True))
    assert np.allclose(p / p.sum(1, keepdims=True), fp.proba, atol=1e-8)


# ---------------------------------------------------------------------------------------------
# data and errors
# ---------------------------------------------------------------------------------------------

def test_country_table_is_sane():
    t = load_countries()
    assert len(t) >= 40 and t.country.is_unique and t.capital.is_unique
    counts = t.continent.value_counts()
    assert len(counts) >= 5 and counts.max() / len(t) <= 0.25  # majority baseline well below 1
    assert {"France": "Paris", "Japan": "Tokyo", "Brazil": "Brasília", "Kenya": "Nairobi",
            "Australia": "Canberra", "Canada": "Ottawa"}.items() <= dict(zip(t.country, t.capital)).items()
    ds = country_dataset()
    assert len(ds) == len(t) * 6 and ds.frame.template.nunique() >= 5
    assert all(p in x for p, x in zip(ds.frame.phrase.str.lower(), ds.frame.text.str.lower()))
    assert not any(c in x for c, x in zip(ds.frame.continent, ds.frame.text))  # the answer is never in the prompt


def test_errors_name_the_field(tiny_gpt2, tmp_path):
    p = tmp_path / "d.csv"
    pd.DataFrame({"text": ["a b", "c d", "e f", "g h"], "y": ["x", "x", "z", "z"],
                  "g": [1, 2, 3, 3]}).to_csv(p, index=False)
    with pytest.raises(ValueError, match=r"dataset\.label: unknown label column 'label'.*\['text', 'y', 'g'\]"):
        load_probe_dataset(p)
    ds = load_probe_dataset(p, label="y", group="g")
    with pytest.raises(ValueError, match="class 'z' has only 1 entity group.*drop_small_classes"):
        group_split(ds)
    with pytest.raises(tk.TokenizationError, match=r"position: unknown position 'first'.*last"):
        parse_position("first")
    with pytest.raises(ValueError, match="position"):
        tk.LinearProbe(position="middle")
    with pytest.raises(tk.HookError, match=r"hooks\[0\]: unknown hook 'blocks\.9\.hook_resid_post'"):
        tk.LinearProbe(hooks=["blocks.9.hook_resid_post"]).check(tiny_gpt2)
    with pytest.raises(tk.ProbingError, match=r"layers\[0\]: layer 7 out of range for a 3-layer model \(blocks 0\.\.2"):
        tk.LinearProbe(layers=[7]).check(tiny_gpt2)
    with pytest.raises(tk.TokenizationError, match=r"position \(row 0\): ' zebra' does not occur"):
        tk.LinearProbe(position="token: zebra").check(tiny_gpt2)
    with pytest.raises(tk.ProbingError, match="has no column 'nation'"):
        tk.LinearProbe(position="field:nation").check(tiny_gpt2)
    with pytest.raises(ValueError, match=r"templates\[0\].*probe target"):
        country_dataset("continent", ["{country} is in {continent}"])
    with pytest.raises(ValueError, match="cv_folds"):
        tk.LinearProbe(cv_folds=5, group_by="both")
    with pytest.raises(tk.ConfigError, match=r"experiments\[0\]\.dataset"):
        tk.parse_config({"experiments": [{"kind": "linear_probe", "dataset": {"builtin": "countries", "path": "x"}}]})


def test_configs_validate():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    for name in ("country_probe.yaml", "country_probe_gpt2.yaml"):
        cfg, _ = tk.load_config(root / "experiments" / name)
        step = cfg.experiments[0]
        assert step.kind == "linear_probe" and step.dataset.builtin == "countries"


def test_kfold_template_run_and_save_load(tiny_llama, tmp_path):
    res = tk.LinearProbe(group_by="template", cv_folds=3, bootstrap=100, layers=[0, -1], Cs=[0.1],
                         sites=["resid_post", "mlp_out"], position="mean").run(tiny_llama, progress=False)
    main = res.to_frame()
    assert list(zip(main.site, main.layer, main.hook)) == [
        ("resid_pre", 0, "blocks.0.hook_resid_pre"), ("resid_post", 0, "blocks.0.hook_resid_post"),
        ("resid_post", 2, "blocks.2.hook_resid_post"), ("mlp_out", 0, "blocks.0.hook_mlp_out"),
        ("mlp_out", 2, "blocks.2.hook_mlp_out")]
    assert set(res.summary()["by_site"]) == {"resid_post", "mlp_out"}
    assert res.meta["bootstrap_resamples"] == "template" and res.meta["n_comparisons"] == 4
    sp = res.tables["split"]
    assert sorted(sp.fold.unique()) == [0, 1, 2] and (sp.side == "test").all()  # each row tested once
    assert res.to_frame()["n_test"].iloc[0] == len(sp)
    res.save(tmp_path / "r")
    back = tk.Result.load(tmp_path / "r")
    assert back.summary() == res.summary()
    assert "linear probe" in back.report()
    dirs = load_probe_directions(tmp_path / "r", normalize=True)
    assert sorted(dirs) == [0, 2] and dirs[2].shape == (6, tiny_llama.cfg.d_model)
    assert sorted(load_probe_directions(tmp_path / "r", site="mlp_out")) == [0, 2]
    assert sorted(load_probe_directions(tmp_path / "r", site="resid_pre")) == [0]  # the embedding baseline
    with pytest.raises(tk.ProbingError, match="renamed"):
        load_probe_directions(tmp_path / "r", site="resid")
    with pytest.raises(tk.ProbingError, match="saved sites"):
        load_probe_directions(tmp_path / "r", site="attn_out")
    assert torch.allclose(dirs[2].norm(dim=-1), torch.ones(6), atol=1e-5)
    assert (tmp_path / "r" / "by_layer.png").exists()


@pytest.mark.slow
def test_country_probe_on_embedded_model(embedded_model):
    """The real model: the continent is decoded far above every control in late layers, and the
    embedding layer at the last token (the template's last word) sits at the majority baseline."""
    res = tk.LinearProbe(layers=[0, 11, 23, 29], bootstrap=300).run(embedded_model, progress=False)
    s = res.summary()
    f = res.to_frame()
    emb = f[f.hook == EMBEDDING_HOOK].iloc[0]
    assert abs(emb["accuracy"] - s["majority_baseline"]) <= 0.1 and not emb["beats_controls"]
    d = f[f.site == "resid_post"].set_index("layer")
    assert s["best_accuracy"] >= 0.8 and s["best_layer"] >= 11
    assert s["best_layer"] in s["layers_beating_controls"]
    assert d.loc[s["best_layer"], "vs_shuffled_lo"] > 0
    assert not any("lexical shortcut" in w for w in s["warnings"])


def test_both_split_run_reports_dropped_rows(tiny_gpt2):
    res = tk.LinearProbe(group_by="both", layers=[0, 1], bootstrap=50, Cs=[0.1]).run(tiny_gpt2, progress=False)
    sp, s = res.tables["split"], res.summary()
    assert s["n_dropped"] == (sp.side == "dropped").sum() > 0
    assert s["n_train"] == (sp.side == "train").sum() and s["n_test"] == (sp.side == "test").sum()
    tr, te = sp[sp.side == "train"], sp[sp.side == "test"]
    assert not set(tr.group) & set(te.group) and not set(tr.template) & set(te.template)


# ---------------------------------------------------------------------------------------------
# vocabulary: block indices, site names, retired names
# ---------------------------------------------------------------------------------------------

def test_retired_site_resid_names_the_new_sites():
    with pytest.raises(tk.ConfigError, match=r"experiments\[0\]\.sites\[0\]: 'resid' was renamed to 'resid_post'"):
        tk.parse_config({"experiments": [{"kind": "linear_probe", "sites": ["resid"]}]})
    with pytest.raises(tk.ProbingError, match="resid_post"):
        probe_hooks(3, ["resid"])
    t = probe_hooks(3, ["resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out"], [-1])
    assert t == [("resid_pre", 0, EMBEDDING_HOOK), ("resid_pre", 2, "blocks.2.hook_resid_pre"),
                 ("resid_mid", 2, "blocks.2.hook_resid_mid"), ("resid_post", 2, "blocks.2.hook_resid_post"),
                 ("attn_out", 2, "blocks.2.hook_attn_out"), ("mlp_out", 2, "blocks.2.hook_mlp_out")]
    # explicit hooks: block index as layer, the name after blocks.L. as site
    assert probe_hooks(3, [], [], ["blocks.1.mlp.hook_post", "hook_embed"])[1:] == [
        ("mlp.hook_post", 1, "blocks.1.mlp.hook_post"), ("hook_embed", -1, "hook_embed")]
    with pytest.raises(tk.ProbingError, match=r"layers\[0\]: layer 3 out of range for a 3-layer model \(blocks 0\.\.2"):
        probe_hooks(3, ["resid_post"], [3])


def test_check_works_on_model_info():
    """check() needs only tokenizer, cfg and hook names: a weightless ModelInfo (5 blocks) suffices."""
    from helpers import GPT2_BPE, tiny_overrides

    info = tk.load_model_info(tk.ModelSpec(name="gpt2", random_init=True, tokenizer=GPT2_BPE,
                                           config_overrides=tiny_overrides("gpt2", 5), device="cpu"))
    assert isinstance(info, tk.ModelInfo)
    tk.LinearProbe(layers=[0, 4], sites=["resid_post", "mlp_out"], position="field:country",
                   hooks=["blocks.1.hook_mlp_in", "blocks.4.attn.hook_result"]).check(info)
    tk.LinearProbe(position=-2).check(info)
    with pytest.raises(tk.ProbingError, match=r"layers\[0\]: layer 5 out of range.*0\.\.4"):
        tk.LinearProbe(layers=[5]).check(info)
    with pytest.raises(tk.HookError, match=r"hooks\[1\]: unknown hook 'blocks\.1\.hook_mlp_inn'"):
        tk.LinearProbe(hooks=["blocks.1.hook_mlp_in", "blocks.1.hook_mlp_inn"]).check(info)
    with pytest.raises(tk.TokenizationError, match=r"position.*40 is out of range"):
        tk.LinearProbe(position=40).check(info)


def test_gated_hooks_are_probed(tiny_gpt2):
    """hook_mlp_in / attn.hook_result only fire when TransformerLens' use_* settings are on: the probe
    switches them on for the extraction (and restores them) instead of failing after the work."""
    hooks = ["blocks.1.hook_mlp_in", "blocks.1.attn.hook_result"]
    before = (tiny_gpt2.cfg.use_hook_mlp_in, tiny_gpt2.cfg.use_attn_result)
    res = tk.LinearProbe(hooks=hooks, layers=[1], bootstrap=20, Cs=[0.1]).run(tiny_gpt2, progress=False)
    f = res.to_frame()
    got = f[f.hook.isin(hooks)]
    assert list(zip(got.site, got.layer)) == [("hook_mlp_in", 1), ("attn.hook_result", 1)]
    assert got.accuracy.between(0, 1).all()
    assert (tiny_gpt2.cfg.use_hook_mlp_in, tiny_gpt2.cfg.use_attn_result) == before
    assert res.arrays["probe.attn.hook_result.1.weight"].shape[1] == tiny_gpt2.cfg.n_heads * tiny_gpt2.cfg.d_model
    assert sorted(load_probe_directions(res, site="hook_mlp_in")) == [1]


# ---------------------------------------------------------------------------------------------
# datasets read as text
# ---------------------------------------------------------------------------------------------

NA_ROWS = [  # labels pandas' default reader turns into NaN, and a text cell 'None'
    {"text": "Toronto is a city", "label": "NA", "group": "ca", "tpl": "t0"},
    {"text": "Chicago is a city", "label": "NA", "group": "us", "tpl": "t1"},
    {"text": "Paris is a city", "label": "N/A", "group": "fr", "tpl": "t0"},
    {"text": "Lyon is a city", "label": "N/A", "group": "fr2", "tpl": "t1"},
    {"text": "None", "label": "None", "group": "x", "tpl": "t0"},
    {"text": "nan is not a number", "label": "None", "group": "null", "tpl": "t1"},
]


def _write(path, rows, fmt):
    if fmt == "jsonl":
        path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    else:
        sep = "," if fmt == "csv" else "\t"
        cols = list(rows[0])
        path.write_text("\n".join([sep.join(cols)] + [sep.join(str(r[c]) if r[c] is not None else "" for c in cols)
                                                      for r in rows]) + "\n")
    return path


def test_na_like_cells_are_values_and_formats_agree(tmp_path):
    frames = []
    for fmt in ("csv", "tsv", "jsonl"):
        ds = load_probe_dataset(_write(tmp_path / f"d.{fmt}", NA_ROWS, fmt), template="tpl")
        assert ds.classes == ["N/A", "NA", "None"], (fmt, ds.classes)  # three classes, none merged into NaN
        assert ds.frame.text.tolist() == [r["text"] for r in NA_ROWS]
        assert ds.frame.group.tolist() == [r["group"] for r in NA_ROWS]
        assert not ds.frame[["text", "label", "group", "template"]].isna().any().any()
        frames.append(ds.frame)
    pd.testing.assert_frame_equal(frames[0], frames[1])
    pd.testing.assert_frame_equal(frames[0], frames[2])


@pytest.mark.parametrize("fmt", ["csv", "tsv", "jsonl"])
def test_empty_required_cell_names_the_row(tmp_path, fmt):
    rows = [dict(r) for r in NA_ROWS]
    rows[3]["label"] = None
    p = _write(tmp_path / f"d.{fmt}", rows, fmt)
    line = 5 if fmt != "jsonl" else 4
    with pytest.raises(tk.ProbingError, match=rf"dataset\.label: row 3 \(line {line} of d\.{fmt}\) has an empty "
                                              r"'label' cell"):
        load_probe_dataset(p)
    rows[3]["label"], rows[1]["text"] = "NA", None
    with pytest.raises(tk.ProbingError, match=r"dataset\.text: row 1 .*empty 'text'"):
        load_probe_dataset(_write(tmp_path / f"e.{fmt}", rows, fmt))
    rows[1]["text"], rows[2]["extra"] = "x", None  # an empty cell in a column the probe does not use is fine
    for r in rows:
        r.setdefault("extra", "v")
    assert len(load_probe_dataset(_write(tmp_path / f"f.{fmt}", rows, fmt))) == 6


def test_builtin_countries_keep_north_america():
    t = load_countries()
    assert "North America" in set(t.continent) and not t.isna().any().any()


# ---------------------------------------------------------------------------------------------
# statistics: engine-level, on synthetic activations (no model)
# ---------------------------------------------------------------------------------------------

def _synthetic(ds, signal: float = 1.5, d: int = 12, seed: int = 0) -> tuple[Activations, list]:
    """The embedding hook carries noise; blocks.0/1.hook_resid_post carry the class one-hot (+noise)."""
    rng = np.random.default_rng(seed)
    y = ds.y()
    K = int(y.max()) + 1
    mk = {}
    mk[EMBEDDING_HOOK] = rng.normal(size=(len(ds), d))
    for L in (0, 1):
        x = rng.normal(size=(len(ds), d))
        x[:, :K] += signal * np.eye(K)[y]
        mk[f"blocks.{L}.hook_resid_post"] = x
    acts = Activations(list(mk), np.arange(len(ds)), np.full(len(ds), -1),
                       {h: torch.tensor(v, dtype=torch.float32) for h, v in mk.items()})
    targets = [("resid_pre", 0, EMBEDDING_HOOK), ("resid_post", 0, "blocks.0.hook_resid_post"),
               ("resid_post", 1, "blocks.1.hook_resid_post")]
    return acts, targets


def test_bootstrap_resamples_held_out_templates():
    """group_by: template holds out 2 of 6 templates; resampling templates gives only 3 possible
    resamples ({t,t}, {t,u}, {u,u}), so every interval end is one of 3 accuracies computed from the
    predictions -- resampling countries (the old behaviour) gives many more values."""
    ds = country_dataset()
    acts, targets = _synthetic(ds, signal=0.6)
    out = probe_layers(acts, ds, targets, group_by="template", bootstrap=400, Cs=[0.1])
    assert out.meta["bootstrap_resamples"] == "template"
    p = out.predictions
    for hook in (EMBEDDING_HOOK, "blocks.1.hook_resid_post"):
        q = p[p.hook == hook].merge(out.split[["row", "template"]], on="row")
        per_t = q.groupby("template").correct.mean()
        assert len(per_t) == 2
        possible = {per_t.iloc[0], per_t.iloc[1], per_t.mean()}
        row = out.main[out.main.hook == hook].iloc[0]
        for end in ("accuracy_lo", "accuracy_hi"):
            assert min(abs(row[end] - v) for v in possible) <= 1e-9, (hook, end, row[end], possible)


def test_two_way_bootstrap_for_both():
    ds = country_dataset()
    units = held_out_units(ds.frame, "both")
    W = split_bootstrap_weights(units, 50, seed=1)
    We, Wt = bootstrap_weights(units[0], 50, 1), bootstrap_weights(units[1], 50, 1 + 104729)
    assert np.array_equal(W, We * Wt)  # weight = (entity drawn k times) x (template drawn m times)
    for g in ("France", "Japan"):  # whole entities and whole templates move together
        m = (ds.frame.group == g).to_numpy()
        assert (We[:, m] == We[:, [np.flatnonzero(m)[0]]]).all()
    acts, targets = _synthetic(ds)
    out = probe_layers(acts, ds, targets, group_by="both", bootstrap=100, Cs=[0.1])
    assert out.meta["bootstrap_resamples"] == "entity x template"


def test_inner_folds_group_like_the_outer_split():
    ds = country_dataset()
    f = ds.frame
    y = ds.y()
    for group_by, cols in (("entity", ["group"]), ("template", ["template"]), ("both", ["group", "template"])):
        folds = inner_splits(f.group.to_numpy(), f.template.to_numpy(), y, group_by, 3, seed=0)
        assert len(folds) >= 2
        for tr, te in folds:
            for c in cols:  # no held-out unit on both sides of an inner fold
                assert not set(f[c].iloc[tr]) & set(f[c].iloc[te]), (group_by, c)
        if group_by == "entity":  # templates are shared, as in the outer entity split
            assert set(f.template.iloc[folds[0][0]]) == set(f.template.iloc[folds[0][1]])


def test_inner_fold_missing_a_class_is_left_out():
    """target: language keeps French with 2 countries: after the outer split one French country is in
    training, and the inner fold holding it out has no French training row. That fold must not vote
    on C (it cannot score French); a warning names the class."""
    ds = country_dataset("language").drop_small_classes(2)
    assert set(ds.classes) == {"Arabic", "English", "French", "Portuguese", "Spanish"}
    acts, targets = _synthetic(ds)
    out = probe_layers(acts, ds, targets, bootstrap=50)
    assert "French" in out.meta["inner_folds_excluded"]["probe"]
    # fit_probe: the fold is excluded with a warning naming the class; all folds lacking one -> refusal
    rng = np.random.default_rng(0)
    X = rng.normal(size=(30, 5))
    y = np.array([0] * 12 + [1] * 12 + [2] * 6)
    X[:, 0] += y
    folds = [(np.arange(6, 30), np.arange(0, 6)), (np.arange(0, 24), np.arange(24, 30)),
             (np.r_[0:12, 18:30], np.arange(12, 18))]
    with pytest.warns(ProbingWarning, match=r"lacks class\(es\) \['c'\]"):
        fp = fit_probe(X, y, X[:3], splits=folds, Cs=[0.1, 1.0], class_names=["a", "b", "c"])
    assert fp.excluded_folds == [(1, ["c"])]
    with pytest.raises(tk.ProbingError, match=r"every inner fold's training part lacks a class.*\['c'\]"):
        fit_probe(X, y, X[:3], splits=[folds[1]], Cs=[0.1, 1.0], class_names=["a", "b", "c"])


def test_multiple_comparisons_recorded_and_applied():
    ds = country_dataset()
    acts, targets = _synthetic(ds, signal=0.35, seed=3)
    kw = dict(bootstrap=300, Cs=[0.1], ci=0.9)
    bon = probe_layers(acts, ds, targets, **kw)
    raw = probe_layers(acts, ds, targets, correction="none", **kw)
    assert bon.meta["n_comparisons"] == 2 and bon.meta["correction"] == "bonferroni"
    assert bon.meta["decision_quantile"] == pytest.approx(0.05 / 2)
    assert raw.meta["decision_quantile"] == pytest.approx(0.05)
    for out in (bon, raw):
        m = out.main
        rest = m[m.hook != EMBEDDING_HOOK]
        expect = (rest.vs_shuffled_lo_adj > 0) & (rest.vs_baseline_lo_adj > 0) & (rest.vs_embedding_lo_adj > 0)
        assert (rest.beats_controls == expect).all()
        assert not m[m.hook == EMBEDDING_HOOK].beats_controls.any()
    # uncorrected bounds equal the plain interval's lower end at 1 - 2 * 0.05 = 0.9
    r = raw.main.iloc[1]
    assert r.vs_shuffled_lo_adj == pytest.approx(r.vs_shuffled_lo, abs=1e-12)
    assert (bon.main.vs_shuffled_lo_adj.iloc[1:] <= raw.main.vs_shuffled_lo_adj.iloc[1:] + 1e-12).all()
    # a notebook gets the same numbers through the kind
    assert list(bon.main.columns[:3]) == ["site", "layer", "hook"]


# ---------------------------------------------------------------------------------------------
# scratch folders: no leftovers on exceptions, Ctrl-C, kill
# ---------------------------------------------------------------------------------------------

def test_scratch_dir_removed_on_every_exit(tmp_path, monkeypatch):
    import signal

    from tracekit.scratch import live_scratch_dirs, scratch_dir

    monkeypatch.setenv("TRACEKIT_SCRATCH", str(tmp_path / "s"))
    before = signal.getsignal(signal.SIGTERM)
    with scratch_dir("t-") as s:
        assert s.path.parent == tmp_path / "s" and s.path.is_dir()
        assert signal.getsignal(signal.SIGTERM) is not before  # cleanup installed while alive
        (s.path / "f").write_text("x")
    assert not s.path.exists() and signal.getsignal(signal.SIGTERM) == before
    for exc in (RuntimeError("boom"), KeyboardInterrupt()):
        with pytest.raises(type(exc)):
            with scratch_dir("t-") as s:
                raise exc
        assert not s.path.exists()
    with scratch_dir("t-") as s:
        s.detach()
    assert s.path.exists() and s.path in live_scratch_dirs()
    s.remove()
    assert not s.path.exists() and not live_scratch_dirs()
    assert list((tmp_path / "s").iterdir()) == []


_EXTRACT_SCRIPT = r"""
import sys, time
sys.path.insert(0, {tests!r})
from helpers import make_tiny
from tracekit.probing import country_dataset, extract_activations

model = make_tiny("gpt2", n_layers=2)
texts = country_dataset().texts
hooks = ["blocks.0.hook_resid_post", "blocks.1.hook_resid_post"]
slow = [("blocks.0.hook_resid_post", lambda x, hook: (time.sleep(0.03), x)[1])]
acts = extract_activations(model, texts, hooks, batch_size=4, fwd_hooks=slow, max_memory_mb=1e-4,
                           chunk_mb=0.001)
assert acts.on_disk
print("EXTRACTED", flush=True)
time.sleep(120)
"""


def test_signal_during_extraction_leaves_no_scratch(tmp_path):
    """Real subprocesses extracting to disk (tiny max_memory_mb) get a real SIGINT / SIGTERM while
    chunk files are being written, or SIGTERM while holding the finished chunks: no folder is left
    behind, and SIGTERM still ends the process with the signal. (The three run in parallel.)"""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    script = tmp_path / "extract.py"
    script.write_text(_EXTRACT_SCRIPT.format(tests=str(root / "tests")))
    cases = {}
    for sig, when in (("SIGINT", "during"), ("SIGTERM", "during"), ("SIGTERM", "after")):
        scratch = tmp_path / f"scratch-{sig}-{when}"
        env = {**os.environ, "TRACEKIT_SCRATCH": str(scratch), "PYTHONPATH": str(root), "HF_HUB_OFFLINE": "1",
               "OMP_NUM_THREADS": "1"}
        proc = start_child([sys.executable, str(script)], env=env, cwd=str(root), stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, start_new_session=True)
        cases[(sig, when)] = (proc, scratch)

    def chunks_written(scratch):
        return scratch.exists() and any(len(list(d.glob("chunk_*"))) >= 2 for d in scratch.iterdir())

    try:
        deadline = time.time() + 180
        pending = dict(cases)
        while pending and time.time() < deadline:
            for key, (proc, scratch) in list(pending.items()):
                sig, when = key
                assert proc.poll() is None, (key, proc.stderr.read())
                ready = chunks_written(scratch) if when == "during" else (
                    scratch.exists() and any((d / "index.json").exists() for d in scratch.iterdir()))
                if ready:
                    assert [d.name for d in scratch.iterdir()][0].startswith("tracekit-acts-")
                    if when == "after":
                        assert proc.stdout.readline().strip() == "EXTRACTED"
                    proc.send_signal(getattr(signal, sig))
                    del pending[key]
            time.sleep(0.05)
        assert not pending, f"no extraction reached the signal point: {list(pending)}"
        for key, (proc, scratch) in cases.items():
            proc.wait(timeout=60)
            assert proc.returncode != 0, key
            if key[0] == "SIGTERM":
                assert proc.returncode == -signal.SIGTERM, (key, proc.returncode)  # still dies of the signal
            assert list(scratch.iterdir()) == [], (key, list(scratch.rglob("*"))[:5])
    finally:
        for proc, _ in cases.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()

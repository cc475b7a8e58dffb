"""``kind: attribution_graph`` end to end on a tiny model: a config dict through the runner gives a
run folder with the graph's tables, its circuit-tracer / Neuronpedia JSON, its HTML page and a
summary with every verification figure; the kind's tables agree with the engines called directly
(the same graph, the same pruning, the same influence ranking); bad inputs (a head the model does
not have, a target of two tokens, transcoders for another model, a set missing a block, too many
rows) fail naming the field before any graph is built.

The transcoders are trained here on the tiny GPT-2 (TopK, 64 features, a few thousand tokens: a
second or so), in a per-test cache (``TRACEKIT_CACHE_DIR``).
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

import tracekit as tk
from helpers import GPT2_BPE, make_tiny
from tracekit.config import parse_config
from tracekit.core.errors import TracekitError
from tracekit.runner import run_config

PROMPT = "The capital of France is"
TRAIN = {"k": 8, "d_sae": 64, "training_tokens": 2048, "eval_tokens": 256, "context_size": 32,
         "train_batch_size_tokens": 256}


def quiet(*a, **k):
    pass


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TRACEKIT_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def step(**kw) -> dict:
    out = {"kind": "attribution_graph", "name": "graph", "transcoders": {"train": dict(TRAIN)},
           "prompts": [PROMPT], "target": " Paris", "foil": " Rome",
           "verify": {"top_k": 3, "n_random": 3, "seed": 0}, "cards": {"features": 4, "contexts": 2, "corpus_tokens": 256},
           "heads": ["L1H0"], "head_split_edges": 3, "main_path": 5}
    out.update(kw)
    return out


def run(tmp_path, model, *steps):
    cfg = parse_config({"model": tk.model_spec_of(model).model_dump(mode="json"), "seed": 0,
                        "experiments": list(steps)})
    return run_config(cfg, tmp_path / "runs", "graph", model=model, progress=False, log=quiet)


def test_runner_writes_tables_json_html_and_verified_summary(tmp_path, cache, tiny_gpt2):
    run_dir, _ = run(tmp_path, tiny_gpt2, step())
    d = run_dir / "graph"
    for f in ("rows.parquet", "nodes.parquet", "edges.parquet", "verification.parquet", "main_path.parquet",
              "head_ov.parquet", "head_qk.parquet", "graph_0.json", "graph_0.html", "summary.json"):
        assert (d / f).is_file(), f
    s = json.loads((d / "summary.json").read_text())
    for k in ("logits_max_abs_error", "completeness_max_abs_error", "pearson", "spearman", "sign_agreement",
              "replacement_score", "completeness_score", "replacement_score_unpruned", "completeness_score_unpruned"):
        assert k in s["verification"] and k in s, k
    # the local replacement model with its error nodes is exact; every node's input is its edges' sum
    assert s["logits_max_abs_error"] < 1e-3 and s["completeness_max_abs_error"] < 1e-3
    for k in ("replacement_score", "completeness_score"):  # scores are shares in [0, 1]
        assert 0.0 <= s[k] <= 1.0 + 1e-6 and 0.0 <= s[f"{k}_unpruned"] <= 1.0 + 1e-6
    assert s["n_graphs"] == 1 and s["graphs"][0]["target"] == " Paris" and s["graphs"][0]["foil"] == " Rome"
    assert s["transcoders"]["path"].startswith(str(cache)) and s["settings"]["node_threshold"] == 0.8
    assert set(s["files"]) == {"graph_0.json", "graph_0.html"}
    # the JSON is circuit-tracer's: metadata, nodes and links; as many nodes as the pruned nodes table
    gj = json.loads((d / "graph_0.json").read_text())
    assert {"metadata", "nodes", "links"} <= set(gj)
    res = tk.Result.load(d)
    nodes, g = res.tables["nodes"], res.tables["rows"].iloc[0]
    kept = nodes[nodes["kept"]]
    assert len(gj["nodes"]) == len(kept) == int(g["pruned_nodes"])
    assert len(gj["links"]) == len(res.tables["edges"]) == int(g["pruned_edges"])
    html = (d / "graph_0.html").read_text()
    assert "<html" in html.lower() and not re.search(r"(src|href)\s*=\s*[\"']?(https?:)?//", html)  # offline page
    # the verification table holds the checked features: top_k by influence + n_random others
    ver = res.tables["verification"]
    assert len(ver) == s["graphs"][0]["n_checked"] and 1 <= len(ver) <= 6
    # the main path: feature nodes by influence, descending, each an active feature of the graph
    mp = res.tables["main_path"]
    assert len(mp) == len(s["main_path"]) and 1 <= len(mp) <= 5
    assert np.all(np.diff(mp["influence"].to_numpy(float)) <= 1e-12)
    assert (mp["activation"].to_numpy(float) != 0).all()
    assert all(isinstance(r["top_tokens"], list) and r["top_tokens"] for r in s["main_path"])
    # the named head's QK attribution and the target logit's top edges split by head are there
    assert len(res.tables["head_qk"]) > 0 and len(res.tables["head_ov"]) > 0
    assert res.report() and set(res.figures()) >= {"main_path"}
    assert res.summary()["verification"] == s["verification"]


def test_kind_agrees_with_the_engines_called_directly(cache, tiny_gpt2):
    """The kind's graph is the engine's graph: same sizes, same errors, same pruning, and its main
    path is the top of the pruning's own node influence."""
    from tracekit.dictionaries.spec import TranscoderSpec
    from tracekit.dictionaries.train import load_transcoders
    from tracekit.graphs.attribution import build_graph
    from tracekit.graphs.prune import prune_graph
    from tracekit.tokens import encode, single_token_id

    res = tk.AttributionGraphExperiment(**{k: v for k, v in step().items() if k not in ("kind", "name")}).run(
        tiny_gpt2, progress=False)
    dset = load_transcoders(TranscoderSpec(train=TRAIN), tiny_gpt2).dictionaries
    ids = torch.tensor(encode(tiny_gpt2, PROMPT))
    g = build_graph(tiny_gpt2, dset, ids, prompt=PROMPT, target=single_token_id(tiny_gpt2, " Paris"),
                    foil=single_token_id(tiny_gpt2, " Rome"))
    pr = prune_graph(g, node_threshold=0.8, edge_threshold=0.98)
    row = res.tables["rows"].iloc[0]
    assert int(row["n_features"]) == g.n_features and int(row["n_pos"]) == g.n_pos
    assert int(row["pruned_nodes"]) == int(torch.as_tensor(pr.node_mask).sum())
    assert abs(float(row["logits_max_abs_error"]) - float(g.verification["logits_max_abs_error"])) < 1e-6
    inf = torch.as_tensor(pr.node_influence).float()[:g.n_features]
    top = torch.argsort(inf, descending=True)[:5].tolist()
    mp = res.tables["main_path"]
    assert mp["node"].tolist() == top
    for r in mp.itertuples():
        assert tuple(int(x) for x in g.features[int(r.node)].tolist()) == (r.layer, r.position, r.feature)


def test_verify_off_is_said_and_no_intervention_runs(cache, tiny_gpt2, monkeypatch):
    import tracekit.graphs.verify as V

    def boom(*a, **k):
        raise AssertionError("verify_graph called with verify.enabled false")

    monkeypatch.setattr(V, "verify_graph", boom)
    res = tk.AttributionGraphExperiment(**{k: v for k, v in step(verify={"enabled": False}, heads=[]).items()
                                           if k not in ("kind", "name")}).run(tiny_gpt2, progress=False)
    s = res.summary()
    assert s["verified_by_intervention"] is False and s["pearson"] is None
    assert s["logits_max_abs_error"] is not None  # the exactness checks cost no intervention: always there
    assert "NOT verified by intervention" in res.report()
    assert len(res.tables["verification"]) == 0


# ---- refusals, before any graph is built ------------------------------------------------------


@pytest.fixture()
def no_graph(monkeypatch):
    """Any graph build or transcoder load fails the test: the refusal must come first."""
    import tracekit.dictionaries.train as T
    import tracekit.graphs.attribution as GA

    def boom(*a, **k):
        raise AssertionError("heavy work started before the refusal")

    monkeypatch.setattr(GA, "build_graph", boom)
    monkeypatch.setattr(T, "load_transcoders", boom)


@pytest.mark.parametrize("bad, field", [
    ({"heads": ["L7H0"]}, "heads[0]"),          # the tiny model has 3 layers
    ({"heads": ["L1H9"]}, "heads[0]"),          # ... of 4 heads
    ({"target": " Paris is"}, "target"),        # two tokens
    ({"foil": " Romeo and"}, "foil"),
    ({"transcoders": {"train": {**TRAIN, "layers": [0, 1]}}}, "transcoders"),  # block 2 has none
    ({"transcoders": {"train": {**TRAIN, "hook_in": "mlp.hook_nothing"}}}, "transcoders.train.hook_in"),
])
def test_bad_inputs_fail_naming_the_field_before_heavy_work(tmp_path, cache, tiny_gpt2, no_graph, bad, field):
    with pytest.raises(TracekitError) as e:
        run(tmp_path, tiny_gpt2, step(**bad))
    assert field in str(e.value)
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())  # refused before the run dir


def test_malformed_head_and_missing_target_are_refused_at_parse():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=r"heads\[0\]"):
        tk.AttributionGraphExperiment(transcoders={"train": TRAIN}, prompts=PROMPT, target=" Paris", heads=["5.3"])
    with pytest.raises(ValidationError, match="target"):
        tk.AttributionGraphExperiment(transcoders={"train": TRAIN}, prompts=PROMPT)
    with pytest.raises(ValidationError, match="max_rows"):
        tk.AttributionGraphExperiment(transcoders={"train": TRAIN}, prompts=[PROMPT] * 3, target=" Paris", max_rows=2)
    with pytest.raises(ValidationError, match="exactly one transcoder source"):
        tk.AttributionGraphExperiment(transcoders={}, prompts=PROMPT, target=" Paris")


def test_too_many_dataset_rows_are_refused(tiny_gpt2):
    rows = [{"prompt": PROMPT, "target": " Paris"}] * 3
    exp = tk.AttributionGraphExperiment(transcoders={"train": TRAIN}, dataset={"rows": rows}, max_rows=2)
    with pytest.raises(TracekitError, match="max_rows"):
        exp.check(tiny_gpt2)


def test_transcoders_saved_for_another_model_are_refused_before_the_graph(tmp_path, cache, tiny_gpt2, monkeypatch):
    """A set trained on the tiny Llama (the same widths, hooks and block count as the tiny GPT-2)
    given by path: refused by the check on the set's recorded model fingerprint, before the run."""
    from tracekit.dictionaries.spec import TranscoderSpec
    from tracekit.dictionaries.train import load_transcoders

    llama = make_tiny("llama")
    other = load_transcoders(TranscoderSpec(train={**TRAIN, "d_sae": 48}), llama).path
    import tracekit.graphs.attribution as GA

    monkeypatch.setattr(GA, "build_graph", lambda *a, **k: (_ for _ in ()).throw(AssertionError("built")))
    with pytest.raises(TracekitError, match="another model") as e:
        run(tmp_path, tiny_gpt2, step(transcoders={"path": other}))
    assert "transcoders.path" in str(e.value)
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_transcoders_with_other_widths_are_refused_from_the_headers(tmp_path, cache):
    """A set whose widths are not the model's is refused by ``validate``'s check on the model's
    config alone (no weights: a ModelInfo), from the safetensors headers."""
    from tracekit.dictionaries.spec import TranscoderSpec
    from tracekit.dictionaries.train import load_transcoders
    from tracekit.model.info import load_model_info
    from tracekit.model.spec import ModelSpec

    wide = make_tiny("gpt2", n_layers=3)
    path = load_transcoders(TranscoderSpec(train=TRAIN), wide).path
    info = load_model_info(ModelSpec(name="llama", random_init=True, tokenizer=GPT2_BPE, device="cpu",
                                     config_overrides={"num_hidden_layers": 3, "hidden_size": 32,
                                                       "intermediate_size": 48, "num_attention_heads": 4,
                                                       "num_key_value_heads": 2}))
    assert int(info.cfg.d_model) == 32 and int(info.cfg.n_layers) == 3
    exp = tk.AttributionGraphExperiment(transcoders={"path": path}, prompts=PROMPT, target=" Paris")
    with pytest.raises(TracekitError, match="widths"):
        exp.check(info)


@pytest.mark.slow  # six variants, each training its own tiny transcoders (~40 s each on 2 loaded cores)
def test_kind_on_perturbed_models_reproduces_the_logits_and_leaves_no_state(cache, perturbed_model):
    """Perturbed norms and biases, GPT-2 / Llama (GQA) / tied embeddings, weight processing on and
    off: the kind's graph reproduces the model's logits and is complete (or the kind refuses the
    model by name), and the model is left as it was (no hook, parameters unchanged)."""
    from tracekit.core.errors import MethodRefused

    model = perturbed_model
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    exp = tk.AttributionGraphExperiment(**{k: v for k, v in step(verify={"top_k": 2, "n_random": 1},
                                                                cards={"enabled": False}).items()
                                           if k not in ("kind", "name")})
    try:
        res = exp.run(model, progress=False)
    except MethodRefused as e:
        assert "attribution" in str(e)
    else:
        s = res.summary()
        assert s["logits_max_abs_error"] < 1e-3 and s["completeness_max_abs_error"] < 1e-3
        assert len(res.tables["verification"]) == 3 and len(res.tables["head_qk"]) > 0
    assert all(not getattr(m, "fwd_hooks", []) and not getattr(m, "bwd_hooks", []) for m in model.modules())
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(p.grad is None for p in model.parameters())

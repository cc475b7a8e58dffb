"""One intervention verb set in the two "units" kinds (neuron_attribution, sae_features): both accept
every verb of tracekit.units.VERBS, name their summary keys by one rule (tracekit.units.verb_key), write
the same interventions-table columns (tracekit.units.INTERVENTION_COLUMNS), summarise them with the one
tracekit.units.intervention_summary, and refuse the retired names (ablate, amplify) naming the new ones."""

from __future__ import annotations

import json

import numpy as np
import pytest
from test_sae import PROMPT, make_sae_dir

import tracekit as tk
from tracekit.neurons import neuron_intervention
from tracekit.sae import SAESpec, feature_decomposition, feature_intervention, load_sae
from tracekit.units import INTERVENTION_COLUMNS, VERBS, intervention_summary

ATOL = 1e-6
#: every verb, with values chosen so each summary key is distinct
VERB_FIELDS = {"modes": list(VERBS), "scale_factors": [3.0], "clamp_value": 0.5, "steer_values": [-2.0]}
KEYS = ["zero", "mean", "clamp_x0.5", "scale_x3", "steer_x-2"]


def _check_table_and_summary(res):
    iv = res.tables["interventions"]
    assert list(iv.columns) == list(INTERVENTION_COLUMNS)
    assert set(iv["verb"]) == set(VERBS) and set(iv["set"]) == {"top", "random"}
    assert (iv[iv["set"] == "top"]["draw"] == 0).all() and set(iv[iv["set"] == "random"]["draw"]) == {1}
    assert iv[iv["verb"].isin(["zero", "mean"])]["value"].isna().all()
    s = res.summary()
    assert list(s["interventions"]) == KEYS
    assert s["interventions"] == intervention_summary(iv)
    assert "scale_x3" in res.report()
    return iv, s


def test_neuron_kind_runs_every_verb(tiny_gpt2, tmp_path):
    m = tiny_gpt2
    exp = tk.NeuronAttribution(prompts="The capital of France is", target=" Paris", foil=" London", layers=[1],
                               top_k=2, value_tokens=0, contexts=None,
                               ablation={"n_random": 1, **VERB_FIELDS})
    res = exp.run(m, progress=False)
    iv, s = _check_table_and_summary(res)
    assert "interventions" in res.figures()
    # each row is the engine's own call with the verb's parameter
    top = [tuple(int(x) for x in u.split(".")) for u in json.loads(iv["units"].iloc[0])]
    for mode, kw in (("clamp", {"value": 0.5}), ("scale", {"factor": 3.0}), ("steer", {"value": -2.0})):
        row = iv[(iv["verb"] == mode) & (iv["set"] == "top")].iloc[0]
        r = neuron_intervention(m, "The capital of France is", " Paris", top, mode, foil=" London", **kw)
        assert row["delta_logit_diff"] == pytest.approx(r["delta"]["logit_diff"], abs=ATOL)
        assert row["delta_target_prob"] == pytest.approx(r["delta"]["target_prob"], abs=ATOL)
    out = res.save(tmp_path / "neurons")
    assert tk.experiments.Result.load(out).summary() == s


def test_sae_kind_runs_every_verb(tiny_gpt2, tmp_path):
    m = tiny_gpt2
    d = make_sae_dir(tmp_path, m, "blocks.1.hook_resid_pre")
    exp = tk.SAEFeatures(sae={"path": str(d)}, prompts=[PROMPT], target=" Paris", foil=" London", top_k=3,
                         interventions={"k": 2, "n_random": 1, **VERB_FIELDS})
    res = exp.run(m, progress=False)
    iv, s = _check_table_and_summary(res)
    # mean: each feature's mean activation over the prompt's non-special tokens
    h = load_sae(SAESpec(path=str(d)), m)
    row = iv[(iv["verb"] == "mean") & (iv["set"] == "top")].iloc[0]
    feats = json.loads(row["units"])
    dec = feature_decomposition(m, h, PROMPT, " Paris", " London", -1)
    keep = ~np.array(dec.special, dtype=bool)
    means = [float(dec.acts[keep, f].mean()) for f in feats]
    r = feature_intervention(m, h, PROMPT, " Paris", " London", feats, "mean", means=means)
    assert row["delta_logit_diff"] == pytest.approx(r["delta_logit"], abs=ATOL)
    r = feature_intervention(m, h, PROMPT, " Paris", " London", feats, "scale", 3.0)
    row = iv[(iv["verb"] == "scale") & (iv["set"] == "top")].iloc[0]
    assert row["delta_target_prob"] == pytest.approx(r["delta_prob"], abs=ATOL)
    out = res.save(tmp_path / "sae")
    assert tk.experiments.Result.load(out).summary() == s


@pytest.mark.parametrize("kind,block", [("neuron_attribution", "ablation"), ("sae_features", "interventions")])
@pytest.mark.parametrize("text,new", [("modes: [ablate]", "'ablate' was renamed to 'zero'"),
                                      ("modes: [zero, amplify]", "'amplify' was renamed to 'scale'"),
                                      ("amplify: [2.0]", "'amplify' was renamed to 'scale_factors'")])
def test_retired_names_in_yaml_name_the_new_one(tmp_path, kind, block, text, new):
    from tracekit.config import load_config

    extra = "    sae: {path: /nonexistent}\n" if kind == "sae_features" else ""
    p = tmp_path / "c.yaml"
    p.write_text(f"model: {{name: gpt2}}\nexperiments:\n  - kind: {kind}\n{extra}    prompts: a b\n"
                 f"    target: ' Paris'\n    {block}:\n      {text}\n")
    with pytest.raises(ValueError, match=new) as e:
        load_config(p)
    assert f"{block}" in str(e.value)

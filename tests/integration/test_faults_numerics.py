"""Faults found by a breaker (issue: numerics, long prompts, text): half precision on CPU, a layer
whose activations carry no information, the trace report's text, and a long prompt's cost."""

from __future__ import annotations

import pandas as pd
import pytest
import torch
from conformance import harness  # noqa: I001

from helpers import GPT2_BPE, tiny_overrides
from tracekit.model.load import load_model
from tracekit.model.spec import ModelSpec

PROMPT = "The capital of France is Paris, and the capital of Italy is"


def _tiny_dir(arch: str) -> str:
    return harness.build({"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "gemma2": "Gemma2ForCausalLM"}[arch])


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("arch", ["gpt2", "llama", "gemma2"])
def test_half_precision_attributions_run_and_add_up_within_the_dtype_tolerance(arch, dtype):
    """DLA, neuron attribution and the trace used to refuse float16/bfloat16 on CPU blaming the
    architecture: the sum check was rounding. Checked in float32 with the dtype's rounding bound."""
    from tracekit.dla import identity_tolerance, logit_attribution
    from tracekit.trace import token_trace

    d = _tiny_dir(arch)
    m32 = load_model(ModelSpec(name=d, tokenizer=GPT2_BPE, device="cpu"))
    mh = load_model(ModelSpec(name=d, tokenizer=GPT2_BPE, device="cpu", dtype=dtype))
    from tracekit.tokens import tokenize
    from tracekit.verify import _pick_tokens

    lp = torch.log_softmax(m32(tokenize(m32, [PROMPT]).tokens).float(), -1)[0, -1]
    t, f = _pick_tokens(m32, lp)
    ref = logit_attribution(m32, PROMPT, t, f, neuron_layers="all")[0]
    half = logit_attribution(mh, PROMPT, t, f, neuron_layers="all")[0]  # no refusal
    parts = [half.embed, half.pos_embed or 0.0, *half.attn.tolist(), *half.mlp.tolist(), half.final_bias]
    tol = identity_tolerance(getattr(torch, dtype), sum(abs(x) for x in parts) + abs(half.attributed), len(parts))
    assert abs(half.total() - half.attributed) <= tol
    # and it is the float32 answer up to the dtype's precision (logits of O(1-10) here)
    scale = max(1.0, abs(ref.attributed))
    assert abs(half.attributed - ref.attributed) <= (0.05 if dtype == "float16" else 0.4) * scale
    tr = token_trace(mh, PROMPT, target=t, foil=f, key_max_tokens=0)
    assert abs(tr.meta["components_sum"] - tr.meta["attributed"]) <= tol


def test_a_layer_with_no_information_is_flagged_not_a_crash(tmp_path):
    """Prompts that all end in ' in', read at the embedding layer of a model without position
    embeddings: every row has the same activation. scikit-learn used to crash the step ("Found array
    with 0 feature(s)"); the layer is now scored as the prior (chance) and flagged."""
    from tracekit import LinearProbe

    model = load_model(ModelSpec(name="llama", random_init=True, tokenizer=GPT2_BPE, device="cpu",
                                 config_overrides=tiny_overrides("llama")))
    rows = [{"text": f"{c} is a country that lies in", "label": lab, "group": c}
            for c, lab in [("France", "EU"), ("Spain", "EU"), ("Italy", "EU"), ("Japan", "AS"), ("China", "AS"),
                           ("India", "AS"), ("Peru", "SA"), ("Chile", "SA"), ("Brazil", "SA")] * 2]
    p = tmp_path / "data.csv"
    pd.DataFrame(rows).to_csv(p, index=False)
    res = LinearProbe(dataset={"path": str(p)}, layers=[0, 1], sites=["resid_pre"], position="last",
                      bootstrap=10).run(model, progress=False)
    main = res.tables["main"]
    flat = main[(main["layer"] == 0) & (main["site"] == "resid_pre")]
    assert bool(flat["uninformative"].iloc[0])
    assert flat["accuracy"].iloc[0] == pytest.approx(flat["baseline_accuracy"].iloc[0], abs=1e-9)  # the prior
    assert not main[main["layer"] == 1]["uninformative"].any()
    assert any("uninformative" in w for w in res.summary()["warnings"])


def test_the_trace_report_shows_text_as_text(tmp_path):
    from tracekit import TokenTrace

    model = load_model(ModelSpec(name="gpt2", random_init=True, tokenizer=GPT2_BPE, device="cpu",
                                 config_overrides=tiny_overrides("gpt2")))
    prompt = "The capital of 中国 is Beijing. The Tower's city is"
    res = TokenTrace(prompts=prompt, target=" Paris", key_max_tokens=0).run(model, progress=False)
    d = res.save(tmp_path / "trace")
    html = (d / "report.html").read_text(encoding="utf-8")
    md = (d / "report.md").read_text(encoding="utf-8")
    assert "中国" in html and "\\u4e2d" not in html and "\\u0027" not in html
    assert "中国" in md and "Tower's" in md and "&#39;" not in md and "&amp;" not in md
    tok = res.tables["tokens"]
    assert not tok["token"].str.contains("\ufffd").any()  # pieces of a character show their bytes
    assert tok["token"].str.startswith("<bytes ").any()
    assert "\ufffd" not in md.split("## 2.")[0]


def test_a_long_prompt_costs_what_the_report_shows():
    """The lens and attention sections read what the report shows (the last LENS_GRID positions; the
    last position's attention row), not every position of the prompt."""
    from tracekit.trace import LENS_GRID, token_trace

    model = load_model(ModelSpec(name="gpt2", random_init=True, tokenizer=GPT2_BPE, device="cpu",
                                 config_overrides={**tiny_overrides("gpt2"), "n_positions": 512}))
    prompt = "The capital of China is Beijing. " * 40  # ~280 tokens
    tr = token_trace(model, prompt, target=" Paris", key_max_tokens=0)
    n_hidden = int(model.cfg.n_layers) + 1
    assert len(tr.tables["lens_grid"]) == n_hidden * LENS_GRID
    n_tok = len(tr.tables["tokens"])
    assert n_tok > 200
    att = tr.tables["attention"]
    assert len(att) == int(model.cfg.n_layers) * int(model.cfg.n_heads) * n_tok  # one query row per head

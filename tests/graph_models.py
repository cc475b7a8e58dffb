"""Tiny models and transcoder sets the attribution-graph tests share (tests/integration/test_graph_*.py):
a perturbed ReLU GPT-2 whose MLPs a transcoder can equal exactly, its own-MLP transcoders, and
imperfect random transcoders of every activation (with a skip matrix)."""

from __future__ import annotations

import torch

from helpers import GPT2_BPE, perturb_params, tiny_overrides
from tracekit.dictionaries import Dictionary, DictionarySet

IDS = torch.tensor([50256, 464, 3139, 286, 4881, 318, 257])  # BOS "The capital of France is a"
PARIS = 6342
ROME = 10598

_RELU: dict = {}


def relu_gpt2():
    """A perturbed tiny GPT-2 with ReLU MLPs (cached)."""
    if "m" in _RELU:
        return _RELU["m"]
    from transformers import AutoModelForCausalLM

    from tracekit.model.load import wrap_hf_model
    from tracekit.model.source import _load_tokenizer, _random_config
    from tracekit.model.spec import ModelSpec

    ov = dict(tiny_overrides("gpt2", 3), activation_function="relu")
    spec = ModelSpec(name="gpt2", random_init=True, tokenizer=GPT2_BPE, config_overrides=ov, device="cpu", seed=7,
                     process_weights=True)
    tok = _load_tokenizer(GPT2_BPE)
    torch.manual_seed(7)
    hf = AutoModelForCausalLM.from_config(_random_config(spec), dtype=torch.float32)
    perturb_params(hf)
    _RELU["m"] = m = wrap_hf_model(hf, tok, spec, bridge_name="gpt2")
    return m


def mlp_transcoders(model) -> DictionarySet:
    """Transcoders that are the model's own (processed) MLPs: W_in/b_in encoder, W_out/b_out decoder."""
    out = {}
    for L in range(model.cfg.n_layers):
        W_in, b_in, W_out, b_out = model.W_in[L], model.b_in[L], model.W_out[L], model.b_out[L]
        t = Dictionary(W_in.shape[0], W_in.shape[1], W_out.shape[1], activation="relu",
                       hook_in=f"blocks.{L}.mlp.hook_in", hook_out=f"blocks.{L}.hook_mlp_out", layer=L)
        with torch.no_grad():
            t.W_enc.copy_(W_in)
            t.b_enc.copy_(b_in)
            t.W_dec.copy_(W_out)
            t.b_dec.copy_(b_out)
        out[L] = t
    return DictionarySet(out)


def random_transcoders(model, d_sae: int = 24, seed: int = 0, kinds=("relu", "jumprelu", "topk"),
                       skip_layers=(1,)) -> DictionarySet:
    """Imperfect transcoders of several activations (and a skip matrix on ``skip_layers``)."""
    d = int(model.cfg.d_model)
    g = torch.Generator().manual_seed(seed)
    out = {}
    for L in range(model.cfg.n_layers):
        act = kinds[L % len(kinds)]
        t = Dictionary(d, d_sae, d, activation=act, k=(6 if act == "topk" else None), skip=L in skip_layers,
                       hook_in=f"blocks.{L}.mlp.hook_in", hook_out=f"blocks.{L}.hook_mlp_out", layer=L)
        with torch.no_grad():
            t.W_enc.copy_(torch.randn(d, d_sae, generator=g) / d ** 0.5)
            t.b_enc.copy_(0.1 * torch.randn(d_sae, generator=g))
            t.W_dec.copy_(torch.randn(d_sae, d, generator=g) / d_sae ** 0.5)
            t.b_dec.copy_(0.1 * torch.randn(d, generator=g))
            if t.threshold is not None:
                t.threshold.fill_(0.05)
            if t.W_skip is not None:
                t.W_skip.copy_(0.05 * torch.randn(d, d, generator=g))
        out[L] = t
    return DictionarySet(out)

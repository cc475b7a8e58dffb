"""The #23 methods on the architectures where readouts and residual edits go wrong: Gemma 2 (final
logit soft-cap, post-norm blocks) and OLMo 2 (post-norm blocks), tiny perturbed models from
tests/conformance. Each invariant compares with the model's own output, which includes the soft-cap."""

from __future__ import annotations

import pytest
import torch
from conformance import harness  # noqa: I001

from tracekit.causal_tracing import causal_trace
from tracekit.lenses.patchscope import patchscope_lens_log_probs
from tracekit.lenses.tuned import TunedLens, lens_log_probs
from tracekit.model.load import load_model
from tracekit.model.readout import Readout
from tracekit.model.spec import ModelSpec
from tracekit.tokens import tokenize

PROMPT = "The capital of France is Paris, and the capital of Italy is"
ARCHS = ["Gemma2ForCausalLM", "Olmo2ForCausalLM"]


@pytest.fixture(scope="module", params=ARCHS)
def model(request):
    d = harness.build(request.param, None)
    return load_model(ModelSpec(name=d, tokenizer=harness.GPT2_BPE, device="cpu"))


def _ids(model) -> list[int]:
    return tokenize(model, [PROMPT]).tokens[0].tolist()


def test_patchscope_of_the_prompt_into_itself_is_the_model_output(model):
    """Source = target prompt, same hidden state, same (last) position: every hidden state gives the
    model's own next-token distribution (soft-capped on Gemma 2). float32 replay vs one forward: 1e-4 nats."""
    ids = _ids(model)
    n = int(model.cfg.n_layers)
    lp = patchscope_lens_log_probs(model, ids, [len(ids) - 1], list(range(n + 1)), target=ids)  # [h, 1, vocab]
    with torch.no_grad():
        own = torch.log_softmax(model(torch.tensor([ids])).float(), -1)[0, -1]
    assert lp.shape[0] == n + 1
    assert (lp[:, 0] - own).abs().max().item() < 1e-4


def test_untrained_tuned_lens_is_the_logit_lens_and_ends_at_the_model_output(model):
    """An untrained tuned lens reads exactly what the logit lens reads (the readout includes Gemma 2's
    soft-cap): identical at every hidden state; at the last one both equal the model's output (1e-4)."""
    ids = _ids(model)
    n = int(model.cfg.n_layers)
    lens = TunedLens.from_model(model)
    _, cache = model.run_with_cache(torch.tensor([ids]))
    states = [cache["blocks.0.hook_resid_pre"][0]] + [cache[f"blocks.{L}.hook_resid_post"][0] for L in range(n)]
    readout = Readout(model)
    for h, x in enumerate(states):
        with torch.no_grad():
            tuned = lens_log_probs(model, lens.transform(x, h)).float()
        assert torch.allclose(tuned, readout.log_probs(x).float(), atol=1e-6), h
    with torch.no_grad():
        own = torch.log_softmax(model(torch.tensor([ids])).float(), -1)[0]
    assert (readout.log_probs(states[-1]).float() - own).abs().max().item() < 1e-4


def test_causal_tracing_restoring_the_last_state_gives_the_clean_run(model):
    """Restoring the residual at the last block's output at the last position gives p_clean; zero noise
    gives zero indirect effect everywhere (post-norm blocks included). Probabilities: 1e-5."""
    ids = _ids(model)
    subj = [i for i, t in enumerate(ids) if model.tokenizer.decode([t]).strip() == "France"]
    assert subj, "the prompt's subject is one token of the GPT-2 tokenizer"
    ct = causal_trace(model, ids, subj, kinds=("resid",), n_samples=3, seed=0)
    n = int(model.cfg.n_layers)
    assert abs(float(ct.p_restored[0, n - 1, len(ids) - 1]) - ct.p_clean) < 1e-5
    zero = causal_trace(model, ids, subj, kinds=("resid", "mlp", "attn"), window=2, noise=0.0, n_samples=2, seed=0)
    assert float(torch.as_tensor(zero.indirect_effect).abs().max()) < 1e-6

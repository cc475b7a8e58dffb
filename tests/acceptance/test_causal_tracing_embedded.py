"""Causal tracing on the real embedded model (SmolLM2-135M-Instruct), small: the residual stream of the
seed prompt with 2 noise draws.

Asserted are properties any correct implementation has (the clean run is the model's own output,
restoring the last block's output at the read position is the clean run, the noise takes the
answer away and restoring the subject's early states brings it back, positions before the subject
have no effect), not values copied from a run."""

from __future__ import annotations

import pytest
import torch

from tracekit.causal_tracing import causal_trace, subject_span
from tracekit.tokens import encode, single_token_id

PROMPT = "The capital of China is Beijing. The capital of France is"


@pytest.mark.slow
def test_paris_residual_trace(embedded_model):
    model = embedded_model
    ids = encode(model, PROMPT)
    subj = subject_span(model, PROMPT, "France", ids)
    paris = single_token_id(model, " Paris")
    tr = causal_trace(model, ids, subj, paris, kinds=("resid",), n_samples=2, seed=0)
    own = float(torch.softmax(model(torch.tensor([ids]))[0, -1].float(), -1)[paris])
    assert abs(tr.p_clean - own) <= 1e-4  # float32 readout of the same final residual
    n = model.cfg.n_layers
    assert abs(float(tr.p_restored[0, n - 1, len(ids) - 1]) - tr.p_clean) <= 1e-4
    assert tr.total_effect > 0.5  # 3 x the embedding std on ' France' takes ' Paris' away
    ie = tr.indirect_effect[0]
    assert float(ie[:, : min(subj)].abs().max()) == 0.0  # before the subject: exactly no effect
    # the subject's early block outputs carry the fact: restoring one brings most of p(Paris) back
    assert float(ie[:5, max(subj)].min()) > 0.5 * tr.total_effect
    L, p, v = tr.peak("resid")
    assert p in (max(subj), len(ids) - 1) and v > 0.5 * tr.total_effect

"""Patchscopes on the real embedded model (SmolLM2-135M), the seed's Paris prompt:

* the last hidden state patched at the identity prompt's last token at the same hidden state is the
  readout of the final residual: the model's own next-token distribution (exact up to float32);
* the identity prompt reads a token's identity back from its embedding-level hidden state (the
  property the prompt is designed for, Ghandeharioun et al. 2024 section 4): the embedding of
  ' France' generates ' France'.
"""

from __future__ import annotations

import pytest
import torch

from tracekit.experiments.patchscope import Patchscope
from tracekit.lenses.patchscope import patchscope_lens_log_probs
from tracekit.tokens import encode

PROMPT = "The capital of China is Beijing. The capital of France is"


@pytest.mark.slow
def test_patchscope_on_the_embedded_model(embedded_model):
    m = embedded_model
    n = m.cfg.n_layers
    ids = encode(m, PROMPT)
    own = torch.log_softmax(m(torch.tensor([ids]))[0, -1].float(), -1)
    lp = patchscope_lens_log_probs(m, ids, [-1], [n])[0, 0]
    assert (lp - own).abs().max() < 1e-4  # float32 over a 49152-token vocabulary
    res = Patchscope(prompts=[PROMPT], position="token: France", hidden_states=[0], target=" France",
                     n_generate=3).run(m, progress=False)
    assert " France" in res.summary()["generated_by_hidden_state"][0]

"""The tuned lens on the real embedded model (SmolLM2-135M): trained on a small budget of the
stdlib corpus's training documents, it is closer to the model's own output distribution than the
logit lens on held-out documents at every hidden state but the last (where both are the output).

The property asserted holds for any correct implementation (Belrose et al. 2023, figure 3: the
tuned lens' KL is below the logit lens' at every layer), not values copied from a run. Budget:
1024 training tokens x 2 epochs (8 Adam steps of 256 tokens per translator, lr 1e-3), 256 held-out
tokens. The smallest budget tried that passes: 512 tokens x 2 epochs at lr 3e-3 fails at a late
hidden state (where the logit lens is already close to the output)."""

from __future__ import annotations

import numpy as np
import pytest

from tracekit.lenses.train import TunedLensSpec, load_or_train_tuned_lens


@pytest.mark.slow
def test_tuned_lens_beats_the_logit_lens_on_held_out_text(embedded_model, tmp_path):
    spec = TunedLensSpec(train_tokens=1024, epochs=2, batch_tokens=256, held_out_tokens=256, lr=1e-3)
    lens = load_or_train_tuned_lens(embedded_model, spec, cache_dir=tmp_path)
    assert lens.source["from"] == "trained"
    r = lens.record
    assert r is not None
    logit, tuned = np.asarray(r["held_out_kl_logit"]), np.asarray(r["held_out_kl"])
    assert len(logit) == 31 and abs(logit[-1]) < 1e-5 and abs(tuned[-1]) < 1e-5
    assert (tuned[:-1] < logit[:-1]).all(), list(zip(logit.round(3), tuned.round(3)))
    # a second call finds it in the cache
    assert load_or_train_tuned_lens(embedded_model, spec, cache_dir=tmp_path).source["from"] == "cache"

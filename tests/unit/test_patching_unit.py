"""Activation patching input rules without a model: layers, baseline populations, padding."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tracekit import patching as P
from tracekit.errors import PatchingError


def test_layers_are_block_indices():
    assert P.resolve_layers(4, None) == [0, 1, 2, 3]
    assert P.resolve_layers(4, [-1, 0, 3]) == [0, 3]
    for bad in (4, -5):
        with pytest.raises(PatchingError, match=r"layers\[0\]: layer .* out of range for a 4-layer model"):
            P.resolve_layers(4, [bad])


def test_baseline_members_exclude_the_prompt_itself_and_shorter_prompts():
    clean = [[1, 2, 3], [4, 5, 6], [1, 2, 3], [7, 8, 9, 10]]
    pop = clean[:3]
    # pair 0's duplicate (pair 2) is the same prompt: never its own baseline; [7, 8, 9, 10] is a
    # pair but not in this population
    with pytest.raises(PatchingError, match=r"'resample' ablation of pairs\[3\] \(4 tokens\).*baseline_prompts"):
        P.baseline_members(clean, pop, "resample")
    assert P.baseline_members(clean[:3], pop, "resample") == [[1], [0, 2], [1]]


def test_mean_needs_two_other_prompts():
    clean = [[1, 2, 3], [4, 5, 6]]
    with pytest.raises(PatchingError, match=r"at least 2.*hold 1"):
        P.baseline_members(clean, clean, "mean")
    pop = [[9, 9, 1, 2, 3], [4, 5, 6], [7, 7, 7], [1, 2, 3], [5]]
    assert P.baseline_members(clean, pop, "mean", "baseline_prompts") == [[0, 1, 2], [0, 2, 3]]
    assert P.MIN_MEAN_POPULATION == 2


def _fake_model(pad=0):
    # a HookedModel without weights: check_unpadded reads the tokenizer's padding token only
    def refuse(*a, **k):
        raise AssertionError("the padding checks do not run the model")

    return SimpleNamespace(tokenizer=SimpleNamespace(pad_token_id=pad, eos_token_id=pad), cfg=None, hook_dict={},
                           __call__=refuse, run_with_cache=refuse, run_with_hooks=refuse, hooks=refuse)


def test_padded_token_rows_are_refused():
    m = _fake_model(pad=0)
    ok = torch.tensor([[0, 5, 6], [0, 7, 8]])  # BOS == pad, one each: not padding
    assert P.check_unpadded(m, ok) is ok
    with pytest.raises(PatchingError, match="right-padded"):
        P.check_unpadded(m, torch.tensor([[5, 6, 7], [5, 6, 0]]))
    with pytest.raises(PatchingError, match="left-padded"):
        P.check_unpadded(m, torch.tensor([[0, 0, 6], [0, 7, 8]]))
    with pytest.raises(PatchingError, match="attention_mask"):
        P.check_unpadded(m, torch.tensor([[5, 6, 7]]), attention_mask=torch.tensor([[0, 1, 1]]))

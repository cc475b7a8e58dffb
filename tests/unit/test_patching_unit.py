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


def _paired_rows(targets, foils):
    from tracekit.dataset.paired import PairedRows
    from tracekit.dataset.rows import Example, PreparedDataset, Row

    clean = ((1, 5, 6), (1, 7), (1, 8, 9))
    corrupted = ((1, 4, 6), (1, 3), (1, 2, 9))
    data = PreparedDataset(tuple(Example(i, Row(prompt=f"p{i}"), c) for i, c in enumerate(clean)))
    return PairedRows(data, clean, corrupted, targets, foils, tuple(("t",) * len(t) for t in targets),
                      None if foils is None else tuple(("f",) * len(f) for f in foils), True,
                      ((2,), (1,), (2,)), ("END",))


def test_paired_rows_become_the_engines_id_arguments():
    """A PairedRows is the one input of the paired engines: paired_args / single_target_args give
    exactly the id arguments their id-based signatures take."""
    import inspect

    from tracekit.circuits.attribution import attribution_patch
    from tracekit.circuits.edges import edge_attribution
    from tracekit.circuits.faithfulness import evaluate_circuits
    from tracekit.circuits.paths import path_patch
    from tracekit.errors import DatasetError
    from tracekit.patching import length_groups, paired_args, run_patching, single_target_args

    rows = _paired_rows(((10,), (11,), (12,)), ((20,), (21,), (22,)))
    args = paired_args(rows)
    assert args == {"clean_ids": [[1, 5, 6], [1, 7], [1, 8, 9]], "corrupted_ids": [[1, 4, 6], [1, 3], [1, 2, 9]],
                    "target_ids": [[10], [11], [12]], "foil_ids": [[20], [21], [22]], "positions": [[2], [1], [2]]}
    one = single_target_args(rows, "edge attribution")
    assert one == {"clean_ids": args["clean_ids"], "corrupted_ids": args["corrupted_ids"],
                   "target_ids": [10, 11, 12], "foil_ids": [20, 21, 22]}
    assert length_groups(rows.lengths) == [(2, [1]), (3, [0, 2])]
    for fn in (run_patching, attribution_patch):
        inspect.signature(fn).bind(None, **args, sites=["resid_pre"], modes=["denoising"], metrics=["logit_diff"])
    for fn, more in ((edge_attribution, {}), (evaluate_circuits, {"circuits": None}),
                     (path_patch, {"senders": [], "receivers": []})):
        inspect.signature(fn).bind(None, **one, **more)
    several = _paired_rows(((10, 13), (11, 14), (12, 15)), None)
    assert paired_args(several)["foil_ids"] is None
    with pytest.raises(DatasetError, match="edge attribution scores one target"):
        single_target_args(several, "edge attribution")

"""A result keeps the activations its kind cached (issue #36: "no result exposes the activations it
cached"): ``result.activations[hook]`` ``[row, read, ...]`` with ``result.activations.positions``,
equal to a fresh TransformerLens ``run_with_cache`` of each row alone at the positions read
(batched rows of different lengths, so padding is exercised), in memory only."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

import tracekit as tk
from helpers import TARGET_ROWS, make_perturbed
from tracekit.activations.cached import CachedActivations

#: |a - b| <= 1e-6 + 1e-5 |b|: the same float32 arithmetic, batched with padding or run alone, differs by
#: rounding only (1.2e-6 seen on a DLA value of 0.35 under left padding).
ATOL, RTOL = 1e-6, 1e-5
PROMPTS, TARGETS, FOILS = ([r[i] for r in TARGET_ROWS] for i in range(3))


def _row_ids(res, i: int) -> list[int]:
    t = res.tables["tokens"]
    return t[t["prompt_idx"] == i].sort_values("position")["token_id"].astype(int).tolist()


def _fresh(model, ids: list[int], names: list[str]) -> dict[str, torch.Tensor]:
    _, cache = model.run_with_cache(torch.tensor([ids]), names_filter=lambda n: n in set(names))
    return {n: cache[n][0] for n in names}


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("position", ["last", "all"])
def test_logit_lens_keeps_the_residual_stream_it_read(side, position):
    m = make_perturbed("gpt2", padding_side=side)
    res = tk.LogitLens(prompts=PROMPTS, target=TARGETS, position=position, batch_size=3).run(m, progress=False)
    acts = res.activations
    assert isinstance(acts, CachedActivations) and acts.note is None
    n_layers, d = int(m.cfg.n_layers), int(m.cfg.d_model)
    # one hook per hidden state (0..n_layers), TransformerLens names
    expected = list(dict.fromkeys([*res.meta["hooks"], f"blocks.{n_layers - 1}.hook_resid_post"]))
    assert len(expected) == n_layers + 1 and all(n in m.hook_dict for n in expected)
    assert expected[0] in ("hook_embed", "blocks.0.hook_resid_pre") or expected[0].startswith("blocks.0.")
    assert sorted(acts) == sorted(expected)
    lengths = [len(_row_ids(res, i)) for i in range(len(PROMPTS))]
    assert len(set(lengths)) > 1  # rows of different lengths: padded batches
    width = 1 if position == "last" else max(lengths)
    for name in expected:
        assert acts[name].shape == (len(PROMPTS), width, d) and acts[name].dtype == torch.float32
    assert acts.positions.shape == (len(PROMPTS), width)
    for i in range(len(PROMPTS)):
        ids = _row_ids(res, i)
        reads = [len(ids) - 1] if position == "last" else list(range(len(ids)))
        assert acts.positions[i, : len(reads)].tolist() == reads
        assert (acts.positions[i, len(reads):] == -1).all()
        fresh = _fresh(m, ids, expected)
        for name in expected:
            got = acts[name][i, : len(reads)]
            torch.testing.assert_close(got, fresh[name][reads], atol=ATOL, rtol=RTOL)
            assert torch.isnan(acts[name][i, len(reads):]).all()  # padded reads are NaN, never a real value
    assert "hooks" in repr(acts) and acts.nbytes > 0


def test_dla_keeps_every_hook_it_read_at_the_attributed_position():
    m = make_perturbed("gpt2", padding_side="left")
    res = tk.DirectLogitAttribution(prompts=PROMPTS, target=TARGETS, foil=FOILS, batch_size=3).run(m, progress=False)
    acts = res.activations
    assert isinstance(acts, CachedActivations) and acts.note is None
    L = int(m.cfg.n_layers) - 1
    for name in ("hook_embed", "blocks.0.hook_resid_pre", f"blocks.{L}.hook_mlp_out", f"blocks.{L}.hook_attn_out"):
        assert name in acts, (name, list(acts))
    assert acts.positions.shape == (len(PROMPTS), 1)
    rows = res.tables["rows"]
    for i in range(len(PROMPTS)):
        ids = [int(x) for x in m.to_tokens(PROMPTS[i])[0]]
        pos = int(rows["position"].iloc[i])
        assert acts.positions[i, 0].item() == pos == len(ids) - 1
        fresh = _fresh(m, ids, list(acts))
        for name in acts:
            assert acts[name].shape[:2] == (len(PROMPTS), 1) and acts[name].shape[2:] == fresh[name].shape[1:]
            torch.testing.assert_close(acts[name][i, 0], fresh[name][pos], atol=ATOL, rtol=RTOL)


def test_activations_are_in_memory_only_and_capped(tmp_path, monkeypatch):
    m = make_perturbed("gpt2")
    exp = tk.LogitLens(prompts=PROMPTS[:2], target=TARGETS[:2])
    res = exp.run(m, progress=False)
    assert len(res.activations) > 0
    back = type(res).load(res.save(tmp_path / "r", figures=False))
    assert len(back.activations) == 0  # not saved with the result
    monkeypatch.setattr(CachedActivations, "limit_mib", 1e-6)
    res2 = exp.run(m, progress=False)
    capped = res2.activations
    assert len(capped) == 0 and capped.note is not None and "limit_mib" in capped.note
    with pytest.raises(KeyError, match="limit_mib"):
        capped["blocks.0.hook_resid_pre"]
    pd.testing.assert_frame_equal(res2.tables["main"], res.tables["main"])  # keeping them changes no number

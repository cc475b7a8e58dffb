"""Causal-tracing figures for a paper and ``tracekit show`` on a causal-tracing run (issue 36,
items 8 and 9): the saved PNGs have a paper's aspect and size (not a 20-inch strip), every text is
>= 9 pt, the per-category heatmaps draw one row per distinct category (one-token subjects: one row
``subject token (first = last)``, no all-blank row), and ``show`` lists each site's peak layer,
category and effect."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from tracekit import plotting
from tracekit.causal_tracing import CATEGORIES, category_rows
from tracekit.experiments.causal_tracing import CausalTracing

#: One-token subjects (GPT-2 tokenizer: " France", " Italy", " Spain"), with tokens after the subject.
PROMPTS = ["The capital of France is the city of", "The capital of Italy is the city of",
           "The capital of Spain is the city of"]
SUBJECTS = ["France", "Italy", "Spain"]


def _texts(fig):
    from matplotlib.text import Text

    return [t for t in fig.findobj(Text) if t.get_visible() and t.get_text().strip()]


def _check_paper_figure(fig, path):
    sizes = [float(t.get_fontsize()) for t in _texts(fig)]
    assert sizes and min(sizes) >= plotting.PAPER_FONT >= 9, sorted(set(sizes))
    w, h = Image.open(path).size
    assert 900 <= w <= 1500 and 300 <= h <= 1100 and w / h <= 4.0, (w, h)  # 9-pt text is >= 25 px at 200 dpi
    return w, h


@pytest.fixture(scope="module")
def one_token_run(tiny_gpt2, tmp_path_factory):
    res = CausalTracing(prompts=PROMPTS, subject=SUBJECTS, window=2, n_samples=1).run(tiny_gpt2, progress=False)
    d = tmp_path_factory.mktemp("ct") / "run"
    res.save(d)
    return res, d


def test_category_rows_merge_coinciding_categories():
    # one-token subject, two tokens after it: first = last subject token; no middle tokens
    rows = category_rows([(8, [3]), (8, [3])])
    assert [label for label, _ in rows] == ["subject token (first = last)", "first subsequent token",
                                            "further tokens", "last token"]
    assert rows[0][1] == ("first subject token", "last subject token")
    # the subject ends just before the last token: that token is also the first subsequent one
    assert [label for label, _ in category_rows([(5, [2, 3])])] == [
        "first subject token", "last subject token", "last token (= first subsequent)"]
    # categories merge only when they coincide in every prompt
    assert [label for label, _ in category_rows([(8, [3]), (8, [2, 3, 4])])] == list(CATEGORIES)


def test_category_heatmaps_are_paper_sized_without_duplicate_rows(one_token_run):
    res, d = one_token_run
    figs = res.figures()
    try:
        assert set(figs) == {"resid", "mlp", "attn"}
        for k, fig in figs.items():
            _check_paper_figure(fig, d / f"{k}.png")
            ax = fig.axes[0]
            labels = [t.get_text() for t in ax.get_yticklabels()]
            assert len(labels) == len(set(labels)) and "subject token (first = last)" in labels
            assert "middle subject tokens" not in labels and "first subject token" not in labels
            grid = np.asarray(ax.images[0].get_array(), dtype=float)
            assert grid.shape[0] == len(labels) == 4
            assert all(np.isfinite(row).any() for row in grid)  # no blank row
            rows = [tuple(np.round(r, 12)) for r in grid]
            assert len(set(rows)) == len(rows)  # no row drawn twice
            assert ax.get_xlabel().startswith("layer") and "indirect effect" in fig.axes[1].get_ylabel()
    finally:
        for f in figs.values():
            plotting.plt().close(f)


def test_one_prompt_heatmap_is_paper_sized(tiny_gpt2, tmp_path):
    res = CausalTracing(prompts=[PROMPTS[0]], subject=SUBJECTS[0], kinds=["resid"], n_samples=1).run(
        tiny_gpt2, progress=False)
    res.save(tmp_path / "one")
    fig = res.figures()["resid"]
    try:
        _check_paper_figure(fig, tmp_path / "one" / "resid.png")
        labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
        assert len(labels) == len(set(labels)) == len(res.tables["rows"]["tokens"].iloc[0])
        assert "p(" in fig.axes[1].get_ylabel()
    finally:
        plotting.plt().close(fig)


def test_show_lists_peak_layer_and_category_per_site(one_token_run, capsys):
    from tracekit import cli

    res, d = one_token_run
    s = json.loads((d / "summary.json").read_text())
    for k in ("resid", "mlp", "attn"):
        assert s[f"peak_{k}"] == (f"layer {s[f'mean_peak_{k}_layer']}, subject token (first = last): "
                                  f"AIE {s[f'mean_peak_{k}_effect']:+.3g}"
                                  if s[f"mean_peak_{k}_category"] == "last subject token" else
                                  f"layer {s[f'mean_peak_{k}_layer']}, {s[f'mean_peak_{k}_category']}: "
                                  f"AIE {s[f'mean_peak_{k}_effect']:+.3g}")
    # a run directory holding the step, as the runner writes it
    run = d.parent / "study"
    run.mkdir()
    (run / "trace").symlink_to(d, target_is_directory=True)
    (run / "status.json").write_text(json.dumps({"status": "complete", "steps": ["trace"], "finished": ["trace"]}))
    cli.main(["show", str(run)])
    out = capsys.readouterr().out
    for k in ("resid", "mlp", "attn"):
        assert f"peak_{k}" in out and s[f"peak_{k}"] in out, out
    assert "mean_total_effect" in out

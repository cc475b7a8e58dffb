"""Sweep comparison figures take their x values and x label from the metric (issue 36, item 4):
``mean_target_prob_by_alpha`` is drawn over the summary's ``alphas``, ``..._by_hidden_state`` over
``hidden_states``; only a metric that names no axis falls back to the list position, and says so."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd

from tracekit.plotting import plt
from tracekit.sweep.figures import compare


def _index(alphas_by_point: list[list[float]]) -> pd.DataFrame:
    """A sweep index of steering-like points (one per alpha list), each with a made-up dose-response."""
    rows = []
    for p, alphas in enumerate(alphas_by_point):
        s = {"steer": {"alphas": alphas, "mean_target_prob_by_alpha": [0.1 + 0.01 * a for a in alphas],
                       "hidden_states": [0, 1, 2], "mean_entropy_by_hidden_state": [3.0, 2.0, 1.0],
                       "scores": [5.0, 6.0], "n_rows": 2}}
        rows.append({"point": p, "layer": p, "status": "complete", "summary": json.dumps(s)})
    df = pd.DataFrame(rows)
    df.attrs["swept"] = ["layer"]
    return df


def _curves(fig) -> tuple[str, list[list[float]]]:
    ax = fig.axes[0]
    xs = [np.asarray(line.get_xdata(), dtype=float).tolist() for line in ax.get_lines()]
    plt().close(fig)
    return ax.get_xlabel(), xs


def test_dose_response_is_drawn_over_its_alphas_not_the_list_index():
    alphas = [-4.0, 0.0, 4.0, 8.0]
    label, xs = _curves(compare(_index([alphas, alphas]), "steer/mean_target_prob_by_alpha"))
    assert label == "alpha"
    assert xs == [alphas, alphas]


def test_points_with_different_alphas_keep_their_own_x_values():
    label, xs = _curves(compare(_index([[0.0, 2.0], [0.0, 5.0, 10.0]]), "mean_target_prob_by_alpha"))
    assert label == "alpha" and sorted(xs) == sorted([[0.0, 2.0], [0.0, 5.0, 10.0]])


def test_lens_metric_is_drawn_over_hidden_states_and_an_unnamed_list_says_so():
    label, xs = _curves(compare(_index([[0.0], [1.0]]), "steer/mean_entropy_by_hidden_state"))
    assert label == "hidden state" and xs == [[0.0, 1.0, 2.0]] * 2
    label, _ = _curves(compare(_index([[0.0], [1.0]]), "steer/scores"))
    assert "list position" in label and "names no axis" in label


def test_metric_axis_convention():
    from tracekit.sweep.figures import metric_axis

    assert metric_axis("s/mean_target_prob_by_alpha", {"alphas"}) == ("alpha", "alphas")
    assert metric_axis("target_prob_by_hidden_state", {"hidden_states"}) == ("hidden_state", "hidden_states")
    assert metric_axis("logit_diff_by_row", {"row_id_by_row"}) == ("row", "row_id_by_row")
    assert metric_axis("fvu_by_layer", set()) == ("layer", None)
    assert metric_axis("scores", {"alphas"}) == ("", None)

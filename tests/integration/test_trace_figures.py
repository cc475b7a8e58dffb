"""The token trace's figures and FFN contexts for a paper (issue 36, item 8): the DLA head grid
numbers only the top heads, at a readable size, in a colour that contrasts with the cell; the FFN
section says where its top-activating contexts come from ("contexts from: <name>, N tokens"),
reading them from the run's own dataset when there is one and from the corpus otherwise."""

from __future__ import annotations

import re
from html import unescape

import numpy as np
import pytest
from matplotlib.colors import to_rgb

from helpers import DATASET_ROWS
from tracekit import plotting
from tracekit.experiments.trace import TokenTrace

SMALL = {"key_max_tokens": 128, "top_neurons": 2, "key_contexts": 2, "top_heads": 3}


def _luminance(rgb) -> float:
    c = np.asarray(rgb, dtype=float)
    c = np.where(c <= 0.03928, c / 12.92, ((c + 0.055) / 1.055) ** 2.4)  # WCAG relative luminance
    return float(c @ np.array([0.2126, 0.7152, 0.0722]))


def _contrast(a, b) -> float:
    la, lb = sorted((_luminance(a), _luminance(b)), reverse=True)
    return (la + 0.05) / (lb + 0.05)


@pytest.fixture(scope="module")
def prompt_trace(tiny_gpt2):
    return TokenTrace.model_validate({"prompts": ["The capital of France is"], "target": " Paris", **SMALL}).run(tiny_gpt2, progress=False)


@pytest.fixture(scope="module")
def dataset_trace(tiny_gpt2):
    return TokenTrace.model_validate({"dataset": {"rows": DATASET_ROWS}, "row": 1, **SMALL}).run(tiny_gpt2, progress=False)


def test_head_grid_numbers_top_heads_readably(prompt_trace):
    res = prompt_trace
    fig = res.figures()["heads_dla"]
    try:
        ax = fig.axes[0]
        top = res.tables["top_heads"]
        texts = [t for t in ax.texts if t.get_text().strip()]
        assert sorted(t.get_text() for t in texts) == sorted(str(int(r)) for r in top["top_rank"])  # only the top-k
        im = ax.images[0]
        grid = np.asarray(im.get_array(), dtype=float)
        for t in texts:
            assert t.get_fontsize() >= 9
            x, y = (int(round(v)) for v in t.get_position())
            cell = im.cmap(im.norm(grid[y, x]))[:3]
            assert _contrast(to_rgb(t.get_color()), cell) >= 4.5, (t.get_text(), t.get_color(), cell)
    finally:
        plotting.plt().close(fig)


def test_ffn_contexts_from_the_corpus_without_a_dataset(prompt_trace):
    res = prompt_trace
    kc = res.meta["key_corpus"]
    assert kc["source"] == "corpus" and "stdlib" in kc["name"] and "Python" in kc["name"]
    assert 0 < kc["n_tokens"] <= SMALL["key_max_tokens"]
    said = f"contexts from: {kc['name']}, {kc['n_tokens']:,} tokens"
    assert said in unescape(res.html()) and said in res.markdown()
    assert res.summary()["neuron_contexts_from"] == said.removeprefix("contexts from: ")


def test_ffn_contexts_from_the_runs_dataset(dataset_trace):
    res = dataset_trace
    kc = res.meta["key_corpus"]
    prompts = [r["prompt"] for r in DATASET_ROWS]
    assert kc["source"] == "dataset" and kc["n_documents"] == len(prompts)
    assert "the run's dataset" in kc["name"] and f"{len(prompts)} prompts" in kc["name"]
    ctx = res.tables["neuron_contexts"]
    assert len(ctx)
    for c in ctx["context"]:  # every context is a piece of one of the dataset's prompts
        text = re.sub(r"\[\[|\]\]", "", str(c))
        assert any(text.strip() in p for p in prompts), c
    said = f"contexts from: {kc['name']}, {kc['n_tokens']:,} tokens"
    assert said in unescape(res.html()) and said in res.markdown()


def test_ffn_contexts_from_a_corpus_given_with_a_dataset(tiny_gpt2):
    res = TokenTrace.model_validate({"dataset": {"rows": DATASET_ROWS}, "key_corpus": "stdlib", **SMALL}).run(tiny_gpt2, progress=False)
    assert res.meta["key_corpus"]["source"] == "corpus" and "stdlib" in res.meta["key_corpus"]["name"]


def test_show_lists_the_traces_key_numbers(prompt_trace, tmp_path, capsys):
    from tracekit import cli

    run = tmp_path / "study"
    prompt_trace.save(run / "trace")
    (run / "status.json").write_text('{"status": "complete", "steps": ["trace"], "finished": ["trace"]}')
    cli.main(["show", str(run)])
    out = capsys.readouterr().out
    s = prompt_trace.summary()
    for key in ("target", "target_prob", "final_target_rank", "jump_layer", "top_components"):
        assert re.search(rf"^\s*(trace\s+token_trace\s+done\s+)?{key}\s", out, re.M), (key, out)
    assert re.search(rf"final_target_rank\s+{s['final_target_rank']}\b", out)


def test_bad_key_corpus_is_refused_naming_the_field_before_the_trace():
    from helpers import make_tiny
    from tracekit.core.errors import TracekitError
    from tracekit.experiments.trace import TokenTrace

    exp = TokenTrace(prompts="The capital of France is", target=" Paris", key_corpus="no-such-corpus-dir",
                     key_max_tokens=64, top_neurons=2, n_samples=1)
    with pytest.raises(TracekitError, match=r"key_corpus: no such file or directory 'no-such-corpus-dir'"):
        exp.prepare(make_tiny("gpt2"))

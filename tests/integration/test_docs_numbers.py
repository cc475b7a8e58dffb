"""Numbers and keys quoted in the docs agree with runs.

Fast tests check that every summary key a doc page lists exists in a run on a tiny model (and only
when the page says it does); ``slow`` tests rerun the embedded model (SmolLM2-135M, CPU float32) and
compare the numbers the tutorial, the logit-lens page and the README quote, read from the docs' text
itself, so an edited number is checked too. Tolerance: half a unit of the last digit quoted (plus
1e-6 for float32 noise): the docs round, the runs do not.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import tracekit as tk
from helpers import make_tiny
from tracekit.experiments.patching import ActivationPatchingResult

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PROMPT = "The capital of China is Beijing. The capital of France is"


def _text(name: str) -> str:
    return " ".join((DOCS / name).read_text(encoding="utf-8").split())  # line breaks do not matter


def _find(pattern: str, text: str, where: str) -> re.Match:
    m = re.search(pattern, text)
    assert m, f"{where}: the sentence /{pattern}/ is gone; update this test with the doc"
    return m


def _close(quoted: str, value: float, scale: float = 1.0) -> bool:
    """``quoted`` (a number as printed, in units of ``scale``) equals ``value`` to its printed digits."""
    dec = len(quoted.split(".")[1]) if "." in quoted else 0
    return abs(float(quoted) - value * scale) <= 0.5 * 10 ** -dec + 1e-6


def _keys(text: str) -> set[str]:
    return set(re.findall(r"`([a-z][a-z0-9_]*)`", text))


@pytest.fixture(scope="module")
def tiny():
    return make_tiny("gpt2")


# ---- fast: keys the docs list exist --------------------------------------------------------------
def test_head_scan_summary_keys_in_attention_doc_exist(tiny):
    sec = _find(r"## `head_scan`(.*)", _text("attention.md"), "attention.md").group(1)
    listed = _keys(_find(r"summary (.*?); figure", sec, "attention.md head_scan").group(1))
    conditional = _keys(_find(r"only with `prompts`/`dataset`, (`\w+`)", sec, "attention.md").group(1))
    assert {"top_induction_heads", "label_counts"} <= listed
    with_rows = tk.HeadScan(seq_len=6, n_seqs=2, prompts=["The capital of France is"]).run(tiny, progress=False)
    bare = tk.HeadScan(seq_len=6, n_seqs=2).run(tiny, progress=False)
    listed -= {"prompts", "dataset"}
    assert listed <= set(with_rows.summary()), listed - set(with_rows.summary())
    assert listed - conditional <= set(bare.summary())
    assert not conditional & set(bare.summary()), "a key the doc calls conditional is always there"


def test_logit_lens_summary_table_matches_runs(tiny):
    text = _text("logit_lens.md")
    raw = (DOCS / "logit_lens.md").read_text(encoding="utf-8")
    table = _find(r"(?s)\| key \| meaning \|\n(.*?)\n\n", raw, "logit_lens.md").group(1)
    listed = set().union(*(_keys(line.split("|")[1]) for line in table.splitlines()[1:]))  # the key column
    assert {"final_top1_by_row", "mean_target_prob_final", "tracked"} <= listed
    single = _keys(_find(r"\*\*Single-row results only:\*\*(.*?)with several rows", text, "logit_lens.md").group(1))
    single -= {"final_top1_by_row"}  # quoted in the sentence, not a single-row key
    many = tk.LogitLens(prompts=["The capital of France is", "Hello world"], target=[" Paris", " world"],
                        foil=" Rome", track=[" the"]).run(tiny, progress=False).summary()
    assert listed <= set(many), listed - set(many)
    assert not (single & set(many)), "single-row keys appear with several rows"
    one = tk.LogitLens(prompts=["The capital of France is"], target=" Paris").run(tiny, progress=False).summary()
    assert single <= set(one), single - set(one)


def test_patching_summary_keys_are_documented_and_exist():
    text = _text("patching.md")
    block = _find(r"\* `summary\.json`(.*?)\*\*Top sites", text, "patching.md").group(1)
    doc = _keys(block)
    keys = set(ActivationPatchingResult.summary_keys)
    assert keys <= doc, f"summary keys missing from docs/patching.md: {sorted(keys - doc)}"
    record_fields = {"intervention", "site", "layer", "label", "position", "position_name", "head_idx", "neuron",
                     "token", "mean_value", "mean_delta", "mean_normalized", "mean_effect", "effect", "delta",
                     "top_k", "rows"}
    assert doc - record_fields <= keys, f"docs/patching.md lists keys no run has: {sorted(doc - record_fields - keys)}"


# ---- slow: the embedded model's numbers ----------------------------------------------------------
@pytest.fixture(scope="module")
def lens(embedded_model):
    return tk.LogitLens(prompts=[PROMPT], target=" Paris", position="all", layer_convention="hidden_states",
                        top_k=10).run(embedded_model, progress=False)


@pytest.mark.slow
def test_logit_lens_doc_numbers(lens):
    """docs/logit_lens.md, "Embedded model result"."""
    t = _find(r"\*\*Embedded model result\*\*(.*?)GPT-2 Small", _text("logit_lens.md"), "logit_lens.md").group(1)
    s = lens.summary()
    prob, rank = s["target_prob_by_hidden_state"], s["target_rank_by_hidden_state"]
    m = _find(r"top 200 at hidden state (\d+) \(rank (\d+)\) and the top 20 at (\d+) \(rank (\d+)\)", t, "lens")
    h1, r1, h2, r2 = map(int, m.groups())
    assert (rank[h1], rank[h2]) == (r1, r2) and rank[h1 - 1] > 200 and rank[h2 - 1] > 20
    m = _find(r"reaches ([\d.]+)% at (\d+)", t, "lens")
    assert _close(m.group(1), prob[int(m.group(2))], 100)
    m = _find(r"is top-1 from hidden state (\d+) on \(([\d.]+)%, the output of block (\d+): emergence layer (\d+)\)",
              t, "lens")
    assert s["emergence_hidden_state"] == int(m.group(1)) and _close(m.group(2), prob[int(m.group(1))], 100)
    assert s["emergence_layer"] == int(m.group(3)) == int(m.group(4))
    assert _close(_find(r"ends at ([\d.]+)%", t, "lens").group(1), s["target_prob_final"], 100)
    m = _find(r"\(([\d.]+)% -> ([\d.]+)%, block (\d+)\)", t, "lens")
    j = s["jump"]
    assert _close(m.group(1), j["from_prob"], 100) and _close(m.group(2), j["to_prob"], 100)
    assert s["jump_layer"] == int(m.group(3))


@pytest.mark.slow
def test_tutorial_numbers(lens, embedded_model):
    """docs/tutorial.md: the trace's headline bullets and the logit-lens step."""
    t = _text("tutorial.md")
    s = lens.summary()
    prob, rank = s["target_prob_by_hidden_state"], s["target_rank_by_hidden_state"]
    m = _find(r"the prompt is (\d+) tokens; ' Paris' \(id (\d+)\) ends up at ([\d.]+)%, second '([^']+)' at ([\d.]+)%",
              t, "tutorial")
    toks = lens.tables["tokens"]
    assert len(toks[toks["prompt_idx"] == 0]) == int(m.group(1))
    assert embedded_model.tokenizer.encode(" Paris", add_special_tokens=False) == [int(m.group(2))]
    fin = lens.tables["final"]
    last = fin[fin["is_last"]].iloc[0]
    assert last["topk_tokens"][0] == " Paris" and _close(m.group(3), last["topk_probs"][0], 100)
    assert last["topk_tokens"][1] == m.group(4) and _close(m.group(5), last["topk_probs"][1], 100)
    m = _find(r"outside the top 100 through hidden state (\d+) \(rank (\d+)\), rank (\d+) at (\d+), rank 1 from "
              r"hidden state (\d+) on \(the output of block (\d+), at ([\d.]+)%", t, "tutorial")
    h, r, r2, h2, e, b, p = m.groups()
    assert all(x > 100 for x in rank[:int(h) + 1]) and rank[int(h)] == int(r) and rank[int(h2)] == int(r2)
    assert s["emergence_hidden_state"] == int(e) and s["emergence_layer"] == int(b) and _close(p, prob[int(e)], 100)
    m = _find(r"becomes top-1 at hidden state (\d+) \(the output of block (\d+), at ([\d.]+)%\), one before the last; "
              r"the last block lifts it to ([\d.]+)% at the output \(hidden state (\d+)\)", t, "tutorial")
    assert s["emergence_hidden_state"] == int(m.group(1)) and _close(m.group(3), prob[int(m.group(1))], 100)
    assert _close(m.group(4), prob[int(m.group(5))], 100) and int(m.group(5)) == len(prob) - 1


@pytest.mark.slow
def test_tutorial_dla_numbers(embedded_model):
    t = _text("tutorial.md")
    m = _find(r"the parts sum to the logit ([\d.]+); the largest writers are attention (\d+) \(\+([\d.]+)\), MLP (\d+) "
              r"\(\+([\d.]+)\) and attention (\d+) \(\+([\d.]+)\)", t, "tutorial")
    res = tk.DirectLogitAttribution(prompts=[PROMPT], target=" Paris").run(embedded_model, progress=False)
    s = res.summary()
    assert _close(m.group(1), s["mean_logit_diff"]) and _close(m.group(1), s["mean_attributed_logit_diff"])
    top = [(c, v) for c, v in s["top_components_mean"][:3]]
    want = [(f"attn.{m.group(2)}", m.group(3)), (f"mlp.{m.group(4)}", m.group(5)), (f"attn.{m.group(6)}", m.group(7))]
    for (c, v), (wc, wv) in zip(top, want):
        assert c == wc and _close(wv, v), (top, want)


@pytest.mark.slow
def test_readme_multi_token_target_message(embedded_model):
    """The README quotes the error for ' Parisian' with the default model's token ids."""
    readme = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    quoted = _find(r"`(target: ' Parisian' is 2 tokens \[[^\]]*\])", readme, "README.md").group(1)
    with pytest.raises(tk.TokenizationError) as e:
        tk.LogitLens(prompts=[PROMPT], target=" Parisian").check(embedded_model)
    assert quoted in str(e.value), (quoted, str(e.value))

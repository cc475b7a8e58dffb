"""Factual-recall datasets that feed patching (issue 36, items 2 and 3).

* ``capitals`` with ``corrupt: country`` (the default): each row's corrupted prompt swaps the
  subject for another country of the table whose name is as many tokens for the model's tokenizer
  (the real GPT-2 tables), seeded, never the row's own; the foil is that country's capital; ``SUBJ``
  and ``END`` index the subject's last token and the last token in both prompts, few-shot or not;
  too many countries without a partner is refused naming ``corrupt`` and the fix.
* ``filter: top1`` keeps the rows whose target is the model's top-1 next token, where ``correct``
  (the target beats the foil) keeps a row whose target is not top-1; the summary of a kind says
  which filter ran and which rows it dropped.
* ``activation_patching`` runs on the generated pairs.
"""

from __future__ import annotations

import pytest
import torch

import tracekit as tk
from helpers import make_tiny
from tracekit.core.errors import DatasetError
from tracekit.dataset import DatasetSpec, Row, filter_rows, generate, prepare_rows
from tracekit.dataset import generators as G
from tracekit.tokens import encode, single_token_id, str_tokens


@pytest.fixture(scope="module", params=[True, False], ids=["bos", "no_bos"])
def model(request):
    return make_tiny("gpt2", prepend_bos=request.param)


def _ntok(model, text):
    return len(encode(model, text, prepend_bos=False))


@pytest.mark.parametrize("few_shot", [False, True], ids=["zero_shot", "few_shot"])
def test_capitals_pairs_swap_the_country_for_one_of_the_same_token_length(model, few_shot):
    data = DatasetSpec(generator={"name": "capitals", "few_shot": few_shot}).prepare(model)
    table = {r["country"]: r for r in G._countries()}
    swapped_lengths = set()
    assert len(data) >= 10
    for e in data.examples:
        r = e.row
        mine, other = table[r.extra["country"]], table[r.extra["corrupt_country"]]
        assert other["country"] != mine["country"]
        prefix = G.FEW_SHOT_CAPITALS if few_shot else ""
        assert r.prompt == f"{prefix}The capital of {mine['phrase']} is"
        assert r.corrupted == f"{prefix}The capital of {other['phrase']} is"
        assert _ntok(model, " " + other["phrase"]) == _ntok(model, " " + mine["phrase"])
        swapped_lengths.add(_ntok(model, " " + mine["phrase"]))
        # the corrupted prompt's answer is the foil: logit(target) - logit(foil) is the clean/corrupted contrast
        assert r.target == " " + mine["capital"] and r.foil == " " + other["capital"] and r.target != r.foil
        assert e.corrupted_ids is not None and len(e.corrupted_ids) == len(e.ids)
        clean, corr = str_tokens(model, list(e.ids)), str_tokens(model, list(e.corrupted_ids))
        s, end = e.positions["SUBJ"], e.positions["END"]
        k = _ntok(model, " " + mine["phrase"])
        # SUBJ is the subject's last token in both prompts; the k tokens ending there are the subject
        assert "".join(clean[s - k + 1:s + 1]) == " " + mine["phrase"]
        assert "".join(corr[s - k + 1:s + 1]) == " " + other["phrase"]
        assert end == len(e.ids) - 1 and clean[end] == corr[end] == " is"
        assert clean[:s - k + 1] == corr[:s - k + 1] and clean[s + 1:] == corr[s + 1:]
    assert swapped_lengths == {1, 2}  # the GPT-2 tables: one-token countries and "the Netherlands"-like ones


def test_capitals_pairs_are_seeded(model):
    a, _ = generate(model, "capitals", seed=3)
    b, _ = generate(model, "capitals", seed=3)
    c, _ = generate(model, "capitals", seed=4)
    swaps = lambda rows: [(r.extra["country"], r.extra["corrupt_country"]) for r in rows]  # noqa: E731
    assert swaps(a) == swaps(b)
    assert swaps(a) != swaps(c)
    none, _ = generate(model, "capitals", seed=3, corrupt="none")
    assert all(r.corrupted is None and "corrupt_country" not in r.extra for r in none)


def test_capitals_drops_countries_without_a_partner_and_refuses_too_many(model, monkeypatch):
    table = G._countries()
    one = [r for r in table if _ntok(model, " " + r["phrase"]) == 1 and _ntok(model, " " + r["capital"]) == 1]
    two = [r for r in table if _ntok(model, " " + r["phrase"]) == 2 and _ntok(model, " " + r["capital"]) == 1]
    assert len(one) >= 4 and len(two) >= 1
    monkeypatch.setattr(G, "_countries", lambda: one[:4] + two[:1])  # one two-token country: no partner
    rows, dropped = generate(model, "capitals")
    assert dropped["country without a partner of its token length"] == 1
    assert two[0]["country"] not in [r.extra["country"] for r in rows] and len(rows) == 4
    data = DatasetSpec(generator={"name": "capitals"}).prepare(model)
    assert data.dropped["country without a partner of its token length"] == 1
    # 3 of 5 countries (one of each length 2, 3 and 4) without a partner: more than half, refused
    monkeypatch.setattr(G, "_countries", lambda: one[:2] + two[:1] + [
        {**one[2], "phrase": one[2]["phrase"] + " Republic of"},
        {**one[3], "phrase": one[3]["phrase"] + " Republic of Somewhere"}])
    with pytest.raises(DatasetError, match=r"dataset\.generator\.corrupt: capitals with corrupt: country swaps .* "
                                           r"3 of the 5 usable countries .* have none for this model's tokenizer.* "
                                           r"set corrupt: none"):
        DatasetSpec(generator={"name": "capitals"}).prepare(model)
    assert len(DatasetSpec(generator={"name": "capitals", "corrupt": "none"}).prepare(model)) == 5


def test_corrupt_values_are_checked_per_generator():
    with pytest.raises(ValueError, match=r"corrupt: generator 'capitals' takes country \| none, not 'abc'"):
        DatasetSpec(generator={"name": "capitals", "corrupt": "abc"})
    with pytest.raises(ValueError, match=r"corrupt: generator 'ioi' takes swap_s2 \| abc \| none, not 'country'"):
        DatasetSpec(generator={"name": "ioi", "corrupt": "country"})
    assert DatasetSpec(generator="capitals").generator.corrupt == "country"  # type: ignore[union-attr]
    assert DatasetSpec(generator="ioi").generator.corrupt == "swap_s2"  # type: ignore[union-attr]
    # a config saved before capitals took corrupt lists ioi's default: what ran had no corrupted prompt
    assert DatasetSpec(generator={"name": "capitals", "corrupt": "swap_s2"}).generator.corrupt == "none"  # type: ignore[union-attr]


@pytest.fixture(scope="module")
def biased():
    """A tiny model whose next token is ' Paris' on every prompt (a large unembedding bias), with
    ' Rome' second: so ' Rome' beats ' Berlin' (filter: correct keeps a Rome row) but is not top-1."""
    m = make_tiny("gpt2")
    paris, rome = single_token_id(m, " Paris"), single_token_id(m, " Rome")
    before = m.unembed.b_U.detach().clone()
    with torch.no_grad():
        m.unembed.b_U[paris] += 1000.0
        m.unembed.b_U[rome] += 500.0
    yield m
    with torch.no_grad():  # make_tiny's models are shared by the session: leave it as it was
        m.unembed.b_U.copy_(before)


ROWS = [{"prompt": "The capital of France is", "target": " Paris", "foil": " Rome"},
        {"prompt": "The capital of Italy is", "target": " Rome", "foil": " Berlin"},
        {"prompt": "The capital of Germany is", "target": " Berlin", "foil": " Paris"}]


def test_filter_top1_drops_a_row_whose_target_only_beats_its_foil(biased):
    data = prepare_rows(biased, [Row.model_validate(r) for r in ROWS])
    correct = filter_rows(biased, data, "correct")
    top1 = filter_rows(biased, data, "top1")
    assert [e.row_id for e in correct.examples] == [0, 1]
    assert [e.row_id for e in top1.examples] == [0]
    assert top1.dropped["filter: top1"] == 2
    rep = top1.filter_report
    assert rep is not None and rep["filter"] == "top1" and (rep["rows_in"], rep["kept"], rep["dropped"]) == (3, 1, 2)
    assert [(r["row_id"], r["prompt"], r["target"], r["top1"]) for r in rep["dropped_rows"]] == [
        (1, ROWS[1]["prompt"], " Rome", " Paris"), (2, ROWS[2]["prompt"], " Berlin", " Paris")]
    assert correct.filter_report is not None and correct.filter_report["filter"] == "correct"
    assert [r["row_id"] for r in correct.filter_report["dropped_rows"]] == [2]
    with pytest.raises(DatasetError, match=r"dataset\.filter: the model gets none of the 1 rows right under filter: "
                                           r"top1"):
        filter_rows(biased, prepare_rows(biased, [Row.model_validate(ROWS[1])]), "top1")


@pytest.mark.parametrize("how", ["top1", "correct"])
def test_summary_says_which_filter_ran_and_what_it_dropped(biased, how):
    res = tk.DirectLogitAttribution(dataset={"rows": ROWS, "filter": how}).run(biased, progress=False)
    s = res.summary()["dataset_filter"]
    want = {"top1": [1, 2], "correct": [2]}[how]
    assert s["filter"] == how and s["rows_in"] == 3 and s["kept"] == 3 - len(want) and s["dropped"] == len(want)
    assert [r["row_id"] for r in s["dropped_rows"]] == want
    assert res.meta["dataset_filter"] == s
    lost = ", ".join(f"row {i} {ROWS[i]['target']!r} (top-1 ' Paris')" for i in want)
    assert f"dataset filter: {how} kept {3 - len(want)} of 3 rows, dropped {len(want)}: {lost}" in res.report()
    plain = tk.DirectLogitAttribution(dataset={"rows": ROWS}).run(biased, progress=False)
    assert "dataset_filter" not in plain.summary() and "dataset filter" not in plain.report()


def test_activation_patching_runs_on_generated_capitals_pairs(biased):
    ds = {"generator": {"name": "capitals", "n": 6, "seed": 0}}
    res = tk.ActivationPatching(dataset=ds, sites=["resid_pre", "attn_out", "mlp_out"], positions=["SUBJ", "END"],
                                metrics=["logit_diff"]).run(biased, progress=False)
    s = res.summary()
    assert s["n_rows"] == 6 and s["positions"] == ["SUBJ", "END"]
    main = res.to_frame()
    assert {"resid_pre", "attn_out", "mlp_out"} <= set(main["site"])
    rows = res.tables["rows"]
    assert rows["corrupted"].notna().all() and (rows["target"] != rows["foil"]).all()

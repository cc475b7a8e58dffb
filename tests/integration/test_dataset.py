"""tracekit.dataset: rows, named positions under BOS and padding, generators, files, filter: correct."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch

from helpers import make_tiny
from tracekit.core.errors import DatasetError
from tracekit.dataset import (
    IOI_NAMES,
    DatasetSpec,
    Row,
    filter_correct,
    prepare_rows,
    rows_from_prompts,
)
from tracekit.tokens import encode, pad_ids, str_tokens

IOI_ROW = {"prompt": "When Mary and John went to the store, John gave a drink to", "target": " Mary",
           "foil": " John", "positions": {"IO": " Mary", "S1": {"text": " John", "occurrence": 0},
                                          "S2": {"text": " John", "occurrence": -1}, "END": -1, "FIRST": 0}}
SHORT_ROW = {"prompt": "Then, John and Mary met. John said to", "target": " Mary", "foil": " John",
             "positions": {"IO": " Mary", "S1": {"text": " John", "occurrence": 0}, "S2": " John", "END": -1,
                           "FIRST": 0}}


@pytest.fixture(scope="module", params=[True, False], ids=["bos", "no_bos"])
def model(request):
    return make_tiny("gpt2", prepend_bos=request.param)


def _tok(model, ids, i):
    return str_tokens(model, [ids[i]])[0]


def test_named_positions_point_at_their_tokens(model):
    data = prepare_rows(model, [Row.model_validate(IOI_ROW), Row.model_validate(SHORT_ROW)])
    for e in data.examples:
        toks = str_tokens(model, list(e.ids))
        assert toks[e.positions["IO"]] == " Mary"
        assert toks[e.positions["S1"]] == " John" and toks[e.positions["S2"]] == " John"
        assert e.positions["S1"] < e.positions["IO"] or e.positions["S1"] > e.positions["IO"]
        assert e.positions["S1"] < e.positions["S2"]
        assert e.positions["END"] == len(e.ids) - 1
        # an int counts the text's tokens: 0 is the first text token whether or not a BOS is prepended
        assert e.positions["FIRST"] == e.n_bos
        assert toks[e.positions["FIRST"]] == str_tokens(model, encode(model, e.prompt, prepend_bos=False)[:1])[0]


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_index_reads_each_rows_own_token(model, side):
    data = prepare_rows(model, [Row.model_validate(IOI_ROW), Row.model_validate(SHORT_ROW)])
    assert len(data.examples[0].ids) != len(data.examples[1].ids)
    batch = pad_ids(model, data.ids, side)
    for name, want in (("IO", " Mary"), ("S2", " John"), ("END", " to")):
        idx = data.padded_index(batch, [0, 1], name)
        got = [str_tokens(model, [int(batch.tokens[r, idx[r]])])[0] for r in range(2)]
        assert got == [want, want], (name, side)
    # counted from the padded start, the shorter row's END would not be its last token under left padding
    if side == "left":
        naive = torch.tensor(data.position("END"))
        assert int(naive[1]) != int(data.padded_index(batch, [0, 1], "END")[1])


def test_row_errors_name_the_row_and_the_fix(model):
    rows = [Row(prompt="The capital of France is", target=" Paris"),
            Row(prompt="The capital of Spain is", target=" Madridxyzq")]
    with pytest.raises(DatasetError, match=r"dataset\.rows\[1\]\.target: ' Madridxyzq' is \d+ tokens"):
        prepare_rows(model, rows)
    with pytest.raises(DatasetError, match=r"rows\[0\]: target and foil are the same token"):
        prepare_rows(model, [Row(prompt="a b", target=" b", foil=" b")])
    with pytest.raises(DatasetError, match=r"rows\[0\]\.positions\.X: index 9 is out of range .*BOS\s+not counted"):
        prepare_rows(model, [Row(prompt="a b", positions={"X": 9})])
    with pytest.raises(DatasetError, match=r"positions\.X: ' zebra' does not occur"):
        prepare_rows(model, [Row(prompt="a b", positions={"X": " zebra"})])
    with pytest.raises(DatasetError, match=r"positions\.X: occurrence 2 of ' b', but it occurs 1 time"):
        prepare_rows(model, [Row(prompt="a b", positions={"X": {"text": " b", "occurrence": 2}})])
    with pytest.raises(DatasetError, match=r"rows\[0\]\.corrupted: \d+ tokens, the prompt \d+"):
        prepare_rows(model, [Row(prompt="a b c", corrupted="a b c d e")])
    with pytest.raises(DatasetError, match=r"not a named position of row 0"):
        prepare_rows(model, [Row(prompt="a b")]).position("END")
    with pytest.raises(ValueError, match="must be an identifier"):
        Row(prompt="a", positions={"the end": -1})
    with pytest.raises(ValueError, match="'answer' was renamed to 'target'"):
        Row.model_validate({"prompt": "a", "answer": " b"})


def test_target_list_is_one_per_prompt_and_track_is_named():
    rows = rows_from_prompts(["a", "b"], [" x", " y"], " z")
    assert [(r.target, r.foil) for r in rows] == [(" x", " z"), (" y", " z")]
    with pytest.raises(DatasetError, match=r"target: 3 tokens for 2 prompt\(s\).*track: \[' x', ' y', ' w'\]"):
        rows_from_prompts(["a", "b"], [" x", " y", " w"])


def test_spec_needs_exactly_one_source_and_fitting_options():
    with pytest.raises(ValueError, match="exactly one of rows, path, generator"):
        DatasetSpec()
    with pytest.raises(ValueError, match="exactly one of rows, path, generator"):
        DatasetSpec(rows=[{"prompt": "a"}], generator="ioi")
    with pytest.raises(ValueError, match=r"generator 'induction' takes no corrupt \(an option of ioi / capitals\)"):
        DatasetSpec(generator={"name": "induction", "corrupt": "abc"})
    for name in ("capitals", "ioi", "induction"):
        saved = DatasetSpec(generator=name).model_dump(mode="json")  # every field, as config.json holds it
        assert DatasetSpec.model_validate(saved) == DatasetSpec(generator=name)
    with pytest.raises(ValueError, match="unknown generator 'iio'"):
        DatasetSpec(generator="iio")
    with pytest.raises(ValueError, match="columns: \\['label'\\] are not row fields"):
        DatasetSpec(path="x.csv", columns={"label": "y"})


@pytest.mark.parametrize("corrupt", ["swap_s2", "abc"])
def test_ioi_generator(model, corrupt):
    data = DatasetSpec(generator={"name": "ioi", "n": 24, "seed": 3, "corrupt": corrupt}).prepare(model)
    assert len(data) == 24
    single = [n for n in IOI_NAMES if len(encode(model, " " + n, prepend_bos=False)) == 1]
    assert data.dropped["names not one token"] == len(IOI_NAMES) - len(single)
    groups = [e.row.group for e in data.examples]
    assert groups.count("ABBA") == groups.count("BABA") == 12
    for e in data.examples:
        toks = str_tokens(model, list(e.ids))
        assert e.row.target and e.row.foil and e.row.target != e.row.foil
        assert toks[e.positions["IO"]] == e.row.target and toks[-1] == toks[e.positions["END"]]
        assert toks[e.positions["S1"]] == e.row.foil == toks[e.positions["S2"]]
        assert e.positions["S1"] < e.positions["S2"]
        io_first = e.positions["IO"] < e.positions["S1"]
        assert io_first == (e.row.group == "ABBA")
        # the corrupted prompt differs from the clean one exactly at S2
        assert e.corrupted_ids is not None
        diff = [i for i, (a, b) in enumerate(zip(e.ids, e.corrupted_ids)) if a != b]
        assert diff == [e.positions["S2"]]
        c = str_tokens(model, [e.corrupted_ids[diff[0]]])[0]
        assert (c == e.row.target) if corrupt == "swap_s2" else (c not in (e.row.target, e.row.foil))
    again = DatasetSpec(generator={"name": "ioi", "n": 24, "seed": 3, "corrupt": corrupt}).prepare(model)
    assert again.prompts == data.prompts
    assert DatasetSpec(generator={"name": "ioi", "n": 24, "seed": 4}).prepare(model).prompts != data.prompts


def test_capitals_and_induction_generators(model):
    cap = DatasetSpec(generator={"name": "capitals", "few_shot": True}).prepare(model)
    assert all(e.prompt.startswith("The capital of China is Beijing. ") for e in cap.examples)
    assert "China" not in [e.row.extra["country"] for e in cap.examples]
    for e in cap.examples:
        toks = str_tokens(model, list(e.ids))
        assert e.row.extra["country"].split()[-1].endswith(toks[e.positions["SUBJ"]].strip())
        assert len(encode(model, e.row.target, prepend_bos=False)) == 1
    ind = DatasetSpec(generator={"name": "induction", "n": 5, "seq_len": 6}).prepare(model)
    for e in ind.examples:
        toks = str_tokens(model, list(e.ids))
        assert toks[e.positions["SRC"]] == e.row.target
        assert toks[e.positions["PREV"]] == toks[e.positions["END"]]
        assert len(e.ids) == e.n_bos + 11


def test_files_read_the_same_rows(model, tmp_path):
    recs = [IOI_ROW, {**SHORT_ROW, "group": "g7", "extra_col": "x"}]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in recs))
    flat = [{"group": None, "extra_col": None, **r, "positions": json.dumps(r["positions"])} for r in recs]
    pd.DataFrame(flat).to_csv(tmp_path / "d.csv", index=False)
    pd.DataFrame(flat).to_parquet(tmp_path / "d.parquet")
    import datasets

    datasets.Dataset.from_list(flat).save_to_disk(str(tmp_path / "hf"))
    renamed = [{("text" if k == "prompt" else k): v for k, v in r.items()} for r in recs]
    (tmp_path / "r.json").write_text(json.dumps(renamed))
    want = prepare_rows(model, [Row.model_validate(r) for r in recs])
    for spec in ({"path": str(tmp_path / "d.jsonl")}, {"path": str(tmp_path / "d.csv")},
                 {"path": str(tmp_path / "d.parquet")}, {"path": str(tmp_path / "hf")},
                 {"path": str(tmp_path / "r.json"), "columns": {"prompt": "text"}}):
        got = DatasetSpec.model_validate(spec).prepare(model)
        assert got.ids == want.ids, spec
        assert [dict(e.positions) for e in got.examples] == [dict(e.positions) for e in want.examples], spec
        assert [e.row.group for e in got.examples] == [None, "g7"], spec
    with pytest.raises(DatasetError, match=r"dataset\.path: row 0 \(line 1\) of bad\.jsonl"):
        (tmp_path / "bad.jsonl").write_text(json.dumps({"target": " x"}))
        DatasetSpec(path=str(tmp_path / "bad.jsonl")).prepare(model)
    with pytest.raises(DatasetError, match="columns.prompt: r.json has no column 'sentence'"):
        DatasetSpec(path=str(tmp_path / "r.json"), columns={"prompt": "sentence"}).prepare(model)


def test_filter_correct_keeps_the_rows_the_model_gets_right(model):
    rows = [Row(prompt=f"The {w} of the", target=t, foil=f) for w in ("cat", "dog", "city", "king", "river")
            for t, f in ((" house", " same"), (" same", " house"))]
    rows += [Row(prompt="One two three", target=" four")]  # no foil: the target must be top-1
    data = prepare_rows(model, rows)
    kept = filter_correct(model, data, batch_size=3)
    want = []
    for i, e in enumerate(data.examples):
        logits = model(torch.tensor([list(e.ids)]))[0, -1]
        ok = logits[e.target_id] > logits[e.foil_id] if e.foil_id is not None else int(logits.argmax()) == e.target_id
        want.append(i) if ok else None
    if not want:
        pytest.skip("the random model gets no row right")
    assert [e.row_id for e in kept.examples] == want
    assert kept.dropped["filter: correct"] == len(rows) - len(want)
    assert 0 < len(want) < len(rows)  # each pair of rows with swapped target/foil has exactly one right


def test_probing_reads_the_shared_rows_at_a_named_position():
    from tracekit.experiments.probing import LinearProbe

    m = make_tiny("gpt2", prepend_bos=True, padding_side="left")
    spec = {"generator": "capitals", "label": "group", "group": "country", "drop_small_classes": True}
    exp = LinearProbe(kind="linear_probe", dataset=spec, position="SUBJ", layers=[0, 2])
    inputs = exp.prepare(m)
    frame = inputs.dataset.frame
    assert len(frame) == len(inputs.ids) > 10
    for ids, pos, phrase in zip(inputs.ids, inputs.positions, frame["country"]):
        assert len(pos) == 1
        # the token read ends the country's name in that row's own tokens (BOS counted)
        assert phrase.endswith(str_tokens(m, [ids[pos[0]]])[0].strip())
    assert set(frame["label"]) <= {"Europe", "Asia", "Africa", "North America", "South America", "Oceania"}
    assert list(frame["group"]) == list(frame["country"])  # group: country -> splits hold countries out
    with pytest.raises(Exception, match="'NOPE' is not a named position of the dataset's rows"):
        LinearProbe(kind="linear_probe", dataset=spec, position="NOPE").prepare(m)


def test_trace_follows_the_chosen_rows_own_target_and_foil():
    from tracekit.experiments.trace import TokenTrace

    m = make_tiny("gpt2")
    rows = [{"prompt": "The capital of France is", "target": " Paris", "foil": " Rome"},
            {"prompt": "The capital of Italy is not", "target": " Rome", "foil": " Paris"}]
    small = {"key_max_tokens": 64, "top_neurons": 2, "n_samples": 1}
    # key_corpus: the contexts from the corpus, as the prompt-mode trace reads them (a dataset trace
    # reads its own rows' prompts by default)
    by_row = TokenTrace(dataset={"rows": rows}, row=1, key_corpus="stdlib", **small).run(m, progress=False)
    direct = TokenTrace(prompts=rows[1]["prompt"], target=" Rome", foil=" Paris", **small).run(m, progress=False)
    assert by_row.meta["row_id"] == 1
    assert set(by_row.tables) == set(direct.tables)
    for name, df in direct.tables.items():
        pd.testing.assert_frame_equal(df, by_row.tables[name], check_exact=False, atol=1e-6)
    with pytest.raises(DatasetError, match="row: 2 is out of range for a dataset of 2 rows"):
        TokenTrace(dataset={"rows": rows}, row=2).prepare(m)
    with pytest.raises(ValueError, match="target/foil beside a dataset"):
        TokenTrace(dataset={"rows": rows}, target=" Paris")


# --- issue #33: one checked file reader, one checked generator draw ------------------------------


def test_a_repeated_column_is_refused_naming_it(model, tmp_path):
    """A CSV header (or a JSON record, or a Parquet schema) naming a column twice kept the last one."""
    (tmp_path / "d.csv").write_text("prompt,target,target\nThe capital of France is, Paris, Rome\n")
    with pytest.raises(DatasetError, match=r"dataset\.path: d\.csv names the column 'target' twice"):
        DatasetSpec(path=str(tmp_path / "d.csv")).prepare(model)
    (tmp_path / "d.jsonl").write_text('{"prompt": "The capital of France is", "target": " Paris", "target": " Rome"}\n')
    with pytest.raises(DatasetError, match=r"dataset\.path: d\.jsonl line 1 names the key 'target' twice"):
        DatasetSpec(path=str(tmp_path / "d.jsonl")).prepare(model)
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table([["The capital of France is"], [" Paris"], [" Rome"]], names=["prompt", "target", "target"]),
                   tmp_path / "d.parquet")
    with pytest.raises(DatasetError, match=r"dataset\.path: d\.parquet names the column 'target' twice"):
        DatasetSpec(path=str(tmp_path / "d.parquet")).prepare(model)


def test_a_files_own_row_id_is_kept(model, tmp_path):
    body = "The capital of France is, Paris\nThe capital of Italy is, Rome\nThe capital of Spain is, Madrid\n"
    (tmp_path / "d.csv").write_text("row_id,prompt,target\n" + "".join(
        f"{i},{line}\n" for i, line in zip((7, 3, 12), body.splitlines())))
    data = DatasetSpec(path=str(tmp_path / "d.csv")).prepare(model)
    assert [e.row_id for e in data.examples] == [7, 3, 12]
    assert list(data.frame()["row_id"]) == [7, 3, 12]
    assert [e.row_id for e in data.select([0, 2]).examples] == [7, 12]
    inline = DatasetSpec(rows=[{"prompt": "a b c", "row_id": 5}, {"prompt": "d e f", "row_id": 1}]).prepare(model)
    assert [e.row_id for e in inline.examples] == [5, 1]
    for ids, why in (("7 7 12", r"\[1\]\.row_id: 7 is also row 0's row_id"),
                     ("7 x 12", r"\[1\]\.row_id: 'x' is not a row id"), ("7 -1 12", r"\[1\]\.row_id: '-1' is not a row id")):
        (tmp_path / "bad.csv").write_text("row_id,prompt,target\n" + "".join(
            f"{i},{line}\n" for i, line in zip(ids.split(), body.splitlines())))
        with pytest.raises(DatasetError, match=rf"dataset\.path row{why}"):
            DatasetSpec(path=str(tmp_path / "bad.csv")).prepare(model)
    (tmp_path / "half.jsonl").write_text('{"prompt": "a b", "row_id": 4}\n{"prompt": "c d"}\n')
    with pytest.raises(DatasetError, match=r"dataset\.path row\[1\]\.row_id: this row has none but row 0 has one"):
        DatasetSpec(path=str(tmp_path / "half.jsonl")).prepare(model)


@pytest.mark.parametrize("name,content,why", [
    ("latin1.csv", "prompt,target\nCaf\xe9 au lait is, hot\n".encode("latin-1"), r"is not UTF-8 .*save it as UTF-8"),
    ("latin1.jsonl", '{"prompt": "Caf\xe9"}\n'.encode("latin-1"), r"is not UTF-8 .*save it as UTF-8"),
    ("damaged.parquet", b"PAR1\x00\x01garbage", r"is not a readable Parquet file .*write it again"),
    ("damaged.json", b'[{"prompt": "a"', r"is not valid JSON .*one list of objects"),
    ("empty.csv", b"", r"is empty"),
    ("blank.jsonl", b"\n\n  \n", r"is empty"),
], ids=lambda v: v if isinstance(v, str) and "." in v and " " not in v else "")
def test_unreadable_files_name_the_file_and_the_fix(model, tmp_path, name, content, why):
    """Non-UTF-8 text, a damaged Parquet file, broken JSON, an empty file: a DatasetError naming the
    field and the file, never a UnicodeDecodeError / pyarrow / pandas traceback."""
    (tmp_path / name).write_bytes(content)
    with pytest.raises(DatasetError, match=rf"dataset\.path: {name} {why}"):
        DatasetSpec(path=str(tmp_path / name)).prepare(model)


def test_pairs_files_go_through_the_checked_reader(tmp_path):
    from tracekit.core.errors import ConfigError
    from tracekit.dataset.pairs import load_pairs

    (tmp_path / "p.csv").write_bytes("clean,corrupted,target,foil\nCaf\xe9 is,Tea is, hot, cold\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=r"pairs_file: p\.csv is not UTF-8 .*save it as UTF-8"):
        load_pairs(tmp_path / "p.csv")
    (tmp_path / "d.csv").write_text("clean,corrupted,target,target\na,b, x, y\n")
    with pytest.raises(ConfigError, match=r"pairs_file: d\.csv names the column 'target' twice"):
        load_pairs(tmp_path / "d.csv")
    (tmp_path / "ok.csv").write_text('clean,corrupted,target,foil\na b,c b, x,\nd e,f e,"["" x"", "" y""]",\n')
    pairs = load_pairs(tmp_path / "ok.csv")
    assert [(p.target, p.foil) for p in pairs] == [(" x", None), ([" x", " y"], None)]


class _Alarm(Exception):
    pass


def _bounded(seconds, fn):
    """``fn()``, failing (not hanging) when it runs longer than ``seconds``."""
    import signal

    def ring(*_):
        raise _Alarm(f"still running after {seconds}s (an unbounded redraw loop)")

    old = signal.signal(signal.SIGALRM, ring)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        return fn()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _prep(model, **generator):
    return _bounded(20, lambda: DatasetSpec(generator=generator).prepare(model))


def test_ioi_names_that_collide_fail_before_the_draw(model):
    """Every 3 of these names hold a name that starts another: the draw redrew forever."""
    with pytest.raises(DatasetError, match=r"dataset\.generator\.names: .*' Dan' starts ' Danny', ' Sara' starts "
                                           r"' Sarah'"):
        _prep(model, name="ioi", names=["Sara", "Sarah", "Dan", "Danny"])
    ok = _prep(model, name="ioi", names=["Sara", "Sarah", "John", "Mary", "Paul"], n=6)
    names = {e.row.target for e in ok.examples} | {e.row.foil for e in ok.examples}
    assert names <= {" Sara", " Sarah", " John", " Mary", " Paul"} and len(ok) == 6


def test_ioi_names_given_twice_or_too_few_are_named(model):
    """A name given twice was blamed on a row's foil ("target and foil are the same token")."""
    with pytest.raises(DatasetError, match=r"dataset\.generator\.names: 'John' is given twice"):
        _prep(model, name="ioi", names=["John", "Mary", "John", "Paul"])
    with pytest.raises(DatasetError, match=r"dataset\.generator\.names: ioi draws 3 distinct names per row \(.*\); "
                                           r"2 names are given, 2 of them one token"):
        _prep(model, name="ioi", names=["John", "Mary"])


def test_capitals_and_induction_options_say_what_is_asked_and_available(model):
    """capitals n: 1 said "only 1 capitals are one token" (the sample, not the tokenizer, was short)."""
    with pytest.raises(DatasetError, match=r"dataset\.generator\.n: capitals needs n >= 2 \(a row's foil is another "
                                           r"row's capital\); n is 1"):
        _prep(model, name="capitals", n=1)
    assert len(_prep(model, name="capitals", n=2)) == 2
    with pytest.raises(DatasetError, match=r"dataset\.generator\.seq_len: induction draws seq_len \+ 1 = 1000 "
                                           r"distinct words per row \(seq_len words and a foil\); only \d+ of the \d+ "
                                           r"built-in words are one token for this model; use seq_len <= \d+"):
        _prep(model, name="induction", seq_len=999)

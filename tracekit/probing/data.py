"""Probing datasets: :class:`ProbeDataset`, file loading, the built-in countries set.

Files (``.jsonl``, ``.json`` records, ``.csv``, ``.tsv``) are read as **text**: no value is guessed
to be missing. pandas' default reader turns ``NA`` (the continent code for North America), ``N/A``,
``None``, ``null``, ``nan`` ... into NaN, which silently merges classes; here only a really empty
cell (or a JSON ``null`` / missing key) is missing, and an empty cell in a column the probe needs
(text, label, group, template) is an error naming the row. The same table written as CSV, TSV and
JSONL loads identically.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Optional, Sequence, cast

import numpy as np
import pandas as pd

from ..dataset.read import read_records
from ..errors import ProbingError

__all__ = ["ProbeDataset", "load_probe_dataset", "probe_dataset_from_frame", "read_table", "load_countries", "country_dataset",
           "COUNTRY_TEMPLATES"]

#: The built-in templates for :func:`country_dataset`. ``{country}`` is the country as written in
#: running text ("the Netherlands"); the subject is never the prompt's last token, so the embedding
#: layer at the last token sees only the template (the lexical-shortcut control should be at chance).
COUNTRY_TEMPLATES: tuple[str, ...] = (
    "In terms of geography, {country} is located in",
    "The capital city of {country} is",
    "Most people in {country} speak",
    "Last summer I flew to {country}. The continent I visited was",
    "Q: On which continent is {country}? A:",
    "The national football team of {country} plays its home games in",
)


@dataclass
class ProbeDataset:
    """A labelled probing dataset: one row per prompt.

    Attributes:
        frame: DataFrame with columns ``text`` (the prompt), ``label`` (class name, or a float for
            regression), ``group`` (the entity the row comes from; splits never share one across
            train/test), ``template`` (template id, or None when there is none) and any extra
            attribute columns (e.g. ``country``, ``capital``).
        task: ``classification`` or ``regression``.
        name: a short description (for reports).

    Raises:
        ProbingError: a missing column, an unknown task, non-numeric regression labels.
    """

    frame: pd.DataFrame
    task: str = "classification"
    name: str = "dataset"

    def __post_init__(self):
        self.frame = self.frame.copy()
        for c in ("text", "label", "group"):
            if c not in self.frame.columns:
                raise ProbingError(f"ProbeDataset.frame needs a {c!r} column; has {list(self.frame.columns)}")
        if "template" not in self.frame.columns:
            self.frame["template"] = None
        self.frame = self.frame.reset_index(drop=True)
        if self.task not in ("classification", "regression"):
            raise ProbingError(f"task: must be 'classification' or 'regression', got {self.task!r}")
        if self.task == "classification":
            self.frame["label"] = self.frame["label"].astype(str)
        else:
            try:
                self.frame["label"] = self.frame["label"].astype(float)
            except (TypeError, ValueError) as e:
                raise ProbingError(f"task: regression needs numeric labels ({e}); use task: classification") from e
        self.frame["group"] = self.frame["group"].astype(str)

    def __len__(self) -> int:
        return len(self.frame)

    @property
    def texts(self) -> list[str]:
        return self.frame["text"].tolist()

    @property
    def classes(self) -> list[str]:
        """Sorted class names (classification); empty for regression."""
        return sorted(self.frame["label"].unique().tolist()) if self.task == "classification" else []

    @property
    def has_templates(self) -> bool:
        return bool(self.frame["template"].notna().any())

    def y(self) -> np.ndarray:
        """Labels as class indices into :attr:`classes` (int64), or floats for regression."""
        if self.task == "regression":
            return self.frame["label"].to_numpy(float)
        idx = {c: i for i, c in enumerate(self.classes)}
        return cast(pd.Series, self.frame["label"]).map(idx).to_numpy(np.int64)

    def drop_small_classes(self, min_groups: int = 2) -> "ProbeDataset":
        """Keep only classes with at least ``min_groups`` distinct groups (classification)."""
        if self.task != "classification":
            return self
        n = cast(pd.Series, self.frame.groupby("label")["group"].nunique())  # groups per class
        keep = n.loc[n >= min_groups].index
        labels = cast(pd.Series, self.frame["label"])
        return ProbeDataset(self.frame.loc[labels.isin(keep)].copy(), self.task, self.name)


def _cell(v: Any) -> Optional[str]:
    """A JSON value as the text a CSV cell would hold (None = missing)."""
    if v is None:
        return None
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float) and v.is_integer() and abs(v) < 2 ** 53:
        return repr(v)  # 1.0 stays "1.0", as written
    if isinstance(v, (dict, list)):
        return json.dumps(v, ensure_ascii=False)
    return str(v)


def read_table(path: str | Path) -> tuple[pd.DataFrame, int]:
    """Read a data file (:func:`tracekit.dataset.read_records`: ``.jsonl`` / ``.json`` / ``.csv`` /
    ``.tsv`` / ``.parquet`` / a saved ``datasets`` folder) as text cells.

    Returns:
        ``(frame, first_line)``: every cell a ``str``, or None where the cell is empty (CSV/TSV: an
        empty field; JSON/Parquet: ``null`` or a missing key); ``first_line`` is the file line of data
        row 0 (for error messages; 0 where lines mean nothing).

    Raises:
        ProbingError: no such file, an unknown file type, a line that is not JSON.
    """
    recs, first = read_records(path, "dataset.path", ProbingError)
    cols: list[str] = []
    for r in recs:
        cols += [k for k in r if k not in cols]
    frame = pd.DataFrame([{c: _cell(r.get(c)) for c in cols} for r in recs], columns=cols, dtype=object)
    return frame, first or 1  # JSON/Parquet rows are numbered from line 1, as before


def load_probe_dataset(path: str | Path, text: str = "text", label: str = "label", group: Optional[str] = "group",
                       template: Optional[str] = None, task: str = "classification") -> ProbeDataset:
    """Load a probing dataset from a ``.jsonl`` / ``.json`` (records) / ``.csv`` / ``.tsv`` file.

    Cells are read as text (:func:`read_table`): ``NA``, ``N/A`` or ``None`` are labels like any
    other, never missing values.

    Args:
        path: the file.
        text: the column holding the prompt.
        label: the column holding the label.
        group: the column holding the entity; ``None`` makes every row its own group (only
            sensible when rows are truly independent).
        template: the column holding the template id (optional).
        task: ``classification`` | ``regression``.

    Returns:
        A :class:`ProbeDataset` (other columns are kept as attributes).

    Raises:
        ProbingError: no such file, unknown file type, a named column is missing (the message lists
            the file's columns and the field to set, e.g. ``dataset.label``), or an empty cell in a
            named column (the message names the row and its file line).
    """
    df, first_line = read_table(path)
    return probe_dataset_from_frame(df, text, label, group, template, task, Path(path).name, first_line)


def probe_dataset_from_frame(df: pd.DataFrame, text: str = "text", label: str = "label",
                             group: Optional[str] = "group", template: Optional[str] = None,
                             task: str = "classification", name: str = "dataset", first_line: int = 0
                             ) -> ProbeDataset:
    """A :class:`ProbeDataset` from a table of rows (a read file, or the shared dataset rows'
    :meth:`tracekit.dataset.PreparedDataset.frame`); the columns named by ``text``, ``label``,
    ``group``, ``template`` must exist and have no empty cell.

    Raises:
        ProbingError: a named column is missing (the message lists the columns and the field to set)
            or has an empty cell (naming the row, and its file line when ``first_line`` is given).
    """
    cols = list(df.columns)
    for fld, col in (("text", text), ("label", label), ("group", group), ("template", template)):
        if col is not None and col not in df.columns:
            raise ProbingError(f"dataset.{fld}: unknown {fld} column {col!r} in {name}; its columns are {cols}. "
                               f"Set dataset.{fld} to one of them.")
        if col is not None:
            empty = np.flatnonzero(df[col].isna().to_numpy())
            if len(empty):
                i = int(empty[0])
                at = f"line {i + first_line} of {name}" if first_line else name
                raise ProbingError(f"dataset.{fld}: row {i} ({at}) has an empty "
                                   f"{col!r} cell ({len(empty)} empty in all); every row needs a {fld}. "
                                   "Fill it in or remove the row.")
    if len(df) == 0:
        raise ProbingError(f"dataset.path: {name} has no rows")
    out = df.copy()
    out["text"] = df[text].astype(str)
    out["label"] = df[label]
    out["group"] = df[group].astype(str) if group is not None else [f"row{i}" for i in range(len(df))]
    out["template"] = df[template].astype(str) if template is not None else None
    return ProbeDataset(out, task=task, name=name)


def load_countries() -> pd.DataFrame:
    """The built-in country table (``tracekit/data/countries.csv``), read as text.

    Columns: ``country`` (short name), ``phrase`` (as written in running text, e.g. "the
    Netherlands"), ``continent`` (Africa, Asia, Europe, North America, Oceania, South America;
    Central America and the Caribbean count as North America), ``capital`` (the seat of government),
    ``language`` (the principal official language; one language where several are official).
    50 countries: 10 Europe, 10 Asia, 10 Africa, 8 South America, 7 North America, 5 Oceania.
    """
    with resources.files("tracekit").joinpath("data/countries.csv").open("r", encoding="utf-8") as f:
        return pd.read_csv(f, dtype=str, keep_default_na=False, na_values=[])


_PLACEHOLDER = re.compile(r"\{(\w+)\}")


def country_dataset(target: str = "continent", templates: Optional[Sequence[str]] = None) -> ProbeDataset:
    """The built-in countries x templates dataset.

    Each of the 50 countries is written into each template; ``group`` is the country and
    ``template`` the template index (``t0``, ``t1``, ...).

    Args:
        target: the label column: ``continent`` (default) or ``language``. (``capital`` is unique
            per country, so it cannot be probed with a country-held-out split.)
        templates: format strings with ``{country}`` (and optionally ``{capital}``/``{language}``/
            ``{continent}``, but never the target's own column); default :data:`COUNTRY_TEMPLATES`.

    Raises:
        ProbingError: unknown target, a template without ``{country}``, with an unknown placeholder,
            or one that writes the target itself into the prompt.
    """
    table = load_countries()
    if target not in ("continent", "language"):
        raise ProbingError(f"dataset.target: unknown target {target!r} for builtin 'countries'; "
                           "use continent or language")
    templates = list(templates) if templates else list(COUNTRY_TEMPLATES)
    known = {"country", "capital", "language", "continent"}
    for j, t in enumerate(templates):
        names = set(_PLACEHOLDER.findall(t))
        if "country" not in names:
            raise ProbingError(f"dataset.templates[{j}]: {t!r} has no {{country}} placeholder")
        if names - known:
            raise ProbingError(f"dataset.templates[{j}]: unknown placeholder(s) {sorted(names - known)}; "
                               f"use {sorted(known)}")
        if target in names:
            raise ProbingError(f"dataset.templates[{j}]: writes the probe target {{{target}}} into the prompt, "
                               "which makes the probe trivially lexical; remove it")
    rows = []
    for _, c in table.iterrows():
        for j, t in enumerate(templates):
            text = t.format(country=c["phrase"], capital=c["capital"], language=c["language"],
                            continent=c["continent"])
            if text[0].islower():  # "the Netherlands ..." at the start of a sentence
                text = text[0].upper() + text[1:]
            rows.append({"text": text, "label": c[target], "group": c["country"], "template": f"t{j}",
                         "country": c["country"], "phrase": c["phrase"], "continent": c["continent"],
                         "capital": c["capital"], "language": c["language"]})
    return ProbeDataset(pd.DataFrame(rows), "classification", f"countries/{target}")

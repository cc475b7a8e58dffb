"""Reading dataset records from files: JSONL, JSON, CSV, TSV, Parquet, a saved Hugging Face
``datasets`` folder.

Every reader returns plain records (``list[dict]``) and the file line of record 0, so errors can
name the row *and* its line. CSV/TSV cells are text (an empty cell is missing, never ``NA``-guessed:
``NA`` is North America's continent code); a CSV cell holding a JSON object or list (``{"IO": 2}``)
is decoded where a field needs one (:mod:`tracekit.dataset.rows`). JSON, Parquet and ``datasets``
values keep their types.
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any

from ..core.errors import DatasetError, TracekitError

__all__ = ["read_records", "FILE_TYPES"]

#: File types :func:`read_records` reads (a folder is read as a saved ``datasets`` dataset).
FILE_TYPES = (".jsonl", ".json", ".csv", ".tsv", ".parquet")


def read_records(path: str | Path, field: str = "dataset.path",
                 error: type[TracekitError] = DatasetError) -> tuple[list[dict[str, Any]], int]:
    """Records of a data file or a saved Hugging Face ``datasets`` folder.

    Args:
        path: a ``.jsonl`` / ``.json`` (a list of objects) / ``.csv`` / ``.tsv`` / ``.parquet`` file,
            or a folder written by ``datasets.Dataset.save_to_disk`` (or a ``DatasetDict`` with one
            split, or the ``train`` split).
        field: the config field quoted in errors.
        error: the error class raised (probing raises its own).

    Returns:
        ``(records, first_line)``: ``first_line`` is the file line of record 0 (1 for JSONL, 2 for
        CSV/TSV under their header; 0 where lines mean nothing).

    Raises:
        DatasetError: (or ``error``) no such file, an unknown type, a line that is not JSON, a CSV
            row with another number of fields than the header, a record that is not an object.
    """
    p = Path(path).expanduser()
    if p.is_dir():
        return _read_hf(p, field, error), 0
    if not p.is_file():
        raise error(f"{field}: no such file or folder {str(p)!r} (paths are relative to the working directory)")
    suf = p.suffix.lower()
    if suf == ".parquet":
        import pandas as pd

        df = pd.read_parquet(p)
        df = df.astype(object).where(df.notna(), None)  # a missing cell is None, not NaN
        return [dict(r) for r in df.to_dict(orient="records")], 0
    text = p.read_text(encoding="utf-8-sig")
    if suf in (".csv", ".tsv"):
        rows = list(csv.reader(io.StringIO(text), delimiter="\t" if suf == ".tsv" else ","))
        if not rows:
            raise error(f"{field}: {p.name} is empty")
        header, body = rows[0], [r for r in rows[1:] if r]
        for i, r in enumerate(body):
            if len(r) != len(header):
                raise error(f"{field}: {p.name} data row {i} has {len(r)} fields, the header {len(header)}")
        return [{h: (v if v != "" else None) for h, v in zip(header, r)} for r in body], 2
    if suf == ".jsonl":
        recs = []
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                recs.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise error(f"{field}: {p.name} line {n} is not JSON ({e})") from None
        first = 1
    elif suf == ".json":
        try:
            recs = json.loads(text)
        except json.JSONDecodeError as e:
            raise error(f"{field}: {p.name} is not JSON ({e})") from None
        if not isinstance(recs, list):
            raise error(f"{field}: {p.name} must hold a list of records")
        first = 0
    else:
        raise error(f"{field}: unknown file type {suf!r}; use one of {', '.join(FILE_TYPES)} or a folder saved "
                    "by datasets.Dataset.save_to_disk")
    for r in recs:
        if not isinstance(r, dict):
            raise error(f"{field}: {p.name}: every record must be a JSON object, got {r!r}")
    return recs, first


def _read_hf(p: Path, field: str, error: type[TracekitError]) -> list[dict[str, Any]]:
    """Records of a folder saved by ``datasets`` (``save_to_disk``), read offline."""
    try:
        import datasets
    except ImportError as e:  # pragma: no cover - datasets is a dependency
        raise error(f"{field}: {p} is a folder; reading it needs the 'datasets' package") from e
    try:
        ds = datasets.load_from_disk(str(p))
    except (FileNotFoundError, ValueError) as e:
        raise error(f"{field}: {p} is a folder but not one saved by datasets' save_to_disk ({e}); give a "
                    f"file ({', '.join(FILE_TYPES)}) or such a folder") from None
    if isinstance(ds, datasets.DatasetDict):
        splits = list(ds.keys())
        if len(splits) != 1 and "train" not in splits:
            raise error(f"{field}: {p} holds the splits {splits}; save the one split to use")
        ds = ds["train" if "train" in splits else splits[0]]
    return [dict(r) for r in ds]  # type: ignore[arg-type]

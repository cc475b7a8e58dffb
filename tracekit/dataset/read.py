"""Reading dataset records from files: JSONL, JSON, CSV, TSV, Parquet, a saved Hugging Face
``datasets`` folder -- the one checked reader of every tabular input (dataset rows, probing
datasets, patching pairs files).

Every reader returns plain records (``list[dict]``) and the file line of record 0, so errors can
name the row *and* its line. CSV/TSV cells are text (an empty cell is missing, never ``NA``-guessed:
``NA`` is North America's continent code); a CSV cell holding a JSON object or list (``{"IO": 2}``)
is decoded where a field needs one (:mod:`tracekit.dataset.rows`). JSON, Parquet and ``datasets``
values keep their types.

What the reader refuses, each with an error naming the field, the file and the fix (never a
``UnicodeDecodeError`` / pyarrow / JSON traceback): a file that is not UTF-8, an empty file, a
damaged Parquet file or ``datasets`` folder, broken JSON, and a column (CSV/TSV header, Parquet
schema) or key (a JSON object) named twice -- a dict keeps only the last of them, silently.
"""

from __future__ import annotations

import csv
import io
import json
from collections import Counter
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
        field: the config field quoted in errors (``dataset.path``, ``pairs_file``, ...).
        error: the error class raised (probing and pairs files raise their own).

    Returns:
        ``(records, first_line)``: ``first_line`` is the file line of record 0 (1 for JSONL, 2 for
        CSV/TSV under their header; 0 where lines mean nothing).

    Raises:
        DatasetError: (or ``error``) no such file, an unknown type, an empty file, text that is not
            UTF-8, a damaged Parquet file or ``datasets`` folder, a line that is not JSON, a column or
            key named twice, a CSV row with another number of fields than the header, a record that
            is not an object. Each names ``field``, the file and the fix.
    """
    p = Path(path).expanduser()
    if p.is_dir():
        return _read_hf(p, field, error), 0
    if not p.is_file():
        raise error(f"{field}: no such file or folder {str(p)!r} (paths are relative to the working directory)")
    suf = p.suffix.lower()
    if suf not in FILE_TYPES:
        raise error(f"{field}: unknown file type {suf!r} ({p.name}); use one of {', '.join(FILE_TYPES)} or a folder "
                    "saved by datasets.Dataset.save_to_disk")
    if p.stat().st_size == 0:
        raise error(f"{field}: {p.name} is empty (0 bytes); give a file with rows")
    if suf == ".parquet":
        return _read_parquet(p, field, error), 0
    raw = p.read_bytes()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise error(f"{field}: {p.name} is not UTF-8 text (byte {raw[e.start]:#04x} at line {line}, offset "
                    f"{e.start}); save it as UTF-8 (a spreadsheet: 'CSV UTF-8'; a shell: iconv -f latin1 -t utf-8 "
                    f"{p.name} > utf8{suf})") from None
    if not text.strip():
        raise error(f"{field}: {p.name} is empty (only blank lines); give a file with rows")
    if suf in (".csv", ".tsv"):
        rows = list(csv.reader(io.StringIO(text), delimiter="\t" if suf == ".tsv" else ","))
        header, body = rows[0], [r for r in rows[1:] if r]
        _no_twice(header, f"{field}: {p.name} names the column", "; rename one (each column is one field)", error)
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
                recs.append(json.loads(line, object_pairs_hook=_pairs_hook))
            except json.JSONDecodeError as e:
                raise error(f"{field}: {p.name} line {n} is not valid JSON ({e}); each line must be one JSON "
                            "object") from None
            except _Twice as e:
                raise error(f"{field}: {p.name} line {n} names the key {e.key!r} twice; keep one (a record holds "
                            "each field once)") from None
        first = 1
    else:  # .json
        try:
            recs = json.loads(text, object_pairs_hook=_pairs_hook)
        except json.JSONDecodeError as e:
            raise error(f"{field}: {p.name} is not valid JSON ({e}); a .json file holds one list of objects "
                        "(or use .jsonl: one object per line)") from None
        except _Twice as e:
            raise error(f"{field}: {p.name} names the key {e.key!r} twice in one object; keep one (a record holds "
                        "each field once)") from None
        if not isinstance(recs, list):
            raise error(f"{field}: {p.name} must hold a list of records")
        first = 0
    for r in recs:
        if not isinstance(r, dict):
            raise error(f"{field}: {p.name}: every record must be a JSON object, got {r!r}")
    return recs, first


class _Twice(ValueError):
    """A JSON object naming one key twice (raised inside ``json.loads``)."""

    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


def _pairs_hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads``' object hook: a dict, refusing a key given twice (json keeps the last)."""
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise _Twice(k)
        out[k] = v
    return out


def _no_twice(names: list[str], what: str, fix: str, error: type[TracekitError]) -> None:
    """Refuse column names given more than once (a record would keep only the last column)."""
    count = Counter(names)
    twice = [n for n, c in count.items() if c > 1]
    if twice:
        where = "; ".join(f"{n!r} {'twice' if count[n] == 2 else f'{count[n]} times'} (columns "
                          f"{[i for i, m in enumerate(names) if m == n]})" for n in twice)
        raise error(f"{what} {where}{fix}")


def _read_parquet(p: Path, field: str, error: type[TracekitError]) -> list[dict[str, Any]]:
    """Records of a Parquet file (a missing cell is None, not NaN)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        with pq.ParquetFile(p) as f:
            _no_twice(list(f.schema_arrow.names), f"{field}: {p.name} names the column", "; rename one (each column "
                      "is one field)", error)
            table = f.read()
    except (pa.ArrowException, OSError, ValueError) as e:
        if isinstance(e, TracekitError):
            raise
        raise error(f"{field}: {p.name} is not a readable Parquet file ({type(e).__name__}: {e}); it is damaged or "
                    "not Parquet: write it again (pandas: df.to_parquet(path)) or give a .csv / .jsonl") from None
    df = table.to_pandas()
    df = df.astype(object).where(df.notna(), None)  # a missing cell is None, not NaN
    return [dict(r) for r in df.to_dict(orient="records")]


def _read_hf(p: Path, field: str, error: type[TracekitError]) -> list[dict[str, Any]]:
    """Records of a folder saved by ``datasets`` (``save_to_disk``), read offline."""
    try:
        import datasets
    except ImportError as e:  # pragma: no cover - datasets is a dependency
        raise error(f"{field}: {p} is a folder; reading it needs the 'datasets' package") from e
    import pyarrow as pa

    try:
        ds = datasets.load_from_disk(str(p))
    except (FileNotFoundError, ValueError) as e:
        raise error(f"{field}: {p} is a folder but not one saved by datasets' save_to_disk ({e}); give a "
                    f"file ({', '.join(FILE_TYPES)}) or such a folder") from None
    except (pa.ArrowException, OSError) as e:
        raise error(f"{field}: {p} is a damaged datasets folder ({type(e).__name__}: {e}); save it again with "
                    f"save_to_disk or give a file ({', '.join(FILE_TYPES)})") from None
    if isinstance(ds, datasets.DatasetDict):
        splits = list(ds.keys())
        if len(splits) != 1 and "train" not in splits:
            raise error(f"{field}: {p} holds the splits {splits}; save the one split to use")
        ds = ds["train" if "train" in splits else splits[0]]
    return [dict(r) for r in ds]  # type: ignore[arg-type]

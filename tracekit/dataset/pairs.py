"""Prompt pairs (activation patching, attribution patching, the circuit kinds): the clean/corrupted
pair config class and the pairs-file reader.

A pair is ``{clean, corrupted, target, foil}`` (:class:`PromptPair`), given inline in a config's
``pairs`` or in a ``pairs_file`` (JSONL, JSON, CSV/TSV or Parquet; :func:`load_pairs`).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from pydantic import ConfigDict, model_validator

from ..core.errors import ConfigError
from ..core.strict import StrictModel
from .read import FILE_TYPES, read_records

__all__ = ["PromptPair", "load_pairs", "RETIRED_PAIR_KEYS"]


#: Retired pair keys and their new names (docs/glossary.md).
RETIRED_PAIR_KEYS = {"answer": "target", "wrong": "foil", "incorrect": "foil"}


class PromptPair(StrictModel):
    """One clean/corrupted prompt pair.

    Fields:
        clean: the prompt with the answer (``"The capital of France is"``).
        corrupted: the same prompt with the key detail changed; must tokenize to the same length.
        target: the clean answer token (``" Paris"``), or a list of them (one per target/foil pair).
        foil: the contrasting token, usually the corrupted prompt's answer (``" Rome"``), or a list
            as long as ``target``; needed by the ``logit_diff`` metric.

    ``answer``/``wrong`` are retired names: they fail with an error naming ``target``/``foil``.
    """

    model_config = ConfigDict(extra="forbid")

    clean: str
    corrupted: str
    target: str | list[str]
    foil: str | list[str] | None = None

    retired = {old: f"{new}; pairs are {{clean, corrupted, target, foil}}" for old, new in RETIRED_PAIR_KEYS.items()}

    @model_validator(mode="after")
    def _target_differs_from_foil(self) -> "PromptPair":
        same = [x for x, y in zip(self.targets, self.foils) if x == y]
        if same:
            raise ValueError(f"target and foil must differ (both {same[0]!r}): the logit difference "
                             "would be 0 for every run; set foil to the corrupted prompt's answer")
        return self

    @property
    def targets(self) -> list[str]:
        return [self.target] if isinstance(self.target, str) else list(self.target)

    @property
    def foils(self) -> list[str]:
        if self.foil is None:
            return []
        return [self.foil] if isinstance(self.foil, str) else list(self.foil)


def _maybe_list(v: object) -> object:
    if isinstance(v, str) and v.strip().startswith("["):
        try:
            return json.loads(v)
        except json.JSONDecodeError:
            return v
    if isinstance(v, float) and np.isnan(v):
        return None
    return v


def load_pairs(path: str | Path, field: str = "pairs_file") -> list[PromptPair]:
    """Read prompt pairs from JSONL (one object per line), JSON (a list), CSV/TSV (header row) or
    Parquet, through the checked reader :func:`tracekit.dataset.read_records` (UTF-8 text, no column
    named twice, damaged files refused naming the file and the fix).

    Keys/columns: ``clean``, ``corrupted``, ``target``, ``foil`` (a JSON list string such as
    ``["' Paris'"]`` for several targets in CSV). The retired keys ``answer``/``wrong`` are refused
    with an error naming the new key.

    Raises:
        ConfigError: missing, empty, damaged or non-UTF-8 file, unknown extension, a column named
            twice, or a record without the needed keys; the message names ``field``, the file and
            the record.
    """
    p = Path(path).expanduser()
    if not p.is_file():
        raise ConfigError(f"{field}: no such file {str(path)!r} (paths are relative to the working directory)")
    if p.suffix.lower() not in FILE_TYPES:
        raise ConfigError(f"{field}: {p} must end in {', '.join(FILE_TYPES)}")
    raw, _ = read_records(p, field, ConfigError)
    text_cells = p.suffix.lower() in (".csv", ".tsv")  # a list of targets is written as a JSON list string
    recs = [{k: (_maybe_list(v) if text_cells else v) for k, v in r.items() if v is not None} for r in raw]
    out: list[PromptPair] = []
    for i, r in enumerate(recs):
        try:
            out.append(PromptPair.model_validate(r))
        except Exception as e:  # reported with the record
            raise ConfigError(f"{field}: record {i} of {p} is not a pair with keys clean, corrupted, target, "
                             f"foil: {e}") from e
    if not out:
        raise ConfigError(f"{field}: {p} holds no pairs")
    return out

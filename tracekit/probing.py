"""Linear probing across layers, with its controls built in.

A linear probe asks "is property X linearly decodable from layer L's activations?" (Alain &
Bengio 2016, "Understanding intermediate layers using linear classifier probes"). It is easy to
fool oneself with, so every function here is written around the controls that make a probe
result mean something (Hewitt & Liang 2019, "Designing and interpreting probes with control
tasks"; Belinkov 2022, "Probing classifiers: promises, shortcomings, and advances"):

* **group splits** -- a row's *group* is the entity (or template) it was generated from; train and
  test never share one (:func:`group_split`, :func:`group_kfold`, checked by
  :func:`check_no_overlap`, not assumed);
* **a control task** -- the same probe, same hyper-parameter search, fitted to shuffled labels
  (:func:`control_labels`); *selectivity* = accuracy - control accuracy;
* **a majority-class baseline** and **the embedding layer** (``blocks.0.hook_resid_pre`` at the same
  position) as baselines: a layer only "decodes X" when it beats all three;
* **bootstrap confidence intervals** over test groups (rows of one entity are not independent).

This module holds the notebook-usable pieces; :mod:`tracekit.experiments.probing` (``kind:
linear_probe``) chains them into one run.

Stages:

1. data -- :class:`ProbeDataset` (text, label, group, template) from a JSONL/CSV file
   (:func:`load_probe_dataset`) or the built-in countries set (:func:`country_dataset`);
2. activations -- :func:`extract_activations`: chosen hooks at chosen positions, one batched
   forward pass per batch of prompts, caching only those hooks; large extractions are written to
   disk in safetensors chunks and streamed back one hook at a time (:class:`Activations`);
3. fitting -- :func:`fit_probe`: scikit-learn logistic regression (binary / multinomial) or ridge
   regression on standardised features, the regularisation strength chosen by group k-fold
   cross-validation *inside the training split*;
4. metrics -- :func:`probe_metrics` / :func:`bootstrap_metrics` (accuracy, balanced accuracy, macro
   F1, AUROC; R^2, Pearson r, MSE for regression), vectorised over bootstrap resamples.

Layer numbering (``hidden_states``, as in the logit lens): layer 0 is the embedding output
(``blocks.0.hook_resid_pre``), layer ``L >= 1`` is the residual stream after block ``L-1``
(``blocks.{L-1}.hook_resid_post``). Attention / MLP outputs use the number of the hidden state
they are written into: ``attn_out`` / ``mlp_out`` layer ``L`` is ``blocks.{L-1}.hook_attn_out`` /
``blocks.{L-1}.hook_mlp_out`` (``L = 1..n_layers``).

Generic helpers that arguably belong in :mod:`tracekit.tokens` live here for now:
:func:`token_index_of_substring` (character span -> token index via the fast tokenizer's offsets).
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
import warnings
from contextlib import nullcontext
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

import numpy as np
import pandas as pd
import torch
from jaxtyping import Float

from .errors import ProbingError
from .tokens import TokenizationError, chunks, encode, run_with_cache, tokenize

__all__ = [
    "ProbeDataset", "load_probe_dataset", "country_dataset", "load_countries", "COUNTRY_TEMPLATES",
    "parse_position", "probe_hooks", "check_hooks", "token_index_of_substring",
    "Activations", "extract_activations",
    "Split", "SplitLeakError", "group_split", "group_kfold", "check_no_overlap", "control_labels",
    "FittedProbe", "fit_probe", "probe_metrics", "bootstrap_weights", "bootstrap_metrics",
    "percentile_ci", "load_probe_directions", "SITES",
]

SITES = ("resid", "attn_out", "mlp_out")
EMBEDDING_HOOK = "blocks.0.hook_resid_pre"

# --------------------------------------------------------------------------------------------
# 1. data
# --------------------------------------------------------------------------------------------

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
    """

    frame: pd.DataFrame
    task: str = "classification"
    name: str = "dataset"

    def __post_init__(self):
        self.frame = self.frame.copy()
        for c in ("text", "label", "group"):
            if c not in self.frame.columns:
                raise ValueError(f"ProbeDataset.frame needs a {c!r} column; has {list(self.frame.columns)}")
        if "template" not in self.frame.columns:
            self.frame["template"] = None
        self.frame = self.frame.reset_index(drop=True)
        if self.task not in ("classification", "regression"):
            raise ValueError(f"task: must be 'classification' or 'regression', got {self.task!r}")
        if self.task == "classification":
            self.frame["label"] = self.frame["label"].astype(str)
        else:
            try:
                self.frame["label"] = self.frame["label"].astype(float)
            except (TypeError, ValueError) as e:
                raise ValueError(f"task: regression needs numeric labels ({e}); use task: classification") from e
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
        return self.frame["label"].map(idx).to_numpy(np.int64)

    def drop_small_classes(self, min_groups: int = 2) -> "ProbeDataset":
        """Keep only classes with at least ``min_groups`` distinct groups (classification)."""
        if self.task != "classification":
            return self
        n = self.frame.groupby("label")["group"].nunique()
        keep = n[n >= min_groups].index
        return ProbeDataset(self.frame[self.frame["label"].isin(keep)].copy(), self.task, self.name)


def load_probe_dataset(path: str | Path, text: str = "text", label: str = "label", group: Optional[str] = "group",
                       template: Optional[str] = None, task: str = "classification") -> ProbeDataset:
    """Load a probing dataset from a ``.jsonl`` / ``.json`` (records) / ``.csv`` / ``.tsv`` file.

    Args:
        path: the file.
        text, label, group, template: column names to use (``template`` optional). ``group=None``
            makes every row its own group (only sensible when rows are truly independent).
        task: ``classification`` | ``regression``.

    Returns:
        A :class:`ProbeDataset` (other columns are kept as attributes).

    Raises:
        FileNotFoundError: no such file.
        ValueError: unknown file type, or a named column is missing (the message lists the columns
            the file has, and the field to set, e.g. ``dataset.label``).
    """
    p = Path(path).expanduser()
    if not p.is_file():
        raise FileNotFoundError(f"dataset.path: no such file {str(p)!r}")
    suf = p.suffix.lower()
    if suf == ".jsonl":
        df = pd.read_json(p, lines=True)
    elif suf == ".json":
        df = pd.read_json(p)
    elif suf in (".csv", ".tsv"):
        df = pd.read_csv(p, sep="\t" if suf == ".tsv" else ",")
    else:
        raise ValueError(f"dataset.path: unknown file type {suf!r}; use .jsonl, .json, .csv or .tsv")
    cols = list(df.columns)
    for fld, col in (("text", text), ("label", label), ("group", group), ("template", template)):
        if col is not None and col not in df.columns:
            raise ValueError(f"dataset.{fld}: unknown {fld} column {col!r} in {p.name}; its columns are {cols}. "
                             f"Set dataset.{fld} to one of them.")
    out = df.copy()
    out["text"] = df[text].astype(str)
    out["label"] = df[label]
    out["group"] = df[group].astype(str) if group is not None else [f"row{i}" for i in range(len(df))]
    out["template"] = df[template].astype(str) if template is not None else None
    return ProbeDataset(out, task=task, name=p.name)


def load_countries() -> pd.DataFrame:
    """The built-in country table (``tracekit/data/countries.csv``).

    Columns: ``country`` (short name), ``phrase`` (as written in running text, e.g. "the
    Netherlands"), ``continent`` (Africa, Asia, Europe, North America, Oceania, South America;
    Central America and the Caribbean count as North America), ``capital`` (the seat of government),
    ``language`` (the principal official language; one language where several are official).
    50 countries: 10 Europe, 10 Asia, 10 Africa, 8 South America, 7 North America, 5 Oceania.
    """
    with resources.files("tracekit").joinpath("data/countries.csv").open("r", encoding="utf-8") as f:
        return pd.read_csv(f)


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
        ValueError: unknown target, a template without ``{country}``, with an unknown placeholder,
            or one that writes the target itself into the prompt.
    """
    table = load_countries()
    if target not in ("continent", "language"):
        raise ValueError(f"dataset.target: unknown target {target!r} for builtin 'countries'; use continent or language")
    templates = list(templates) if templates else list(COUNTRY_TEMPLATES)
    known = {"country", "capital", "language", "continent"}
    for j, t in enumerate(templates):
        names = set(_PLACEHOLDER.findall(t))
        if "country" not in names:
            raise ValueError(f"dataset.templates[{j}]: {t!r} has no {{country}} placeholder")
        if names - known:
            raise ValueError(f"dataset.templates[{j}]: unknown placeholder(s) {sorted(names - known)}; "
                             f"use {sorted(known)}")
        if target in names:
            raise ValueError(f"dataset.templates[{j}]: writes the probe target {{{target}}} into the prompt, "
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


# --------------------------------------------------------------------------------------------
# 2. activations
# --------------------------------------------------------------------------------------------

_POSITION_HELP = ("use 'last' (last real token), 'mean' (mean over real tokens, BOS excluded), 'all' "
                  "(every real token but BOS), 'token:<text>' (the last token of the last occurrence of "
                  "<text> in the prompt) or 'field:<column>' (the last token of that row's <column> value "
                  "in the prompt, e.g. field:country)")


def parse_position(spec: str) -> tuple[str, Optional[str]]:
    """Parse a position spec into ``(kind, argument)``.

    Forms: ``last``, ``mean``, ``all``, ``token:<text>``, ``field:<column>``.

    Raises:
        ValueError: any other spec (the message lists the valid forms).
    """
    if not isinstance(spec, str):
        raise ValueError(f"position: must be a string, got {spec!r}; {_POSITION_HELP}")
    s = spec.strip()
    if s in ("last", "mean", "all"):
        return s, None
    for kind in ("token", "field"):
        if s.startswith(kind + ":"):
            arg = spec.split(":", 1)[1]
            arg = arg if kind == "token" else arg.strip()
            if arg.strip() == "":
                raise ValueError(f"position: {spec!r} has an empty {kind}; {_POSITION_HELP}")
            return kind, arg
    raise ValueError(f"position: unknown position spec {spec!r}; {_POSITION_HELP}")


def probe_hooks(n_layers: int, sites: Sequence[str] = ("resid",), layers: Optional[Sequence[int]] = None,
                extra_hooks: Sequence[str] = ()) -> list[tuple[str, int, str]]:
    """``(site, layer, hook name)`` triples to probe, hidden-state numbering (module docstring).

    The embedding layer ``("resid", 0, "blocks.0.hook_resid_pre")`` is always included (it is the
    lexical baseline). Explicit ``extra_hooks`` get site ``hook`` and the layer of the hidden state
    their block writes into (``blocks.{B}.* -> B + 1``; ``-1`` when no block index).

    Raises:
        ValueError: unknown site or a layer out of range (the message gives the valid range).
    """
    out: list[tuple[str, int, str]] = [("resid", 0, EMBEDDING_HOOK)]
    for s in sites:
        if s not in SITES:
            raise ValueError(f"sites: unknown site {s!r}; use {list(SITES)} (or list hook names under 'hooks')")
    for L in layers or []:
        if not 0 <= int(L) <= n_layers:
            raise ValueError(f"layers: layer {L} out of range; layers are 0..{n_layers} "
                             "(0 = embedding, L = output of block L-1)")
    want = sorted({int(L) for L in layers}) if layers is not None else list(range(n_layers + 1))
    for s in sites:
        for L in want:
            if s == "resid":
                if L > 0:
                    out.append(("resid", L, f"blocks.{L - 1}.hook_resid_post"))
            elif L > 0:
                out.append((s, L, f"blocks.{L - 1}.hook_{s}"))
    for h in extra_hooks:
        m = re.match(r"blocks\.(\d+)\.", h)
        out.append(("hook", int(m.group(1)) + 1 if m else -1, h))
    seen, uniq = set(), []
    for t in out:
        if (t[0], t[2]) not in seen:
            seen.add((t[0], t[2]))
            uniq.append(t)
    return uniq


def check_hooks(model, hooks: Sequence[str], field: str = "hooks") -> None:
    """Raise ValueError naming ``field`` for hook names the model does not have (with near matches)."""
    have = set(model.hook_dict.keys())
    for h in hooks:
        if h not in have:
            import difflib

            near = difflib.get_close_matches(h, sorted(have), n=3)
            raise ValueError(f"{field}: unknown hook {h!r} for this model ({model.cfg.n_layers} blocks); "
                             f"did you mean {near}? Hook names are TransformerLens', e.g. "
                             "'blocks.3.hook_resid_post', 'blocks.3.hook_mlp_out'.")


def token_index_of_substring(model, text: str, sub: str, prepend_bos: Optional[bool] = None) -> int:
    """Index (in ``tracekit.tokens.encode(model, text)``, BOS included) of the token holding the last
    character of the last occurrence of ``sub`` in ``text``.

    Uses the fast tokenizer's character offsets, and checks they describe the same tokens as
    :func:`tracekit.tokens.encode`.

    Raises:
        ValueError: ``sub`` does not occur in ``text``.
        TokenizationError: the tokenizer gives no offsets (not a "fast" tokenizer) or disagrees.
    """
    start = text.rfind(sub)
    if start < 0 or sub == "":
        raise ValueError(f"position: {sub!r} does not occur in the prompt {text!r}")
    end = start + len(sub)
    tok = model.tokenizer
    try:
        enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    except (NotImplementedError, TypeError) as e:
        raise TokenizationError("position token:/field: needs a fast tokenizer (character offsets)") from e
    ids = encode(model, text, prepend_bos)
    n_bos = len(ids) - len(enc["input_ids"])
    if n_bos not in (0, 1) or list(enc["input_ids"]) != ids[n_bos:]:
        raise TokenizationError(f"tokenizer offsets disagree with tracekit.tokens.encode for {text!r}")
    offs = enc["offset_mapping"]
    cands = [j for j, (a, b) in enumerate(offs) if a <= end - 1 < b]
    if not cands:
        cands = [j for j, (a, _) in enumerate(offs) if a < end]
    return n_bos + cands[-1]


def _row_positions(model, texts: Sequence[str], ids: Sequence[Sequence[int]], spec: str,
                   fields: Optional[Sequence[str]], prepend_bos: bool) -> list[list[int]]:
    """Per row, the unpadded token positions to read (a list; ``mean`` averages over them)."""
    kind, arg = parse_position(spec)
    out = []
    for i, (t, seq) in enumerate(zip(texts, ids)):
        n = len(seq)
        first = 1 if (prepend_bos and n > 1) else 0
        if kind == "last":
            out.append([n - 1])
        elif kind in ("mean", "all"):
            out.append(list(range(first, n)))
        else:
            sub = arg if kind == "token" else (fields[i] if fields is not None else None)
            if sub is None:
                raise ValueError(f"position: {spec!r} needs the rows' {arg!r} values (pass fields=...)")
            try:
                out.append([token_index_of_substring(model, t, str(sub), prepend_bos)])
            except ValueError as e:
                raise ValueError(f"position: {spec!r}: row {i}: {e}") from None
    return out


class Activations:
    """Extracted activations: per hook, a ``[n_examples, d]`` float32 matrix, in memory or on disk.

    On disk (``directory`` set) the matrices are split into safetensors chunk files
    (``chunk_00000.safetensors``, ...), each holding every hook for a run of examples; :meth:`get`
    reads one hook's slices chunk by chunk, so memory holds one hook at a time, never all layers.

    Attributes:
        hooks: hook names.
        rows: ``[n_examples]`` dataset row of each example.
        positions: ``[n_examples]`` token position read (BOS included in the count; ``-1`` = mean).
        directory: chunk directory, or None when in memory.
    """

    def __init__(self, hooks: list[str], rows: np.ndarray, positions: np.ndarray,
                 tensors: Optional[dict[str, torch.Tensor]] = None, directory: Optional[Path] = None,
                 files: Optional[list[str]] = None, temporary: bool = False):
        self.hooks = list(hooks)
        self.rows = np.asarray(rows, dtype=np.int64)
        self.positions = np.asarray(positions, dtype=np.int64)
        self._tensors = tensors
        self.directory = Path(directory) if directory is not None else None
        self.files = list(files or [])
        self._temporary = temporary

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def on_disk(self) -> bool:
        return self.directory is not None

    def iter_chunks(self, hook: str) -> Iterator[Float[torch.Tensor, "chunk d"]]:
        """Yield one hook's activations chunk by chunk (a single chunk when in memory)."""
        if hook not in self.hooks:
            raise KeyError(f"hook {hook!r} was not extracted; have {self.hooks}")
        if self._tensors is not None:
            yield self._tensors[hook]
            return
        from safetensors import safe_open

        for f in self.files:
            with safe_open(str(self.directory / f), framework="pt") as h:
                yield h.get_tensor(hook)

    def get(self, hook: str) -> Float[torch.Tensor, "n d"]:
        """One hook's ``[n_examples, d]`` matrix (float32, CPU)."""
        parts = list(self.iter_chunks(hook))
        return parts[0] if len(parts) == 1 else torch.cat(parts, 0)

    @classmethod
    def load(cls, directory: str | Path) -> "Activations":
        """Open a chunk directory written by :func:`extract_activations` (``cache_dir=``)."""
        d = Path(directory)
        meta = json.loads((d / "index.json").read_text())
        return cls(meta["hooks"], np.array(meta["rows"]), np.array(meta["positions"]), None, d, meta["files"])

    def cleanup(self) -> None:
        """Delete a temporary chunk directory (no-op otherwise)."""
        if self._temporary and self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)


class _ChunkWriter:
    def __init__(self, directory: Path, hooks: list[str], chunk_examples: int):
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self.hooks = hooks
        self.chunk_examples = max(1, chunk_examples)
        self.buf: dict[str, list[torch.Tensor]] = {h: [] for h in hooks}
        self.n_buf = 0
        self.files: list[str] = []

    def add(self, parts: dict[str, torch.Tensor]) -> None:
        for h in self.hooks:
            self.buf[h].append(parts[h])
        self.n_buf += int(next(iter(parts.values())).shape[0])
        if self.n_buf >= self.chunk_examples:
            self.flush()

    def flush(self) -> None:
        if self.n_buf == 0:
            return
        from safetensors.torch import save_file

        name = f"chunk_{len(self.files):05d}.safetensors"
        save_file({h: torch.cat(v, 0).contiguous() for h, v in self.buf.items()}, str(self.dir / name))
        self.files.append(name)
        self.buf = {h: [] for h in self.hooks}
        self.n_buf = 0


@torch.no_grad()
def extract_activations(
    model,
    texts: Sequence[str],
    hooks: Sequence[str],
    position: str = "last",
    batch_size: int = 16,
    fields: Optional[Sequence[str]] = None,
    fwd_hooks: Optional[list[tuple[str, Callable]]] = None,
    cache_dir: Optional[str | Path] = None,
    max_memory_mb: float = 1024.0,
    chunk_mb: float = 256.0,
    progress: bool = False,
) -> Activations:
    """Activations of ``hooks`` at ``position`` for every text, one batched forward pass per batch.

    Each batch is tokenized and padded by :func:`tracekit.tokens.tokenize` (the model spec's BOS and
    padding side; the attention mask makes padded prompts equal one-by-one runs), and run once with
    only ``hooks`` cached (:func:`tracekit.tokens.run_with_cache`).

    Args:
        model: a hooked model (TransformerBridge).
        texts: the prompts, ``n_rows`` of them.
        hooks: hook names (e.g. from :func:`probe_hooks`).
        position: ``last`` | ``mean`` | ``all`` | ``token:<text>`` | ``field:<column>`` (see
            :func:`parse_position`). ``mean``/``all`` skip the BOS token.
        batch_size: prompts per forward pass.
        fields: per-row strings for ``field:<column>`` (the column's values).
        fwd_hooks: extra ``(hook name, fn)`` forward hooks active during extraction (interventions,
            planted signals in tests).
        cache_dir: write chunks here (and keep them); default: memory, or a temporary directory when
            the estimate exceeds ``max_memory_mb``.
        max_memory_mb: in-memory budget (MiB) for the whole extraction before spilling to disk.
        chunk_mb: target size (MiB) of one chunk file.

    Returns:
        :class:`Activations` with ``n_examples`` = ``n_rows`` (``all``: the number of read tokens).
        Values are float32 ``[n_examples, d]`` per hook.

    Raises:
        ValueError: bad position spec, a ``token:``/``field:`` string missing from a prompt, unknown hook.
    """
    from .models import model_spec_of

    hooks = list(dict.fromkeys(hooks))
    check_hooks(model, hooks)
    texts = list(texts)
    if not texts:
        raise ValueError("texts: need at least one prompt")
    spec = model_spec_of(model)
    ids_all = [encode(model, t) for t in texts]
    pos_all = _row_positions(model, texts, ids_all, position, fields, spec.prepend_bos)
    kind, _ = parse_position(position)
    n_examples = sum(len(p) for p in pos_all) if kind == "all" else len(texts)
    dims = _hook_dims(model, hooks)
    total_mb = n_examples * sum(dims.values()) * 4 / 2 ** 20
    temporary = False
    if cache_dir is None and total_mb > max_memory_mb:
        cache_dir = tempfile.mkdtemp(prefix="tracekit-acts-")
        temporary = True
    writer = None
    if cache_dir is not None:
        per_ex = max(1, sum(dims.values()) * 4)
        writer = _ChunkWriter(Path(cache_dir), hooks, int(chunk_mb * 2 ** 20 // per_ex))
    mem: dict[str, list[torch.Tensor]] = {h: [] for h in hooks}
    rows, positions = [], []
    ctx = model.hooks(fwd_hooks=fwd_hooks) if fwd_hooks else nullcontext()
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(texts), desc="activations", leave=False)
    with ctx:
        for sl in chunks(len(texts), batch_size):
            batch = tokenize(model, texts[sl])
            _, cache = run_with_cache(model, batch, hooks)
            offs = batch.offsets
            b_idx, p_idx, seg = [], [], []  # gather indices; seg groups tokens for 'mean'
            for b in range(batch.size):
                r = sl.start + b
                ps = pos_all[r]
                for p in ps:
                    b_idx.append(b)
                    p_idx.append(offs[b] + p)
                if kind == "all":
                    rows += [r] * len(ps)
                    positions += ps
                    seg += list(range(len(seg), len(seg) + len(ps)))
                else:
                    rows.append(r)
                    positions.append(-1 if kind == "mean" else ps[0])
                    seg += [b] * len(ps)
            bi = torch.tensor(b_idx, device=batch.tokens.device)
            pi = torch.tensor(p_idx, device=batch.tokens.device)
            parts = {}
            for h in hooks:
                a = cache[h][bi, pi].float()
                if kind == "mean":
                    sg = torch.tensor(seg, device=a.device)
                    s = torch.zeros(batch.size, a.shape[-1], device=a.device).index_add_(0, sg, a)
                    a = s / torch.bincount(sg, minlength=batch.size).clamp(min=1).unsqueeze(-1).float()
                parts[h] = a.reshape(a.shape[0], -1).cpu()
            del cache
            if writer is not None:
                writer.add(parts)
            else:
                for h in hooks:
                    mem[h].append(parts[h])
            if bar is not None:
                bar.update(batch.size)
    if bar is not None:
        bar.close()
    if writer is not None:
        writer.flush()
        (Path(cache_dir) / "index.json").write_text(json.dumps(
            {"hooks": hooks, "rows": rows, "positions": positions, "files": writer.files, "position": position}))
        return Activations(hooks, np.array(rows), np.array(positions), None, Path(cache_dir), writer.files,
                           temporary=temporary)
    return Activations(hooks, np.array(rows), np.array(positions), {h: torch.cat(v, 0) for h, v in mem.items()})


def _hook_dims(model, hooks: Sequence[str]) -> dict[str, int]:
    """Width of each hook's activation (per position), for memory estimates; d_model by default."""
    cfg = model.cfg
    out = {}
    for h in hooks:
        if h.endswith(("hook_z", "hook_q", "hook_k", "hook_v", "hook_result")):
            out[h] = cfg.n_heads * cfg.d_head
        elif ".mlp.hook_" in h:
            out[h] = getattr(cfg, "d_mlp", None) or 4 * cfg.d_model
        else:
            out[h] = cfg.d_model
    return out


# --------------------------------------------------------------------------------------------
# 3. splits and controls
# --------------------------------------------------------------------------------------------

class SplitLeakError(ProbingError):
    """A train/test split shares a group (entity or template) across its sides."""


@dataclass
class Split:
    """Row indices of one train/test split.

    Attributes:
        train, test: row indices (into the dataset's frame).
        dropped: rows in neither side (``group_by: both`` drops rows whose entity is held out but
            template is not, or vice versa).
        group_by: ``entity`` | ``template`` | ``both``.
        fold: fold number (0 for a single split).
    """

    train: np.ndarray
    test: np.ndarray
    dropped: np.ndarray
    group_by: str
    fold: int = 0


def _keys(frame: pd.DataFrame, group_by: str) -> np.ndarray:
    if group_by == "entity":
        return frame["group"].astype(str).to_numpy()
    if group_by == "template":
        if frame["template"].isna().all():
            raise ValueError("group_by: 'template' needs a template column; set dataset.template "
                             "(or use group_by: entity)")
        return frame["template"].astype(str).to_numpy()
    raise ValueError(f"group_by: unknown value {group_by!r}; use entity, template or both")


def _group_labels(keys: np.ndarray, labels: Optional[np.ndarray]) -> Optional[dict]:
    """key -> its single label, or None if labels vary within a key (or no labels)."""
    if labels is None:
        return None
    out: dict = {}
    for k, y in zip(keys, labels):
        if out.setdefault(k, y) != y:
            return None
    return out


def _assign_test_groups(keys: np.ndarray, labels: Optional[np.ndarray], test_size: float,
                        rng: np.random.Generator, what: str) -> set:
    uniq = sorted(set(keys.tolist()))
    gl = _group_labels(keys, labels)
    if gl is not None:
        test: set = set()
        by_class: dict = {}
        for g in uniq:
            by_class.setdefault(gl[g], []).append(g)
        for c in sorted(by_class, key=str):
            gs = by_class[c]
            if len(gs) < 2:
                raise ValueError(
                    f"class {c!r} has only {len(gs)} {what} group ({gs}); a {what}-held-out split needs at "
                    f"least 2 per class (one for train, one for test). Add rows for it, drop small classes "
                    f"(dataset.drop_small_classes: true), or change group_by.")
            n_test = min(len(gs) - 1, max(1, int(round(test_size * len(gs)))))
            order = rng.permutation(len(gs))
            test |= {gs[i] for i in order[:n_test]}
        return test
    if len(uniq) < 2:
        raise ValueError(f"group_by: only {len(uniq)} distinct {what} group(s); a held-out split needs >= 2")
    n_test = min(len(uniq) - 1, max(1, int(round(test_size * len(uniq)))))
    order = rng.permutation(len(uniq))
    return {uniq[i] for i in order[:n_test]}


def group_split(ds: ProbeDataset, group_by: str = "entity", test_size: float = 0.3, seed: int = 0) -> Split:
    """One train/test split with no group on both sides (checked with :func:`check_no_overlap`).

    * ``entity``: hold out whole entities (``group``), stratified by class when each entity has one
      label (each class keeps >= 1 entity on each side);
    * ``template``: hold out whole templates;
    * ``both``: hold out entities *and* templates; train keeps rows whose entity and template are both
      unseen in test, test keeps rows whose entity and template are both held out; the cross rows are
      dropped (so the test set is about ``test_size**2`` of the rows).

    Args:
        ds: the dataset.
        group_by: ``entity`` | ``template`` | ``both``.
        test_size: fraction of groups held out (0 < test_size < 1).
        seed: RNG seed; the same seed gives the same split.

    Raises:
        ValueError: bad ``test_size``/``group_by``; a class with fewer than 2 groups; no templates for
            ``template``/``both``.
        SplitLeakError: the split shares a group (a bug; never expected).
    """
    if not 0 < test_size < 1:
        raise ValueError(f"test_size: must be in (0, 1), got {test_size}")
    rng = np.random.default_rng(seed)
    f = ds.frame
    labels = f["label"].astype(str).to_numpy() if ds.task == "classification" else None
    if group_by in ("entity", "template"):
        keys = _keys(f, group_by)
        test_g = _assign_test_groups(keys, labels, test_size, rng, group_by)
        is_test = np.isin(keys, list(test_g))
        split = Split(np.flatnonzero(~is_test), np.flatnonzero(is_test), np.array([], dtype=np.int64), group_by)
    elif group_by == "both":
        ek, tk = _keys(f, "entity"), _keys(f, "template")
        test_e = _assign_test_groups(ek, labels, test_size, rng, "entity")
        test_t = _assign_test_groups(tk, None, test_size, rng, "template")
        e_in, t_in = np.isin(ek, list(test_e)), np.isin(tk, list(test_t))
        tr, te = ~e_in & ~t_in, e_in & t_in
        split = Split(np.flatnonzero(tr), np.flatnonzero(te), np.flatnonzero(~(tr | te)), "both")
    else:
        _keys(f, group_by)
        raise AssertionError  # pragma: no cover
    check_no_overlap(ds, split)
    if len(split.train) == 0 or len(split.test) == 0:
        raise ValueError(f"group_by: {group_by}: the split left {len(split.train)} train / {len(split.test)} test rows; "
                         "lower test_size or use more groups")
    return split


def group_kfold(ds: ProbeDataset, k: int = 5, group_by: str = "entity", seed: int = 0) -> list[Split]:
    """``k`` folds over groups (stratified by class when each group has one label); every row is in
    exactly one test fold, and no fold shares a group across train/test (checked).

    Raises:
        ValueError: ``k < 2``, more folds than groups, ``group_by: both`` (single split only).
    """
    if group_by == "both":
        raise ValueError("cv_folds: k-fold is not supported with group_by: both (it drops cross rows); "
                         "use group_by: entity or template, or cv_folds: null")
    if k < 2:
        raise ValueError(f"cv_folds: need at least 2 folds, got {k}")
    keys = _keys(ds.frame, group_by)
    labels = ds.frame["label"].astype(str).to_numpy() if ds.task == "classification" else None
    return [_check(ds, s) for s in _kfold_keys(keys, labels, k, seed, group_by)]


def _check(ds, s):
    check_no_overlap(ds, s)
    return s


def _kfold_keys(keys: np.ndarray, labels: Optional[np.ndarray], k: int, seed: int, group_by: str) -> list[Split]:
    rng = np.random.default_rng(seed)
    uniq = sorted(set(keys.tolist()))
    if k > len(uniq):
        raise ValueError(f"cv_folds: {k} folds but only {len(uniq)} {group_by} groups; lower cv_folds")
    gl = _group_labels(keys, labels)
    buckets: dict = {}
    for g in uniq:
        buckets.setdefault(gl[g] if gl is not None else 0, []).append(g)
    fold_of: dict = {}
    start = 0
    for c in sorted(buckets, key=str):
        gs = [buckets[c][i] for i in rng.permutation(len(buckets[c]))]
        for i, g in enumerate(gs):
            fold_of[g] = (start + i) % k
        start = (start + len(gs)) % k
    folds = np.array([fold_of[g] for g in keys])
    empty = np.array([], dtype=np.int64)
    return [Split(np.flatnonzero(folds != j), np.flatnonzero(folds == j), empty, group_by, j) for j in range(k)]


def check_no_overlap(ds: ProbeDataset, split: Split) -> None:
    """Assert that train and test share no row, no entity (``entity``/``both``) and no template
    (``template``/``both``).

    Raises:
        SplitLeakError: naming the shared groups.
    """
    f = ds.frame
    both = set(split.train.tolist()) & set(split.test.tolist())
    if both:
        raise SplitLeakError(f"rows on both sides of the split: {sorted(both)[:10]}")
    checks = {"entity": ["group"], "template": ["template"], "both": ["group", "template"]}[split.group_by]
    for col in checks:
        a = set(f[col].iloc[split.train].astype(str))
        b = set(f[col].iloc[split.test].astype(str))
        shared = a & b
        if shared:
            raise SplitLeakError(f"split by {split.group_by}: {col} values on both sides: {sorted(shared)[:10]}")


def control_labels(ds: ProbeDataset, mode: str = "auto", seed: int = 0,
                   parts: Optional[Sequence[np.ndarray]] = None) -> tuple[np.ndarray, str]:
    """Shuffled labels for the control task (Hewitt & Liang 2019).

    * ``shuffle_groups``: permute the labels *of the groups* (each entity keeps one consistent, random
      label across its templates) -- the analogue of Hewitt & Liang's per-word-type control task;
      needs each group to have one label;
    * ``shuffle_rows``: permute labels across rows;
    * ``auto``: ``shuffle_groups`` when possible, else ``shuffle_rows``.

    ``parts`` (row-index arrays, e.g. the train and test rows of a split, or each fold's test rows):
    labels are permuted *within* each part, so every part keeps exactly its real class counts. Then
    the control differs from the real task only in which input carries which label; without it, a
    random excess of one control class in the test side is a deficit in the training side, and a
    signal-free probe that leans to the training majority scores systematically *below* chance.
    Rows in no part keep a permutation over the rest. Class proportions are always preserved.

    Returns ``(labels, mode used)``, labels in the same encoding as ``ds.y()``.

    Raises:
        ValueError: unknown mode, or ``shuffle_groups`` with labels that vary within a group.
    """
    rng = np.random.default_rng(seed + 7919)
    y = ds.y()
    keys = ds.frame["group"].astype(str).to_numpy()
    if mode not in ("auto", "shuffle_groups", "shuffle_rows"):
        raise ValueError(f"control: unknown mode {mode!r}; use auto, shuffle_groups or shuffle_rows")
    gl = _group_labels(keys, y)
    if mode == "shuffle_groups" and gl is None:
        raise ValueError("control: shuffle_groups needs one label per group; use control: shuffle_rows")
    used = "shuffle_rows" if (mode == "shuffle_rows" or gl is None) else "shuffle_groups"
    parts = [np.asarray(p, dtype=np.int64) for p in (parts or []) if len(p)]
    covered = np.zeros(len(y), bool)
    for p in parts:
        covered[p] = True
    rest = np.flatnonzero(~covered)
    out = y.copy()
    for p in parts + ([rest] if len(rest) else []):
        if used == "shuffle_rows":
            out[p] = y[p][rng.permutation(len(p))]
        else:
            gs = sorted(set(keys[p].tolist()))
            vals = np.array([gl[g] for g in gs])
            new = dict(zip(gs, vals[rng.permutation(len(gs))]))
            out[p] = np.array([new[k] for k in keys[p]], dtype=y.dtype)
    return out, used


# --------------------------------------------------------------------------------------------
# 4. fitting
# --------------------------------------------------------------------------------------------

@dataclass
class FittedProbe:
    """A fitted probe, its test predictions, and its weights in the activation basis.

    Attributes:
        weight: ``[n_out, d]`` in the *original* activation basis (standardisation undone), so that
            ``x @ weight.T + bias`` equals the probe's decision function on a raw activation ``x``.
            ``n_out`` is the number of classes for multiclass, 1 for binary (the positive class,
            ``classes[1]``) and for regression.
        bias: ``[n_out]``.
        classes: class indices the probe was trained on (classification), else empty.
        reg: the chosen regularisation (``C`` for logistic regression, ``alpha`` for ridge).
        pred: test predictions (class index or value), ``[n_test]``.
        proba: ``[n_test, n_classes_total]`` class probabilities (classification) or None.
        train_score: accuracy (or R^2) on the training rows.
    """

    weight: np.ndarray
    bias: np.ndarray
    classes: np.ndarray
    reg: float
    pred: np.ndarray
    proba: Optional[np.ndarray]
    train_score: float
    extra: dict = field(default_factory=dict)


def _inner_splits(groups: np.ndarray, y: Optional[np.ndarray], k: int, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    k = max(2, min(k, len(set(groups.tolist()))))
    if len(set(groups.tolist())) < 2:
        raise ValueError("inner_folds: the training split has a single group; cannot cross-validate")
    folds = _kfold_keys(np.asarray(groups).astype(str), y, k, seed, "inner")
    return [(s.train, s.test) for s in folds if len(s.test) and len(s.train)]


def fit_probe(
    X_train: Float[np.ndarray, "n_train d"],
    y_train: np.ndarray,
    X_test: Float[np.ndarray, "n_test d"],
    groups_train: np.ndarray,
    task: str = "classification",
    n_classes: Optional[int] = None,
    Cs: Sequence[float] = (0.001, 0.01, 0.1, 1.0),
    alphas: Sequence[float] = (0.1, 1.0, 10.0, 100.0, 1000.0),
    inner_folds: int = 3,
    seed: int = 0,
    max_iter: int = 1000,
) -> FittedProbe:
    """Fit one linear probe with its regularisation chosen by group cross-validation in the training set.

    Features are standardised with the training rows' mean and standard deviation; when ``d`` exceeds
    the number of training rows, the fit runs in the span of the training rows (exact for
    L2-penalised models: the optimum lies in that span -- the representer theorem), which is much
    faster. BLAS runs single-threaded during fitting (multi-threaded BLAS thrashes on small matrices).

    * classification: :class:`sklearn.linear_model.LogisticRegressionCV` (lbfgs, L2; multinomial for
      more than two classes), ``Cs`` searched by log loss over ``inner_folds`` group folds;
    * regression: :class:`sklearn.linear_model.RidgeCV` over ``alphas`` with the same group folds.

    Args:
        X_train: ``[n_train, d]`` activations; X_test: ``[n_test, d]``.
        y_train: class indices (int) or targets (float).
        groups_train: group of each training row (inner folds never share one).
        n_classes: total number of classes (probability columns); default ``max(y_train) + 1``.

    Returns:
        :class:`FittedProbe`.

    Raises:
        ValueError: fewer than two classes in the training rows, or a single training group.
    """
    from sklearn.linear_model import LogisticRegressionCV, RidgeCV
    from threadpoolctl import threadpool_limits

    X_train = np.asarray(X_train, dtype=np.float64)
    X_test = np.asarray(X_test, dtype=np.float64)
    limit = threadpool_limits(1)
    try:
        mu = X_train.mean(0)
        sd = X_train.std(0)
        sd = np.where(sd > 1e-8 * max(1.0, float(np.abs(mu).max(initial=0.0))), sd, 1.0)
        Xs = (X_train - mu) / sd
        Xt = (X_test - mu) / sd
        V = None
        if Xs.shape[1] > Xs.shape[0]:
            # Row space of the training matrix from its Gram matrix (n x n): Xs = U S V^T.
            evals, U = np.linalg.eigh(Xs @ Xs.T)
            keep = evals > max(float(evals.max(initial=0.0)), 1e-300) * 1e-9
            V = (Xs.T @ U[:, keep]) / np.sqrt(evals[keep])  # [d, r], orthonormal columns
            Zs, Zt = Xs @ V, Xt @ V
        else:
            Zs, Zt = Xs, Xt
    finally:
        limit.restore_original_limits()
    strat = y_train if task == "classification" else None
    splits = _inner_splits(np.asarray(groups_train), strat, inner_folds, seed)
    with threadpool_limits(1), warnings.catch_warnings():
        warnings.simplefilter("ignore", category=UserWarning)
        warnings.filterwarnings("ignore", message=".*(converge|iteration).*")
        if task == "classification":
            classes = np.unique(y_train)
            if len(classes) < 2:
                raise ValueError(f"the training split has {len(classes)} class; a probe needs >= 2")
            n_classes = n_classes or int(y_train.max()) + 1
            m = LogisticRegressionCV(Cs=list(Cs), cv=splits, max_iter=max_iter, tol=1e-4, scoring="neg_log_loss",
                                     l1_ratios=(0.0,), use_legacy_attributes=False, random_state=seed)
            m.fit(Zs, y_train)
            coef, b = m.coef_, m.intercept_
            p = m.predict_proba(Zt)
            proba = np.zeros((len(Zt), n_classes))
            proba[:, m.classes_] = p
            pred = m.classes_[np.argmax(p, 1)]
            reg = float(np.ravel(m.C_)[0])
            train_score = float((m.predict(Zs) == y_train).mean())
        else:
            classes = np.array([], dtype=np.int64)
            m = RidgeCV(alphas=list(alphas), cv=splits, scoring="neg_mean_squared_error").fit(Zs, y_train)
            coef, b = np.atleast_2d(m.coef_), np.atleast_1d(m.intercept_)
            pred = m.predict(Zt)
            proba = None
            reg = float(m.alpha_)
            ss = ((y_train - y_train.mean()) ** 2).sum()
            train_score = float(1 - ((m.predict(Zs) - y_train) ** 2).sum() / ss) if ss > 0 else float("nan")
    w_std = coef @ V.T if V is not None else coef  # [n_out, d] in the standardised basis
    weight = w_std / sd
    bias = b - weight @ mu
    return FittedProbe(weight, bias, classes, reg, pred, proba, train_score)


# --------------------------------------------------------------------------------------------
# 5. metrics and bootstrap
# --------------------------------------------------------------------------------------------

def bootstrap_weights(units: np.ndarray, n_boot: int = 1000, seed: int = 0) -> np.ndarray:
    """Resampling weights ``[n_boot, n]``: how often each example is drawn in each bootstrap resample.

    ``units`` names the resampling unit of each example: pass the example's group for a cluster
    bootstrap (whole groups drawn with replacement), or ``np.arange(n)`` for a row bootstrap.
    The same ``(units, n_boot, seed)`` give the same weights, so every layer is resampled identically
    (paired differences between layers and controls).
    """
    units = np.asarray(units)
    uniq, inv = np.unique(units.astype(str), return_inverse=True)
    rng = np.random.default_rng(seed)
    counts = rng.multinomial(len(uniq), np.full(len(uniq), 1.0 / len(uniq)), size=n_boot)  # [B, G]
    return counts[:, inv].astype(np.float64)


def _auroc_weighted(scores: np.ndarray, pos: np.ndarray, W: np.ndarray) -> np.ndarray:
    """Weighted Mann-Whitney AUROC for each weight row; NaN where a side has no weight."""
    sp, sn = scores[pos], scores[~pos]
    if len(sp) == 0 or len(sn) == 0:
        return np.full(W.shape[0], np.nan)
    M = (sp[:, None] > sn[None, :]).astype(np.float64) + 0.5 * (sp[:, None] == sn[None, :])
    Wp, Wn = W[:, pos], W[:, ~pos]
    num = ((Wp @ M) * Wn).sum(1)
    den = Wp.sum(1) * Wn.sum(1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, num / den, np.nan)


def bootstrap_metrics(y: np.ndarray, pred: np.ndarray, proba: Optional[np.ndarray], W: np.ndarray,
                      task: str = "classification", n_classes: Optional[int] = None) -> dict[str, np.ndarray]:
    """Metrics under each weight row of ``W`` (``[n_boot, n]``; a row of ones = the plain metric).

    Classification: ``accuracy``, ``balanced_accuracy`` (mean recall over classes present),
    ``macro_f1`` (over classes in truth or predictions, as scikit-learn), ``auroc`` (binary; one-vs-rest
    macro average for multiclass, over classes with both positives and negatives; needs ``proba``).
    Regression: ``r2``, ``pearson``, ``mse``. Each value is an array ``[n_boot]``; all are in [0, 1]
    except ``pearson`` ([-1, 1]), ``r2`` (<= 1) and ``mse`` (squared target units).
    """
    W = np.atleast_2d(np.asarray(W, dtype=np.float64))
    tot = W.sum(1)
    with np.errstate(invalid="ignore", divide="ignore"):
        if task == "regression":
            y = y.astype(np.float64)
            p = pred.astype(np.float64)
            my = (W @ y) / tot
            mp = (W @ p) / tot
            sse = W @ (y ** 2) - 2 * (W @ (y * p)) + W @ (p ** 2)
            sst = W @ (y ** 2) - tot * my ** 2
            cov = W @ (y * p) - tot * my * mp
            vp = W @ (p ** 2) - tot * mp ** 2
            return {"r2": 1 - sse / sst, "pearson": cov / np.sqrt(sst * vp), "mse": sse / tot}
        K = n_classes or int(max(y.max(), pred.max())) + 1
        out = {"accuracy": (W @ (y == pred).astype(np.float64)) / tot}
        rec, f1 = [], []
        for k in range(K):
            yk, pk = y == k, pred == k
            tp = W @ (yk & pk).astype(np.float64)
            fp = W @ (~yk & pk).astype(np.float64)
            fn = W @ (yk & ~pk).astype(np.float64)
            sup = W @ yk.astype(np.float64)
            rec.append(np.where(sup > 0, tp / sup, np.nan))
            den = 2 * tp + fp + fn
            f1.append(np.where(den > 0, 2 * tp / den, np.nan))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            out["balanced_accuracy"] = np.nanmean(np.stack(rec), 0)
            out["macro_f1"] = np.nanmean(np.stack(f1), 0)
            if proba is not None:
                if K == 2:
                    out["auroc"] = _auroc_weighted(proba[:, 1], y == 1, W)
                else:
                    aucs = np.stack([_auroc_weighted(proba[:, k], y == k, W) for k in range(K)])
                    out["auroc"] = np.nanmean(aucs, 0) if np.isfinite(aucs).any() else np.full(len(W), np.nan)
        return out


def probe_metrics(y: np.ndarray, pred: np.ndarray, proba: Optional[np.ndarray] = None,
                  task: str = "classification", n_classes: Optional[int] = None) -> dict[str, float]:
    """Point metrics on the test rows (see :func:`bootstrap_metrics` for definitions)."""
    m = bootstrap_metrics(y, pred, proba, np.ones((1, len(y))), task, n_classes)
    return {k: float(v[0]) for k, v in m.items()}


def percentile_ci(values: np.ndarray, level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap interval (NaN-aware); ``(nan, nan)`` when every value is NaN."""
    v = np.asarray(values, dtype=np.float64)
    v = v[np.isfinite(v)]
    if len(v) == 0:
        return float("nan"), float("nan")
    a = (1 - level) / 2
    return float(np.quantile(v, a)), float(np.quantile(v, 1 - a))


# --------------------------------------------------------------------------------------------
# 6. saved directions
# --------------------------------------------------------------------------------------------

def load_probe_directions(source: Any, site: str = "resid", bias: bool = False,
                          normalize: bool = False) -> dict[int, Any]:
    """Fitted probe directions of a ``linear_probe`` run, as tensors keyed by layer.

    Args:
        source: a :class:`~tracekit.experiments.probing.LinearProbeResult` or a saved step directory
            (``<run>/<step>/`` holding ``arrays.safetensors``).
        site: ``resid`` | ``attn_out`` | ``mlp_out`` | ``hook``.
        bias: also return the bias: values become ``(weight, bias)``.
        normalize: scale each row to unit L2 norm (for use as steering / ablation directions).

    Returns:
        ``{layer: Float[Tensor, "n_out d_model"]}`` in the model's own activation basis (the
        standardisation used for fitting is undone: ``act @ W.T + b`` is the probe's logit).
        ``n_out`` = number of classes (multiclass; row order = the result's ``meta["classes"]``),
        or 1 (binary: the direction of ``classes[1]``; regression).

    Raises:
        FileNotFoundError: the directory has no ``arrays.safetensors`` (run with save_directions: true).
        KeyError: no directions for that site.
    """
    if isinstance(source, (str, Path)):
        p = Path(source) / "arrays.safetensors"
        if not p.exists():
            raise FileNotFoundError(f"{p}: no saved probe directions (run with save_directions: true)")
        from safetensors.torch import load_file

        arrays = load_file(str(p))
    else:
        arrays = source.arrays
    out: dict[int, Any] = {}
    for k, v in arrays.items():
        m = re.fullmatch(r"probe\.(\w+)\.(-?\d+)\.weight", k)
        if m and m.group(1) == site:
            L = int(m.group(2))
            w = v.float()
            if normalize:
                w = w / w.norm(dim=-1, keepdim=True).clamp(min=1e-12)
            out[L] = (w, arrays[f"probe.{site}.{L}.bias"].float()) if bias else w
    if not out:
        sites = sorted({k.split(".")[1] for k in arrays if k.startswith("probe.")})
        raise KeyError(f"no probe directions for site {site!r}; saved sites: {sites}")
    return dict(sorted(out.items()))

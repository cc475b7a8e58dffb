"""Attention heads as experiment kinds.

* ``kind: attention_pattern`` (:class:`AttentionPattern`): over a dataset (or prompts), the
  attention *from one query position per row* (``query: END``, ``last``, an index or
  ``token:<text>``) to named key positions (``keys: [IO, S1, S2]``, or ``all``), at any set of
  layers and heads, in one batched forward pass per ``batch_size`` rows
  (:func:`tracekit.attention.query_attention`). Tables per row and per head (mean, spread), a
  label per (row, layer, head) (self / first / previous / spread / content), small multiples of
  the chosen heads' patterns and a layer x head heatmap per key.
* ``kind: head_scan`` (:class:`HeadScan`): every head of every layer: previous-token and induction
  scores on repeated random tokens (Olsson et al. 2022; TransformerLens' head-detector patterns)
  and, for given prompts, the head labels averaged over query positions.

The tables are built by the engine (:func:`tracekit.attention_tables.query_tables`); the result
classes, summaries and figures are in :mod:`tracekit.experiments.attention_tables`.

Units: ``score`` is the pre-softmax attention score (``q.k / sqrt(d_head)``, logits of the
softmax); ``weight`` is a probability (each query row sums to 1; future keys get 0).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional, Union

import pandas as pd
from pydantic import Field, field_validator, model_validator

from ..attention import check_layer, check_repeated_length, classify_heads, head_scores, query_attention, read_layers
from ..attention_tables import query_tables
from ..core.errors import AttentionError, DatasetError, TokenizationError
from ..core.sites import check_heads, check_layers, hook
from ..dataset import DatasetSpec, PreparedDataset
from ..model.info import HookedModel
from ..tokens import Position, PositionSpec, pad_ids, parse_position
from .attention_tables import AttentionPatternResult, HeadScanResult
from .base import (
    Experiment,
    Indices,
    OptionalPrompts,
    check_dataset_fields,
    encode_prompts,
    kind_dataset,
    register,
)

__all__ = ["AttentionPattern", "AttentionPatternInputs", "AttentionPatternResult", "HeadScan", "HeadScanInputs",
           "HeadScanResult", "QUERY_FORMS"]

#: The position forms ``query`` and each of ``keys`` accept.
QUERY_FORMS = ("int", "last", "token:<text>", "name")
#: Columns of the labels tables renamed so none shadows a DataFrame attribute (``df.first`` is a method).
LABEL_RENAMES = {"head": "head_idx", "self": "self_weight", "first": "first_weight", "previous": "previous_weight"}


@dataclass(frozen=True)
class AttentionPatternInputs:
    """What :meth:`AttentionPattern.prepare` builds once.

    Attributes:
        data: the prepared rows (ids, named positions, row fields).
        layers / heads: the layers and heads read (sorted, unique).
        query_pos: per row, the query's index into the row's ids (BOS counted).
        key_names: the key names (``None`` for ``keys: all``).
        key_pos: per row, each key's index into the row's ids (``()`` for ``keys: all``).
        plot_heads: the shown ``(layer, head)`` pairs (None: the top heads, chosen after the run).
    """

    data: PreparedDataset
    layers: tuple[int, ...]
    heads: tuple[int, ...]
    query_pos: tuple[int, ...]
    key_names: Optional[tuple[str, ...]]
    key_pos: tuple[tuple[int, ...], ...]
    plot_heads: Optional[tuple[tuple[int, int], ...]]

    @property
    def ids(self) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(i) for i in self.data.ids)


@dataclass(frozen=True)
class HeadScanInputs:
    """What :meth:`HeadScan.prepare` builds once: the layers scanned and each prompt's token ids."""

    layers: tuple[int, ...]
    ids: tuple[tuple[int, ...], ...]
    row_ids: tuple[int, ...] = ()


#: Retired config keys of ``attention_pattern`` and the key that replaced each.
RETIRED = {"prompt": "prompts"}


def _parse_query(spec: PositionSpec, field: str) -> Position:
    """:func:`tracekit.tokens.parse_position` in :data:`QUERY_FORMS`; a name written with spaces
    around it (``" is"``) is a token's text, refused with the ``token:`` hint.

    Raises:
        TokenizationError: an unknown form, or a bare token string.
    """
    pos = parse_position(spec, QUERY_FORMS, field)
    if pos.kind == "name" and isinstance(spec, str) and spec != spec.strip():
        raise TokenizationError(f"{field}: {spec!r} looks like a token's text; write it 'token:{spec}' (a name "
                                "such as END has no spaces)")
    return pos


def _resolve_per_row(model: HookedModel, data: PreparedDataset, pos: Position, field: str) -> list[int]:
    """Each row's index (into its own ids, BOS counted) of ``pos``: a dataset name per row
    (:meth:`PreparedDataset.position`), ``last``, an index or ``token:<text>``."""
    if pos.kind == "name":
        if not data.position_names:
            raise DatasetError(f"{field}: {pos.text!r} names a dataset position, but these rows have none ({data.source}); "
                               f"use last, an index, or 'token:{pos.text}' for a token's text")
        return data.position(str(pos.text), field)
    out = []
    for e in data.examples:
        out.append(pos.resolve(model, e.prompt, e.ids, field=field)[0])
    return out


@register
class AttentionPattern(Experiment):
    """Attention from one query position per row to named keys, at any layers and heads, over a
    dataset, in one batched forward pass per ``batch_size`` rows.

    Fields:
        prompts: one text or a list (each a row, without named positions); give prompts or dataset.
        dataset: a :class:`tracekit.dataset.DatasetSpec` (``rows:`` / ``path:`` / ``generator:``)
            whose rows carry named positions (``IO``, ``S1``, ``S2``, ``END``...); give prompts or
            dataset.
        layers: ``all`` (default) or block indices (negative from the end).
        layer: one block (the older single-layer form; same as ``layers: [layer]``).
        heads: ``all`` (default) or query-head indices.
        head: the head shown (the older form, needs ``layer``: same as ``plot_heads: [[layer, head]]``;
            added to ``heads``).
        query: the query position, resolved per row after BOS and padding: a dataset name
            (``END``), ``last`` (default), an int (index into the row's tokens, BOS counted when
            prepended; negative from the end) or ``token:<text>`` (the token holding the last
            character of the last ``<text>``, e.g. ``"token: is"``).
        position: the same as ``query`` (``position`` is the name every kind gives the position it
            reads, and the one the glossary uses; give one of them).
        keys: the key positions, each in the forms of ``query`` (``[IO, S1, S2]``), or ``all``
            (every key ``<= query``). Default: the dataset's named positions other than the query,
            or ``all`` when the rows have none. A key after the query gets weight 0 (causal mask).
        plot_heads: ``[[layer, head], ...]`` the heads shown in the figures and the summary's
            ``mean_attention_by_key`` (default: the ``n_plot_heads`` heads with the largest mean
            attention to the first key; with ``keys: all``, the largest mean weight on one key
            other than the first token).
        n_plot_heads: heads shown by default (3).
        plot_rows: rows shown in the figures (6).
        top_k: heads listed per key in ``top_heads_by_key`` (5).
        scores: also read the pre-softmax scores (``hook_attn_scores``; column ``score``).
        full_pattern: also tabulate the full causal pattern of the shown heads on the first
            ``plot_rows`` rows (one more forward pass of those rows).
        batch_size: rows per forward pass (16).
        dominance / spread_entropy: thresholds of the head labels (see
            :func:`tracekit.attention.classify_heads`).

    Summary (``*_by_row``: lists aligned with the rows; everything else names its aggregate):
        ``n_rows``; ``layers``, ``heads`` (the indices read); ``query`` and ``keys`` (the names);
        ``query_pos_by_row`` / ``query_token_by_row``; ``shown_heads`` (``[[layer, head], ...]``);
        ``top_heads_by_key`` (``{key: [[layer, head, mean weight over rows], ...]}``, ``top_k``
        each, largest first); ``mean_attention_by_key`` (``{key: {"L<l>H<h>": mean weight over
        rows}}`` for the shown heads); ``mean_score_by_key`` (the same for scores; with
        ``scores: true``); ``modal_label_by_head`` (``{"L<l>H<h>": the most frequent label over
        rows}`` for the shown heads); ``max_abs_row_sum_error`` (max over rows, layers and heads of
        ``|sum of the query's weights over the row's real keys - 1|``: 0 up to float error when no
        weight leaks to padding).

    Retired keys: ``prompt`` (now ``prompts``).

    Raises:
        AttentionError: unknown layer/head, a shown head outside ``layers``/``heads``.
        TokenizationError: a position not in a prompt. DatasetError: a name a row does not have.
    """

    kind: Literal["attention_pattern"] = "attention_pattern"
    prompts: OptionalPrompts = Field(default_factory=list)
    dataset: Optional[DatasetSpec] = None
    layers: Union[Literal["all"], Indices] = "all"
    layer: Optional[int] = None
    heads: Union[Literal["all"], Indices] = "all"
    head: Optional[int] = None
    query: Optional[PositionSpec] = None
    position: Optional[PositionSpec] = None
    keys: Union[Literal["all"], list[PositionSpec], None] = None
    plot_heads: Optional[list[tuple[int, int]]] = None
    n_plot_heads: int = Field(default=3, ge=1)
    plot_rows: int = Field(default=6, ge=1)
    top_k: int = Field(default=5, ge=1)
    scores: bool = False
    full_pattern: bool = False
    batch_size: int = Field(default=16, ge=1)
    dominance: float = Field(default=0.4, gt=0, le=1)
    spread_entropy: float = Field(default=0.9, gt=0, le=1)

    result_class = AttentionPatternResult

    retired = RETIRED

    @field_validator("query", "position")
    @classmethod
    def _position(cls, v, info):
        if v is not None:
            _parse_query(v, info.field_name)
        return v

    @field_validator("keys")
    @classmethod
    def _keys(cls, v):
        if isinstance(v, list):
            if not v:
                raise ValueError("an empty list selects nothing; list key positions ([IO, S1]) or write all")
            names = [str(_parse_query(k, f"keys[{i}]")) for i, k in enumerate(v)]
            dup = sorted({n for n in names if names.count(n) > 1})
            if dup:
                raise ValueError(f"keys: {dup} given more than once")
        return v

    @field_validator("plot_heads")
    @classmethod
    def _plot_heads(cls, v):
        if v is not None and not v:
            raise ValueError("an empty list selects nothing; omit plot_heads to show the top heads")
        return v

    @model_validator(mode="after")
    def _fields(self):
        check_dataset_fields(self.prompts, self.dataset)
        if self.query is not None and self.position is not None:
            raise ValueError("give query or position (the same field under its cross-kind name), not both")
        if self.layer is not None and self.layers != "all":
            raise ValueError("give layers (a list) or layer (one block), not both")
        if self.head is not None and self.layer is None:
            raise ValueError("head needs layer (the shown head of that block); for several blocks use "
                             "plot_heads: [[layer, head], ...]")
        if self.head is not None and self.plot_heads is not None:
            raise ValueError("give head or plot_heads, not both")
        return self

    @property
    def query_field(self) -> str:
        """The field the query position was given in (``query`` or ``position``)."""
        return "position" if self.position is not None else "query"

    @property
    def query_spec(self) -> PositionSpec:
        q = self.query if self.query is not None else self.position
        return "last" if q is None else q

    def prepare(self, model: HookedModel) -> AttentionPatternInputs:
        """Prepare the rows, check the layers and heads, and resolve the query and key positions
        per row (tokenizer and config only: works on a :class:`tracekit.model.ModelInfo`)."""
        data = kind_dataset(model, self.prompts or None, self.dataset, batch_size=self.batch_size)
        layers = [check_layer(model, self.layer)] if self.layer is not None else check_layers(model, self.layers)
        heads = check_heads(model, self.heads, layer=layers[0])
        for L in layers[1:]:
            check_heads(model, heads, layer=L)
        plot = None
        if self.head is not None:
            check_heads(model, [self.head], "head", layer=layers[0])
            if self.head not in heads:
                heads = sorted([*heads, self.head])
            plot = ((layers[0], int(self.head)),)
        elif self.plot_heads is not None:
            plot_l = []
            for i, (L, H) in enumerate(self.plot_heads):
                L = check_layer(model, L, f"plot_heads[{i}]")
                check_heads(model, [H], f"plot_heads[{i}]", layer=L)
                if L not in layers or H not in heads:
                    raise AttentionError(f"plot_heads[{i}]: L{L}H{H} is not read (layers {layers}, heads {heads}); "
                                         "add it to layers / heads")
                plot_l.append((L, int(H)))
            plot = tuple(dict.fromkeys(plot_l))
        qpos = _parse_query(self.query_spec, self.query_field)
        query_pos = _resolve_per_row(model, data, qpos, self.query_field)
        keys = self.keys
        if keys is None:
            names = [n for n in data.position_names if not (qpos.kind == "name" and n == qpos.text)]
            keys = names or "all"
        if keys == "all":
            key_names, key_pos = None, ()
        else:
            parsed = [_parse_query(k, f"keys[{i}]") for i, k in enumerate(keys)]
            key_names = tuple(str(p) for p in parsed)
            cols = [_resolve_per_row(model, data, p, f"keys[{i}]") for i, p in enumerate(parsed)]
            key_pos = tuple(tuple(int(c[r]) for c in cols) for r in range(len(data)))
        return AttentionPatternInputs(data, tuple(layers), tuple(heads), tuple(int(q) for q in query_pos), key_names,
                                      key_pos, plot)

    def _run(self, model: HookedModel, inputs: AttentionPatternInputs, progress: bool = True) -> AttentionPatternResult:
        # the engine reads the prepared ids and positions: nothing is tokenized again; the tables are
        # built by tracekit.attention_tables.query_tables from the same QueryAttention
        from ..core.progress import progress_bar

        data = inputs.data
        bar = progress_bar(total=len(data), desc="attention", unit="row", enabled=progress)

        def advance(n: int) -> None:
            bar.update(n)

        try:
            qa = query_attention(model, inputs.ids, inputs.query_pos, list(inputs.layers), list(inputs.heads),
                                 self.batch_size, self.scores, progress=advance,
                                 field="dataset" if self.dataset is not None else "prompts")
        finally:
            bar.close()
        qt = query_tables(model, data, inputs.ids, qa, inputs.key_names, inputs.key_pos, inputs.plot_heads,
                          dominance=self.dominance, spread_entropy=self.spread_entropy,
                          n_plot_heads=self.n_plot_heads, full_pattern=self.full_pattern, plot_rows=self.plot_rows,
                          batch_size=self.batch_size)
        meta = {"n_rows": len(qt.row_ids), "row_ids": qt.row_ids, "layers": qt.layers, "heads": qt.heads,
                "query": str(_parse_query(self.query_spec, self.query_field)), "keys": qt.key_names,
                "key_mode": "named" if inputs.key_names is not None else "all", "query_pos_by_row": qt.query_pos,
                "query_token_by_row": qt.query_tokens, "shown_heads": qt.shown,
                "max_abs_row_sum_error": qt.max_abs_row_sum_error, "source": data.source, "dropped": dict(data.dropped)}
        return AttentionPatternResult(self, qt.tables, meta)


@register
class HeadScan(Experiment):
    """Previous-token / induction scores of every head (Olsson et al. 2022) and head labels.

    Fields:
        seq_len: random tokens per half of the repeated sequence.
        n_seqs: repeated random-token sequences the previous-token / induction scores are averaged
            over (default 4).
        seed: seed of the random tokens of the repeated sequences (default 0).
        layers: ``all`` or a list.
        dataset: optional dataset rows (:mod:`tracekit.dataset`) on which each head is labelled, instead
            of ``prompts`` (table ``labels`` carries each row's ``row_id``).
        prompts: optional prompts on which each head is labelled (self/first/previous/spread/content),
            averaged over query positions >= 1.
        top_k: heads listed in the summary.
        induction_threshold: induction score (attention probability, in [0, 1]; default 0.3) at or
            above which a head is counted in the summary's ``n_induction_heads``.
        dominance: head labelling on ``prompts``: a head is labelled ``self``/``first``/``previous``
            when its mean attention mass on that key is >= this (in (0, 1]; default 0.4).
        spread_entropy: head labelling: otherwise a head is ``spread`` when its normalised attention
            entropy ``H / log(q+1)`` is >= this (in (0, 1]; default 0.9), else ``content``.

    Raises:
        AttentionError: unknown layer, or sequences longer than the context.
    """

    kind: Literal["head_scan"] = "head_scan"
    seq_len: int = Field(default=40, ge=2)
    n_seqs: int = Field(default=4, ge=1)
    seed: int = 0
    layers: Union[Literal["all"], Indices] = "all"
    prompts: OptionalPrompts = Field(default_factory=list)
    dataset: Optional[DatasetSpec] = None
    top_k: int = Field(default=5, ge=1)
    induction_threshold: float = Field(default=0.3, ge=0, le=1)
    dominance: float = Field(default=0.4, gt=0, le=1)
    spread_entropy: float = Field(default=0.9, gt=0, le=1)

    result_class = HeadScanResult

    def _layers(self, model: HookedModel):
        if self.layers == "all":
            return list(range(int(model.cfg.n_layers)))
        return [check_layer(model, L, f"layers[{i}]") for i, L in enumerate(self.layers)]

    def prepare(self, model: HookedModel) -> HeadScanInputs:
        """Check the layers and the sequence length against the context, tokenize the prompts
        (tokenizer and config only: works on a :class:`tracekit.model.ModelInfo`)."""
        layers = tuple(self._layers(model))
        check_repeated_length(model, self.seq_len)
        if self.dataset is not None:
            if self.prompts:
                raise AttentionError("prompts / dataset: give one of them (the rows on which heads are labelled)")
            data = kind_dataset(model, None, self.dataset)
            return HeadScanInputs(layers, tuple(data.ids), tuple(e.row_id for e in data.examples))
        ids = encode_prompts(model, self.prompts)
        return HeadScanInputs(layers, ids, tuple(range(len(ids))))

    def _run(self, model: HookedModel, inputs: HeadScanInputs, progress: bool = True) -> HeadScanResult:
        layers = list(inputs.layers)
        sc = head_scores(model, self.seq_len, self.n_seqs, self.seed, layers)
        prev, ind = sc["prev_token_score"] >= self.dominance, sc["induction_score"] >= self.induction_threshold
        sc["type"] = [", ".join(t for t, on in (("previous-token", p), ("induction", i)) if on)
                      for p, i in zip(prev.tolist(), ind.tolist())]
        sc["measured_on"] = f"random tokens ({self.n_seqs} x 2 x {self.seq_len}, seed {self.seed})"
        tables = {"scores": sc}
        if inputs.ids:
            rows = []
            for pi, ids in zip(inputs.row_ids, inputs.ids):
                batch = pad_ids(model, [ids])  # one prompt: no padding
                labs: dict[str, pd.DataFrame] = {}  # per layer; the [1, head, pos, pos] patterns are read a chunk
                # of layers at a time under the memory budget and dropped once labelled

                def label(got: dict, labs=labs) -> None:
                    for k, v in got.items():
                        labs[k] = classify_heads(v[0].float().cpu(), None, self.dominance, self.spread_entropy)

                read_layers(model, batch, layers, ("head_pattern",), label, what="head scan labels")
                for L in layers:
                    lab = labs[hook("head_pattern", L)]
                    rows.append(lab.rename(columns=LABEL_RENAMES).assign(
                        prompt_idx=pi, row_id=pi, layer=L, measured_on=f"row {pi}, every query position >= 1"))
            tables["labels"] = pd.concat(rows, ignore_index=True)
        return HeadScanResult(self, tables, {"layers": layers})

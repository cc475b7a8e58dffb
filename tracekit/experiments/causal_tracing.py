"""Causal tracing (Meng et al. 2022, ROME section 2.1) as an experiment kind, per row.

``kind: causal_tracing`` (:class:`CausalTracing`): for each row, the subject's token embeddings are
corrupted with Gaussian noise, and the clean hidden state is restored at one (layer, position) at a
time -- the block output (``resid``), the MLP output (``mlp``) or the attention output (``attn``),
the last two with a window of layers centred on the layer. The indirect effect of a state is
``p(target | corrupted, restored) - p(target | corrupted)`` averaged over the noise draws. The
computation is :func:`tracekit.causal_tracing.causal_trace` (one cached corrupted run per row,
batched layer-skipping replays); this module resolves the subjects and targets, sets the noise
level once for all rows, shapes the tables (per row, and ROME's average over token categories) and
draws the three classic heatmaps. Units: every ``p_*`` is a probability in [0, 1]; effects are
differences of probabilities.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional, Union

import numpy as np
import pandas as pd
from pydantic import Field, field_validator, model_validator

from .. import plotting
from ..causal_tracing import CATEGORIES, KINDS, category_rows, causal_trace, noise_scale, subject_span, token_categories
from ..core.errors import ConfigError, DatasetError
from ..core.strict import StrictModel
from ..dataset import PreparedDataset, rows_from_prompts
from ..model.info import HookedModel
from ..tokens import str_tokens
from .base import (
    DatasetSpec,
    Experiment,
    OptionalPrompts,
    Result,
    check_dataset_fields,
    dataset_meta,
    kind_dataset,
    register,
    row_frame,
)
from .frames import column, select, tuples

__all__ = ["CausalTracing", "CausalTracingInputs", "CausalTracingResult", "SubjectSpec"]

Kind = Literal["resid", "mlp", "attn"]
_LABEL = {"resid": "residual stream (block output)", "mlp": "MLP output", "attn": "attention output"}


class SubjectSpec(StrictModel):
    """Where a row's subject is; give exactly one of ``text``, ``field`` or ``position``.

    Fields:
        text: the subject's text, found in every prompt (its last occurrence); the subject is every
            token overlapping it.
        field: a dataset column holding each row's subject text (``country`` for the ``capitals``
            generator), found the same way.
        position: a named position of the dataset's rows marking the subject's **last** token (the
            ``capitals`` generator's ``SUBJ``); with ``span`` tokens ending there (default 1: the last
            subject token only, which is what a single named index can say).
        span: with ``position``: how many tokens, ending at it, the subject has (>= 1).
    """

    text: Optional[str] = None
    field: Optional[str] = None
    position: Optional[str] = None
    span: int = Field(default=1, ge=1)

    @model_validator(mode="after")
    def _one(self):
        given = [k for k in ("text", "field", "position") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of text, field or position (got {given or 'none'})")
        if self.span != 1 and self.position is None:
            raise ValueError("span goes with position (a text or a field already names every subject token)")
        return self


@dataclass(frozen=True)
class CausalTracingInputs:
    """What :meth:`CausalTracing.prepare` builds once: the rows, each row's subject positions
    (indices into its ids, BOS counted) and subject text (None for a named position), and each
    row's target id (None: the model's top-1 on the clean prompt, resolved at run time)."""

    data: PreparedDataset
    subjects: tuple[tuple[int, ...], ...]
    subject_texts: tuple[Optional[str], ...]
    target_ids: tuple[Optional[int], ...]

    @property
    def ids(self) -> tuple[tuple[int, ...], ...]:
        """Each row's token ids (BOS counted), as prepared once."""
        return tuple(e.ids for e in self.data.examples)


def _peak(ie: np.ndarray) -> tuple[int, int, float]:
    L, p = np.unravel_index(int(np.nanargmax(ie)), ie.shape)
    return int(L), int(p), float(ie[L, p])


class CausalTracingResult(Result):
    """Tables (``row_id`` = the dataset row's id; probabilities in [0, 1]):

    * ``effects``: one line per row x kind x layer x position: ``row_id``, ``kind`` (``resid``,
      ``mlp``, ``attn``), ``layer`` (block index; for ``mlp`` / ``attn`` the window's centre),
      ``position`` (BOS counted), ``token``, ``in_subject``, ``p_restored`` (mean over noise draws),
      ``indirect_effect`` (mean over draws of ``p_restored - p_corrupted``).
    * ``rows``: one line per row: its fields (``prompt``, ``target``, ...), ``target`` (the token
      traced), ``target_source`` (``given`` or ``top1``: the model's own clean prediction),
      ``subject`` (text, or None for a named position), ``subject_positions``, ``n_tokens``,
      ``p_clean``, ``p_corrupted``, ``total_effect`` (``p_clean - p_corrupted``), per kind
      ``peak_<kind>_layer`` / ``_position`` / ``_token`` / ``_effect`` (the largest indirect
      effect), ``tokens``.
    * ``categories``: ROME's average over token categories: ``kind``, ``category`` (first subject
      token, middle subject tokens, last subject token, first subsequent token, further tokens, last
      token), ``layer``, ``mean_p_restored``, ``mean_indirect_effect``, ``n`` (the (row, token) pairs
      pooled; tokens before the subject are in no category).

    Summary keys: ``n_rows``, ``row_id_by_row``, ``dataset_source``, ``rows_dropped``, ``kinds``,
    ``window``, ``n_samples``, ``seed``, ``noise`` (the multiple of the embedding std, None when
    ``noise_std`` was given), ``embedding_std`` (None likewise), ``noise_std`` (the std used),
    ``noise_calibration`` (the rule: ``subjects_table``, ``row_subjects``, or ``absolute`` when
    ``noise_std`` was given), ``embedding_std_over`` (the population it pooled, in words; None for
    ``absolute``) and ``embedding_std_n_tokens``; ``target_by_row``,
    ``target_source_by_row``, ``p_clean_by_row``, ``p_corrupted_by_row``, ``total_effect_by_row``
    and their means ``mean_p_clean``, ``mean_p_corrupted``, ``mean_total_effect``; per kind
    ``peak_<kind>_layer_by_row``, ``peak_<kind>_position_by_row``, ``peak_<kind>_token_by_row``,
    ``peak_<kind>_effect_by_row``, and over rows (the ``categories`` table)
    ``mean_peak_<kind>_layer``, ``mean_peak_<kind>_category``, ``mean_peak_<kind>_effect``, and
    the three in one line ``peak_<kind>`` (``"layer 5, last subject token: AIE +0.41"``; categories
    that coincide in every row named as one, e.g. ``subject token (first = last)``; ``IE`` for one
    row), which ``tracekit show`` lists.
    """

    config: "CausalTracing"
    main_table = "effects"
    headline_keys = ("mean_p_clean", "mean_p_corrupted", "mean_total_effect", "peak_resid", "peak_mlp", "peak_attn",
                     "n_rows")
    table_names = ("effects", "rows", "categories")

    def summary(self) -> dict:
        rows, cats = self.tables["rows"], self.tables["categories"]
        dmeta = self.meta.get("dataset", {})
        s: dict = {
            "n_rows": int(len(rows)), "row_id_by_row": [int(x) for x in rows["row_id"]],
            "dataset_source": dmeta.get("source"), "rows_dropped": dict(dmeta.get("dropped", {})),
            "kinds": list(self.meta["kinds"]), "window": int(self.meta["window"]),
            "n_samples": int(self.meta["n_samples"]), "seed": int(self.meta["seed"]),
            "noise": self.meta.get("noise"), "embedding_std": self.meta.get("embedding_std"),
            "noise_std": float(self.meta["noise_std"]),
            "noise_calibration": self.meta.get("noise_calibration", "row_subjects" if self.meta.get("noise") is not None
                                               else "absolute"),  # results saved before the field: per-step pooling
            "embedding_std_over": self.meta.get("embedding_std_over"),
            "embedding_std_n_tokens": self.meta.get("embedding_std_n_tokens"),
            "target_by_row": [str(x) for x in rows["target"]],
            "target_source_by_row": [str(x) for x in rows["target_source"]],
            "chunks": self.meta.get("chunks"),
        }
        for col in ("p_clean", "p_corrupted", "total_effect"):
            s[f"{col}_by_row"] = [float(x) for x in rows[col]]
            s[f"mean_{col}"] = float(column(rows, col).mean())
        for k in self.meta["kinds"]:
            for part, cast in (("layer", int), ("position", int), ("token", str), ("effect", float)):
                s[f"peak_{k}_{part}_by_row"] = [cast(x) for x in rows[f"peak_{k}_{part}"]]
            c = select(cats, (column(cats, "kind") == k) & (column(cats, "n") > 0))
            # ties (a one-token subject is its first and last token; " is" can be the first subsequent
            # and the last token) go to the later category, as ROME's story reads them
            best = c.loc[column(c, "mean_indirect_effect").iloc[::-1].idxmax()] if len(c) else None
            s[f"mean_peak_{k}_layer"] = int(best["layer"]) if best is not None else None
            s[f"mean_peak_{k}_category"] = str(best["category"]) if best is not None else None
            s[f"mean_peak_{k}_effect"] = float(best["mean_indirect_effect"]) if best is not None else None
        merged = {c: label for label, cs in category_rows([(int(n), [int(p) for p in sp]) for n, sp in
                                                            zip(rows["n_tokens"], rows["subject_positions"])])
                  for c in cs}
        for k in self.meta["kinds"]:  # one line per site for `tracekit show` (headline_keys)
            cat = s[f"mean_peak_{k}_category"]
            s[f"peak_{k}"] = (None if cat is None else f"layer {s[f'mean_peak_{k}_layer']}, {merged.get(cat, cat)}: "
                              f"{'AIE' if len(rows) > 1 else 'IE'} {s[f'mean_peak_{k}_effect']:+.3g}")
        return s

    def report(self) -> str:
        s = self.summary()
        src = f" from {s['dataset_source']}" if s["dataset_source"] else ""
        noise = (f"{s['noise']} x embedding std {s['embedding_std']:.4f} ({s['noise_calibration']}: over "
                 f"{s['embedding_std_over']})" if s["noise"] is not None else "absolute")
        lines = [f"causal tracing [{self.config.step_name}]: {s['n_rows']} row(s){src}; noise std {s['noise_std']:.4f} "
                 f"({noise}), {s['n_samples']} draws (seed {s['seed']}), window {s['window']} for mlp/attn",
                 f"mean p_clean {s['mean_p_clean']:.4g}, p_corrupted {s['mean_p_corrupted']:.4g}, total effect "
                 f"{s['mean_total_effect']:+.4g}"]
        rows = self.tables["rows"]
        shown = rows.head(20)
        for k in s["kinds"]:
            lines.append(f"{_LABEL[k]}: mean over rows peaks at layer {s[f'mean_peak_{k}_layer']} on the "
                         f"{s[f'mean_peak_{k}_category']} (indirect effect {s[f'mean_peak_{k}_effect']:+.4g})")
        lines.append(plotting.text_table(
            [(int(r.row_id), repr(r.target), f"{r.p_clean:.4g}", f"{r.p_corrupted:.4g}",
              *(f"L{getattr(r, f'peak_{k}_layer')} {getattr(r, f'peak_{k}_token')!r} "
                f"{getattr(r, f'peak_{k}_effect'):+.3g}" for k in s["kinds"]))
             for r in tuples(shown)],
            ["row_id", "target", "p_clean", "p_corr", *(f"peak {k}" for k in s["kinds"])]))
        if len(rows) > len(shown):
            lines.append(f"({len(shown)} of {len(rows)} rows shown)")
        return "\n".join(lines)

    def figures(self) -> dict:
        """One paper-sized heatmap per kind (:func:`tracekit.plotting.paper_heatmap`: rows x layers,
        text >= 9 pt, saved at 200 dpi), in ROME's colours. One row: rows are the prompt's tokens
        (``*`` = subject), colour p(target) restored. Several rows: rows are ROME's token categories
        (:func:`tracekit.causal_tracing.category_rows`: categories no row has are left out, and
        categories that coincide in every row, e.g. the first and last token of one-token subjects,
        are one row ``subject token (first = last)``), colour the mean indirect effect."""
        rows, eff, cats = self.tables["rows"], self.tables["effects"], self.tables["categories"]
        figs = {}
        if len(rows) == 1:
            r = rows.iloc[0]
            toks = list(r["tokens"])
            subj = {int(p) for p in r["subject_positions"]}
            shown = [repr(t) for t in toks]
            labels = [f"{t}{'*' if i in subj else ''}" + (f" ({i})" if shown.count(t) > 1 else "")
                      for i, t in enumerate(shown)]  # first token on top; a repeated token names its position
            for k in self.meta["kinds"]:
                e = eff[eff["kind"] == k]
                grid = e.pivot(index="position", columns="layer", values="p_restored").sort_index()
                figs[k] = plotting.paper_heatmap(
                    grid.to_numpy(), grid.columns.tolist(), labels, cmap=_CMAP[k],
                    title=f"{_LABEL[k]} restored: p({r['target']!r}), clean {r['p_clean']:.3g}, corrupted "
                          f"{r['p_corrupted']:.3g} (* = subject token)", xlabel="layer" + _WINDOW(self, k),
                    ylabel="token", colorbar_label=f"p({r['target']!r}) restored")
            return figs
        merged = category_rows([(int(n), [int(p) for p in sp]) for n, sp in zip(rows["n_tokens"],
                                                                                 rows["subject_positions"])])
        for k in self.meta["kinds"]:
            c = cats[cats["kind"] == k]
            grid = c.pivot(index="category", columns="layer", values="mean_indirect_effect")
            figs[k] = plotting.paper_heatmap(
                grid.reindex([cs[0] for _, cs in merged]).to_numpy(), grid.columns.tolist(),
                [label for label, _ in merged], cmap=_CMAP[k],
                title=f"{_LABEL[k]}: average indirect effect over {len(rows)} prompts",
                xlabel="layer" + _WINDOW(self, k), ylabel="token category",
                colorbar_label="average indirect effect (AIE, probability)")
        return figs


_CMAP = {"resid": "Purples", "mlp": "Greens", "attn": "Reds"}  # ROME's colours


def _WINDOW(res: CausalTracingResult, kind: str) -> str:  # noqa: N802 - a label helper
    w = int(res.meta["window"])
    return f" (centre of a {w}-layer window)" if kind != "resid" and w > 1 else ""


@register
class CausalTracing(Experiment):
    """Causal tracing (Meng et al. 2022, ROME section 2.1): which hidden states carry a factual
    recall, found by corrupting the subject and restoring clean states one at a time.

    Fields:
        prompts: one string or a list (one row each); or
        dataset: the rows (:class:`tracekit.dataset.DatasetSpec`, e.g. ``{generator: capitals}``).
        subject: where each row's subject is: its text (found in every prompt, last occurrence; the
            subject is every token overlapping it), a list of texts (one per prompt), or
            :class:`SubjectSpec` (``{field: country}``: a dataset column; ``{position: SUBJ, span: 2}``:
            a named position of the rows marking the subject's last token, and how many tokens end
            there). Required.
        target: with ``prompts``: the token traced (``" Paris"``), or a list with one per prompt;
            default (and for dataset rows without a target) the model's own top-1 on the clean
            prompt (ROME). Dataset rows use their own ``target``.
        kinds: which states are restored: ``resid`` (block output), ``mlp``, ``attn`` (default all).
        window: layers restored together for ``mlp`` / ``attn``, centred as ROME (>= 1; default 10).
        noise: the noise's standard deviation as a multiple of the embedding std of a population
            of subject tokens (ROME's ``collect_embedding_std``; default 3, ROME's ``s3``).
        noise_calibration: the population (:func:`tracekit.causal_tracing.noise_scale`):
            ``subjects_table`` (default; the 50 subjects of the shipped capitals table, the same std
            whatever the rows, as ROME pools its whole facts dataset) or ``row_subjects`` (the subject
            tokens of this step's rows: the std then depends on which subjects are traced).
        noise_std: the noise's standard deviation in residual-stream units instead (not with
            ``noise`` or ``noise_calibration``).
        n_samples: noise draws per row (ROME: 10), the same draws for every restoration.
        seed: the noise's seed (the same draws on every row, as ROME).
        batch_size: replay rows per batch, or ``auto`` (by free memory).

    Summary keys and tables: :class:`CausalTracingResult`.

    Raises:
        TokenizationError / DatasetError: a subject not in a prompt, a target not one token, a
            named position or column a row does not have.
        MethodRefused: ``mlp`` / ``attn`` on a model without ``hook_mlp_out`` / ``hook_attn_out``.
    """

    kind: Literal["causal_tracing"] = "causal_tracing"
    prompts: OptionalPrompts = Field(default_factory=list)
    dataset: Optional[DatasetSpec] = None
    subject: Union[str, list[str], SubjectSpec, None] = None
    target: Union[str, list[str], None] = None
    kinds: list[Kind] = Field(default_factory=lambda: list(KINDS), min_length=1)
    window: int = 10
    noise: float = 3.0
    noise_calibration: Literal["subjects_table", "row_subjects"] = "subjects_table"
    noise_std: Optional[float] = None
    n_samples: int = 10
    seed: int = 0
    batch_size: Union[int, Literal["auto"]] = "auto"

    result_class = CausalTracingResult

    @field_validator("window")
    @classmethod
    def _window(cls, v):
        if v < 1:
            raise ValueError(f"{v} restores no layer; give a window of at least 1 layer (ROME: 10; 1 = one layer)")
        return v

    @field_validator("n_samples")
    @classmethod
    def _samples(cls, v):
        if v < 1:
            raise ValueError(f"{v}; give at least 1 noise draw (ROME: 10)")
        return v

    @field_validator("noise", "noise_std")
    @classmethod
    def _noise(cls, v):
        if v is not None and v < 0:
            raise ValueError(f"{v}; a standard deviation is >= 0 (0 = no corruption)")
        return v

    @field_validator("batch_size")
    @classmethod
    def _batch(cls, v):
        if isinstance(v, int) and v < 1:
            raise ValueError(f"{v}; give at least 1 replay row per batch, or auto")
        return v

    @field_validator("kinds")
    @classmethod
    def _kinds(cls, v):
        if len(set(v)) != len(v):
            raise ValueError(f"{v} repeats a kind; list each of resid, mlp, attn once")
        return v

    @model_validator(mode="after")
    def _rows(self):
        check_dataset_fields(self.prompts, self.dataset, self.target, None)
        if self.subject is None:
            raise ValueError("subject: give the subject causal tracing corrupts: its text (subject: France), one per "
                             "prompt, a dataset column ({field: country}) or a named position ({position: SUBJ})")
        if "noise" in self.model_fields_set and self.noise_std is not None:
            raise ValueError("noise and noise_std: give one (noise: a multiple of the embedding std; noise_std: "
                             "absolute)")
        if "noise_calibration" in self.model_fields_set and self.noise_std is not None:
            raise ValueError("noise_calibration and noise_std: noise_calibration sets the embedding std that noise "
                             "multiplies; an absolute noise_std uses none. Give one")
        if self.dataset is None:
            rows_from_prompts(self.prompts, self.target)  # a target list: one per prompt
        if isinstance(self.subject, list) and len(self.subject) != len(self.prompts):
            raise ValueError(f"subject: {len(self.subject)} subjects for {len(self.prompts)} prompts; give one per "
                             "prompt (or one text for every prompt)")
        if isinstance(self.subject, SubjectSpec) and self.dataset is None and self.subject.text is None:
            raise ValueError("subject: field / position read a dataset's rows; with prompts give the subject's text")
        return self

    def _subject(self, model: HookedModel, data: PreparedDataset, i: int) -> tuple[tuple[int, ...], Optional[str]]:
        e = data.examples[i]
        s = self.subject
        at = f"subject[{i}]" if isinstance(s, list) else "subject"
        if isinstance(s, SubjectSpec) and s.position is not None:
            last = data.select([i]).position(s.position, "subject.position")[0]
            first = last - s.span + 1
            if first < e.n_bos:
                raise DatasetError(f"subject.span: {s.span} tokens ending at {s.position} (index {last}) start before "
                                   f"the prompt of row {e.row_id} {str_tokens(model, list(e.ids))}; give a smaller span")
            return tuple(range(first, last + 1)), None
        if isinstance(s, SubjectSpec) and s.field is not None:
            extra = e.row.extra
            if s.field not in extra or not isinstance(extra[s.field], str):
                raise DatasetError(f"subject.field: row {e.row_id} has no text column {s.field!r} (its columns: "
                                   f"{sorted(extra) or 'none'})")
            text = str(extra[s.field])
            at = f"subject.field ({s.field} of row {e.row_id})"
        else:
            text = s[i] if isinstance(s, list) else (s.text if isinstance(s, SubjectSpec) else s)
        assert isinstance(text, str)
        return subject_span(model, e.prompt, text, e.ids, field=at), text

    def prepare(self, model: HookedModel) -> CausalTracingInputs:
        """The rows prepared once (prompts tokenized, targets checked to be one token), each row's
        subject positions and target id (tokenizer only: works on a :class:`tracekit.model.ModelInfo`).

        Raises:
            TokenizationError / DatasetError: see the class docstring.
        """
        data = kind_dataset(model, self.prompts or None, self.dataset, self.target, None)
        subs = [self._subject(model, data, i) for i in range(len(data))]
        return CausalTracingInputs(data, tuple(p for p, _ in subs), tuple(t for _, t in subs),
                                   tuple(e.target_id for e in data.examples))

    def _run(self, model: HookedModel, inputs: CausalTracingInputs, progress: bool = True) -> CausalTracingResult:
        from ..core.progress import progress_bar

        data = inputs.data
        scale = None
        if self.noise_std is None:
            scale = noise_scale(model, self.noise_calibration, data.ids, inputs.subjects)
            noise_std = self.noise * scale.embedding_std
        else:
            noise_std = self.noise_std
        n_layers = int(model.cfg.n_layers)
        total = sum(len(self.kinds) * n_layers * len(e.ids) * self.n_samples for e in data.examples)
        bar = progress_bar(total=total, desc="causal tracing", unit="patched run", enabled=progress)
        effects, recs, cat_parts = [], [], []
        batch_sizes: list[int] = []  # per row, replay rows per batch (run.memory_budget)
        try:
            for e, subj, text, tid in zip(data.examples, inputs.subjects, inputs.subject_texts, inputs.target_ids):
                tr = causal_trace(model, e.ids, subj, tid, tuple(self.kinds), self.window, noise_std=noise_std,
                                  n_samples=self.n_samples, seed=self.seed, batch_size=self.batch_size,
                                  progress=bar.update)
                f = tr.frame()
                f.insert(0, "row_id", e.row_id)
                f.insert(5, "in_subject", f["position"].isin(subj))
                effects.append(f)
                rec = {"target": tr.target, "target_id": tr.target_id, "target_source": "given" if tid is not None
                       else "top1", "subject": text, "subject_positions": list(subj), "n_tokens": len(e.ids),
                       "p_clean": tr.p_clean, "p_corrupted": tr.p_corrupted, "total_effect": tr.total_effect}
                ie, pr = tr.indirect_effect.numpy(), tr.p_restored.numpy()
                for ki, k in enumerate(tr.kinds):
                    L, p, v = _peak(ie[ki])
                    rec.update({f"peak_{k}_layer": L, f"peak_{k}_position": p, f"peak_{k}_token": tr.tokens[p],
                                f"peak_{k}_effect": v})
                    for cat, pos in token_categories(len(e.ids), subj).items():
                        for q in pos:
                            cat_parts.append(pd.DataFrame({"kind": k, "category": cat, "layer": np.arange(n_layers),
                                                           "p_restored": pr[ki, :, q], "indirect_effect": ie[ki, :, q]}))
                rec["tokens"] = tr.tokens
                recs.append(rec)
                batch_sizes.append(int(tr.batch_size))
        finally:
            bar.close()
        tables = {"effects": pd.concat(effects, ignore_index=True), "rows": row_frame(data, recs),
                  "categories": _categories(cat_parts, list(self.kinds), n_layers)}
        meta = {"kinds": list(self.kinds), "window": self.window, "n_samples": self.n_samples, "seed": self.seed,
                "noise": None if self.noise_std is not None else self.noise,
                "embedding_std": scale.embedding_std if scale else None, "noise_std": float(noise_std),
                "noise_calibration": scale.calibration if scale else "absolute",
                "embedding_std_over": scale.population if scale else None,
                "embedding_std_n_tokens": scale.n_tokens if scale else None,
                "n_layers": n_layers, "dataset": dataset_meta(data),
                "chunks": {"causal tracing replay": {"rows": batch_sizes}},
                "noise_site": "blocks.0.hook_resid_pre at the subject positions",
                "embedding_std_of": "blocks.0.hook_resid_pre minus hook_pos_embed where the model has a learned "
                                    "position embedding (the token embedding as it enters the stream), at the tokens "
                                    "of embedding_std_over"}
        return CausalTracingResult(self, tables, meta)


def _categories(parts: list[pd.DataFrame], kinds: list[str], n_layers: int) -> pd.DataFrame:
    """Mean over the pooled (row, token) pairs of each (kind, category, layer), every cell present
    (``n`` 0 and NaN means for a category no row has, e.g. middle subject tokens of one-token subjects)."""
    full = pd.MultiIndex.from_product([kinds, list(CATEGORIES), range(n_layers)], names=["kind", "category", "layer"])
    if not parts:
        raise ConfigError("causal tracing: no rows")
    df = pd.concat(parts, ignore_index=True)
    g = df.groupby(["kind", "category", "layer"])
    out = pd.DataFrame({"mean_p_restored": g["p_restored"].mean(), "mean_indirect_effect": g["indirect_effect"].mean(),
                        "n": g.size()}).reindex(full)
    out["n"] = out["n"].fillna(0).astype(int)
    return out.reset_index()

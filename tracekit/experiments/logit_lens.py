"""``kind: logit_lens`` -- at which layer does the answer appear in the residual stream?

The method and its numbering live in :mod:`tracekit.logit_lens` (notebook-callable); this module
validates the config, prepares the rows once (:mod:`tracekit.dataset`), calls the engine on their
token ids and shapes tables, summary, report and figures.

Rows: ``prompts`` (+ ``target``/``foil``: a string is every prompt's, a list one per prompt) or a
``dataset`` whose rows carry their own target, foil and named positions. ``track`` lists tokens
followed on every row.

Tables (``vocab_rank``: 1 = the top token of the vocabulary distribution; it was ``rank``):

* ``main``: one row per dataset row x position x hidden state: ``prompt_idx`` (index in this run),
  ``row_id`` (the dataset's id), ``prompt``, ``position``, ``token``, ``is_last``,
  ``hidden_state`` (the lens axis), ``layer`` (block index), ``site``, ``hook``, ``entropy``,
  ``top1``, ``top1_id``, ``top1_prob``, and the **row's own** ``target``, ``target_id``, ``prob``,
  ``log_prob``, ``vocab_rank`` (-1 / NaN on rows without a target); with foils also ``foil``,
  ``foil_id``, ``foil_prob``, ``foil_log_prob``, ``logit_diff`` (``log_prob - foil_log_prob`` =
  the target's logit minus the foil's);
* ``tracked`` (with ``track``): one row per row x position x hidden state x tracked token:
  ``tracked_token``, ``tracked_id``, ``prob``, ``log_prob``, ``vocab_rank``;
* ``rows``: one row per dataset row (:meth:`tracekit.dataset.PreparedDataset.frame` columns:
  ``row_id``, ``prompt``, ``target``, ``foil``, ``corrupted``, ``group``, ``pos_<NAME>``, extras)
  plus ``prompt_idx``, ``position`` / ``token`` (the read the row's numbers come from: the row's
  read position, or its last token with ``position: all``), ``target_id``, ``final_top1``,
  ``final_top1_prob``, ``target_prob_final``, ``target_log_prob_final``,
  ``target_vocab_rank_final`` (the model's own output), ``emergence_hidden_state``,
  ``emergence_layer``, ``jump_layer``, ``jump_from_hidden_state``, ``jump_to_hidden_state``,
  ``jump_from_prob``, ``jump_to_prob``, ``jump_gain``; with foils ``foil_id``,
  ``foil_prob_final``, ``logit_diff_final``;
* ``topk``: row x position x hidden state x k; ``tokens``: every row's tokenization (BOS included
  when prepended); ``final``: the model's own output distribution (top-k, the row's target, the
  tracked tokens) at each read position.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Optional, Union

import numpy as np
import pandas as pd
from pydantic import Field, field_validator, model_validator

from ..activations.cached import CachedActivations
from ..dataset import DatasetSpec, Rows
from ..lenses.train import TunedLensSpec, load_or_train_tuned_lens
from ..logit_lens import LENS_POSITIONS, LayerConvention, LensPoint, landmarks, lens_points, logit_lens
from ..model.info import HookedModel
from ..tokens import parse_position, single_token_id, str_tokens
from . import onepass
from .base import Experiment, OptionalPrompts, check_dataset_fields, register
from .logit_lens_tables import LogitLensResult

__all__ = ["LogitLens", "LogitLensInputs", "LogitLensResult"]


@dataclass(frozen=True)
class LogitLensInputs:
    """What :meth:`LogitLens.prepare` builds once: the prepared rows (ids with BOS when prepended,
    per-row target/foil ids, named positions), per row the positions read and the one its summary
    numbers come from, the tracked tokens' ids, the hidden states read."""

    data: Rows
    ids: tuple[tuple[int, ...], ...]
    positions: tuple[tuple[int, ...], ...]
    summary_positions: tuple[int, ...]
    track_ids: tuple[int, ...]
    points: tuple[LensPoint, ...]


@register
class LogitLens(Experiment):
    """Logit lens over rows: per hidden state, each row's own target probability / log-prob / vocab
    rank, entropy, top-k; where each row's target emerges; tokens tracked on every row.

    Method: nostalgebraist 2020; tuned-lens ``LogitLens``. Engine: :func:`tracekit.logit_lens.logit_lens`
    (one batched pass per ``batch_size`` rows; each row's target gathered from the same
    log-softmax).

    Fields:
        prompts: one string or a list (batched with padding; each prompt's own tokens are read);
            or ``dataset`` instead.
        dataset: rows with their own ``target``, ``foil``, named ``positions``, ``group`` and extra
            columns (:class:`tracekit.dataset.DatasetSpec`: inline ``rows``, a file ``path`` or a
            ``generator`` such as ``capitals``); no ``target``/``foil`` beside it.
        target: with ``prompts``: a token string = every prompt's answer; a list = **one answer per
            prompt** (same length as ``prompts``). Each exactly one token, leading space included.
            Optional.
        foil: with ``prompts``: each prompt's contrasting token, like ``target`` (adds ``foil_prob``
            and ``logit_diff``). Optional.
        track: tokens followed on every row (the old "list of targets"): table ``tracked``.
        position: ``last`` (each row's last token), ``all`` (the classic grid picture), a token
            index (BOS counted; negative from the end) or a dataset's named position (``END``,
            ``SUBJ``...: resolved per row, after BOS and padding). The summary and the ``rows``
            table read each row at this position (its last token with ``all``).
        layer_convention: which hidden states are read: ``hidden_states`` (0 = embeddings ..
            n_layers = the output; default), ``resid_post`` (block outputs 1..n_layers) or
            ``resid_pre`` (block inputs 0..n_layers-1). Tables always carry ``hidden_state``,
            ``layer`` (block index) and ``hook``.
        top_k: number of top tokens kept per read.
        batch_size: rows per forward pass.
        lens: ``logit`` (default) or ``tuned``: the tuned lens (Belrose et al. 2023,
            :mod:`tracekit.lenses.tuned`): each hidden state's residual goes through its learned
            affine translator before the readout; same tables, figures and summary keys.
        tuned: with ``lens: tuned``, the tuned lens (:class:`tracekit.lenses.train.TunedLensSpec`):
            ``{path: folder}`` loads a saved lens (tracekit's or the tuned-lens package's layout),
            otherwise a training config (default: train on the stdlib corpus once per model, then
            load from the cache).

    Summary keys (every one states its scope; lists ``*_by_row`` follow the ``rows`` table's
    order; ``*_by_hidden_state`` lists are indexed by hidden state, null where none is read; the
    numbers are read at each row's summary position):
        layer_convention, hidden_states, hooks: what was read.
        n_rows (= n_prompts, kept for old configs): rows run.
        final_top1_by_row: the model's own top-1 next token per row.
        mean_entropy_by_hidden_state: mean over rows of the lens entropy (nats).
        With targets (means, medians and shares over the rows that have one):
        target_by_row, target_prob_final_by_row: each row's target and its probability in the
        model's output; mean_target_prob_final: their mean; top1_accuracy_final: share of rows
        whose target is the model's top-1; emergence_hidden_state_by_row, emergence_layer_by_row,
        jump_layer_by_row: each row's landmarks (:func:`tracekit.logit_lens.landmarks`; null where
        none); share_rows_emerged: share of rows whose target is top-1 for good from some hidden
        state; median_emergence_layer: median emergence layer over the rows that emerge (null when
        none does); mean_target_prob_by_hidden_state: mean over rows of each row's own target
        probability; median_target_rank_by_hidden_state: median over rows of its vocab rank.
        With foils: logit_diff_final_by_row, mean_logit_diff_final, mean_logit_diff_by_hidden_state
        (target logit minus foil logit).
        With track: tracked (the tokens), mean_tracked_prob_final ({token: mean over rows}),
        mean_tracked_prob_by_hidden_state ({token: [mean by hidden state]}).
        Single-row results only (present only when the run has exactly one row, and then exactly
        that row's; with several rows use the keys above): final_top1, top1_by_hidden_state,
        top1_prob_by_hidden_state, entropy_by_hidden_state, and with a target: target,
        target_prob_final, target_prob_by_hidden_state, target_rank_by_hidden_state,
        target_log_prob_by_hidden_state, emergence_hidden_state, emergence_layer, jump, jump_layer.

    Raises (from :meth:`check`):
        TokenizationError: a target/foil/tracked token is not exactly one token (the message shows
            its tokenization), a position out of range, a prompt longer than the model's context.
        DatasetError: a dataset row that cannot be used (naming it), a named position a row lacks.
    """

    kind: Literal["logit_lens"] = "logit_lens"
    prompts: OptionalPrompts = Field(default_factory=list)
    dataset: Optional[DatasetSpec] = None
    target: Optional[Union[str, list[str]]] = None
    foil: Optional[Union[str, list[str]]] = None
    track: list[str] = Field(default_factory=list)
    position: Union[int, str] = "last"
    layer_convention: LayerConvention = "hidden_states"
    top_k: int = Field(default=10, ge=1, le=1000)
    batch_size: int = Field(default=8, ge=1)
    lens: Literal["logit", "tuned"] = "logit"
    tuned: Optional[TunedLensSpec] = None

    result_class = LogitLensResult
    retired = {"positions": "position", "layers": "layer_convention; layers now always means block indices"}

    @field_validator("position")
    @classmethod
    def _position(cls, v, info):  # info: pydantic ValidationInfo (unannotated: a Protocol beartype cannot check)
        try:
            pos = parse_position(v, LENS_POSITIONS)
        except Exception as e:  # noqa: BLE001 - reported with the field's path by pydantic
            raise ValueError(str(e).removeprefix("position: ")) from None
        if pos.kind == "name" and info.data.get("dataset") is None:
            raise ValueError(f"unknown position {v!r}: use last, all or a token index (BOS counted; -1 = the last); "
                             "a name (END, IO, SUBJ...) is a dataset's named position and needs a dataset whose rows "
                             "name it")
        return v

    @model_validator(mode="after")
    def _rows_fit(self):
        check_dataset_fields(self.prompts, self.dataset, self.target, self.foil)
        if self.tuned is not None and self.lens != "tuned":
            raise ValueError("tuned: a tuned lens spec is only read with lens: tuned (set lens: tuned, or drop tuned)")
        for name in ("target", "foil"):
            v = getattr(self, name)
            if isinstance(v, list) and len(v) != len(self.prompts):
                raise ValueError(f"{name}: {len(v)} tokens for {len(self.prompts)} prompt(s); a {name} list gives "
                                 f"each prompt its own answer (one per prompt). To follow the same tokens on every "
                                 f"prompt use track: {v!r}")
        pos = parse_position(self.position, LENS_POSITIONS)
        if pos.kind == "name" and self.dataset is not None and self.dataset.rows is not None:
            for i, r in enumerate(self.dataset.rows):  # inline rows: a missing name is known before any model
                if pos.text not in r.positions:
                    raise ValueError(f"position: {pos.text!r} is not a named position of dataset.rows[{i}] (its "
                                     f"positions: {sorted(r.positions) or 'none'}); name one the rows have or use "
                                     "last / all / an index")
        return self

    @property
    def targets(self) -> list[str]:
        """The ``target`` field as a list (one per prompt, or the one string)."""
        if self.target is None:
            return []
        return [self.target] if isinstance(self.target, str) else list(self.target)

    def prepare(self, model: HookedModel) -> LogitLensInputs:
        """Prepare the rows once (tokenized with BOS as the model spec says; per-row target/foil
        ids; named positions), resolve the read positions per row and the tracked tokens' ids
        (tokenizer and config only: works on a :class:`tracekit.model.ModelInfo`).

        Raises:
            TokenizationError / DatasetError: see the class docstring.
            ConfigError: a tuned lens to train with ``tuned.seq_len`` longer than the model's context.
        """
        points = tuple(lens_points(int(model.cfg.n_layers), self.layer_convention))
        # the rows through the dataset door: tokenized once, target/foil ids (a prompts' target/foil
        # error is a TokenizationError naming the field, as the notebook door's)
        data = (Rows.from_prompts(model, self.prompts, self.target, self.foil) if self.dataset is None
                else self.dataset.prepare(model, "dataset", batch_size=self.batch_size))
        track_ids = tuple(single_token_id(model, t, field=f"track[{j}]") for j, t in enumerate(self.track))
        pos = parse_position(self.position, LENS_POSITIONS)
        ids = tuple(tuple(e.ids) for e in data.examples)
        if pos.kind == "name":
            positions = tuple((i,) for i in data.position(str(pos.text), field="position"))
        else:
            positions = tuple(tuple(pos.resolve(model, e.prompt, e.ids, field="position", skip_bos=False))
                              for e in data.examples)
        summary_positions = tuple(p[0] if pos.single else len(seq) - 1 for p, seq in zip(positions, ids))
        if self.lens == "tuned":
            (self.tuned or TunedLensSpec()).check_context(model, "tuned")
        return LogitLensInputs(data, ids, positions, summary_positions, track_ids, points)

    def _run(self, model: HookedModel, inputs: LogitLensInputs, progress: bool = True) -> LogitLensResult:
        # the engine reads the prepared ids, targets and positions: nothing is tokenized again
        from ..core.progress import progress_bar

        data = inputs.data
        tuned = load_or_train_tuned_lens(model, self.tuned, progress, "tuned") if self.lens == "tuned" else None
        bar = progress_bar(total=len(data), desc=f"{self.lens} lens", unit="row", enabled=progress)

        kept = CachedActivations("the residual stream the lens read, before any tuned-lens translator")

        def engine(track: list[int], keep: Optional[CachedActivations] = None) -> list:
            return logit_lens(model, data, position=self.position, layer_convention=self.layer_convention,
                              top_k=self.top_k, batch_size=self.batch_size, progress=bar.update,
                              track=track, reads=[list(p) for p in inputs.positions],
                              translator=None if tuned is None else tuned.transform, keep=keep)

        try:  # in a sweep, steps differing only in target share one pass (tracekit.experiments.onepass)
            shared = onepass.current() if tuned is None else None
            if shared:
                kept.note = "not kept: this step shared one forward pass with other steps of a sweep"
            got = shared.lens(model, self, len(data), list(inputs.track_ids), engine) if shared else None
            lens = engine(list(inputs.track_ids), kept) if got is None else onepass.split_lens(
                got[0], got[1], len(inputs.track_ids), [e.target_id for e in data.examples])
        finally:
            bar.close()
        decode = _Decoder(model)
        has_t, has_f = data.has_targets, data.has_foils
        main, topk, toks, final, tracked, per_row = [], [], [], [], [], []
        for pi, (ex, pl) in enumerate(zip(data.examples, lens)):
            main.append(self._main_rows(pi, ex, pl, decode, has_t, has_f))
            topk.append(self._topk_rows(pi, pl, decode))
            toks.append({"prompt_idx": np.full(len(pl.ids), pi), "position": np.arange(len(pl.ids)),
                         "token": _obj(pl.tokens), "token_id": np.asarray(pl.ids, dtype=np.int64)})
            final.append(self._final_rows(pi, ex, pl, decode))
            if pl.track_ids:
                tracked.append(self._tracked_rows(pi, ex, pl))
            per_row.append(self._row_record(pi, ex, pl, inputs.summary_positions[pi], decode, has_f))
        # one DataFrame per table from concatenated columns (a frame per prompt and pd.concat cost
        # ~1 s per 256 prompts)
        rec = pd.DataFrame(per_row).drop(columns=["row_id"])
        frame = data.frame()
        frame = frame.rename(columns={c: f"extra_{c}" for c in frame.columns if c in rec.columns})
        rows = pd.concat([frame.reset_index(drop=True),
                          rec.reset_index(drop=True)], axis=1)
        for c in ("emergence_hidden_state", "emergence_layer", "jump_layer", "jump_from_hidden_state",
                  "jump_to_hidden_state"):
            rows[c] = rows[c].astype("Int64")
        tables = {"main": _frame(main), "rows": rows, "topk": _frame(topk), "tokens": _frame(toks),
                  "final": pd.DataFrame([r for part in final for r in part])}
        if tracked:
            tables["tracked"] = _frame(tracked)
        points = inputs.points
        meta = {"n_layers": int(model.cfg.n_layers), "hooks": [p.hook for p in points],
                "hidden_states": [p.hidden_state for p in points], "d_vocab": int(model.cfg.d_vocab),
                "source": data.source, "dropped": dict(data.dropped), "lens": self.lens}
        if tuned is not None:
            meta["tuned"] = {**tuned.source, "record": tuned.record, "config": tuned.config.to_dict()}
        result = LogitLensResult(self, tables, meta)
        result.activations = kept
        return result

    # ---- table shaping ------------------------------------------------------------------------
    def _main_rows(self, pi: int, ex, pl, decode, has_t: bool, has_f: bool) -> dict[str, np.ndarray]:
        """Columns of the ``main`` rows of one row (hidden state x position)."""
        H, P = pl.entropy.shape
        n = H * P
        n_real = len(pl.ids)
        out = {
            "prompt_idx": np.full(n, pi, dtype=np.int64), "row_id": np.full(n, ex.row_id, dtype=np.int64),
            "prompt": _obj([pl.prompt] * n),
            "position": np.tile(np.asarray(pl.positions, dtype=np.int64), H),
            "token": _obj([pl.tokens[p] for p in pl.positions] * H),
            "is_last": np.tile(np.asarray([p == n_real - 1 for p in pl.positions], dtype=bool), H),
            "hidden_state": np.repeat(np.asarray([p.hidden_state for p in pl.points], dtype=np.int64), P),
            "layer": np.repeat(np.asarray([p.layer for p in pl.points], dtype=np.int64), P),
            "site": np.repeat(_obj([p.site for p in pl.points]), P),
            "hook": np.repeat(_obj([p.hook for p in pl.points]), P),
            "entropy": pl.entropy.reshape(-1).numpy(),
            "top1": _obj(decode(pl.topk_ids[..., 0].reshape(-1))),
            "top1_id": pl.topk_ids[..., 0].reshape(-1).numpy(),
            "top1_prob": pl.topk_probs[..., 0].reshape(-1).numpy(),
            "target": np.full(n, ex.row.target if pl.target_ids else None, dtype=object),
        }
        if not has_t:
            return out
        if pl.target_ids:
            lp = pl.target_log_prob[..., 0].reshape(-1).numpy()
            rank = pl.target_rank[..., 0].reshape(-1).numpy().astype(np.int64)
        else:
            lp, rank = np.full(n, np.nan, dtype=np.float32), np.full(n, -1, dtype=np.int64)
        out.update({"target_id": np.full(n, pl.target_id if pl.target_ids else -1, dtype=np.int64),
                    "prob": np.exp(lp), "log_prob": lp, "vocab_rank": rank})
        if has_f:
            flp = (pl.foil_log_prob[..., 0].reshape(-1).numpy() if pl.foil_ids
                   else np.full(n, np.nan, dtype=np.float32))
            out.update({"foil": np.full(n, ex.row.foil if pl.foil_ids else None, dtype=object),
                        "foil_id": np.full(n, pl.foil_ids[0] if pl.foil_ids else -1, dtype=np.int64),
                        "foil_prob": np.exp(flp), "foil_log_prob": flp, "logit_diff": lp - flp})
        return out

    def _tracked_rows(self, pi: int, ex, pl) -> dict[str, np.ndarray]:
        """Columns of the ``tracked`` rows of one row (hidden state x position x tracked token)."""
        H, P, K = pl.track_log_prob.shape
        n = H * P * K
        n_real = len(pl.ids)
        lp = pl.track_log_prob.reshape(-1).numpy()
        return {
            "prompt_idx": np.full(n, pi, dtype=np.int64), "row_id": np.full(n, ex.row_id, dtype=np.int64),
            "position": np.tile(np.repeat(np.asarray(pl.positions, dtype=np.int64), K), H),
            "is_last": np.tile(np.repeat(np.asarray([p == n_real - 1 for p in pl.positions], dtype=bool), K), H),
            "hidden_state": np.repeat(np.asarray([p.hidden_state for p in pl.points], dtype=np.int64), P * K),
            "layer": np.repeat(np.asarray([p.layer for p in pl.points], dtype=np.int64), P * K),
            "hook": np.repeat(_obj([p.hook for p in pl.points]), P * K),
            "tracked_token": np.tile(_obj(list(self.track)), H * P),
            "tracked_id": np.tile(np.asarray(pl.track_ids, dtype=np.int64), H * P),
            "prob": np.exp(lp), "log_prob": lp,
            "vocab_rank": pl.track_rank.reshape(-1).numpy().astype(np.int64),
        }

    def _topk_rows(self, pi: int, pl, decode) -> dict[str, np.ndarray]:
        """Columns of the ``topk`` rows of one prompt (hidden state x position x k)."""
        H, P, K = pl.topk_ids.shape
        return {
            "prompt_idx": np.full(H * P * K, pi, dtype=np.int64),
            "position": np.tile(np.repeat(np.asarray(pl.positions, dtype=np.int64), K), H),
            "hidden_state": np.repeat(np.asarray([p.hidden_state for p in pl.points], dtype=np.int64), P * K),
            "k": np.tile(np.arange(1, K + 1), H * P),
            "token": _obj(decode(pl.topk_ids.reshape(-1))),
            "token_id": pl.topk_ids.reshape(-1).numpy(),
            "prob": pl.topk_probs.reshape(-1).numpy(),
        }

    def _final_rows(self, pi: int, ex, pl, decode) -> list[dict]:
        """The ``final`` rows of one row: the model's own output at each read position."""
        n_real = len(pl.ids)
        out = []
        for j, p in enumerate(pl.positions):
            row = {"prompt_idx": pi, "row_id": ex.row_id, "position": p, "is_last": p == n_real - 1,
                   "top1": decode(pl.final_topk_ids[j, :1])[0], "top1_prob": float(pl.final_topk_probs[j, 0]),
                   "topk_tokens": decode(pl.final_topk_ids[j]), "topk_probs": pl.final_topk_probs[j].tolist(),
                   "target": ex.row.target if pl.target_ids else None,
                   "target_prob": float(pl.final_log_prob[j, 0].exp()) if pl.target_ids else float("nan"),
                   "target_vocab_rank": int(pl.final_rank[j, 0]) if pl.target_ids else -1}
            if self.track:
                row["tracked_tokens"] = list(self.track)
                row["tracked_probs"] = pl.final_track_log_prob[j].exp().tolist()
            out.append(row)
        return out

    def _row_record(self, pi: int, ex, pl, at: int, decode, has_f: bool) -> dict:
        """The ``rows`` table's numbers for one row, read at its summary position ``at``."""
        j = pl.positions.index(at)
        hs = [p.hidden_state for p in pl.points]
        rec: dict[str, Any] = {
            "row_id": ex.row_id, "prompt_idx": pi, "position": at, "token": pl.tokens[at],
            "target_id": pl.target_id if pl.target_ids else -1,
            "final_top1": decode(pl.final_topk_ids[j, :1])[0], "final_top1_prob": float(pl.final_topk_probs[j, 0]),
            "target_prob_final": np.nan, "target_log_prob_final": np.nan, "target_vocab_rank_final": -1,
            "emergence_hidden_state": None, "emergence_layer": None, "jump_layer": None,
            "jump_from_hidden_state": None, "jump_to_hidden_state": None, "jump_from_prob": np.nan,
            "jump_to_prob": np.nan, "jump_gain": np.nan,
        }
        if pl.target_ids:
            lp_final = float(pl.final_log_prob[j, 0])
            probs = pl.target_log_prob[:, j, 0].exp().tolist()
            ranks = [int(r) for r in pl.target_rank[:, j, 0].tolist()]
            lm = landmarks(hs, probs, ranks)
            rec.update({"target_prob_final": float(np.exp(lp_final)), "target_log_prob_final": lp_final,
                        "target_vocab_rank_final": int(pl.final_rank[j, 0]),
                        "emergence_hidden_state": lm["emergence_hidden_state"],
                        "emergence_layer": lm["emergence_layer"], "jump_layer": lm["jump_layer"]})
            if lm["jump"]:
                jp = lm["jump"]
                rec.update({"jump_from_hidden_state": jp["from_hidden_state"], "jump_to_hidden_state": jp["to_hidden_state"],
                            "jump_from_prob": jp["from_prob"], "jump_to_prob": jp["to_prob"], "jump_gain": jp["gain"]})
        if has_f:
            rec["foil_id"] = pl.foil_ids[0] if pl.foil_ids else -1
            flp = float(pl.final_foil_log_prob[j, 0]) if pl.foil_ids else np.nan
            rec["foil_prob_final"] = float(np.exp(flp))
            rec["logit_diff_final"] = rec["target_log_prob_final"] - flp
        return rec


def _obj(items) -> np.ndarray:
    """A 1-D object array of ``items`` (strings stay Python strings, as in a DataFrame column)."""
    out = np.empty(len(items), dtype=object)
    out[:] = list(items)
    return out


def _frame(parts: list[dict[str, np.ndarray]]) -> pd.DataFrame:
    """One DataFrame from per-prompt column dicts (same keys), columns concatenated once."""
    return pd.DataFrame({k: np.concatenate([p[k] for p in parts]) for k in parts[0]})


class _Decoder:
    """Token id -> string, memoised (the same ids recur across hidden states)."""

    def __init__(self, model: HookedModel):
        self.model = model
        self.memo: dict[int, str] = {}

    def __call__(self, ids) -> list[str]:
        out = []
        for i in (int(x) for x in ids.reshape(-1).tolist()):
            s = self.memo.get(i)
            if s is None:
                s = self.memo[i] = str_tokens(self.model, [i])[0]
            out.append(s)
        return out

"""``kind: patchscope`` -- what does a hidden state say when patched into a target prompt?

The method, its numbering and its cost live in :mod:`tracekit.lenses.patchscope` (Ghandeharioun et
al. 2024); this module validates the config, prepares the rows once (:mod:`tracekit.dataset`),
calls the engine per row and shapes tables, summary, report and figures.

Rows: ``prompts`` (+ an optional ``target``: a string is every prompt's, a list one per prompt) or a
``dataset`` whose rows carry their own target and named positions (``SUBJ``, ``END``). Each row's
hidden states ``hidden_states`` at its ``position`` are patched into ``target_prompt`` (default the
paper's identity prompt) at ``target_position`` and ``target_hidden_state`` (default ``same``).

Tables:

* ``main``: one row per dataset row x hidden state: ``prompt_idx``, ``row_id``, ``prompt``,
  ``position``, ``token`` (the source token decoded), ``hidden_state``, ``target_hidden_state``,
  ``top1``, ``top1_id``, ``top1_prob``, ``target``, ``target_id`` (-1: none), ``target_prob``,
  ``target_log_prob``, ``target_rank`` (1 = top; -1 / NaN without a target), ``generated`` (the
  greedily generated text), ``generated_ids``;
* ``top_tokens``: row x hidden state x k: ``k`` (1 = top), ``token``, ``token_id``, ``prob``;
* ``rows``: one row per dataset row (:meth:`tracekit.dataset.PreparedDataset.frame` columns) plus
  ``prompt_idx``, ``position``, ``token``, ``target_id``, ``first_top1_hidden_state`` (the first
  hidden state whose Patchscope puts the row's target on top; NA when none does).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Optional, Union, cast

import numpy as np
import pandas as pd
from pydantic import Field, field_validator, model_validator

from .. import plotting
from ..core.errors import PatchscopeError, TokenizationError
from ..dataset import DatasetSpec, PreparedDataset
from ..dla import DLA_POSITION_FORMS, as_position, row_positions
from ..lenses.patchscope import IDENTITY_PROMPT, patchscope, target_tokens
from ..model.context import check_generation
from ..model.info import HookedModel
from ..tokens import PositionSpec, str_tokens
from .base import Experiment, OptionalPrompts, Result, check_dataset_fields, kind_dataset, register, row_frame
from .frames import column, select, tuples

__all__ = ["Patchscope", "PatchscopeInputs", "PatchscopeResult"]

_HS_LABEL = "source hidden state (0 = embeddings, h = output of block h-1)"


@dataclass(frozen=True)
class PatchscopeInputs:
    """What :meth:`Patchscope.prepare` builds once: the prepared rows, each row's source position,
    the source hidden states, the target prompt's ids, its patched position (>= 0) and the target
    hidden state (None: each source hidden state's own)."""

    data: PreparedDataset
    positions: tuple[int, ...]
    hidden_states: tuple[int, ...]
    target_ids: tuple[int, ...]
    target_position: int
    target_hidden_state: Optional[int]

    @property
    def ids(self) -> tuple[tuple[int, ...], ...]:
        """Each row's token ids (BOS counted), as prepared once."""
        return tuple(e.ids for e in self.data.examples)


def _none_int(v) -> Optional[int]:
    return None if v is None or pd.isna(v) else int(v)


class PatchscopeResult(Result):
    """Result of :class:`Patchscope`: tables ``main``, ``top_tokens``, ``rows`` (module docstring).

    Summary keys: ``hidden_states``, ``n_rows``, ``target_prompt``, ``target_position``,
    ``target_hidden_state``, ``top1_by_row`` (per row, the Patchscope's top-1 per hidden state),
    ``generated_by_row`` (per row, the generated text per hidden state); with targets
    ``target_by_row``, ``first_top1_hidden_state_by_row`` (None: never top-1),
    ``mean_target_prob_by_hidden_state``; with one row also that row's ``top1_by_hidden_state``,
    ``generated_by_hidden_state``, and with a target ``target``, ``target_prob_by_hidden_state``,
    ``target_rank_by_hidden_state``, ``first_top1_hidden_state``.
    """

    config: "Patchscope"
    main_table = "main"
    table_names = ("main", "top_tokens", "rows")
    null_reasons = {
        "first_top1_hidden_state": "the row's target is top-1 at no hidden state under the Patchscope",
        "first_top1_hidden_state_by_row": "that row's target is top-1 at no hidden state under the Patchscope (or "
                                          "the row has no target)",
    }

    def _rows(self) -> pd.DataFrame:
        return self.tables["rows"].sort_values("prompt_idx")

    @property
    def has_targets(self) -> bool:
        return bool((self.tables["rows"]["target_id"] >= 0).any())

    def summary(self) -> dict:
        main = self.tables["main"].sort_values(["prompt_idx", "hidden_state"])
        rows = self._rows()
        hs = sorted(int(h) for h in main["hidden_state"].unique())
        per = {int(cast(int, pi)): g for pi, g in main.groupby("prompt_idx")}
        out: dict[str, Any] = {
            "hidden_states": hs,
            "n_rows": len(rows),
            "target_prompt": self.meta.get("target_prompt"),
            "target_position": self.meta.get("target_position"),
            "target_hidden_state": self.meta.get("target_hidden_state"),
            "top1_by_row": [per[int(pi)]["top1"].tolist() for pi in rows["prompt_idx"]],
            "generated_by_row": [per[int(pi)]["generated"].tolist() for pi in rows["prompt_idx"]],
        }
        if self.has_targets:
            t = select(main, column(main, "target_id") >= 0)
            out.update({
                "target_by_row": [None if tid < 0 else tg for tg, tid in zip(rows["target"], rows["target_id"])],
                "first_top1_hidden_state_by_row": [_none_int(v) for v in rows["first_top1_hidden_state"]],
                "mean_target_prob_by_hidden_state": [round(float(v), 6) for v in
                                                     cast(pd.Series, t.groupby("hidden_state")["target_prob"].mean()).reindex(hs)],
            })
        if len(rows) == 1:
            g = per[int(rows["prompt_idx"].iloc[0])]
            out["top1_by_hidden_state"] = g["top1"].tolist()
            out["generated_by_hidden_state"] = g["generated"].tolist()
            if int(rows["target_id"].iloc[0]) >= 0:
                out.update({
                    "target": rows["target"].iloc[0],
                    "target_prob_by_hidden_state": [round(float(v), 6) for v in g["target_prob"]],
                    "target_rank_by_hidden_state": [int(v) for v in g["target_rank"]],
                    "first_top1_hidden_state": _none_int(rows["first_top1_hidden_state"].iloc[0]),
                })
        return out

    def report(self) -> str:
        cfg = self.config
        main = self.tables["main"].sort_values(["prompt_idx", "hidden_state"])
        lines = [f"patchscope [{cfg.step_name}]: target prompt {self.meta.get('target_prompt')!r} patched at token "
                 f"{self.meta.get('target_position')} ({self.meta.get('target_token')!r}), target hidden state "
                 f"{cfg.target_hidden_state}; h = source hidden state (0 = embeddings, h = output of block h-1)"]
        for r in tuples(self._rows().head(10)):
            g = select(main, column(main, "prompt_idx") == r.prompt_idx)
            has_t = int(r.target_id) >= 0
            table = [[h.hidden_state, repr(h.top1), f"{h.top1_prob:.4f}"]
                     + ([f"{h.target_prob:.4%}", h.target_rank] if has_t else []) + [repr(h.generated)]
                     for h in tuples(g)]
            headers = ["h", "top-1", "p(top-1)"] + ([f"p({r.target!r})", "rank"] if has_t else []) + ["generated"]
            lines.append(f"row {r.row_id}: {r.prompt!r} at position {r.position} ({r.token!r})")
            lines.append(plotting.text_table(table, headers))
            if has_t:
                f = _none_int(r.first_top1_hidden_state)
                lines.append(f"first hidden state with {r.target!r} top-1: {'never' if f is None else f}")
        if len(self._rows()) > 10:
            lines.append(f"... {len(self._rows()) - 10} more rows (table 'rows')")
        return "\n".join(lines)

    def figures(self) -> dict:
        plt = plotting.plt()
        main = self.tables["main"].sort_values(["prompt_idx", "hidden_state"])
        rows = self._rows()
        figs = {}
        if self.has_targets:
            fig, ax = plt.subplots(figsize=(7, 4))
            t = select(main, column(main, "target_id") >= 0)
            series = {f"row {r.row_id}: {plotting.short_text(r.prompt, 28)} → {r.target!r}":
                      column(select(t, column(t, "prompt_idx") == r.prompt_idx), "target_prob").to_numpy()
                      for r in tuples(select(rows, column(rows, "target_id") >= 0))}
            x = sorted(column(t, "hidden_state").unique().tolist())
            plotting.curves(ax, x, series)
            ax.set_xlabel(_HS_LABEL, fontsize=8)
            ax.set_ylabel("p(row's target) under the Patchscope")
            ax.set_title("Patchscope: target probability by hidden state")
            ax.set_ylim(-0.02, 1.02)
            ax.grid(alpha=.3)
            fig.tight_layout()
            figs["target_by_hidden_state"] = fig
        shown = rows.head(40)
        hs = sorted(main["hidden_state"].unique().tolist())
        grid = np.full((len(shown), len(hs)), np.nan)
        text = [["" for _ in hs] for _ in range(len(shown))]
        for i, r in enumerate(tuples(shown)):
            g = select(main, column(main, "prompt_idx") == r.prompt_idx).set_index("hidden_state")
            for j, h in enumerate(hs):
                grid[i, j] = g.loc[h, "top1_prob"]
                text[i][j] = repr(g.loc[h, "top1"])[1:-1]
        ylab = [f"row {r.row_id}: {plotting.short_text(r.prompt, 24)}" for r in tuples(shown)]
        figs["top1_grid"] = plotting.heatmap(grid, hs, ylab, vmin=0, vmax=1,
                                             cell_text=text, title="Patchscope top-1 token (colour: its probability)",
                                             xlabel=_HS_LABEL, colorbar_label="p(top-1)")
        return figs


@register
class Patchscope(Experiment):
    """Patchscopes (Ghandeharioun et al. 2024): each row's hidden states at one position, patched into
    a target prompt, read as a next-token distribution and a short greedy generation.

    Fields:
        prompts: one string or a list (one row each); or
        dataset: the rows (:class:`tracekit.dataset.DatasetSpec`), each with an optional target and named
            positions (``SUBJ``, ``END``).
        target: optional, with ``prompts``: a one-token string for every prompt or a list with one per
            prompt; its probability and vocab rank are reported per hidden state.
        position: the source position: an int (BOS counted; negative from the end), ``last``
            (default), ``token:<text>``, or a named position of the dataset's rows (``SUBJ``, ``END``).
        hidden_states: ``all`` (0..n_layers, default) or a list of hidden states.
        target_prompt: the prompt patched into (default the identity prompt
            ``cat -> cat; 1135 -> 1135; hello -> hello; ?``), tokenized with the model's BOS convention.
        target_position: the target token overwritten (BOS counted; default -1, the last token).
        target_hidden_state: ``same`` (default: each source hidden state's own) or one hidden state.
        top_k: top tokens kept per hidden state.
        n_generate: tokens generated greedily with the patch in place (0: none).
        batch_size: patches per batch, or ``auto``.

    Raises:
        TokenizationError: a target that is not one token, a position not in a prompt or the target prompt.
        PatchscopeError: hidden states or target hidden state outside ``0..n_layers``.
        ConfigError: ``target_prompt`` then ``n_generate`` tokens longer than the model's context.
        MethodRefused: a model whose residual stream is not a token's whole state (blocks with
            token-dependent side inputs).
    """

    kind: Literal["patchscope"] = "patchscope"
    prompts: OptionalPrompts = Field(default_factory=list)
    dataset: Optional[DatasetSpec] = None
    target: Union[str, list[str], None] = None
    position: PositionSpec = "last"
    hidden_states: Union[Literal["all"], list[int]] = "all"
    target_prompt: str = Field(default=IDENTITY_PROMPT, min_length=1)
    target_position: int = -1
    target_hidden_state: Union[Literal["same"], int] = "same"
    top_k: int = Field(default=10, ge=1)
    n_generate: int = Field(default=5, ge=0, le=64)
    batch_size: Union[int, Literal["auto"]] = "auto"

    result_class = PatchscopeResult

    @field_validator("position")
    @classmethod
    def _position(cls, v):
        as_position(v, "position", DLA_POSITION_FORMS)
        return v

    @field_validator("hidden_states")
    @classmethod
    def _hidden_states(cls, v):
        if isinstance(v, list) and (not v or any(isinstance(h, bool) or h < 0 for h in v)):
            raise ValueError("give 'all' or a non-empty list of hidden states 0..n_layers (0 = embeddings, h = output "
                             "of block h-1)")
        return v

    @field_validator("batch_size")
    @classmethod
    def _batch(cls, v):
        if isinstance(v, int) and v < 1:
            raise ValueError("batch_size must be 'auto' or a positive integer (patches per batch)")
        return v

    @model_validator(mode="after")
    def _rows(self):
        check_dataset_fields(self.prompts, self.dataset, self.target, None)
        return self

    def prepare(self, model: HookedModel) -> PatchscopeInputs:
        """The rows prepared once (prompts tokenized, target ids, named positions), each row's source
        position, the hidden states and the tokenized target prompt (tokenizer and config only).

        Raises:
            TokenizationError / DatasetError / PatchscopeError: see the class docstring.
        """
        data = kind_dataset(model, self.prompts, self.dataset, self.target)
        positions = row_positions(model, data, self.position)
        n = int(model.cfg.n_layers)
        hs = list(range(n + 1)) if self.hidden_states == "all" else list(self.hidden_states)
        for i, h in enumerate(hs):
            if not 0 <= h <= n:
                raise PatchscopeError(f"hidden_states[{i}]: {h} out of range for a {n}-layer model (0 = embeddings .. "
                                    f"{n} = output of the last block)")
        th = None if self.target_hidden_state == "same" else int(self.target_hidden_state)
        if th is not None and not 0 <= th <= n:
            raise PatchscopeError(f"target_hidden_state: {th} out of range for a {n}-layer model (0..{n}, or 'same')")
        tgt = target_tokens(model, self.target_prompt, "target_prompt")
        if not -len(tgt) <= self.target_position < len(tgt):
            raise TokenizationError(f"target_position: {self.target_position} is out of range for the target prompt's "
                                    f"{len(tgt)} tokens {str_tokens(model, tgt)} (use 0..{len(tgt) - 1} or -1)")
        check_generation(model, len(tgt), self.n_generate, "n_generate", "target_prompt")
        return PatchscopeInputs(data, tuple(positions), tuple(hs), tuple(tgt), self.target_position % len(tgt), th)

    def _run(self, model: HookedModel, inputs: PatchscopeInputs, progress: bool = True) -> PatchscopeResult:
        data = inputs.data
        tok = model.tokenizer
        main, top, recs = [], [], []
        for pi, (e, p) in enumerate(zip(data.examples, inputs.positions)):
            tid = -1 if e.target_id is None else int(e.target_id)
            has_t = tid >= 0
            out = patchscope(model, e.ids, [p], inputs.hidden_states, target_ids=inputs.target_ids,
                             target_hidden_state=inputs.target_hidden_state, target_position=inputs.target_position,
                             top_k=self.top_k, n_generate=self.n_generate, batch_size=self.batch_size,
                             log_probs=has_t)
            first = None
            token = tok.decode([int(e.ids[p])])
            for i, h in enumerate(out.hidden_states):
                ids_k = out.topk_ids[i, 0].tolist()
                gen = out.generated[i, 0].tolist()
                rec = {"prompt_idx": pi, "row_id": e.row_id, "prompt": e.prompt, "position": p, "token": token,
                       "hidden_state": h, "target_hidden_state": out.target_hidden_states[i],
                       "top1": tok.decode([ids_k[0]]), "top1_id": ids_k[0],
                       "top1_prob": float(out.topk_probs[i, 0, 0]), "target": e.row.target if has_t else None,
                       "target_id": tid, "target_prob": float("nan"),
                       "target_log_prob": float("nan"), "target_rank": -1, "generated": tok.decode(gen),
                       "generated_ids": gen}
                if has_t:
                    assert out.log_probs is not None
                    lp = out.log_probs[i, 0]
                    own = lp[tid]
                    rank = int((lp > own).sum()) + 1
                    rec.update(target_prob=float(own.exp()), target_log_prob=float(own), target_rank=rank)
                    if rank == 1 and first is None:
                        first = h
                main.append(rec)
                top += [{"prompt_idx": pi, "row_id": e.row_id, "hidden_state": h, "k": j + 1,
                         "token": tok.decode([t]), "token_id": t, "prob": float(out.topk_probs[i, 0, j])}
                        for j, t in enumerate(ids_k)]
            recs.append({"prompt_idx": pi, "position": p, "token": token,
                         "target_id": tid, "first_top1_hidden_state": first})
        rows = row_frame(data, recs)
        rows["first_top1_hidden_state"] = rows["first_top1_hidden_state"].astype("Int64")
        tables = {"main": pd.DataFrame(main), "top_tokens": pd.DataFrame(top), "rows": rows}
        meta = {"n_layers": int(model.cfg.n_layers), "target_prompt": self.target_prompt,
                "target_ids": list(inputs.target_ids), "target_position": inputs.target_position,
                "target_token": tok.decode([inputs.target_ids[inputs.target_position]]),
                "target_hidden_state": self.target_hidden_state,
                "dataset": {"source": data.source, "dropped": dict(data.dropped), "n_rows": len(data)},
                "readout": "next-token distribution at the target prompt's last token; generation greedy, the patch "
                           "kept in place"}
        return PatchscopeResult(self, tables, meta)


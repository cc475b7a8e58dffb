# pyright: reportAttributeAccessIssue=false, reportArgumentType=false, reportCallIssue=false, reportGeneralTypeIssues=false, reportIndexIssue=false, reportOptionalMemberAccess=false, reportOptionalSubscript=false, reportOptionalOperand=false, reportReturnType=false, reportAssignmentType=false, reportOperatorIssue=false
"""``kind: logit_lens`` -- at which layer does the answer appear in the residual stream?

The method and its numbering live in :mod:`tracekit.logit_lens` (notebook-callable); this module
validates the config, calls the engine and shapes tables, summary, report and figures.

Tables:

* ``main``: one row per prompt x position x hidden state x target (without targets: per prompt x
  position x hidden state): ``hidden_state`` (the lens axis), ``layer`` (block index), ``site``
  (``resid_pre``/``resid_post``), ``hook``, ``prob``, ``log_prob``, ``rank``, ``entropy``, ``top1``...;
* ``topk``: prompt x position x hidden state x k;
* ``tokens``: every prompt's tokenization (BOS included when prepended);
* ``final``: the model's own output distribution (top-k, targets) at each read position.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Optional, Union

import numpy as np
import pandas as pd
from pydantic import Field, field_validator

from .. import plotting
from ..logit_lens import LENS_POSITIONS, LayerConvention, LensPoint, landmarks, lens_points, logit_lens
from ..tokens import parse_position, single_token_id, str_tokens
from .base import Experiment, Prompts, Result, encode_prompts, register

__all__ = ["LogitLens", "LogitLensInputs", "LogitLensResult"]

_HS_LABEL = "hidden state (0 = embeddings, h = output of block h-1)"


@dataclass(frozen=True)
class LogitLensInputs:
    """What :meth:`LogitLens.prepare` builds once: per prompt its token ids (BOS included when
    prepended) and the positions read; the targets' token ids; the hidden states read."""

    ids: tuple[tuple[int, ...], ...]
    positions: tuple[tuple[int, ...], ...]
    target_ids: tuple[int, ...]
    points: tuple[LensPoint, ...]


class LogitLensResult(Result):
    """Result of :class:`LogitLens`: tables ``main``, ``topk``, ``tokens``, ``final``."""

    config: "LogitLens"
    main_table = "main"
    #: Keys of summary() (pipelines check references against them before any model loads).
    summary_keys = ("layer_convention", "hidden_states", "hooks", "n_prompts", "top1_by_hidden_state",
                    "top1_prob_by_hidden_state", "entropy_by_hidden_state", "final_top1", "targets", "target",
                    "target_prob_final", "target_prob_by_hidden_state", "target_rank_by_hidden_state",
                    "target_log_prob_by_hidden_state", "emergence_hidden_state", "emergence_layer", "jump",
                    "jump_layer", "per_prompt", "emergence_hidden_state_by_prompt")
    table_names = ("main", "topk", "tokens", "final")
    #: Why a summary value can be null (quoted when a pipeline reference resolves to null).
    null_reasons = {
        "emergence_layer": "the target never stays top-1 through the last hidden state read (or does so only from "
                           "the embeddings), so there is no emergence layer",
        "emergence_hidden_state": "the target never stays top-1 through the last hidden state read",
        "jump_layer": "the largest gain is into the embeddings or only one hidden state was read",
        "jump": "only one hidden state was read",
        "target_prob_final": "no target was given",
    }

    def _last_rows(self) -> pd.DataFrame:
        df = self.tables["main"]
        return df[df["is_last"]]

    def _by_hidden_state(self, values: dict) -> list:
        """A list indexed by hidden state (0..n_layers), None where the convention reads none."""
        n = int(self.meta.get("n_layers", 0)) + 1
        return [values.get(h) for h in range(n)]

    def summary(self) -> dict:
        df = self._last_rows()
        cfg = self.config
        hs = sorted(df["hidden_state"].unique().tolist())
        first = df[df["prompt_idx"] == 0].drop_duplicates("hidden_state").sort_values("hidden_state")
        out: dict[str, Any] = {
            "layer_convention": cfg.layer_convention,
            "hidden_states": hs,
            "hooks": first["hook"].tolist(),
            "n_prompts": int(df["prompt_idx"].nunique()),
            "top1_by_hidden_state": self._by_hidden_state(dict(zip(first["hidden_state"], first["top1"]))),
            "top1_prob_by_hidden_state": self._by_hidden_state(
                dict(zip(first["hidden_state"], first["top1_prob"].round(6)))),
            "entropy_by_hidden_state": self._by_hidden_state(
                dict(zip(first["hidden_state"], first["entropy"].round(6)))),
        }
        fin = self.tables["final"]
        fin = fin[fin["is_last"]]
        out["final_top1"] = fin[fin["prompt_idx"] == 0]["top1"].iloc[0]
        if "target" not in df.columns or df["target"].isna().all():
            return out
        targets = df["target"].dropna().unique().tolist()
        out["targets"] = targets
        per_prompt = []
        for (pi, tgt), g in df.groupby(["prompt_idx", "target"], sort=True):
            g = g.sort_values("hidden_state")
            f = fin[(fin["prompt_idx"] == pi) & (fin["target"] == tgt)]
            probs = g["prob"].round(6).tolist()
            ranks = g["rank"].astype(int).tolist()
            rec = {"prompt_idx": int(pi), "target": tgt,
                   "target_prob_final": float(f["target_prob"].iloc[0]),
                   "target_prob_by_hidden_state": self._by_hidden_state(dict(zip(g["hidden_state"], probs))),
                   "target_rank_by_hidden_state": self._by_hidden_state(dict(zip(g["hidden_state"], ranks))),
                   "target_log_prob_by_hidden_state": self._by_hidden_state(
                       dict(zip(g["hidden_state"], g["log_prob"].round(5)))),
                   **landmarks(g["hidden_state"].tolist(), probs, ranks)}
            per_prompt.append(rec)
        head = [p for p in per_prompt if p["target"] == targets[0]]
        if len(head) == 1:
            out.update({k: v for k, v in head[0].items() if k != "prompt_idx"})
        else:
            out["target"] = targets[0]
            out["target_prob_final"] = float(np.mean([p["target_prob_final"] for p in head]))
            P = np.array([[np.nan if v is None else v for v in p["target_prob_by_hidden_state"]] for p in head])
            R = np.array([[np.nan if v is None else v for v in p["target_rank_by_hidden_state"]] for p in head])
            out["target_prob_by_hidden_state"] = [None if np.isnan(v) else round(float(v), 6)
                                                  for v in np.nanmean(P, 0)] if len(P) else []
            out["target_rank_by_hidden_state"] = [None if np.isnan(v) else float(v) for v in np.nanmedian(R, 0)]
            out["emergence_hidden_state_by_prompt"] = [p["emergence_hidden_state"] for p in head]
            em = [p["emergence_hidden_state"] for p in head]
            out["emergence_hidden_state"] = None if any(e is None for e in em) else max(em)
            out["emergence_layer"] = (out["emergence_hidden_state"] - 1) if out["emergence_hidden_state"] else None
            mean_curve = [v for v in out["target_prob_by_hidden_state"]]
            read = [h for h, v in enumerate(mean_curve) if v is not None]
            lm = landmarks(read, [mean_curve[h] for h in read], [2] * len(read))
            out["jump"], out["jump_layer"] = lm["jump"], lm["jump_layer"]
        if len(per_prompt) > 1:
            out["per_prompt"] = per_prompt
        return out

    def report(self) -> str:
        """Per-hidden-state table of the first prompt's last position (and first target, if any)."""
        df = self._last_rows()
        df = df[df["prompt_idx"] == 0]
        has_t = "target" in df.columns and df["target"].notna().any()
        if has_t:
            df = df[df["target"] == df["target"].dropna().iloc[0]]
        df = df.sort_values("hidden_state")
        rows = []
        for r in df.itertuples():
            row = [r.hidden_state, r.hook, repr(r.top1), f"{r.top1_prob:.4f}"]
            if has_t:
                row += [f"{r.prob:.4%}", r.rank]
            rows.append(row)
        headers = ["h", "hook", "top-1", "p(top-1)"] + ([f"p({df['target'].iloc[0]!r})", "rank"] if has_t else [])
        lines = [f"logit lens [{self.config.step_name}] {self.config.layer_convention} "
                 f"(h = hidden state: 0 = embeddings, h = output of block h-1) prompt 0: {df['prompt'].iloc[0]!r}",
                 plotting.text_table(rows, headers, align=">" + "<" + ">" * (len(headers) - 2))]
        fin = self.tables["final"]
        fin = fin[(fin["prompt_idx"] == 0) & fin["is_last"]]
        line = f"model output top-1: {fin['top1'].iloc[0]!r} ({fin['top1_prob'].iloc[0]:.4%})"
        if has_t:
            t = df["target"].iloc[0]
            fin_t = fin[fin["target"] == t]
            lm = landmarks(df["hidden_state"].tolist(), df["prob"].tolist(), df["rank"].astype(int).tolist())
            em = lm["emergence_hidden_state"]
            line += f"; p({t!r}) = {fin_t['target_prob'].iloc[0]:.4%}"
            line += (f"; emergence: hidden state {em} (output of block {em - 1})" if em else "; never top-1 for good")
            if lm["jump"]:
                j = lm["jump"]
                line += (f"; largest jump: h{j['from_hidden_state']} -> h{j['to_hidden_state']} "
                         f"({j['from_prob']:.2%} -> {j['to_prob']:.2%}, block {j['layer']})")
        lines.append(line)
        return "\n".join(lines)

    def figures(self) -> dict:
        plt = plotting.plt()
        figs = {}
        df = self._last_rows()
        if "target" in df.columns and df["target"].notna().any():
            fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
            many = df["prompt_idx"].nunique() > 1
            probs, ranks = {}, {}
            x = sorted(df["hidden_state"].unique().tolist())
            for (pi, tgt), g in df.groupby(["prompt_idx", "target"]):
                g = g.set_index("hidden_state").reindex(x)
                lab = f"{tgt!r}" + (f" (prompt {pi})" if many else "")
                probs[lab] = g["prob"].to_numpy()
                ranks[lab] = g["rank"].to_numpy(dtype=float)
            plotting.curves(a1, x, probs)
            plotting.curves(a2, x, ranks)
            a1.set_xlabel(_HS_LABEL, fontsize=8); a1.set_ylabel("target probability")
            a1.set_title("Logit lens: target probability"); a1.set_ylim(-0.02, 1.02)
            a2.set_yscale("log"); a2.invert_yaxis(); a2.set_xlabel(_HS_LABEL, fontsize=8)
            a2.set_ylabel("target rank (1 = top)"); a2.set_title("target rank (log scale)")
            a1.grid(alpha=.3); a2.grid(alpha=.3)
            fig.tight_layout()
            figs["target_by_layer"] = fig

        m = self.tables["main"]
        m0 = m[m["prompt_idx"] == 0]
        if "target" in m0.columns and m0["target"].notna().any():
            m0 = m0[m0["target"] == m0["target"].dropna().iloc[0]]
        pos = sorted(m0["position"].unique().tolist())
        hs = sorted(m0["hidden_state"].unique().tolist())
        grid = np.full((len(hs), len(pos)), np.nan)
        labels = [["" for _ in pos] for _ in hs]
        hi = {h: i for i, h in enumerate(hs)}
        pj = {p: j for j, p in enumerate(pos)}
        for r in m0.itertuples():
            grid[hi[r.hidden_state], pj[r.position]] = r.top1_prob
            labels[hi[r.hidden_state]][pj[r.position]] = r.top1
        toks = self.tables["tokens"]
        toks0 = toks[toks["prompt_idx"] == 0].set_index("position")["token"]
        figs["top1_grid"] = plotting.heatmap(
            grid, [repr(toks0.get(p, "?"))[1:-1][:12] for p in pos], hs, vmin=0, vmax=1, cell_text=labels,
            title="Logit lens: top-1 next token (colour = its probability)",
            xlabel="input token (position)", ylabel=_HS_LABEL)
        return figs


@register
class LogitLens(Experiment):
    """Logit lens over prompts: per hidden state, target probability / log-prob / rank, entropy, top-k.

    Method: nostalgebraist 2020; tuned-lens ``LogitLens``. Engine: :func:`tracekit.logit_lens.logit_lens`.

    Fields:
        prompts: one string or a list (batched with padding; each prompt's own tokens are read).
        target: a token string or list of them (each exactly one token, leading space included),
            tracked at every read position; optional.
        position: ``last`` (each prompt's last token), ``all`` (the classic grid picture) or a token
            index (BOS counted; negative from the end).
        layer_convention: which hidden states are read: ``hidden_states`` (0 = embeddings ..
            n_layers = the output; default), ``resid_post`` (block outputs 1..n_layers) or
            ``resid_pre`` (block inputs 0..n_layers-1). Tables always carry ``hidden_state``,
            ``layer`` (block index) and ``hook``.
        top_k: number of top tokens kept per read.
        batch_size: prompts per forward pass.

    Raises (from :meth:`check`):
        TokenizationError: a target is not exactly one token (the message shows its tokenization),
            a position out of range, a prompt longer than the model's context.
    """

    kind: Literal["logit_lens"] = "logit_lens"
    prompts: Prompts
    target: Optional[Union[str, list[str]]] = None
    position: Union[int, str] = "last"
    layer_convention: LayerConvention = "hidden_states"
    top_k: int = Field(default=10, ge=1, le=1000)
    batch_size: int = Field(default=8, ge=1)

    result_class = LogitLensResult
    retired = {"positions": "position", "layers": "layer_convention; layers now always means block indices"}

    @field_validator("position")
    @classmethod
    def _position(cls, v):
        try:
            parse_position(v, LENS_POSITIONS)
        except Exception as e:  # noqa: BLE001 - reported with the field's path by pydantic
            raise ValueError(str(e).removeprefix("position: ")) from None
        return v

    @property
    def targets(self) -> list[str]:
        if self.target is None:
            return []
        return [self.target] if isinstance(self.target, str) else list(self.target)

    def prepare(self, model) -> LogitLensInputs:
        """Tokenize the prompts, resolve the read positions and the targets' ids (tokenizer and
        config only: works on a :class:`tracekit.model.ModelInfo`)."""
        pos = parse_position(self.position, LENS_POSITIONS)
        ids = encode_prompts(model, self.prompts)
        positions = tuple(tuple(pos.resolve(model, p, seq, field="position", skip_bos=False))
                          for p, seq in zip(self.prompts, ids))
        target_ids = tuple(single_token_id(model, t, field="target" if isinstance(self.target, str) else f"target[{j}]")
                           for j, t in enumerate(self.targets))
        points = tuple(lens_points(int(model.cfg.n_layers), self.layer_convention))
        return LogitLensInputs(ids, positions, target_ids, points)

    def _run(self, model, inputs: LogitLensInputs, progress: bool = True) -> LogitLensResult:
        # The engine (tracekit.logit_lens.logit_lens) takes the prompt strings and tokenizes each
        # batch itself (it has no ids parameter yet), so each prompt is tokenized once more there.
        from tqdm.auto import tqdm

        bar = tqdm(total=len(self.prompts), desc="logit lens", disable=not progress, leave=False)
        try:
            lens = logit_lens(model, self.prompts, self.targets, self.position, self.layer_convention, self.top_k,
                              self.batch_size, progress=bar.update)
        finally:
            bar.close()
        decode = _Decoder(model)
        main, topk, toks, final = [], [], [], []
        for pi, pl in enumerate(lens):
            main.append(self._main_rows(pi, pl, decode))
            topk.append(self._topk_rows(pi, pl, decode))
            toks.append({"prompt_idx": np.full(len(pl.ids), pi), "position": np.arange(len(pl.ids)),
                         "token": _obj(pl.tokens), "token_id": np.asarray(pl.ids, dtype=np.int64)})
            final.append(self._final_rows(pi, pl, decode))
        # one DataFrame per table from concatenated columns (a frame per prompt and pd.concat cost
        # ~1 s per 256 prompts)
        tables = {"main": _frame(main), "topk": _frame(topk), "tokens": _frame(toks),
                  "final": pd.concat(final, ignore_index=True)}
        points = inputs.points
        meta = {"n_layers": int(model.cfg.n_layers), "hooks": [p.hook for p in points],
                "hidden_states": [p.hidden_state for p in points], "d_vocab": int(model.cfg.d_vocab)}
        return LogitLensResult(self, tables, meta)

    # ---- table shaping ------------------------------------------------------------------------
    def _main_rows(self, pi: int, pl, decode) -> dict[str, np.ndarray]:
        """Columns of the ``main`` rows of one prompt (hidden state x position [x target])."""
        H, P = pl.entropy.shape
        n = H * P
        n_real = len(pl.ids)
        base = {
            "prompt_idx": np.full(n, pi, dtype=np.int64), "prompt": _obj([pl.prompt] * n),
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
        }
        if not pl.target_ids:
            return {**base, "target": np.full(n, None, dtype=object)}
        parts = []
        for ti, (tname, tid) in enumerate(zip(self.targets, pl.target_ids)):
            lp = pl.target_log_prob[..., ti].reshape(-1).numpy()
            parts.append({**base, "target": np.full(n, tname, dtype=object), "target_id": np.full(n, tid, dtype=np.int64),
                          "prob": np.exp(lp), "log_prob": lp,
                          "rank": pl.target_rank[..., ti].reshape(-1).numpy().astype(np.int64)})
        return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}

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

    def _final_rows(self, pi: int, pl, decode) -> pd.DataFrame:
        n_real = len(pl.ids)
        rows = []
        for j, p in enumerate(pl.positions):
            row = {"prompt_idx": pi, "position": p, "is_last": p == n_real - 1,
                   "top1": decode(pl.final_topk_ids[j, :1])[0], "top1_prob": float(pl.final_topk_probs[j, 0]),
                   "topk_tokens": decode(pl.final_topk_ids[j]), "topk_probs": pl.final_topk_probs[j].tolist()}
            if pl.target_ids:
                for ti, tname in enumerate(self.targets):
                    rows.append({**row, "target": tname, "target_prob": float(pl.final_log_prob[j, ti].exp())})
            else:
                rows.append({**row, "target": None, "target_prob": float("nan")})
        return pd.DataFrame(rows)


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

    def __init__(self, model):
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

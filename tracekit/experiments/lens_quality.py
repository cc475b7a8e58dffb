"""``kind: lens_quality`` -- which lens to trust at which hidden state.

Scores the logit lens, the tuned lens (Belrose et al. 2023; trained here once and cached, or
loaded from ``tuned.path``) and optionally the Patchscope identity readout on held-out text: per
hidden state the mean KL to the model's own output, the next-token cross-entropy and the top-1
agreement (:mod:`tracekit.lenses.quality`). The held-out text is the held-out side of the corpus's
document split (:func:`tracekit.lenses.train.document_split`), disjoint from what the tuned lens
trains on. Units: nats; agreement in [0, 1].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Union, cast

import numpy as np
import pandas as pd
from pydantic import Field, field_validator

from .. import plotting
from ..core.strict import StrictModel
from ..corpus import Window
from ..lenses.quality import LENSES, quality_figure, quality_table
from ..lenses.train import TunedLensSpec, load_or_train_tuned_lens, split_windows
from ..lenses.tuned import residual_basis
from ..model.info import HookedModel
from .base import Experiment, Result, register

__all__ = ["LensQuality", "LensQualityResult", "LensEvalSpec", "LensQualityInputs"]


class LensEvalSpec(StrictModel):
    """The held-out text the lenses are scored on.

    Fields:
        corpus: ``stdlib`` (default, offline), a text/JSONL file, a folder or a list; only its
            held-out documents are read.
        n_tokens: held-out tokens scored (BOS excluded; default 1024).
        seq_len: tokens per window, BOS included (default 128).
        seed: seeds the Patchscope position sample (default 0).
    """

    corpus: Union[str, list[str]] = "stdlib"
    n_tokens: int = Field(default=1024, ge=1)
    seq_len: int = Field(default=128, ge=4)
    seed: int = 0


@dataclass(frozen=True)
class LensQualityInputs:
    """The held-out windows (tokenized once in :meth:`LensQuality.prepare`)."""

    windows: tuple[Window, ...]

    @property
    def ids(self) -> tuple[tuple[int, ...], ...]:
        """Each held-out window's token ids, as tokenized once."""
        return tuple(w.ids for w in self.windows)


class LensQualityResult(Result):
    """Table ``quality``: ``lens``, ``hidden_state``, ``kl`` (mean KL(final || lens), nats),
    ``kl_se`` (its standard error), ``cross_entropy`` (nats, against the actual next token),
    ``top1_agreement`` (share of positions whose lens top-1 is the model's top-1), ``n_tokens``.

    Summary keys: ``lenses``; ``hidden_states``; ``n_tokens`` ({lens: positions scored});
    ``kl_by_hidden_state``, ``cross_entropy_by_hidden_state``, ``top1_agreement_by_hidden_state``
    ({lens: [value per hidden state]}); ``mean_kl`` ({lens: mean over hidden states 0..n_layers-1});
    with logit and tuned: ``kl_gain_by_hidden_state`` (logit KL - tuned KL per hidden state),
    ``tuned_better_hidden_states`` (where the tuned lens' KL is lower), ``tuned_better_share``;
    ``tuned`` (how the tuned lens was obtained: from a path, the cache or trained, with its
    training record); ``headline`` (one sentence).
    """

    config: "LensQuality"
    main_table = "quality"

    def _by(self, col: str) -> dict:
        q = self.tables["quality"]
        return {str(k): [float(x) for x in g.sort_values("hidden_state")[col]] for k, g in q.groupby("lens", sort=False)}

    def summary(self) -> dict:
        q = self.tables["quality"]
        kl = self._by("kl")
        lenses = list(kl)
        H = int(cast(pd.Series, q["hidden_state"]).max()) + 1
        out: dict = {"lenses": lenses, "hidden_states": list(range(H)),
                     "n_tokens": {str(k): int(cast(pd.Series, g["n_tokens"]).max()) for k, g in q.groupby("lens", sort=False)},
                     "kl_by_hidden_state": kl, "cross_entropy_by_hidden_state": self._by("cross_entropy"),
                     "top1_agreement_by_hidden_state": self._by("top1_agreement"),
                     "mean_kl": {k: float(np.mean(v[:-1])) if len(v) > 1 else float(v[0]) for k, v in kl.items()}}
        parts = [f"mean KL over hidden states 0..{H - 2}: " +
                 ", ".join(f"{k} {v:.2f}" for k, v in out["mean_kl"].items()) + " nats"]
        if "logit" in kl and "tuned" in kl:
            gain = [a - b for a, b in zip(kl["logit"], kl["tuned"])]
            better = [h for h, g in enumerate(gain[:-1]) if g > 0]
            out.update(kl_gain_by_hidden_state=gain, tuned_better_hidden_states=better,
                       tuned_better_share=len(better) / max(1, H - 1))
            parts.append(f"the tuned lens is closer to the model's output than the logit lens at {len(better)} of "
                         f"{H - 1} hidden states" + (" (all)" if len(better) == H - 1 else f" ({better})"))
        if "patchscope" in kl:
            ps = kl["patchscope"]
            parts.append(f"Patchscope (on {out['n_tokens']['patchscope']} positions) mean KL {np.mean(ps[:-1]):.2f}")
        out["tuned"] = self.meta.get("tuned")
        out["headline"] = "; ".join(parts)
        return out

    def report(self) -> str:
        s = self.summary()
        q = self.tables["quality"]
        lines = [f"lens quality [{self.config.step_name}]: {s['headline']}"]
        t = s.get("tuned") or {}
        if t:
            lines.append(f"tuned lens: {t.get('from')} ({t.get('path')})")
        wide = q.pivot(index="hidden_state", columns="lens", values="kl")[s["lenses"]]
        top = q.pivot(index="hidden_state", columns="lens", values="top1_agreement")[s["lenses"]]
        rows = [[h] + [f"{wide.loc[h, k]:.3f}" for k in s["lenses"]] + [f"{top.loc[h, k]:.2f}" for k in s["lenses"]]
                for h in wide.index]
        lines.append(plotting.text_table(rows, ["h"] + [f"KL {k}" for k in s["lenses"]] +
                                         [f"top1 {k}" for k in s["lenses"]]))
        return "\n".join(lines)

    def figures(self) -> dict:
        return {"quality": quality_figure(self.tables["quality"], f"Lens quality by hidden state [{self.config.step_name}]")}


@register
class LensQuality(Experiment):
    """Lens quality per hidden state on held-out text: logit lens vs tuned lens (vs Patchscope).

    Method: Belrose et al. 2023 (arXiv:2303.08112) section 4's comparison of the logit and tuned
    lens by KL to the final distribution; Patchscope (Ghandeharioun et al. 2024) identity readout.
    Engine: :func:`tracekit.lenses.quality.quality_table`.

    Fields:
        lenses: any of ``logit``, ``tuned``, ``patchscope`` (default ``[logit, tuned]``).
        tuned: the tuned lens (:class:`tracekit.lenses.train.TunedLensSpec`): ``{path: folder}``
            loads a saved lens (tracekit's or the tuned-lens package's), otherwise the training
            config (trained once per model and config, then loaded from the cache).
        eval: the held-out text (:class:`LensEvalSpec`: corpus, n_tokens, seq_len, seed).
        patchscope_positions: positions Patchscope is scored on (a seeded sample; it costs one
            forward pass per hidden state and position; default 16).
        patchscope_target: Patchscope's target prompt (default: its identity prompt).
        batch_size: windows per forward pass (default 8).

    Summary keys and table: :class:`LensQualityResult`.

    Raises:
        CorpusError: a corpus too small for ``eval.n_tokens`` or the tuned lens' budget.
        ConfigError: a tuned lens the model cannot use (another width, depth or residual basis).
    """

    kind: Literal["lens_quality"] = "lens_quality"
    lenses: list[Literal["logit", "tuned", "patchscope"]] = Field(default_factory=lambda: ["logit", "tuned"])
    tuned: TunedLensSpec = Field(default_factory=TunedLensSpec)
    eval: LensEvalSpec = Field(default_factory=LensEvalSpec)
    patchscope_positions: int = Field(default=16, ge=1)
    patchscope_target: Union[str, None] = None
    batch_size: int = Field(default=8, ge=1)

    result_class = LensQualityResult

    @field_validator("lenses")
    @classmethod
    def _lenses(cls, v):
        if not v:
            raise ValueError(f"give at least one lens of {list(LENSES)}")
        if len(set(v)) != len(v):
            raise ValueError(f"{v} lists a lens twice")
        return sorted(v, key=LENSES.index)

    def prepare(self, model: HookedModel) -> LensQualityInputs:
        """The held-out windows, tokenized once (tokenizer only).

        Raises:
            CorpusError: the corpus' held-out documents hold fewer than ``eval.n_tokens`` tokens.
            ConfigError: ``eval.seq_len`` or (a tuned lens to train) ``tuned.seq_len`` longer than the
                model's context.
        """
        e = self.eval
        if "tuned" in self.lenses:
            self.tuned.check_context(model, "tuned")
        return LensQualityInputs(tuple(split_windows(model, e.corpus, "held_out", e.n_tokens, e.seq_len,
                                                     "eval.corpus", "eval.seq_len")))

    def _run(self, model: HookedModel, inputs: LensQualityInputs, progress: bool = True) -> LensQualityResult:
        from ..core.progress import progress_bar

        lens = load_or_train_tuned_lens(model, self.tuned, progress, "tuned") if "tuned" in self.lenses else None
        bar = progress_bar(total=len(inputs.windows), desc="lens quality", unit="window", enabled=progress)
        try:
            table = quality_table(model, inputs.windows, self.lenses, lens, self.patchscope_positions,
                                  self.eval.seed, self.batch_size, patchscope_target=self.patchscope_target,
                                  progress=bar.update)
        finally:
            bar.close()
        meta = {"n_layers": int(model.cfg.n_layers), "residual_basis": residual_basis(model),
                "eval_windows": len(inputs.windows),
                "tuned": None if lens is None else {**lens.source, "record": lens.record,
                                                    "config": lens.config.to_dict()}}
        return LensQualityResult(self, {"quality": pd.DataFrame(table)}, meta)

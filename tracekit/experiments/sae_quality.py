"""SAE quality kinds over :mod:`tracekit.sae` (SAELens-format SAEs, no SAELens needed); ``sae_features`` is in
:mod:`tracekit.experiments.sae`, which re-exports these.

* ``kind: sae_eval`` (:class:`SAEEval`): the SAE spliced into the model on corpus windows (the
  held-out tokens of an SAE trained here): MSE, explained variance, L0, dead / dense features,
  CE loss recovered against zero and mean ablation, KL to the clean run.
* ``kind: sae_train`` (:class:`SAETrain`): train (or find in the cache) the SAE of a ``sae.train``
  block (SAELens' runner where SAELens imports, tracekit's own trainer elsewhere:
  :func:`tracekit.sae.train.train_sae`) and evaluate it on held-out text.

Neither kind has prompts, so neither prepares inputs (``prepare`` returns None); ``check`` checks
the SAE against the model. Units: activations in the SAE's input units; losses in nats.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import pandas as pd
from pydantic import Field, field_validator

from .. import plotting
from ..model.context import check_window
from ..model.info import HookedModel
from ..sae import SAESpec, check_sae, eval_seq_len, eval_windows, load_sae, sae_info, sae_quality
from .base import Experiment, Result, register
from .frames import column, select

__all__ = ["SAEEval", "SAEEvalResult", "SAETrain", "SAETrainResult", "check_spec", "load_handle", "rounded"]


def check_spec(exp, model: HookedModel) -> None:
    """Check the SAE of a kind's ``sae`` field against the model (no weights loaded), and the windows
    it is evaluated on against the model's context (``seq_len``; unset: the SAE's context size).

    Raises:
        SAEError: see :func:`tracekit.sae.check_sae`. ConfigError: windows longer than the model's context.
    """
    info = sae_info(exp.sae, model, "sae")
    check_sae(model, info, "sae")
    if exp.corpus is not None or exp.sae.train is None:  # else the SAE's own held-out windows (checked above)
        check_window(model, eval_seq_len(exp.sae.train, info.context_size, getattr(exp, "seq_len", None)), "seq_len")


def load_handle(exp, model: HookedModel, progress):
    """Load (or train, or find in the cache) the SAE of a kind's ``sae`` field."""
    return load_sae(exp.sae, model, "sae", progress=progress)


def rounded(x, nd: int = 5):
    """``x`` as a float rounded to ``nd`` digits; None when it is not a finite number."""
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return None if not np.isfinite(v) else round(v, nd)


# =============================================================================================
# sae_eval


class SAEEvalResult(Result):
    """Tables: ``metrics`` (one row: every quality number, SAELens' definitions), ``features``
    (per feature: density, max activation, dead, dense)."""

    config: "SAEEval"
    main_table = "metrics"

    def summary(self) -> dict:
        m = self.tables["metrics"].to_dict("records")[0]  # per-column types (counts stay ints)
        counts = {"n_dead", "n_dense", "n_tokens", "n_ce_tokens", "n_windows"}
        out = {k: (int(v) if k in counts and v == v else rounded(v, 6) if isinstance(v, (float, np.floating))
                   else (int(v) if isinstance(v, (np.integer,)) else v))
               for k, v in m.items()}
        f = self.tables["features"]
        out["dead_features"] = column(select(f, column(f, "dead")), "feature").head(50).tolist()
        out["dense_features"] = column(select(f, column(f, "dense")), "feature").head(50).tolist()
        out["hook"] = self.meta.get("hook")
        out["sae"] = self.meta.get("sae")
        return out

    def report(self) -> str:
        s = self.summary()
        return (f"SAE eval [{self.config.step_name}] {s['sae']} at {s['hook']} on {s['n_tokens']} tokens: "
                f"explained variance {s['explained_variance']}, L0 {s['l0']}, MSE {s['mse']}, CE loss recovered "
                f"{s['ce_loss_recovered']} (zero abl.) / {s['ce_loss_recovered_mean']} (mean abl.), KL {s['kl']} nats, "
                f"dead {s['n_dead']}, dense {s['n_dense']} (> {s['dense_threshold']})\n"
                f"CE loss: clean {s['ce_loss_clean']}, SAE {s['ce_loss_sae']}, zero {s['ce_loss_zero']}, "
                f"mean {s['ce_loss_mean']} nats")

    def figures(self) -> dict:
        p = plotting.plt()
        f = self.tables["features"]
        dens = f["density"].to_numpy()
        fig, ax = p.subplots(figsize=(6, 3.2))
        live = dens[dens > 0]
        if len(live):
            ax.hist(np.log10(live), bins=40)
        ax.set_xlabel("log10 feature density (dead features omitted)")
        ax.set_ylabel("features")
        ax.set_title(f"Feature density ({int((dens == 0).sum())} dead of {len(dens)})")
        fig.tight_layout()
        return {"density": fig}


@register
class SAEEval(Experiment):
    """Splice the SAE in and measure its quality on corpus windows (SAELens' metrics).

    Fields:
        sae: the SAE.
        corpus: text to evaluate on: ``stdlib``, a text/JSONL file or directory path, or a list of
            paths (default: an SAE trained here is evaluated on its held-out tokens, any other on ``stdlib``).
        max_tokens: corpus tokens evaluated (the first ``max_tokens``; default 4096; for an SAE trained
            here, at most its ``eval_tokens``).
        seq_len: window length (default: the SAE's context size, else 64).
        batch_size: token windows per forward pass (default 8).
        dense_threshold: a feature active on more than this fraction of tokens is ``dense``.
    """

    kind: Literal["sae_eval"] = "sae_eval"
    sae: SAESpec
    corpus: str | list[str] | None = None
    max_tokens: int = Field(default=4096, ge=16)
    seq_len: int | None = Field(default=None, ge=4)
    batch_size: int = Field(default=8, ge=1)
    dense_threshold: float = Field(default=0.1, gt=0, le=1)

    result_class = SAEEvalResult

    def check(self, model: HookedModel) -> None:
        """The SAE against the model (:func:`tracekit.sae.check_sae`); nothing to prepare."""
        check_spec(self, model)

    def _run(self, model: HookedModel, inputs: None, progress: bool = True) -> SAEEvalResult:
        h = load_handle(self, model, progress)
        wins = eval_windows(model, h, self.corpus, self.max_tokens, self.seq_len)
        q = sae_quality(model, h, wins, self.batch_size, self.dense_threshold, progress)
        return _eval_result(self, h, q, wins)


def _eval_result(exp, h, q, wins):
    dens = q.density.numpy()
    feats = pd.DataFrame({"feature": np.arange(len(dens)), "density": dens, "max_activation": q.max_act.numpy(),
                          "dead": dens == 0, "dense": dens > q.metrics["dense_threshold"]})
    meta = {"hook": h.hook, "sae": h.info.source, "d_sae": h.d_sae, "sae_path": h.path,
            "eval_text": "held-out corpus tokens" if (h.spec and h.spec.train and exp.corpus is None) else
            str(exp.corpus or "stdlib"),
            "definitions": "sae_lens.evals: mse = mean_t ||x - x_hat||^2; explained_variance = 1 - E||x - x_hat||^2 / "
                           "(E||x||^2 - ||E x||^2); ce_loss_recovered = (ce_zero - ce_sae) / (ce_zero - ce_clean)"}
    return SAEEvalResult(exp, {"metrics": pd.DataFrame([q.metrics]), "features": feats}, meta)


# =============================================================================================
# sae_train


class SAETrainResult(SAEEvalResult):
    """Tables: ``training`` (one row: directory, cache hit, time, tokens), plus ``metrics`` /
    ``features`` on the held-out tokens (as :class:`SAEEvalResult`)."""

    config: "SAETrain"  # type: ignore[assignment]

    def summary(self) -> dict:
        out = super().summary()
        t = self.tables["training"].iloc[0].to_dict()
        out.update({k: (rounded(v, 3) if isinstance(v, float) else v) for k, v in t.items()})
        return out

    def report(self) -> str:
        s = self.summary()
        head = (f"SAE train [{self.config.step_name}] {'cache hit' if s['cache_hit'] else 'trained'} -> {s['path']} "
                f"({s.get('train_tokens')} tokens, {'trained earlier in' if s['cache_hit'] else 'in'} "
                f"{s.get('train_seconds')} s{', activations from a store' if s.get('activations_from') == 'store' else ''})")
        return head + "\n" + super().report()


@register
class SAETrain(Experiment):
    """Train an SAE on this model (SAELens' runner where SAELens imports, tracekit's own trainer
    elsewhere; or load it from the cache) and evaluate it on held-out corpus tokens.

    Fields:
        sae: must be a ``train:`` block.
        max_tokens: held-out corpus tokens the trained SAE is evaluated on (default 4096; at most
            ``sae.train.eval_tokens``).
        batch_size: evaluation token windows per forward pass (default 8).
        dense_threshold: a feature active on more than this fraction of evaluation tokens is
            ``dense`` (in (0, 1]; default 0.1).
    """

    kind: Literal["sae_train"] = "sae_train"
    sae: SAESpec
    max_tokens: int = Field(default=4096, ge=16)
    batch_size: int = Field(default=8, ge=1)
    dense_threshold: float = Field(default=0.1, gt=0, le=1)

    result_class = SAETrainResult

    @field_validator("sae")
    @classmethod
    def _needs_train(cls, v: SAESpec):
        if v.train is None:
            raise ValueError("sae_train needs a train: block (sae: {train: {hook: blocks.L.hook_resid_pre}})")
        return v

    @property
    def corpus(self):
        return None

    def check(self, model: HookedModel) -> None:
        """The SAE against the model (:func:`tracekit.sae.check_sae`); nothing to prepare."""
        check_spec(self, model)

    def _run(self, model: HookedModel, inputs: None, progress: bool = True) -> SAETrainResult:
        h = load_handle(self, model, progress)
        wins = eval_windows(model, h, None, self.max_tokens)
        q = sae_quality(model, h, wins, self.batch_size, self.dense_threshold, progress)
        base = _eval_result(self, h, q, wins)
        stats = dict(h.train_stats)
        stats.pop("train", None)
        row = {"path": h.path, "cache_hit": bool(h.cache_hit), **stats}
        tables = {**base.tables, "training": pd.DataFrame([row])}
        return SAETrainResult(self, tables, base.meta)

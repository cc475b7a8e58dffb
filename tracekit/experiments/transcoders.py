"""``kind: transcoder_train``: train (or find in the cache) one transcoder per layer on the activation
store and measure it on held-out text (:mod:`tracekit.dictionaries`).

Tables: ``layers`` (per layer: FVU, MSE, L0, dead fraction), ``overall`` (one row: the whole
replacement model's next-token CE against the model's, ``KL(model || replacement)``, means), and
``training`` (one row: folder, cache hit, times, tokens). Units: FVU a fraction; CE and KL in nats
per predicted token; L0 active features per token.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import pandas as pd
from pydantic import Field, field_validator

from .. import plotting
from ..dictionaries.quality import transcoder_quality
from ..dictionaries.spec import TranscoderSpec, transcoder_hooks
from ..dictionaries.train import load_transcoders, training_windows
from ..model.context import check_window
from ..model.info import HookedModel
from .base import Experiment, Result, register

__all__ = ["TranscoderTrain", "TranscoderTrainResult"]


def _num(v, nd: int = 5):
    try:
        f = float(v)
    except (TypeError, ValueError):
        return v
    return None if not np.isfinite(f) else round(f, nd)


class TranscoderTrainResult(Result):
    """Tables: ``layers`` (per-layer quality), ``overall`` (replacement model), ``training``."""

    config: "TranscoderTrain"
    main_table = "layers"

    def summary(self) -> dict:
        o = {k: _num(v) for k, v in self.tables["overall"].iloc[0].to_dict().items()}
        t = self.tables["training"].iloc[0].to_dict()
        out = {**o, "path": t.get("path"), "cache_hit": bool(t.get("cache_hit")),
               "train_seconds": _num(t.get("train_seconds"), 2), "n_layers": int(len(self.tables["layers"]))}
        layers = self.tables["layers"]
        out["fvu_max"] = _num(layers["fvu"].max())
        out["fvu_by_layer"] = [_num(v, 4) for v in layers["fvu"].tolist()]
        return out

    def report(self) -> str:
        s = self.summary()
        head = (f"transcoder train [{self.config.step_name}] {'cache hit' if s['cache_hit'] else 'trained'} -> "
                f"{s['path']} ({s['n_layers']} layers, {'trained earlier in' if s['cache_hit'] else 'in'} "
                f"{s['train_seconds']} s)")
        return (head + f"\nheld-out: FVU mean {s['fvu_mean']} (max {s['fvu_max']}), L0 mean {s['l0_mean']}; "
                f"replacement model CE {s['ce_replacement']} vs model {s['ce_model']} nats (delta {s['ce_delta']}), "
                f"KL(model || replacement) {s['kl']} nats")

    def figures(self) -> dict:
        p = plotting.plt()
        df = self.tables["layers"]
        fig, ax = p.subplots(figsize=(7, 3.2))
        ax.bar(df["layer"].to_numpy(), df["fvu"].to_numpy())
        ax.set_xlabel("layer")
        ax.set_ylabel("FVU (held-out)")
        ax.set_title("Transcoder fraction of variance unexplained per layer")
        fig.tight_layout()
        return {"fvu": fig}


@register
class TranscoderTrain(Experiment):
    """Train per-layer transcoders on this model (or load them from the cache) and measure them on
    the held-out corpus tokens right after the training tokens.

    Fields:
        transcoders: must be a ``train:`` block (:class:`tracekit.dictionaries.spec.TranscoderTrainSpec`).
        batch_size: evaluation windows per forward pass (default 8; chunked under the memory budget).
    """

    kind: Literal["transcoder_train"] = "transcoder_train"
    transcoders: TranscoderSpec
    batch_size: int = Field(default=8, ge=1)

    result_class = TranscoderTrainResult

    @field_validator("transcoders")
    @classmethod
    def _needs_train(cls, v: TranscoderSpec):
        if v.train is None:
            raise ValueError("transcoder_train needs a train: block (transcoders: {train: {...}})")
        return v

    def check(self, model: HookedModel) -> None:
        """The context size and every layer's hook pair against the model (no forward pass).

        Raises:
            ConfigError: ``context_size`` longer than the model's context.
            SAEError: a layer or hook the model lacks.
        """
        t = self.transcoders.train
        assert t is not None
        check_window(model, t.context_size, "transcoders.train.context_size")
        for L in (t.layers if t.layers is not None else range(int(model.cfg.n_layers))):
            transcoder_hooks(model, L, t, "transcoders.train")

    def _run(self, model: HookedModel, inputs: None, progress: bool = True) -> TranscoderTrainResult:
        t = self.transcoders.train
        assert t is not None
        lt = load_transcoders(self.transcoders, model, field="transcoders", progress=progress)
        _, held = training_windows(model, t.corpus, t.context_size, t.dataset_tokens or t.training_tokens,
                                   t.eval_tokens, "transcoders.train")
        per_layer, overall = transcoder_quality(model, lt.dictionaries, held, batch_size=self.batch_size)
        st = lt.stats
        row = {"path": lt.path, "cache_hit": bool(lt.cache_hit), "train_seconds": st.get("train_seconds"),
               "store_seconds": st.get("store_seconds"), "train_tokens": st.get("train_tokens"),
               "dataset_tokens": st.get("dataset_tokens"), "held_out_tokens": st.get("held_out_tokens"),
               "d_sae": lt.info.get("d_sae"), "architecture": lt.info.get("activation"), "k": lt.info.get("k"),
               "key": st.get("key")}
        meta = {"transcoders": lt.info, "definitions": (
            "fvu = sum ||y - y_hat||^2 / sum ||y - mean(y)||^2 over held-out tokens; l0 = active features per token; "
            "replacement model = every covered hook_out replaced at once by its transcoder's prediction from the "
            "replacement run's hook_in; kl = KL(p_model || p_replacement), ce in nats per predicted token")}
        tables = {"layers": per_layer, "overall": pd.DataFrame([overall]), "training": pd.DataFrame([row])}
        return TranscoderTrainResult(self, tables, meta)

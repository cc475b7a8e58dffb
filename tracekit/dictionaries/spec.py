"""Which transcoders: the ``transcoders:`` config block (:class:`TranscoderSpec`: a saved set, or
:class:`TranscoderTrainSpec`: train one here) and the hook pair a transcoder reads and predicts
(:func:`transcoder_hooks`).

The default pair is ``blocks.L.mlp.hook_in`` -> ``blocks.L.hook_mlp_out``: the MLP's own input
(after the block's pre-MLP norm, so normalised) and what the MLP adds to the residual stream. On
the post-norm families (Gemma 2/3: a post-feedforward norm ``ln2_post`` after the MLP), the bridge's
``hook_mlp_out`` is *after* that norm (``hook_resid_post - hook_resid_mid`` exactly; ``mlp.hook_out``
is before it), so a transcoder on the default pair predicts the normalised MLP output that enters
the residual stream, as Gemma Scope's transcoders do (circuit-tracer ``configs/gemmascope-*.yaml``:
``hook_mlp_out``), and the replacement model needs no extra norm after it.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from ..core.errors import SAEError
from ..core.strict import StrictModel
from ..hooks import check_hooks
from ..model.info import HookedModel

__all__ = ["TranscoderSpec", "TranscoderTrainSpec", "transcoder_hooks", "hook_name"]


class TranscoderTrainSpec(StrictModel):
    """Train one transcoder per layer on this model (then load it from the cache).

    Fields:
        layers: the blocks to train transcoders for: ``[0, 1, ..., L-1]`` (circuit-tracer's sets have no
            gaps; default: every block).
        hook_in: the site a transcoder reads, relative to ``blocks.L.`` (default ``mlp.hook_in``:
            the MLP's normalised input).
        hook_out: the site it predicts, relative to ``blocks.L.`` (default ``hook_mlp_out``: what
            the MLP adds to the residual stream; after the post-feedforward norm on Gemma 2/3).
        architecture: ``topk`` (Gao et al. 2024; default, with the AuxK dead-feature loss) or
            ``jumprelu`` (Rajamanoharan et al. 2024; straight-through estimator of the threshold
            with ``bandwidth`` and an L0 penalty ``l0_coefficient``).
        d_sae: features per transcoder (default ``expansion_factor x d_in``).
        expansion_factor: used when ``d_sae`` is not given.
        k: active features per token (``topk``).
        l0_coefficient: weight of the L0 penalty (``jumprelu``), per token, in units of the
            normalised output's squared norm.
        bandwidth: the JumpReLU straight-through estimator's bandwidth (``jumprelu``).
        init_threshold: the JumpReLU threshold at initialisation (``jumprelu``).
        skip: give each transcoder a linear skip matrix ``W_skip`` (skip transcoders, Paulo et al. 2025).
        training_tokens: tokens the optimiser sees per layer (more than ``dataset_tokens``: several
            passes).
        dataset_tokens: distinct corpus tokens trained on, the first ones of the corpus packed into
            windows (default ``training_tokens``).
        eval_tokens: held-out tokens (right after the dataset tokens) the quality is measured on.
        context_size: tokens per packed window (BOS included when the model prepends one).
        train_batch_size_tokens: tokens per optimiser step.
        lr: Adam's learning rate.
        dead_feature_window: steps without firing after which a feature counts as dead (the AuxK
            loss then trains it on the residual error).
        corpus: ``stdlib`` (offline default), a text/JSONL file or folder, or a list of them.
        seed: seeds each layer's initialisation and token order (same seed, same weights).
        dtype: the parameters' dtype while training (``float32``).
        store: an activation store to train from (written by this model from packed windows of
            ``corpus`` with ``seq_len: context_size`` at position ``all``, holding both hooks of
            every layer); default: the trainer writes one into the cache.
        checkpoint_every: optimiser steps between checkpoints (a killed training resumes from the
            last one; does not change the weights).
    """

    layers: list[int] | None = None
    hook_in: str = "mlp.hook_in"
    hook_out: str = "hook_mlp_out"
    architecture: Literal["topk", "jumprelu"] = "topk"
    d_sae: int | None = Field(default=None, ge=1)
    expansion_factor: int = Field(default=4, ge=1)
    k: int = Field(default=32, ge=1)
    l0_coefficient: float = Field(default=1e-3, ge=0)
    bandwidth: float = Field(default=0.05, gt=0)
    init_threshold: float = Field(default=0.01, ge=0)
    skip: bool = False
    training_tokens: int = Field(default=40_960, ge=64)
    dataset_tokens: int | None = Field(default=None, ge=64)
    eval_tokens: int = Field(default=4096, ge=64)
    context_size: int = Field(default=128, ge=4)
    train_batch_size_tokens: int = Field(default=1024, ge=8)
    lr: float = Field(default=1e-3, gt=0)
    dead_feature_window: int = Field(default=200, ge=1)
    corpus: str | list[str] = "stdlib"
    seed: int = 0
    dtype: Literal["float32", "float64"] = "float32"
    store: str | None = None
    checkpoint_every: int = Field(default=100, ge=1)

    @model_validator(mode="after")
    def _means_what_it_says(self):
        if self.architecture == "topk" and self.d_sae is not None and self.k > self.d_sae:
            raise ValueError(f"k: {self.k} active features per token is more than d_sae ({self.d_sae}); lower k or "
                             "raise d_sae")
        if self.training_tokens < self.train_batch_size_tokens:
            raise ValueError(f"training_tokens: {self.training_tokens} is less than one batch "
                             f"(train_batch_size_tokens {self.train_batch_size_tokens}); raise training_tokens or "
                             "lower train_batch_size_tokens")
        if self.layers is not None and (not self.layers or sorted(self.layers) != list(range(len(self.layers)))):
            raise ValueError(f"layers: {self.layers} must be the blocks 0..L-1 (circuit-tracer's transcoder sets cover "
                             "the first blocks without gaps; an attribution graph needs every block up to its last); "
                             "give [0, 1, ..., L-1] or leave it unset (every block)")
        for name in ("hook_in", "hook_out"):
            if getattr(self, name).startswith("blocks."):
                raise ValueError(f"{name}: give the site relative to blocks.L. ({getattr(self, name).split('.', 2)[-1]!r}"
                                 f" rather than {getattr(self, name)!r})")
        return self

    def training_fields(self) -> dict:
        """The fields that change the trained weights (the cache key's part of the spec)."""
        return self.model_dump(mode="json", exclude={"store", "checkpoint_every"})

    def d_sae_for(self, d_in: int) -> int:
        """The number of features for input width ``d_in``."""
        return int(self.d_sae or d_in * self.expansion_factor)


class TranscoderSpec(StrictModel):
    """Which transcoders (config key ``transcoders:``): exactly one of

    * ``path``: a transcoder set folder in circuit-tracer's layout (per-layer safetensors plus a
      config listing the layers and hooks);
    * ``train``: a :class:`TranscoderTrainSpec` (trained once, then loaded from the cache).

    Fields:
        path: a saved transcoder set folder.
        train: train the set on this model here (cached by content).
    """

    path: str | None = None
    train: TranscoderTrainSpec | None = None

    @model_validator(mode="after")
    def _one_source(self):
        given = [n for n in ("path", "train") if getattr(self, n) is not None]
        if len(given) != 1:
            raise ValueError("give exactly one transcoder source: path (a saved transcoder set) or train (train one "
                             f"here); got {given or 'none'}")
        return self

    def describe(self) -> str:
        return str(self.path) if self.path is not None else "trained"


def hook_name(site: str, layer: int) -> str:
    """``blocks.<layer>.<site>``."""
    return f"blocks.{int(layer)}.{site}"


def transcoder_hooks(model: HookedModel, layer: int, spec: TranscoderTrainSpec,
                     field: str = "transcoders.train") -> tuple[str, str]:
    """The hook a layer's transcoder reads and the one it predicts, checked on the model.

    Args:
        model: a hooked model (or :class:`tracekit.model.ModelInfo`).
        layer: the block.
        spec: the training block (``hook_in`` / ``hook_out`` site templates).
        field: the config field quoted in errors.

    Returns:
        ``(hook_in, hook_out)``, e.g. ``("blocks.3.mlp.hook_in", "blocks.3.hook_mlp_out")``.

    Raises:
        SAEError: the layer is not a block of the model, or a hook the model does not have
            (naming ``<field>.layers`` / ``<field>.hook_in`` / ``<field>.hook_out``).
    """
    n = int(model.cfg.n_layers)
    if not 0 <= int(layer) < n:
        raise SAEError(f"{field}.layers: block {layer} is not one of the model's {n} blocks (0..{n - 1})")
    pair = (hook_name(spec.hook_in, layer), hook_name(spec.hook_out, layer))
    for name, h in zip(("hook_in", "hook_out"), pair):
        try:
            check_hooks(model, [h], f"{field}.{name}")
        except Exception as e:  # noqa: BLE001 - HookError or a ModelInfo's own refusal
            raise SAEError(f"{field}.{name}: {e}") from e
    return pair

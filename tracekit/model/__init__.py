"""The model layer: from a spec to a hooked model, and what tracekit reads and measures on it.

Files, one idea each (imports only :mod:`tracekit.core` and each other):

* :mod:`.spec` — :class:`ModelSpec` and the one device decision (:func:`run_device`, :func:`load_device`, over :func:`resolve_device`);
* :mod:`.source` — where weights, config and tokenizer come from (embedded GGUF, hub cache, folder, random);
* :mod:`.load` — :func:`load_model`: the bridge, weights shared between specs, load-time checks;
* :mod:`.info` — :class:`ModelInfo` (no weights, for ``check``) and :class:`HookedModel`;
* :mod:`.weights_cache`, :mod:`.processed` — the on-disk caches of dequantised and processed weights;
* :mod:`.architectures` — what tracekit reads on each family, and the one refusal (``require``);
* :mod:`.norms`, :mod:`.readout`, :mod:`.writepath` — the final norm, residual -> logits, and each
  block's write path (post-norms, residual multipliers);
* :mod:`.state` — :class:`ModelState`, the one typed attribute tracekit keeps on a model;
* :mod:`.checks` — the load-time checks and the tolerance table.
"""

from .info import HookedModel, ModelInfo, load_model_info
from .load import (
    bos_info,
    clear_cache,
    load_model,
    model_device,
    model_fingerprint,
    model_spec_of,
    wrap_hf_model,
)
from .readout import Readout
from .source import BUILTIN_TOKENIZERS, builtin_tokenizer_dir, embedded_gguf_path
from .spec import (
    DTYPES,
    EMBEDDED_ALIASES,
    ModelSpec,
    as_spec,
    load_device,
    resolve_device,
    run_device,
    tokenizer_adds_bos,
)
from .state import ModelState, state_of

__all__ = ["ModelSpec", "ModelInfo", "HookedModel", "load_model", "load_model_info", "wrap_hf_model",
           "model_spec_of", "model_device", "resolve_device", "run_device", "load_device", "embedded_gguf_path", "clear_cache",
           "BUILTIN_TOKENIZERS", "builtin_tokenizer_dir", "bos_info", "model_fingerprint", "as_spec", "DTYPES",
           "EMBEDDED_ALIASES", "tokenizer_adds_bos", "Readout", "ModelState", "state_of"]

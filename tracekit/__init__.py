"""tracekit: mechanistic-interpretability experiments as composable, YAML-driven classes.

Notebook use::

    import tracekit as tk
    model = tk.load_model()                       # embedded SmolLM2-135M (or "gpt2", a path, ...)
    res = tk.LogitLens(prompts=["The capital of China is Beijing. The capital of France is"],
                       target=" Paris").run(model)
    res.to_frame(); res.summary(); res.plot()

Modules, one stage of "how did the model compute this token?" each:
``models`` (loading), ``tokens`` (tokenization/padding), ``readout`` (final norm + unembedding),
``experiments`` (the kinds), ``config`` (YAML), ``runner``/``cli`` (``tracekit run``).
"""

from .models import ModelLoadError, ModelSpec, load_model, wrap_hf_model  # noqa: F401
from .tokens import TokenizationError  # noqa: F401
from .readout import Readout  # noqa: F401
from .experiments import *  # noqa: F401,F403
from .experiments import __all__ as _exp_all
from .config import ConfigError, load_config, parse_config  # noqa: F401

__version__ = "0.1.0"
__all__ = ["ModelLoadError", "ModelSpec", "load_model", "wrap_hf_model", "TokenizationError",
           "Readout", "ConfigError", "load_config", "parse_config", *_exp_all]

"""One error root for everything tracekit refuses.

Every error that means "your input (config, prompt, model spec, data file, output folder) cannot
be used as given" is a :class:`TracekitError`; its message names the field (YAML path) and the fix.
Each class also subclasses the built-in type that fits the case (``ValueError`` for bad values,
``FileNotFoundError``/``OSError`` for paths, ``RuntimeError`` for a model that cannot be had), so
code written against the built-in types keeps working.

The CLI maps every :class:`TracekitError` to exit code 2 (bad input); anything else raised while a
step runs is a failure of the step (exit code 1). Pattern: TransformerLens'
``tools/model_registry/exceptions.py`` (one ``ModelRegistryError`` root).
"""

from __future__ import annotations

__all__ = [
    "TracekitError", "ConfigError", "ModelLoadError", "TokenizationError", "HookError", "PatchingError",
    "AttributionError", "AttentionError", "CorpusError", "ProbingError", "SAEError", "ResultLoadError",
    "OutputError", "MethodRefused", "DatasetError",
]


class TracekitError(Exception):
    """Root of every error tracekit raises for input it cannot use; the CLI exits with code 2."""


class ConfigError(TracekitError, ValueError):
    """A config (YAML file, ``--set`` override or experiment field) is invalid; the message names
    each YAML path and the fix."""


class ModelLoadError(TracekitError, RuntimeError):
    """The model named by a spec cannot be had (not cached while offline, bad path, bad GGUF,
    unsupported architecture, devices missing); the message says what to do."""


class TokenizationError(TracekitError, ValueError):
    """A string that must be one token is not, prompts that must align do not, or a prompt is
    longer than the model's context."""


class HookError(TracekitError, ValueError):
    """An unknown hook name, or a hook that exists but never fires under the model's settings
    (TransformerLens gates e.g. ``hook_mlp_in`` and ``attn.hook_result`` behind ``set_use_*``)."""


class PatchingError(TracekitError, ValueError):
    """Bad activation-patching input (sites, layers, padded batches, ablation baselines)."""


class AttributionError(TracekitError, ValueError):
    """Bad attribution input (unknown layer or neuron, position out of range) or a model whose
    residual stream is not the sum of the parts read."""


class AttentionError(TracekitError, ValueError):
    """Bad attention-analysis input: unknown layer or head, or a query not in the prompt."""


class CorpusError(TracekitError, ValueError):
    """A corpus source cannot be read; the message names the field and the fix."""


class DatasetError(TracekitError, ValueError):
    """A dataset (rows, file, generator or filter) cannot be used; the message names the row and field."""


class ProbingError(TracekitError, ValueError):
    """Bad probing input: dataset columns, empty cells, splits that cannot be made, positions."""


class SAEError(TracekitError, ValueError):
    """An SAE that cannot be used with this model (hook missing or not firing, width, basis,
    trained on another model) or cannot be loaded."""


class ResultLoadError(TracekitError, FileNotFoundError):
    """A folder is not a complete saved result; the message says what is missing."""


class OutputError(TracekitError, OSError):
    """The output folder cannot be written; the message names the path."""



class MethodRefused(TracekitError, ValueError):
    """A method cannot give exact numbers on this model's architecture (a mixture-of-experts MLP
    has no dense neurons, a block has no per-head output, an SSM layer has no attention, a block
    reads token inputs that bypass the residual stream); the message names the architecture, the
    reason and, where there is one, what can be done instead (docs/architectures.md)."""


class CircuitError(TracekitError, ValueError):
    """Bad circuit-method input (attribution patching, edge attribution, path patching, circuits):
    a node or edge name that does not exist, an entry listed twice, an unknown method, mode, rule
    or ablation, a receiver that reads before its sender writes. (An architecture the method cannot
    run on is :class:`MethodRefused`.)"""


__all__ += ["CircuitError"]


class PatchscopeError(PatchingError):
    """Bad Patchscope input (hidden-state indices outside ``0..n_layers``, ``top_k``, ``n_generate``).
    A :class:`PatchingError` too, so code that caught Patchscope's input errors as such keeps working."""


class SteeringError(TracekitError, ValueError):
    """Bad steering input: a vector of the wrong width, an unknown hook, empty alphas, a file without
    the named tensor. The message names the field and the fix."""


__all__ += ["PatchscopeError", "SteeringError"]



class MemoryBudgetError(TracekitError, MemoryError):
    """A run that does not fit its memory budget (one row, position or layer needs more than
    ``run.memory_budget`` allows), or a budget that cannot be read. The message says how much is
    needed and which setting to change (:mod:`tracekit.core.budget`)."""


__all__ += ["MemoryBudgetError"]

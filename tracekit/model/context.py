"""The model's context length and the one check every generation and corpus windowing goes through.

A forward pass over more positions than the model's context either fails deep inside the model (a
learned position table, GPT-2's 1024, has no row for position 1024: an ``IndexError``) or runs on
positions the model never saw in training (RoPE extrapolates silently). tracekit refuses both
before any work, at config check time (a :class:`~tracekit.model.ModelInfo` has the config) and
again when a step or engine starts, with a :class:`~tracekit.core.errors.ConfigError` naming the
setting, the model's context and the largest value that fits:

* windows of a corpus (``seq_len``, ``context_size``): :func:`check_window`;
* generation (a prompt then ``max_new_tokens`` / ``n_generate`` new tokens): :func:`check_generation`.
  Generating ``g`` tokens after a prompt of ``n`` runs the model on at most ``n + g - 1`` positions
  (the last generated token is never fed back), so ``n + g - 1 <= n_ctx`` is the exact rule.

The context (:func:`context_length`) is TransformerLens' ``cfg.n_ctx``: the Hugging Face config's
``n_positions`` or ``max_position_embeddings`` (GPT-2 1024, SmolLM2 8192, the tiny test GPT-2 128).
A sliding attention window does not lower it (each token still has its own position up to
``max_position_embeddings``); a RoPE scaling (``yarn``, ``linear``, ``dynamic``, ``longrope``,
``llama3``) that states its ``factor`` and ``original_max_position_embeddings`` raises it to
``factor x original`` where that is larger (Qwen2's YaRN recipe leaves ``max_position_embeddings``
at the original).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from ..core.errors import ConfigError, TracekitError

if TYPE_CHECKING:  # only for the annotations: model.info imports the loader (a cycle at run time)
    from .info import HookedModel

__all__ = ["context_length", "check_context", "check_window", "check_generation"]

#: RoPE scalings whose ``factor x original_max_position_embeddings`` is the positions the model serves.
_SCALED_ROPE = ("yarn", "linear", "dynamic", "longrope", "llama3")


def _scaled_max(rope: Any) -> int:
    """The largest ``factor x original_max_position_embeddings`` of a RoPE parameter dict (or a dict of
    them per layer type, as transformers 5 keeps them); 0 when it states none."""
    if not isinstance(rope, dict):
        return 0
    if any(isinstance(v, dict) for v in rope.values()):
        return max((_scaled_max(v) for v in rope.values()), default=0)
    kind = rope.get("rope_type", rope.get("type"))
    factor, orig = rope.get("factor"), rope.get("original_max_position_embeddings")
    if kind in _SCALED_ROPE and factor and orig:
        return int(float(factor) * int(orig))
    return 0


def context_length(model: HookedModel) -> Optional[int]:
    """The model's context length in tokens, or None when its config does not say.

    ``cfg.n_ctx`` (TransformerLens: the HF config's ``n_positions`` / ``max_position_embeddings``),
    raised to ``factor x original_max_position_embeddings`` for a scaled RoPE (module docstring).
    Works on a loaded bridge and on a :class:`~tracekit.model.ModelInfo` (no weights).

    Args:
        model: anything with a TransformerLens ``cfg``.
    """
    cfg = getattr(model, "cfg", None)
    n = getattr(cfg, "n_ctx", None)
    if not n:
        return None
    scaled = max(_scaled_max(getattr(cfg, "rope_parameters", None)), _scaled_max(getattr(cfg, "rope_scaling", None)))
    return max(int(n), scaled)


def _name(model: HookedModel) -> str:
    spec = getattr(model, "tracekit_spec", None)
    name = getattr(spec, "name", None) or getattr(getattr(model, "cfg", None), "model_name", None)
    return f"model {name!r}" if name else "the model"


def check_context(model: HookedModel, n_positions: int, field: str, what: str, fix: str,
                  error: type[TracekitError] = ConfigError) -> None:
    """Refuse a forward pass over more positions than the model's context (the one check).

    Args:
        model: a hooked model or :class:`~tracekit.model.ModelInfo`.
        n_positions: the most positions one forward pass will hold.
        field: the config field (YAML path) or argument that sets it, quoted first in the message.
        what: how ``n_positions`` comes about, e.g. ``"windows of 200 tokens"``.
        fix: what to change, e.g. ``"set seq_len to at most 128"``.
        error: the class raised (a :class:`TracekitError`; default :class:`ConfigError`).

    Raises:
        ConfigError: (or ``error``) ``n_positions`` is larger than :func:`context_length`; nothing is
            raised when the context is unknown.
    """
    n_ctx = context_length(model)
    if n_ctx is not None and int(n_positions) > n_ctx:
        raise error(f"{field}: {what} need {int(n_positions)} positions, more than {_name(model)}'s context of "
                    f"{n_ctx} tokens (the model has no position beyond it); {fix}")


def check_window(model: HookedModel, seq_len: int, field: str = "seq_len", error: type[TracekitError] = ConfigError) -> None:
    """Refuse corpus windows of ``seq_len`` tokens (BOS included) longer than the model's context.

    Args:
        model: a hooked model or :class:`~tracekit.model.ModelInfo`.
        seq_len: tokens per window.
        field: the config field that sets it (``corpus.seq_len``, ``sae.train.context_size``...).
        error: the class raised (default :class:`ConfigError`).

    Raises:
        ConfigError: (or ``error``) ``seq_len`` > the model's context, naming ``field`` and the limit.
    """
    n_ctx = context_length(model)
    check_context(model, seq_len, field, f"windows of {int(seq_len)} tokens",
                  f"set {field} to at most {n_ctx}", error)


def check_generation(model: HookedModel, prompt_len: int, max_new_tokens: int, field: str = "max_new_tokens",
                     prompt_field: str = "the prompt", error: type[TracekitError] = ConfigError) -> None:
    """Refuse generating ``max_new_tokens`` after a prompt of ``prompt_len`` tokens past the context.

    Generation runs the model on at most ``prompt_len + max_new_tokens - 1`` positions (the last new
    token is not fed back), so that is what must fit.

    Args:
        model: a hooked model or :class:`~tracekit.model.ModelInfo`.
        prompt_len: the prompt's tokens (BOS included).
        max_new_tokens: tokens generated at most.
        field: the config field that sets ``max_new_tokens`` (``generate.max_new_tokens``, ``n_generate``).
        prompt_field: the prompt's field, named in the fix (``prompts[3]``, ``target_prompt``).
        error: the class raised (default :class:`ConfigError`).

    Raises:
        ConfigError: (or ``error``) the generation does not fit, naming both fields and the largest
            ``max_new_tokens`` that fits.
    """
    n_ctx = context_length(model)
    if max_new_tokens < 1 or n_ctx is None:
        return
    room = n_ctx - int(prompt_len) + 1
    fix = (f"set {field} to at most {room} or shorten {prompt_field}" if room >= 1
           else f"shorten {prompt_field} to at most {n_ctx} tokens")
    check_context(model, int(prompt_len) + int(max_new_tokens) - 1, field,
                  f"{prompt_field} ({int(prompt_len)} tokens) then {int(max_new_tokens)} generated tokens", fix, error)

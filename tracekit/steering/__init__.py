"""Steering vectors: add ``alpha x vector`` to the residual stream, measure the dose-response against
norm-matched random directions, and generate text with and without steering.

Methods: ActAdd (Turner et al. 2023, "Activation Addition: Steering Language Models Without
Optimization", arXiv:2308.10248: the difference of the activations of two prompts, added at a layer)
and contrastive activation addition, CAA (Rimsky et al. 2024, arXiv:2312.06681: the mean difference of
residual activations over contrastive pairs, added with a multiplier at every position after the
prompt).

* **vectors** (:class:`SteeringVector`): :func:`mean_difference` (CAA / ActAdd, read at a hook),
  :func:`probe_vector` (a saved ``linear_probe`` direction, :func:`tracekit.probing.load_probe_directions`),
  :func:`sae_vector` (an SAE decoder row ``W_dec[f]``, :func:`tracekit.sae.load.load_sae`),
  :func:`file_vector` (``.pt`` / ``.npy`` / ``.safetensors``); :func:`check_vector` checks the width
  against the hook.
* **steering** (:class:`Steer`, :func:`steer`): a forward hook adding ``alpha x vector`` at absolute
  token positions (BOS counted) of the prompt and/or at every generated token. The hook knows the
  absolute position of the first token of each forward pass (:class:`StepClock`), so it adds at the
  right tokens with the KV cache too (prompt pass: ``seq_len`` = prompt length; later steps: 1).
  Hooks are removed whatever is raised (:func:`tracekit.hooks.fwd_hooks`).
* **dose-response** (:func:`dose_response`): target probability / log-prob / logit difference at each
  alpha for the vector and for ``n_random`` seeded Gaussian directions rescaled to exactly the
  vector's norm (:func:`random_directions`; :data:`DEFAULT_N_RANDOM` of them), rows x alphas x
  directions batched; :func:`control_spread`: the controls' mean, percentile band and max per alpha
  and the vector's rank among them.
* **generation** (:func:`generate`): greedy or seeded sampling (temperature, top-p) with a KV cache,
  the same loop with and without steering.

Why generation is a loop here and not ``TransformerBridge.generate``: with TransformerLens 3.9 and
transformers 5.24, HF's attention modules receive their cache as ``cache=`` while the bridge's
``AttentionBridge._update_kv_cache`` reads ``past_key_values=`` / ``layer_past=``; the cache stays
empty and every cached step attends to its own token only (the bridge's ``generate`` with
``use_past_kv_cache=True`` continues "Paris" with "---------" on SmolLM2). :func:`generate` passes
the cache under both names for the duration of the call (:func:`_kv_cache_names`) and checks after
the prompt pass that the cache holds the prompt; ``use_kv_cache=False`` runs the full sequence each
step (the reference the tests compare against).
"""

from __future__ import annotations

from ..core.errors import SteeringError
from .apply import Steer, StepClock, steer
from .dose import (
    CONTROL_BAND,
    DEFAULT_N_RANDOM,
    DoseResponse,
    SteerRow,
    control_spread,
    dose_response,
    forward_batch,
    sequence_bytes,
)
from .generation import Generation, generate
from .vectors import (
    SteeringVector,
    check_vector,
    file_vector,
    mean_difference,
    probe_vector,
    random_directions,
    sae_vector,
)

__all__ = ["SteeringError", "SteeringVector", "mean_difference", "probe_vector", "sae_vector", "file_vector",
           "check_vector", "random_directions", "StepClock", "Steer", "steer", "SteerRow", "DoseResponse",
           "dose_response", "forward_batch", "sequence_bytes", "Generation", "generate", "control_spread",
           "DEFAULT_N_RANDOM", "CONTROL_BAND"]

"""Greedy or seeded sampled generation with a KV cache, optionally steered."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence, cast

import torch

from ..core.errors import SteeringError
from ..model.context import check_generation
from ..model.info import HookedModel
from ..model.load import model_device
from .apply import Steer, StepClock, steer

__all__ = ["Generation", "generate"]


@dataclass(frozen=True)
class Generation:
    """A generated continuation.

    Attributes:
        prompt_ids: the prompt's ids.
        new_ids: the generated ids (EOS included when it ended there).
        text: the decoded continuation (``new_ids`` only).
    """

    prompt_ids: tuple[int, ...]
    new_ids: tuple[int, ...]
    text: str


@contextlib.contextmanager
def _kv_cache_names(model: HookedModel) -> Iterator[None]:
    """Pass an attention module's ``cache=`` keyword also as ``past_key_values=`` for the block
    (TransformerLens 3.9's ``AttentionBridge`` reads only the latter; transformers 5 passes the former),
    with forward pre-hooks removed on exit whatever is raised."""
    from transformer_lens.model_bridge.generalized_components.attention import (
        AttentionBridge,  # lazy: TransformerLens internals
    )

    def both(module, args, kwargs):
        if kwargs.get("past_key_values") is None and kwargs.get("cache") is not None:
            return args, {**kwargs, "past_key_values": kwargs["cache"]}
        return None

    handles = [m.register_forward_pre_hook(both, with_kwargs=True) for m in cast(Any, model).modules()
               if isinstance(m, AttentionBridge)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _pick(logits: torch.Tensor, do_sample: bool, temperature: float, top_p: Optional[float],
          gen: torch.Generator) -> int:
    """The next token: argmax, or a draw from ``softmax(logits / temperature)`` kept to the top-p nucleus."""
    lg = logits.float()
    if not do_sample:
        return int(lg.argmax())
    probs = torch.softmax(lg / float(temperature), -1)
    if top_p is not None and top_p < 1.0:
        p, idx = probs.sort(descending=True)
        keep = (p.cumsum(-1) - p) < float(top_p)  # the smallest prefix reaching top_p (the first always kept)
        probs = torch.zeros_like(probs).scatter(0, idx[keep], p[keep])
    return int(torch.multinomial(probs / probs.sum(), 1, generator=gen))


@torch.no_grad()
def generate(model: HookedModel, prompt_ids: Sequence[int], max_new_tokens: int = 20, *, do_sample: bool = False,
             temperature: float = 1.0, top_p: Optional[float] = None, seed: int = 0,
             steering: Optional[Steer] = None, use_kv_cache: bool = True, stop_at_eos: bool = True) -> Generation:
    """Generate a continuation of one prompt, greedy or sampled (seeded), optionally steered.

    With the KV cache the prompt pass feeds the whole prompt and each later step one token; the
    steering hook is told the absolute position of the first token fed (:class:`StepClock`), so it
    adds at the same tokens as a full pass would. Sampling draws from a ``torch.Generator`` seeded
    with ``seed`` on the model's device, so the same seed gives the same text with and without
    steering until their distributions differ.

    Args:
        model: a hooked model (TransformerLens bridge).
        prompt_ids: the prompt's token ids (BOS included as the model prepends it).
        max_new_tokens: tokens generated at most.
        do_sample: sample (else greedy argmax).
        temperature: sampling temperature (> 0).
        top_p: nucleus sampling mass in (0, 1] (None: the whole vocabulary).
        seed: the sampling seed.
        steering: what to add while generating (None: plain generation).
        use_kv_cache: reuse keys/values between steps (False: the full sequence every step).
        stop_at_eos: stop after the tokenizer's EOS token.

    Returns:
        A :class:`Generation`.

    Raises:
        SteeringError: bad settings; the KV cache did not fill (the model's attention ignores it:
            run with ``use_kv_cache=False``).
        ConfigError: the prompt and ``max_new_tokens`` do not fit the model's context (at most
            ``len(prompt_ids) + max_new_tokens - 1`` positions are run;
            :func:`tracekit.model.context.check_generation`), before any forward pass.
    """
    if max_new_tokens < 1 or (do_sample and not temperature > 0) or (top_p is not None and not 0 < top_p <= 1):
        raise SteeringError(f"generate: max_new_tokens >= 1, temperature > 0 and top_p in (0, 1] are needed "
                            f"(got {max_new_tokens}, {temperature}, {top_p})")
    check_generation(model, len(prompt_ids), int(max_new_tokens), "max_new_tokens", "prompt_ids")
    dev = model_device(model)
    ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=dev)
    n0 = ids.shape[1]
    gen = torch.Generator(device=dev).manual_seed(int(seed))
    tok = getattr(model, "tokenizer", None)
    eos = getattr(tok, "eos_token_id", None) if stop_at_eos else None
    new: list[int] = []
    with contextlib.ExitStack() as stack:
        clock = stack.enter_context(steer(model, steering, n0)) if steering is not None else StepClock()
        cache = None
        if use_kv_cache:
            from transformers import DynamicCache  # lazy: only for cached generation

            stack.enter_context(_kv_cache_names(model))
            cache = DynamicCache()
        for step in range(int(max_new_tokens)):
            n = ids.shape[1]
            if cache is None:
                clock.offset = 0
                logits = model(ids, return_type="logits")
            elif step == 0:
                clock.offset = 0
                logits = model(ids, return_type="logits", past_key_values=cache, use_cache=True)
                if cache.get_seq_length() != n:
                    raise SteeringError(f"generate: the KV cache holds {cache.get_seq_length()} of the prompt's {n} "
                                        "tokens after the prompt pass (this model's attention ignores it); run with "
                                        "use_kv_cache: false")
            else:
                clock.offset = n - 1
                logits = model(ids[:, -1:], return_type="logits", past_key_values=cache, use_cache=True,
                               attention_mask=torch.ones((1, n), dtype=torch.long, device=dev),
                               position_ids=torch.tensor([[n - 1]], device=dev))
            nxt = _pick(logits[0, -1], do_sample, temperature, top_p, gen)
            new.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]], device=dev)], 1)
            if eos is not None and nxt == eos:
                break
    text = tok.decode(new) if tok is not None else ""
    return Generation(tuple(int(i) for i in prompt_ids), tuple(new), text)

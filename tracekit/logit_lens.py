"""Logit lens: the next-token distribution each hidden state of the residual stream would give.

Method (nostalgebraist, "interpreting GPT: the logit lens", 2020; tuned-lens' ``LogitLens`` in
``tuned_lens/nn/lenses.py``): take the residual stream before/after each block, apply the model's
final norm -- *recomputed* for that vector (:class:`tracekit.model.readout.Readout`) -- and the
unembedding, and read off a distribution over the vocabulary. It answers "at which layer does
' Paris' appear?".

Numbering (docs/glossary.md): a **hidden state** ``h`` is Hugging Face's ``output_hidden_states``
index: ``h = 0`` is the embedding output (``blocks.0.hook_resid_pre``) and ``h >= 1`` the output of
block ``h-1`` (``blocks.{h-1}.hook_resid_post``); the last one equals the model's own output
distribution. A **layer** is a block index. The ``layer_convention`` picks which hidden states are
read: ``hidden_states`` (all ``n_layers + 1``), ``resid_post`` (``1..n_layers``: block outputs) or
``resid_pre`` (``0..n_layers-1``: block inputs).

Landmarks (:func:`landmarks`): the **emergence** hidden state is the first from which the target stays
top-1 through the last one read; the **jump** is the largest one-step gain of the target's
probability between consecutive hidden states read; the block that produced it is the ``jump_layer``
(block ``h-1`` for a gain into hidden state ``h``), and the block whose output first has the target
on top for good is the ``emergence_layer``.

Speed: only the residual hooks read are kept, only at the positions read, and the forward pass ends
after the last block's output (:mod:`tracekit.fastpath`); the model's own output distribution is the
readout of the last block's output (equal to its logits' softmax, tested to 1e-5).

Units: ``prob`` in [0, 1]; ``log_prob`` natural log; ``rank`` is 1 for the top token (1 + the number
of tokens with a strictly larger probability); ``entropy`` in nats.

Notebook use (a doctest, run on a tiny model)::

    >>> from tracekit.logit_lens import logit_lens
    >>> out = logit_lens(model, ["The capital of France is"], targets=[" Paris"])
    >>> p = out[0].target_prob[:, -1, 0]     # [hidden states] p(' Paris') at the last token
    >>> p.shape[0] == model.cfg.n_layers + 1 and bool(((p >= 0) & (p <= 1)).all())
    True
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional, Sequence

import numpy as np
import torch
from jaxtyping import Float, Int

from .core.sites import hook
from .tokens import Position, chunks, parse_position, single_token_id, str_tokens, tokenize

__all__ = ["LayerConvention", "LensPoint", "lens_points", "PromptLens", "logit_lens", "landmarks",
           "emergence_hidden_state", "LENS_POSITIONS"]

LayerConvention = Literal["hidden_states", "resid_post", "resid_pre"]
#: Position forms the lens accepts.
LENS_POSITIONS = ("int", "last", "all")


@dataclass(frozen=True)
class LensPoint:
    """One residual-stream read: its hidden-state index, block index, site and hook name."""

    hidden_state: int
    layer: int
    site: str
    hook: str


def lens_points(n_layers: int, convention: str) -> list[LensPoint]:
    """The residual reads of a layer convention, in order of hidden state.

    Raises:
        ValueError: an unknown convention.
    """
    pre = [LensPoint(L, L, "resid_pre", hook("resid_pre", L)) for L in range(n_layers)]
    post = [LensPoint(L + 1, L, "resid_post", hook("resid_post", L)) for L in range(n_layers)]
    if convention == "hidden_states":
        return pre[:1] + post
    if convention == "resid_post":
        return post
    if convention == "resid_pre":
        return pre
    raise ValueError(f"layer_convention: unknown convention {convention!r}; use hidden_states, resid_post or "
                     "resid_pre")


@dataclass
class PromptLens:
    """The lens of one prompt at the read positions (all tensors on the CPU, float32).

    Attributes:
        prompt, ids, tokens: the prompt, its token ids (BOS included when prepended) and strings.
        positions: the token indices read, ``[P]``.
        points: the residual reads (hidden states), ``[H]``.
        target_ids: ``[T]`` target token ids.
        target_log_prob, target_rank: ``[H, P, T]`` natural-log probability and rank of each target.
        entropy: ``[H, P]`` nats. topk_ids, topk_probs: ``[H, P, k]``.
        final_log_prob: ``[P, T]`` the model's own output for each target; final_topk_ids/probs ``[P, k]``.
    """

    prompt: str
    ids: list[int]
    tokens: list[str]
    positions: list[int]
    points: list[LensPoint]
    target_ids: list[int]
    target_log_prob: Float[torch.Tensor, "hidden pos target"]
    target_rank: Int[torch.Tensor, "hidden pos target"]
    entropy: Float[torch.Tensor, "hidden pos"]
    topk_ids: Int[torch.Tensor, "hidden pos k"]
    topk_probs: Float[torch.Tensor, "hidden pos k"]
    final_log_prob: Float[torch.Tensor, "pos target"]
    final_topk_ids: Int[torch.Tensor, "pos k"]
    final_topk_probs: Float[torch.Tensor, "pos k"]

    @property
    def target_prob(self) -> Float[torch.Tensor, "hidden pos target"]:
        return self.target_log_prob.exp()


@torch.no_grad()
def logit_lens(
    model,
    prompts: Sequence[str],
    targets: Sequence[str] = (),
    position: Position | int | str | list[int] | tuple[int, ...] | range = "last",
    layer_convention: LayerConvention = "hidden_states",
    top_k: int = 10,
    batch_size: int = 8,
    progress=None,
) -> list[PromptLens]:
    """Run the logit lens over prompts (batched with padding; each prompt read at its own tokens).

    Args:
        model: a hooked model (TransformerBridge in compatibility mode).
        prompts: the texts.
        targets: token strings tracked at every read (each exactly one token, leading space included).
        position: ``last`` (default), ``all`` or a token index (negative from the end); from a
            notebook also a list of token indices (e.g. ``range(-16, 0)``: the last 16 tokens), so
            the cost scales with the positions read, not the prompt's length.
        layer_convention: which hidden states are read (module docstring).
        top_k: top tokens kept per read.
        batch_size: prompts per forward pass.
        progress: optional callable receiving the number of prompts finished.

    Returns:
        One :class:`PromptLens` per prompt.

    Raises:
        TokenizationError: a target is not one token, a position out of range, a prompt longer than
            the context.
    """
    from .fastpath import lens_readout, residual_stream

    explicit: list[int] | None = None
    pos: Position | None = None
    if isinstance(position, (list, tuple, range)):
        explicit = [int(i) for i in position]
    else:
        pos = position if isinstance(position, Position) else parse_position(position, LENS_POSITIONS)
    n_layers = int(model.cfg.n_layers)
    points = lens_points(n_layers, layer_convention)
    hooks = [p.hook for p in points]
    last_post = hook("resid_post", n_layers - 1)  # its readout is the model's own output
    read_hooks = hooks + ([] if last_post in hooks else [last_post])
    final_at = read_hooks.index(last_post)
    tgt_ids = [single_token_id(model, t, field="target") for t in targets]
    out: list[PromptLens] = []
    for sl in chunks(len(prompts), batch_size):
        chunk = list(prompts[sl])
        batch = tokenize(model, chunk)
        if explicit is not None:  # token indices (negative from the end), e.g. the last 16 of a long prompt
            reads = [sorted({i % len(batch.ids[b]) for i in explicit}) for b in range(len(chunk))]
        else:
            assert pos is not None  # parsed above when no explicit indices were given
            reads = [pos.resolve(model, p, batch.ids[b], field="position", skip_bos=False) for b, p in enumerate(chunk)]
        width = max(len(r) for r in reads)
        idx = torch.stack([batch.real_index(b)[torch.tensor(r + [r[-1]] * (width - len(r)))]
                           for b, r in enumerate(reads)])  # [b, n_read] padded indices (last repeated)
        resid = residual_stream(model, batch, read_hooks, positions=idx)  # [hooks, b, n_read, d]
        r = lens_readout(model, resid, tgt_ids, top_k)
        for b, prompt in enumerate(chunk):
            n = len(reads[b])
            lens_part = {k: v[: len(hooks), b, :n] for k, v in r.items()}
            final = {k: v[final_at, b, :n] for k, v in r.items()}
            ids = batch.ids[b]
            out.append(PromptLens(prompt, list(ids), str_tokens(model, ids), list(reads[b]), points, tgt_ids,
                                  lens_part["target_log_prob"], lens_part["target_rank"], lens_part["entropy"],
                                  lens_part["top_id"], lens_part["top_prob"], final["target_log_prob"],
                                  final["top_id"], final["top_prob"]))
        if progress is not None:
            progress(len(chunk))
        del resid, r
    return out


def emergence_hidden_state(hidden_states: Sequence[int], ranks: Sequence[int]) -> Optional[int]:
    """First hidden state from which the target stays top-1 through the last one read (None if never)."""
    out = None
    for h, r in zip(reversed(list(hidden_states)), reversed(list(ranks))):
        if int(r) == 1:
            out = int(h)
        else:
            break
    return out


def landmarks(hidden_states: Sequence[int], probs: Sequence[float], ranks: Sequence[int]) -> dict:
    """The emergence and jump of a target's lens curve (module docstring).

    Returns:
        ``{"emergence_hidden_state", "emergence_layer", "jump": {"from_hidden_state",
        "to_hidden_state", "layer", "from_prob", "to_prob", "gain"}, "jump_layer"}``; the layers are
        block indices (None when the landmark is the embedding or does not exist).
    """
    hs = [int(h) for h in hidden_states]
    em = emergence_hidden_state(hs, ranks)
    out: dict = {"emergence_hidden_state": em, "emergence_layer": (em - 1) if em else None}
    if len(hs) > 1:
        gains = np.diff(np.asarray(probs, dtype=float))
        j = int(np.argmax(gains))
        out["jump"] = {"from_hidden_state": hs[j], "to_hidden_state": hs[j + 1], "layer": hs[j + 1] - 1,
                       "from_prob": float(probs[j]), "to_prob": float(probs[j + 1]), "gain": float(gains[j])}
        out["jump_layer"] = hs[j + 1] - 1
    else:
        out["jump"] = None
        out["jump_layer"] = None
    return out

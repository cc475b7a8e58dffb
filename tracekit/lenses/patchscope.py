"""Patchscopes: decode a hidden state by patching it into a target prompt.

Method (Ghandeharioun et al. 2024, "Patchscopes: A Unifying Framework for Inspecting Hidden
Representations of Language Models", arXiv:2401.06102): the hidden state of a *source* prompt at
(hidden state ``h``, position ``p``) replaces the residual stream of a *target* prompt at (target
hidden state ``h*``, target position ``p*``); the target run continues from there, and its
next-token distribution at the target prompt's last token, and a few tokens generated greedily
from it, read out what the hidden state encodes. The default target is the paper's **identity
prompt** :data:`IDENTITY_PROMPT` (``"cat -> cat; 1135 -> 1135; hello -> hello; ?"``) patched at its
last token ``?`` at the same hidden state (``h* = h``): the next-token-prediction Patchscope of the
paper's section 4.1, a lens comparable with the logit lens and the tuned lens
(:func:`patchscope_lens_log_probs`).

Numbering (docs/glossary.md): hidden state ``h = 0`` is the embedding output
(``blocks.0.hook_resid_pre``), ``h >= 1`` the output of block ``h-1``
(``blocks.{h-1}.hook_resid_post``). Patching at target hidden state ``h*`` replaces the residual at
``blocks.{h*}.hook_resid_pre`` (the input of block ``h*``); ``h* = n_layers`` replaces the final
residual (the input of the final norm), so the Patchscope is then just the readout of the patched
vector: with the target position last, the logit lens of the source state.

Where the distribution is read: at the target prompt's **last** token (where the paper reads it and
generation continues). With the default ``target_position = -1`` that is the patched token itself;
a patch at an earlier target position reaches the readout only through attention.

How it runs (two engines, one per need):

* the next-token distribution: the patching engine's replay (:mod:`tracekit.patching.engine`):
  the target prompt is run once (:func:`~tracekit.patching.engine.cache_run`), and every patch is a
  row of a batched replay that starts at block ``h*`` from the cached block input, with the source
  vector written at ``p*`` (rows sorted by ``h*`` join the batch at their block: the staircase;
  out-of-memory halves the batch). Blocks before ``h*`` are not recomputed, so a sweep over all
  hidden states costs about half of one full forward per patch;
* generation (``n_generate > 1``): the replay's cache holds the target prompt only (its block inputs
  -- masks, rotary embeddings -- are for that length), so each further token re-runs the patched
  prefix (target prompt + the tokens generated so far) as a plain batched forward, rows = patches,
  with a hook per target hidden state writing each row's source vector at ``p*``: the patch stays
  in place at every step, exactly as in the paper. The first generated token is the argmax of the
  replayed distribution; tests check both against an unbatched reference (one plain forward, one
  hook, per patch, and a token-by-token generation loop). Cost of ``n_generate = g``: ``g - 1``
  forwards of ``len(target) + g - 1`` tokens per patch; no KV cache (exact, and short prompts).

Units: log-probabilities are natural log, float32, through :class:`tracekit.model.readout.Readout`
(final norm recomputed, output transform included).

Refused: hidden states or target hidden state outside ``0..n_layers``; positions outside the
prompts; models whose blocks read token-dependent inputs besides the residual stream (Gemma 3n /
Gemma 4 per-layer embeddings, Zamba 2's original embeddings): there the residual is not the full
state of a token, and a patched state would be read with the *target* token's side inputs. Parallel
attention/MLP blocks (GPT-J, GPT-NeoX, Falcon) are fine: the residual between blocks is still the
whole state. Recurrent / state-space layers also carry the target's earlier tokens in their state,
as attention does through its keys: that is the target context the method intends.

Notebook use (a doctest, run on a tiny model)::

    >>> from tracekit.lenses.patchscope import patchscope, patchscope_lens_log_probs
    >>> from tracekit.tokens import encode
    >>> ids = encode(model, "The capital of France is")
    >>> out = patchscope(model, ids, [-1], [0, model.cfg.n_layers], n_generate=2, top_k=3)
    >>> out.topk_ids.shape, out.generated.shape
    (torch.Size([2, 1, 3]), torch.Size([2, 1, 2]))
    >>> lp = patchscope_lens_log_probs(model, ids, [-1], [1])
    >>> lp.shape[:2], bool(abs(lp.exp().sum() - 1) < 1e-4)
    (torch.Size([1, 1]), True)
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional, Union, cast

import torch
from jaxtyping import Float, Int

from ..core.errors import MethodRefused, PatchscopeError, TokenizationError
from ..core.sites import hook
from ..fastpath import residual_stream
from ..hooks import fwd_hooks
from ..model.architectures import architecture_name, require
from ..model.context import check_generation
from ..model.info import HookedModel
from ..model.load import model_device
from ..patching.engine import PatchJob, auto_batch_size, cache_run, patch_rows, run_chunked
from ..patching.setters import Site
from ..tokens import check_length, encode, pad_ids

__all__ = ["IDENTITY_PROMPT", "PatchscopeOutput", "patchscope", "patchscope_lens_log_probs", "hidden_state_hook",
           "target_tokens", "patchscope_batch_size"]

#: The paper's identity prompt (section 4.1): few-shot "repeat the token", patched at its last token.
IDENTITY_PROMPT = "cat -> cat; 1135 -> 1135; hello -> hello; ?"

TargetSpec = Union[str, Sequence[int], None]


@dataclass
class PatchscopeOutput:
    """What :func:`patchscope` reads, per source (hidden state, position); CPU tensors.

    ``H`` source hidden states, ``P`` source positions, ``k`` top tokens, ``g`` generated tokens.

    Attributes:
        hidden_states: ``[H]`` the source hidden states (0 = embeddings, h = output of block h-1).
        positions: ``[P]`` the source positions (indices into the source ids, BOS counted, >= 0).
        target_hidden_states: ``[H]`` the target hidden state each source hidden state is patched at.
        target_ids: the target prompt's token ids (BOS included when prepended).
        target_position: the patched target position (index into ``target_ids``, >= 0).
        topk_ids: ``[H, P, k]`` next-token top-k ids at the target's last token.
        topk_probs: ``[H, P, k]`` their probabilities.
        generated: ``[H, P, g]`` greedily generated token ids (the patch kept in place).
        log_probs: ``[H, P, vocab]`` float32 natural-log next-token probabilities (when asked), else None.
    """

    hidden_states: list[int]
    positions: list[int]
    target_hidden_states: list[int]
    target_ids: list[int]
    target_position: int
    topk_ids: Int[torch.Tensor, "hidden pos k"]
    topk_probs: Float[torch.Tensor, "hidden pos k"]
    generated: Int[torch.Tensor, "hidden pos gen"]
    log_probs: Optional[Float[torch.Tensor, "hidden pos vocab"]] = None


def hidden_state_hook(n_layers: int, h: int) -> str:
    """The hook whose output is hidden state ``h``: ``blocks.0.hook_resid_pre`` for ``h = 0``, else
    ``blocks.{h-1}.hook_resid_post`` (equal to the input of block ``h``; ``h = n_layers``: the final
    residual)."""
    return hook("resid_pre", 0) if h == 0 else hook("resid_post", h - 1)


def _as_int(v) -> Optional[int]:
    """``v`` as an int when it is an integer (Python or numpy/torch scalar), else None (bools too)."""
    if isinstance(v, bool):
        return None
    try:
        return operator.index(v)
    except TypeError:
        return None


def _check_hidden(n_layers: int, values: Sequence[int], field: str) -> list[int]:
    out = []
    for i, h in enumerate(values):
        if _as_int(h) is None or not 0 <= int(h) <= n_layers:
            raise PatchscopeError(f"{field}[{i}]: hidden state {h!r} out of range for a {n_layers}-layer model (0 = "
                                f"embeddings .. {n_layers} = output of the last block)")
        out.append(int(h))
    if not out:
        raise PatchscopeError(f"{field}: give at least one hidden state (0..{n_layers})")
    return out


def _check_positions(values: Sequence[int], n: int, field: str) -> list[int]:
    out = []
    for i, p in enumerate(values):
        if _as_int(p) is None or not -n <= int(p) < n:
            raise TokenizationError(f"{field}[{i}]: position {p!r} out of range for a prompt of {n} tokens (use "
                                    f"0..{n - 1}, or -1 for the last)")
        out.append(int(p) % n)
    if not out:
        raise TokenizationError(f"{field}: give at least one position")
    return out


def target_tokens(model: HookedModel, target: TargetSpec = None, field: str = "target_prompt") -> list[int]:
    """The target prompt's token ids: ``None`` = :data:`IDENTITY_PROMPT`; a string is tokenized with
    the model's BOS convention (:func:`tracekit.tokens.encode`); token ids are taken as given.

    Raises:
        TokenizationError: an empty prompt, ids outside the vocabulary, or longer than the context.
    """
    if target is None or isinstance(target, str):
        text = IDENTITY_PROMPT if target is None else target
        ids = encode(model, text)
    else:
        ids = [int(t) for t in target]
        vocab = int(model.cfg.d_vocab)
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise TokenizationError(f"{field}: token ids {bad[:5]} are outside the vocabulary (0..{vocab - 1})")
        text = None
    if not ids:
        raise TokenizationError(f"{field}: the target prompt has no tokens; give a non-empty prompt")
    check_length(model, ids, field, text)
    return ids


def _set_vector(act, rows, index, source, src_rows):
    """Setter of the replay: ``act[rows[i], pos[i]] = source[src_rows[i]]`` (``source`` ``[S, d]``)."""
    act[rows, index["pos"]] = source[src_rows].to(act.dtype)
    return act


#: The replay site: a source vector written into block ``h``'s input at one position.
_SITE = Site("patchscope", "blocks.{layer}.hook_resid_pre", ("pos",), _set_vector, "input",
             description="a source hidden state written into the target's block input at one position")


def _refuse_side_inputs(model: HookedModel, run) -> None:
    varying = run.varying_inputs(torch.tensor([0]), torch.tensor([1]))
    if varying:
        raise MethodRefused(
            f"patchscope is refused on {architecture_name(model)}: its blocks read token-dependent inputs that bypass "
            f"the residual stream ({', '.join(varying[:3])}), so a residual hidden state is not the whole state of a "
            "token and would be decoded with the target token's side inputs.")


@torch.no_grad()
def patchscope(
    model: HookedModel,
    source_ids: Sequence[int],
    source_positions: Sequence[int],
    source_hidden_states: Sequence[int],
    target_ids: TargetSpec = None,
    target_hidden_state: Optional[int] = None,
    target_position: int = -1,
    top_k: int = 10,
    n_generate: int = 5,
    batch_size: Union[int, str] = "auto",
    *,
    log_probs: bool = False,
) -> PatchscopeOutput:
    """Patch each source hidden state at each source position into the target prompt; read the
    next-token distribution at the target's last token and generate greedily (module docstring).

    Args:
        model: a hooked model (TransformerBridge).
        source_ids: the source prompt's token ids (BOS included as the model reads them).
        source_positions: ``[P]`` indices into ``source_ids`` (negative from the end).
        source_hidden_states: ``[H]`` hidden states ``0..n_layers`` to decode.
        target_ids: the target prompt: None (:data:`IDENTITY_PROMPT`), a string (tokenized with the
            model's BOS convention) or token ids.
        target_hidden_state: where in the target the vector is written: None = each source hidden
            state's own (the paper's ``l* = l``), or one hidden state ``0..n_layers`` for all.
        target_position: the target token overwritten (index into the target ids; -1 = last).
        top_k: top next-token ids kept.
        n_generate: tokens generated greedily with the patch in place (0: distribution only).
        batch_size: patches per batch, or ``auto`` (from free memory); capped by the memory budget
            (:func:`patchscope_batch_size`).
        log_probs: also return the full ``[H, P, vocab]`` log-probabilities (``H x P x vocab``
            floats: the caller asks for few positions).

    Returns:
        :class:`PatchscopeOutput`.

    Raises:
        PatchscopeError: a hidden state or target hidden state outside ``0..n_layers``, bad top_k / n_generate.
        TokenizationError: a position outside its prompt, an empty or too long prompt.
        ConfigError: the target prompt and ``n_generate`` do not fit the model's context (the last
            step runs ``len(target) + n_generate - 1`` positions; :func:`tracekit.model.context.check_generation`).
        MethodRefused: a model whose blocks read token-dependent inputs besides the residual stream
            (module docstring), or one whose verification refused patchscope.
        MemoryBudgetError: one patch does not fit ``run.memory_budget`` (before any forward pass).
    """
    n_layers = int(model.cfg.n_layers)
    src = [int(t) for t in source_ids]
    if not src:
        raise TokenizationError("source_ids: the source prompt has no tokens")
    check_length(model, src, "source_ids")
    hs = _check_hidden(n_layers, list(source_hidden_states), "source_hidden_states")
    pos = _check_positions(list(source_positions), len(src), "source_positions")
    tgt = target_tokens(model, target_ids, "target_ids")
    t_pos = _check_positions([target_position], len(tgt), "target_position")[0]
    if target_hidden_state is None:
        t_hs = list(hs)
    else:
        t_hs = [_check_hidden(n_layers, [target_hidden_state], "target_hidden_state")[0]] * len(hs)
    if isinstance(top_k, bool) or int(top_k) < 1:
        raise PatchscopeError(f"top_k: {top_k!r} must be a positive integer")
    if isinstance(n_generate, bool) or int(n_generate) < 0:
        raise PatchscopeError(f"n_generate: {n_generate!r} must be 0 or a positive integer")
    check_generation(model, len(tgt), int(n_generate), "n_generate", "target_ids")
    require(model, "patchscope")
    k = min(int(top_k), int(model.cfg.d_vocab))
    H, P = len(hs), len(pos)
    bs = auto_batch_size(model, len(tgt) + max(0, int(n_generate) - 1)) if batch_size == "auto" else int(batch_size)
    bs = patchscope_batch_size(model, len(tgt) + max(0, int(n_generate) - 1), bs, log_probs)

    # one forward of the source: [H, P, d] hidden states
    uniq = sorted(set(hs))
    batch = pad_ids(model, [src])
    resid = residual_stream(model, batch, [hidden_state_hook(n_layers, h) for h in uniq],
                            positions=torch.tensor([pos], device=batch.tokens.device))[:, 0]  # [U, P, d]
    vectors = resid[[uniq.index(h) for h in hs]].reshape(H * P, -1)  # row r = (hidden r // P, pos r % P)

    # the target run, cached once (a second row with other tokens finds side inputs)
    dev = model_device(model)
    t_tok = torch.tensor([tgt], device=dev)
    run = cache_run(model, torch.cat([t_tok, (t_tok + 1) % int(model.cfg.d_vocab)]))
    _refuse_side_inputs(model, run)
    V = H * P
    layer = torch.tensor([t_hs[r // P] for r in range(V)])
    job = PatchJob(_SITE, layer, {"pos": torch.full((V,), t_pos)}, torch.zeros(V, dtype=torch.long),
                   {h: vectors for h in set(t_hs)}, torch.arange(V))
    vocab = int(model.cfg.d_vocab)

    def metric(logits: torch.Tensor, _rows: torch.Tensor) -> torch.Tensor:
        lp = torch.log_softmax(logits.float(), dim=-1)
        tp, ti = lp.exp().topk(k, dim=-1)
        parts = [tp, ti.float()] + ([lp] if log_probs else [])
        return torch.cat(parts, dim=-1)

    vals = patch_rows(model, run, [job], metric, batch_size=bs, skip_unchanged=False)[0]  # [V, 2k (+ vocab)]
    top_p, top_i = vals[:, :k], vals[:, k:2 * k].long()
    generated = torch.empty(V, max(0, int(n_generate)), dtype=torch.long)
    if n_generate > 0:
        generated[:, 0] = top_i[:, 0]
        if n_generate > 1:
            _generate(model, tgt, t_pos, layer, vectors, generated, bs)
    return PatchscopeOutput(
        hs, pos, t_hs, tgt, t_pos, top_i.reshape(H, P, k), top_p.reshape(H, P, k),
        generated.reshape(H, P, -1), vals[:, 2 * k:].reshape(H, P, vocab) if log_probs else None)


def patchscope_batch_size(model: HookedModel, n_tokens: int, batch_size: int, log_probs: bool = False) -> int:
    """Patches per batch: ``batch_size`` capped by the memory budget. One patch costs a forward pass
    of the target prompt (``n_tokens``: the longest generation step) with its ``[tokens, vocab]``
    logits (:func:`tracekit.model.readout.forward_row_bytes`), the readout of its last token
    (:func:`tracekit.model.readout.readout_bytes`) and, with ``log_probs``, the ``[vocab]``
    log-probabilities kept. Every patch runs the same target prompt (no padding); a capped batch is
    a multiple of :data:`tracekit.model.readout.MIN_READOUT_ROWS` when it can be (batches of 1-3
    patches read the last token through another matmul kernel: the same numbers to ~2e-6).

    Raises:
        MemoryBudgetError: one patch does not fit ``run.memory_budget`` (before any forward pass).
    """
    from ..core.budget import bytes_of, chunk_rows
    from ..model.readout import forward_row_bytes, readout_bytes

    per = forward_row_bytes(model, n_tokens, logits=True) + readout_bytes(model) + (
        bytes_of(int(model.cfg.d_vocab)) if log_probs else 0)
    from ..model.readout import MIN_READOUT_ROWS

    want = max(1, int(batch_size))
    got = chunk_rows(per, want, what="patchscope", device=model_device(model),
                     unit=f"patch ({n_tokens} target tokens)", fix="shorten the target prompt or lower n_generate")
    if got < want and got >= MIN_READOUT_ROWS:  # whole groups: the last token's readout has the bits of a big batch
        got -= got % MIN_READOUT_ROWS
    return got


def _patch_hook(act, hook, rows: torch.Tensor, pos: int, vectors: torch.Tensor):
    act[rows, pos] = vectors.to(act.dtype)
    return act


def _generate(model: HookedModel, tgt: list[int], t_pos: int, layer: torch.Tensor, vectors: torch.Tensor,
              generated: torch.Tensor, batch_size: int) -> None:
    """Fill ``generated[:, 1:]`` greedily: each step re-runs target + generated tokens with every row's
    source vector written at ``t_pos`` of its target hidden state (a hook per hidden state).

    No KV cache: a cached one-token step through TransformerBridge 3.9 did not reproduce the re-run on
    Llama (tiny perturbed models, different tokens), while the re-run is exact by construction."""
    n_layers = int(model.cfg.n_layers)
    dev = model_device(model)
    g = generated.shape[1]
    base = torch.tensor(tgt, device=dev)

    def do(sl: slice) -> None:
        rows = torch.arange(sl.start, sl.stop)
        hooks = []
        for h in layer[rows].unique().tolist():
            local = (layer[rows] == h).nonzero().flatten()
            name = hook("resid_post", n_layers - 1) if h == n_layers else hook("resid_pre", h)
            hooks.append((name, _bind(local.to(dev), t_pos, vectors[rows[local].to(vectors.device)])))
        with fwd_hooks(model, hooks):
            for s in range(1, g):
                toks = torch.cat([base.expand(len(rows), -1), generated[rows, :s].to(dev)], dim=1)
                logits = cast(Any, model)(toks, return_type="logits")
                generated[rows, s] = logits[:, -1].float().argmax(-1).cpu()

    run_chunked(do, generated.shape[0], batch_size)


def _bind(rows: torch.Tensor, pos: int, vectors: torch.Tensor):
    def fn(act, hook):
        return _patch_hook(act, hook, rows, pos, vectors)
    return fn


@torch.no_grad()
def patchscope_lens_log_probs(
    model: HookedModel,
    ids: Sequence[int],
    positions: Sequence[int],
    hidden_states: Sequence[int],
    target: TargetSpec = None,
    batch_size: Union[int, str] = "auto",
) -> Float[torch.Tensor, "hidden pos vocab"]:
    """The next-token-prediction Patchscope as a lens (the paper's section 4.1): each hidden state
    of ``ids`` at each position, patched into the target prompt's last token at the same hidden
    state, read as a next-token distribution.

    Args:
        model: a hooked model (TransformerBridge).
        ids: one prompt's token ids (BOS included as the model reads them).
        positions: ``[P]`` indices into ``ids`` (negative from the end).
        hidden_states: ``[H]`` hidden states ``0..n_layers``.
        target: the target prompt: None (:data:`IDENTITY_PROMPT`), a string or token ids; patched at
            its last token.
        batch_size: patches per batch, or ``auto``.

    Returns:
        ``[H, P, vocab]`` float32 natural-log probabilities on the CPU.

    Raises:
        PatchscopeError / TokenizationError / MethodRefused: as :func:`patchscope`.
    """
    out = patchscope(model, ids, positions, hidden_states, target_ids=target, top_k=1, n_generate=0,
                     batch_size=batch_size, log_probs=True)
    assert out.log_probs is not None
    return out.log_probs.float().cpu()

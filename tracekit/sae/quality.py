"""SAE quality on token windows, with SAELens' metric definitions (``sae_lens.evals``):
reconstruction (MSE, explained variance), sparsity (L0, dead and dense features) and the
downstream CE loss / KL of the model with the SAE spliced in, against zero and mean ablation.

Computed here without SAELens (both TransformerLens stacks); the explained variance is SAELens'
``ExplainedVarianceCalculator`` arithmetic (:class:`ExplainedVariance`, equal to it: tested)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from jaxtyping import Float

from ..core.errors import SAEError
from ..hooks import enabled_hooks
from ..model.context import check_window
from ..model.info import HookedModel
from ..tokens import Batch, forward_kwargs, pad_ids
from .decompose import _flat, sae_terms, splice_hook
from .load import LoadedSAE
from .windows import _corpus_windows, special_token_ids

__all__ = ["ExplainedVariance", "SAEQuality", "eval_seq_len", "eval_windows", "sae_quality"]


class ExplainedVariance:
    """Streaming explained variance (R^2) over batches of vectors, SAELens' definition and arithmetic
    (``sae_lens.evals.ExplainedVarianceCalculator``, v6.54)::

        1 - E||x - x_hat||^2 / (E||x||^2 - ||E x||^2)

    (the total variance summed over dimensions; every vector weighted equally). The per-dimension sum
    of ``x`` is kept on the CPU in float64 and the scalar sums as Python floats, since the total
    variance is a difference of two nearly equal numbers when ``x`` has a large mean. With a total
    variance below 1e-10 it is 1 when the MSE is below 1e-10 too, else 0 (SAELens); 0 with no vector.
    """

    def __init__(self) -> None:
        self.sum_x: torch.Tensor | None = None
        self.sum_squared_norm = 0.0
        self.sum_squared_residual = 0.0
        self.num_samples = 0

    def add_batch(self, sae_output: Float[torch.Tensor, "n d"], hidden_acts: Float[torch.Tensor, "n d"]) -> None:
        """Add ``n`` vectors ``x`` (``hidden_acts``) and their reconstructions ``x_hat`` (``sae_output``).
        Raises nothing."""
        hidden_acts = hidden_acts.to(torch.promote_types(hidden_acts.dtype, torch.float32))
        batch_sum = hidden_acts.sum(dim=0).to(device="cpu", dtype=torch.float64)
        self.sum_x = batch_sum if self.sum_x is None else self.sum_x + batch_sum
        self.sum_squared_norm += hidden_acts.pow(2).sum().item()
        self.sum_squared_residual += (hidden_acts - sae_output).pow(2).sum().item()
        self.num_samples += hidden_acts.shape[0]

    def compute(self) -> float:
        """The explained variance of every vector added (a fraction; 1 is a perfect reconstruction).
        Raises nothing."""
        if self.num_samples == 0 or self.sum_x is None:
            return 0.0
        mean_squared_norm = self.sum_squared_norm / self.num_samples
        mean_x = self.sum_x / self.num_samples
        total_variance = mean_squared_norm - mean_x.pow(2).sum().item()
        mse = self.sum_squared_residual / self.num_samples
        if total_variance < 1e-10:
            return 1.0 if mse < 1e-10 else 0.0
        return 1.0 - mse / total_variance


@dataclass
class SAEQuality:
    """SAE quality on a set of token windows (SAELens' definitions, ``sae_lens.evals``).

    ``metrics``: ``mse`` (``||x - x_hat||^2`` summed over dimensions, mean over tokens),
    ``explained_variance`` (``1 - E||x - x_hat||^2 / (E||x||^2 - ||E x||^2)``, SAELens'
    ``ExplainedVarianceCalculator``), ``l0`` (mean active features per token), ``ce_loss_clean`` /
    ``ce_loss_sae`` / ``ce_loss_zero`` / ``ce_loss_mean`` (nats per predicted token),
    ``ce_loss_recovered`` (``(ce_zero - ce_sae) / (ce_zero - ce_clean)``, SAELens'
    ``ce_loss_score``), ``ce_loss_recovered_mean`` (against mean ablation), ``kl`` (KL(clean ||
    spliced), nats), ``n_dead`` / ``n_dense``, ``n_tokens``.
    ``density``: ``[d_sae]`` fraction of tokens each feature is active on; ``dead``: never active.
    """

    metrics: dict
    density: torch.Tensor
    max_act: torch.Tensor

    def dead(self) -> list[int]:
        return torch.nonzero(self.density == 0).flatten().tolist()

    def dense(self, threshold: float) -> list[int]:
        return torch.nonzero(self.density > threshold).flatten().tolist()


def _ce(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Per-token next-token cross-entropy ``[batch, pos-1]`` (nats)."""
    lp = torch.log_softmax(logits[:, :-1].float(), -1)
    return -lp.gather(-1, tokens[:, 1:, None])[..., 0]


@dataclass
class _Tally:
    """The running per-token sums of :func:`sae_quality`'s two passes over the windows."""

    counts: torch.Tensor  # [d_sae] float64: tokens each feature is active on
    max_act: torch.Tensor  # [d_sae]: largest activation seen
    evc: ExplainedVariance  # SAELens' ExplainedVarianceCalculator arithmetic
    sums: dict = field(default_factory=lambda: {k: 0.0 for k in ("mse", "l0", "ce_clean", "ce_sae", "ce_zero",
                                                                  "ce_mean", "kl")})
    n_tok: int = 0
    n_ce: int = 0
    x_sum: torch.Tensor | None = None
    clean: list = field(default_factory=list)  # per batch: clean log-probs at the counted CE positions (cpu)


def _masks(batch: Batch, special: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(keep, ce_mask)``: ``keep`` ``[batch, pos]`` the real, non-special tokens; ``ce_mask``
    ``[batch, pos-1]`` the positions whose next-token loss counts (token kept, next token real)."""
    real = batch.attention_mask.bool()
    keep = ~torch.isin(batch.tokens.cpu(), special).to(real.device) & real
    ce_mask = keep[:, :-1] & real[:, 1:]
    return keep, ce_mask


def _clean_batch(model: HookedModel, handle: LoadedSAE, batch: Batch, special: torch.Tensor, tally: _Tally) -> None:
    """Pass 1 on one batch: clean logits (CE loss, log-probs kept for the KL), the SAE's
    reconstruction and sparsity statistics, and the activation sum (for the mean ablation)."""
    hook = handle.hook
    keep, ce_mask = _masks(batch, special)
    st: dict = {}

    def grab(act, hook=None, st=st):
        st["x"] = act.detach()
    logits = model.run_with_hooks(batch.tokens, fwd_hooks=[(hook, grab)], **forward_kwargs(batch))
    terms = sae_terms(handle, st["x"])
    k = keep.to(terms.x.device)
    x = terms.x[k].float()
    xh = terms.recon[k].float()
    a = terms.acts[k].float()
    tally.evc.add_batch(sae_output=xh, hidden_acts=x)
    tally.sums["mse"] += float((x - xh).pow(2).sum())
    tally.sums["l0"] += float((a != 0).sum())
    tally.counts += (a != 0).sum(0).double().cpu()
    if len(a):
        tally.max_act = torch.maximum(tally.max_act, a.max(0).values.cpu())
    tally.x_sum = x.sum(0) if tally.x_sum is None else tally.x_sum + x.sum(0)
    tally.n_tok += int(k.sum())
    ce = _ce(logits, batch.tokens)
    tally.sums["ce_clean"] += float(ce[ce_mask].sum())
    tally.n_ce += int(ce_mask.sum())
    tally.clean.append(torch.log_softmax(logits.float(), -1)[:, :-1][ce_mask].cpu())


def _ablation_hooks(handle: LoadedSAE, untouched: torch.Tensor, mean_x: torch.Tensor):
    """``(zero, mean)``: forward hooks replacing the activation by zeros / by ``mean_x`` except at the
    ``untouched`` positions (``[batch, pos]`` bool)."""

    def zero(act, hook=None, untouched=untouched):
        flat = _flat(handle, act)
        out = torch.where(untouched[..., None].to(act.device), flat, torch.zeros_like(flat))
        return out.reshape(act.shape)

    def mean(act, hook=None, untouched=untouched):
        flat = _flat(handle, act)
        out = torch.where(untouched[..., None].to(act.device), flat, mean_x.to(flat.dtype).expand_as(flat))
        return out.reshape(act.shape)

    return zero, mean


def _ablated_batch(model: HookedModel, handle: LoadedSAE, batch: Batch, special: torch.Tensor,
                   mean_x: torch.Tensor, clean_lp: torch.Tensor, tally: _Tally) -> None:
    """Pass 2 on one batch: CE loss with the SAE spliced in (no error term), zero- and mean-ablated,
    and KL(clean || spliced) against the batch's clean log-probs ``clean_lp``."""
    hook = handle.hook
    keep, ce_mask = _masks(batch, special)
    untouched = ~keep
    zero, mean = _ablation_hooks(handle, untouched, mean_x)
    kw = forward_kwargs(batch)
    spliced = model.run_with_hooks(batch.tokens, fwd_hooks=[(hook, splice_hook(handle, use_error=False,
                                                                               keep=untouched))], **kw)
    lz = model.run_with_hooks(batch.tokens, fwd_hooks=[(hook, zero)], **kw)
    lm = model.run_with_hooks(batch.tokens, fwd_hooks=[(hook, mean)], **kw)
    for name, lg in (("ce_sae", spliced), ("ce_zero", lz), ("ce_mean", lm)):
        tally.sums[name] += float(_ce(lg, batch.tokens)[ce_mask].sum())
    ref = clean_lp.to(spliced.device)
    lp = torch.log_softmax(spliced.float(), -1)[:, :-1][ce_mask]
    tally.sums["kl"] += float((ref.exp() * (ref - lp)).sum())


def _quality(tally: _Tally, dense_threshold: float, n_windows: int) -> SAEQuality:
    """The metrics of :class:`SAEQuality` from the tallies of both passes."""
    sums, n_tok, n_ce, counts = tally.sums, tally.n_tok, tally.n_ce, tally.counts
    density = (counts / n_tok).float()
    ce = {k: sums[k] / max(1, n_ce) for k in ("ce_clean", "ce_sae", "ce_zero", "ce_mean")}

    def recovered(abl):
        den = abl - ce["ce_clean"]
        return (abl - ce["ce_sae"]) / den if abs(den) > 1e-12 else float("nan")
    metrics = {
        "mse": sums["mse"] / n_tok, "explained_variance": float(tally.evc.compute()), "l0": sums["l0"] / n_tok,
        "ce_loss_clean": ce["ce_clean"], "ce_loss_sae": ce["ce_sae"], "ce_loss_zero": ce["ce_zero"],
        "ce_loss_mean": ce["ce_mean"], "ce_loss_recovered": recovered(ce["ce_zero"]),
        "ce_loss_recovered_mean": recovered(ce["ce_mean"]), "kl": sums["kl"] / max(1, n_ce),
        "n_dead": int((counts == 0).sum()), "n_dense": int((density > dense_threshold).sum()),
        "dense_threshold": dense_threshold, "n_tokens": n_tok, "n_ce_tokens": n_ce, "n_windows": n_windows,
    }
    return SAEQuality(metrics, density, tally.max_act)


@torch.no_grad()
def sae_quality(model: HookedModel, handle: LoadedSAE, windows: Sequence[Sequence[int]], batch_size: int = 8,
                dense_threshold: float = 0.1, progress: bool = False) -> SAEQuality:
    """Evaluate an SAE spliced into the model on token windows.

    Padding and special tokens are excluded from every metric and left untouched by the splice
    and by the ablations (SAELens' ``exclude_special_tokens`` / ``ignore_tokens`` mask); the CE
    loss counts position ``t`` (predicting token ``t+1``) when token ``t`` is counted and ``t+1``
    is real. The mean ablation replaces the activation by its mean over the counted tokens of all
    windows. Results do not depend on ``batch_size`` (per-token sums).

    Raises:
        SAEError: the windows hold no token to evaluate (all padding or special tokens).
    """
    special = torch.tensor(special_token_ids(model))
    d_sae = handle.d_sae
    tally = _Tally(counts=torch.zeros(d_sae, dtype=torch.float64), max_act=torch.zeros(d_sae),
                   evc=ExplainedVariance())
    batches = [list(windows[i:i + batch_size]) for i in range(0, len(windows), max(1, batch_size))]
    with enabled_hooks(model, [handle.hook]):
        for wins in batches:  # pass 1: clean logits, SAE stats, activation mean
            _clean_batch(model, handle, pad_ids(model, wins), special, tally)
        if tally.n_tok == 0:
            raise SAEError("the evaluation windows hold no token to evaluate (all padding or special tokens)")
        assert tally.x_sum is not None, "pass 1 sums the activations of every counted token"
        mean_x = (tally.x_sum / tally.n_tok)
        for bi, wins in enumerate(batches):  # pass 2: spliced, zero- and mean-ablated runs
            _ablated_batch(model, handle, pad_ids(model, wins), special, mean_x, tally.clean[bi], tally)
    return _quality(tally, dense_threshold, len(windows))


def eval_seq_len(train: Any, context_size: int | None, seq_len: int | None = None) -> int:
    """The window length an SAE is evaluated on: ``seq_len``, else the training spec's
    ``context_size``, else the SAE's recorded context size, else 64.

    Args:
        train: the SAE's training spec (:class:`~tracekit.sae.spec.SAETrainSpec`) or None.
        context_size: the context size the SAE records (``SAEInfo.context_size``) or None.
        seq_len: the configured window length or None.
    """
    return int(seq_len or (train.context_size if train is not None else None) or context_size or 64)


def eval_windows(model: HookedModel, handle: LoadedSAE, corpus: str | list[str] | None = None,
                 max_tokens: int = 4096, seq_len: int | None = None, field: str = "corpus",
                 seq_field: str = "seq_len") -> list[list[int]]:
    """Token windows to evaluate an SAE on: for an SAE trained here with ``corpus`` None, the
    held-out tokens that follow its training tokens; else the first ``max_tokens`` of ``corpus``.
    Windows are ``seq_len`` tokens (default: the SAE's context size, else 64).

    Args:
        model: the hooked model.
        handle: the loaded SAE.
        corpus: the corpus source (None: see above).
        max_tokens: text tokens evaluated at most.
        seq_len: tokens per window (None: the SAE's context size, else 64).
        field: the corpus' config field, named in errors.
        seq_field: the config field of ``seq_len``, named in errors (also when ``seq_len`` is None and the
            SAE's context size is used: setting it is the fix).

    Raises:
        SAEError: the corpus gives no window.
        ConfigError: the windows are longer than the model's context (:func:`eval_seq_len`).
    """
    t = handle.spec.train if handle.spec is not None else None
    L = eval_seq_len(t, handle.info.context_size, seq_len)
    if t is not None and corpus is None:
        wins = _corpus_windows(model, t.corpus, t.context_size, t.dataset_tokens or t.training_tokens,
                               min(max_tokens, t.eval_tokens) if max_tokens else t.eval_tokens, field)
    else:
        check_window(model, L, seq_field)
        wins = _corpus_windows(model, corpus or "stdlib", L, 0, max_tokens, field, seq_field)
    if not wins:
        raise SAEError(f"{field}: no full window of {L} tokens in the corpus; lower seq_len or give more text")
    return wins

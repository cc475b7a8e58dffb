"""The decomposition ``x = sum_f a_f d_f + b + e`` of one activation through an SAE
(:func:`sae_terms`), the forward hook that splices the SAE in (:func:`splice_hook`), and the
attribution of a prompt's target logit to SAE features (:func:`feature_decomposition`; many rows,
each with its own target/foil and read position, in batched passes: :func:`feature_decompositions`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from jaxtyping import Float

from ..activations.chunking import forward_chunk_size, forward_chunks, forward_row_bytes, row_slice
from ..core.errors import SAEError, TokenizationError
from ..core.sites import hook as site_hook
from ..dla import LogitTarget, resolve_target
from ..hooks import enabled_hooks
from ..model.info import HookedModel
from ..model.norms import run_sigma
from ..model.readout import Readout
from ..tokens import Batch, check_length, encode, forward_kwargs, pad_ids, refuse_padding, str_tokens
from .load import LoadedSAE
from .windows import special_token_ids

__all__ = ["FeatureDecomposition", "SAETerms", "effective_decoder", "feature_decomposition", "feature_decompositions",
           "sae_terms", "splice_hook"]


@dataclass
class SAETerms:
    """The SAE's reading of activations ``x`` (flattened to ``[..., d_in]``).

    ``x = recon + error``; ``recon = scale * (acts @ W_eff + b_dec) + shift``, so feature ``f``
    writes ``scale * acts[..., f] * W_eff[f]`` and the decoder-bias term is ``scale * b_dec + shift``.
    """

    x: torch.Tensor
    acts: torch.Tensor
    scale: torch.Tensor
    shift: torch.Tensor
    W_eff: torch.Tensor
    b_dec: torch.Tensor

    @property
    def bias_term(self) -> torch.Tensor:
        return self.scale * self.b_dec + self.shift

    @property
    def recon(self) -> torch.Tensor:
        return self.scale * (self.acts @ self.W_eff + self.b_dec) + self.shift

    @property
    def error(self) -> torch.Tensor:
        return self.x - self.recon


def _flat(handle: LoadedSAE, x: torch.Tensor) -> torch.Tensor:
    """Per-head activations ``[..., head, d_head]`` flattened to ``[..., head * d_head]``."""
    return x.flatten(-2, -1) if x.ndim == 4 else x


def effective_decoder(handle: LoadedSAE) -> Float[torch.Tensor, "d_sae d_in"]:
    """Decoder rows as they write into the activation: ``W_dec`` (divided by its row norms when the
    SAE rescales activations by decoder norm, SAELens TopK). Raises nothing."""
    sae = handle.sae
    W = sae.W_dec
    if sae.rescale_acts_by_decoder_norm:
        W = W / W.norm(dim=-1, keepdim=True)
    return W


@torch.no_grad()
def sae_terms(handle: LoadedSAE, x: Float[torch.Tensor, "... d_in"]) -> SAETerms:
    """Encode ``x`` with the SAE (SAELens' ``encode``, reproduced by
    :class:`~tracekit.dictionaries.Dictionary`: its input normalisation, ``b_dec`` subtraction,
    activation function) and return the linear pieces of its reconstruction.

    Raises:
        SAEError: the activation's width is not the SAE's ``d_in``.
    """
    sae = handle.sae
    x = _flat(handle, x)
    if x.shape[-1] != sae.d_in:
        raise SAEError(f"sae: activation width {x.shape[-1]} != the SAE's d_in {sae.d_in}")
    xs = x.to(sae.W_enc.dtype)
    # encode without keeping the input's normalisation on the module (Dictionary.encode keeps it for
    # a following decode; the decomposition below undoes it itself): pre-activations, then activation
    acts = sae.activate(sae.pre_acts(xs), xs if sae.activation == "gated" else None)
    norm = sae.normalize_activations
    one = torch.ones(xs.shape[:-1] + (1,), dtype=xs.dtype, device=xs.device)
    zero = torch.zeros_like(one)
    if norm == "layer_norm":
        mu = xs.mean(dim=-1, keepdim=True)
        scale, shift = (xs - mu).std(dim=-1, keepdim=True), mu
    elif norm == "constant_norm_rescale":
        scale, shift = xs.norm(dim=-1, keepdim=True) / (sae.d_in ** 0.5), zero
    else:
        scale, shift = one, zero
    return SAETerms(xs, acts, scale, shift, effective_decoder(handle), sae.b_dec)


FeatureEdit = Callable[[torch.Tensor], torch.Tensor]


def splice_hook(handle: LoadedSAE, *, use_error: bool = True, edit: FeatureEdit | None = None,
                add: torch.Tensor | None = None, keep: torch.Tensor | None = None,
                store: dict | None = None):
    """A TransformerLens forward hook that splices the SAE in at its hook.

    Args:
        use_error: with the error term the output is ``x + scale * (acts' - acts) @ W_eff`` (equal to
            ``x`` exactly when nothing is edited); without it, the reconstruction ``x_hat(acts')``.
        edit: ``acts -> acts'`` (``[batch, pos, d_sae]``), e.g. set a feature to 0.
        add: ``[batch, pos, d_in]`` added to the output (steering along decoder rows).
        keep: ``[batch, pos]`` bool, positions left untouched (special tokens, padding).
        store: filled with the :class:`SAETerms` of the clean activation (key ``terms``).
    """

    def hook(act, hook=None):
        shape = act.shape
        terms = sae_terms(handle, act)
        if store is not None:
            store["terms"] = terms
        new = terms.acts if edit is None else edit(terms.acts.clone())
        if use_error:
            out = terms.x + terms.scale * ((new - terms.acts) @ terms.W_eff) if edit is not None else terms.x.clone()
        else:
            out = terms.scale * (new @ terms.W_eff + terms.b_dec) + terms.shift
        if add is not None:
            out = out + add.to(out.dtype)
        if keep is not None:
            out = torch.where(keep[..., None].to(out.device), terms.x, out)
        return out.to(act.dtype).reshape(shape)

    return hook


# =============================================================================================
# decomposition + attribution of prompts


@dataclass
class FeatureDecomposition:
    """One prompt read through the SAE.

    Attributes:
        prompt: the prompt.
        tokens: its tokens, decoded.
        ids: its token ids.
        position: the read position.
        special: per token, whether it is a special token.
        acts: ``[pos, d_sae]`` feature activations. error_norm / x_norm: ``[pos]``.
        metric: the model's target logit (or logit difference) at ``position``.
        direct: ``[d_sae]`` each feature's direct contribution (logits) at ``position`` through the
            frozen final-norm scale; None when the hook is not a residual write of width d_model.
        direct_error / direct_bias / direct_total: the same for the error and decoder-bias terms,
            and for the whole activation (features + error + bias = total).
        total: ``[d_sae]`` activation x gradient of the metric, summed over the non-special
            positions; total_error / total_bias / total_special / total_activation likewise
            (features + error + bias + special = activation).
    """

    prompt: str
    tokens: list[str]
    ids: list[int]
    position: int
    special: list[bool]
    acts: torch.Tensor
    error_norm: torch.Tensor
    x_norm: torch.Tensor
    metric: float
    label: str
    direct: torch.Tensor | None
    direct_error: float
    direct_bias: float
    direct_total: float
    final_scale: float
    total: torch.Tensor
    total_error: float
    total_bias: float
    total_special: float
    total_activation: float


def _metric_fn(target_id: int, foil_id: int | None):
    """``logits_row -> `` the target logit, minus the foil's when there is one."""
    def f(logits_row):
        v = logits_row[target_id].float()
        return v - logits_row[foil_id].float() if foil_id is not None else v
    return f


def _direct_ok(hook: str) -> bool:
    """Whether ``hook`` is a write into the residual stream (so its direct logit effect is defined)."""
    return hook.endswith(("hook_resid_pre", "hook_resid_mid", "hook_resid_post", "hook_attn_out", "hook_mlp_out"))


def _prompt_ids(model: HookedModel, handle: LoadedSAE, prompt: str, position: int,
                field: str) -> tuple[list[int], int]:
    """The prompt's token ids (with the SAE's ``prepend_bos``) and the read position as an index.

    Raises:
        TokenizationError: prompt too long for the model, position out of range.
        SAEError: the prompt is longer than the SAE's training context.
    """
    ids = encode(model, prompt, prepend_bos=handle.info.prepend_bos)
    check_length(model, ids, field, prompt)
    ctx = handle.info.context_size
    if ctx and len(ids) > int(ctx):
        raise SAEError(f"{field}: {prompt[:40]!r}... is {len(ids)} tokens, longer than the SAE's training context "
                       f"({ctx}); its features are not defined beyond it")
    n = len(ids)
    if not -n <= position < n:
        raise TokenizationError(f"position: {position} is out of range for a prompt of {n} tokens")
    return ids, position % n


def _metric_backward(model: HookedModel, handle: LoadedSAE, batch: Batch, ps: Sequence[int],
                     tgts: Sequence[LogitTarget]) -> tuple[dict, torch.Tensor]:
    """Run a padded batch with the activation at the SAE's hook made a grad leaf (``store["x"]``,
    ``[batch, pos, ...]``) and the final norm's input and output recorded (under their hook names),
    then backpropagate the sum over rows of each row's metric at its padded position ``ps[b]`` with
    its own target (rows are independent, so each row's gradient is its own metric's); grads are
    enabled only here. Returns ``(store, metrics [batch])``."""
    store: dict = {}

    def grab(act, hook):
        leaf = act.detach().clone().requires_grad_(True)
        store["x"] = leaf
        return leaf

    def grab_final(act, hook):
        store[hook.name] = act.detach()

    with enabled_hooks(model, [handle.hook]), torch.enable_grad():
        logits = model.run_with_hooks(batch.tokens, fwd_hooks=[(handle.hook, grab),
                                                               (site_hook("final_norm_in"), grab_final),
                                                               (site_hook("final_norm_out"), grab_final)],
                                      **forward_kwargs(batch))
        ms = torch.stack([_metric_fn(t.target_id, t.foil_id)(logits[b, ps[b]]) for b, t in enumerate(tgts)])
        ms.sum().backward()
    return store, ms.detach()


def _total_attribution(terms: SAETerms, grad: torch.Tensor, special: list[bool]) -> dict:
    """Activation x gradient (``grad``: ``[pos, d_in]``) of each term, summed over the non-special
    positions: ``total`` (``[d_sae]``), ``total_error``, ``total_bias``; ``total_special`` (the
    special positions' whole activation) and ``total_activation`` (every position)."""
    acts = terms.acts[0].float()
    W = terms.W_eff.float()
    sc = terms.scale[0].float()
    feat_mask = torch.tensor([not s for s in special], device=acts.device)
    gW = grad @ W.T  # [pos, d_sae]
    per_pos = acts * sc * gW  # [pos, d_sae]
    total = (per_pos * feat_mask[:, None]).sum(0)
    err = terms.error[0].float()
    bias = terms.bias_term[0].float()
    xf = terms.x[0].float()
    dot = lambda v: (v * grad).sum(-1)
    return {"total": total.detach().cpu(), "total_error": float((dot(err) * feat_mask).sum()),
            "total_bias": float((dot(bias.expand_as(err)) * feat_mask).sum()),
            "total_special": float((dot(xf) * ~feat_mask).sum()), "total_activation": float(dot(xf).sum())}


def _direct_attribution(model: HookedModel, handle: LoadedSAE, terms: SAETerms, readout: Readout, sigma: float,
                        p: int, tgt: LogitTarget, special_p: bool) -> dict:
    """Direct logit attribution at position ``p`` through the final-norm scale ``sigma`` of this run:
    ``direct`` (``[d_sae]``, zeros at a special position; None when the hook is not a residual write
    of width d_model), ``direct_error``, ``direct_bias``, ``direct_total`` (NaN then)."""
    acts = terms.acts[0].float()
    W = terms.W_eff.float()
    sc = terms.scale[0].float()
    err = terms.error[0].float()
    bias = terms.bias_term[0].float()
    xf = terms.x[0].float()
    direct = None
    d_err = d_bias = d_tot = float("nan")
    if _direct_ok(handle.hook) and W.shape[-1] == int(model.cfg.d_model):
        ue, _ = readout.direction(tgt.target_id, tgt.foil_id)
        ue = ue.to(W.device)
        inv = 1.0 / sigma
        direct = acts[p] * sc[p] * (W @ ue) * inv
        if special_p:
            direct = torch.zeros_like(direct)
        d_err = float(err[p] @ ue) * inv
        d_bias = float(bias[p] @ ue) * inv if bias.ndim > 1 else float(bias @ ue) * inv
        d_tot = float(xf[p] @ ue) * inv
    return {"direct": None if direct is None else direct.detach().cpu(), "direct_error": d_err,
            "direct_bias": d_bias, "direct_total": d_tot}


def feature_decomposition(model: HookedModel, handle: LoadedSAE, prompt: str, target: str, foil: str | None = None,
                          position: int = -1, field: str = "prompts") -> FeatureDecomposition:
    """Read one prompt through the SAE and attribute the target logit (difference) to its features.

    Tokenized with the SAE's ``prepend_bos`` when it records one. Special tokens (BOS wherever it
    sits) are masked by id: they get no feature rows in rankings and their activation's attribution
    is reported as its own term.

    * direct (Elhage et al. 2021 direct logit attribution through the frozen final-norm scale of
      this run, from the final norm's input and output; :meth:`tracekit.Readout.direction`; under
      a nonlinear output transform such as Gemma 2's soft-cap, of the pre-transform logits): feature ``f`` at the
      read position contributes ``scale * a_f * W_eff[f] . u_eff / sigma`` logits.
    * total (attribution patching, Nanda 2023; Marks et al. 2024 for SAE features): ``a_f * d_f .
      grad_x metric``, summed over positions; grads are enabled only for this call.

    One row of :func:`feature_decompositions`.

    Raises:
        TokenizationError: target/foil not one token, prompt too long, position out of range.
        SAEError: the prompt is longer than the SAE's training context.
    """
    tgt = resolve_target(model, target, foil)
    ids, p = _prompt_ids(model, handle, prompt, position, field)
    return feature_decompositions(model, handle, [ids], [tgt], [p], prompts=[prompt])[0]


def feature_decompositions(model: HookedModel, handle: LoadedSAE, ids: Sequence[Sequence[int]],
                           targets: Sequence[LogitTarget], read_at: Sequence[int], batch_size: int = 8,
                           prompts: Sequence[str] | None = None) -> list[FeatureDecomposition]:
    """:func:`feature_decomposition` of many prepared rows, batched: ``batch_size`` rows per forward
    and backward pass (padded on the right: see the note in the code), each row with its own target /
    foil (its own metric and direction ``u``) read at its own position. Rows are independent (the
    attention mask keeps pads out; the backward pass is of the sum of the rows' metrics), so a row's
    decomposition equals that row run alone (tested with models whose spec pads on the left and on the
    right, BOS on and off).

    Args:
        ids: each row's token ids (with the SAE's BOS setting, e.g. prepared once in a kind).
        targets: each row's :class:`tracekit.dla.LogitTarget` (target and optional foil ids).
        read_at: each row's read position, an index into its own ids (BOS counted).
        prompts: the rows' texts (recorded on the results; default: decoded from the ids).

    Returns:
        One :class:`FeatureDecomposition` per row (``acts``: ``[pos, d_sae]`` over the row's own
        tokens; logits for ``direct`` / ``total``), in input order.

    Memory budget (``run.memory_budget``): each batch of ``batch_size`` rows runs as chunks of rows
    the budget allows (each padded to the batch's width, so every row's numbers are those of the
    unchunked batch). The estimate per row: a forward pass whose every block autograd keeps, with
    the logits and their gradient (:func:`tracekit.activations.chunking.forward_row_bytes`), plus,
    once, the SAE terms of the row being read (``8 x [pos, d_sae]`` float32). The returned ``acts``
    (``[pos, d_sae]`` per row) are the result and not counted.

    Raises:
        TokenizationError: lists of different lengths, a read position outside its row.
        MemoryBudgetError: one row does not fit the budget, before its forward pass.
    """
    n = len(ids)
    if len(targets) != n or len(read_at) != n or (prompts is not None and len(prompts) != n):
        raise TokenizationError(f"feature_decompositions: {n} rows, {len(targets)} targets, {len(read_at)} "
                                "positions; give one of each per row")
    for i, (q, seq) in enumerate(zip(read_at, ids)):
        if not 0 <= int(q) < len(seq):
            raise TokenizationError(f"position: {q} is out of range for row {i}'s {len(seq)} tokens")
    special_ids = set(special_token_ids(model))
    readout = Readout(model)
    out: list[FeatureDecomposition] = []
    size = max(1, int(batch_size))
    for s in range(0, n, size):
        rows = [list(x) for x in ids[s:s + size]]
        # right padding whatever the model spec says: under left padding a pad position's query sees
        # no key, and the backward pass through such fully masked attention rows gives NaN gradients
        # that reach the row's real tokens (seen with PyTorch's SDPA); right padding is exact for a
        # causal model (the pads come after every real token, which never attends to them)
        if len({len(r) for r in rows}) > 1:
            refuse_padding(model, "prompts")
        full = pad_ids(model, rows, "right")
        width = int(full.tokens.shape[1])
        d_sae = handle.d_sae
        per_row = forward_row_bytes(model, width, logits=True, grad_layers=int(model.cfg.n_layers))
        chunk = forward_chunk_size(model, full.size, per_row, fixed=8 * 4 * width * d_sae,
                                   what="SAE feature decomposition",
                                   fix="shorten the prompts (each row's [pos, d_sae] terms are held while it is read)")
        done: dict[int, list[FeatureDecomposition]] = {}

        def run(sl: slice, s=s, rows=rows, full=full, done=done) -> None:
            done[sl.start] = _decompose_rows(model, handle, row_slice(full, sl), rows[sl], s + sl.start, targets,
                                             read_at, prompts, special_ids, readout)

        forward_chunks(run, full.size, chunk, "SAE feature decomposition")
        for k in sorted(done):
            out += done[k]
    return out


def _decompose_rows(model: HookedModel, handle: LoadedSAE, batch: Batch, rows: list[list[int]], s: int,
                    targets: Sequence[LogitTarget], read_at: Sequence[int], prompts: Sequence[str] | None,
                    special_ids: set, readout: Readout) -> list[FeatureDecomposition]:
    """One forward + backward pass of ``batch`` (rows ``s .. s + len(rows)`` of the call, padded on the
    right) and each row's :class:`FeatureDecomposition`."""
    f_in, f_out = site_hook("final_norm_in"), site_hook("final_norm_out")
    out: list[FeatureDecomposition] = []
    ps = [batch.offsets[b] + int(read_at[s + b]) for b in range(batch.size)]
    store, ms = _metric_backward(model, handle, batch, ps, targets[s:s + batch.size])
    x = store["x"]
    grads = x.grad.detach()
    for b, seq in enumerate(rows):
        i, p = s + b, int(read_at[s + b])
        real = batch.real_index(b)
        special = [int(t) in special_ids for t in seq]
        grad = _flat(handle, grads[b, real][None])[0].float()
        terms = sae_terms(handle, x.detach()[b, real][None])
        totals = _total_attribution(terms, grad, special)
        sigma = float("nan")
        if f_in in store and f_out in store:  # the final norm's scale in this row's run
            sigma = float(run_sigma(readout.final_norm, store[f_in][b, ps[b]], store[f_out][b, ps[b]]))
        direct = _direct_attribution(model, handle, terms, readout, sigma, p, targets[i], special[p])
        err = terms.error[0].float()
        xf = terms.x[0].float()
        out.append(FeatureDecomposition(
            prompt=prompts[i] if prompts is not None else "".join(str_tokens(model, seq)),
            tokens=str_tokens(model, seq), ids=list(seq), position=p, special=special,
            acts=terms.acts[0].float().detach().cpu(), error_norm=err.norm(dim=-1).cpu(),
            x_norm=xf.norm(dim=-1).cpu(), metric=float(ms[b]), label=targets[i].label,
            final_scale=1.0 / sigma, **direct, **totals))
    del store, x, grads
    return out

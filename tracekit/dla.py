"""Direct logit attribution: the logit (difference) at a position split into the writes of every
embedding, attention head and MLP (and, on request, every MLP neuron).

Engine of the ``direct_logit_attribution`` kind (:mod:`tracekit.experiments.dla`); neuron-level
readouts and interventions are in :mod:`tracekit.neurons`.

Method (Elhage et al. 2021, "A Mathematical Framework for Transformer Circuits"). The final
residual stream at a position is a sum of writes: the token embedding, the position embedding
(GPT-2), every attention layer's output (= sum over heads of ``z_h W_O^h`` plus ``b_O``) and every
MLP's output (= sum over neurons of ``a_n W_out[n]`` plus ``b_out``). The final norm is linear once
its scale is fixed, so with the *run's own* final-norm scale ``1/sigma`` (``ln_final.hook_scale``
of the same forward pass) each write ``c`` contributes::

    contribution(c) = (centre(c) . (w * u)) / sigma        u = W_U[:, target] - W_U[:, foil]

(:meth:`tracekit.model.readout.Readout.direction`: ``w`` the final norm's weight, ``centre`` the
LayerNorm mean subtraction, nothing for RMSNorm). The parts plus the bias terms (final-norm bias .
u, ``b_U[target] - b_U[foil]``, ``b_O``, ``b_out``) add up to the model's own logit (difference)
*exactly* (tested to 1e-4 in float32 on perturbed GPT-2 / Llama / tied-embedding Llama models,
weight processing on and off). Choice stated: the scale is frozen at the run's value; a
component's contribution is not what the logit would be without it (that moves the scale too:
use :func:`tracekit.neurons.neuron_intervention` for that).

Reference implementation: TransformerLens' ``tools.analysis.direct_logit_attribution`` over
``ActivationCache.decompose_resid`` / ``stack_head_results`` / ``logit_attrs``. Those assume the
final norm's weight is folded into ``W_U`` (``process_weights``); tracekit's numbers equal theirs
on processed models (tested) and stay correct without weight processing, where TransformerLens'
direction misses the norm weight (and bias).

Units: all contributions are **logits**. With ``process_weights`` (centred unembedding) a single
target logit is the logit minus the mean logit of the position; logit differences (with a
``foil``) are unchanged by weight processing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

import numpy as np
import pandas as pd
import torch
from jaxtyping import Float

from .core.sites import check_layers, hook
from .errors import AttributionError, HookError
from .fastpath import activations_at
from .model.architectures import MethodRefused, architecture_name, require
from .model.norms import run_sigma
from .model.readout import Readout
from .model.writepath import WritePath, write_paths
from .tokens import Position, PositionSpec, parse_position, single_token_id, str_tokens, tokenize

__all__ = ["AttributionError", "LogitTarget", "resolve_target", "check_layers", "POSITION_FORMS",
           "as_position", "DirectAttribution", "logit_attribution", "identity_tolerance"]

#: The position forms direct logit attribution and neuron attribution accept.
POSITION_FORMS = ("int", "last", "token:<text>")


# ---------------------------------------------------------------------------------------------
# targets, layers, positions


@dataclass(frozen=True)
class LogitTarget:
    """A target token and an optional foil (the metric is ``logit[target] - logit[foil]``)."""

    target: str
    target_id: int
    foil: Optional[str] = None
    foil_id: Optional[int] = None

    @property
    def label(self) -> str:
        return f"logit({self.target!r})" + (f" - logit({self.foil!r})" if self.foil is not None else "")


def resolve_target(model, target: str, foil: Optional[str] = None) -> LogitTarget:
    """Token ids of ``target`` (and ``foil``); needs only the tokenizer (works on a ``ModelInfo``).

    Raises:
        TokenizationError: ``target``/``foil`` is not exactly one token (message shows the split).
        AttributionError: ``foil`` equals ``target``.
    """
    t = single_token_id(model, target, field="target")
    f = single_token_id(model, foil, field="foil") if foil is not None else None
    if f is not None and f == t:
        raise AttributionError(f"foil: {foil!r} is the same token as target; pick a different foil or drop it")
    return LogitTarget(target, t, foil, f)


def as_position(position: Union[PositionSpec, Position], field: str = "position") -> Position:
    """A :class:`tracekit.tokens.Position` of one of :data:`POSITION_FORMS` (int, ``last``,
    ``token:<text>``).

    Raises:
        TokenizationError: another form, or a bare token string (the message suggests ``token:<text>``).
    """
    if isinstance(position, Position):
        if position.kind not in ("index", "last", "token"):
            parse_position(str(position), POSITION_FORMS, field)  # raises, listing the accepted forms
        return position
    return parse_position(position, POSITION_FORMS, field)


def _resolve_positions(model, prompts: Sequence[str], batch, pos: Position, field: str = "position") -> list[int]:
    """Padded index of ``pos`` in each prompt of ``batch``."""
    return [batch.offsets[b] + pos.resolve(model, p, batch.ids[b], field=field)[0] for b, p in enumerate(prompts)]


# ---------------------------------------------------------------------------------------------
# direct logit attribution


@dataclass
class DirectAttribution:
    """Direct logit attribution of one prompt at one position (all values in logits).

    Attributes:
        logit: the model's own logit (difference) at the position, from its output (after the
            family's output transform, e.g. Gemma 2's soft-cap).
        attributed: the logit (difference) the parts add up to: equal to ``logit`` unless the
            output transform is nonlinear, where it is the **pre-transform** logit (difference)
            (``transform`` says which).
        transform: the model's output transform (``none``, ``logits x m``, ``final logit soft-cap c``).
        final_scale: ``1/sigma`` of the final norm in this run (the scale every part goes through).
        embed, pos_embed: contributions of the token and position embeddings: together the
            stream's start ``blocks.0.hook_resid_pre`` (after any embedding scale or norm).
            ``pos_embed`` is None when the model has no learned position embedding, or when
            ``hook_embed + hook_pos_embed`` is not exactly the start (then ``embed`` is all of it).
        heads: ``[n_layers, n_heads]`` per attention head (``z_h W_O^h``, through the block's
            post-attention norm at this run's scale where the block has one).
        attn_bias: ``[n_layers]`` the ``b_O`` term of each attention layer (and the post-norm's bias).
        attn: ``[n_layers]`` each attention layer's total (``hook_attn_out``) = heads + attn_bias.
        mlp: ``[n_layers]`` each MLP's total (``hook_mlp_out``) = neurons + mlp_bias.
        mlp_bias: ``[n_layers]`` the ``b_out`` term (and the post-MLP norm's bias).
        final_bias: final-norm bias and unembedding bias terms.
        neuron_act / neuron_contrib: ``{layer: [d_mlp]}`` activation (``hook_post``) and
            contribution of each neuron, for the requested layers.
        neuron_value: ``{layer: [d_mlp]}`` logits per unit activation at this run's scales.
        max_error: the largest violation of the sum identities checked in this run (logits).
    """

    prompt: str
    prompt_idx: int
    tokens: list[str]
    position: int
    target: LogitTarget
    logit: float
    final_scale: float
    embed: float
    pos_embed: Optional[float]
    heads: Float[torch.Tensor, "layer head"]
    attn_bias: Float[torch.Tensor, " layer"]
    attn: Float[torch.Tensor, " layer"]
    mlp: Float[torch.Tensor, " layer"]
    mlp_bias: Float[torch.Tensor, " layer"]
    final_bias: float
    neuron_act: dict = field(default_factory=dict)
    neuron_contrib: dict = field(default_factory=dict)
    neuron_value: dict = field(default_factory=dict)
    attributed: Optional[float] = None
    transform: str = "none"
    max_error: float = 0.0

    def __post_init__(self):
        if self.attributed is None:
            self.attributed = self.logit

    def total(self) -> float:
        """Sum of the components plus bias terms (equals :attr:`attributed` up to float rounding)."""
        return float(self.embed + (self.pos_embed or 0.0) + self.attn.sum() + self.mlp.sum() + self.final_bias)

    def components_frame(self) -> pd.DataFrame:
        """One row per component: embed, pos_embed, attn L, mlp L, bias; contributions sum to
        :attr:`attributed` (the logit, or the pre-transform logit under a soft-cap)."""
        base = {"prompt_idx": self.prompt_idx, "position": self.position}
        rows = [{**base, "component": "embed", "kind": "embed", "layer": -1, "contribution": self.embed}]
        if self.pos_embed is not None:
            rows.append({**base, "component": "pos_embed", "kind": "embed", "layer": -1, "contribution": self.pos_embed})
        for L in range(len(self.attn)):
            rows.append({**base, "component": f"attn.{L}", "kind": "attn", "layer": L, "contribution": float(self.attn[L])})
            rows.append({**base, "component": f"mlp.{L}", "kind": "mlp", "layer": L, "contribution": float(self.mlp[L])})
        rows.append({**base, "component": "bias", "kind": "bias", "layer": len(self.attn), "contribution": self.final_bias})
        return pd.DataFrame(rows)

    def heads_frame(self) -> pd.DataFrame:
        """One row per head (``head`` >= 0) plus one ``b_O`` row per layer (``head`` = -1)."""
        rows = []
        nL, nH = self.heads.shape
        for L in range(nL):
            for h in range(nH):
                rows.append({"prompt_idx": self.prompt_idx, "layer": L, "head": h, "component": f"L{L}H{h}",
                             "contribution": float(self.heads[L, h])})
            rows.append({"prompt_idx": self.prompt_idx, "layer": L, "head": -1, "component": f"attn_bias.{L}",
                         "contribution": float(self.attn_bias[L])})
        return pd.DataFrame(rows)

    def neurons_frame(self) -> pd.DataFrame:
        """One row per neuron of the requested layers: activation, logit per unit activation,
        contribution (= activation x logit_per_activation)."""
        frames = []
        for L in sorted(self.neuron_contrib):
            n = len(self.neuron_contrib[L])
            frames.append(pd.DataFrame({
                "prompt_idx": self.prompt_idx, "layer": L, "neuron": np.arange(n),
                "activation": self.neuron_act[L].numpy(), "logit_per_activation": self.neuron_value[L].numpy(),
                "contribution": self.neuron_contrib[L].numpy()}))
        return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(
            columns=["prompt_idx", "layer", "neuron", "activation", "logit_per_activation", "contribution"])


def _vec(obj, name) -> Optional[torch.Tensor]:
    try:
        x = getattr(obj, name)
    except (AttributeError, TypeError):
        return None
    return x.detach().float() if isinstance(x, torch.Tensor) else None


#: Unit roundoff of each dtype (the relative error of one rounding).
UNIT_ROUNDOFF = {torch.float32: 2.0 ** -24, torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8,
                 torch.float64: 2.0 ** -53}


def identity_tolerance(dtype: torch.dtype, magnitude: float, n_terms: int, atol32: float = 1e-3) -> float:
    """Tolerance of a sum identity checked in float32 on activations of ``dtype``.

    float32 (and float64): ``atol32 * max(1, magnitude)``: the model's own additions in float32
    differ from tracekit's float32 sum by far less. float16/bfloat16: the model adds ``n_terms``
    activations, each rounded to the dtype, so the worst-case floating-sum bound
    ``n_terms * u * magnitude`` applies (``u`` = 2^-11 for float16, 2^-8 for bfloat16), with
    ``magnitude`` the sum of the terms' absolute values; ``atol32 * max(1, magnitude)`` is added.
    """
    base = atol32 * max(1.0, float(magnitude))
    u = UNIT_ROUNDOFF.get(dtype, 2.0 ** -24)
    if u <= 2.0 ** -24:
        return base
    return base + float(n_terms) * u * float(magnitude)


def _block_write_paths(model, kind: str, arch: str) -> list[WritePath]:
    """Every block's write path for ``kind`` (``attn`` / ``mlp``); :func:`require` has checked
    that each block writes one."""
    paths = write_paths(model, kind)
    missing = [L for L, wp in enumerate(paths) if wp is None]
    if missing:
        raise AttributionError(f"direct logit attribution is refused on {arch}: block {missing[0]} has no "
                               f"{kind} write path (hook_{kind}_out)")
    return [wp for wp in paths if wp is not None]


def _dtype_of(model) -> torch.dtype:
    try:
        return next(model.parameters()).dtype
    except StopIteration:  # pragma: no cover
        return torch.float32


@torch.no_grad()
def logit_attribution(
    model,
    prompts: Union[str, Sequence[str]],
    target: str,
    foil: Optional[str] = None,
    position: Union[PositionSpec, Position] = "last",
    neuron_layers: Union[str, Sequence[int], None] = (),
    batch_size: int = 8,
    check_atol: float = 1e-3,
) -> list[DirectAttribution]:
    """Split the logit (difference) at ``position`` into embedding / head / MLP / neuron parts.

    Not TransformerLens' ``direct_logit_attribution`` (which returns one stacked tensor and needs
    the final norm folded into ``W_U``): this returns one :class:`DirectAttribution` per prompt,
    with the bias terms, so the parts add up to the model's logit (difference). Every norm between
    a component's write and the logits is applied at this run's frozen scale: the final norm
    (:meth:`tracekit.model.readout.Readout.direction`) and, on sandwich/post-norm blocks (Gemma 2/3,
    OLMo 2, GLM-4), the block's post-attention / post-MLP norm (:mod:`tracekit.model.writepath`); a linear
    output transform (Granite, Cohere) is folded into the direction. Under a nonlinear one
    (Gemma 2's final soft-cap) the parts add up to the **pre-cap** logit (difference), reported as
    ``attributed`` next to the model's ``logit``. Caches only the hooks it reads.

    Three identities are checked on every prompt, in float32, with the tolerance of
    :func:`identity_tolerance` for the model's dtype; a violation raises instead of returning a
    wrong number: the final residual is embed + attention + MLP writes; the parts plus bias terms
    equal ``attributed``; per layer, heads + ``b_O`` equal the attention total and neurons +
    ``b_out`` the MLP total.

    Args:
        model: hooked model (TransformerBridge in compatibility mode, or HookedTransformer).
        prompts: one prompt or several (batched with padding).
        target: the token whose logit is split, e.g. ``" Paris"`` (exactly one token).
        foil: optional second token; the metric becomes ``logit[target] - logit[foil]``.
        position: the read position, a :class:`tracekit.tokens.Position` or its spec: an int (BOS
            counted when prepended; negative from the end), ``"last"``, or ``"token:<text>"``.
        neuron_layers: blocks whose per-neuron contributions to compute (``"all"``, a list, or ()).
        batch_size: prompts per forward pass.
        check_atol: float32 tolerance of the identities, relative to their magnitude when above 1.

    Returns:
        One :class:`DirectAttribution` per prompt (logits).

    Raises:
        TokenizationError: target/foil not one token, or a position that is not in a prompt.
        AttributionError: bad layer, or an identity that does not hold (naming the architecture
            and which identity).
        MethodRefused: a block without attention heads / MLP writes (SSM layers), or MLP neurons
            asked for on a mixture-of-experts MLP.
    """
    # Long (reason): one pass per batch whose terms (heads, biases, post-norm scales, neurons) share per-layer products computed once above the loop; the identity check needs them all in one place.
    tgt = resolve_target(model, target, foil)
    pos = as_position(position)
    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    n_layers = int(model.cfg.n_layers)
    nl = check_layers(model, neuron_layers, "neuron_layers") if neuron_layers not in ((), [], None) else []
    require(model, "direct logit attribution", need=("attn", "mlp", "heads"))
    if nl:
        require(model, "neuron attribution", layers=nl, need=("neurons",))
    readout = Readout(model)
    ue, bias = readout.direction(tgt.target_id, tgt.foil_id)
    fnorm = readout.final_norm
    transform = readout.transform
    arch = architecture_name(model)
    dtype = _dtype_of(model)
    if not fnorm.exact:
        raise AttributionError(f"direct logit attribution is refused on {arch}: its final norm is not an "
                               f"elementwise affine norm (max deviation {fnorm.max_error:.3g}), so a frozen scale "
                               "does not make it linear")
    apaths, mpaths = _block_write_paths(model, "attn", arch), _block_write_paths(model, "mlp", arch)
    for wp in [*apaths, *mpaths]:
        if wp.norm is not None and not wp.norm.exact:
            raise AttributionError(f"direct logit attribution is refused on {arch}: blocks.{wp.layer}.{wp.norm_name} "
                                   "is not an elementwise affine norm")
    has_pos = hook("pos_embed") in model.hook_dict
    names = [hook("embed"), hook("resid_pre", 0), hook("final_norm_in"), hook("final_norm_out")] + (
        [hook("pos_embed")] if has_pos else [])
    for L in range(n_layers):
        names += [hook("head_out", L), *apaths[L].hooks(), *mpaths[L].hooks()]
    names += [hook("neuron", L) for L in nl]
    names = list(dict.fromkeys(names))
    # per-layer weight products with each block's direction (per unit 1/sigma_post), computed once
    WO_u, bO_u, Wout_u, bout_u, apost_b, mpost_b = [], [], {}, [], [], []
    for L in range(n_layers):
        blk = model.blocks[L]
        da = apaths[L].direction(ue)
        dm = mpaths[L].direction(ue)
        W_O = blk.attn.W_O.float()  # [n_heads, d_head, d_model]
        WO_u.append(W_O @ da.to(W_O.device))
        b_O = _vec(blk.attn, "b_O")
        bO_u.append(float(b_O @ da.to(b_O.device)) if b_O is not None else 0.0)
        b_out = _vec(blk.mlp, "b_out")
        bout_u.append(float(b_out @ dm.to(b_out.device)) if b_out is not None else 0.0)
        apost_b.append(apaths[L].bias_logit(ue))
        mpost_b.append(mpaths[L].bias_logit(ue))
        if L in nl:
            W_out = blk.mlp.W_out.float()  # [d_mlp, d_model]
            Wout_u[L] = W_out @ dm.to(W_out.device)

    n_heads = max([int(model.cfg.n_heads)] + [int(w.shape[0]) for w in WO_u])

    def fail(what: str, err: float, tol: float) -> AttributionError:
        cause = (f"this is more than {dtype} rounding can explain (bound {tol:.3g})"
                 if dtype in (torch.float16, torch.bfloat16) else f"tolerance {tol:.3g}")
        return AttributionError(f"direct logit attribution is refused on {arch}: {what} (max error {err:.3g}; "
                                f"{cause}). The architecture writes to the residual stream or the logits through "
                                "something these parts do not see; no numbers are returned.")

    out: list[DirectAttribution] = []
    size = max(1, int(batch_size))
    for s in range(0, len(prompts), size):
        chunk = prompts[s:s + size]
        batch = tokenize(model, chunk)
        ps = _resolve_positions(model, chunk, batch, pos)
        # each hook read at the attributed position only; the forward pass ends at the final norm
        try:
            cache = activations_at(model, batch, [n for n in names if n != hook("pos_embed")],
                                   torch.tensor(ps, device=batch.tokens.device),
                                   optional=[hook("pos_embed")] if has_pos else [])
        except HookError as e:
            raise AttributionError(f"direct logit attribution is refused on {arch}: {e}") from e
        has_pos_b = has_pos and hook("pos_embed") in cache
        for b, prompt in enumerate(chunk):
            p = ps[b]
            resid = cache[hook("final_norm_in")][b].float()
            sigma = float(run_sigma(fnorm, resid, cache[hook("final_norm_out")][b]))
            inv = 1.0 / sigma

            def dot(x, b=b, p=p, inv=inv):
                return float(x[b].float() @ ue.to(x.device)) * inv

            # The stream starts as blocks.0.hook_resid_pre: token (+ position) embeddings after any
            # embedding scale or norm (Gemma's sqrt(d_model), Granite's multiplier, Bloom's LayerNorm).
            # It is split into token and position terms when hook_embed + hook_pos_embed is exactly it.
            start = cache[hook("resid_pre", 0)][b].float()
            embed = dot(cache[hook("resid_pre", 0)])
            pe = None
            if has_pos_b:
                e_pe = cache[hook("embed")][b].float() + cache[hook("pos_embed")][b].float()
                if float((e_pe - start).abs().max()) <= identity_tolerance(dtype, float(start.abs().max()), 2, 1e-5):
                    pe = dot(cache[hook("pos_embed")])
                    embed = embed - pe
            heads = torch.zeros(n_layers, n_heads)
            attn, mlp = torch.zeros(n_layers), torch.zeros(n_layers)
            a_bias, m_bias = torch.zeros(n_layers), torch.zeros(n_layers)
            recon = start.clone()
            terms = [recon.abs().max()]
            na, nc, nv = {}, {}, {}
            worst = 0.0
            for L in range(n_layers):
                ap, mp = apaths[L], mpaths[L]
                a_write = cache[ap.write_hook][b]
                m_write = cache[mp.write_hook][b]
                a_inv = inv / float(ap.sigma(cache[ap.raw_hook][b], a_write))
                m_inv = inv / float(mp.sigma(cache[mp.raw_hook][b], m_write))
                z = cache[hook("head_out", L)][b].float()  # [n_heads, d_head]
                if z.shape != WO_u[L].shape:
                    raise MethodRefused(f"direct logit attribution is refused on {arch}: block {L}'s per-head "
                                        f"outputs (attn.hook_z, {tuple(z.shape)} per position) do not match its W_O "
                                        f"({tuple(WO_u[L].shape)}), so heads cannot be attributed")
                hl = (z * WO_u[L].to(z.device)).sum(-1).cpu() * a_inv
                heads[L, :hl.shape[0]] = hl
                a_bias[L] = bO_u[L] * a_inv + apost_b[L] * inv
                m_bias[L] = bout_u[L] * m_inv + mpost_b[L] * inv
                attn[L] = dot(cache[ap.write_hook])
                mlp[L] = dot(cache[mp.write_hook])
                e = abs(float(hl.sum()) + float(a_bias[L]) - float(attn[L]))
                tol = identity_tolerance(dtype, float(hl.abs().sum()) + abs(float(attn[L])), int(hl.numel()) + 1,
                                         check_atol)
                if e > tol:
                    raise fail(f"the heads of block {L} plus b_O do not add up to its attention output "
                               f"(through {ap.describe()})", e, tol)
                worst = max(worst, e)
                recon = recon + a_write.float() + m_write.float()
                terms += [a_write.float().abs().max(), m_write.float().abs().max()]
                if L in nl:
                    a = cache[hook("neuron", L)][b].float()
                    na[L] = a.cpu()
                    nv[L] = (Wout_u[L] * m_inv).cpu()
                    nc[L] = (a * Wout_u[L].to(a.device) * m_inv).cpu()
                    e = abs(float(nc[L].sum()) + float(m_bias[L]) - float(mlp[L]))
                    tol = identity_tolerance(dtype, float(nc[L].abs().sum()) + abs(float(mlp[L])), a.numel() + 1,
                                             check_atol)
                    if e > tol:
                        raise fail(f"the neurons of block {L} plus b_out do not add up to its MLP output "
                                   f"(through {mp.describe()})", e, tol)
                    worst = max(worst, e)
            err = float((recon - resid).abs().max())
            mag = float(sum(float(t) for t in terms))
            tol = identity_tolerance(dtype, max(mag, float(resid.abs().max())), 2 * n_layers + 2, check_atol)
            if err > tol:
                raise fail("the final residual stream is not embed + attention + MLP outputs", err, tol)
            lg = readout.logits(cache[hook("final_norm_in")][b:b + 1])[0].float()  # the model's own (lens_final)
            logit = float(lg[tgt.target_id] - (lg[tgt.foil_id] if tgt.foil_id is not None else 0.0))
            if transform.linear:
                attributed = logit
            else:
                pl = readout.pre_transform_logits(cache[hook("final_norm_in")][b:b + 1])[0].float()
                attributed = float(pl[tgt.target_id] - (pl[tgt.foil_id] if tgt.foil_id is not None else 0.0))
            d = DirectAttribution(
                prompt=prompt, prompt_idx=s + b, tokens=str_tokens(model, batch.ids[b]),
                position=int(p - batch.offsets[b]), target=tgt, logit=logit, final_scale=inv,
                embed=embed, pos_embed=pe, heads=heads, attn_bias=a_bias, attn=attn,
                mlp=mlp, mlp_bias=m_bias, final_bias=bias,
                neuron_act=na, neuron_contrib=nc, neuron_value=nv, attributed=attributed,
                transform=transform.description)
            parts = [embed, pe or 0.0, *attn.tolist(), *mlp.tolist(), bias]
            e = abs(d.total() - attributed)
            tol = identity_tolerance(dtype, sum(abs(x) for x in parts) + abs(attributed), len(parts), check_atol)
            if e > tol:
                what = "the parts plus bias terms do not add up to the " + (
                    "logit (difference)" if transform.linear else f"pre-transform logit ({transform.description})")
                raise fail(what, e, tol)
            d.max_error = max(worst, e)
            out.append(d)
        del cache
    return out

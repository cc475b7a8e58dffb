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

(:meth:`tracekit.readout.Readout.direction`: ``w`` the final norm's weight, ``centre`` the
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

from .errors import AttributionError
from .readout import Readout
from .tokens import Position, PositionSpec, parse_position, run_with_cache, single_token_id, str_tokens, tokenize

__all__ = ["AttributionError", "LogitTarget", "resolve_target", "check_layers", "POSITION_FORMS",
           "as_position", "DirectAttribution", "logit_attribution"]

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


def check_layers(model, layers: Union[str, int, Sequence[int], None], field: str = "layers") -> list[int]:
    """Block indices: ``"all"``/None -> every block; ints are validated (negative counts from the
    end). Needs only ``model.cfg``.

    Raises:
        AttributionError: a layer index outside ``[-n_layers, n_layers)``, naming the field.
    """
    n = int(model.cfg.n_layers)
    if layers is None or layers == "all":
        return list(range(n))
    if isinstance(layers, (int, np.integer)) and not isinstance(layers, bool):
        layers = [int(layers)]
    if isinstance(layers, str):
        raise AttributionError(f"{field}: {layers!r} is not a layer list; give 'all' or block indices like [8, 9]")
    out = []
    for L in layers:
        if isinstance(L, bool) or not isinstance(L, (int, np.integer)) or not -n <= int(L) < n:
            raise AttributionError(f"{field}: layer {L!r} does not exist; this model has {n} blocks "
                                   f"(0..{n - 1}, or negative from the end, or 'all')")
        out.append(int(L) % n)
    return sorted(set(out))


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
        logit: the model's own logit (difference) at the position, from its output.
        final_scale: ``1/sigma`` of the final norm in this run (the scale every part goes through).
        embed, pos_embed: contributions of the token and position embeddings (pos_embed None when
            the model has no learned position embedding).
        heads: ``[n_layers, n_heads]`` per attention head (``z_h W_O^h``).
        attn_bias: ``[n_layers]`` the ``b_O`` term of each attention layer.
        attn: ``[n_layers]`` each attention layer's total (``hook_attn_out``) = heads + attn_bias.
        mlp: ``[n_layers]`` each MLP's total (``hook_mlp_out``) = neurons + mlp_bias.
        mlp_bias: ``[n_layers]`` the ``b_out`` term.
        final_bias: final-norm bias and unembedding bias terms.
        neuron_act / neuron_contrib: ``{layer: [d_mlp]}`` activation (``hook_post``) and
            contribution of each neuron, for the requested layers.
        neuron_value: ``{layer: [d_mlp]}`` logits per unit activation at this run's scale.
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

    def total(self) -> float:
        """Sum of the components plus bias terms (equals :attr:`logit` up to float rounding)."""
        return float(self.embed + (self.pos_embed or 0.0) + self.attn.sum() + self.mlp.sum() + self.final_bias)

    def components_frame(self) -> pd.DataFrame:
        """One row per component: embed, pos_embed, attn L, mlp L, bias; contributions sum to logit."""
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
    with the bias terms, so the parts add up to the model's logit (difference). Caches only the
    hooks it reads.

    Args:
        model: hooked model (TransformerBridge in compatibility mode, or HookedTransformer).
        prompts: one prompt or several (batched with padding).
        target: the token whose logit is split, e.g. ``" Paris"`` (exactly one token).
        foil: optional second token; the metric becomes ``logit[target] - logit[foil]``.
        position: the read position, a :class:`tracekit.tokens.Position` or its spec: an int (BOS
            counted when prepended; negative from the end), ``"last"``, or ``"token:<text>"``.
        neuron_layers: blocks whose per-neuron contributions to compute (``"all"``, a list, or ()).
        batch_size: prompts per forward pass.
        check_atol: the final residual stream must equal the sum of the parts read to this absolute
            tolerance (relative to its largest entry when that exceeds 1), else the architecture
            writes something this decomposition does not see.

    Returns:
        One :class:`DirectAttribution` per prompt (logits).

    Raises:
        TokenizationError: target/foil not one token, or a position that is not in a prompt.
        AttributionError: bad layer, or an architecture whose residual stream is not embed +
        attention + MLP outputs (e.g. post-norms).
    """
    tgt = resolve_target(model, target, foil)
    pos = as_position(position)
    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    n_layers = int(model.cfg.n_layers)
    nl = check_layers(model, neuron_layers, "neuron_layers") if neuron_layers not in ((), [], None) else []
    ue, bias = Readout(model).direction(tgt.target_id, tgt.foil_id)
    has_pos = "hook_pos_embed" in model.hook_dict
    names = ["hook_embed", "ln_final.hook_scale", "ln_final.hook_in"] + (["hook_pos_embed"] if has_pos else [])
    for L in range(n_layers):
        names += [f"blocks.{L}.attn.hook_z", f"blocks.{L}.hook_attn_out", f"blocks.{L}.hook_mlp_out"]
    names += [f"blocks.{L}.mlp.hook_post" for L in nl]
    # per-layer weight products with the direction, computed once
    WO_u, bO_u, Wout_u, bout_u = [], [], {}, []
    for L in range(n_layers):
        blk = model.blocks[L]
        W_O = blk.attn.W_O.float()  # [n_heads, d_head, d_model]
        WO_u.append(W_O @ ue.to(W_O.device))
        b_O = _vec(blk.attn, "b_O")
        bO_u.append(float(b_O @ ue.to(b_O.device)) if b_O is not None else 0.0)
        b_out = _vec(blk.mlp, "b_out")
        bout_u.append(float(b_out @ ue.to(b_out.device)) if b_out is not None else 0.0)
        if L in nl:
            W_out = blk.mlp.W_out.float()  # [d_mlp, d_model]
            Wout_u[L] = W_out @ ue.to(W_out.device)

    out: list[DirectAttribution] = []
    size = max(1, int(batch_size))
    for s in range(0, len(prompts), size):
        chunk = prompts[s:s + size]
        batch = tokenize(model, chunk)
        ps = _resolve_positions(model, chunk, batch, pos)
        logits, cache = run_with_cache(model, batch, names, strict=False)
        has_pos_b = has_pos and "hook_pos_embed" in cache
        for b, prompt in enumerate(chunk):
            p = ps[b]
            sigma = float(cache["ln_final.hook_scale"][b, p].float().reshape(-1)[0])
            inv = 1.0 / sigma

            def dot(x, b=b, p=p, inv=inv):
                return float(x[b, p].float() @ ue.to(x.device)) * inv

            embed = dot(cache["hook_embed"])
            pe = dot(cache["hook_pos_embed"]) if has_pos_b else None
            heads = torch.zeros(n_layers, int(model.cfg.n_heads))
            attn = torch.zeros(n_layers)
            mlp = torch.zeros(n_layers)
            recon = cache["hook_embed"][b, p].float() + (cache["hook_pos_embed"][b, p].float() if has_pos_b else 0)
            na, nc, nv = {}, {}, {}
            for L in range(n_layers):
                z = cache[f"blocks.{L}.attn.hook_z"][b, p].float()  # [n_heads, d_head]
                heads[L] = (z * WO_u[L].to(z.device)).sum(-1).cpu() * inv
                attn[L] = dot(cache[f"blocks.{L}.hook_attn_out"])
                mlp[L] = dot(cache[f"blocks.{L}.hook_mlp_out"])
                recon = recon + cache[f"blocks.{L}.hook_attn_out"][b, p].float() + cache[f"blocks.{L}.hook_mlp_out"][b, p].float()
                if L in nl:
                    a = cache[f"blocks.{L}.mlp.hook_post"][b, p].float()
                    na[L] = a.cpu()
                    nv[L] = (Wout_u[L] * inv).cpu()
                    nc[L] = (a * Wout_u[L].to(a.device) * inv).cpu()
            resid = cache["ln_final.hook_in"][b, p].float()
            err = float((recon - resid).abs().max())
            if err > check_atol * max(1.0, float(resid.abs().max())):
                raise AttributionError(
                    f"the final residual stream is not embed + attention + MLP outputs (max error {err:.3g}); "
                    "this architecture writes to the residual stream elsewhere (e.g. post-norms), so a "
                    "direct logit attribution by these parts would not add up")
            lg = logits[b, p].float()
            logit = float(lg[tgt.target_id] - (lg[tgt.foil_id] if tgt.foil_id is not None else 0.0))
            out.append(DirectAttribution(
                prompt=prompt, prompt_idx=s + b, tokens=str_tokens(model, batch.ids[b]),
                position=int(p - batch.offsets[b]), target=tgt, logit=logit, final_scale=inv,
                embed=embed, pos_embed=pe, heads=heads, attn_bias=torch.tensor(bO_u) * inv, attn=attn,
                mlp=mlp, mlp_bias=torch.tensor(bout_u) * inv, final_bias=bias,
                neuron_act=na, neuron_contrib=nc, neuron_value=nv))
        del cache, logits
    return out

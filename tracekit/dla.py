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

Datasets: every row has its own target and foil (an IOI row's indirect object and subject), so its
own direction ``u``; :func:`logit_attribution` takes prompt strings (a ``target`` string for every
prompt or a list, one per prompt) or a :class:`tracekit.dataset.PreparedDataset` (ids, targets and
named positions prepared once), and reads all rows in one batched forward pass per ``batch_size``
rows, each at its own position in the padded batch.

Units: all contributions are **logits**. With ``process_weights`` (centred unembedding) a single
target logit is the logit minus the mean logit of the position; logit differences (with a
``foil``) are unchanged by weight processing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, Union, cast

import numpy as np
import pandas as pd
import torch
from jaxtyping import Float

from .activations.cached import CachedActivations
from .core.sites import check_layers, hook
from .dataset import PreparedDataset
from .dataset.targets import (
    DLA_POSITION_FORMS,
    UNIT_POSITION_FORMS,
    LogitTarget,
    as_position,
    resolve_target,
    row_positions,
    row_targets,
)
from .errors import AttributionError, HookError, TokenizationError
from .fastpath import activations_at
from .model.architectures import MethodRefused, architecture_name, require
from .model.info import HookedModel
from .model.norms import run_sigma
from .model.readout import Readout
from .model.writepath import WritePath, write_paths
from .tokens import (
    Position,
    PositionSpec,
    encode_prompts,
    pad_rows,
    str_tokens,
)

__all__ = ["AttributionError", "LogitTarget", "resolve_target", "check_layers", "POSITION_FORMS",
           "DLA_POSITION_FORMS", "as_position", "row_positions", "row_targets", "DirectAttribution",
           "logit_attribution", "identity_tolerance", "dla_batch_size"]

#: The position forms direct logit attribution and neuron attribution accept on prompts (the
#: target and position helpers live in :mod:`tracekit.dataset.targets`, re-exported here).
POSITION_FORMS = UNIT_POSITION_FORMS


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
        row_id: the dataset row's id (:class:`tracekit.dataset.Example`); ``prompt_idx`` (the
            index in the input order) when the input was prompt strings.
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
    row_id: Optional[int] = None

    def __post_init__(self):
        if self.attributed is None:
            self.attributed = self.logit
        if self.row_id is None:
            self.row_id = self.prompt_idx

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


def _block_write_paths(model: HookedModel, kind: str, arch: str) -> list[WritePath]:
    """Every block's write path for ``kind`` (``attn`` / ``mlp``); :func:`require` has checked
    that each block writes one."""
    paths = write_paths(model, kind)
    missing = [L for L, wp in enumerate(paths) if wp is None]
    if missing:
        raise AttributionError(f"direct logit attribution is refused on {arch}: block {missing[0]} has no "
                               f"{kind} write path (hook_{kind}_out)")
    return [wp for wp in paths if wp is not None]


def _dtype_of(model: HookedModel) -> torch.dtype:
    try:
        return next(cast(Any, model).parameters()).dtype  # a loaded bridge's weights
    except StopIteration:  # pragma: no cover
        return torch.float32


@dataclass
class _Direction:
    """One (target, foil) pair's readout direction and its per-layer products with the weights,
    computed once per distinct pair (weights only, no forward pass)."""

    ue: Float[torch.Tensor, " d_model"]
    bias: float
    WO_u: list  # per layer [n_heads, d_head]: W_O^h @ direction through the block's write path
    bO_u: list  # per layer: b_O . direction
    bout_u: list  # per layer: b_out . direction
    apost_b: list  # per layer: the post-attention norm's bias term
    mpost_b: list  # per layer: the post-MLP norm's bias term
    Wout_u: dict  # neuron layer -> [d_mlp]: W_out @ direction


def _direction(model: HookedModel, readout: Readout, tgt: LogitTarget, apaths: list[WritePath], mpaths: list[WritePath],
               nl: Sequence[int]) -> _Direction:
    ue, bias = readout.direction(tgt.target_id, tgt.foil_id)
    WO_u, bO_u, bout_u, apost_b, mpost_b, Wout_u = [], [], [], [], [], {}
    for L in range(int(model.cfg.n_layers)):
        blk = cast(Any, model).blocks[L]  # a loaded bridge's module
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
    return _Direction(ue, bias, WO_u, bO_u, bout_u, apost_b, mpost_b, Wout_u)


@torch.no_grad()
def logit_attribution(
    model: HookedModel,
    prompts: Union[str, Sequence[str], PreparedDataset],
    target: Union[str, Sequence[str], None] = None,
    foil: Union[str, Sequence[str], None] = None,
    position: Union[PositionSpec, Position] = "last",
    neuron_layers: Union[str, Sequence[int], None] = (),
    batch_size: int = 8,
    check_atol: float = 1e-3,
    *,
    read_at: Optional[Sequence[int]] = None,
    keep: Optional[CachedActivations] = None,
) -> list[DirectAttribution]:
    """Split each row's logit (difference) at its read position into embedding / head / MLP /
    neuron parts (Elhage et al. 2021, "A Mathematical Framework for Transformer Circuits").

    Not TransformerLens' ``direct_logit_attribution`` (which returns one stacked tensor and needs
    the final norm folded into ``W_U``): this returns one :class:`DirectAttribution` per row, with
    the bias terms, so the parts add up to the model's logit (difference). Every norm between
    a component's write and the logits is applied at this run's frozen scale: the final norm
    (:meth:`tracekit.model.readout.Readout.direction`) and, on sandwich/post-norm blocks (Gemma 2/3,
    OLMo 2, GLM-4), the block's post-attention / post-MLP norm (:mod:`tracekit.model.writepath`); a linear
    output transform (Granite, Cohere) is folded into the direction. Under a nonlinear one
    (Gemma 2's final soft-cap) the parts add up to the **pre-cap** logit (difference), reported as
    ``attributed`` next to the model's ``logit``. Caches only the hooks it reads.

    **Per-row targets, one batched pass.** Each row has its own direction
    ``u = W_U[:, target_row] - W_U[:, foil_row]`` (through the readout as above), computed once per
    distinct (target, foil) pair from the weights; the activations of all rows come from one
    forward pass per ``batch_size`` rows (padded on the model spec's ``padding_side``, each row read
    at its own padded index), never from one run per row. Rows of a batch are independent: the
    result of a row equals that row run alone (tested with left and right padding, BOS on and off).

    Three identities are checked on every row, in float32, with the tolerance of
    :func:`identity_tolerance` for the model's dtype; a violation raises instead of returning a
    wrong number: the final residual is embed + attention + MLP writes; the parts plus bias terms
    equal ``attributed`` (the row's own logit (difference)); per layer, heads + ``b_O`` equal the
    attention total and neurons + ``b_out`` the MLP total.

    Args:
        model: hooked model (TransformerBridge in compatibility mode, or HookedTransformer).
        prompts: one prompt, several (tokenized here), or a :class:`tracekit.dataset.PreparedDataset`
            whose rows carry their token ids, targets and foils (tokenized once, e.g. in a kind's
            ``prepare``; nothing is tokenized again here).
        target: with prompt strings: the token whose logit is split, e.g. ``" Paris"`` (exactly one
            token), for every prompt; or a list with one token per prompt. None with a dataset.
        foil: optional second token (a string for every prompt or a list, one per prompt); the
            metric becomes ``logit[target] - logit[foil]``. None with a dataset (its rows' foils).
        position: the read position, a :class:`tracekit.tokens.Position` or its spec: an int (an
            index into the row's tokens, BOS counted when prepended; negative from the end),
            ``"last"``, ``"token:<text>"``, or, with a dataset, a named position of its rows
            (``"END"``, ``"IO"``), resolved per row.
        neuron_layers: blocks whose per-neuron contributions to compute (``"all"``, a list, or ()).
        batch_size: rows per forward pass.
        check_atol: float32 tolerance of the identities, relative to their magnitude when above 1.
        read_at: each row's read position as an index into its own ids (BOS counted), already
            resolved (e.g. by :func:`row_positions` in a kind's ``prepare``); overrides ``position``.
        keep: optional :class:`~tracekit.activations.cached.CachedActivations` receiving every hook
            read at each row's attributed position, ``[row, 1, ...]`` per hook name (``hook_embed``,
            ``blocks.0.hook_resid_pre``, ``blocks.L.attn.hook_z`` / head outputs, ``hook_attn_out``,
            ``hook_mlp_out``, the final norm's input and output, ``mlp.hook_post`` of the neuron layers).

    Returns:
        One :class:`DirectAttribution` per row, in input order (logits), each with its ``row_id``.

    Raises:
        TokenizationError: target/foil not one token, or a position that is not in a prompt.
        DatasetError: a named position some row does not have.
        AttributionError: bad layer, target/foil beside a dataset or a dataset row without a target,
            a target list of the wrong length, or an identity that does not hold (naming the
            architecture and which identity).
        MethodRefused: a block without attention heads / MLP writes (SSM layers), or MLP neurons
            asked for on a mixture-of-experts MLP.
        MemoryBudgetError: one row's forward pass does not fit ``run.memory_budget``
            (``batch_size`` is capped by it: :func:`dla_batch_size`).
    """
    # Long (reason): input normalisation (strings, per-row lists, a prepared dataset) then the batched loop; the input half is the piece to share with neuron_contributions.
    # inputs: per row its ids, prompt text, row id, LogitTarget and read position (index into its ids)
    if isinstance(prompts, PreparedDataset):
        data = prompts
        if target is not None or foil is not None:
            raise AttributionError("target/foil beside a dataset: each row carries its own target and foil")
        missing = [e.row_id for e in data.examples if e.target_id is None]
        if missing:
            raise AttributionError(f"rows {missing[:5]} have no target; direct logit attribution splits each row's "
                                   "target logit (give every row a target)")
        row_ids = [e.row_id for e in data.examples]
        texts = data.prompts
        all_ids = [list(e.ids) for e in data.examples]
        pairs: dict[tuple, LogitTarget] = {}
        tgts = [pairs.setdefault((e.target_id, e.foil_id), LogitTarget(str(e.row.target), int(e.target_id or 0),
                                                                         e.row.foil, e.foil_id))
                for e in data.examples]
        pos_of = list(read_at) if read_at is not None else row_positions(model, data, position)
    else:
        texts = [prompts] if isinstance(prompts, str) else list(prompts)
        if not texts:
            raise TokenizationError("prompts: need at least one prompt")
        tgts = row_targets(model, len(texts), target, foil)
        row_ids = list(range(len(texts)))
        all_ids = [list(seq) for seq in encode_prompts(model, texts)]
        if read_at is not None:
            pos_of = list(read_at)
        else:
            pos = as_position(position)
            pos_of = [pos.resolve(model, p, seq, field="position")[0] for p, seq in zip(texts, all_ids)]
    if len(pos_of) != len(all_ids):
        raise AttributionError(f"read_at: {len(pos_of)} indices for {len(all_ids)} rows; give one per row")
    for i, (q, seq) in enumerate(zip(pos_of, all_ids)):
        if not 0 <= int(q) < len(seq):
            raise AttributionError(f"read_at[{i}]: {q} is not an index into row {row_ids[i]}'s {len(seq)} tokens")
    return _attribute(model, texts, all_ids, row_ids, tgts, [int(q) for q in pos_of], neuron_layers,
                      batch_size, check_atol, keep)


def dla_batch_size(model: HookedModel, all_ids: Sequence[Sequence[int]], n_hooks: int, batch_size: int,
                   neurons: bool = False) -> int:
    """Rows per forward pass of direct logit attribution: ``batch_size`` capped by the memory budget.

    One row costs its forward pass at the longest row's length
    (:func:`tracekit.model.readout.forward_row_bytes`) plus the hooks kept at its one attributed
    position (``n_hooks`` vectors of ``max(d_model, d_mlp)`` floats with ``neurons``, else
    ``max(d_model, n_heads x d_head)``) and two vocabulary readouts (the logit and the
    pre-transform logit). Under a budget rows run in smaller padded batches (padded less: the
    numbers can differ in float32 rounding).

    Raises:
        MemoryBudgetError: one row does not fit ``run.memory_budget`` (before any forward pass).
    """
    from .core.budget import bytes_of, chunk_rows
    from .model.load import model_device
    from .model.readout import forward_row_bytes, readout_bytes

    cfg = model.cfg
    T = max((len(x) for x in all_ids), default=1)
    width = max(int(cfg.d_model), int(getattr(cfg, "n_heads", 1)) * int(getattr(cfg, "d_head", 1) or 1))
    if neurons:
        width = max(width, int(getattr(cfg, "d_mlp", None) or 4 * int(cfg.d_model)))
    per_row = forward_row_bytes(model, T) + bytes_of(n_hooks, width)
    return chunk_rows(per_row, max(1, int(batch_size)), what="direct logit attribution", device=model_device(model),
                      fixed=2 * readout_bytes(model), unit=f"row ({T} tokens)", fix="shorten the prompts")


def _attribute(model: HookedModel, texts: Sequence[str], all_ids: Sequence[Sequence[int]], row_ids: Sequence[int],
               tgts: Sequence[LogitTarget], pos_of: Sequence[int], neuron_layers, batch_size: int,
               check_atol: float, keep: Optional[CachedActivations] = None) -> list[DirectAttribution]:
    """The attribution of prepared rows (see :func:`logit_attribution`)."""
    # Long (reason): one pass per batch whose terms (heads, biases, post-norm scales, neurons) share per-layer products computed once per (target, foil) pair; the identity check needs them all in one place.
    n_layers = int(model.cfg.n_layers)
    nl = check_layers(model, neuron_layers, "neuron_layers") if neuron_layers not in ((), [], None) else []
    require(model, "direct logit attribution", need=("attn", "mlp", "heads"))
    if nl:
        require(model, "neuron attribution", layers=nl, need=("neurons",))
    readout = Readout(model)
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
    # each distinct (target, foil) pair's direction and per-layer weight products, computed once
    dirs: dict[tuple, _Direction] = {}
    for t in tgts:
        if (t.target_id, t.foil_id) not in dirs:
            dirs[(t.target_id, t.foil_id)] = _direction(model, readout, t, apaths, mpaths, nl)
    n_heads = max([int(model.cfg.n_heads)] + [int(w.shape[0]) for d in dirs.values() for w in d.WO_u])

    def fail(what: str, err: float, tol: float, row: int) -> AttributionError:
        cause = (f"this is more than {dtype} rounding can explain (bound {tol:.3g})"
                 if dtype in (torch.float16, torch.bfloat16) else f"tolerance {tol:.3g}")
        return AttributionError(f"direct logit attribution is refused on {arch}: {what} (row {row}; max error "
                                f"{err:.3g}; {cause}). The architecture writes to the residual stream or the logits "
                                "through something these parts do not see; no numbers are returned.")

    out: list[DirectAttribution] = []
    size = dla_batch_size(model, all_ids, len(names), batch_size, bool(nl))
    for s in range(0, len(all_ids), size):
        batch = pad_rows(model, all_ids[s:s + size])
        ps = [batch.offsets[b] + pos_of[s + b] for b in range(batch.size)]  # each row's own padded index
        # each hook read at the attributed position only; one forward pass for the whole batch
        try:
            cache = activations_at(model, batch, [n for n in names if n != hook("pos_embed")],
                                   torch.tensor(ps, device=batch.tokens.device),
                                   optional=[hook("pos_embed")] if has_pos else [])
        except HookError as e:
            raise AttributionError(f"direct logit attribution is refused on {arch}: {e}") from e
        has_pos_b = has_pos and hook("pos_embed") in cache
        if keep is not None:  # what was read at the attributed position, [b, 1, ...] (views: no copy on the CPU)
            keep.add({n: v[:, None] for n, v in cache.items()}, [[pos_of[s + b]] for b in range(batch.size)])
        for b in range(batch.size):
            i = s + b
            tgt = tgts[i]
            dr = dirs[(tgt.target_id, tgt.foil_id)]
            ue = dr.ue
            resid = cache[hook("final_norm_in")][b].float()
            sigma = float(run_sigma(fnorm, resid, cache[hook("final_norm_out")][b]))
            inv = 1.0 / sigma

            def dot(x, b=b, inv=inv, ue=ue):
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
                if z.shape != dr.WO_u[L].shape:
                    raise MethodRefused(f"direct logit attribution is refused on {arch}: block {L}'s per-head "
                                        f"outputs (attn.hook_z, {tuple(z.shape)} per position) do not match its W_O "
                                        f"({tuple(dr.WO_u[L].shape)}), so heads cannot be attributed")
                hl = (z * dr.WO_u[L].to(z.device)).sum(-1).cpu() * a_inv
                heads[L, :hl.shape[0]] = hl
                a_bias[L] = dr.bO_u[L] * a_inv + dr.apost_b[L] * inv
                m_bias[L] = dr.bout_u[L] * m_inv + dr.mpost_b[L] * inv
                attn[L] = dot(cache[ap.write_hook])
                mlp[L] = dot(cache[mp.write_hook])
                e = abs(float(hl.sum()) + float(a_bias[L]) - float(attn[L]))
                tol = identity_tolerance(dtype, float(hl.abs().sum()) + abs(float(attn[L])), int(hl.numel()) + 1,
                                         check_atol)
                if e > tol:
                    raise fail(f"the heads of block {L} plus b_O do not add up to its attention output "
                               f"(through {ap.describe()})", e, tol, row_ids[i])
                worst = max(worst, e)
                recon = recon + a_write.float() + m_write.float()
                terms += [a_write.float().abs().max(), m_write.float().abs().max()]
                if L in nl:
                    a = cache[hook("neuron", L)][b].float()
                    na[L] = a.cpu()
                    nv[L] = (dr.Wout_u[L] * m_inv).cpu()
                    nc[L] = (a * dr.Wout_u[L].to(a.device) * m_inv).cpu()
                    e = abs(float(nc[L].sum()) + float(m_bias[L]) - float(mlp[L]))
                    tol = identity_tolerance(dtype, float(nc[L].abs().sum()) + abs(float(mlp[L])), a.numel() + 1,
                                             check_atol)
                    if e > tol:
                        raise fail(f"the neurons of block {L} plus b_out do not add up to its MLP output "
                                   f"(through {mp.describe()})", e, tol, row_ids[i])
                    worst = max(worst, e)
            err = float((recon - resid).abs().max())
            mag = float(sum(float(t) for t in terms))
            tol = identity_tolerance(dtype, max(mag, float(resid.abs().max())), 2 * n_layers + 2, check_atol)
            if err > tol:
                raise fail("the final residual stream is not embed + attention + MLP outputs", err, tol, row_ids[i])
            lg = readout.logits(cache[hook("final_norm_in")][b:b + 1])[0].float()  # the model's own (lens_final)
            logit = float(lg[tgt.target_id] - (lg[tgt.foil_id] if tgt.foil_id is not None else 0.0))
            if transform.linear:
                attributed = logit
            else:
                pl = readout.pre_transform_logits(cache[hook("final_norm_in")][b:b + 1])[0].float()
                attributed = float(pl[tgt.target_id] - (pl[tgt.foil_id] if tgt.foil_id is not None else 0.0))
            d = DirectAttribution(
                prompt=texts[i], prompt_idx=i, tokens=str_tokens(model, batch.ids[b]),
                position=int(pos_of[i]), target=tgt, logit=logit, final_scale=inv,
                embed=embed, pos_embed=pe, heads=heads, attn_bias=a_bias, attn=attn,
                mlp=mlp, mlp_bias=m_bias, final_bias=dr.bias,
                neuron_act=na, neuron_contrib=nc, neuron_value=nv, attributed=attributed,
                transform=transform.description, row_id=int(row_ids[i]))
            parts = [embed, pe or 0.0, *attn.tolist(), *mlp.tolist(), dr.bias]
            e = abs(d.total() - attributed)
            tol = identity_tolerance(dtype, sum(abs(x) for x in parts) + abs(attributed), len(parts), check_atol)
            if e > tol:
                what = "the parts plus bias terms do not add up to the " + (
                    "logit (difference)" if transform.linear else f"pre-transform logit ({transform.description})")
                raise fail(what, e, tol, row_ids[i])
            d.max_error = max(worst, e)
            out.append(d)
        del cache
    return out

"""Direct logit attribution, FFN neurons as key-value memories, and neuron interventions.

Notebook-usable functions behind the ``direct_logit_attribution`` and ``neuron_attribution``
experiment kinds (:mod:`tracekit.experiments.neurons`).

**Direct logit attribution** (Elhage et al. 2021, "A Mathematical Framework for Transformer
Circuits"). The final residual stream at a position is a sum of writes: the token embedding, the
position embedding (GPT-2), every attention layer's output (= sum over heads of ``z_h W_O^h`` plus
``b_O``) and every MLP's output (= sum over neurons of ``a_n W_out[n]`` plus ``b_out``). The final
norm is linear once its scale is fixed, so with the *run's own* final-norm scale ``1/sigma``
(``ln_final.hook_scale`` of the same forward pass) each write ``c`` contributes::

    contribution(c) = (centre(c) . (w * u)) / sigma        u = W_U[:, target] - W_U[:, foil]

where ``w`` is the final norm's weight, ``centre`` subtracts the mean over ``d_model`` for
LayerNorm (nothing for RMSNorm), and ``u`` is the target's unembedding column (minus the foil's).
The parts plus the bias terms (final-norm bias . u, ``b_U[target] - b_U[foil]``, ``b_O``, ``b_out``)
add up to the model's own logit (difference) *exactly* (tested to 1e-4 in float32). Choice stated:
the scale is frozen at the run's value; a component's contribution is not what the logit would be
without it (that would move the scale too: use the interventions for that).

Units: all contributions are **logits**. With ``process_weights`` (TransformerLens' centred
unembedding) a single target logit is the logit minus the mean logit of the position; logit
differences (with a ``foil``) and probabilities are unchanged by weight processing.

**FFN neurons as key-value memories** (Geva et al. 2021, "Transformer Feed-Forward Layers Are
Key-Value Memories"; Geva et al. 2022, "Transformer Feed-Forward Layers Build Predictions by
Promoting Concepts in the Vocabulary Space"). Neuron ``n`` of MLP ``L`` has a key (its input
weights; the activation ``a_n = blocks.L.mlp.hook_post[n]``, i.e. GELU(pre) for GPT-2 and
SiLU(gate) * up for SwiGLU models) and a value (its output row ``W_out[L, n]``). Its direct
contribution is ``a_n * (W_out[L, n] . w * u) / sigma``; the value readout projects ``W_out[L, n]``
onto the vocabulary; the key readout lists its top-activating corpus contexts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Literal, Optional, Sequence, Union

import numpy as np
import pandas as pd
import torch
from jaxtyping import Float
from tqdm.auto import tqdm

from .readout import Readout
from .tokens import forward_kwargs, run_with_cache, single_token_id, str_tokens, tokenize, TokenizationError

__all__ = [
    "AttributionError", "LogitTarget", "resolve_target", "final_norm_params", "logit_direction",
    "DirectAttribution", "direct_logit_attribution", "value_logits", "value_readout", "KeyReadout", "key_readout",
    "neuron_intervention", "random_neurons", "check_layers", "parse_neuron",
]


from .errors import AttributionError  # noqa: E402  (re-exported)


# ---------------------------------------------------------------------------------------------
# targets, directions


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
    """Token ids of ``target`` (and ``foil``).

    Raises:
        TokenizationError: ``target``/``foil`` is not exactly one token (message shows the split).
        AttributionError: ``foil`` equals ``target``.
    """
    t = single_token_id(model, target, field="target")
    f = single_token_id(model, foil, field="foil") if foil is not None else None
    if f is not None and f == t:
        raise AttributionError(f"foil: {foil!r} is the same token as target; pick a different foil or drop it")
    return LogitTarget(target, t, foil, f)


def final_norm_params(model):
    """``(weight, bias or None, is_layernorm)`` of the final norm: :meth:`tracekit.Readout.norm_params`."""
    return Readout(model).norm_params()


def logit_direction(model, tgt: LogitTarget) -> tuple[Float[torch.Tensor, "d_model"], float]:
    """The (target - foil) logit's residual direction and bias: :meth:`tracekit.Readout.direction`."""
    return Readout(model).direction(tgt.target_id, tgt.foil_id)


def _vec(x) -> Optional[torch.Tensor]:
    return x.detach().float() if isinstance(x, torch.Tensor) else None


def _attr(obj, name):
    try:
        return getattr(obj, name)
    except (AttributeError, TypeError):
        return None


def check_layers(model, layers: Union[str, int, Sequence[int], None], field: str = "layers") -> list[int]:
    """``"all"``/None -> every layer; ints are validated (negative counts from the end).

    Raises:
        AttributionError: a layer index outside ``[-n_layers, n_layers)``, naming the field.
    """
    n = int(model.cfg.n_layers)
    if layers is None or layers == "all":
        return list(range(n))
    if isinstance(layers, int):
        layers = [layers]
    out = []
    for L in layers:
        if not isinstance(L, (int, np.integer)) or not -n <= int(L) < n:
            raise AttributionError(f"{field}: layer {L!r} does not exist; this model has {n} layers "
                                   f"(0..{n - 1}, or negative from the end, or 'all')")
        out.append(int(L) % n)
    return sorted(set(out))


def parse_neuron(model, spec, field: str = "neurons") -> tuple[int, int]:
    """``"L.N"``, ``"L5N123"``-free forms: ``"5.123"``, ``[5, 123]`` or ``(5, 123)`` -> ``(5, 123)``.

    Raises:
        AttributionError: malformed spec, unknown layer, or neuron index outside ``[0, d_mlp)``.
    """
    try:
        if isinstance(spec, str):
            L, N = (int(x) for x in spec.replace("L", "").replace("N", ".").strip(".").split("."))
        else:
            L, N = (int(x) for x in spec)
    except (ValueError, TypeError) as e:
        raise AttributionError(f"{field}: {spec!r} is not a neuron; write 'layer.neuron' like '8.1234' "
                               "or a pair [8, 1234]") from e
    L = check_layers(model, [L], field)[0]
    d_mlp = int(model.cfg.d_mlp)
    if not 0 <= N < d_mlp:
        raise AttributionError(f"{field}: neuron {N} does not exist in layer {L}; MLPs have {d_mlp} neurons (0..{d_mlp - 1})")
    return L, N


def _position(batch, b: int, position: int, field: str = "position") -> int:
    idx = batch.real_index(b)
    n = len(idx)
    if not -n <= position < n:
        raise AttributionError(f"{field}: {position} is out of range for a prompt of {n} tokens "
                               f"(use 0..{n - 1} or -1 for the last token)")
    return int(idx[position])


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
    heads: torch.Tensor
    attn_bias: torch.Tensor
    attn: torch.Tensor
    mlp: torch.Tensor
    mlp_bias: torch.Tensor
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


@torch.no_grad()
def direct_logit_attribution(
    model,
    prompts: Union[str, Sequence[str]],
    target: str,
    foil: Optional[str] = None,
    position: int = -1,
    neuron_layers: Union[str, Sequence[int], None] = (),
    batch_size: int = 8,
    check_atol: float = 1e-3,
) -> list[DirectAttribution]:
    """Split the logit (difference) at ``position`` into embedding / head / MLP / neuron parts.

    Method: Elhage et al. 2021 (direct path of the residual stream), through the run's final-norm
    scale (see the module docstring). Caches only the hooks it reads.

    Args:
        model: hooked model (TransformerBridge in compatibility mode, or HookedTransformer).
        prompts: one prompt or several (batched with padding; ``position`` indexes each prompt's
            real tokens, BOS included, -1 = last).
        target: the token whose logit is split, e.g. ``" Paris"`` (exactly one token).
        foil: optional second token; the metric becomes ``logit[target] - logit[foil]``.
        neuron_layers: layers whose per-neuron contributions to compute (``"all"``, a list, or ()).
        check_atol: the residual stream must equal the sum of the parts read to this absolute
            tolerance (float32 rounding is ~1e-6), else the architecture writes something this
            decomposition does not see.

    Returns:
        One :class:`DirectAttribution` per prompt.

    Raises:
        TokenizationError: target/foil not one token. AttributionError: bad layer or position,
        or an architecture whose residual stream is not embed + attn + mlp outputs.
    """
    tgt = resolve_target(model, target, foil)
    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    n_layers = int(model.cfg.n_layers)
    nl = check_layers(model, neuron_layers, "neuron_layers") if neuron_layers not in ((), [], None) else []
    ue, bias = logit_direction(model, tgt)
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
        b_O = _vec(_attr(blk.attn, "b_O"))
        bO_u.append(float(b_O @ ue.to(b_O.device)) if b_O is not None else 0.0)
        b_out = _vec(_attr(blk.mlp, "b_out"))
        bout_u.append(float(b_out @ ue.to(b_out.device)) if b_out is not None else 0.0)
        if L in nl:
            W_out = blk.mlp.W_out.float()  # [d_mlp, d_model]
            Wout_u[L] = W_out @ ue.to(W_out.device)

    out: list[DirectAttribution] = []
    size = max(1, int(batch_size))
    for s in range(0, len(prompts), size):
        chunk = prompts[s:s + size]
        batch = tokenize(model, chunk)
        logits, cache = run_with_cache(model, batch, names, strict=False)
        for b, prompt in enumerate(chunk):
            p = _position(batch, b, position)
            sigma = float(cache["ln_final.hook_scale"][b, p].float().reshape(-1)[0])
            inv = 1.0 / sigma

            def dot(x):
                return float(x[b, p].float() @ ue.to(x.device)) * inv

            embed = dot(cache["hook_embed"])
            has_pos_b = has_pos and "hook_pos_embed" in cache.cache_dict if hasattr(cache, "cache_dict") else has_pos and "hook_pos_embed" in cache
            pos = dot(cache["hook_pos_embed"]) if has_pos_b else None
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
                embed=embed, pos_embed=pos, heads=heads, attn_bias=torch.tensor(bO_u) * inv, attn=attn,
                mlp=mlp, mlp_bias=torch.tensor(bout_u) * inv, final_bias=bias,
                neuron_act=na, neuron_contrib=nc, neuron_value=nv))
        del cache, logits
    return out


# ---------------------------------------------------------------------------------------------
# value readout (Geva et al. 2022)


@torch.no_grad()
def value_logits(model, layer: int, neuron: int) -> Float[torch.Tensor, "d_vocab"]:
    """A neuron's value vector read in vocabulary space: ``(centre(W_out[L, n]) * w) @ W_U``,
    centred over the vocabulary (logits per unit activation at final-norm scale 1; Geva et al. 2022).

    ``value_logits[t] - value_logits[f]`` times ``final_scale`` equals the neuron's
    ``logit_per_activation`` in :func:`direct_logit_attribution` for target t and foil f (tested).

    Raises:
        AttributionError: unknown layer or neuron.
    """
    L, N = parse_neuron(model, (layer, neuron), "neuron")
    return Readout(model).vocab_projection(model.blocks[L].mlp.W_out[N]).cpu()


@torch.no_grad()
def value_readout(model, layer: int, neuron: int, k: int = 10, sign: float = 1.0) -> pd.DataFrame:
    """Tokens a neuron's value vector ``W_out[layer, neuron]`` promotes and suppresses most.

    Geva et al. 2022 project each FFN value vector onto the vocabulary. Here the projection goes
    through the final norm's weight (and LayerNorm's centring), i.e. it is the neuron's direct
    effect on every logit per unit activation with the final-norm scale set to 1, centred over the
    vocabulary so that ``process_weights`` does not change it.

    Args:
        layer, neuron: which neuron (validated).
        k: tokens per side.
        sign: multiply by the sign of the neuron's activation in a context (``-1`` for a negative
            SwiGLU activation) so ``promoted`` means promoted in that context.

    Returns:
        DataFrame with ``layer, neuron, side ('promoted'|'suppressed'), rank, token, token_id,
        logit_per_activation`` (logits per unit activation at final scale 1).

    Raises:
        AttributionError: unknown layer or neuron.
    """
    L, N = parse_neuron(model, (layer, neuron), "neuron")
    scores = value_logits(model, L, N) * (1.0 if sign >= 0 else -1.0)
    k = min(int(k), scores.numel())
    rows = []
    tok = model.tokenizer
    for side, (vals, idx) in (("promoted", scores.topk(k)), ("suppressed", (-scores).topk(k))):
        for r, (val, i) in enumerate(zip(vals.tolist(), idx.tolist())):
            rows.append({"layer": L, "neuron": N, "side": side, "rank": r + 1, "token": tok.decode([i]),
                         "token_id": int(i), "logit_per_activation": val if side == "promoted" else -val})
    return pd.DataFrame(rows)


# ---------------------------------------------------------------------------------------------
# key readout (Geva et al. 2021)


@dataclass
class KeyReadout:
    """Top-activating corpus contexts of some neurons.

    Attributes:
        contexts: ``layer, neuron, rank, activation, token, context, doc_id, window, position``;
            ``context`` marks the token as ``[[token]]`` with text on both sides.
        means: ``{(layer, neuron): mean activation over the corpus' text tokens}`` (BOS excluded).
        n_tokens: text tokens read; n_windows: windows read.
    """

    contexts: pd.DataFrame
    means: dict
    n_tokens: int
    n_windows: int


class _StopForward(Exception):
    """Raised by a hook once the last needed activation is stored (skips the rest of the model)."""


def _activations_until(model, batch, names: list[str]) -> dict:
    """Run ``batch`` and return the named activations, stopping the forward pass right after the
    last of them fires (no later blocks, no unembedding). Hooks are removed even when stopped."""
    store: dict = {}
    last = names[-1]

    def grab(act, hook):
        store[hook.name] = act.detach()
        if hook.name == last:
            raise _StopForward

    try:
        model.run_with_hooks(batch.tokens, fwd_hooks=[(n, grab) for n in names], **forward_kwargs(batch))
    except _StopForward:
        pass
    missing = [n for n in names if n not in store]
    if missing:
        raise AttributionError(f"the model never produced the activations {missing}")
    return store


def _context(model, ids, p, n_prefix, before, after) -> tuple[str, str]:
    tok = model.tokenizer
    left = tok.decode(list(ids[max(n_prefix, p - before):p]))
    mid = tok.decode([ids[p]])
    right = tok.decode(list(ids[p + 1:p + 1 + after]))
    clean = lambda s: s.replace("\n", " ")  # noqa: E731
    return mid, clean(left) + "[[" + clean(mid) + "]]" + clean(right)


@torch.no_grad()
def key_readout(
    model,
    neurons: Sequence,
    corpus=None,
    *,
    top_n: int = 10,
    seq_len: int = 64,
    batch_size: int = 16,
    max_tokens: Optional[int] = 12288,
    signs: Optional[Sequence[float]] = None,
    context_before: int = 12,
    context_after: int = 4,
    jsonl_field: str = "text",
    progress: bool = True,
) -> KeyReadout:
    """Top-activating contexts of neurons over a corpus (Geva et al. 2021's key readout).

    Streams the corpus (:mod:`tracekit.corpus`) in padded batches; the forward pass stops after
    the deepest requested layer; only ``blocks.L.mlp.hook_post`` of the needed layers is cached
    and only the running top ``top_n`` per neuron is kept, so memory is bounded. Results do not
    depend on ``batch_size`` (tested).

    Args:
        neurons: ``(layer, neuron)`` pairs or ``"L.N"`` strings.
        corpus: ``None``/``"stdlib"`` (offline default), a text/JSONL file, a directory, or a list.
        top_n: contexts per neuron.
        seq_len, batch_size, max_tokens: window length (BOS included), windows per forward pass,
            and the cap on text tokens read (None: the whole corpus).
        signs: per neuron, ``+1`` ranks by the largest activation, ``-1`` by the most negative
            (SwiGLU activations can be negative). Default all ``+1``.
        context_before, context_after: tokens of text shown around the activating token.

    Raises:
        AttributionError: bad neuron spec. CorpusError: unreadable corpus.
    """
    from .corpus import iter_documents, token_windows, window_batches

    specs = [parse_neuron(model, n) for n in neurons]
    if not specs:
        raise AttributionError("neurons: give at least one neuron")
    signs_t = torch.tensor([1.0 if (signs is None or s >= 0) else -1.0 for s in (signs or [1.0] * len(specs))])
    if len(signs_t) != len(specs):
        raise AttributionError("signs: need one sign per neuron")
    layers = sorted({L for L, _ in specs})
    names = [f"blocks.{L}.mlp.hook_post" for L in layers]
    N = len(specs)
    best_v = torch.full((N, top_n), float("-inf"))
    best_w = torch.full((N, top_n), -1, dtype=torch.long)
    best_p = torch.full((N, top_n), -1, dtype=torch.long)
    sums = torch.zeros(N, dtype=torch.float64)
    count = 0
    windows: dict[int, object] = {}
    n_windows = 0
    docs = iter_documents(corpus, jsonl_field=jsonl_field)
    wins = token_windows(model, docs, seq_len=seq_len, max_tokens=max_tokens)
    bar = tqdm(total=max_tokens, desc="key readout", unit="tok", disable=not progress, leave=False)
    for batch, group in window_batches(model, wins, batch_size):
        cache = _activations_until(model, batch, names)
        acts = torch.stack([cache[f"blocks.{L}.mlp.hook_post"][..., n].float().cpu() for L, n in specs], -1)  # [B,P,N]
        valid = batch.attention_mask.bool().cpu().clone()
        valid[:, : group[0].n_prefix] = False  # BOS (windows are right-padded, BOS first)
        sums += (acts * valid[..., None]).sum((0, 1)).double()
        ntok = int(valid.sum())
        count += ntok
        vals = (acts * signs_t).masked_fill(~valid[..., None], float("-inf"))  # [B,P,N]
        B, P, _ = vals.shape
        wid = torch.tensor([w.window for w in group]).repeat_interleave(P)
        pid = torch.arange(P).repeat(B)
        cand_v = torch.cat([best_v, vals.reshape(B * P, N).T], 1)
        cand_w = torch.cat([best_w, wid.expand(N, -1)], 1)
        cand_p = torch.cat([best_p, pid.expand(N, -1)], 1)
        # deterministic order: activation desc, then window, then position (exact ties happen
        # when two windows share a prefix)
        o1 = torch.sort(cand_w * (P + seq_len + 1) + cand_p, dim=1, stable=True).indices
        o2 = torch.sort(cand_v.gather(1, o1), dim=1, descending=True, stable=True).indices
        order = o1.gather(1, o2)[:, :top_n]
        best_v, best_w, best_p = cand_v.gather(1, order), cand_w.gather(1, order), cand_p.gather(1, order)
        for w in group:
            windows[w.window] = w
        keep = set(best_w[torch.isfinite(best_v)].tolist())
        windows = {k: v for k, v in windows.items() if k in keep}
        n_windows += len(group)
        bar.update(ntok)
        del cache
    bar.close()
    rows = []
    for j, (L, n) in enumerate(specs):
        for r in range(best_v.shape[1]):
            if not torch.isfinite(best_v[j, r]):
                continue
            w = windows[int(best_w[j, r])]
            p = int(best_p[j, r])
            token, ctx = _context(model, w.ids, p, w.n_prefix, context_before, context_after)
            rows.append({"layer": L, "neuron": n, "rank": r + 1, "activation": float(best_v[j, r] * signs_t[j]),
                         "token": token, "context": ctx, "doc_id": w.doc_id, "window": w.window, "position": p})
    means = {(L, n): float(sums[j] / max(1, count)) for j, (L, n) in enumerate(specs)}
    cols = ["layer", "neuron", "rank", "activation", "token", "context", "doc_id", "window", "position"]
    return KeyReadout(pd.DataFrame(rows, columns=cols), means, count, n_windows)


# ---------------------------------------------------------------------------------------------
# interventions


def random_neurons(model, like: Sequence[tuple[int, int]], seed: int = 0, exclude: Iterable = ()) -> list[tuple[int, int]]:
    """As many random neurons per layer as ``like`` has, avoiding ``exclude`` (a control set)."""
    g = np.random.default_rng(seed)
    d_mlp = int(model.cfg.d_mlp)
    ex = set(map(tuple, exclude)) | set(map(tuple, like))
    out = []
    for L in sorted({L for L, _ in like}):
        k = sum(1 for l2, _ in like if l2 == L)
        pool = np.array([n for n in range(d_mlp) if (L, n) not in ex])
        out += [(L, int(n)) for n in g.choice(pool, size=min(k, len(pool)), replace=False)]
    return out


def _metrics(logits_row: torch.Tensor, tgt: LogitTarget) -> dict:
    lg = logits_row.float()
    lp = torch.log_softmax(lg, -1)
    out = {"target_prob": float(lp[tgt.target_id].exp()), "target_log_prob": float(lp[tgt.target_id]),
           "target_logit": float(lg[tgt.target_id])}
    if tgt.foil_id is not None:
        out["foil_prob"] = float(lp[tgt.foil_id].exp())
        out["logit_diff"] = float(lg[tgt.target_id] - lg[tgt.foil_id])
    else:
        out["logit_diff"] = out["target_logit"]
    return out


@torch.no_grad()
def neuron_intervention(
    model,
    prompt: str,
    target: str,
    neurons: Sequence,
    mode: Literal["zero", "mean", "scale"] = "zero",
    foil: Optional[str] = None,
    means: Optional[dict] = None,
    factor: float = 2.0,
    positions: Literal["last", "all"] = "last",
    position: int = -1,
    freeze_downstream: bool = False,
    clean_metrics: Optional[dict] = None,
) -> dict:
    """Set some neurons' activations and measure the target (Geva et al. 2022's interventions).

    Args:
        prompt: one prompt. target/foil: as in :func:`direct_logit_attribution`.
        neurons: ``(layer, neuron)`` pairs or ``"L.N"`` strings.
        mode: ``zero`` (activation := 0), ``mean`` (:= ``means[(L, n)]``, e.g. the corpus mean from
            :func:`key_readout`), ``scale`` (activation *= ``factor``; amplification when > 1).
        positions: intervene at the read position only (``last``) or at every position (``all``).
        freeze_downstream: keep every later attention/MLP output, the other neurons of the edited
            layers and the final-norm scale at their clean values, so only the direct path
            changes; then a zero-ablation moves the logit by exactly minus the neurons' summed
            direct contributions (tested).
        clean_metrics: the ``clean`` dict of an earlier call on the same prompt/target, to skip the
            clean forward pass (ignored with ``freeze_downstream``).

    Returns:
        ``{"clean": metrics, "patched": metrics, "delta": patched - clean}`` where metrics are
        ``target_prob`` (probability), ``target_log_prob`` (nats), ``target_logit``, ``logit_diff``
        (target - foil logit, or the target logit without a foil; logits), and ``foil_prob``.

    Raises:
        AttributionError: bad neuron spec, position, or ``mode='mean'`` without ``means``.
    """
    tgt = resolve_target(model, target, foil)
    specs = [parse_neuron(model, n) for n in neurons]
    if mode == "mean" and (means is None or any(s not in means for s in specs)):
        raise AttributionError("means: mode 'mean' needs the mean activation of every neuron (run key_readout or pass means)")
    if mode not in ("zero", "mean", "scale"):
        raise AttributionError(f"mode: {mode!r} is not one of zero, mean, scale")
    batch = tokenize(model, [prompt])
    p = _position(batch, 0, position)
    by_layer: dict[int, list[int]] = {}
    for L, n in specs:
        by_layer.setdefault(L, []).append(n)
    n_layers = int(model.cfg.n_layers)
    clean_names = []
    lmin = min(by_layer) if by_layer else n_layers
    if freeze_downstream:
        clean_names = ["ln_final.hook_scale"] + [f"blocks.{L}.hook_attn_out" for L in range(lmin + 1, n_layers)] + \
                      [f"blocks.{L}.hook_mlp_out" for L in range(lmin + 1, n_layers)] + \
                      [f"blocks.{L}.mlp.hook_post" for L in by_layer]
    if clean_metrics is not None and not freeze_downstream:
        clean, clean_m = {}, clean_metrics
    else:
        logits, clean = run_with_cache(model, batch, clean_names) if clean_names else (model(batch.tokens, **forward_kwargs(batch)), {})
        clean_m = _metrics(logits[0, p], tgt)
    sel = slice(p, p + 1) if positions == "last" else slice(None)

    def make_post_hook(L):
        idx = torch.tensor(by_layer[L])

        def hook(act, hook):
            if freeze_downstream:
                act = clean[hook.name].clone().to(act.dtype)
            idx_d = idx.to(act.device)
            cur = act[:, sel][..., idx_d]
            if mode == "zero":
                new = torch.zeros_like(cur)
            elif mode == "mean":
                m = torch.tensor([means[(L, n)] for n in by_layer[L]], dtype=act.dtype, device=act.device)
                new = m.expand_as(cur).clone()
            else:
                new = cur * factor
            view = act[:, sel]
            view[..., idx_d] = new
            act[:, sel] = view
            return act
        return hook

    def freeze(act, hook):
        return clean[hook.name].to(act.dtype)

    hooks = [(f"blocks.{L}.mlp.hook_post", make_post_hook(L)) for L in by_layer]
    if freeze_downstream:
        hooks.append(("ln_final.hook_scale", freeze))
        for L in range(lmin + 1, n_layers):
            hooks.append((f"blocks.{L}.hook_attn_out", freeze))
            if L not in by_layer:
                hooks.append((f"blocks.{L}.hook_mlp_out", freeze))
    patched = model.run_with_hooks(batch.tokens, fwd_hooks=hooks, **forward_kwargs(batch))
    pm = _metrics(patched[0, p], tgt)
    return {"clean": clean_m, "patched": pm, "delta": {k: pm[k] - clean_m[k] for k in pm}}

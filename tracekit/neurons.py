"""FFN neurons as key-value memories: per-neuron direct contributions, value readout, key
readout (top-activating corpus contexts) and interventions.

Engine of the ``neuron_attribution`` kind (:mod:`tracekit.experiments.neurons`); the underlying
direct logit attribution is :func:`tracekit.dla.logit_attribution`.

Method (Geva et al. 2021, "Transformer Feed-Forward Layers Are Key-Value Memories"; Geva et al.
2022, "Transformer Feed-Forward Layers Build Predictions by Promoting Concepts in the Vocabulary
Space"). Neuron ``n`` of MLP ``L`` (a block index) has a key (its input weights; the activation
``a_n = blocks.L.mlp.hook_post[n]``, i.e. GELU(pre) for GPT-2 and SiLU(gate) * up for SwiGLU
models, which can be negative) and a value (its output row ``W_out[L, n]``).

* contribution (:func:`neuron_contributions`): ``a_n * (W_out[L, n] . u_eff) / sigma`` logits,
  the neuron's direct effect through the run's frozen final-norm scale
  (:meth:`tracekit.model.readout.Readout.direction`); per layer the neurons plus the ``b_out`` term equal
  the MLP's direct attribution (tested);
* value readout (:func:`value_logits`, :func:`value_readout`): ``W_out[L, n]`` read in vocabulary
  space by :meth:`tracekit.model.readout.Readout.vocab_projection` (logits per unit activation);
* key readout (:func:`key_readout`): top-activating contexts over a corpus (:mod:`tracekit.corpus`);
* interventions (:func:`neuron_intervention`): zero / mean / scale some neurons' activations and
  measure the output with :mod:`tracekit.metrics`.

Every function that adds hooks removes them whatever is raised (TransformerLens' ``hooks``
context manager and ``run_with_cache``, both of which remove their hooks in a ``finally``; tested
by raising inside a hook).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Optional, Sequence, Union

import numpy as np
import pandas as pd
import torch
from jaxtyping import Float
from tqdm.auto import tqdm

from .core.sites import check_layer, check_layers, check_neurons, hook, mlp_width
from .dla import DirectAttribution, LogitTarget, as_position, logit_attribution, resolve_target
from .errors import AttributionError
from .hooks import check_hooks
from .metrics import logit_diff, target_log_prob, target_prob
from .model.architectures import require
from .model.readout import Readout
from .model.writepath import write_path
from .tokens import Position, PositionSpec, forward_kwargs, tokenize

if TYPE_CHECKING:
    from .corpus import Window

__all__ = [
    "AttributionError", "parse_neuron", "neuron_contributions", "value_logits", "value_readout", "KeyReadout",
    "key_readout", "neuron_intervention", "random_neurons", "output_metrics", "prompt_means", "INTERVENE_AT",
]

#: Where :func:`neuron_intervention` edits activations: the read position only, or every position.
INTERVENE_AT = ("position", "all")


def parse_neuron(model, spec, field: str = "neurons") -> tuple[int, int]:
    """``"L.N"`` (``"5.123"``), ``[5, 123]`` or ``(5, 123)`` -> ``(5, 123)``; ``L`` is a block index
    (negative from the end). Needs only ``model.cfg``.

    Raises:
        AttributionError: malformed spec, unknown layer, or neuron index outside ``[0, d_mlp)``.
    """
    try:
        if isinstance(spec, str):
            L, N = (int(x) for x in spec.split("."))
        else:
            L, N = (int(x) for x in spec)
    except (ValueError, TypeError) as e:
        raise AttributionError(f"{field}: {spec!r} is not a neuron; write 'layer.neuron' like '8.1234' "
                               "or a pair [8, 1234]") from e
    L = check_layer(model, L, field)
    require(model, "neuron attribution", layers=[L], need=("neurons",))
    check_neurons(model, L, [N], field)
    return L, N


def neuron_contributions(
    model,
    prompts: Union[str, Sequence[str]],
    target: str,
    foil: Optional[str] = None,
    position: Union[PositionSpec, Position] = "last",
    layers: Union[str, Sequence[int]] = "all",
    batch_size: int = 8,
) -> list[DirectAttribution]:
    """Direct contribution of every neuron of ``layers`` to the logit (difference) at ``position``.

    One :func:`tracekit.dla.logit_attribution` pass with per-neuron parts: each result's
    :meth:`~tracekit.dla.DirectAttribution.neurons_frame` lists ``activation`` (``hook_post``),
    ``logit_per_activation`` and ``contribution`` (logits) per neuron; ``mlp`` / ``mlp_bias`` give
    the MLP total and its ``b_out`` term (neurons + b_out = MLP, tested).

    Raises:
        TokenizationError: target/foil not one token, position not in a prompt.
        AttributionError: unknown layer.
    """
    nl = check_layers(model, layers, "layers")
    return logit_attribution(model, prompts, target, foil, position, neuron_layers=nl, batch_size=batch_size)


# ---------------------------------------------------------------------------------------------
# value readout (Geva et al. 2022)


@torch.no_grad()
def value_logits(model, layer: int, neuron: int) -> Float[torch.Tensor, " d_vocab"]:
    """A neuron's value vector read in vocabulary space: ``(centre(W_out[L, n]) * w) @ W_U``,
    centred over the vocabulary (logits per unit activation at final-norm scale 1; Geva et al. 2022).
    On blocks with a post-MLP norm (Gemma 2/3, OLMo 2, GLM-4) the vector goes through that norm's
    weight first, at its scale 1, as the write does (:mod:`tracekit.model.writepath`); a residual
    multiplier (Granite) scales it.

    ``value_logits[t] - value_logits[f]`` times ``final_scale`` equals the neuron's
    ``logit_per_activation`` in :func:`tracekit.dla.logit_attribution` for target t and foil f (tested).

    Raises:
        AttributionError: unknown layer or neuron.
    """
    L, N = parse_neuron(model, (layer, neuron), "neuron")
    v = model.blocks[L].mlp.W_out[N].float()
    wp = write_path(model, L, "mlp")
    if wp is not None and wp.norm is not None:  # through the post-MLP norm at its scale 1
        v = wp.norm.weight.to(v.device) * wp.norm.centre(v)
    if wp is not None:
        v = v * wp.multiplier
    return Readout(model).vocab_projection(v).cpu()


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


@torch.no_grad()
def _activations(model, batch, names: list[str], stop_at_layer: Optional[int]) -> dict:
    """The named activations of ``batch``; the forward pass stops before block ``stop_at_layer``
    (TransformerLens' ``run_with_cache(stop_at_layer=...)``: no later blocks, no unembedding; its
    hooks are removed in a ``finally``)."""
    n_layers = int(model.cfg.n_layers)
    stop = stop_at_layer if stop_at_layer is not None and stop_at_layer < n_layers else None
    _, cache = model.run_with_cache(batch.tokens, names_filter=set(names).__contains__, stop_at_layer=stop,
                                    **forward_kwargs(batch))
    missing = [n for n in names if n not in cache]
    if missing:
        raise AttributionError(f"the model never produced the activations {missing}")
    return {n: cache[n] for n in names}


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
    the deepest requested block (``run_with_cache(stop_at_layer=...)``); only ``blocks.L.mlp.hook_post`` of the needed layers is cached
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
    names = check_hooks(model, [hook("neuron", L) for L in layers], "neurons")
    N = len(specs)
    best_v = torch.full((N, top_n), float("-inf"))
    best_w = torch.full((N, top_n), -1, dtype=torch.long)
    best_p = torch.full((N, top_n), -1, dtype=torch.long)
    sums = torch.zeros(N, dtype=torch.float64)
    count = 0
    windows: dict[int, Window] = {}
    n_windows = 0
    docs = iter_documents(corpus, jsonl_field=jsonl_field)
    wins = token_windows(model, docs, seq_len=seq_len, max_tokens=max_tokens)
    bar = tqdm(total=max_tokens, desc="key readout", unit="tok", disable=not progress, leave=False)
    for batch, group in window_batches(model, wins, batch_size):
        cache = _activations(model, batch, names, max(layers) + 1)
        acts = torch.stack([cache[hook("neuron", L)][..., n].float().cpu() for L, n in specs], -1)  # [B,P,N]
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


@torch.no_grad()
def prompt_means(model, prompts: Sequence[str], neurons: Sequence) -> dict:
    """Mean activation (``hook_post``) of each neuron over the prompts' real tokens, BOS excluded:
    the baseline of a ``mean`` ablation when no corpus is read.

    Returns:
        ``{(layer, neuron): mean activation}``.

    Raises:
        AttributionError: bad neuron spec.
    """
    from .tokens import run_with_cache

    specs = [parse_neuron(model, n) for n in neurons]
    layers = sorted({L for L, _ in specs})
    batch = tokenize(model, list(prompts))
    _, cache = run_with_cache(model, batch, [hook("neuron", L) for L in layers])
    mask = batch.attention_mask.bool().clone()
    start = 1 if getattr(getattr(model, "tracekit_spec", None), "prepend_bos", False) else 0
    for b in range(batch.size):
        mask[b, batch.offsets[b]: batch.offsets[b] + start] = False
    return {(L, n): float(cache[hook("neuron", L)][..., n].float()[mask].mean()) for L, n in specs}


def random_neurons(model, like: Sequence[tuple[int, int]], seed: int = 0, exclude: Iterable = ()) -> list[tuple[int, int]]:
    """As many random neurons per layer as ``like`` has, avoiding ``exclude`` (a control set)."""
    g = np.random.default_rng(seed)
    ex = set(map(tuple, exclude)) | set(map(tuple, like))
    out = []
    for L in sorted({L for L, _ in like}):
        d_mlp = mlp_width(model, L)
        k = sum(1 for l2, _ in like if l2 == L)
        pool = np.array([n for n in range(d_mlp) if (L, n) not in ex])
        out += [(L, int(n)) for n in g.choice(pool, size=min(k, len(pool)), replace=False)]
    return out


def output_metrics(logits: Float[torch.Tensor, " d_vocab"], tgt: LogitTarget) -> dict:
    """``target_prob`` (probability), ``target_log_prob`` (nats), ``target_logit`` and
    ``logit_diff`` (logits: target - foil, or the target logit without a foil) and, with a foil,
    ``foil_prob``, of one next-token logit vector, computed by :mod:`tracekit.metrics`."""
    lg = logits.float().reshape(1, -1)
    t = torch.tensor([[tgt.target_id]], device=lg.device)
    out = {"target_prob": float(target_prob(lg, t)[0]), "target_log_prob": float(target_log_prob(lg, t)[0]),
           "target_logit": float(lg[0, tgt.target_id])}
    if tgt.foil_id is not None:
        f = torch.tensor([[tgt.foil_id]], device=lg.device)
        out["foil_prob"] = float(target_prob(lg, f)[0])
        out["logit_diff"] = float(logit_diff(lg, t, f)[0])
    else:
        out["logit_diff"] = out["target_logit"]
    return out


def _new_values(mode: str, cur: torch.Tensor, mean_values: Optional[torch.Tensor], factor: float) -> torch.Tensor:
    """The edited activations of the chosen neurons (``cur``: ``[batch, pos, k]``)."""
    if mode == "zero":
        return torch.zeros_like(cur)
    if mode == "mean":
        assert mean_values is not None
        return mean_values.to(cur.dtype).expand_as(cur).clone()
    return cur * factor


def _frozen(clean, name: str, act: torch.Tensor) -> torch.Tensor:
    """The clean run's activation at hook ``name``, in ``act``'s dtype (a freeze hook's output)."""
    return clean[name].to(act.dtype)


@torch.no_grad()
def neuron_intervention(
    model,
    prompt: str,
    target: str,
    neurons: Sequence,
    mode: str = "zero",  # zero | mean | scale (checked below, with the field named)
    foil: Optional[str] = None,
    means: Optional[dict] = None,
    factor: float = 2.0,
    intervene_at: str = "position",  # position | all (checked below, with the field named)
    position: Union[PositionSpec, Position] = "last",
    freeze_downstream: bool = False,
    clean_metrics: Optional[dict] = None,
) -> dict:
    """Set some neurons' activations and measure the target (Geva et al. 2022's interventions).

    Args:
        prompt: one prompt. target/foil: as in :func:`tracekit.dla.logit_attribution`.
        neurons: ``(layer, neuron)`` pairs or ``"L.N"`` strings (layer = block index).
        mode: ``zero`` (activation := 0), ``mean`` (:= ``means[(L, n)]``, e.g. the corpus mean from
            :func:`key_readout`), ``scale`` (activation *= ``factor``; amplification when > 1).
        intervene_at: edit the activations at the read ``position`` only (``position``) or at every
            position (``all``).
        position: the read position (int, ``last``, ``token:<text>``), where the metrics are read.
        freeze_downstream: keep every later attention/MLP output, the other neurons of the edited
            layers and the final-norm scale at their clean values, so only the direct path
            changes; then a zero-ablation moves the logit by exactly minus the neurons' summed
            direct contributions (tested).
        clean_metrics: the ``clean`` dict of an earlier call on the same prompt/target/position, to
            skip the clean forward pass (ignored with ``freeze_downstream``).

    Returns:
        ``{"clean": metrics, "patched": metrics, "delta": patched - clean}`` with the metrics of
        :func:`output_metrics` (``target_prob``, ``target_log_prob``, ``target_logit``,
        ``logit_diff``, ``foil_prob``).

    Raises:
        AttributionError: bad neuron spec, ``intervene_at``, non-finite ``factor``/means, or
        ``mode='mean'`` without ``means``. TokenizationError: position not in the prompt.
    """
    tgt = resolve_target(model, target, foil)
    specs = [parse_neuron(model, n) for n in neurons]
    if mode not in ("zero", "mean", "scale"):
        raise AttributionError(f"mode: {mode!r} is not one of zero, mean, scale")
    if intervene_at not in INTERVENE_AT:
        raise AttributionError(f"intervene_at: {intervene_at!r} is not one of {', '.join(INTERVENE_AT)}")
    if mode == "mean" and (means is None or any(s not in means for s in specs)):
        raise AttributionError("means: mode 'mean' needs the mean activation of every neuron (run key_readout or pass means)")
    if mode == "scale" and not np.isfinite(factor):
        raise AttributionError(f"factor: {factor!r} is not a finite number")
    pos = as_position(position)
    batch = tokenize(model, [prompt])
    p = batch.offsets[0] + pos.resolve(model, prompt, batch.ids[0])[0]
    by_layer: dict[int, list[int]] = {}
    for L, n in specs:
        by_layer.setdefault(L, []).append(n)
    mean_vals: dict[int, Optional[torch.Tensor]] = {}
    for L, ns in by_layer.items():
        mean_vals[L] = None
        if mode == "mean":
            assert means is not None
            mv = torch.tensor([float(means[(L, n)]) for n in ns])
            if not torch.isfinite(mv).all():
                raise AttributionError(f"means: the mean activations of layer {L} are not finite ({mv.tolist()})")
            mean_vals[L] = mv
    n_layers = int(model.cfg.n_layers)
    lmin = min(by_layer) if by_layer else n_layers
    # the post-MLP norm of an edited block (Gemma 2/3, OLMo 2, GLM-4) is frozen at its clean scale too
    post_scales = []
    for L in by_layer:
        wp = write_path(model, L, "mlp")
        if wp is not None and wp.norm is not None and f"blocks.{L}.{wp.norm_name}.hook_scale" in model.hook_dict:
            post_scales.append(f"blocks.{L}.{wp.norm_name}.hook_scale")
    clean: dict = {}
    if freeze_downstream:
        from .tokens import run_with_cache

        clean_names = ([hook("final_norm_scale")] + [hook("attn_out", L) for L in range(lmin + 1, n_layers)]
                       + [hook("mlp_out", L) for L in range(lmin + 1, n_layers)]
                       + [hook("neuron", L) for L in by_layer] + post_scales)
        logits, clean = run_with_cache(model, batch, clean_names)
        clean_m = output_metrics(logits[0, p], tgt)
    elif clean_metrics is not None:
        clean_m = clean_metrics
    else:
        clean_m = output_metrics(model(batch.tokens, **forward_kwargs(batch))[0, p], tgt)
    sel = slice(p, p + 1) if intervene_at == "position" else slice(None)

    def make_post_hook(L):
        idx = torch.tensor(by_layer[L])

        def hook(act, hook):
            if freeze_downstream:
                act = clean[hook.name].clone().to(act.dtype)
            idx_d = idx.to(act.device)
            m = mean_vals[L]
            mv = m.to(act.device) if m is not None else None
            view = act[:, sel]
            view[..., idx_d] = _new_values(mode, view[..., idx_d], mv, factor)
            act[:, sel] = view
            return act
        return hook

    def freeze(act, hook):
        return _frozen(clean, hook.name, act)

    hooks = [(hook("neuron", L), make_post_hook(L)) for L in by_layer]
    if freeze_downstream:
        hooks.append((hook("final_norm_scale"), freeze))
        hooks += [(n, freeze) for n in post_scales]
        for L in range(lmin + 1, n_layers):
            hooks.append((hook("attn_out", L), freeze))
            if L not in by_layer:
                hooks.append((hook("mlp_out", L), freeze))
    check_hooks(model, [n for n, _ in hooks], "neurons")
    with model.hooks(fwd_hooks=hooks):  # removes exactly these hooks on exit, whatever is raised
        patched = model(batch.tokens, **forward_kwargs(batch))
    pm = output_metrics(patched[0, p], tgt)
    return {"clean": clean_m, "patched": pm, "delta": {k: pm[k] - clean_m[k] for k in pm}}

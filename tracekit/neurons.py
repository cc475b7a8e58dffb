# Over 600 lines (reason): the neuron engine's four methods (per-row contributions, value readout, key readout, batched interventions), which share NeuronBasis and the batched-row plumbing; the readouts are the piece to move to a module of their own.
"""FFN neurons as key-value memories: per-neuron direct contributions, value readout, key
readout (top-activating corpus contexts) and interventions.

Engine of the ``neuron_attribution`` kind (:mod:`tracekit.experiments.neurons`); the underlying
direct logit attribution is :func:`tracekit.dla.logit_attribution`.

Method (Geva et al. 2021, "Transformer Feed-Forward Layers Are Key-Value Memories"; Geva et al.
2022, "Transformer Feed-Forward Layers Build Predictions by Promoting Concepts in the Vocabulary
Space"). Neuron ``n`` of MLP ``L`` (a block index) has a key (its input weights; the activation
``a_n = blocks.L.mlp.hook_post[n]``, i.e. GELU(pre) for GPT-2 and SiLU(gate) * up for SwiGLU
models, which can be negative) and a value (its output row ``W_out[L, n]``).

The neurons of one MLP are a unit basis (:class:`NeuronBasis`, :mod:`tracekit.units`), so the
interventions, random controls and readouts are the ones SAE features use:

* contribution (:func:`neuron_contributions`): ``a_n * (W_out[L, n] . u_eff) / sigma`` logits,
  the neuron's direct effect through the run's frozen final-norm scale
  (:meth:`tracekit.model.readout.Readout.direction`); per layer the neurons plus the ``b_out`` term equal
  the MLP's direct attribution (tested);
* value readout (:func:`value_logits`, :func:`value_readout`): ``W_out[L, n]`` read in vocabulary
  space (:func:`tracekit.units.vocab_readout`; logits per unit activation);
* key readout (:func:`key_readout`): top-activating contexts over a corpus (:mod:`tracekit.corpus`,
  :func:`tracekit.units.top_contexts`);
* interventions (:func:`neuron_intervention`): the verbs of :mod:`tracekit.units` (``zero`` /
  ``mean`` / ``clamp`` / ``scale`` / ``steer``) on some neurons, measured with :mod:`tracekit.metrics`
  (:func:`tracekit.units.intervene`); random controls (:func:`random_neurons`).

Datasets: :func:`neuron_contributions`, :func:`neuron_interventions` and :func:`prompt_means` take
prompt strings or a :class:`tracekit.dataset.PreparedDataset` (token ids, per-row target / foil ids
and named positions prepared once, e.g. in a kind's ``prepare``: nothing is tokenized again). Every
row has its own target and foil (its own direction ``u``) and its own read position; the rows are
read in one batched forward pass per ``batch_size`` rows (padded on the model spec's
``padding_side``, each row at its own padded index), never one run per row, and a row's numbers
equal that row run alone (tested with left and right padding, BOS on and off).

Every function that adds hooks removes them whatever is raised (TransformerLens' ``hooks``
context manager and ``run_with_cache``, both of which remove their hooks in a ``finally``; tested
by raising inside a hook).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional, Sequence, Union, cast

import numpy as np
import pandas as pd
import torch
from jaxtyping import Bool, Float

from .circuits.gradients import balanced_chunk, hook_bytes, pass_bytes
from .core.budget import chunk_rows
from .core.progress import progress_bar
from .core.sites import check_layer, check_layers, check_neurons, hook, mlp_width, norm_hook
from .corpus import iter_documents, token_windows, window_batches
from .dataset import PreparedDataset
from .dla import (
    DirectAttribution,
    LogitTarget,
    as_position,
    logit_attribution,
    resolve_target,
    row_positions,
    row_targets,
)
from .errors import AttributionError, TokenizationError
from .hooks import check_hooks, enabled_hooks
from .model.architectures import require
from .model.info import HookedModel
from .model.load import model_device
from .model.readout import Readout
from .model.writepath import write_path
from .tokens import (
    Batch,
    Position,
    PositionSpec,
    check_length,
    display_text,
    encode,
    forward_kwargs,
    pad_rows,
    run_with_cache,
    token_text,
    tokenize,
)
from .units import (
    VERBS,
    UnitEdit,
    batch_parts,
    canonical_verb,
    intervene,
    output_metrics,
    random_units,
    top_contexts,
    vocab_readout,
)

if TYPE_CHECKING:
    from .corpus import Window

__all__ = [
    "AttributionError", "parse_neuron", "NeuronBasis", "neuron_contributions", "value_logits", "value_readout",
    "KeyReadout", "key_readout", "neuron_intervention", "neuron_interventions", "rows_per_pass", "random_neurons", "output_metrics",
    "prompt_means", "INTERVENE_AT",
]

#: Where :func:`neuron_intervention` edits activations: the read position only, or every position.
INTERVENE_AT = ("position", "all")


def parse_neuron(model: HookedModel, spec, field: str = "neurons") -> tuple[int, int]:
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


class NeuronBasis:
    """The neurons of MLP ``layer`` as a :class:`tracekit.units.UnitBasis`: activations are
    ``blocks.L.mlp.hook_post``, unit ``n``'s decoder row is its value vector ``W_out[L, n]`` as it
    reaches the residual stream (through a post-MLP norm's weight at scale 1 and a residual
    multiplier, :mod:`tracekit.model.writepath`). Supports every verb of :data:`tracekit.units.VERBS`
    (``steer`` adds ``value`` to the activation, i.e. ``value x W_out[L, n]`` to the MLP's output).

    Raises:
        AttributionError: unknown layer; MethodRefused: a block without dense neurons (MoE).
    """

    name = "neuron"
    verbs: tuple[str, ...] = VERBS  # declared as UnitBasis does (a literal tuple type would not match it)

    def __init__(self, model: HookedModel, layer: int):
        self.model = model
        self.layer = check_layer(model, layer, "layer")
        require(model, "neuron attribution", layers=[self.layer], need=("neurons",))
        self.hook = hook("neuron", self.layer)
        self.n_units = mlp_width(model, self.layer)

    def check(self, units: Sequence[int], field: str = "neurons") -> list[int]:
        """Neuron indices, checked against the MLP's width (SiteError, an AttributionError)."""
        return check_neurons(self.model, self.layer, list(units), field)

    def activations(self, value: Float[torch.Tensor, "*batch d_mlp"]) -> Float[torch.Tensor, "*batch d_mlp"]:
        """``hook_post`` is the neurons' activations."""
        return value

    def decoder_rows(self, units: Sequence[int]) -> Float[torch.Tensor, "k d_model"]:
        """``W_out[L, units]`` as written into the residual stream per unit activation (float32)."""
        v = cast(Any, self.model).blocks[self.layer].mlp.W_out[list(units)].float()  # a loaded bridge's block
        wp = write_path(self.model, self.layer, "mlp")
        if wp is not None and wp.norm is not None:  # through the post-MLP norm at its scale 1
            v = wp.norm.weight.to(v.device) * wp.norm.centre(v)
        if wp is not None:
            v = v * wp.multiplier
        return v

    def hook_rows(self, units: Sequence[int]) -> Float[torch.Tensor, "k d_mlp"]:
        """One-hot rows: steering a neuron adds to its own activation."""
        rows = torch.zeros(len(units), self.n_units)
        rows[torch.arange(len(units)), torch.tensor(list(units), dtype=torch.long)] = 1.0
        return rows

    def edit_hook(self, units: Sequence[int], edit: Optional[Callable[[torch.Tensor], torch.Tensor]],
                  add: Optional[Float[torch.Tensor, " d_mlp"]],
                  where: Union[Bool[torch.Tensor, " pos"], Bool[torch.Tensor, "batch pos"]],
                  start: Optional[torch.Tensor] = None) -> Callable:
        """A ``hook_post`` hook: ``act[where][..., units] = edit(...)``, then ``+ add`` at ``where``.

        ``where``: ``[pos]`` (the same positions in every row of the batch) or ``[batch, pos]`` (each
        row its own positions, e.g. its own read position in a padded batch)."""
        idx = torch.tensor(list(units), dtype=torch.long)

        def hook_fn(act, hook):
            if start is not None:
                act = start.clone().to(act.dtype)
            sel = where.to(act.device).bool()
            if sel.ndim == 1:
                sel = sel[None, :].expand(act.shape[0], -1)
            view = act[sel]  # [n_selected, d_mlp] (a copy)
            if edit is not None:
                i = idx.to(act.device)
                view[..., i] = edit(view[..., i])
            if add is not None:
                view = view + add.to(device=act.device, dtype=act.dtype)
            act[sel] = view
            return act
        return hook_fn


def neuron_contributions(
    model: HookedModel,
    prompts: Union[str, Sequence[str], PreparedDataset],
    target: Union[str, Sequence[str], None] = None,
    foil: Union[str, Sequence[str], None] = None,
    position: Union[PositionSpec, Position] = "last",
    layers: Union[str, Sequence[int]] = "all",
    batch_size: int = 8,
    *,
    read_at: Optional[Sequence[int]] = None,
) -> list[DirectAttribution]:
    """Direct contribution of every neuron of ``layers`` to each row's logit (difference) at its
    read position (Geva et al. 2022's neuron view of direct logit attribution, Elhage et al. 2021).

    One :func:`tracekit.dla.logit_attribution` pass with per-neuron parts, batched: ``batch_size``
    rows per forward pass (padded, each row read at its own padded index with its own target/foil
    direction). Each result's :meth:`~tracekit.dla.DirectAttribution.neurons_frame` lists
    ``activation`` (``hook_post``), ``logit_per_activation`` and ``contribution`` (logits) per
    neuron; ``mlp`` / ``mlp_bias`` give the MLP total and its ``b_out`` term (neurons + b_out = MLP,
    checked on every row: a violation raises).

    Args:
        prompts: one prompt, several, or a :class:`tracekit.dataset.PreparedDataset` (ids, per-row
            targets/foils and named positions prepared once; nothing is tokenized again).
        target: with prompt strings: a one-token string for every prompt, or a list with one per
            prompt; None with a dataset (its rows carry their own).
        foil: the same for the foil (optional).
        position: the read position: an int (BOS counted), ``last``, ``token:<text>`` or, with a
            dataset, a named position of its rows (``END``), resolved per row.
        layers: MLP blocks (block indices) whose neurons are attributed, or ``"all"``.
        read_at: each row's read position as an index into its own ids (BOS counted), already
            resolved (e.g. in a kind's ``prepare``); overrides ``position``.

    Returns:
        One :class:`tracekit.dla.DirectAttribution` per row (``neuron_act`` / ``neuron_contrib`` /
        ``neuron_value``: ``{layer: Float[Tensor, "d_mlp"]}``; logits), in input order.

    Raises:
        TokenizationError: target/foil not one token, position not in a prompt.
        DatasetError: a named position some row does not have.
        AttributionError: unknown layer, a target list of the wrong length, a dataset row without a
            target, or a sum identity that does not hold.
    """
    nl = check_layers(model, layers, "layers")
    return logit_attribution(model, prompts, target, foil, position, neuron_layers=nl, batch_size=batch_size,
                             read_at=read_at)


@dataclass(frozen=True)
class _Rows:
    """Rows ready for a batched pass: ids, row ids, targets, read positions, BOS counts."""

    ids: list[list[int]]
    row_ids: list[int]
    targets: list[LogitTarget]
    read_at: list[int]
    n_bos: list[int]


def rows_per_pass(model: HookedModel, batch_size: int, n: int, n_pos: int, what: str, extra_per_row: int = 0) -> int:
    """Rows per forward pass: ``batch_size``, or fewer where the memory budget
    (``run.memory_budget``, :func:`tracekit.core.budget.chunk_rows`) allows fewer (then evened
    out over a batch, :func:`tracekit.circuits.gradients.balanced_chunk`).

    A row counts :func:`tracekit.circuits.gradients.pass_bytes` of a forward pass without
    gradients over ``n_pos`` tokens (its logits ``[pos, d_vocab]`` included) plus
    ``extra_per_row`` bytes (what the caller keeps per row: cached activations, a second run's
    logits).

    Raises:
        MemoryBudgetError: one row does not fit (names the setting to change)."""
    per = pass_bytes(model, max(1, int(n_pos)), backward=False) + int(extra_per_row)
    fits = chunk_rows(per, max(1, int(n)), what=what, device=model_device(model), unit="row",
                      fix="shorten the prompts")
    size = max(1, min(int(batch_size), fits))
    return size if size >= int(batch_size) else balanced_chunk(size, min(int(batch_size), max(1, int(n))))


def _rows(model: HookedModel, prompts, target, foil, position, read_at: Optional[Sequence[int]], need_target: bool = True) -> _Rows:
    """Prompt strings (tokenized here) or a :class:`PreparedDataset` (used as prepared) as :class:`_Rows`.

    Raises:
        AttributionError: target/foil beside a dataset, a row without a target, lists of the wrong length.
        TokenizationError: an empty or too long prompt, a position not in a prompt.
    """
    if isinstance(prompts, PreparedDataset):
        data = prompts
        if target is not None or foil is not None:
            raise AttributionError("target/foil beside a dataset: each row carries its own target and foil")
        missing = [e.row_id for e in data.examples if e.target_id is None]
        if need_target and missing:
            raise AttributionError(f"rows {missing[:5]} have no target (give every row a target)")
        tgts = [LogitTarget(str(e.row.target), int(e.target_id if e.target_id is not None else -1), e.row.foil,
                            e.foil_id) for e in data.examples]
        pos_of = list(read_at) if read_at is not None else (
            row_positions(model, data, position) if need_target else [len(e.ids) - 1 for e in data.examples])
        return _Rows([list(e.ids) for e in data.examples], [e.row_id for e in data.examples], tgts,
                     [int(q) for q in pos_of], [e.n_bos for e in data.examples])
    texts = [prompts] if isinstance(prompts, str) else list(prompts)
    if not texts:
        raise TokenizationError("prompts: need at least one prompt")
    ids = []
    for i, p in enumerate(texts):
        seq = encode(model, p)
        if not seq:
            raise TokenizationError(f"prompts[{i}]: {p!r} tokenizes to nothing; give a non-empty prompt")
        check_length(model, seq, f"prompts[{i}]", p)
        ids.append(seq)
    tgts = row_targets(model, len(texts), target, foil) if need_target else []
    if read_at is not None:
        pos_of = [int(q) for q in read_at]
    else:
        pos = as_position(position)
        pos_of = [pos.resolve(model, p, seq, field="position")[0] for p, seq in zip(texts, ids)]
    n_bos = len(encode(model, ""))
    return _Rows(ids, list(range(len(texts))), tgts, pos_of, [n_bos] * len(texts))


# ---------------------------------------------------------------------------------------------
# value readout (Geva et al. 2022)


@torch.no_grad()
def value_logits(model: HookedModel, layer: int, neuron: int) -> Float[torch.Tensor, " d_vocab"]:
    """A neuron's value vector read in vocabulary space: ``(centre(W_out[L, n]) * w) @ W_U``,
    centred over the vocabulary (logits per unit activation at final-norm scale 1; Geva et al. 2022).
    On blocks with a post-MLP norm (Gemma 2/3, OLMo 2, GLM-4) the vector goes through that norm's
    weight first, at its scale 1, as the write does (:mod:`tracekit.model.writepath`); a residual
    multiplier (Granite) scales it (:meth:`NeuronBasis.decoder_rows`).

    ``value_logits[t] - value_logits[f]`` times ``final_scale`` equals the neuron's
    ``logit_per_activation`` in :func:`tracekit.dla.logit_attribution` for target t and foil f (tested).

    Raises:
        AttributionError: unknown layer or neuron.
    """
    L, N = parse_neuron(model, (layer, neuron), "neuron")
    return Readout(model).vocab_projection(NeuronBasis(model, L).decoder_rows([N]))[0].cpu()


@torch.no_grad()
def value_readout(model: HookedModel, layer: int, neuron: int, k: int = 10, sign: float = 1.0) -> pd.DataFrame:
    """Tokens a neuron's value vector ``W_out[layer, neuron]`` promotes and suppresses most
    (:func:`tracekit.units.vocab_readout` over :class:`NeuronBasis`).

    Geva et al. 2022 project each FFN value vector onto the vocabulary. Here the projection goes
    through the final norm's weight (and LayerNorm's centring), i.e. it is the neuron's direct
    effect on every logit per unit activation with the final-norm scale set to 1, centred over the
    vocabulary so that ``process_weights`` does not change it.

    Args:
        layer: the neuron's block (validated).
        neuron: the neuron's index in that block's MLP (validated).
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
    df = vocab_readout(model, NeuronBasis(model, L), [N], k, signs=[sign])
    df = df.rename(columns={"score": "logit_per_activation"}).drop(columns="unit")
    df.insert(0, "neuron", N)
    df.insert(0, "layer", L)
    return df


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


def _context(model: HookedModel, ids, p, n_prefix, before, after) -> tuple[str, str]:
    # a piece of a character (cut by the window, or the token itself) shows its bytes, not U+FFFD
    left = display_text(model, list(ids[max(n_prefix, p - before):p]))
    mid = token_text(model, int(ids[p]))
    right = display_text(model, list(ids[p + 1:p + 1 + after]))
    clean = lambda s: s.replace("\n", " ")  # noqa: E731
    return mid, clean(left) + "[[" + clean(mid) + "]]" + clean(right)


@torch.no_grad()
def key_readout(
    model: HookedModel,
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
    documents: Optional[Iterable[tuple[str, str]]] = None,
) -> KeyReadout:
    """Top-activating contexts of neurons over a corpus (Geva et al. 2021's key readout;
    :func:`tracekit.units.top_contexts` over :class:`NeuronBasis`).

    Streams the corpus (:mod:`tracekit.corpus`) in padded batches; the forward pass stops after
    the deepest requested block (``run_with_cache(stop_at_layer=...)``); only ``blocks.L.mlp.hook_post``
    of the needed layers is cached and only the running top ``top_n`` per neuron is kept, so memory
    is bounded. Results do not depend on ``batch_size`` (tested).

    Args:
        neurons: ``(layer, neuron)`` pairs or ``"L.N"`` strings.
        corpus: ``None``/``"stdlib"`` (offline default), a text/JSONL file, a directory, or a list.
        top_n: contexts per neuron.
        seq_len: window length (BOS included).
        batch_size: windows per padded batch; the memory budget may run a batch's forward pass in
            parts (:func:`rows_per_pass`, :func:`tracekit.units.batch_parts`: the same numbers).
        max_tokens: the cap on text tokens read (None: the whole corpus).
        signs: per neuron, ``+1`` ranks by the largest activation, ``-1`` by the most negative
            (SwiGLU activations can be negative). Default all ``+1``.
        context_before: tokens of text shown before the activating token.
        context_after: tokens of text shown after it.
        documents: ``(doc_id, text)`` pairs read instead of ``corpus`` (e.g. a dataset's prompts,
            one document each).

    Raises:
        AttributionError: bad neuron spec. CorpusError: unreadable corpus.
        MemoryBudgetError: one window does not fit the memory budget.
    """
    specs = [parse_neuron(model, n) for n in neurons]
    if not specs:
        raise AttributionError("neurons: give at least one neuron")
    if signs and len(signs) != len(specs):
        raise AttributionError("signs: need one sign per neuron")
    bases = {L: NeuronBasis(model, L) for L in sorted({L for L, _ in specs})}
    windows: dict[int, Window] = {}
    docs = documents if documents is not None else iter_documents(corpus, jsonl_field=jsonl_field)
    wins = token_windows(model, docs, seq_len=seq_len, max_tokens=max_tokens)
    bar = progress_bar(total=max_tokens, desc="key readout", unit="tok", enabled=progress)

    deepest = max(L for L, _ in specs)
    kept = len(bases) * hook_bytes(model, hook("neuron", deepest), seq_len)
    size = rows_per_pass(model, batch_size, batch_size, seq_len, "neuron key readout", kept)

    def batches():
        for batch, group in window_batches(model, wins, batch_size):
            valid = batch.attention_mask.bool().cpu().clone()
            valid[:, : group[0].n_prefix] = False  # BOS (windows are right-padded, BOS first)
            windows.update((w.window, w) for w in group)
            yield batch, [w.window for w in group], valid

    def after_batch(found, masked, valid):  # keep only the windows still ranked (bounded memory)
        keep = found.top.kept_windows()
        for k in [k for k in windows if k not in keep]:
            del windows[k]
        bar.update(int(valid.sum()))

    found = top_contexts(model, [(bases[L], n) for L, n in specs], batches(), top_n=top_n, signs=signs or None,
                         on_batch=after_batch, field="neurons", rows_per_pass=size)
    bar.close()
    rows = []
    for j, (L, n) in enumerate(specs):
        for r, (act, wid, p) in enumerate(found.ranked(j)):
            w = windows[wid]
            token, ctx = _context(model, w.ids, p, w.n_prefix, context_before, context_after)
            rows.append({"layer": L, "neuron": n, "rank": r + 1, "activation": act, "token": token, "context": ctx,
                         "doc_id": w.doc_id, "window": w.window, "position": p})
    means = {(L, n): float(found.sums[j] / max(1, found.count)) for j, (L, n) in enumerate(specs)}
    cols = ["layer", "neuron", "rank", "activation", "token", "context", "doc_id", "window", "position"]
    return KeyReadout(pd.DataFrame(rows, columns=cols), means, found.count, found.n_windows)


# ---------------------------------------------------------------------------------------------
# interventions


@torch.no_grad()
def prompt_means(model: HookedModel, prompts: Union[Sequence[str], PreparedDataset], neurons: Sequence, batch_size: int = 16) -> dict:
    """Mean activation (``hook_post``) of each neuron over the rows' real tokens, BOS and padding
    excluded: the baseline of a ``mean`` ablation when no corpus is read (Geva et al. 2022's
    interventions need a reference activation).

    Args:
        prompts: prompt strings (tokenized here) or a :class:`tracekit.dataset.PreparedDataset`
            (its prepared ids; nothing is tokenized again).
        neurons: ``(layer, neuron)`` pairs or ``"L.N"`` strings.
        batch_size: rows per padded batch (the attention mask keeps rows independent; the memory
            budget may run a batch in parts, :func:`rows_per_pass`: the same numbers).

    Returns:
        ``{(layer, neuron): mean activation}`` (activation units), over every text token of every row.

    Raises:
        AttributionError: bad neuron spec.
        MemoryBudgetError: one row does not fit the memory budget.
    """
    specs = [parse_neuron(model, n) for n in neurons]
    layers = sorted({L for L, _ in specs})
    rows = _rows(model, prompts, None, None, "last", None, need_target=False)
    sums = torch.zeros(len(specs), dtype=torch.float64)
    count = 0
    n_pos = max((len(r) for r in rows.ids), default=1)
    kept = len(layers) * hook_bytes(model, hook("neuron", layers[0]), n_pos) if layers else 0
    size = rows_per_pass(model, batch_size, len(rows.ids), n_pos, "neuron prompt means", kept)  # rows per pass
    step = max(1, int(batch_size))
    for s in range(0, len(rows.ids), step):
        batch = pad_rows(model, rows.ids[s:s + step])
        acts: list[list[torch.Tensor]] = [[] for _ in specs]
        for _, part in batch_parts(batch, size):  # the budget's parts of the padded batch: the same numbers
            _, cache = run_with_cache(model, part, [hook("neuron", L) for L in layers])
            for j, (L, n) in enumerate(specs):
                acts[j].append(cache[hook("neuron", L)][..., n])
            del cache
        mask = batch.attention_mask.bool().clone()
        for b in range(batch.size):
            o = batch.offsets[b]
            mask[b, o:o + rows.n_bos[s + b]] = False
        for j in range(len(specs)):
            sums[j] += torch.cat(acts[j]).double()[mask].sum().cpu()
        count += int(mask.sum())
    return {(L, n): float(sums[j] / max(1, count)) for j, (L, n) in enumerate(specs)}


def random_neurons(model: HookedModel, like: Sequence[tuple[int, int]], seed: int = 0, exclude: Iterable = ()) -> list[tuple[int, int]]:
    """As many random neurons per layer as ``like`` has, avoiding ``exclude`` and ``like`` (a
    control set; :func:`tracekit.units.random_units`, one numpy generator seeded with ``seed``
    drawing layer after layer in increasing order)."""
    g = np.random.default_rng(seed)
    ex = set(map(tuple, exclude)) | set(map(tuple, like))
    out = []
    for L in sorted({L for L, _ in like}):
        k = sum(1 for l2, _ in like if l2 == L)
        out += [(L, n) for n in random_units(mlp_width(model, L), k, {n for l2, n in ex if l2 == L}, rng=g)]
    return out


def _direct_path_freeze(model: HookedModel, layers: Sequence[int]) -> list[str]:
    """Hooks held at their clean values so an edit of the neurons of ``layers`` moves the output only
    through the direct path: the final-norm scale, the edited blocks' post-MLP norm scales, every
    later attention output and non-edited MLP output, and the edited ``hook_post`` s themselves."""
    n_layers = int(model.cfg.n_layers)
    lmin = min(layers, default=n_layers)
    post_scales = []
    for L in layers:
        wp = write_path(model, L, "mlp")
        if wp is not None and wp.norm is not None and norm_hook(L, str(wp.norm_name)) in model.hook_dict:
            post_scales.append(norm_hook(L, str(wp.norm_name)))
    return ([hook("final_norm_scale")] + post_scales + [hook("attn_out", L) for L in range(lmin + 1, n_layers)]
            + [hook("mlp_out", L) for L in range(lmin + 1, n_layers) if L not in layers]
            + [hook("neuron", L) for L in layers])


@torch.no_grad()
def neuron_intervention(
    model: HookedModel,
    prompt: str,
    target: str,
    neurons: Sequence,
    mode: str = "zero",  # a verb of tracekit.units.VERBS (checked, with the field named)
    foil: Optional[str] = None,
    means: Optional[dict] = None,
    factor: float = 2.0,
    intervene_at: str = "position",  # position | all (checked below, with the field named)
    position: Union[PositionSpec, Position] = "last",
    freeze_downstream: bool = False,
    clean_metrics: Optional[dict] = None,
    value: float = 0.0,
) -> dict:
    """Edit some neurons' activations and measure the target (Geva et al. 2022's interventions;
    :func:`tracekit.units.intervene` over one :class:`NeuronBasis` per layer).

    Args:
        prompt: one prompt (:func:`neuron_interventions` runs many rows batched, each with its own
            target/foil). target/foil: one-token strings, as in :func:`tracekit.dla.logit_attribution`.
        neurons: ``(layer, neuron)`` pairs or ``"L.N"`` strings (layer = block index).
        mode: a verb of :data:`tracekit.units.VERBS`: ``zero`` (activation := 0), ``mean`` (:=
            ``means[(L, n)]``, e.g. the corpus mean from :func:`key_readout`), ``clamp`` (:=
            ``value``), ``scale`` (activation *= ``factor``; amplification when > 1), ``steer``
            (activation += ``value``, i.e. ``value x W_out[L, n]`` added to the MLP's output).
            ``ablate`` / ``amplify`` are read as ``zero`` / ``scale``.
        intervene_at: edit the activations at the read ``position`` only (``position``) or at every
            position (``all``).
        position: the read position (int, ``last``, ``token:<text>``), where the metrics are read.
        freeze_downstream: keep every later attention/MLP output, the other neurons of the edited
            layers and the final-norm scale at their clean values, so only the direct path
            changes; then a zero-ablation moves the logit by exactly minus the neurons' summed
            direct contributions (tested).
        clean_metrics: the ``clean`` dict of an earlier call on the same prompt/target/position, to
            skip the clean forward pass (ignored with ``freeze_downstream``).
        value: the activation of ``clamp``, the amount of ``steer`` (activation units).

    Returns:
        ``{"clean": metrics, "patched": metrics, "delta": patched - clean}`` with the metrics of
        :func:`tracekit.units.output_metrics` (``target_prob``, ``target_log_prob``,
        ``target_logit``, ``logit_diff``, ``foil_prob``).

    Raises:
        AttributionError: bad neuron spec, ``mode``, ``intervene_at``, non-finite
            ``factor``/``value``/means, or ``mode='mean'`` without ``means``.
        TokenizationError: position not in the prompt.
    """
    tgt = resolve_target(model, target, foil)
    edits, layers = _neuron_edits(model, neurons, mode, means, factor, value, intervene_at)
    pos = as_position(position)
    batch = tokenize(model, [prompt])
    p = batch.offsets[0] + pos.resolve(model, prompt, batch.ids[0])[0]
    where = None
    if intervene_at == "position":
        where = torch.zeros(batch.tokens.shape[1], dtype=torch.bool)
        where[p] = True
    freeze = _direct_path_freeze(model, layers) if freeze_downstream else ()
    return intervene(model, edits, batch, p, tgt, where=where, freeze=freeze, clean_metrics=clean_metrics,
                     field="neurons")


def _neuron_edits(model: HookedModel, neurons: Sequence, mode: str, means: Optional[dict], factor: float, value: float,
                  intervene_at: str) -> tuple[list[UnitEdit], list[int]]:
    """The :class:`tracekit.units.UnitEdit` s (one per layer) of an intervention, checked."""
    specs = [parse_neuron(model, n) for n in neurons]
    verb = canonical_verb(mode, "mode")
    if intervene_at not in INTERVENE_AT:
        raise AttributionError(f"intervene_at: {intervene_at!r} is not one of {', '.join(INTERVENE_AT)}")
    if verb == "mean" and (means is None or any(s not in means for s in specs)):
        raise AttributionError("means: mode 'mean' needs the mean activation of every neuron (run key_readout or pass means)")
    by_layer: dict[int, list[int]] = {}
    for L, n in specs:
        by_layer.setdefault(L, []).append(n)
    edits = [UnitEdit(NeuronBasis(model, L), ns, verb, value=factor if verb == "scale" else value,
                      means=[float(means[(L, n)]) for n in ns] if verb == "mean" and means is not None else None,
                      field="neurons") for L, ns in by_layer.items()]
    return edits, list(by_layer)


@torch.no_grad()
def _intervene_rows(model: HookedModel, edits: Sequence[UnitEdit], batch: Batch, read_at: Sequence[int],
                    targets: Sequence[LogitTarget], where: Bool[torch.Tensor, "batch pos"], freeze: Sequence[str] = (),
                    clean_metrics: Optional[Sequence[dict]] = None) -> list[dict]:
    """:func:`tracekit.units.intervene` for every row of a padded batch: row ``b`` read at its padded
    index ``read_at[b]`` with its own target, edited at ``where[b]``."""
    names = [e.basis.hook for e in edits]
    check_hooks(model, names + [n for n in freeze if n not in names], "neurons")
    mask = where.bool().to(batch.tokens.device)
    clean: dict = {}
    rows = range(batch.size)
    with enabled_hooks(model, names):
        if freeze:
            logits, clean = run_with_cache(model, batch, list(dict.fromkeys(freeze)))
            clean_m = [output_metrics(logits[b, read_at[b]], targets[b]) for b in rows]
        elif clean_metrics is not None:
            clean_m = list(clean_metrics)
        else:
            logits = model(batch.tokens, **forward_kwargs(batch))
            clean_m = [output_metrics(logits[b, read_at[b]], targets[b]) for b in rows]

        def freeze_hook(act, hook):
            return clean[hook.name].to(act.dtype)

        hooks = [(e.basis.hook, e.hook(mask, clean[e.basis.hook] if e.basis.hook in freeze else None))
                 for e in edits]
        hooks += [(n, freeze_hook) for n in dict.fromkeys(freeze) if n not in names]
        with model.hooks(fwd_hooks=hooks):  # removes exactly these hooks on exit, whatever is raised
            patched = model(batch.tokens, **forward_kwargs(batch))
    out = []
    for b in rows:
        pm = output_metrics(patched[b, read_at[b]], targets[b])
        out.append({"clean": clean_m[b], "patched": pm, "delta": {k: pm[k] - clean_m[b][k] for k in pm}})
    return out


@torch.no_grad()
def neuron_interventions(
    model: HookedModel,
    prompts: Union[str, Sequence[str], PreparedDataset],
    target: Union[str, Sequence[str], None],
    neurons: Sequence,
    mode: str = "zero",
    foil: Union[str, Sequence[str], None] = None,
    means: Optional[dict] = None,
    factor: float = 2.0,
    intervene_at: str = "position",
    position: Union[PositionSpec, Position] = "last",
    freeze_downstream: bool = False,
    clean_metrics: Optional[Sequence[dict]] = None,
    value: float = 0.0,
    *,
    read_at: Optional[Sequence[int]] = None,
    batch_size: int = 8,
) -> list[dict]:
    """:func:`neuron_intervention` on every row, batched: the same neurons edited in ``batch_size``
    rows per forward pass (padded on the model spec's ``padding_side``), each row edited at and read
    at its own position with its own target/foil (Geva et al. 2022's interventions). A row's result
    equals :func:`neuron_intervention` on that row alone (tested).

    Args:
        prompts: prompt strings, or a :class:`tracekit.dataset.PreparedDataset` (prepared ids,
            per-row targets/foils and named positions; nothing is tokenized again).
        target: with prompt strings: a string for every prompt or a list, one per prompt; None with a
            dataset.
        foil: the same for the foil (optional).
        neurons: as in :func:`neuron_intervention` (so are ``mode``, ``means``, ``factor``, ``value``
            and ``freeze_downstream``).
        intervene_at: ``position`` (each row's own read position) or ``all`` (every real token of
            each row).
        position: the read position (spec, resolved per row).
        read_at: or the rows' resolved read indices into their own ids (BOS counted).
        clean_metrics: the ``clean`` dicts of an earlier call on the same rows (one per row), to skip
            the clean forward passes (ignored with ``freeze_downstream``).
        batch_size: rows per padded batch (the memory budget may run a batch in parts,
            :func:`rows_per_pass`, :func:`tracekit.units.batch_parts`: the same numbers).

    Returns:
        One ``{"clean", "patched", "delta"}`` dict per row (:func:`tracekit.units.output_metrics`:
        probabilities, logits, nats), in input order.

    Raises:
        AttributionError: bad neuron spec, ``mode``, ``intervene_at``, non-finite values / means,
            target/foil beside a dataset, a row without a target.
        TokenizationError: a position not in a prompt.
        MemoryBudgetError: one row does not fit the memory budget (before any forward pass).
    """
    edits, layers = _neuron_edits(model, neurons, mode, means, factor, value, intervene_at)
    rows = _rows(model, prompts, target, foil, position, read_at)
    n = len(rows.ids)
    if clean_metrics is not None and len(clean_metrics) != n:
        raise AttributionError(f"clean_metrics: {len(clean_metrics)} for {n} rows; give one per row")
    for i, (q, seq) in enumerate(zip(rows.read_at, rows.ids)):
        if not 0 <= q < len(seq):
            raise TokenizationError(f"position: {q} is not an index into row {rows.row_ids[i]}'s {len(seq)} tokens")
    freeze = _direct_path_freeze(model, layers) if freeze_downstream else ()
    out: list[dict] = []
    n_pos = max((len(r) for r in rows.ids), default=1)
    # kept per row: the clean run's logits beside the patched run's, and the frozen activations
    kept = int(model.cfg.d_vocab) * n_pos * 4 + sum(hook_bytes(model, h, n_pos) for h in freeze)
    size = rows_per_pass(model, batch_size, n, n_pos, "neuron interventions", kept)
    step = max(1, int(batch_size))
    for s in range(0, n, step):
        batch = pad_rows(model, rows.ids[s:s + step])
        ps = [batch.offsets[b] + rows.read_at[s + b] for b in range(batch.size)]
        if intervene_at == "position":
            where = torch.zeros(batch.tokens.shape, dtype=torch.bool)
            where[torch.arange(batch.size), torch.tensor(ps)] = True
        else:
            where = batch.attention_mask.bool().cpu()
        for sl, part in batch_parts(batch, size):  # the budget's parts of the padded batch: the same numbers
            cm = None if clean_metrics is None else clean_metrics[s + sl.start:s + sl.stop]
            out += _intervene_rows(model, edits, part, ps[sl], rows.targets[s + sl.start:s + sl.stop], where[sl],
                                   freeze, cm)
    return out

"""Feature cards for the nodes of an attribution graph: what a transcoder feature reads and writes.

A card holds, for one feature node (layer ``L``, position ``p``, feature ``f``):

* its **activation** on the prompt at ``p`` (the graph's, feature units) and the prompt token there;
* its **top activating contexts** (Bricken et al. 2023; Neuronpedia's feature dashboards): the
  tokens on which feature ``f`` of layer ``L``'s transcoder is most active, with the text around
  each and the activating token marked. Read from an activation store of the transcoder's
  ``hook_in`` when one is given (``source: store``: no forward pass; the context around a token
  is the store's own neighbouring tokens of the same row, so a store written at ``position: all``
  or from a packed corpus shows whole contexts, one at ``last`` only the token), else from a
  small corpus pass (``source: corpus``: :func:`tracekit.units.top_contexts`, the stdlib corpus
  by default; special tokens never rank);
* its **logit readout**: the decoder row ``W_dec[f]`` read in vocabulary space through the final
  norm's weight (and LayerNorm's centring) and the unembedding at final-norm scale 1, centred over
  the vocabulary (:meth:`tracekit.model.readout.Readout.vocab_projection`: the rule of the logit
  lens' value readout, Geva et al. 2022): the ``top_tokens`` tokens it promotes and suppresses
  most, in logits per unit of activation. It is the feature's *direct* path to the logits only as
  if written into the last residual stream (later layers are ignored), as on Neuronpedia.

Memory (``run.memory_budget``, :mod:`tracekit.core.budget`): the store is read in chunks of
examples (``[chunk, d_in]`` plus two ``[chunk, d_sae]`` float32 per layer), the corpus in chunks of
windows (:func:`tracekit.activations.chunking.forward_row_bytes` plus three ``[pos, d_sae]``
float32 per layer read), the readout in chunks of rows (:func:`tracekit.model.readout.readout_chunk`,
padded to whole groups so chunked equals unchunked bit for bit).

Source: Ameisen et al. 2025, "Circuit Tracing" (feature visualisations); Neuronpedia / SAE
dashboards (Bricken et al. 2023; McDougall 2024, sae-vis).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union

import numpy as np
import torch
from jaxtyping import Bool, Float

from ..activations import ActivationStore
from ..activations.chunking import forward_chunk_size, forward_row_bytes, row_slice
from ..core.budget import bytes_of, chunk_rows
from ..core.errors import AttributionError, SAEError
from ..corpus import iter_documents, token_windows
from ..dictionaries.dictionary import Dictionary, DictionarySet
from ..model.info import HookedModel
from ..model.load import model_device
from ..model.readout import MIN_READOUT_ROWS, Readout, readout_chunk
from ..sae.windows import special_token_ids
from ..tokens import pad_ids, token_texts
from ..units import top_contexts
from .graph import AttributionGraph

__all__ = ["feature_cards", "logit_readout", "READOUT_RULE", "DictionaryBasis"]

#: The rule of the logit readout, as stated on every card.
READOUT_RULE = ("W_dec[f] through the final norm's weight (LayerNorm: centred first) and W_U at final-norm scale 1, "
                "centred over the vocabulary; logits per unit of activation")


class DictionaryBasis:
    """The features of one :class:`~tracekit.dictionaries.Dictionary` as a read-only
    :class:`tracekit.units.UnitBasis` (what :func:`tracekit.units.top_contexts` reads: the
    activations of the value at ``hook_in``; the decoder rows ``W_dec``). It edits nothing."""

    name = "dictionary_feature"
    verbs: tuple[str, ...] = ()

    def __init__(self, d: Dictionary):
        self.d = d
        self.hook = d.hook_in
        self.n_units = d.d_sae

    def check(self, units: Sequence[int], field: str = "features") -> list[int]:
        """Feature indices as ints. Raises SAEError: one outside ``[0, d_sae)`` (naming ``field``)."""
        bad = [u for u in units if not 0 <= int(u) < self.n_units]
        if bad:
            raise SAEError(f"{field}: feature {bad[0]} out of range: the dictionary has {self.n_units} features")
        return [int(u) for u in units]

    def activations(self, value: torch.Tensor) -> Float[torch.Tensor, "... d_sae"]:
        """``encode`` of the hook's value (flattened to ``d_in``). Raises nothing."""
        x = value.reshape(*value.shape[:2], -1) if value.ndim > 3 else value
        return self.d.encode(x.to(self.d.W_enc.device))

    def decoder_rows(self, units: Sequence[int]) -> Float[torch.Tensor, "k d_out"]:
        """``W_dec[units]`` (float32). Raises nothing."""
        return self.d.W_dec[list(units)].detach().float()

    def hook_rows(self, units: Sequence[int]) -> Float[torch.Tensor, "k d_out"]:
        """``W_dec[units]`` in the dictionary's dtype. Raises nothing."""
        return self.d.W_dec[list(units)].detach()

    def edit_hook(self, units: Sequence[int], edit: Optional[Callable[[torch.Tensor], torch.Tensor]],
                  add: Optional[Float[torch.Tensor, " d_hook"]], where: Bool[torch.Tensor, " pos"],
                  start: Optional[torch.Tensor] = None) -> Callable:
        """Not supported (cards only read). Raises SAEError always."""
        raise SAEError("a feature card reads features; intervene with tracekit.graphs.verify instead")


@torch.no_grad()
def logit_readout(model: HookedModel, rows: Float[torch.Tensor, "k d_model"], k: int = 8
                  ) -> list[tuple[list[tuple[str, int, float]], list[tuple[str, int, float]]]]:
    """The tokens each decoder row promotes and suppresses most (module docstring, :data:`READOUT_RULE`).

    Args:
        rows: ``[k_rows, d_model]`` residual-stream directions (a transcoder's ``W_dec`` rows).
        k: tokens per side.

    Returns:
        Per row ``(promoted, suppressed)``, each ``[(token text, token id, logits per unit)]``
        (suppressed: the most negative first, scores negative).

    Raises:
        AttributionError: rows not of width ``d_model`` (a dictionary that does not write the
            residual stream). MemoryBudgetError: one group of rows does not fit the budget.
    """
    d_model = int(model.cfg.d_model)
    if rows.ndim != 2 or rows.shape[1] != d_model:
        raise AttributionError(f"logit readout: decoder rows of shape {tuple(rows.shape)} do not write the residual "
                               f"stream (d_model {d_model}); cards read transcoders whose hook_out is a residual write")
    ro = Readout(model)
    n = rows.shape[0]
    k = min(int(k), int(model.cfg.d_vocab))
    chunk = readout_chunk(model, n, what="feature card logit readout", fix="give fewer nodes")
    out = []
    for s in range(0, n, chunk):
        part = rows[s:s + chunk]
        m = part.shape[0]
        pad = (-m) % MIN_READOUT_ROWS  # whole groups: each row's bits do not depend on the chunk
        if pad:
            part = torch.cat([part, part.new_zeros(pad, d_model)])
        scores = ro.vocab_projection(part)[:m].cpu()
        for i in range(m):
            up, down = torch.topk(scores[i], k), torch.topk(-scores[i], k)
            ut, dt = token_texts(model, up.indices.tolist()), token_texts(model, down.indices.tolist())
            out.append(([(t, int(j), float(v)) for t, j, v in zip(ut, up.indices.tolist(), up.values.tolist())],
                        [(t, int(j), -float(v)) for t, j, v in zip(dt, down.indices.tolist(), down.values.tolist())]))
    return out


def _check_nodes(graph: AttributionGraph, dictionaries: DictionarySet, nodes: Sequence[int]) -> list[int]:
    out = []
    for n in nodes:
        if isinstance(n, bool) or not hasattr(n, "__index__") or not 0 <= int(n) < graph.n_features:
            raise AttributionError(f"nodes: {n!r} is not a feature node (feature nodes are 0..{graph.n_features - 1})")
        out.append(int(n))
    missing = sorted({int(graph.features[n, 0]) for n in out} - set(dictionaries.layers))
    if missing:
        raise AttributionError(f"dictionaries: no transcoder for layer(s) {missing} of the graph's features (it has "
                               f"{dictionaries.layers}); pass the transcoder set the graph was built with")
    return list(dict.fromkeys(out))


def _merge_top(vals: torch.Tensor, idx: torch.Tensor, new_v: torch.Tensor, new_i: torch.Tensor, top_n: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Running top-n per feature (rows), ties by the lower example index (deterministic, chunk-free)."""
    v = torch.cat([vals, new_v], 1)
    i = torch.cat([idx, new_i], 1)
    o1 = torch.sort(i, dim=1, stable=True).indices
    o2 = torch.sort(v.gather(1, o1), dim=1, descending=True, stable=True).indices
    order = o1.gather(1, o2)[:, :top_n]
    return v.gather(1, order), i.gather(1, order)


def _store_contexts(model: HookedModel, dictionaries: DictionarySet, by_layer: dict[int, list[int]], store: ActivationStore,
                    top_n: int, before: int, after: int) -> dict[tuple[int, int], list[dict]]:
    store.check_model(model, "store")
    store.require_hooks([dictionaries[L].hook_in for L in by_layer], "store")
    rows, positions, tok = store.rows, store.positions, store.token_ids
    order = np.lexsort((positions, rows))  # examples by row, then position: a row's context is contiguous
    out: dict[tuple[int, int], list[dict]] = {}
    dev = model_device(model)
    for L, feats in by_layer.items():
        d = dictionaries[L]
        per = bytes_of(d.d_in + 2 * d.d_sae)
        chunk = chunk_rows(per, max(1, len(store)), what="feature cards (store read)", device=dev, unit="example",
                           fix="give fewer nodes or a store of narrower transcoders")
        f_idx = torch.tensor(feats, dtype=torch.long)
        vals = torch.full((len(feats), 0), float("-inf"))
        idx = torch.zeros((len(feats), 0), dtype=torch.long)
        at = 0
        for part in store.iter_batches(d.hook_in, chunk):
            acts = d.encode(part.to(device=d.W_enc.device, dtype=d.W_enc.dtype))[:, f_idx.to(d.W_enc.device)]
            a = acts.float().cpu().T  # [n_feats, chunk]
            a = a.masked_fill(~(a > 0), float("-inf"))  # inactive never ranks
            ex = torch.arange(at, at + part.shape[0]).expand(len(feats), -1)
            vals, idx = _merge_top(vals, idx, a, ex, top_n)
            at += part.shape[0]
        for j, f in enumerate(feats):
            ctxs = []
            for v, e in zip(vals[j].tolist(), idx[j].tolist()):
                if not np.isfinite(v):
                    continue
                r, p = int(rows[e]), int(positions[e])
                lo = np.searchsorted(rows[order], r, "left")
                hi = np.searchsorted(rows[order], r, "right")
                same = order[lo:hi]
                near = same[(positions[same] >= p - before) & (positions[same] <= p + after)]
                near = near[np.argsort(positions[near], kind="stable")]
                ids = [int(t) for t in tok[near]]
                ctxs.append({"activation": float(v), "tokens": token_texts(model, ids) if ids else [],
                             "at": int(np.nonzero(positions[near] == p)[0][0]) if len(near) else 0,
                             "row": r, "position": p})
            out[(L, f)] = ctxs
    return out


def _corpus_contexts(model: HookedModel, dictionaries: DictionarySet, by_layer: dict[int, list[int]], corpus, top_n: int,
                     seq_len: int, max_tokens: int, batch_size: int, before: int, after: int
                     ) -> dict[tuple[int, int], list[dict]]:
    reads = [(DictionaryBasis(dictionaries[L]), f) for L, feats in by_layer.items() for f in feats]
    windows = [list(w.ids) for w in token_windows(model, iter_documents(corpus), seq_len=seq_len, max_tokens=max_tokens)]
    if not windows:
        raise AttributionError("corpus: no text to read feature contexts from; give a corpus or a store")
    special = torch.tensor(special_token_ids(model), dtype=torch.long)
    width = sum(dictionaries[L].d_sae for L in by_layer)
    deepest, n_layers = max(by_layer), int(model.cfg.n_layers)  # the pass stops after the deepest block read
    step = max(1, int(batch_size))

    def batches():
        for s in range(0, len(windows), step):
            batch = pad_ids(model, windows[s:s + step])
            ok = batch.attention_mask.bool().cpu() & ~torch.isin(batch.tokens.cpu(), special)
            T = int(batch.tokens.shape[1])
            per_row = forward_row_bytes(model, T, logits=deepest + 1 >= n_layers) + 3 * 4 * T * width
            chunk = forward_chunk_size(model, batch.size, per_row, what="feature cards (corpus contexts)",
                                       fix="lower seq_len or give fewer nodes")
            for c in range(0, batch.size, chunk):
                sl = slice(c, min(batch.size, c + chunk))
                yield row_slice(batch, sl), list(range(s + sl.start, s + sl.stop)), ok[sl]

    found = top_contexts(model, reads, batches(), top_n=top_n, positive_only=True, field="nodes")  # type: ignore[arg-type]
    out: dict[tuple[int, int], list[dict]] = {}
    j = 0
    for L, feats in by_layer.items():
        for f in feats:
            ctxs = []
            for v, w, p in found.ranked(j):
                ids = windows[w]
                lo, hi = max(0, p - before), min(len(ids), p + after + 1)
                ctxs.append({"activation": float(v), "tokens": token_texts(model, ids[lo:hi]), "at": p - lo,
                             "row": int(w), "position": int(p)})
            out[(L, f)] = ctxs
            j += 1
    return out


def _clerp(promoted: list[tuple[str, int, float]]) -> str:
    return "→ " + " ".join(repr(t) for t, _, _ in promoted[:3]) if promoted else ""


@torch.no_grad()
def feature_cards(model: HookedModel, dictionaries: DictionarySet, graph: AttributionGraph, nodes: Sequence[int], *,
                  store: Union[ActivationStore, str, Path, None] = None, contexts: int = 5, top_tokens: int = 8,
                  corpus: Union[str, Sequence[str], None] = None, seq_len: int = 64, max_tokens: int = 4096,
                  batch_size: int = 8, before: int = 8, after: int = 3) -> dict[int, dict[str, Any]]:
    """Feature cards of some feature nodes (module docstring).

    Args:
        model: the hooked model the graph was built on.
        dictionaries: the graph's transcoder set (layer -> :class:`~tracekit.dictionaries.Dictionary`).
        graph: the attribution graph.
        nodes: feature node indices (``0 .. graph.n_features - 1``); repeats are read once.
        store: an activation store (or its folder) holding each needed layer's ``hook_in``; None
            reads ``corpus`` instead.
        contexts: top activating contexts per card.
        top_tokens: tokens per side of the logit readout.
        corpus: the corpus of the corpus pass (None: the offline stdlib corpus; a file, folder or
            list of texts: :func:`tracekit.corpus.iter_documents`).
        seq_len: corpus window length (tokens, BOS included).
        max_tokens: text tokens the corpus pass reads at most.
        batch_size: windows per forward pass (the budget may split it; the result does not change).
        before: tokens of context shown before the activating token.
        after: tokens of context shown after it.

    Returns:
        ``{node: card}``; a card: ``node``, ``node_id``-free facts ``layer``, ``position``,
        ``feature``, ``token`` (prompt token at the position), ``activation`` (the graph's, feature
        units), ``source`` (``store`` | ``corpus``) and ``source_detail``, ``contexts``
        (``[{activation, tokens, at, row, position}]``, ``tokens[at]`` the activating token; best
        first), ``top_tokens`` / ``bottom_tokens`` (``[{token, token_id, logit}]``, logits per unit
        of activation), ``readout_rule`` (:data:`READOUT_RULE`) and ``clerp`` (a short label: the
        top promoted tokens).

    Raises:
        AttributionError: a node that is not a feature node; a layer without a transcoder; a
            transcoder that does not write the residual stream (``d_out != d_model``); no corpus text.
        StoreError: a store of another model or without a needed hook.
        MemoryBudgetError: one example, window or readout group does not fit the budget.
    """
    idx = _check_nodes(graph, dictionaries, nodes)
    if not idx:
        return {}
    if contexts < 0 or top_tokens < 1:
        raise AttributionError(f"contexts ({contexts}) must be >= 0 and top_tokens ({top_tokens}) >= 1")
    trip = {n: tuple(int(v) for v in graph.features[n].tolist()) for n in idx}  # (layer, pos, feature)
    by_layer: dict[int, list[int]] = {}
    for L, _, f in trip.values():
        if f not in by_layer.setdefault(L, []):
            by_layer[L].append(f)
    for L, feats in by_layer.items():
        DictionaryBasis(dictionaries[L]).check(feats, f"graph features of layer {L}")
    # the logit readout, one row per (layer, feature)
    keys = [(L, f) for L, feats in by_layer.items() for f in feats]
    rows = torch.stack([dictionaries[L].W_dec[f].detach().float() for L, f in keys])
    readout = dict(zip(keys, logit_readout(model, rows.to(model_device(model)), top_tokens)))
    # the contexts
    ctx: dict[tuple[int, int], list[dict]] = {k: [] for k in keys}
    if contexts > 0:
        if store is not None:
            st = store if isinstance(store, ActivationStore) else ActivationStore(store, field="store")
            try:
                ctx = _store_contexts(model, dictionaries, by_layer, st, contexts, before, after)
            finally:
                if st is not store:
                    st.close()
        else:
            ctx = _corpus_contexts(model, dictionaries, by_layer, corpus, contexts, seq_len, max_tokens, batch_size,
                                   before, after)
    if store is not None:
        path = store.path if isinstance(store, ActivationStore) else Path(store)
        source, detail = "store", f"activation store {Path(path).name} ({'hook_in of each layer'})"
    else:
        source = "corpus"
        detail = (f"corpus pass over {'the stdlib corpus' if corpus is None else 'the given corpus'} "
                  f"(at most {max_tokens} tokens, windows of {seq_len})")
    cards: dict[int, dict[str, Any]] = {}
    for n in idx:
        L, p, f = trip[n]
        up, down = readout[(L, f)]
        cards[n] = {"node": n, "layer": L, "position": p, "feature": f, "token": graph.tokens[p],
                    "activation": float(graph.activations[n]), "source": source, "source_detail": detail,
                    "contexts": ctx.get((L, f), []),
                    "top_tokens": [{"token": t, "token_id": j, "logit": v} for t, j, v in up],
                    "bottom_tokens": [{"token": t, "token_id": j, "logit": v} for t, j, v in down],
                    "readout_rule": READOUT_RULE, "clerp": _clerp(up)}
    return cards

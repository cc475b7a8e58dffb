"""Training a tuned lens on cached activations, and the cache of trained lenses.

Over 600 lines (reason): the training spec, its data (corpus split, residual cache, store), the
loop, its memory-budget estimates and the lens cache share one cache key and one record; split,
each piece would import the others' private helpers.

Data: corpus documents (:func:`tracekit.corpus.iter_documents`; default the offline ``stdlib``
corpus) are split **by document** into training and held-out text, deterministically
(:func:`document_split`: a document -- paragraphs sharing a topic/docstring owner count as one -- is
held out when the sha256 of its id is 0 mod 5, so ~20% of the text), and cut into windows of at
most ``seq_len`` tokens (:func:`tracekit.corpus.token_windows`). The residual stream at every
hidden state is cached once, at the windows' real tokens only (BOS and padding excluded), into a
memory-mapped scratch file (float32, ``[n_layers + 1, n_tokens, d_model]``; memory stays bounded by
one batch of windows). With ``store`` (:func:`store_tokens`) they are copied from an activation
store (:mod:`tracekit.activations`) of the same model instead: corpus windows at position ``all``,
split by document the same way, so the same corpus and ``seq_len`` give the same tokens and lens.

Loss (tuned-lens ``scripts/train_loop.py``, ``--loss kl``): for every translator ``h < n_layers``,
``KL(p_final || p_lens_h)`` in nats, averaged over tokens, where ``p_final`` is the model's own
output distribution (the :class:`~tracekit.model.readout.Readout` of the last hidden state) and
``p_lens_h`` the tuned lens at ``h``. Each translator's loss is back-propagated on its own (as the
package, bounding memory), then one optimizer step for all. Optimizer: Adam (default; with a
budget of a few thousand tokens it converges in fewer steps than SGD-Nesterov) or SGD with
Nesterov momentum (the package's default, lr ``lr * (1 - momentum)``); weight decay on the
translators, i.e. towards the identity; gradient norm clipped to 1; linear warm-up (10%) and decay
of the learning rate; seeded (token order and nothing else is random: translators start at zero).

Cache: the trained lens is saved under ``$TRACEKIT_CACHE_DIR/tuned_lenses/<key>`` (default
``~/.cache/tracekit``), ``key`` = sha256 of the model's fingerprint, residual basis, BOS and dtype,
the training config and the token ids trained and evaluated on (the corpus content; with a store,
also the sha256 of its manifest), written
atomically with a files manifest (sizes and sha256, checked on every hit); so the first run trains
and later runs load.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import time
import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Literal, Optional, Sequence, Union, cast

import numpy as np
import torch
from pydantic import Field

from ..activations.chunking import check_fits, forward_chunk_size, forward_chunks, forward_row_bytes, row_slice
from ..activations.store import MANIFEST, ActivationStore, StoreError
from ..core.cachedir import cache_path, remove_stale_temps
from ..core.errors import ConfigError, CorpusError
from ..core.io import ManifestInvalid, file_sha256, verify_files_manifest, write_files_manifest
from ..core.strict import StrictModel
from ..corpus import Window, iter_documents, token_windows, window_batches
from ..fastpath import residual_stream
from ..logit_lens import lens_points
from ..model.context import check_window
from ..model.info import HookedModel
from ..model.load import model_spec_of
from ..model.readout import Readout
from ..scratch import scratch_dir
from ..tokens import encode
from .tuned import CONFIG_FILE, PARAMS_FILE, TRACEKIT_FILE, TunedLens, lens_log_probs, residual_basis

__all__ = ["TunedLensSpec", "document_split", "split_windows", "cache_residuals", "train_tuned_lens",
           "load_or_train_tuned_lens", "tuned_lens_cache_dir", "held_out_kl", "ResidualCache",
           "StoreTokens", "store_tokens"]

#: One document in this many is held out (by the sha256 of its id).
HELD_OUT_EVERY = 5


class TunedLensSpec(StrictModel):
    """How to get a tuned lens: load one (``path``) or train one (the other fields).

    Fields:
        path: a saved lens folder (tracekit's or the tuned-lens package's layout); then nothing is
            trained and the training fields are ignored.
        store: an activation store (:mod:`tracekit.activations`) to train from instead of running
            the model: written by this model from a corpus at position ``all`` with every hidden
            state's hook (``blocks.0.hook_resid_pre``, ``blocks.{L}.hook_resid_post``); its windows
            are split by document as the corpus's (:func:`document_split`), so ``corpus``,
            ``seq_len`` and ``batch_size`` are the store's (ignored here).
        corpus: training text: ``stdlib`` (default, offline), a ``.txt``/``.md``/``.jsonl`` file, a
            folder of them, or a list; only its training documents are used (:func:`document_split`).
        train_tokens: tokens trained on (BOS excluded; default 4096).
        seq_len: tokens per window (BOS included; default 128).
        epochs: passes over the training tokens (default 3).
        batch_tokens: tokens per optimizer step (default 256).
        optimizer: ``adam`` (default) or ``sgd`` (Nesterov momentum, as tuned-lens).
        lr: learning rate (default 1e-3 for Adam, 1.0 for SGD, which is scaled by ``1 - momentum``).
        momentum: SGD momentum / Adam beta1 (default 0.9).
        weight_decay: decay of the translators towards the identity (default 1e-3).
        bias: translators with a bias (default true).
        held_out_tokens: held-out tokens on which the training records each hidden state's KL,
            before and after training (default 256; 0: none).
        batch_size: windows per forward pass when caching activations (default 8).
        seed: seeds the token order (default 0).
        cache: load / save the trained lens in the cache (default true).
    """

    path: Optional[str] = None
    store: Optional[str] = None
    corpus: Union[str, list[str]] = "stdlib"
    train_tokens: int = Field(default=4096, ge=8)
    seq_len: int = Field(default=128, ge=4)
    epochs: int = Field(default=3, ge=1)
    batch_tokens: int = Field(default=256, ge=1)
    optimizer: Literal["adam", "sgd"] = "adam"
    lr: Optional[float] = Field(default=None, gt=0)
    momentum: float = Field(default=0.9, ge=0, lt=1)
    weight_decay: float = Field(default=1e-3, ge=0)
    bias: bool = True
    held_out_tokens: int = Field(default=256, ge=0)
    batch_size: int = Field(default=8, ge=1)
    seed: int = 0
    cache: bool = True

    def check_context(self, model: HookedModel, field: str = "tuned") -> None:
        """Refuse a ``seq_len`` longer than the model's context when a lens is to be trained (no
        ``path`` nor ``store``), before anything runs (:func:`tracekit.model.context.check_window`).

        Args:
            model: a hooked model or :class:`~tracekit.model.ModelInfo`.
            field: the spec's config field (``<field>.seq_len`` is named).

        Raises:
            ConfigError: ``seq_len`` longer than the model's context.
        """
        if self.path is None and self.store is None:
            check_window(model, self.seq_len, f"{field}.seq_len")

    def training_fields(self) -> dict:
        """The fields that change the trained lens (the cache key's part of the config)."""
        return self.model_dump(mode="json", exclude={"path", "store", "cache", "batch_size"})


def tuned_lens_cache_dir() -> Path:
    """``$TRACEKIT_CACHE_DIR/tuned_lenses`` (default ``~/.cache/tracekit/tuned_lenses``; :func:`tracekit.core.cachedir.cache_path`)."""
    return cache_path("tuned_lenses")


def document_split(doc_id: str) -> str:
    """``"held_out"`` or ``"train"`` for a corpus document, from the sha256 of its id up to ``#`` (the
    paragraphs of one reference topic, docstring or file paragraph group go to the same side)."""
    group = doc_id.split("#", 1)[0]
    return "held_out" if int(hashlib.sha256(group.encode()).hexdigest(), 16) % HELD_OUT_EVERY == 0 else "train"


def split_windows(model: HookedModel, corpus: Union[str, Sequence[str], None], part: str, n_tokens: int, seq_len: int,
                  field: str = "corpus", seq_field: str = "seq_len") -> list[Window]:
    """Windows of the documents of one side of the split, in corpus order, until ``n_tokens`` text
    tokens (BOS excluded) are collected.

    Args:
        model: a hooked model or :class:`~tracekit.model.ModelInfo` (tokenizer and BOS setting).
        corpus: the corpus source (:func:`tracekit.corpus.iter_documents`).
        part: ``"train"`` or ``"held_out"``.
        n_tokens: text tokens wanted.
        seq_len: tokens per window, BOS included.
        field: the config field quoted in errors.
        seq_field: the config field of ``seq_len``, quoted in errors.

    Raises:
        CorpusError: the corpus side holds fewer than ``n_tokens`` tokens.
        ConfigError: ``seq_len`` longer than the model's context.
    """
    docs = ((d, t) for d, t in iter_documents(corpus, field=field) if document_split(d) == part)
    wins = list(token_windows(model, docs, seq_len=seq_len, max_tokens=n_tokens, field=seq_field))
    got = sum(len(w.ids) - w.n_prefix for w in wins)
    if got < n_tokens:
        raise CorpusError(f"{field}: the {part.replace('_', '-')} documents of the corpus give {got} tokens, fewer than "
                          f"the {n_tokens} asked for; lower the token count or give a larger corpus")
    return wins


def _tokens_sha(windows: Sequence[Window]) -> str:
    h = hashlib.sha256()
    for w in windows:
        h.update(np.asarray(w.ids, dtype=np.int64).tobytes() + b"|" + str(w.n_prefix).encode())
    return h.hexdigest()


class ResidualCache:
    """Residuals at every hidden state of some windows' real tokens, memory-mapped from a file.

    Attributes:
        acts: ``[n_layers + 1, n_tokens, d_model]`` float32 (a ``numpy.memmap``).
        next_ids: ``[n_tokens]`` the token after each one (-1 for a window's last token).
    """

    def __init__(self, acts: np.ndarray, next_ids: np.ndarray):
        self.acts = acts
        self.next_ids = next_ids

    @property
    def n_tokens(self) -> int:
        return int(self.acts.shape[1])

    def rows(self, hidden_state: int, idx: np.ndarray, device) -> torch.Tensor:
        """``[len(idx), d_model]`` float32 residuals of a hidden state at token rows ``idx``, on ``device``."""
        return torch.from_numpy(np.ascontiguousarray(self.acts[hidden_state, np.sort(idx)])).to(device)


@torch.no_grad()
def cache_residuals(model: HookedModel, windows: Sequence[Window], folder: Path, batch_size: int = 8,
                    progress: Optional[Callable[[int], object]] = None) -> ResidualCache:
    """Run the model over ``windows`` once and store the residual stream at every hidden state
    (``0 .. n_layers``) at each window's text tokens (``ids[n_prefix:]``: BOS and padding excluded)
    in ``folder/residuals.npy`` (memory-mapped; memory stays bounded by one batch).

    Args:
        model: a hooked model.
        windows: corpus windows (:func:`split_windows`).
        folder: where the file is written (a scratch folder).
        batch_size: windows per forward pass.
        progress: optional callable receiving the number of windows done.

    Memory budget (``run.memory_budget``): each batch of ``batch_size`` windows runs in chunks of
    windows the budget allows (padded to the batch's width: the residuals do not depend on it). The
    estimate per window: its forward pass without logits
    (:func:`tracekit.activations.chunking.forward_row_bytes`) plus ``[n_layers + 1, pos, d_model]``
    read twice (the stacked hooks and the float32 copy). The cache file is on disk (memory-mapped).

    Returns:
        The :class:`ResidualCache` (tokens in window order).

    Raises:
        MemoryBudgetError: one window does not fit the budget, before its forward pass.
    """
    n_layers = int(model.cfg.n_layers)
    hooks = [p.hook for p in lens_points(n_layers, "hidden_states")]
    n = sum(len(w.ids) - w.n_prefix for w in windows)
    acts = np.lib.format.open_memmap(folder / "residuals.npy", mode="w+", dtype=np.float32,
                                     shape=(n_layers + 1, n, int(model.cfg.d_model)))
    next_ids = np.full(n, -1, dtype=np.int64)
    starts = np.cumsum([0] + [len(w.ids) - w.n_prefix for w in windows])
    done = 0
    H, d = n_layers + 1, int(model.cfg.d_model)
    for batch, group in window_batches(model, windows, batch_size=batch_size):
        T = int(batch.tokens.shape[1])
        per_row = forward_row_bytes(model, T, logits=False) + 2 * 4 * H * T * d  # + [H, pos, d] and its copy
        chunk = forward_chunk_size(model, batch.size, per_row, what="tuned lens residual cache",
                                   fix="lower tuned.seq_len")

        def run(sl: slice, batch=batch, group=group, first=done) -> None:
            resid = residual_stream(model, row_slice(batch, sl), hooks)  # [H, rows, pos, d]
            for j, w in enumerate(group[sl]):
                b = sl.start + j
                idx = batch.real_index(b)[w.n_prefix:]
                at, k = int(starts[first + b]), len(idx)
                acts[:, at:at + k] = resid[:, j, idx.to(resid.device)].float().cpu().numpy()
                next_ids[at:at + k - 1] = np.asarray(w.ids[w.n_prefix + 1:], dtype=np.int64)

        forward_chunks(run, batch.size, chunk, "tuned lens residual cache")
        done += len(group)
        if progress is not None:
            progress(len(group))
    acts.flush()
    return ResidualCache(acts, next_ids)


@dataclass
class StoreTokens:
    """The tokens a tuned lens trains and is evaluated on, read from an activation store.

    Attributes:
        store: the opened store (checked against the model).
        train: the training windows (store rows of training-side documents, the last one cut to
            ``train_tokens``; ``start`` is -1: the store does not record it).
        held_out: the held-out windows (held-out-side documents, cut to ``held_out_tokens``).
        train_examples: ``[n_train_tokens]`` the store examples of ``train``, increasing.
        held_out_examples: ``[n_held_out_tokens]`` those of ``held_out``.
        manifest_sha256: sha256 of the store's ``manifest.json`` (its identity in the cache key).
    """

    store: ActivationStore
    train: list[Window]
    held_out: list[Window]
    train_examples: np.ndarray
    held_out_examples: np.ndarray
    manifest_sha256: str

    def residuals(self, model: HookedModel, part: str, folder: Path) -> ResidualCache:
        """The :class:`ResidualCache` of one side (``"train"`` / ``"held_out"``), copied from the store
        into ``folder/residuals.npy`` (float32; one store slice in memory at a time)."""
        wins, ex = (self.train, self.train_examples) if part == "train" else (self.held_out, self.held_out_examples)
        n_layers = int(model.cfg.n_layers)
        acts = np.lib.format.open_memmap(folder / "residuals.npy", mode="w+", dtype=np.float32,
                                         shape=(n_layers + 1, len(ex), int(model.cfg.d_model)))
        self.store.read_into([p.hook for p in lens_points(n_layers, "hidden_states")], ex, acts)
        acts.flush()
        next_ids = np.full(len(ex), -1, dtype=np.int64)
        at = 0
        for w in wins:
            k = len(w.ids) - w.n_prefix
            next_ids[at:at + k - 1] = np.asarray(w.ids[w.n_prefix + 1:], dtype=np.int64)
            at += k
        return ResidualCache(acts, next_ids)


def store_tokens(model: HookedModel, spec: TunedLensSpec, field: str = "tuned") -> StoreTokens:
    """Open ``spec.store`` and pick the tokens to train and evaluate on: its windows split by
    document (:func:`document_split`), in store order, until ``train_tokens`` / ``held_out_tokens``
    text tokens (the tokens :func:`split_windows` gives on the corpus the store was written from,
    when the store holds enough of it and used the same ``seq_len``).

    Args:
        model: the hooked model the store must have been written with.
        spec: the lens spec (``store`` set).
        field: the config field quoted in errors (``<field>.store``).

    Returns:
        The :class:`StoreTokens`.

    Raises:
        StoreError: no complete store at the path; a store of another model; one not written from a
            corpus at position ``all`` (or without its documents recorded); a hidden state's hook
            missing; fewer training / held-out tokens than asked for.
    """
    assert spec.store is not None
    f = f"{field}.store"
    store = ActivationStore(spec.store, field=f)
    store.check_model(model, f)
    man = store.manifest
    if man.get("source", {}).get("packed"):
        raise StoreError(f"{f}: the store at {store.path} holds packed corpus windows (corpus.packed: true: windows "
                         "across documents, BOS included), which an SAE trains on; a tuned lens trains on per-document "
                         "windows split by document: write one without corpus.packed, or drop tuned.store")
    if man.get("source", {}).get("kind") != "corpus" or store.position != "all" or "row_docs" not in man:
        raise StoreError(f"{f}: the store at {store.path} holds position {store.position!r} of "
                         f"{man.get('source', {}).get('kind')!r} rows; a tuned lens trains on every token of corpus "
                         "windows: write one with kind: activations, corpus: {...}, position: all (with this "
                         "tracekit version, which records each window's document), or drop tuned.store")
    store.require_hooks([p.hook for p in lens_points(int(model.cfg.n_layers), "hidden_states")], f)
    rows, pos, tok = store.rows, store.positions, store.token_ids
    starts = np.searchsorted(rows, np.arange(int(man["n_rows"]) + 1))
    bos = list(encode(model, "", prepend_bos=True)) if model_spec_of(model).prepend_bos else []
    want = {"train": spec.train_tokens, "held_out": spec.held_out_tokens}
    wins: dict[str, list[Window]] = {"train": [], "held_out": []}
    ex: dict[str, list[np.ndarray]] = {"train": [], "held_out": []}
    got = {"train": 0, "held_out": 0}
    for r, doc in enumerate(man["row_docs"]):
        part = document_split(str(doc))
        a, b = int(starts[r]), int(starts[r + 1])
        k = min(b - a, want[part] - got[part])
        if k <= 0:
            continue
        wins[part].append(Window(len(wins[part]), str(doc), -1, tuple(bos + tok[a:a + k].tolist()), int(pos[a])))
        ex[part].append(np.arange(a, a + k))
        got[part] += k
    for part, name in (("train", "train_tokens"), ("held_out", "held_out_tokens")):
        if got[part] < want[part]:
            raise StoreError(f"{f}: the {part.replace('_', '-')} documents of the store at {store.path} give "
                             f"{got[part]} tokens, fewer than {field}.{name} = {want[part]}; write a larger store "
                             f"(corpus.max_tokens) or lower {field}.{name}")
    cat = {p: np.concatenate(v) if v else np.zeros(0, dtype=np.int64) for p, v in ex.items()}
    return StoreTokens(store, wins["train"], wins["held_out"], cat["train"], cat["held_out"],
                       file_sha256(store.path / MANIFEST, memo=False))


def training_bytes(model: HookedModel, spec: TunedLensSpec, held_out: bool = True) -> int:
    """Estimated bytes one training step holds whatever the budget (its batch is the user's
    ``batch_tokens``, never split, so the lens does not depend on the budget), float32: the final
    and the lens' log-probabilities with the loss' temporaries and gradient
    (``6 x batch_tokens x d_vocab``), the translators with their gradients and Adam's moments
    (``5 x n_layers x (d_model^2 + d_model)``); with held-out tokens, the held-out evaluation's
    ``4 x min(256, held_out_tokens) x d_vocab`` when larger (:func:`held_out_kl`'s batch)."""
    vocab, d, L = int(model.cfg.d_vocab), int(model.cfg.d_model), int(model.cfg.n_layers)
    step = 6 * spec.batch_tokens * vocab
    held = 4 * min(256, spec.held_out_tokens) * vocab if held_out else 0
    return 4 * (max(step, held) + 5 * L * (d * d + d))


def _batches(n: int, size: int, gen: torch.Generator) -> Iterator[np.ndarray]:
    perm = torch.randperm(n, generator=gen).numpy()
    for s in range(0, n, size):
        yield perm[s:s + size]


def _optimizer(params, spec: TunedLensSpec) -> torch.optim.Optimizer:
    if spec.optimizer == "sgd":  # the package's: PyTorch scales the lr by 1/(1 - momentum), undone here
        return torch.optim.SGD(params, lr=(spec.lr or 1.0) * (1 - spec.momentum), momentum=spec.momentum,
                               nesterov=spec.momentum > 0, weight_decay=spec.weight_decay)
    return torch.optim.Adam(params, lr=spec.lr or 1e-3, betas=(spec.momentum, 0.999), amsgrad=True,
                            weight_decay=spec.weight_decay)


@torch.no_grad()
def held_out_kl(model: HookedModel, lens: Optional[TunedLens], cache: ResidualCache, batch_tokens: int = 256) -> list[float]:
    """Mean ``KL(p_final || p_lens_h)`` (nats) per hidden state ``0 .. n_layers`` over the cached tokens
    (``lens=None``: the logit lens)."""
    readout = Readout(model)
    dev = readout.W_U.device
    H = cache.acts.shape[0]
    sums = np.zeros(H)
    for s in range(0, cache.n_tokens, batch_tokens):
        idx = np.arange(s, min(s + batch_tokens, cache.n_tokens))
        fin = readout.log_probs(cache.rows(H - 1, idx, dev).to(readout.W_U.dtype))
        pf = fin.exp()
        for h in range(H):
            x = cache.rows(h, idx, dev).to(readout.W_U.dtype)
            lp = readout.log_probs(x if lens is None else lens.transform(x, h))
            sums[h] += float((pf * (fin - lp)).sum(-1).sum())
    return [float(v / max(1, cache.n_tokens)) for v in sums]


def _fit(model: HookedModel, lens: TunedLens, cache: ResidualCache, spec: TunedLensSpec, progress: bool) -> list[float]:
    """Train every translator on the cached residuals (module docstring); returns each translator's
    mean training KL over the last epoch (nats)."""
    from ..core.progress import progress_bar

    readout = Readout(model)
    dev = readout.W_U.device
    gen = torch.Generator().manual_seed(int(spec.seed))
    opt = _optimizer([p for p in lens.parameters()], spec)
    steps_per_epoch = math.ceil(cache.n_tokens / spec.batch_tokens)
    total = steps_per_epoch * spec.epochs
    warm = max(1, total // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / warm, max(0.0, (total - s) / max(1, total - warm))))
    n = len(lens.layer_translators)
    bar = progress_bar(total=total, desc="tuned lens training", unit="step", enabled=progress)
    last = np.zeros(n)
    try:
        for _epoch in range(spec.epochs):
            last[:] = 0.0
            for idx in _batches(cache.n_tokens, spec.batch_tokens, gen):
                with torch.no_grad():
                    fin = readout.log_probs(cache.rows(n, idx, dev).to(readout.W_U.dtype))
                    pf = fin.exp()
                for h in range(n):
                    x = cache.rows(h, idx, dev).to(readout.W_U.dtype)
                    lp = lens_log_probs(model, lens.transform(x, h))
                    loss = (pf * (fin - lp)).sum(-1).mean()
                    loss.backward()
                    last[h] += float(loss.detach()) * len(idx)
                torch.nn.utils.clip_grad_norm_(lens.parameters(), 1.0)
                opt.step()
                opt.zero_grad(set_to_none=False)
                sched.step()
                bar.update(1)
    finally:
        bar.close()
    return [float(v / cache.n_tokens) for v in last]


def train_tuned_lens(model: HookedModel, spec: TunedLensSpec, progress: bool = False, field: str = "tuned",
                     windows: Optional[tuple[list[Window], list[Window]]] = None,
                     stored: Optional[StoreTokens] = None) -> TunedLens:
    """Train a tuned lens for ``model`` (no cache: :func:`load_or_train_tuned_lens` caches).

    Args:
        model: a hooked model (its weights are not changed; gradients flow through its final norm
            and unembedding only).
        spec: the training config.
        progress: show progress bars.
        field: the config field quoted in errors.
        windows: ``(train, held_out)`` windows (default: :func:`split_windows` of ``spec.corpus``).
        stored: residuals read from an activation store instead of running the model (default:
            :func:`store_tokens` when ``spec.store`` is set); its windows replace ``windows``.

    Returns:
        The trained lens on the model's device; its ``record`` holds the training config, token
        counts, time, per-hidden-state training KL (last epoch) and held-out KL of the logit lens
        (``held_out_kl_logit``) and of the tuned lens (``held_out_kl``), in nats.

    Memory budget (``run.memory_budget``): only the forward passes that cache the residuals are
    chunked (:func:`cache_residuals`); the optimiser's batches are ``batch_tokens`` tokens whatever
    the budget, so for a given seed the lens is the same under any budget. A budget below one
    training step (:func:`training_bytes`) is refused before the model runs.

    Raises:
        CorpusError: the corpus is too small for ``train_tokens`` / ``held_out_tokens``.
        StoreError: a store that cannot be used (:func:`store_tokens`).
        MemoryBudgetError: one training step or one window's forward pass does not fit the budget.
    """
    if stored is None and spec.store is not None:
        stored = store_tokens(model, spec, field)
    if stored is not None:
        windows = (stored.train, stored.held_out)
    elif windows is None:
        windows = _spec_windows(model, spec, field)
    train_w, held_w = windows

    def residuals(part: str, wins: Sequence[Window], folder: Path) -> ResidualCache:
        if stored is not None:
            return stored.residuals(model, part, folder)
        return cache_residuals(model, wins, folder, spec.batch_size)

    check_fits(model, training_bytes(model, spec, bool(held_w)), what="tuned lens training", unit="optimiser step",
               fix=f"lower {field}.batch_tokens (it changes the lens) or {field}.held_out_tokens")
    lens = TunedLens.from_model(model, bias=spec.bias)
    t0 = time.time()
    params = [p for p in cast(Any, model).parameters()]  # a loaded bridge's parameters
    grads = [p.requires_grad for p in params]
    for p in params:  # the model stays frozen: gradients reach the translators only
        p.requires_grad_(False)
    try:
        with scratch_dir("tuned-lens-") as scratch:
            cache = residuals("train", train_w, scratch.path)
            t_acts = time.time() - t0
            with torch.enable_grad():
                train_kl = _fit(model, lens, cache, spec, progress)
            del cache
            held = {}
            if held_w:
                (scratch.path / "held").mkdir()
                hc = residuals("held_out", held_w, scratch.path / "held")
                held = {"held_out_kl_logit": held_out_kl(model, None, hc), "held_out_kl": held_out_kl(model, lens, hc),
                        "held_out_tokens": hc.n_tokens}
                del hc
    finally:
        for p, g in zip(params, grads):
            p.requires_grad_(g)
    assert lens.record is not None
    lens.record.update({"train": spec.training_fields(), "train_tokens": sum(len(w.ids) - w.n_prefix for w in train_w),
                        "train_windows": len(train_w), "train_seconds": round(time.time() - t0, 2),
                        "activation_seconds": round(t_acts, 2), "train_kl": train_kl, **held,
                        "tokens_sha256": _tokens_sha(list(train_w) + list(held_w))})
    if stored is not None:
        lens.record["store"] = {"path": str(stored.store.path), "manifest_sha256": stored.manifest_sha256,
                                "dtype": stored.store.dtype, "source": stored.store.manifest.get("source")}
    return lens


def _spec_windows(model: HookedModel, spec: TunedLensSpec, field: str) -> tuple[list[Window], list[Window]]:
    train = split_windows(model, spec.corpus, "train", spec.train_tokens, spec.seq_len, f"{field}.corpus",
                          f"{field}.seq_len")
    held = split_windows(model, spec.corpus, "held_out", spec.held_out_tokens, spec.seq_len, f"{field}.corpus",
                         f"{field}.seq_len") \
        if spec.held_out_tokens else []
    return train, held


def _train_key(model: HookedModel, spec: TunedLensSpec, windows: tuple[list[Window], list[Window]],
               store_sha: Optional[str] = None) -> str:
    """sha256 (16 hex digits) of the model's fingerprint, basis, BOS, dtype, the training config,
    the token ids of the training and held-out windows and the store's manifest sha256 (if any)."""
    lens = TunedLens.from_model(model, bias=spec.bias)
    rec = lens.record or {}
    blob = {"format": 1, "fingerprint": rec.get("model_fingerprint"), "basis": residual_basis(model),
            "prepend_bos": rec.get("prepend_bos"), "dtype": rec.get("dtype"), "train": spec.training_fields(),
            "tokens": _tokens_sha(list(windows[0]) + list(windows[1]))}
    if store_sha is not None:
        blob["store"] = store_sha
    return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()[:16]


_FILES = (CONFIG_FILE, PARAMS_FILE, TRACEKIT_FILE)


def _cached(out: Path, model: HookedModel, field: str) -> Optional[TunedLens]:
    if not out.exists():
        return None
    try:
        verify_files_manifest(out, _FILES)
        return TunedLens.load(out, model, field)
    except (ManifestInvalid, OSError, ConfigError) as e:
        warnings.warn(f"the cached tuned lens {out} is invalid ({e}): training it again", stacklevel=3)
        shutil.rmtree(out, ignore_errors=True)
        return None


def load_or_train_tuned_lens(model: HookedModel, spec: Optional[TunedLensSpec] = None, progress: bool = False,
                             field: str = "tuned", cache_dir: Optional[Path] = None) -> TunedLens:
    """The tuned lens a spec names: loaded from ``spec.path``, else from the cache, else trained
    (:func:`train_tuned_lens`) and cached.

    Args:
        model: a hooked model.
        spec: the lens spec (default :class:`TunedLensSpec()`: train on the stdlib corpus).
        progress: show progress bars.
        field: the config field quoted in errors.
        cache_dir: the cache root (default :func:`tuned_lens_cache_dir`).

    Returns:
        The lens, checked against the model and on its device; ``lens.source`` says where it came
        from: ``{"from": "path" | "cache" | "trained", "path": ..., "key": ...}``.

    Raises:
        ConfigError: a lens the model cannot use (:meth:`TunedLens.check_model`), a bad ``path``.
        CorpusError: a corpus too small for the budget.
        StoreError: a ``store`` that cannot be used (:func:`store_tokens`).
    """
    spec = spec or TunedLensSpec()
    if spec.path is not None:
        lens = TunedLens.load(spec.path, model, f"{field}.path")
        lens.source = {"from": "path", "path": str(Path(spec.path).expanduser())}
        return lens
    stored = store_tokens(model, spec, field) if spec.store is not None else None
    windows = (stored.train, stored.held_out) if stored is not None else _spec_windows(model, spec, field)
    root = Path(cache_dir) if cache_dir is not None else tuned_lens_cache_dir()
    key = _train_key(model, spec, windows, stored.manifest_sha256 if stored is not None else None)
    out = root / key
    if spec.cache:
        remove_stale_temps(root)
        hit = _cached(out, model, field)
        if hit is not None:
            hit.source = {"from": "cache", "path": str(out), "key": key}
            return hit
    lens = train_tuned_lens(model, spec, progress, field, windows, stored)
    lens.check_model(model, field)
    if spec.cache:
        root.mkdir(parents=True, exist_ok=True)
        tmp = root / f".{key}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            lens.write_files(tmp)
            write_files_manifest(tmp, {"key": key, "kind": "tuned_lens"})
            if out.exists():
                shutil.rmtree(out, ignore_errors=True)
            tmp.rename(out)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    lens.source = {"from": "trained", "path": str(out) if spec.cache else None, "key": key}
    return lens

"""SAE training data read from an activation store (``sae.train.store``) instead of the model.

SAELens trains on packed windows: documents concatenated across their ends, cut into windows of
exactly ``context_size`` tokens, BOS first (:func:`tracekit.corpus.packed_windows`), every position
cached, the BOS included, and special tokens masked by id (``exclude_special_tokens``). A store
written with ``corpus: {packed: true, seq_len: <context_size>}`` (position ``all``) holds exactly
that, so :func:`store_windows` checks the store against the training block and
:func:`cache_activations_from_store` converts its first windows into SAELens' cached-activations
dataset (one row per window: ``[context_size, d_in]`` float32 named after the hook, plus
``token_ids``), one store slice in memory at a time. What SAELens then trains on is the same
dataset :func:`tracekit.sae.train._cache_activations` builds by running the model, so the SAE is
the same (tested: weights equal, atol 0 in float32 with the same batch size).

Refused, naming ``sae.train.store`` and the fix: a store of another model; one not written from
packed corpus windows, or with another ``seq_len`` than ``context_size``; one without the hook;
one made from another corpus than ``sae.train.corpus`` (the held-out tokens come from the corpus);
windows that differ from the corpus' packed windows (the corpus changed since the store was
written); fewer windows than ``dataset_tokens`` needs.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..activations.store import MANIFEST, ActivationStore, StoreError
from ..core.io import file_sha256
from ..model.info import HookedModel
from .spec import SAETrainSpec

__all__ = ["StoreWindows", "store_windows", "cache_activations_from_store"]


@dataclass
class StoreWindows:
    """The training windows of an SAE, read from an activation store.

    Attributes:
        store: the opened store (checked against the model and the training block).
        n_windows: the windows trained on (the store's first ones).
        manifest_sha256: sha256 of the store's ``manifest.json`` (its identity in the cache key).
    """

    store: ActivationStore
    n_windows: int
    manifest_sha256: str


def store_windows(model: HookedModel, t: SAETrainSpec, windows: list[list[int]], field: str = "sae.train"
                  ) -> StoreWindows:
    """Open ``t.store`` and check it can stand in for running the model over ``windows``.

    Args:
        model: the hooked model the store must have been written with.
        t: the training block (``store`` set).
        windows: the packed corpus windows the SAE trains on (token ids, BOS included), as
            :func:`tracekit.sae.train._training_windows` cuts them from ``t.corpus``.
        field: the config field quoted in errors (``<field>.store``).

    Returns:
        The :class:`StoreWindows`.

    Raises:
        StoreError: see the module docstring (each names ``<field>.store`` and the fix).
    """
    assert t.store is not None
    f = f"{field}.store"
    store = ActivationStore(t.store, field=f)
    store.check_model(model, f)
    src = store.manifest.get("source", {})
    if src.get("kind") != "corpus" or not src.get("packed"):
        raise StoreError(f"{f}: the store at {store.path} holds {src.get('kind')!r} rows"
                         f"{'' if src.get('kind') != 'corpus' else ' in per-document windows'}; an SAE trains on "
                         "packed corpus windows: write one with kind: activations, corpus: {packed: true, seq_len: "
                         f"{t.context_size}}}, hooks: [{t.hook}], or drop {f}")
    if int(src.get("seq_len", -1)) != t.context_size:
        raise StoreError(f"{f}: the store's windows are {src.get('seq_len')} tokens long but {field}.context_size is "
                         f"{t.context_size}; set context_size: {src.get('seq_len')} or write the store with seq_len: "
                         f"{t.context_size}")
    if src.get("source") != t.corpus:
        raise StoreError(f"{f}: the store was written from corpus {src.get('source')!r} but {field}.corpus is "
                         f"{t.corpus!r} (the held-out tokens come from the corpus, right after the training ones); "
                         f"set {field}.corpus to the store's corpus or write the store from {t.corpus!r}")
    store.require_hooks([t.hook], f)
    n, ctx = len(windows), t.context_size
    have = int(store.manifest["n_rows"])
    if have < n:
        raise StoreError(f"{f}: the store holds {have} windows of {ctx} tokens, fewer than the {n} "
                         f"windows {field}.dataset_tokens needs; write a larger store (corpus.max_tokens) or lower "
                         "dataset_tokens")
    tok = store.token_ids[: n * ctx]
    pos = store.positions[: n * ctx]
    want = np.asarray(windows, dtype=np.int64).reshape(-1)
    if tok.shape != want.shape or not np.array_equal(pos, np.tile(np.arange(ctx), n)) or not np.array_equal(tok, want):
        raise StoreError(f"{f}: the store's first {n} windows are not the packed windows of {t.corpus!r} this model "
                         "gives now (the corpus or the tokenizer changed since the store was written); write the "
                         "store again (overwrite: true)")
    return StoreWindows(store, n, file_sha256(store.path / MANIFEST, memo=False))


def cache_activations_from_store(sw: StoreWindows, hook: str, windows: list[list[int]], out: Path,
                                 progress: bool = False) -> None:
    """Write SAELens' cached-activations dataset for ``windows`` from the store (as
    :func:`tracekit.sae.train._cache_activations` writes it from the model), streaming: one store
    slice and one writer batch (<= 64 MiB) in memory at a time.

    Args:
        sw: the checked store (:func:`store_windows`).
        hook: the hook the SAE reads.
        windows: ``[n_windows][context_size]`` token ids (the store's first windows).
        out: the dataset folder (``datasets`` ``save_to_disk`` layout).
        progress: show ``datasets``' progress bars.
    """
    import datasets  # lazy: datasets is heavy
    from datasets import Array2D, Dataset, Features, Sequence, Value

    ctx, d = len(windows[0]), sw.store.width(hook)
    n = sw.n_windows

    def rows():
        buf: list[torch.Tensor] = []
        have, w = 0, 0
        for part in sw.store.iter_batches(hook, max(1, 4096 // ctx) * ctx):
            buf.append(part)
            have += int(part.shape[0])
            if have < ctx:
                continue
            block = torch.cat(buf, 0) if len(buf) > 1 else buf[0]
            k = min(have // ctx, n - w)
            arr = block[: k * ctx].float().numpy().reshape(k, ctx, d)
            for a in arr:
                yield {hook: a, "token_ids": windows[w]}
                w += 1
            if w >= n:
                return
            rest = block[k * ctx:]
            buf, have = ([rest] if rest.shape[0] else []), int(rest.shape[0])

    feats = Features({hook: Array2D(shape=(ctx, d), dtype="float32"),
                      "token_ids": Sequence(Value("int32"), length=ctx)})
    bars = datasets.is_progress_bar_enabled()
    if not progress:
        datasets.disable_progress_bars()
    gen = out.parent / f".{out.name}.gen"  # from_generator's own cache: removed once saved
    try:
        ds = Dataset.from_generator(rows, features=feats, cache_dir=str(gen),
                                    writer_batch_size=max(1, (64 << 20) // (ctx * d * 4)))
        ds.save_to_disk(str(out))
        del ds
    finally:
        shutil.rmtree(gen, ignore_errors=True)
        if bars:
            datasets.enable_progress_bars()

"""Training sparse dictionaries without SAELens: per-layer transcoders (and SAEs) on the activation
store, seeded, resumable, cached by content.

Data: the first ``dataset_tokens`` of the corpus packed into windows of ``context_size`` tokens
(:func:`tracekit.corpus.packed_windows`, as SAELens packs its contexts) are written once into an
activation store (:func:`tracekit.activations.write_store`, every position, both hooks of every
layer at once, chunked under the memory budget, itself resumable), under
``$TRACEKIT_CACHE_DIR/transcoders/stores/<key>``, or read from a store the user gives
(``train.store``: checked against the model, the hooks and the windows). Special tokens (BOS, EOS,
PAD) are left out of training wherever they sit (SAELens' ``exclude_special_tokens``: the BOS
position's activations are outliers). Held-out windows are the corpus tokens right after.

Training (:func:`fit_dictionary`, one layer at a time; SAELens' ``TopKTrainingSAE`` /
``JumpReLUTrainingSAE`` and its trainer, written here for ``d_in != d_out``):

* inputs and targets scaled by one scalar each so their mean squared norm is their width (SAELens'
  ``expected_average_only_in``), folded back into the weights when saved (exactly: the
  pre-activations are unchanged);
* ``topk``: pre-activations scaled by the decoder row norms (SAELens'
  ``rescale_acts_by_decoder_norm``), folded into ``W_enc``/``b_enc``/``W_dec`` when saved; loss =
  squared error summed over the output width, averaged over tokens, plus the AuxK loss (Gao et al.
  2024, App. A.2): the ``d_out // 2`` largest pre-activations of the dead features reconstruct the
  residual error, scaled by ``min(n_dead / k_aux, 1)``;
* ``jumprelu``: ``pre * (pre > threshold)`` with SAELens' straight-through estimators (rectangle
  kernel of width ``bandwidth``) for the threshold, loss = squared error + ``l0_coefficient`` x L0
  (SAELens' ``step`` mode); the threshold is projected to >= 0 after each step;
* ``relu`` (SAELens ``standard``, SAE only): loss = squared error + ``l1_coefficient`` x
  ``sum(acts * ||W_dec||)``;
* optional skip matrix ``W_skip`` (zeros at the start); Adam, gradient norm clipped to 1,
  constant learning rate; the token order is a seeded permutation per pass.

Seeds: layer ``L``'s initialisation and token order depend only on ``(seed, L)``, so the same seed
gives the same weights (``torch.equal``). Resuming: every ``checkpoint_every`` steps the layer's
parameters, Adam's state, the dead-feature counters and the step are saved under
``<cache>/.<key>.partial/``; finished layers are kept there; a rerun after a kill continues from them
and gives the same weights as an uninterrupted run.

Cache: ``$TRACEKIT_CACHE_DIR/transcoders/<key>``, ``key`` = sha256 over the training fields, the
corpus content, the model's fingerprint, basis, BOS and dtype, the store's manifest (when given) and
:data:`TRAIN_VERSION`; written atomically with a files manifest (sizes and sha256, checked on every
hit), in circuit-tracer's transcoder layout.

Sources: SAELens ``sae_lens/saes/topk_sae.py``, ``jumprelu_sae.py``, ``training/sae_trainer.py``;
circuit-tracer ``circuit_tracer/transcoder/single_layer_transcoder.py``; Dunefsky et al. 2024
(transcoders), Ameisen et al. 2025 (circuit tracing).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from ..activations.chunking import check_fits
from ..activations.rows import corpus_rows
from ..activations.store import MANIFEST, ActivationStore, StoreError, model_identity
from ..activations.write import write_store
from ..core.cachedir import cache_path, remove_stale_temps
from ..core.errors import SAEError
from ..core.io import ManifestInvalid, atomic_folder, file_sha256, verify_files_manifest, write_files_manifest
from ..core.locks import acquire, release
from ..core.progress import progress_bar
from ..corpus import CorpusError, iter_documents, packed_windows
from ..inputs import input_files
from ..model.context import check_window
from ..model.info import HookedModel
from ..model.load import model_device, model_fingerprint, model_spec_of
from ..sae.windows import special_token_ids
from .dictionary import DictionarySet
from .fit import TRAIN_VERSION, DictTrainSettings, fit_dictionary, to_dictionary
from .formats import load_transcoder_set, save_transcoder_set
from .spec import TranscoderSpec, TranscoderTrainSpec, transcoder_hooks

__all__ = ["TRAIN_VERSION", "DictTrainSettings", "LoadedTranscoders", "fit_dictionary", "load_transcoders",
           "train_transcoders", "transcoder_cache_dir", "training_windows", "training_bytes", "special_ids"]

#: Files of a cached transcoder set besides the per-layer weights (circuit-tracer's config, and
#: tracekit's training record: the model's fingerprint, the training block, the figures).
SET_CONFIG = "config.yaml"
TRAIN_RECORD = "tracekit_train.json"


@dataclass
class LoadedTranscoders:
    """A transcoder set ready for use.

    Attributes:
        dictionaries: ``layer -> Dictionary`` on the model's device, float32.
        path: the folder it was loaded from (the cache entry when trained).
        cache_hit: it was loaded, not trained, by this call.
        stats: the training record (time, tokens, per-layer training figures); ``{}`` for a ``path``.
        info: identity (hooks, widths, architecture, model, key).
    """

    dictionaries: DictionarySet
    path: str
    cache_hit: bool
    stats: dict = field(default_factory=dict)
    info: dict = field(default_factory=dict)


def transcoder_cache_dir() -> Path:
    """``$TRACEKIT_CACHE_DIR/transcoders`` (default ``~/.cache/tracekit/transcoders``; :func:`tracekit.core.cachedir.cache_path`)."""
    return cache_path("transcoders")


def special_ids(model: HookedModel) -> list[int]:
    """Ids of the tokenizer's special tokens (BOS, EOS, PAD, ...), left out of training
    (:func:`tracekit.sae.windows.special_token_ids`). Raises nothing."""
    return special_token_ids(model)


def training_windows(model: HookedModel, corpus: Any, context_size: int, dataset_tokens: int, eval_tokens: int,
                     field: str) -> tuple[list[list[int]], list[list[int]]]:
    """The packed training windows (the first ``dataset_tokens`` text tokens of the corpus) and the
    held-out windows right after them (``eval_tokens``).

    Raises:
        SAEError: the corpus holds too few tokens (naming ``<field>.dataset_tokens``).
        ConfigError: ``context_size`` longer than the model's context.
    """
    def cut(skip: int, n: int) -> list[list[int]]:
        try:
            return [list(w) for w in packed_windows(model, iter_documents(corpus, field=f"{field}.corpus"),
                                                    context_size, skip, n, f"{field}.context_size")]
        except CorpusError as e:
            raise SAEError(f"{field}.corpus: {e}") from e

    train = cut(0, dataset_tokens)
    held = cut(dataset_tokens, eval_tokens)
    n_tok, n_held = sum(map(len, train)), sum(map(len, held))
    if n_tok < dataset_tokens or n_held < eval_tokens:
        raise SAEError(f"{field}.dataset_tokens: the corpus gives {n_tok} dataset tokens and {n_held} held-out tokens, "
                       f"fewer than dataset_tokens ({dataset_tokens}) and eval_tokens ({eval_tokens}); lower them "
                       "(the stdlib corpus holds ~130k tokens) or give a larger corpus")
    return train, held


# =============================================================================================
# the store


def _store_source(t_corpus: Any, context_size: int, dataset_tokens: int) -> dict:
    src = {"kind": "corpus", "source": t_corpus, "seq_len": int(context_size), "max_tokens": int(dataset_tokens),
           "packed": True, "content_sha256": {k: v["sha256"] for k, v in input_files({"corpus": t_corpus}).items()}}
    names = [t_corpus] if isinstance(t_corpus, str) else list(t_corpus)
    if "stdlib" in names:
        src["python"] = platform.python_version()
    return src


def open_training_store(model: HookedModel, path: Path, hooks: list[str], windows: list[list[int]], corpus: Any,
                        context_size: int, field: str) -> ActivationStore:
    """Open a store and check that it can stand in for running the model over ``windows``.

    Raises:
        StoreError: another model; not packed corpus windows of ``context_size`` from ``corpus``;
            a hook missing; fewer windows, or other token ids, than ``windows`` (each names
            ``<field>.store`` and the fix).
    """
    f = f"{field}.store"
    store = ActivationStore(path, field=f)
    try:
        store.check_model(model, f)
        src = store.manifest.get("source", {})
        if src.get("kind") != "corpus" or not src.get("packed"):
            raise StoreError(f"{f}: the store at {store.path} does not hold packed corpus windows; write one with kind: "
                             f"activations, corpus: {{packed: true, seq_len: {context_size}}}, position: all, or drop {f}")
        if int(src.get("seq_len", -1)) != context_size:
            raise StoreError(f"{f}: the store's windows are {src.get('seq_len')} tokens long but {field}.context_size "
                             f"is {context_size}; set context_size: {src.get('seq_len')} or write the store again")
        if src.get("source") != corpus:
            raise StoreError(f"{f}: the store was written from corpus {src.get('source')!r} but {field}.corpus is "
                             f"{corpus!r}; set {field}.corpus to the store's corpus or write the store again")
        store.require_hooks(hooks, f)
        n = len(windows)
        if int(store.manifest["n_rows"]) < n:
            raise StoreError(f"{f}: the store holds {store.manifest['n_rows']} windows, fewer than the {n} "
                             f"{field}.dataset_tokens needs; write a larger store or lower dataset_tokens")
        tok = store.token_ids[: n * context_size]
        want = np.asarray(windows, dtype=np.int64).reshape(-1)
        if tok.shape != want.shape or not np.array_equal(tok, want):
            raise StoreError(f"{f}: the store's first {n} windows are not the packed windows of {corpus!r} this model "
                             "gives now (the corpus or tokenizer changed); write the store again")
    except BaseException:
        store.close()
        raise
    return store


def _own_store(model: HookedModel, t: TranscoderTrainSpec, hooks: list[str], windows: list[list[int]], root: Path,
               field: str, progress: bool) -> Path:
    """Write (or resume, or find) the store of ``hooks`` over the training windows under ``root/stores``."""
    n_data = t.dataset_tokens or t.training_tokens
    source = _store_source(t.corpus, t.context_size, n_data)
    blob = {"model": model_identity(model), "hooks": hooks, "source": source}  # the write plan's own identity
    key = hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()[:16]
    path = root / "stores" / key  # the registered cache "transcoder_stores" (core.cachedir.CACHES)
    rows = corpus_rows(model, t.corpus, t.context_size, n_data, "all", corpus_field=f"{field}.corpus", packed=True,
                       seq_field=f"{field}.context_size")
    write_store(model, rows, hooks, path, position="all", source=source, dtype="float32", batch_size=8,
                shard_mb=128.0, progress=progress, field=f"{field}.store")
    return path


def _layer_data(store: ActivationStore, hook_in: str, hook_out: str, n_examples: int, keep: np.ndarray,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x [n, d_in], y [n, d_out])`` of the kept examples among the store's first ``n_examples``."""
    def read(hook: str) -> torch.Tensor:
        parts, have = [], 0
        for part in store.iter_batches(hook, 1 << 16):
            parts.append(part[: max(0, n_examples - have)].to(dtype))
            have += int(part.shape[0])
            if have >= n_examples:
                break
        return torch.cat(parts, 0)[torch.from_numpy(keep)]

    return read(hook_in), read(hook_out)


# =============================================================================================
# the cache and the entry point


def _train_key(model: HookedModel, t: TranscoderTrainSpec, layers: list[int], store_sha256: Optional[str]) -> str:
    spec = model_spec_of(model)
    blob = {"train": t.training_fields(), "layers": layers,
            "corpus_sha256": {k: v["sha256"] for k, v in input_files({"corpus": t.corpus}).items()},
            "fingerprint": model_fingerprint(model), "process_weights": bool(spec.process_weights),
            "prepend_bos": bool(spec.prepend_bos), "dtype": spec.dtype, "store": store_sha256,
            "version": TRAIN_VERSION}
    if isinstance(t.corpus, str) and t.corpus == "stdlib" or (isinstance(t.corpus, list) and "stdlib" in t.corpus):
        blob["python"] = platform.python_version()
    return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()[:16]


def _cached(out: Path) -> Optional[dict]:
    if not out.exists():
        return None
    try:
        verify_files_manifest(out, (SET_CONFIG, TRAIN_RECORD))
        return json.loads((out / TRAIN_RECORD).read_text())
    except (ManifestInvalid, OSError, ValueError) as e:
        warnings.warn(f"the cached transcoder set {out} is invalid ({e}): removing it and training it again",
                      stacklevel=3)
        shutil.rmtree(out, ignore_errors=True)
        return None


def _width(model: HookedModel, hook: str) -> int:
    """The width of a hook a transcoder reads or predicts (``d_mlp`` inside the MLP, else ``d_model``)."""
    if hook.endswith(("mlp.hook_pre", "mlp.hook_post", "mlp.hook_pre_linear")):
        return int(getattr(model.cfg, "d_mlp", 0) or model.cfg.d_model)
    return int(model.cfg.d_model)


def training_bytes(n_tokens: int, d_in: int, d_out: int, s: DictTrainSettings) -> int:
    """Estimated bytes one layer's training holds: its data (``x``, ``y`` and their scaled copies),
    the parameters with their gradients and Adam's two moments, and one batch's pre-activations,
    activations and outputs with their gradients (float32, or float64 when training in it)."""
    el = 8 if s.dtype == torch.float64 else 4
    params = (d_in + d_out) * s.d_sae + s.d_sae + d_out + (d_in * d_out if s.skip else 0)
    return el * (2 * n_tokens * (d_in + d_out) + 4 * params + 4 * s.batch * (s.d_sae + d_in + d_out))


def _settings(t: TranscoderTrainSpec, layer: int, d_in: int) -> DictTrainSettings:
    return DictTrainSettings(activation=t.architecture, d_sae=t.d_sae_for(d_in), k=t.k,
                             steps=t.training_tokens // t.train_batch_size_tokens, batch=t.train_batch_size_tokens,
                             lr=t.lr, dead_feature_window=t.dead_feature_window, seed=t.seed, layer=layer, skip=t.skip,
                             l0_coefficient=t.l0_coefficient, bandwidth=t.bandwidth, init_threshold=t.init_threshold,
                             checkpoint_every=t.checkpoint_every,
                             dtype=torch.float64 if t.dtype == "float64" else torch.float32)


def train_transcoders(model: HookedModel, t: TranscoderTrainSpec, *, field: str = "transcoders.train",
                      progress: bool = False, cache_dir: Optional[Path] = None) -> tuple[Path, bool, dict]:
    """Train one transcoder per layer on the activation store (or find the set in the cache).

    Returns:
        ``(folder, cache_hit, stats)``: the set in circuit-tracer's layout; ``stats`` has the times,
        token counts and per-layer training figures.

    Memory: one layer's training data (``2 x n_tokens x d`` float32) plus the parameters with Adam's
    state and one batch's activations are checked against the budget before training
    (``run.memory_budget``); the store is written chunked under it.

    Raises:
        SAEError: a layer or hook the model lacks; too small a corpus.
        StoreError: ``t.store`` made from another model, without a hook, or from other windows.
        MemoryBudgetError: one layer's training does not fit the memory budget.
        ConfigError: ``context_size`` longer than the model's context.
    """
    check_window(model, t.context_size, f"{field}.context_size")
    layers = sorted(t.layers) if t.layers is not None else list(range(int(model.cfg.n_layers)))
    pairs = {L: transcoder_hooks(model, L, t, field) for L in layers}
    hooks = list(dict.fromkeys(h for pr in pairs.values() for h in pr))
    root = Path(cache_dir) if cache_dir is not None else transcoder_cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(root)
    n_data = t.dataset_tokens or t.training_tokens
    wins, held = training_windows(model, t.corpus, t.context_size, n_data, t.eval_tokens, field)
    store_sha = None
    if t.store is not None:  # checked before the cache: a bad store is refused, not hidden by a hit
        with open_training_store(model, Path(t.store).expanduser(), hooks, wins, t.corpus, t.context_size, field) as st:
            store_sha = file_sha256(st.path / MANIFEST, memo=False)
    key = _train_key(model, t, layers, store_sha)
    out = root / key
    stats = _cached(out)
    if stats is not None:
        return out, True, stats
    lock = acquire(root / f".{key}.lock", wait=True)
    try:
        stats = _cached(out)  # another process may have finished it while we waited
        if stats is not None:
            return out, True, stats
        return out, False, _train_locked(model, t, layers, pairs, hooks, wins, held, root, key, field, progress,
                                         store_sha)
    finally:
        release(lock)


def _train_locked(model: HookedModel, t: TranscoderTrainSpec, layers: list[int], pairs: dict, hooks: list[str],
                  wins: list[list[int]], held: list[list[int]], root: Path, key: str, field: str, progress: bool,
                  store_sha: Optional[str]) -> dict:
    n_ex = len(wins) * t.context_size
    tok = np.asarray(wins, dtype=np.int64).reshape(-1)
    keep = ~np.isin(tok, np.asarray(special_ids(model), dtype=np.int64))
    n_keep = int(keep.sum())
    dt = torch.float64 if t.dtype == "float64" else torch.float32
    settings: dict[int, DictTrainSettings] = {}
    for L in layers:  # refused before any forward pass: k above the width, a layer that does not fit the budget
        d_in, d_out = (_width(model, h) for h in pairs[L])
        settings[L] = s = _settings(t, L, d_in)
        if s.activation == "topk" and (s.k or 0) > s.d_sae:
            raise SAEError(f"{field}.k: {s.k} is more than the {s.d_sae} features of layer {L}; lower k or raise d_sae")
        check_fits(model, training_bytes(n_keep, d_in, d_out, s), what="transcoder training", unit="layer",
                   fix=f"lower {field}.dataset_tokens, train_batch_size_tokens or d_sae / expansion_factor")
    t0 = time.time()
    store_path = Path(t.store).expanduser() if t.store is not None else _own_store(model, t, hooks, wins, root, field,
                                                                                   progress)
    t_store = time.time() - t0
    partial = root / f".{key}.partial"
    partial.mkdir(parents=True, exist_ok=True)
    per_layer: dict[str, dict] = {}
    dev = model_device(model)
    total_steps = sum(settings[L].steps for L in layers if not (partial / f"layer_{L}.pt").is_file())
    with open_training_store(model, store_path, hooks, wins, t.corpus, t.context_size, field) as store, \
            progress_bar(total=total_steps, desc="transcoder training", unit="step", enabled=progress) as bar:
        for L in layers:
            h_in, h_out = pairs[L]
            d_in, d_out = store.width(h_in), store.width(h_out)
            s = settings[L]
            done = partial / f"layer_{L}.pt"
            if done.is_file():
                rec = torch.load(done, weights_only=False)
                per_layer[str(L)] = rec["stats"]
                continue
            x, y = _layer_data(store, h_in, h_out, n_ex, keep, dt)
            t1 = time.time()
            bar.set_postfix_str(f"layer {L}")
            params, st = fit_dictionary(x.to(dev), y.to(dev), s, checkpoint=partial / f"ckpt_{L}.pt",
                                        progress=lambda _step, _parts: bar.update(1))
            st["seconds"] = round(time.time() - t1, 2)
            st.update({"hook_in": h_in, "hook_out": h_out, "d_in": d_in, "d_out": d_out, "d_sae": s.d_sae})
            tmp = done.with_name(done.name + f".tmp-{os.getpid()}")
            torch.save({"params": {k: v.cpu() for k, v in params.items()}, "stats": st}, tmp)
            os.replace(tmp, done)
            (partial / f"ckpt_{L}.pt").unlink(missing_ok=True)
            per_layer[str(L)] = st
            del x, y
    dicts = {}
    spec = model_spec_of(model)
    for L in layers:
        rec = torch.load(partial / f"layer_{L}.pt", weights_only=False)
        s = _settings(t, L, int(rec["params"]["W_enc"].shape[0]))
        dicts[L] = to_dictionary(rec["params"], s, *pairs[L])
    meta = {"tracekit_fingerprint": model_fingerprint(model), "model": spec.name, "key": key,
            "process_weights": bool(spec.process_weights), "prepend_bos": bool(spec.prepend_bos),
            "train": t.model_dump(mode="json")}
    stats = {"train_seconds": round(time.time() - t0, 2), "store_seconds": round(t_store, 2), "key": key,
             "train_tokens": t.training_tokens, "dataset_tokens": len(wins) * t.context_size,
             "train_examples": n_keep, "held_out_tokens": sum(map(len, held)), "layers": layers,
             "per_layer": per_layer, "activations_from": "store" if t.store is not None else "own store",
             "store": str(store_path) if t.store is not None else None, "store_manifest_sha256": store_sha}
    stats["metadata"] = meta
    with atomic_folder(root / key) as tmp:  # readers see the old set or the whole new one
        save_transcoder_set(DictionarySet(dicts, meta), tmp, model_name=spec.name)
        (tmp / TRAIN_RECORD).write_text(json.dumps(stats))
        write_files_manifest(tmp, {"key": key, "kind": "transcoders"})
    shutil.rmtree(partial, ignore_errors=True)
    return stats


def _check_set(model: HookedModel, dset: DictionarySet, field: str) -> None:
    """Refuse a set whose hooks the model lacks or whose widths differ from the model's."""
    from ..hooks import check_hooks  # lazy: only when a set is checked

    for L in dset.layers:
        d = dset[L]
        try:
            check_hooks(model, [d.hook_in, d.hook_out], field)
        except Exception as e:  # noqa: BLE001
            raise SAEError(f"{field}: layer {L}'s transcoder reads {d.hook_in!r} -> {d.hook_out!r}: {e}") from e
        widths = {int(model.cfg.d_model)} | ({int(model.cfg.d_mlp)} if getattr(model.cfg, "d_mlp", None) else set())
        if d.d_in not in widths or d.d_out not in widths:
            raise SAEError(f"{field}: layer {L}'s transcoder is {d.d_in} -> {d.d_out} wide, not this model's widths "
                           f"{sorted(widths)}; it was made for another model")
    fp = dset.metadata.get("tracekit_fingerprint")
    if fp is not None and fp != model_fingerprint(model):
        raise SAEError(f"{field}: the transcoders were trained by tracekit on another model (fingerprint {fp}); train "
                       "them on this model (transcoders.train) or load the model they were trained on")


def load_transcoders(spec: TranscoderSpec, model: HookedModel, *, field: str = "transcoders", progress: bool = False,
                     cache_dir: Optional[Path] = None) -> LoadedTranscoders:
    """The transcoders a spec names: loaded from ``path``, or trained (first run) / loaded from the
    cache (later runs), on the model's device in float32.

    Args:
        spec: the ``transcoders:`` block.
        model: the hooked model they belong to.
        field: the config field quoted in errors.
        progress: progress bars while writing the store.
        cache_dir: the cache root (default :func:`transcoder_cache_dir`).

    Returns:
        :class:`LoadedTranscoders`.

    Raises:
        SAEError: a set for another model (hooks, widths, fingerprint), an unreadable folder, and
            what :func:`train_transcoders` raises.
    """
    if spec.path is not None:
        path = Path(spec.path).expanduser()
        hit = True
        rec = path / TRAIN_RECORD if path.is_dir() else path.parent / TRAIN_RECORD
        try:
            stats = json.loads(rec.read_text()) if rec.is_file() else {}
        except (OSError, ValueError):
            stats = {}
    else:
        assert spec.train is not None
        path, hit, stats = train_transcoders(model, spec.train, field=f"{field}.train", progress=progress,
                                             cache_dir=cache_dir)
    try:
        dset = load_transcoder_set(path)
    except SAEError as e:
        raise SAEError(f"{field}.path: {e}") from e
    dset.metadata.update(stats.get("metadata") or {})
    _check_set(model, dset, field)
    dset.to(device=model_device(model), dtype=torch.float32)
    first = dset[dset.layers[0]]
    info = {"hook_in": first.hook_in, "hook_out": first.hook_out, "d_in": first.d_in, "d_sae": first.d_sae,
            "d_out": first.d_out, "activation": first.activation, "k": first.k, "layers": dset.layers,
            "skip": first.W_skip is not None, "key": dset.metadata.get("key"), "model": dset.metadata.get("model")}
    return LoadedTranscoders(dset, str(path), hit, stats, info)

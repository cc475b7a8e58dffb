"""Training an SAE with SAELens on tracekit's model, and the cache of trained SAEs.

SAELens' ``LanguageModelSAETrainingRunner`` trains on activations cached once from corpus token
windows (:func:`_cache_activations`). Where SAELens cannot be imported (the TransformerLens 4
environment), tracekit's own trainer (:func:`tracekit.dictionaries.train.fit_dictionary`: the same
TopK + AuxK / ReLU + L1 losses, SAELens' conventions) trains on the same windows' activations and
writes the same SAELens directory (:func:`tracekit.dictionaries.formats.save_saelens_dir`); its
cache key names that trainer instead of SAELens' version. The trained SAE is saved in SAELens' format under
``$TRACEKIT_CACHE_DIR/saes/<hash>`` with a files manifest (sizes and sha256), keyed by the training
block, the corpus content, the model's fingerprint and basis (:func:`_train_key`). SAELens'
interrupt handling is replaced by tracekit's (:mod:`tracekit.core.signals`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import shutil
import time
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..activations.chunking import check_fits, forward_chunk_size, forward_chunks, forward_row_bytes, row_slice
from ..compat import has_sae_lens, require_sae_lens
from ..core.cachedir import cache_path, clear_dir, dir_entries, remove_stale_temps, sizes_match
from ..core.errors import SAEError
from ..core.io import ManifestInvalid, verify_files_manifest, write_files_manifest
from ..core.progress import progress_bar
from ..core.signals import preserved_signal_handlers
from ..dictionaries.fit import TRAIN_VERSION, DictTrainSettings, fit_dictionary, to_dictionary
from ..dictionaries.formats import save_saelens_dir
from ..fastpath import residual_stream
from ..hooks import enabled_hooks, state_guard
from ..inputs import input_files
from ..model.context import check_window
from ..model.info import HookedModel
from ..model.load import model_device, model_fingerprint, model_parameters, model_spec_of
from ..model.spec import ModelSpec
from ..tokens import pad_ids
from .spec import SAETrainSpec, hook_width
from .store import StoreWindows, cache_activations_from_store, store_windows
from .windows import _corpus_windows, special_token_ids

__all__ = ["SAE_FILES", "clear_sae_cache", "sae_cache_dir", "sae_cache_entries", "train_sae"]


#: The files of a cached SAE (SAELens' format plus tracekit's training record), checked against the
#: entry's manifest (sizes and sha256) on every cache hit.
SAE_FILES = ("cfg.json", "sae_weights.safetensors", "tracekit_train.json")


def sae_cache_entries() -> list[dict]:
    """Every cached SAE: ``key, path, size_bytes, hook, created, valid`` (sizes only; a hit checks
    the sha256 too); leftover temporary folders of killed trainings are listed as invalid."""
    def describe(d: Path, man: dict) -> dict:
        return {"created": man.get("created"), "hook": json.loads((d / "cfg.json").read_text()).get("hook_name"),
                "valid": sizes_match(d, man) and set(SAE_FILES) <= set(man.get("files", {}))}

    return dir_entries(sae_cache_dir(), describe)


def clear_sae_cache() -> tuple[int, int]:
    """Remove every cached SAE and leftover temporary folder: ``(entries removed, bytes freed)``."""
    return clear_dir(sae_cache_dir())


def sae_cache_dir() -> Path:
    """``$TRACEKIT_CACHE_DIR/saes`` (default ``~/.cache/tracekit/saes``; :func:`tracekit.core.cachedir.cache_path`)."""
    return cache_path("saes")


def _train_key(model: HookedModel, t: SAETrainSpec, store_sha256: str | None = None) -> str:
    """The cache key of a training: sha256 (16 hex digits) of the training block (with a store: the
    sha256 of its manifest instead of its path), the corpus files' sha256, the model's fingerprint,
    basis, BOS and dtype, and SAELens' version."""
    spec = model_spec_of(model)
    corpus = {k: v["sha256"] for k, v in input_files({"corpus": t.corpus}).items()}  # what the files hold
    train = t.model_dump(mode="json", exclude={"store"})
    if store_sha256 is not None:  # the store's content, not its path
        train["store_manifest_sha256"] = store_sha256
    blob = {"train": train, "corpus_sha256": corpus, "fingerprint": model_fingerprint(model),
            "process_weights": bool(spec.process_weights), "prepend_bos": bool(spec.prepend_bos),
            "dtype": spec.dtype}
    if has_sae_lens():
        import sae_lens  # lazy: sae_lens is heavy

        blob["sae_lens"] = getattr(sae_lens, "__version__", "?")
    else:  # tracekit's own trainer (no SAELens here): another optimisation path, another key
        blob["sae_lens"] = None
        blob["trainer"] = f"tracekit-{TRAIN_VERSION}"
    return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()[:16]


@torch.no_grad()
def _cache_activations(model: HookedModel, hook: str, windows: list[list[int]], out: Path, batch_size: int = 16,
                       progress: bool = False) -> None:
    """Run the model once over ``windows`` and save the activations at ``hook`` (and the token ids)
    as a ``datasets`` dataset in SAELens' cached-activations format (one row per window: a
    ``[context_size, d_in]`` array named after the hook, plus ``token_ids``), so SAELens' trainer
    can take several passes over them without re-running the model. The forward pass stops at the
    hook. Windows must all have the same length and no padding.

    Memory: each batch of ``batch_size`` windows runs in chunks of windows the memory budget allows
    (:mod:`tracekit.activations.chunking`; the activations do not depend on it); the cached
    activations themselves (``[n_windows, context_size, d_in]`` float32: SAELens' dataset) are held
    whole, as SAELens' ``Dataset.from_dict`` needs them.

    Raises:
        MemoryBudgetError: one window's forward pass does not fit the budget."""
    import datasets  # lazy: datasets is heavy
    from datasets import Array2D, Dataset, Features, Sequence, Value

    chunks: list[np.ndarray] = []
    it = range(0, len(windows), batch_size)
    it = progress_bar(it, desc=f"activations at {hook}", unit="batch", enabled=progress)
    width = hook_width(model, hook) or int(model.cfg.d_model)
    for i in it:
        batch = pad_ids(model, windows[i:i + batch_size])
        T = int(batch.tokens.shape[1])
        per_row = forward_row_bytes(model, T, logits=False) + 3 * 4 * T * width  # + the read, its float copy, numpy
        chunk = forward_chunk_size(model, batch.size, per_row, what="SAE training activations",
                                   fix="lower sae.train.context_size")
        parts: dict[int, np.ndarray] = {}

        def run(sl: slice, batch=batch, parts=parts) -> None:
            act = residual_stream(model, row_slice(batch, sl), [hook])[0]
            parts[sl.start] = act.reshape(act.shape[0], act.shape[1], -1).float().cpu().numpy()

        forward_chunks(run, batch.size, chunk, "SAE training activations")
        chunks += [parts[k] for k in sorted(parts)]
    acts = np.concatenate(chunks)
    del chunks
    feats = Features({hook: Array2D(shape=tuple(acts.shape[1:]), dtype="float32"),
                      "token_ids": Sequence(Value("int32"), length=acts.shape[1])})
    ds = Dataset.from_dict({hook: acts, "token_ids": np.asarray(windows, dtype=np.int32)}, features=feats)
    del acts
    bars = datasets.is_progress_bar_enabled()
    if not progress:
        datasets.disable_progress_bars()
    try:
        ds.save_to_disk(str(out))
    finally:
        if bars:
            datasets.enable_progress_bars()


def training_bytes(t: SAETrainSpec, width: int, d_sae: int) -> int:
    """Estimated bytes SAELens' training holds, whatever the budget (the optimiser's batches are the
    user's, so they are never split): the SAE's parameters with their gradients and Adam's two
    moments (``4 x (2 d_in d_sae + d_sae + d_in)``), one training batch's activations and their
    gradients (``4 x train_batch_size_tokens x (d_sae + d_in)``: input, pre-activations,
    activations, reconstruction) and SAELens' shuffled activation buffer (``n_batches_in_buffer x 8
    windows x context_size x d_in``, twice: it is refilled while mixing), float32."""
    n_buffer = max(4, math.ceil(2 * t.train_batch_size_tokens / t.context_size))
    params = 2 * width * d_sae + d_sae + width
    batch = t.train_batch_size_tokens * (d_sae + width)
    buffer = 2 * n_buffer * 8 * t.context_size * width
    return 4 * (4 * params + 4 * batch + buffer)


def _sae_lens_interrupts() -> tuple[type[BaseException], ...]:
    """SAELens' own interrupt exception (mapped to ``KeyboardInterrupt``), when this SAELens has one."""
    try:
        from sae_lens.training._interruption import InterruptedException  # lazy: sae_lens is heavy
    except ImportError:  # pragma: no cover - another SAELens layout: nothing to map
        return ()
    return (InterruptedException,)


def _runner_class(base):
    """SAELens' runner without its signal handling: its ``run_trainer_with_interruption_handling``
    installs SIGINT/SIGTERM handlers that raise its own exception and are never restored; tracekit's
    own handlers (Ctrl-C -> KeyboardInterrupt, SIGTERM -> an interrupted run) stay in charge."""

    class _Runner(base):
        def run_trainer_with_interruption_handling(self, trainer):
            return trainer.fit()

    return _Runner


def _cached_stats(out: Path) -> dict | None:
    """The training record of a valid cache entry ``out`` (manifest sizes and sha256 checked), or None
    when there is none; an invalid entry is removed with a warning (it is then trained again)."""
    if not out.exists():
        return None
    try:
        verify_files_manifest(out, SAE_FILES)
        return json.loads((out / "tracekit_train.json").read_text())
    except (ManifestInvalid, OSError, ValueError) as e:
        warnings.warn(f"the cached SAE {out} is invalid ({e}): removing it and training it again", stacklevel=3)
        shutil.rmtree(out, ignore_errors=True)
        return None


def _training_windows(model: HookedModel, t: SAETrainSpec, field: str) -> tuple[list[list[int]], int, int]:
    """The training windows (the first ``dataset_tokens`` of the corpus) and the counts of dataset
    and held-out tokens: ``(windows, n_dataset_tokens, n_held_out_tokens)``.

    Raises:
        SAEError: the corpus holds fewer tokens than ``dataset_tokens`` + ``eval_tokens``.
    """
    n_data = t.dataset_tokens or t.training_tokens
    wins = _corpus_windows(model, t.corpus, t.context_size, 0, n_data, f"{field}.corpus", f"{field}.context_size")
    n_tok = sum(len(w) for w in wins)
    held = _corpus_windows(model, t.corpus, t.context_size, n_data, t.eval_tokens, f"{field}.corpus",
                           f"{field}.context_size")
    n_held = sum(len(w) for w in held)
    if n_tok < n_data or n_held < t.eval_tokens:
        raise SAEError(f"{field}: the corpus gives {n_tok} dataset tokens and {n_held} held-out tokens, fewer than "
                       f"dataset_tokens ({n_data}) and eval_tokens ({t.eval_tokens}); lower them (the stdlib corpus "
                       "holds ~130k tokens; training_tokens above dataset_tokens repeats the dataset) or give a "
                       "larger corpus")
    return wins, n_tok, n_held


def _runner_config(model: HookedModel, t: SAETrainSpec, spec: ModelSpec, width: int, d_sae: int, tmp: Path,
                   acts_dir: Path, progress: bool, field: str) -> Any:
    """SAELens' ``LanguageModelSAERunnerConfig``: the SAE architecture, training on the activations
    cached in ``acts_dir``, output to ``tmp``, no checkpoints and no wandb.

    Raises:
        SAEError: a TopK ``k`` above ``d_sae``.
    """
    from sae_lens import (  # lazy: sae_lens is heavy
        LanguageModelSAERunnerConfig,
        LoggingConfig,
        StandardTrainingSAEConfig,
        TopKTrainingSAEConfig,
    )

    dev = str(model_device(model))
    if t.architecture == "topk":
        t.check_width(width, field)
        sae_cfg = TopKTrainingSAEConfig(d_in=width, d_sae=d_sae, k=t.k, device=dev)
    else:
        sae_cfg = StandardTrainingSAEConfig(d_in=width, d_sae=d_sae, l1_coefficient=t.l1_coefficient, device=dev)
    n_buffer = max(4, math.ceil(2 * t.train_batch_size_tokens / t.context_size))
    return LanguageModelSAERunnerConfig(
        sae=sae_cfg, model_name=spec.name, hook_name=t.hook, dataset_path="tracekit-corpus",
        is_dataset_tokenized=True, streaming=False, context_size=t.context_size, training_tokens=t.training_tokens,
        use_cached_activations=True, cached_activations_path=str(acts_dir),
        exclude_special_tokens=special_token_ids(model),
        train_batch_size_tokens=t.train_batch_size_tokens, store_batch_size_prompts=8, n_batches_in_buffer=n_buffer,
        prepend_bos=False, device=dev, lr=t.lr, seed=t.seed, logger=LoggingConfig(log_to_wandb=False),
        dead_feature_window=t.dead_feature_window,
        output_path=str(tmp), checkpoint_path=None, n_checkpoints=0, verbose=bool(progress),
        n_batches_for_norm_estimate=4, n_eval_batches=1, dtype="float32",
        model_from_pretrained_kwargs={"center_writing_weights": bool(spec.process_weights)})


@contextlib.contextmanager
def _quiet_sae_lens() -> Iterator[None]:
    """SAELens' logger at ERROR for the block, its level restored after."""
    sl_logger = logging.getLogger("sae_lens")
    level = sl_logger.level
    sl_logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        sl_logger.setLevel(level)


def _fit(model: HookedModel, t: SAETrainSpec, cfg: Any, ds: Any, wins: list[list[int]], acts_dir: Path,
         progress: bool, sw: StoreWindows | None = None) -> float:
    """Cache the activations at ``t.hook`` (from the store ``sw`` when given, else by running the
    model), then run SAELens' trainer on them, with the model's state, gated hooks, warning filters
    and signal handlers restored after and its parameters left frozen.
    Returns the time (``time.time()``) at which the activations were cached."""
    from sae_lens import LanguageModelSAETrainingRunner  # lazy: sae_lens is heavy

    with state_guard(model), enabled_hooks(model, [t.hook]), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if sw is not None:
            cache_activations_from_store(sw, t.hook, wins, acts_dir, progress=progress)
        else:
            _cache_activations(model, t.hook, wins, acts_dir, progress=progress)
        acts_done = time.time()
        dev = model_device(model)
        # SAELens' runner never seeds torch (its ``seed`` is not used for the SAE's initialisation or
        # the buffer shuffles), so the SAE depended on the global RNG state: seeded here with
        # ``t.seed``, the caller's RNG state restored after.
        with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else [],
                                   device_type=dev.type if dev.type == "cuda" else "cuda"):
            torch.manual_seed(t.seed)
            runner = _runner_class(LanguageModelSAETrainingRunner)(cfg, override_dataset=ds, override_model=model)
            with preserved_signal_handlers(_sae_lens_interrupts()):
                runner.run()
        # sae-lens' runner may leave the trainer's grad settings on: the model stays frozen.
        for p in model_parameters(model):
            p.requires_grad_(False)
    return acts_done


def _record_provenance(tmp: Path, model: HookedModel, spec: ModelSpec) -> None:
    """Add tracekit's provenance (model fingerprint, basis, BOS) to the ``metadata`` of ``tmp/cfg.json``."""
    cj = json.loads((tmp / "cfg.json").read_text())
    cj.setdefault("metadata", {})
    cj["metadata"].update({"tracekit_fingerprint": model_fingerprint(model),
                           "tracekit_process_weights": bool(spec.process_weights),
                           "tracekit_model": spec.name, "prepend_bos": bool(spec.prepend_bos),
                           "model_from_pretrained_kwargs": {"center_writing_weights": bool(spec.process_weights)}})
    (tmp / "cfg.json").write_text(json.dumps(cj))


def _publish(tmp: Path, out: Path, key: str, stats: dict) -> None:
    """Write the training record and the files manifest into ``tmp``, then rename it to ``out``."""
    (tmp / "tracekit_train.json").write_text(json.dumps(stats))
    write_files_manifest(tmp, {"key": key, "kind": "sae"})  # sizes + sha256, checked on every hit
    if out.exists():
        shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def train_sae(model: HookedModel, t: SAETrainSpec, progress: bool = False, field: str = "sae.train",
              cache_dir: Path | None = None) -> tuple[Path, bool, dict]:
    """Train an SAE with SAELens' ``LanguageModelSAETrainingRunner`` (``override_model``: this
    bridge; ``override_dataset``: an in-memory ``datasets.Dataset`` of corpus token windows), save
    it in SAELens' format and cache it by the hash of its training config and model.

    Returns:
        ``(directory, cache_hit, stats)``; ``stats`` has the training time and token counts.

    With ``t.store``, the activations are read from that activation store
    (:mod:`tracekit.sae.store`) instead of running the model; the SAE is the same.

    Memory budget (``run.memory_budget``): only the forward passes that produce the activations are
    chunked (rows of each batch of windows); SAELens' batches are the user's
    (``train_batch_size_tokens``), so for a given seed the trained SAE is the same whatever the
    budget. A budget below one optimiser step is refused before anything runs.

    Raises:
        SAEError: the hook cannot be read, the corpus is too small, or SAELens is not installed
            (:func:`tracekit.compat.require_sae_lens`).
        MemoryBudgetError: one optimiser step (:func:`training_bytes`) or one window's forward pass
            does not fit the memory budget (``run.memory_budget``), before the model runs.
        ConfigError: ``context_size`` longer than the model's context (before anything runs).
        StoreError: ``t.store`` cannot stand in for the model (another model, not packed corpus
            windows of ``context_size``, another corpus, no such hook, too few windows).
    """
    check_window(model, t.context_size, f"{field}.context_size")
    own = not has_sae_lens()
    if not own:
        require_sae_lens(field)

    root = Path(cache_dir) if cache_dir is not None else sae_cache_dir()
    remove_stale_temps(root)  # what killed trainings left behind
    sw: StoreWindows | None = None
    wins: list[list[int]] | None = None
    n_tok = n_held = 0
    if t.store is not None:  # checked before the cache: a bad store is refused, not hidden by a hit
        wins, n_tok, n_held = _training_windows(model, t, field)
        sw = store_windows(model, t, wins, field)
    key = _train_key(model, t, sw.manifest_sha256 if sw is not None else None)
    out = root / key
    stats = _cached_stats(out)
    if stats is not None:
        return out, True, stats
    width = hook_width(model, t.hook)
    if width is None:
        raise SAEError(f"{field}.hook: cannot tell the width of hook {t.hook!r}; train on a residual, attn_out, "
                       "mlp_out or mlp.hook_post hook")
    d_sae = t.d_sae or width * t.expansion_factor
    check_fits(model, training_bytes(t, width, d_sae), what="SAE training", unit="optimiser step",
               fix=f"lower {field}.train_batch_size_tokens or {field}.d_sae / expansion_factor (they change the SAE)")
    if wins is None:
        wins, n_tok, n_held = _training_windows(model, t, field)
    spec = model_spec_of(model)
    tmp = root / f".{key}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    if own:
        return out, False, _train_own(model, t, spec, width, d_sae, wins, n_tok, n_held, sw, tmp, out, key, progress)
    from datasets import Dataset  # lazy: datasets is heavy

    acts_dir = tmp / "activations"
    cfg = _runner_config(model, t, spec, width, d_sae, tmp, acts_dir, progress, field)
    ds = Dataset.from_dict({"input_ids": wins})
    t0 = time.time()
    try:
        with _quiet_sae_lens():
            t_acts = _fit(model, t, cfg, ds, wins, acts_dir, progress, sw) - t0
            _record_provenance(tmp, model, spec)
            shutil.rmtree(acts_dir, ignore_errors=True)
            stats = {"train_seconds": round(time.time() - t0, 2), "activation_seconds": round(t_acts, 2),
                     "train_tokens": t.training_tokens,
                     "dataset_tokens": n_tok, "train_windows": len(wins), "held_out_tokens": n_held,
                     "d_sae": d_sae, "d_in": width, "key": key, "train": t.model_dump(mode="json"),
                     "activations_from": "store" if sw is not None else "model"}
            if sw is not None:
                stats["store_manifest_sha256"] = sw.manifest_sha256
            _publish(tmp, out, key, stats)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out, False, stats


@torch.no_grad()
def _activations(model: HookedModel, hook: str, windows: list[list[int]], width: int, sw: StoreWindows | None,
                 batch_size: int = 16) -> torch.Tensor:
    """``[n_windows * context_size, width]`` float32 activations at ``hook`` over ``windows`` (from the
    store ``sw`` when given, else by running the model in chunks under the memory budget)."""
    n = len(windows) * len(windows[0])
    if sw is not None:
        chunks: list[torch.Tensor] = []
        have = 0
        for part in sw.store.iter_batches(hook, 1 << 16):
            chunks.append(part[: n - have].float())
            have += int(chunks[-1].shape[0])
            if have >= n:
                break
        return torch.cat(chunks, 0)
    out = torch.empty(n, width, dtype=torch.float32)
    at = 0
    with state_guard(model), enabled_hooks(model, [hook]):
        for i in range(0, len(windows), batch_size):
            batch = pad_ids(model, windows[i:i + batch_size])
            T = int(batch.tokens.shape[1])
            per_row = forward_row_bytes(model, T, logits=False) + 2 * 4 * T * width
            chunk = forward_chunk_size(model, batch.size, per_row, what="SAE training activations",
                                       fix="lower sae.train.context_size")
            parts: dict[int, torch.Tensor] = {}

            def run(sl: slice, batch=batch, parts=parts) -> None:
                act = residual_stream(model, row_slice(batch, sl), [hook])[0]
                parts[sl.start] = act.reshape(-1, width).float().cpu()

            forward_chunks(run, batch.size, chunk, "SAE training activations")
            for k in sorted(parts):
                out[at:at + parts[k].shape[0]] = parts[k]
                at += parts[k].shape[0]
    return out


def _train_own(model: HookedModel, t: SAETrainSpec, spec: ModelSpec, width: int, d_sae: int, wins: list[list[int]],
               n_tok: int, n_held: int, sw: StoreWindows | None, tmp: Path, out: Path, key: str,
               progress: bool) -> dict:
    """Train the SAE with tracekit's trainer (no SAELens here) and publish it in SAELens' format:
    every window position trained on except special tokens (SAELens' ``exclude_special_tokens``);
    ``b_dec`` subtracted from the input (SAELens' ``apply_b_dec_to_input``); TopK with the AuxK loss
    or ReLU with the decoder-norm-weighted L1 penalty; seeded by ``t.seed``."""
    t0 = time.time()
    acts = _activations(model, t.hook, wins, width, sw)
    tok = torch.tensor(np.asarray(wins, dtype=np.int64).reshape(-1))
    keep = ~torch.isin(tok, torch.tensor(special_token_ids(model), dtype=torch.long))
    x = acts[keep]
    del acts
    t_acts = time.time() - t0
    s = DictTrainSettings(activation="topk" if t.architecture == "topk" else "relu", d_sae=d_sae, k=t.k,
                          steps=t.training_tokens // t.train_batch_size_tokens, batch=t.train_batch_size_tokens,
                          lr=t.lr, dead_feature_window=t.dead_feature_window, seed=t.seed,
                          l1_coefficient=t.l1_coefficient, apply_b_dec_to_input=True)
    with progress_bar(total=s.steps, desc="SAE training", unit="step", enabled=progress) as bar:
        params, fit = fit_dictionary(x.to(model_device(model)), x.to(model_device(model)), s,
                                     progress=lambda _step, _parts: bar.update(1))
    d = to_dictionary({k: v.cpu() for k, v in params.items()}, s, t.hook, t.hook)
    try:
        save_saelens_dir(d, tmp, model_name=spec.name)
        _record_provenance(tmp, model, spec)
        stats = {"train_seconds": round(time.time() - t0, 2), "activation_seconds": round(t_acts, 2),
                 "train_tokens": t.training_tokens, "dataset_tokens": n_tok, "train_windows": len(wins),
                 "held_out_tokens": n_held, "d_sae": d_sae, "d_in": width, "key": key,
                 "train": t.model_dump(mode="json"), "activations_from": "store" if sw is not None else "model",
                 "trainer": f"tracekit-{TRAIN_VERSION}", "dead_fraction": fit["dead_fraction"]}
        if sw is not None:
            stats["store_manifest_sha256"] = sw.manifest_sha256
        _publish(tmp, out, key, stats)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return stats

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
import uuid
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch
import torch.nn.functional as F

from ..activations.chunking import check_fits
from ..activations.rows import corpus_rows
from ..activations.store import MANIFEST, ActivationStore, StoreError
from ..activations.write import write_store
from ..core.cachedir import remove_stale_temps
from ..core.errors import SAEError
from ..core.io import ManifestInvalid, file_sha256, verify_files_manifest, write_files_manifest
from ..core.locks import acquire, release
from ..corpus import CorpusError, iter_documents, packed_windows
from ..inputs import input_files
from ..model.context import check_window
from ..model.info import HookedModel
from ..model.load import model_device, model_fingerprint, model_spec_of
from .dictionary import Dictionary, DictionarySet
from .spec import TranscoderSpec, TranscoderTrainSpec, transcoder_hooks

__all__ = ["TRAIN_VERSION", "DictTrainSettings", "LoadedTranscoders", "fit_dictionary", "load_transcoders",
           "train_transcoders", "transcoder_cache_dir", "training_windows", "special_ids"]

#: Version of this trainer's maths, part of every cache key (bump when the weights would change).
TRAIN_VERSION = 1

#: Files of a cached transcoder set besides the per-layer weights.
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


@dataclass
class DictTrainSettings:
    """How :func:`fit_dictionary` trains one dictionary (the training block's fields, resolved).

    Attributes:
        activation: ``topk`` | ``jumprelu`` | ``relu``. d_sae / k: widths. skip: a skip matrix.
        steps: optimiser steps. batch: tokens per step. lr: Adam's learning rate.
        dead_feature_window: steps without firing after which a feature is dead (AuxK).
        l0_coefficient / bandwidth / init_threshold: JumpReLU. l1_coefficient: ReLU (SAE).
        aux_coefficient: AuxK weight (SAELens default 1). seed: ``(seed, layer)`` seeds everything.
        checkpoint_every: steps between checkpoints. apply_b_dec_to_input: SAE convention.
    """

    activation: str
    d_sae: int
    k: Optional[int]
    steps: int
    batch: int
    lr: float
    dead_feature_window: int
    seed: int
    layer: int = 0
    skip: bool = False
    l0_coefficient: float = 1e-3
    bandwidth: float = 0.05
    init_threshold: float = 0.01
    l1_coefficient: float = 5.0
    aux_coefficient: float = 1.0
    checkpoint_every: int = 100
    apply_b_dec_to_input: bool = False
    dtype: torch.dtype = torch.float32


def transcoder_cache_dir() -> Path:
    """``$TRACEKIT_CACHE_DIR/transcoders`` (default ``~/.cache/tracekit/transcoders``)."""
    root = os.environ.get("TRACEKIT_CACHE_DIR")
    base = Path(root).expanduser() if root else Path("~/.cache/tracekit").expanduser()
    return base / "transcoders"


def special_ids(model: HookedModel) -> list[int]:
    """Ids of the tokenizer's special tokens (BOS, EOS, PAD, ...), left out of training."""
    tok = model.tokenizer
    ids = {int(i) for i in (getattr(tok, "all_special_ids", None) or [])}
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        v = getattr(tok, name, None)
        if v is not None:
            ids.add(int(v))
    return sorted(ids)


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
    blob = {"model": model_fingerprint(model), "hooks": hooks, "source": source}
    key = hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()[:16]
    path = root / "stores" / key
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
# the trainer


class _StepFn(torch.autograd.Function):
    """SAELens' ``Step``: ``1[x > threshold]`` with the rectangle-kernel estimator for the threshold."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, threshold: torch.Tensor, bandwidth: float) -> torch.Tensor:
        ctx.save_for_backward(x, threshold)
        ctx.bandwidth = bandwidth
        return (x > threshold).to(x)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[None, torch.Tensor, None]:
        x, threshold = ctx.saved_tensors
        bw = ctx.bandwidth
        ste = (1.0 / bw) * (((x - threshold) / bw).abs() < 0.5).to(x) * grad_output
        return None, (-ste).sum(0), None


class _JumpReLUFn(torch.autograd.Function):
    """SAELens' ``JumpReLU``: ``x * 1[x > threshold]``; threshold gradient by the rectangle kernel."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, threshold: torch.Tensor, bandwidth: float) -> torch.Tensor:
        ctx.save_for_backward(x, threshold)
        ctx.bandwidth = bandwidth
        return x * (x > threshold).to(x)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        x, threshold = ctx.saved_tensors
        bw = ctx.bandwidth
        ste = (threshold / bw) * (((x - threshold) / bw).abs() < 0.5).to(x) * grad_output
        return (x > threshold).to(x) * grad_output, (-ste).sum(0), None


def _scale(v: torch.Tensor) -> float:
    """The scalar that makes ``E ||v||^2 = width`` (SAELens' ``expected_average_only_in``)."""
    ms = float(v.double().pow(2).sum(-1).mean())
    return float(np.sqrt(v.shape[-1] / ms)) if ms > 0 else 1.0


def _params(d_in: int, d_out: int, s: DictTrainSettings, y_mean: torch.Tensor) -> dict[str, torch.Tensor]:
    """Seeded initial parameters: decoder rows random unit directions; encoder columns random unit
    directions (the decoder's transpose for an SAE, as SAELens); ``b_dec`` = the target mean."""
    g = torch.Generator().manual_seed(int(s.seed) * 1_000_003 + int(s.layer))
    W_dec = torch.randn(s.d_sae, d_out, generator=g, dtype=torch.float64)
    W_dec = W_dec / W_dec.norm(dim=-1, keepdim=True)
    if d_in == d_out and s.apply_b_dec_to_input:
        W_enc = W_dec.T.clone()
    else:
        W_enc = torch.randn(d_in, s.d_sae, generator=g, dtype=torch.float64)
        W_enc = W_enc / W_enc.norm(dim=0, keepdim=True)
    p = {"W_enc": W_enc, "b_enc": torch.zeros(s.d_sae, dtype=torch.float64), "W_dec": W_dec,
         "b_dec": y_mean.double().clone()}
    if s.activation == "topk":
        p["W_dec"] = p["W_dec"] * 0.1  # decoder norm is divided out of the output and into the pre-activations
    if s.skip:
        p["W_skip"] = torch.zeros(d_out, d_in, dtype=torch.float64)
    if s.activation == "jumprelu":
        p["threshold"] = torch.full((s.d_sae,), float(s.init_threshold), dtype=torch.float64)
    return {k: v.to(s.dtype).requires_grad_(True) for k, v in p.items()}


def _forward(p: dict[str, torch.Tensor], x: torch.Tensor, s: DictTrainSettings
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
    """``(y_hat, fired [d_sae] bool, pre, normalised decoder, sparsity term)`` of a batch in the
    scaled units (training form). TopK decodes sparsely (``embedding_bag`` over the ``k`` active
    rows of the normalised decoder: the same sum as the dense product, ~d_sae/k times cheaper)."""
    sae_in = x - p["b_dec"] if s.apply_b_dec_to_input else x
    pre = sae_in @ p["W_enc"] + p["b_enc"]
    w_unit = None
    zero = torch.zeros((), dtype=pre.dtype, device=pre.device)
    if s.activation == "topk":
        dec_norm = p["W_dec"].norm(dim=-1)
        pre = pre * dec_norm
        vals, idx = torch.topk(pre, k=min(int(s.k or 1), pre.shape[-1]), dim=-1, sorted=False)
        vals = vals.relu()
        w_unit = p["W_dec"] / dec_norm[:, None]
        y_hat = F.embedding_bag(idx, w_unit, per_sample_weights=vals, mode="sum") + p["b_dec"]
        fired = torch.zeros(pre.shape[-1], dtype=torch.bool, device=pre.device)
        fired[idx[vals > 0]] = True
        sparsity = zero
    elif s.activation == "jumprelu":
        acts = _JumpReLUFn.apply(pre, p["threshold"], s.bandwidth)
        y_hat = acts @ p["W_dec"] + p["b_dec"]
        fired = (acts > 0).any(0)
        sparsity = _StepFn.apply(pre, p["threshold"], s.bandwidth).sum(-1).mean()  # L0 (SAELens "step")
    else:
        acts = torch.relu(pre)
        y_hat = acts @ p["W_dec"] + p["b_dec"]
        fired = (acts > 0).any(0)
        sparsity = (acts * p["W_dec"].norm(dim=-1)).sum(-1).mean()  # L1 weighted by decoder norms
    if "W_skip" in p:
        y_hat = y_hat + x @ p["W_skip"].T
    return y_hat, fired, pre, w_unit, sparsity


def _loss(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor, s: DictTrainSettings,
          dead: torch.Tensor) -> tuple[torch.Tensor, dict, torch.Tensor]:
    """``(loss, parts, fired [d_sae] bool)`` of one batch (SAELens' losses, module docstring)."""
    y_hat, fired, pre, w_unit, sparsity = _forward(p, x, s)
    mse = (y_hat - y).pow(2).sum(-1).mean()
    loss = mse
    parts = {"mse": float(mse.detach())}
    if s.activation == "topk":
        n_dead = int(dead.sum())
        if n_dead > 0:
            assert w_unit is not None
            k_aux = y.shape[-1] // 2
            scale = min(n_dead / k_aux, 1.0)
            k_aux = min(k_aux, n_dead)
            masked = torch.where(dead[None], pre, torch.tensor(-torch.inf, dtype=pre.dtype, device=pre.device))
            top = masked.topk(k_aux, dim=-1, sorted=False)
            recons = F.embedding_bag(top.indices, w_unit, per_sample_weights=top.values, mode="sum")
            aux = (recons - (y - y_hat).detach()).pow(2).sum(-1).mean()
            loss = loss + s.aux_coefficient * scale * aux
            parts["aux"] = float(aux.detach())
    elif s.activation == "jumprelu":
        loss = loss + s.l0_coefficient * sparsity
        parts["l0"] = float(sparsity.detach())
    else:
        loss = loss + s.l1_coefficient * sparsity
        parts["l1"] = float(sparsity.detach())
    return loss, parts, fired


def _order(n: int, batch: int, step: int, s: DictTrainSettings) -> torch.Tensor:
    """The example indices of optimiser step ``step``: consecutive slices of a seeded permutation per
    pass over the ``n`` examples (a batch straddling two passes takes from both)."""
    start = step * batch
    out = []
    while len(out) < batch:
        ep, off = divmod(start + len(out), n)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(
            int(s.seed) * 1_000_003 + int(s.layer) * 1009 + ep + 1))
        out.extend(perm[off: off + batch - len(out)].tolist())
    return torch.tensor(out, dtype=torch.long)


def fit_dictionary(x: torch.Tensor, y: torch.Tensor, s: DictTrainSettings, *, checkpoint: Optional[Path] = None,
                   progress: Optional[Callable[[int, dict], None]] = None) -> tuple[dict[str, torch.Tensor], dict]:
    """Train one dictionary from ``x [n, d_in]`` to ``y [n, d_out]`` (an SAE when ``y is x``).

    Args:
        x: inputs (float, CPU or the training device).
        y: targets.
        s: the settings (:class:`DictTrainSettings`).
        checkpoint: a file to save the training state to every ``s.checkpoint_every`` steps and to
            resume from when it exists (same settings and data: same weights as without a stop).
        progress: called ``(step, parts)`` after each step.

    Returns:
        ``(params, stats)``: the parameters in the *unscaled* units with the decoder norm folded
        (``W_enc [d_in, d_sae]``, ``b_enc``, ``W_dec [d_sae, d_out]``, ``b_dec``, ``W_skip``?,
        ``threshold``?) and ``{"steps", "final_mse_normalised", "dead_fraction", "x_scale", "y_scale"}``.

    Raises:
        SAEError: fewer examples than one batch.
    """
    n = int(x.shape[0])
    if n < s.batch:
        raise SAEError(f"train_batch_size_tokens: {s.batch} tokens per step but only {n} training tokens (special "
                       "tokens left out); raise dataset_tokens or lower train_batch_size_tokens")
    sx, sy = _scale(x), _scale(y)
    xs, ys = (x * sx).to(s.dtype), (y * sy).to(s.dtype)
    p = _params(xs.shape[1], ys.shape[1], s, ys.mean(0))
    opt = torch.optim.Adam(list(p.values()), lr=s.lr)
    since = torch.zeros(s.d_sae, dtype=torch.long)
    step0, recent = 0, []
    if checkpoint is not None and checkpoint.is_file():
        ck = torch.load(checkpoint, weights_only=False)
        with torch.no_grad():
            for k, v in ck["params"].items():
                p[k].copy_(v)
        opt.load_state_dict(ck["opt"])
        since, step0, recent = ck["since"], int(ck["step"]), list(ck["recent"])
    for step in range(step0, s.steps):
        idx = _order(n, s.batch, step, s)
        dead = since > s.dead_feature_window
        loss, parts, fired = _loss(p, xs[idx], ys[idx], s, dead)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(p.values()), 1.0)
        opt.step()
        with torch.no_grad():
            if "threshold" in p:
                p["threshold"].clamp_(min=0.0)
        since = torch.where(fired, torch.zeros_like(since), since + 1)
        recent = (recent + [parts["mse"]])[-20:]
        if progress is not None:
            progress(step, parts)
        if checkpoint is not None and (step + 1) % s.checkpoint_every == 0 and step + 1 < s.steps:
            tmp = checkpoint.with_name(checkpoint.name + f".tmp-{os.getpid()}")
            torch.save({"params": {k: v.detach().clone() for k, v in p.items()}, "opt": opt.state_dict(),
                        "since": since, "step": step + 1, "recent": recent}, tmp)
            os.replace(tmp, checkpoint)
    out = {k: v.detach().double() for k, v in p.items()}
    if s.activation == "topk":  # fold the decoder norm (SAELens' _fold_norm_topk)
        nrm = out["W_dec"].norm(dim=-1)
        out["b_enc"] = out["b_enc"] * nrm
        out["W_enc"] = out["W_enc"] * nrm[None]
        out["W_dec"] = out["W_dec"] / nrm[:, None]
    # fold the input/output scales: pre-activations unchanged, outputs divided by sy
    # (an SAE applying b_dec to its input has x is y, so sx == sy: (x sx - b_dec) @ W_enc = (x - b_dec / sx) @ (sx W_enc))
    out["W_enc"] = out["W_enc"] * sx
    out["W_dec"] = out["W_dec"] / sy
    out["b_dec"] = out["b_dec"] / sy
    if "W_skip" in out:
        out["W_skip"] = out["W_skip"] * (sx / sy)
    stats = {"steps": s.steps, "final_mse_normalised": float(np.mean(recent)) if recent else None,
             "dead_fraction": float((since > s.dead_feature_window).float().mean()), "x_scale": sx, "y_scale": sy}
    return {k: v.float() for k, v in out.items()}, stats


def to_dictionary(params: dict[str, torch.Tensor], s: DictTrainSettings, hook_in: str, hook_out: str,
                  metadata: Optional[dict] = None) -> Dictionary:
    """A :class:`Dictionary` holding ``params`` (:func:`fit_dictionary`'s output)."""
    d_in, d_sae = params["W_enc"].shape
    d_out = params["W_dec"].shape[1]
    d = Dictionary(int(d_in), int(d_sae), int(d_out), activation=s.activation, k=s.k, skip="W_skip" in params,
                   hook_in=hook_in, hook_out=hook_out, layer=s.layer, apply_b_dec_to_input=s.apply_b_dec_to_input,
                   metadata=metadata)
    with torch.no_grad():
        for k, v in params.items():
            getattr(d, k).copy_(v)
    return d


# =============================================================================================
# saving (circuit-tracer's layout)


def _save_set(dset: DictionarySet, path: Path, *, model_name: str) -> Path:
    """Write ``dset`` in circuit-tracer's transcoder layout: ``layer_<L>.safetensors`` (``W_enc
    [d_in, d_sae]``, ``W_dec [d_sae, d_out]``, ``b_enc``, ``b_dec``, ``W_skip``?, ``threshold``?)
    and ``config.yaml`` (model, hooks, layers, activation)."""
    from safetensors.torch import save_file  # lazy

    path.mkdir(parents=True, exist_ok=True)
    entries = []
    first = dset[dset.layers[0]]
    for L in dset.layers:
        d = dset[L]
        t = {"W_enc": d.W_enc, "W_dec": d.W_dec, "b_enc": d.b_enc, "b_dec": d.b_dec}
        if d.W_skip is not None:
            t["W_skip"] = d.W_skip
        if d.threshold is not None:
            t["threshold"] = d.threshold
        save_file({k: v.detach().float().cpu().contiguous() for k, v in t.items()}, str(path / f"layer_{L}.safetensors"))
        entries.append({"id": f"layer_{L}", "layer": int(L), "filepath": f"layer_{L}.safetensors"})
    site_in = first.hook_in.split(".", 2)[-1] if first.hook_in.startswith("blocks.") else first.hook_in
    site_out = first.hook_out.split(".", 2)[-1] if first.hook_out.startswith("blocks.") else first.hook_out
    cfg = {"model_name": model_name, "feature_input_hook": site_in, "feature_output_hook": site_out,
           "activation": first.activation, "k": first.k, "transcoders": entries,
           "metadata": dset.metadata}
    (path / SET_CONFIG).write_text(json.dumps(cfg, indent=1))  # JSON is valid YAML
    return path


def _load_set(path: Path, *, field: str) -> DictionarySet:
    """Read a set :func:`_save_set` wrote (circuit-tracer's layout, ``config.yaml``)."""
    import yaml  # lazy
    from safetensors.torch import load_file  # lazy

    cfgf = path / SET_CONFIG
    if not cfgf.is_file():
        raise SAEError(f"{field}.path: {path} holds no {SET_CONFIG} (a transcoder set in circuit-tracer's layout)")
    cfg = yaml.safe_load(cfgf.read_text())
    out: dict[int, Dictionary] = {}
    for e in cfg["transcoders"]:
        L = int(e["layer"])
        t = load_file(str(path / e.get("filepath", f"layer_{L}.safetensors")))
        act = cfg.get("activation") or ("jumprelu" if "threshold" in t else "relu")
        d = Dictionary(t["W_enc"].shape[0], t["W_enc"].shape[1], t["W_dec"].shape[1], activation=act,
                       k=cfg.get("k"), skip="W_skip" in t, hook_in=f"blocks.{L}.{cfg['feature_input_hook']}",
                       hook_out=f"blocks.{L}.{cfg['feature_output_hook']}", layer=L)
        with torch.no_grad():
            for k, v in t.items():
                getattr(d, k).copy_(v)
        out[L] = d
    return DictionarySet(out, dict(cfg.get("metadata") or {}))


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
    t0 = time.time()
    store_path = Path(t.store).expanduser() if t.store is not None else _own_store(model, t, hooks, wins, root, field,
                                                                                   progress)
    t_store = time.time() - t0
    partial = root / f".{key}.partial"
    partial.mkdir(parents=True, exist_ok=True)
    n_ex = len(wins) * t.context_size
    tok = np.asarray(wins, dtype=np.int64).reshape(-1)
    keep = ~np.isin(tok, np.asarray(special_ids(model), dtype=np.int64))
    n_keep = int(keep.sum())
    dt = torch.float64 if t.dtype == "float64" else torch.float32
    per_layer: dict[str, dict] = {}
    dev = model_device(model)
    with open_training_store(model, store_path, hooks, wins, t.corpus, t.context_size, field) as store:
        for L in layers:
            h_in, h_out = pairs[L]
            d_in, d_out = store.width(h_in), store.width(h_out)
            s = _settings(t, L, d_in)
            if s.activation == "topk" and (s.k or 0) > s.d_sae:
                raise SAEError(f"{field}.k: {s.k} is more than the {s.d_sae} features of layer {L}; lower k")
            el = 4 if dt == torch.float32 else 8
            need = el * (n_keep * (2 * (d_in + d_out)) + 4 * (d_in + d_out) * s.d_sae
                         + 4 * s.batch * (s.d_sae + d_in + d_out))
            check_fits(model, need, what="transcoder training", unit="layer",
                       fix=f"lower {field}.dataset_tokens or d_sae / expansion_factor")
            done = partial / f"layer_{L}.pt"
            if done.is_file():
                rec = torch.load(done, weights_only=False)
                per_layer[str(L)] = rec["stats"]
                continue
            x, y = _layer_data(store, h_in, h_out, n_ex, keep, dt)
            t1 = time.time()
            params, st = fit_dictionary(x.to(dev), y.to(dev), s, checkpoint=partial / f"ckpt_{L}.pt")
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
    tmp = root / f".{key}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        _save_set(DictionarySet(dicts, meta), tmp, model_name=spec.name)
        (tmp / TRAIN_RECORD).write_text(json.dumps(stats))
        write_files_manifest(tmp, {"key": key, "kind": "transcoders"})
        out = root / key
        if out.exists():
            shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
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
        dset = _load_set(path, field=field)
        hit, stats = True, {}
    else:
        assert spec.train is not None
        path, hit, stats = train_transcoders(model, spec.train, field=f"{field}.train", progress=progress,
                                             cache_dir=cache_dir)
        dset = _load_set(path, field=field)
    _check_set(model, dset, field)
    dset.to(device=model_device(model), dtype=torch.float32)
    first = dset[dset.layers[0]]
    info = {"hook_in": first.hook_in, "hook_out": first.hook_out, "d_in": first.d_in, "d_sae": first.d_sae,
            "d_out": first.d_out, "activation": first.activation, "k": first.k, "layers": dset.layers,
            "skip": first.W_skip is not None, "key": dset.metadata.get("key"), "model": dset.metadata.get("model")}
    return LoadedTranscoders(dset, str(path), hit, stats, info)

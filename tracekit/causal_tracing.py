"""Causal tracing (Meng et al. 2022, "Locating and Editing Factual Associations in GPT", ROME, section 2.1).

Over 600 lines (reason): one method in one place, as ROME's ``causal_trace.py`` is: the subject span,
the noise calibration, the corrupted run and its restoration replay share :class:`Restoration`
and the cached run, and the result types sit beside the two entry points.

Three runs per prompt, as in ROME's ``experiments/causal_trace.py`` (``trace_with_patch``):

* **clean**: the prompt as it is; ``p_clean = p(target)`` at the last position;
* **corrupted**: Gaussian noise ``N(0, noise_std^2)`` (i.i.d. per sample, subject token and
  dimension) added to the residual stream's start ``blocks.0.hook_resid_pre`` at the subject's
  token positions; ``n_samples`` seeded draws, the same draws for every restoration (ROME reuses one
  ``RandomState`` per call); ``p_corrupted`` is the mean over draws;
* **corrupted-with-restoration**: the corrupted run with the clean state written back at one
  (layer, position): the block output ``blocks.L.hook_resid_post`` (``resid``), or the MLP /
  attention output ``blocks.L.hook_mlp_out`` / ``hook_attn_out`` at every layer of a window centred
  on ``L`` (ROME's ``trace_important_window``: layers ``max(0, L - w//2) .. min(n, L + ceil(w/2)) - 1``).

The indirect effect of a state is ``p(target | corrupted, restored) - p(target | corrupted)``,
averaged over the noise draws; the total effect is ``p_clean - p_corrupted``.

Noise level: ``noise_std = noise x sigma``, ``sigma`` the standard deviation of the token
embeddings of a population of subjects (ROME's ``collect_embedding_std``, default ``noise = 3``:
ROME's ``--noise_level s3``). ROME pools over the subjects of its whole facts dataset (the 1209
"known" facts), so one prompt's noise does not depend on which subject it traces. The population is
the *calibration* (:data:`NOISE_CALIBRATIONS`, :func:`noise_scale`): ``subjects_table`` (default),
the 50 subjects of the capitals table tracekit ships (``tracekit/data/countries.csv``, column
``country``), fixed whatever the prompts; ``row_subjects``, the subject tokens of the prompts traced
(the rows of one step: it changes with the prompts, e.g. a one-prompt run noises ' France' by its
own std). :func:`embedding_std` reads sigma from the tensor the noise is added to,
``blocks.0.hook_resid_pre``, after any embedding scale or norm (Gemma's ``sqrt(d_model)``,
Granite's multiplier, Bloom's LayerNorm), minus the learned position embedding
(``hook_pos_embed``) where the model has one (GPT-2): the token embedding as it enters the stream,
which is ROME's ``wte`` output on GPT-2. Adding noise to ``blocks.0.hook_resid_pre`` is the same as
adding it to the embedding output (the position embedding is added, not mixed).

Batching: one cached run per prompt holds the clean row and the ``n_samples`` corrupted rows
(:func:`tracekit.patching.engine.cache_run`; the noise enters through a forward pre-hook on block 0
so every recorded block input is the corrupted one); every (restoration, draw) is then a row of a
layer-skipping replay (``_replay``: rows join at their first restored block, as the patching
engine's staircase). The patching engine's ``_replay`` patches one hook per variant; a window
restores several layers per variant, so this module has its own small replay on
:meth:`CachedRun.block_call`, with the same guarantees (hooks removed in a ``finally``, chunked
with out-of-memory halving by :func:`tracekit.patching.engine.run_chunked`).

Positions before the first subject token are not replayed: in a causal model their states do not
depend on the noise, so restoring them is the identity and ``p_restored = p_corrupted`` (indirect
effect exactly 0). This is checked on the cached run: the clean and corrupted block inputs there
must agree within float rounding (:data:`PREFIX_TOLERANCE`), else those positions are replayed too.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, cast

import pandas as pd
import torch
from jaxtyping import Float

from .core.errors import ConfigError, TokenizationError
from .core.sites import hook
from .model.architectures import require
from .model.info import HookedModel
from .model.load import model_device
from .model.readout import Readout
from .model.state import state_of
from .patching.engine import (
    CachedRun,
    cache_run,
    check_replay_fits,
    readout_last,
    replay_chunk,
    replay_row_bytes,
    run_chunked,
    tensor_bytes,
)
from .tokens import encode, pad_ids, run_with_cache, str_tokens, tokenizer_of

__all__ = ["KINDS", "CATEGORIES", "PREFIX_TOLERANCE", "NOISE_CALIBRATIONS", "Restoration", "RestoredProbs",
           "CausalTrace", "NoiseScale", "causal_trace", "trace_restorations", "embedding_std", "noise_scale",
           "table_subjects", "subject_noise", "window_layers", "subject_span", "token_categories", "category_rows"]

#: What is restored: the block output (residual stream), the MLP output, the attention output.
KINDS = ("resid", "mlp", "attn")
_SITE = {"mlp": "mlp_out", "attn": "attn_out"}
#: ROME's token categories for averages over prompts (``experiments/causal_trace.py`` notebooks).
CATEGORIES = ("first subject token", "middle subject tokens", "last subject token", "first subsequent token",
              "further tokens", "last token")
#: Largest |clean - corrupted| block input allowed before the first subject token, relative to the
#: largest |state| there, for those positions to be taken as unaffected (causality; float rounding
#: of batched rows is ~1e-7 relative in float32).
PREFIX_TOLERANCE = 1e-4
#: The populations sigma (the embedding std the noise is a multiple of) can be computed over:
#: ``subjects_table`` the shipped capitals table's 50 subjects (prompt-independent, the default),
#: ``row_subjects`` the subject tokens of the prompts traced (:func:`noise_scale`).
NOISE_CALIBRATIONS = ("subjects_table", "row_subjects")


@dataclass(frozen=True)
class Restoration:
    """Clean states written into the corrupted run.

    Attributes:
        kind: ``resid`` (block output ``blocks.L.hook_resid_post``), ``mlp`` (``blocks.L.hook_mlp_out``)
            or ``attn`` (``blocks.L.hook_attn_out``).
        layers: the blocks whose state is restored (a window for ``mlp`` / ``attn``).
        positions: the token positions restored (indices into the prompt's ids, BOS counted).
    """

    kind: str
    layers: tuple[int, ...]
    positions: tuple[int, ...]

    @property
    def start(self) -> int:
        """The first block the replay must run (a block output is the next block's input)."""
        return min(self.layers) + 1 if self.kind == "resid" else min(self.layers)


def window_layers(layer: int, window: int, n_layers: int) -> tuple[int, ...]:
    """The blocks restored together around ``layer``: ROME's ``trace_important_window``,
    ``range(max(0, layer - window // 2), min(n_layers, layer + ceil(window / 2)))`` (window 10:
    ``layer - 5 .. layer + 4``, clipped at the ends).

    Raises:
        ConfigError: ``window < 1``.
    """
    if window < 1:
        raise ConfigError(f"window: {window} restores no layer; give a window of at least 1 layer (ROME: 10)")
    return tuple(range(max(0, layer - window // 2), min(n_layers, layer - (-window // 2))))


def subject_span(model: HookedModel, prompt: str, subject: str, ids: Sequence[int] | None = None, field: str = "subject"
                 ) -> tuple[int, ...]:
    """Token positions (into ``ids`` = ``encode(model, prompt)``, BOS counted) of every token that
    overlaps the **last** occurrence of ``subject`` in ``prompt`` (ROME's ``find_token_range`` takes
    the first; the last is the query's subject when a few-shot prefix comes before it).

    Raises:
        TokenizationError: the subject is empty or not in the prompt, or the tokenizer gives no
            character offsets.
    """
    if not subject:
        raise TokenizationError(f"{field}: an empty subject; give the subject's text as it appears in the prompt")
    start = prompt.rfind(subject)
    if start < 0:
        raise TokenizationError(f"{field}: {subject!r} does not occur in the prompt {prompt!r}; give the subject "
                                "exactly as written there (case and spaces count)")
    end = start + len(subject)
    ids = list(ids) if ids is not None else encode(model, prompt)
    try:
        enc = tokenizer_of(model)(prompt, add_special_tokens=False, split_special_tokens=True, return_offsets_mapping=True)
    except (NotImplementedError, TypeError) as e:
        raise TokenizationError(f"{field}: finding a subject needs a fast tokenizer (character offsets)") from e
    n_bos = len(ids) - len(enc["input_ids"])
    if n_bos not in (0, 1) or list(enc["input_ids"]) != ids[n_bos:]:
        raise TokenizationError(f"{field}: tokenizer offsets disagree with tracekit.tokens.encode for {prompt!r}")
    span = [n_bos + j for j, (a, b) in enumerate(enc["offset_mapping"]) if a < end and b > start]
    if not span:
        raise TokenizationError(f"{field}: no token of {str_tokens(model, ids)} covers {subject!r}")
    return tuple(range(span[0], span[-1] + 1))


def token_categories(n_tokens: int, subject_positions: Sequence[int]) -> dict[str, list[int]]:
    """ROME's token categories (:data:`CATEGORIES`) as positions, exactly as ROME's averages count
    them: a one-token subject is both the first and the last subject token, a subject ending just
    before the last token makes that token both the first subsequent and the last token; tokens
    before the subject belong to none (in a causal model their effect is 0)."""
    first, last, end = min(subject_positions), max(subject_positions), n_tokens - 1
    return {"first subject token": [first], "middle subject tokens": list(range(first + 1, last)),
            "last subject token": [last], "first subsequent token": [last + 1] if last + 1 <= end else [],
            "further tokens": list(range(last + 2, end)), "last token": [end]}


#: Row labels of categories that are the same positions in every prompt (:func:`category_rows`).
_MERGED: dict[tuple[str, ...], str] = {("first subject token", "last subject token"): "subject token (first = last)",
           ("first subsequent token", "last token"): "last token (= first subsequent)"}


def category_rows(prompts: Sequence[tuple[int, Sequence[int]]]) -> list[tuple[str, tuple[str, ...]]]:
    """The rows of a per-category figure of :data:`CATEGORIES` (ROME's average causal-tracing
    heatmaps), for prompts given as ``(n_tokens, subject_positions)``: a category no prompt has
    (middle subject tokens of one-token subjects) is left out, and categories that are the same
    positions in every prompt are one row, e.g. ``"subject token (first = last)"`` for one-token
    subjects, ``"last token (= first subsequent)"`` when the subject ends just before the last
    token; their averages are then the same numbers, which two rows would draw twice.

    Args:
        prompts: per prompt, its token count (BOS counted) and its subject positions.

    Returns:
        ``(label, categories)`` per row, in :data:`CATEGORIES` order (``categories``: the merged
        category names, the first of them the one whose numbers the row shows).
    """
    per = [token_categories(n, subj) for n, subj in prompts]
    rows: list[tuple[str, tuple[str, ...]]] = []
    for cat in CATEGORIES:
        if not any(p[cat] for p in per):
            continue
        same = next((i for i, (_, cats) in enumerate(rows) if all(p[cats[0]] == p[cat] for p in per)), None)
        if same is None:
            rows.append((cat, (cat,)))
        else:
            cats = rows[same][1] + (cat,)
            rows[same] = (_MERGED.get(cats, " = ".join(cats)), cats)
    return rows


def subject_noise(n_samples: int, n_subject: int, d_model: int, std: float, seed: int
                  ) -> Float[torch.Tensor, "sample subject d_model"]:
    """``[n_samples, n_subject, d_model]`` Gaussian noise ``std * N(0, 1)`` drawn on the CPU from a
    generator seeded with ``seed`` (the same numbers on every device), float32."""
    g = torch.Generator().manual_seed(int(seed))
    return torch.randn(n_samples, n_subject, d_model, generator=g, dtype=torch.float32) * float(std)


def _std_chunks(lengths: Sequence[int], max_tokens: int = 4096) -> list[slice]:
    """Consecutive slices of prompts, each padded batch at most ``max_tokens`` (or one prompt)."""
    out, start, width = [], 0, 0
    for i, n in enumerate(lengths):
        w = max(width, n)
        if i > start and w * (i + 1 - start) > max_tokens:
            out.append(slice(start, i))
            start, w = i, n
        width = w
    out.append(slice(start, len(lengths)))
    return out


@torch.no_grad()
def embedding_std(model: HookedModel, ids: Sequence[Sequence[int]], positions: Sequence[Sequence[int]]) -> float:
    """ROME's ``collect_embedding_std``: the standard deviation of every element of the token
    embeddings at the given positions of the given prompts (pooled), read as they enter the residual
    stream: ``blocks.0.hook_resid_pre`` minus ``hook_pos_embed`` where the model has a learned
    position embedding that adds up to it (see the module docstring).

    Args:
        model: the hooked model.
        ids: the prompts' token ids.
        positions: per prompt, the positions read (the subject's tokens).

    Prompts run in right-padded batches (of at most 4096 padded tokens); only the embedding of
    each real token is read, which padding does not change.

    Returns:
        The standard deviation (residual-stream units, float).
    """
    start, pe, emb = hook("resid_pre", 0), hook("pos_embed"), hook("embed")
    hd = model.hook_dict
    names = [start] + [n for n in (pe, emb) if n in hd]
    vals = []
    for sl in _std_chunks([len(s) for s in ids]):
        # right padding: every prompt's real tokens keep their positions (and their embeddings)
        _, cache = run_with_cache(model, pad_ids(model, [list(s) for s in ids[sl]], "right"), names, strict=False)
        for b, pos in enumerate(positions[sl]):
            x = cache[start][b].float()
            if pe in cache and emb in cache and cache[pe].shape == cache[start].shape:
                tok_part = x - cache[pe][b].float()
                # the token part only when the stream's start is token + position embedding (not scaled after)
                if torch.allclose(cache[emb][b].float(), tok_part, atol=1e-5, rtol=1e-4):
                    x = tok_part
            vals.append(x[list(pos)].flatten())
    return float(torch.cat(vals).std())


def table_subjects() -> list[str]:
    """The subjects of the capitals table tracekit ships (``tracekit/data/countries.csv``, column
    ``country``: 50 country names, in the table's order), the population of the ``subjects_table``
    noise calibration."""
    import csv
    from importlib import resources

    with resources.files("tracekit").joinpath("data/countries.csv").open("r", encoding="utf-8") as f:
        return [r["country"] for r in csv.DictReader(f)]


@dataclass(frozen=True)
class NoiseScale:
    """The embedding std sigma the noise is a multiple of, and what it was computed over.

    Attributes:
        calibration: the rule (:data:`NOISE_CALIBRATIONS`).
        embedding_std: sigma (residual-stream units).
        population: in words, the tokens sigma pools.
        n_subjects: subjects (or prompts) pooled.
        n_tokens: tokens pooled (each contributes ``d_model`` elements).
    """

    calibration: str
    embedding_std: float
    population: str
    n_subjects: int
    n_tokens: int


def _table_subject_positions(model: HookedModel, name: str, ids: Sequence[int]) -> tuple[int, ...]:
    """The tokens of ``" " + name`` (encoded as ``ids``) overlapping ``name``; without character
    offsets (a slow tokenizer), every token after the prepended BOS."""
    try:
        return subject_span(model, " " + name, name, ids, field="subjects table")
    except TokenizationError:
        n_bos = len(ids) - len(tokenizer_of(model)(" " + name, add_special_tokens=False)["input_ids"])
        return tuple(range(max(0, n_bos), len(ids)))


def noise_scale(model: HookedModel, calibration: str = "subjects_table", ids: Sequence[Sequence[int]] = (),
                positions: Sequence[Sequence[int]] = ()) -> NoiseScale:
    """sigma for ``noise_std = noise x sigma`` (ROME's ``collect_embedding_std``, ``experiments/causal_trace.py``
    of kmeng01/rome: the std of every element of the subjects' token embeddings, pooled).

    Args:
        model: the hooked model.
        calibration: ``subjects_table``: over the 50 subjects of the shipped capitals table
            (:func:`table_subjects`), each encoded on its own as it stands in running text, ``" " +
            name`` (BOS as the model prepends it, not read), reading every token overlapping the
            name; the same for every prompt (ROME pools its whole facts dataset's subjects, encoding
            each bare subject; tracekit's prompts have it after a space). Cached on the model.
            ``row_subjects``: over ``positions`` of ``ids`` (the subject tokens of the prompts traced).
        ids: with ``row_subjects``: the prompts' token ids.
        positions: with ``row_subjects``: per prompt, the subject positions.

    Returns:
        :class:`NoiseScale`.

    Raises:
        ConfigError: an unknown calibration, or ``row_subjects`` without subject positions.
    """
    if calibration == "subjects_table":
        cached = state_of(model).subjects_table_scale
        if cached is not None:
            return cached
        names = table_subjects()
        enc = [encode(model, " " + n) for n in names]
        pos = [_table_subject_positions(model, n, e) for n, e in zip(names, enc)]
        out = NoiseScale("subjects_table", embedding_std(model, enc, pos),
                         f"the {len(names)} subjects of the built-in capitals table (tracekit/data/countries.csv, "
                         "column country), each encoded alone as ' ' + name", len(names), sum(len(p) for p in pos))
        if hasattr(model, "__dict__"):
            state_of(model).subjects_table_scale = out
        return out
    if calibration == "row_subjects":
        if not ids or len(ids) != len(positions) or not all(positions):
            raise ConfigError("noise_calibration: row_subjects needs the prompts' subject positions")
        return NoiseScale("row_subjects", embedding_std(model, ids, positions),
                          f"the subject tokens of the {len(ids)} prompt(s) traced", len(ids),
                          sum(len(p) for p in positions))
    raise ConfigError(f"noise_calibration: {calibration!r}; choose from {list(NOISE_CALIBRATIONS)}")


@dataclass
class RestoredProbs:
    """What :func:`trace_restorations` measures (probabilities of the target at the last position).

    Attributes:
        target_id: the target token (the clean top-1 when none was given).
        p_clean: ``p(target)`` on the clean prompt.
        p_corrupted: ``[sample]`` ``p(target)`` on each corrupted run.
        p_restored: ``[restoration, sample]`` ``p(target)`` with each restoration, per noise draw.
        replayed: ``[restoration]`` False where the restoration was taken as the identity (only
            positions before the subject, see the module docstring).
        batch_size: replay rows per batch used (``run.memory_budget`` and ``batch_size``, after
            any out-of-memory halving).
    """

    target_id: int
    p_clean: float
    p_corrupted: Float[torch.Tensor, " sample"]
    p_restored: Float[torch.Tensor, "restoration sample"]
    replayed: torch.Tensor
    batch_size: int = 0


def _noise_pre_hook(module, args, kwargs, subj, noise):
    """Add ``noise`` [S, n_subj, d] to rows 1.. of block 0's input at the subject positions."""
    x = args[0].clone()
    x[1:, subj] = x[1:, subj] + noise.to(device=x.device, dtype=x.dtype)
    return (x, *args[1:]), kwargs


def _corrupted_run(model: HookedModel, ids: Sequence[int], subject_positions: Sequence[int], noise: torch.Tensor,
                   hook_names: Sequence[str]) -> CachedRun:
    """One cached run of ``1 + n_samples`` rows: row 0 clean, row ``s + 1`` with noise draw ``s``."""
    dev = model_device(model)
    tokens = torch.tensor([list(ids)] * (noise.shape[0] + 1), dtype=torch.long, device=dev)
    subj = torch.tensor(list(subject_positions), dtype=torch.long, device=dev)
    handle = None
    try:  # registered before cache_run's own pre-hook, so the recorded block-0 input is the noised one
        handle = cast(Any, model).blocks[0].register_forward_pre_hook(
            partial(_noise_pre_hook, subj=subj, noise=noise), with_kwargs=True)
        return cache_run(model, tokens, hook_names)
    finally:
        if handle is not None:
            handle.remove()


def _prefix_unaffected(run: CachedRun, first_subject: int) -> bool:
    """Clean and corrupted block inputs agree (within float rounding) before the first subject token."""
    if first_subject == 0:
        return True
    for r in run.resid:
        pre = r[:, :first_subject].float()
        diff = float((pre[1:] - pre[:1]).abs().max()) if pre.shape[0] > 1 else 0.0
        if diff > PREFIX_TOLERANCE * (1.0 + float(pre.abs().max())):
            return False
    return True


def _restore_hook(module, inputs, output, rows, pos, values):
    conv = getattr(module, "hook_conversion", None)
    act = conv.convert(output) if conv is not None else output
    act = act.clone()
    act[rows, pos] = values.to(act.dtype)
    return conv.revert(act) if conv is not None else act


def _replay(model: HookedModel, run: CachedRun, rests: Sequence[Restoration], chunk: Sequence[tuple[int, int]],
            hook_points: dict[str, Any]) -> Float[torch.Tensor, "rows d_vocab"]:
    """Replay ``chunk`` = ``(restoration, run row)`` pairs sorted by start block as a staircase:
    rows join at their restoration's first block from the cached corrupted input; ``resid``
    restorations write the clean block output into the stream before the next block, ``mlp`` /
    ``attn`` ones through a forward hook per (site, block) that writes the clean output into every
    row restoring it there. Returns the last-position logits ``[len(chunk), d_vocab]`` (float32, via
    :class:`Readout`). Every hook is removed whatever is raised."""
    n_layers = model.cfg.n_layers
    dev = run.resid[0].device
    starts = [rests[r].start for r, _ in chunk]
    x, order, k, handles = None, torch.empty(0, dtype=torch.long, device=dev), 0, []

    def writes(kind: str, layer: int, n_rows: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        rr, pp = [], []
        for i, (r, _) in enumerate(chunk[:n_rows]):
            rs = rests[r]
            if rs.kind == kind and layer in rs.layers:
                rr += [i] * len(rs.positions)
                pp += list(rs.positions)
        if not rr:
            return None
        return torch.tensor(rr, device=dev), torch.tensor(pp, device=dev)

    try:
        for L in range(min(starts), n_layers + 1):
            while k < len(chunk) and starts[k] == L:
                k += 1
            if x is None or x.shape[0] < k:
                n0 = 0 if x is None else x.shape[0]
                nb = torch.tensor([s for _, s in chunk[n0:k]], dtype=torch.long, device=dev)
                xn = run.resid[L][nb].clone()
                x = xn if x is None else torch.cat([x, xn], 0)
                order = torch.cat([order, nb])
            if L >= 1 and (w := writes("resid", L - 1, k)) is not None:
                x[w[0], w[1]] = run.resid[L][0, w[1]]  # the clean output of block L-1
            if L == n_layers:
                break
            for kind, site in _SITE.items():
                w = writes(kind, L, k)
                if w is not None:
                    name = hook(site, L)
                    fn = partial(_restore_hook, rows=w[0], pos=w[1], values=run.acts[name][0, w[1]])
                    handles.append(hook_points[name].register_forward_hook(fn))
            x = run.run_block(model, L, x, order)
            for h in handles:
                h.remove()
            handles = []
    finally:
        for h in handles:
            h.remove()
    assert x is not None
    return readout_last(model, x)


def _check_inputs(model: HookedModel, ids: Sequence[int], subject_positions: Sequence[int], n_samples: int, kinds: Sequence[str]
                  ) -> None:
    if n_samples < 1:
        raise ConfigError(f"n_samples: {n_samples}; give at least 1 noise sample (ROME: 10)")
    if not subject_positions:
        raise ConfigError("subject: no subject positions; causal tracing corrupts the subject's tokens")
    bad = [p for p in subject_positions if not 0 <= int(p) < len(ids)]
    if bad:
        raise ConfigError(f"subject: positions {bad} are outside the prompt's {len(ids)} tokens (0 .. {len(ids) - 1})")
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        raise ConfigError(f"kinds: {unknown or '[]'}; choose from {list(KINDS)}")
    need = [k for k in ("mlp", "attn") if k in kinds]
    if need:
        require(model, "causal tracing", need=need)


@torch.no_grad()
def trace_restorations(
    model: HookedModel,
    ids: Sequence[int],
    subject_positions: Sequence[int],
    restorations: Sequence[Restoration],
    noise_std: float,
    target_id: int | None = None,
    n_samples: int = 10,
    seed: int = 0,
    batch_size: int | str = "auto",
    skip_prefix: bool = True,
    progress: Callable[[int], Any] | None = None,
) -> RestoredProbs:
    """``p(target)`` at the last position, clean, corrupted and with each restoration, per noise draw.

    Args:
        model: the hooked model (blocks called as ``model.blocks[i]``).
        ids: the prompt's token ids (one prompt, BOS included when prepended).
        subject_positions: the positions noised (the subject's tokens).
        restorations: what to restore (:class:`Restoration`), each replayed with every noise draw.
        noise_std: the noise's standard deviation (residual-stream units; 0 = no corruption).
        target_id: the token whose probability is read; default the clean run's top-1 (ROME).
        n_samples: noise draws (rows of the corrupted run).
        seed: the noise generator's seed (:func:`subject_noise`).
        batch_size: replay rows per batch at most, or ``auto``: what ``run.memory_budget`` allows
            (the cached run fixed, :func:`tracekit.patching.engine.replay_row_bytes` per row), at
            most 512.
        skip_prefix: restorations at positions before the first subject token only are taken as the
            identity when the cached run shows those states unaffected (see the module docstring).
        progress: called with the number of replay rows finished.

    Returns:
        :class:`RestoredProbs`.

    Raises:
        ConfigError: ``n_samples < 1``, no or out-of-range subject positions, an unknown kind, a
            restoration layer or position out of range.
        MethodRefused: a model without ``hook_mlp_out`` / ``hook_attn_out`` for an ``mlp`` / ``attn``
            restoration (:func:`tracekit.model.architectures.require`).
        MemoryBudgetError: the cached run of ``1 + n_samples`` rows plus one replay row does not fit
            ``run.memory_budget`` (before the cached run is made).
    """
    n_layers = int(model.cfg.n_layers)
    _check_inputs(model, ids, subject_positions, n_samples, sorted({r.kind for r in restorations}) or ["resid"])
    for r in restorations:
        if not r.layers or not r.positions or any(not 0 <= L < n_layers for L in r.layers) or \
                any(not 0 <= p < len(ids) for p in r.positions):
            raise ConfigError(f"restoration {r}: layers must be in 0..{n_layers - 1} and positions in 0..{len(ids) - 1}")
    noise = subject_noise(n_samples, len(subject_positions), int(model.cfg.d_model), noise_std, seed)
    names = sorted({hook(_SITE[r.kind], L) for r in restorations if r.kind != "resid" for L in r.layers})
    check_replay_fits(model, n_samples + 1, len(ids), names, what="causal tracing replay", unit="replay row",
                      fix="lower n_samples or shorten the prompt")
    run = _corrupted_run(model, ids, subject_positions, noise, names)
    probs = torch.softmax(Readout(model).logits(run.resid[n_layers][:, -1:, :])[:, 0].float(), -1)
    tid = int(probs[0].argmax()) if target_id is None else int(target_id)
    p_clean, p_corr = float(probs[0, tid]), probs[1:, tid].cpu()
    first = min(subject_positions)
    replay = torch.tensor([not (skip_prefix and max(r.positions) < first) for r in restorations])
    if not bool(replay.all()) and not _prefix_unaffected(run, first):
        replay[:] = True  # not causal within tolerance: replay everything
    out = p_corr.repeat(len(restorations), 1)
    todo = sorted(((restorations[i].start, i, s + 1) for i in replay.nonzero().flatten().tolist()
                   for s in range(n_samples)))
    if progress and len(todo) < len(restorations) * n_samples:
        progress(len(restorations) * n_samples - len(todo))
    hd = model.hook_dict  # resolved once: the bridge rebuilds it on every access
    hook_points = {n: hd[n] for n in names}
    bs = replay_chunk(model, replay_row_bytes(model, len(ids)), len(todo), what="causal tracing replay",
                      fixed=tensor_bytes(run), batch_size=batch_size, unit="replay row",
                      fix="lower n_samples or shorten the prompt")

    def do(sl: slice) -> None:
        chunk = [(i, s) for _, i, s in todo[sl]]
        p = torch.softmax(_replay(model, run, restorations, chunk, hook_points), -1)[:, tid].cpu()
        for (i, s), v in zip(chunk, p):
            out[i, s - 1] = v
        if progress:
            progress(len(chunk))

    used = run_chunked(do, len(todo), bs, what="causal tracing replay") if todo else bs
    return RestoredProbs(tid, p_clean, p_corr, out, replay, int(used))


@dataclass
class CausalTrace:
    """Causal tracing of one prompt (probabilities of the target at the last position).

    Attributes:
        ids: the prompt's token ids; ``tokens`` their strings.
        subject_positions: the noised positions.
        target_id: the token traced; ``target`` its string.
        kinds: the restored kinds, in the order of ``p_restored_by_sample``'s first axis.
        window: layers restored together for ``mlp`` / ``attn`` (``resid``: 1).
        noise_std: the noise's standard deviation (residual-stream units).
        n_samples: noise draws; ``seed`` their seed.
        p_clean: ``p(target)`` on the clean prompt.
        p_corrupted_by_sample: ``[sample]`` on each corrupted run.
        p_restored_by_sample: ``[kind, layer, position, sample]`` with the clean state restored at
            (layer, position) (a window around ``layer`` for ``mlp`` / ``attn``).
        replayed: ``[kind, layer, position]`` False where the restoration was taken as the identity.
        batch_size: replay rows per batch used (:attr:`RestoredProbs.batch_size`).
    """

    ids: tuple[int, ...]
    tokens: list[str]
    subject_positions: tuple[int, ...]
    target_id: int
    target: str
    kinds: tuple[str, ...]
    window: int
    noise_std: float
    n_samples: int
    seed: int
    p_clean: float
    p_corrupted_by_sample: Float[torch.Tensor, " sample"]
    p_restored_by_sample: Float[torch.Tensor, "kind layer pos sample"]
    replayed: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.bool))
    batch_size: int = 0

    @property
    def p_corrupted(self) -> float:
        """Mean ``p(target)`` over the corrupted runs."""
        return float(self.p_corrupted_by_sample.mean())

    @property
    def total_effect(self) -> float:
        """``p_clean - p_corrupted``."""
        return self.p_clean - self.p_corrupted

    @property
    def p_restored(self) -> Float[torch.Tensor, "kind layer pos"]:
        """Mean over noise draws of ``p(target)`` with the restoration."""
        return self.p_restored_by_sample.mean(-1)

    @property
    def indirect_effect(self) -> Float[torch.Tensor, "kind layer pos"]:
        """Mean over draws of ``p_restored - p_corrupted`` (the same draw's corrupted run)."""
        return (self.p_restored_by_sample - self.p_corrupted_by_sample).mean(-1)

    def peak(self, kind: str) -> tuple[int, int, float]:
        """``(layer, position, indirect effect)`` of the largest indirect effect of ``kind``."""
        ie = self.indirect_effect[self.kinds.index(kind)]
        flat = int(ie.argmax())
        L, p = divmod(flat, ie.shape[1])
        return L, p, float(ie[L, p])

    def frame(self) -> pd.DataFrame:
        """One row per (kind, layer, position): ``kind``, ``layer``, ``position``, ``token``,
        ``p_restored``, ``indirect_effect``."""
        pr, ie = self.p_restored, self.indirect_effect
        recs = [{"kind": k, "layer": L, "position": p, "token": self.tokens[p], "p_restored": float(pr[ki, L, p]),
                 "indirect_effect": float(ie[ki, L, p])}
                for ki, k in enumerate(self.kinds) for L in range(pr.shape[1]) for p in range(pr.shape[2])]
        return pd.DataFrame(recs)


@torch.no_grad()
def causal_trace(
    model: HookedModel,
    ids: Sequence[int],
    subject_positions: Sequence[int],
    target_id: int | None = None,
    kinds: Sequence[str] = KINDS,
    window: int = 10,
    noise: float = 3.0,
    noise_std: float | None = None,
    n_samples: int = 10,
    seed: int = 0,
    batch_size: int | str = "auto",
    skip_prefix: bool = True,
    progress: Callable[[int], Any] | None = None,
    noise_calibration: str = "subjects_table",
) -> CausalTrace:
    """ROME's causal tracing of one prompt: every (kind, layer, position) restored in turn.

    Args:
        model: the hooked model.
        ids: the prompt's token ids (BOS included when prepended).
        subject_positions: the subject's token positions (noised), e.g. from :func:`subject_span`.
        target_id: the token traced; default the clean run's top-1 (ROME).
        kinds: any of ``resid``, ``mlp``, ``attn`` (:data:`KINDS`).
        window: layers restored together for ``mlp`` / ``attn``, centred as ROME (:func:`window_layers`);
            ``resid`` restores one block output.
        noise: the noise's standard deviation as a multiple of the embedding std sigma of
            ``noise_calibration`` (ROME: 3); ignored when ``noise_std`` is given.
        noise_std: the noise's standard deviation in residual-stream units (overrides ``noise``).
        n_samples: seeded noise draws (ROME: 10), the same for every restoration.
        seed: the noise's seed.
        batch_size: replay rows per batch at most, or ``auto`` (what ``run.memory_budget`` allows).
        skip_prefix: take restorations before the first subject token as the identity (see
            :func:`trace_restorations`).
        progress: called with the number of replay rows finished.
        noise_calibration: what sigma pools (:func:`noise_scale`): ``subjects_table`` (default: the
            shipped capitals table's subjects, the same sigma whatever the prompt) or
            ``row_subjects`` (this prompt's subject tokens).

    Returns:
        :class:`CausalTrace`.

    Raises:
        ConfigError: ``window < 1``, ``n_samples < 1``, a negative noise, an unknown kind, bad subject
            positions, an unknown ``noise_calibration``.
        MethodRefused: no ``hook_mlp_out`` / ``hook_attn_out`` where those kinds are asked for.
        MemoryBudgetError: as :func:`trace_restorations`.
    """
    n_layers = int(model.cfg.n_layers)
    kinds = tuple(kinds)
    window_layers(0, window, n_layers)  # checks window >= 1
    _check_inputs(model, ids, subject_positions, n_samples, kinds)
    if noise_std is None:
        if noise < 0:
            raise ConfigError(f"noise: {noise}; give a non-negative multiple of the embedding std (ROME: 3)")
        noise_std = float(noise) * noise_scale(model, noise_calibration, [ids], [subject_positions]).embedding_std
    if noise_std < 0:
        raise ConfigError(f"noise_std: {noise_std}; give a non-negative standard deviation")
    P = len(ids)
    rests = [Restoration(k, (L,) if k == "resid" else window_layers(L, window, n_layers), (p,))
             for k, L, p in itertools.product(kinds, range(n_layers), range(P))]
    rp = trace_restorations(model, ids, subject_positions, rests, noise_std, target_id, n_samples, seed, batch_size,
                            skip_prefix, progress)
    return CausalTrace(tuple(int(i) for i in ids), str_tokens(model, list(ids)), tuple(int(p) for p in subject_positions),
                       rp.target_id, str_tokens(model, [rp.target_id])[0], kinds, int(window), float(noise_std),
                       int(n_samples), int(seed), rp.p_clean, rp.p_corrupted,
                       rp.p_restored.reshape(len(kinds), n_layers, P, n_samples), rp.replayed.reshape(len(kinds), n_layers, P),
                       rp.batch_size)

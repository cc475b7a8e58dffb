"""Activation extraction for probing: which hooks (:func:`probe_hooks`), read where
(:class:`tracekit.tokens.Position`), in memory or streamed from disk (:class:`Activations`).

Layers are **block indices** ``0 .. n_layers-1`` (docs/glossary.md). A *site* names one hook per
block, with the activation-patching site names: ``resid_pre`` (``blocks.L.hook_resid_pre``, the
block's input), ``resid_mid``, ``resid_post`` (the block's output), ``attn_out``, ``mlp_out``. The
embedding layer -- ``blocks.0.hook_resid_pre`` (site ``resid_pre``, layer 0) -- is always probed,
as the lexical baseline.
"""

from __future__ import annotations

import json
from contextlib import ExitStack, nullcontext
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

import numpy as np
import torch
from jaxtyping import Float

from ..activations.chunking import forward_chunk_size, forward_chunks, forward_row_bytes, row_slice
from ..activations.store import ActivationStore
from ..core.progress import progress_bar
from ..core.sites import BLOCK_HOOKS, SITE_TABLE, check_layers, hook
from ..errors import ProbingError
from ..hooks import check_hooks, hook_layer
from ..model.info import HookedModel
from ..tokens import Batch, Position, chunks, encode, parse_position, run_with_cache, tokenize

__all__ = ["SITES", "EMBEDDING_HOOK", "POSITION_FORMS_PROBING", "probe_hooks", "row_positions",
           "Activations", "extract_activations"]

#: Probe sites (the activation-patching site names) -> their hook template (:mod:`tracekit.core.sites`).
SITES: dict[str, str] = {s: SITE_TABLE[s].template for s in BLOCK_HOOKS}
EMBEDDING_HOOK = hook("resid_pre", 0)
#: Position forms a probe accepts (all of :data:`tracekit.tokens.POSITION_FORMS`).
POSITION_FORMS_PROBING = ("int", "last", "all", "mean", "token:<text>", "field:<column>", "name")


def probe_hooks(n_layers: int, sites: Sequence[str] = ("resid_post",), layers: Optional[Sequence[int]] = None,
                extra_hooks: Sequence[str] = ()) -> list[tuple[str, int, str]]:
    """``(site, layer, hook name)`` triples to probe; ``layer`` is the block index.

    The embedding layer ``("resid_pre", 0, "blocks.0.hook_resid_pre")`` always comes first (the
    lexical baseline). ``layers`` (default all) may count from the end (``-1`` = last block).
    Explicit ``extra_hooks`` get their block index and, as site, the name after ``blocks.L.``
    (``blocks.1.hook_mlp_in`` -> site ``hook_mlp_in``, layer 1; ``blocks.2.mlp.hook_post`` -> site
    ``mlp.hook_post``); a hook outside the blocks (``hook_embed``) is its own site, layer ``-1``.

    Raises:
        ProbingError: an unknown site (``resid`` names its replacements) or a layer out of range.
    """
    for i, s in enumerate(sites):
        if s == "resid":
            raise ProbingError(f"sites[{i}]: 'resid' was renamed to 'resid_post' (the output of block L, "
                               "the old layer L+1; or 'resid_pre', the input of block L); sites are "
                               f"{list(SITES)}")
        if s not in SITES:
            raise ProbingError(f"sites[{i}]: unknown site {s!r}; use {list(SITES)} (or list hook names under "
                               "'hooks')")
    want = check_layers(n_layers, None if layers is None else [int(L) for L in layers], "layers")
    out: list[tuple[str, int, str]] = [("resid_pre", 0, EMBEDDING_HOOK)]
    for s in sites:
        out += [(s, L, hook(s, L)) for L in want]
    for h in extra_hooks:
        b = hook_layer(h)
        out.append((h, -1, h) if b is None else (h.split(".", 2)[2], b, h))
    seen, uniq = set(), []
    for t in out:
        if t[2] not in seen:
            seen.add(t[2])
            uniq.append(t)
    return uniq


def row_positions(model: HookedModel, texts: Sequence[str], ids: Sequence[Sequence[int]], position: Position | int | str,
                  fields: Optional[Sequence[str]] = None, field: str = "position") -> list[list[int]]:
    """Per row, the unpadded token positions to read (``mean`` averages over them), through
    :meth:`tracekit.tokens.Position.resolve` (``all``/``mean`` skip a prepended BOS).

    Raises:
        TokenizationError: a position that does not resolve in a row (the message names the row).
        ProbingError: ``field:<column>`` without the column's values.
    """
    pos = position if isinstance(position, Position) else parse_position(position, POSITION_FORMS_PROBING, field)
    if pos.kind == "field" and fields is None:
        raise ProbingError(f"{field}: {pos} needs the rows' {pos.text!r} values (pass fields=...)")
    if pos.kind == "name":  # a dataset's named position: its per-row index is in ``fields``
        if fields is None:
            raise ProbingError(f"{field}: {pos} is a named position; it needs a dataset whose rows name it "
                               "(dataset: {generator: ...} or {rows: [...positions...]})")
        return [[int(v)] for v in fields]
    out = []
    for i, (t, seq) in enumerate(zip(texts, ids)):
        fv = fields[i] if (pos.kind == "field" and fields is not None) else None
        out.append(pos.resolve(model, t, seq, f"{field} (row {i})", field_value=fv))
    return out


class Activations:
    """Extracted activations: per hook, a ``[n_examples, d]`` float32 matrix, in memory or on disk.

    On disk (``directory`` set) the matrices are split into safetensors chunk files
    (``chunk_00000.safetensors``, ...), each holding every hook for a run of examples; :meth:`get`
    reads one hook's slices chunk by chunk, so memory holds one hook at a time, never all layers.
    A temporary directory (spilled above ``max_memory_mb``) is a :func:`tracekit.scratch.scratch_dir`
    folder: :meth:`cleanup` (or leaving a ``with`` block on the object) removes it, and so do
    interpreter exit and SIGTERM.

    Attributes:
        hooks: hook names.
        rows: ``[n_examples]`` dataset row of each example.
        positions: ``[n_examples]`` token position read (BOS included in the count; ``-1`` = mean).
        directory: chunk directory, or None when in memory.
    """

    def __init__(self, hooks: list[str], rows: np.ndarray, positions: np.ndarray,
                 tensors: Optional[dict[str, torch.Tensor]] = None, directory: Optional[Path] = None,
                 files: Optional[list[str]] = None, scratch=None):
        self.hooks = list(hooks)
        self.rows = np.asarray(rows, dtype=np.int64)
        self.positions = np.asarray(positions, dtype=np.int64)
        self._tensors = tensors
        self.directory = Path(directory) if directory is not None else None
        self.files = list(files or [])
        self._scratch = scratch

    def __len__(self) -> int:
        return len(self.rows)

    def __enter__(self) -> "Activations":
        return self

    def __exit__(self, *exc) -> None:
        self.cleanup()

    @property
    def on_disk(self) -> bool:
        return self.directory is not None

    @property
    def temporary(self) -> bool:
        return self._scratch is not None

    def iter_chunks(self, hook: str) -> Iterator[Float[torch.Tensor, "chunk d"]]:
        """Yield one hook's activations chunk by chunk (a single chunk when in memory).

        Raises:
            ProbingError: the hook was not extracted.
        """
        if hook not in self.hooks:
            raise ProbingError(f"hook {hook!r} was not extracted; have {self.hooks}")
        if self._tensors is not None:
            yield self._tensors[hook]
            return
        from safetensors import safe_open

        assert self.directory is not None, "activations not in memory are in a chunk directory"
        for f in self.files:
            with safe_open(str(self.directory / f), framework="pt") as h:
                yield h.get_tensor(hook)

    def get(self, hook: str) -> Float[torch.Tensor, "n d"]:
        """One hook's ``[n_examples, d]`` matrix (float32, CPU)."""
        parts = list(self.iter_chunks(hook))
        return parts[0] if len(parts) == 1 else torch.cat(parts, 0)

    @classmethod
    def from_store(cls, store: ActivationStore, hooks: Sequence[str], store_rows: Optional[np.ndarray] = None
                   ) -> "Activations":
        """Read ``hooks`` from an activation store (:class:`tracekit.activations.ActivationStore`)
        instead of running the model; memory holds one hook at a time, as from a chunk directory.

        Args:
            store: the opened store.
            hooks: the hooks to read.
            store_rows: ``[n_rows]`` the store row of each of this extraction's rows
                (:meth:`~tracekit.activations.ActivationStore.match_rows`); default: every stored row,
                in store order.

        Raises:
            StoreError: a hook the store does not hold.
        """
        store.require_hooks(hooks)
        rows, positions = store.rows, store.positions
        if store_rows is None:
            return cls(list(hooks), rows, positions, None, store.path, store.files)
        by_row: dict[int, np.ndarray] = {}
        order = np.argsort(rows, kind="stable")
        starts = np.searchsorted(rows[order], np.arange(int(rows.max(initial=-1)) + 2))
        examples = []
        for r in store_rows:
            r = int(r)
            if r not in by_row:
                by_row[r] = order[starts[r]:starts[r + 1]]
            examples.append(by_row[r])
        ex = np.concatenate(examples) if examples else np.zeros(0, dtype=np.int64)
        new_rows = np.concatenate([np.full(len(e), i, dtype=np.int64) for i, e in enumerate(examples)]) \
            if examples else np.zeros(0, dtype=np.int64)
        return _StoreSelection(store, list(hooks), new_rows, positions[ex], ex)

    @classmethod
    def load(cls, directory: str | Path) -> "Activations":
        """Open a chunk directory written by :func:`extract_activations` (``cache_dir=``)."""
        d = Path(directory)
        meta = json.loads((d / "index.json").read_text())
        return cls(meta["hooks"], np.array(meta["rows"]), np.array(meta["positions"]), None, d, meta["files"])

    def cleanup(self) -> None:
        """Delete a temporary chunk directory (no-op otherwise)."""
        if self._scratch is not None:
            self._scratch.remove()


class _StoreSelection(Activations):
    """Some examples of an activation store, in a given order (:meth:`Activations.from_store`)."""

    def __init__(self, store: ActivationStore, hooks: list[str], rows: np.ndarray, positions: np.ndarray,
                 examples: np.ndarray):
        super().__init__(hooks, rows, positions, None, store.path, store.files)
        self._store = store
        self._examples = torch.as_tensor(examples, dtype=torch.long)

    def iter_chunks(self, hook: str) -> Iterator[Float[torch.Tensor, "chunk d"]]:
        if hook not in self.hooks:
            raise ProbingError(f"hook {hook!r} was not extracted; have {self.hooks}")
        yield self._store.get(hook)[self._examples]


class _ChunkWriter:
    def __init__(self, directory: Path, hooks: list[str], chunk_examples: int):
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self.hooks = hooks
        self.chunk_examples = max(1, chunk_examples)
        self.buf: dict[str, list[torch.Tensor]] = {h: [] for h in hooks}
        self.n_buf = 0
        self.files: list[str] = []

    def add(self, parts: dict[str, torch.Tensor]) -> None:
        for h in self.hooks:
            self.buf[h].append(parts[h])
        self.n_buf += int(next(iter(parts.values())).shape[0])
        if self.n_buf >= self.chunk_examples:
            self.flush()

    def flush(self) -> None:
        if self.n_buf == 0:
            return
        from safetensors.torch import save_file

        name = f"chunk_{len(self.files):05d}.safetensors"
        save_file({h: torch.cat(v, 0).contiguous() for h, v in self.buf.items()}, str(self.dir / name))
        self.files.append(name)
        self.buf = {h: [] for h in self.hooks}
        self.n_buf = 0


@torch.no_grad()
def extract_activations(
    model: HookedModel,
    texts: Sequence[str],
    hooks: Sequence[str],
    position: Position | int | str = "last",
    batch_size: int = 16,
    fields: Optional[Sequence[str]] = None,
    fwd_hooks: Optional[list[tuple[str, Callable]]] = None,
    cache_dir: Optional[str | Path] = None,
    max_memory_mb: float = 1024.0,
    chunk_mb: float = 256.0,
    progress: bool = False,
) -> Activations:
    """Activations of ``hooks`` at ``position`` for every text, one batched forward pass per batch.

    Each batch is tokenized and padded by :func:`tracekit.tokens.tokenize` (the model spec's BOS and
    padding side; the attention mask makes padded prompts equal one-by-one runs), and run once with
    only ``hooks`` cached (:func:`tracekit.tokens.run_with_cache`, which switches on TransformerLens'
    gated hooks such as ``hook_mlp_in`` / ``attn.hook_result`` for the call).

    Args:
        model: a hooked model (TransformerBridge).
        texts: the prompts, ``n_rows`` of them.
        hooks: TransformerLens hook names (e.g. from :func:`probe_hooks`).
        position: a :class:`tracekit.tokens.Position` or its spec: an int, ``last``, ``mean``, ``all``,
            ``token:<text>``, ``field:<column>``. ``mean``/``all`` skip a prepended BOS.
        batch_size: prompts per forward pass.
        fields: per-row strings for ``field:<column>`` (the column's values).
        fwd_hooks: extra ``(hook name, fn)`` forward hooks active during extraction (interventions,
            planted signals); removed on exit whatever happens.
        cache_dir: write chunks here (and keep them); default: memory, or a scratch folder
            (:func:`tracekit.scratch.scratch_dir`, removed by :meth:`Activations.cleanup`, on any
            exception incl. Ctrl-C, at exit and on SIGTERM) when the estimate exceeds ``max_memory_mb``.
        max_memory_mb: in-memory budget (MiB) for the whole extraction before spilling to disk.
        chunk_mb: target size (MiB) of one chunk file.

    Returns:
        :class:`Activations` with ``n_examples`` = ``n_rows`` (``all``: the number of read tokens).
        Values are float32 ``[n_examples, d]`` per hook (head-resolved hooks flattened).

    Memory budget (``run.memory_budget``): each batch of ``batch_size`` prompts runs in chunks of
    prompts the budget allows (padded to the batch's width: the values do not depend on it). The
    estimate per prompt: its forward pass with logits
    (:func:`tracekit.activations.chunking.forward_row_bytes`) plus the cached hooks
    (``[pos, d]`` each). What is kept (in memory up to ``max_memory_mb``, else on disk) is the result.

    Raises:
        HookError: an unknown hook (or one that never fires).
        TokenizationError: a bad position spec, a ``token:``/``field:`` string missing from a prompt,
            a prompt longer than the context.
        ProbingError: no texts.
        MemoryBudgetError: one prompt does not fit the memory budget, before its forward pass.
    """
    # Long (reason): a context manager whose setup, batched reads and cleanup (scratch folder, hooks) must stay in one frame.
    from ..scratch import scratch_dir

    hooks = list(dict.fromkeys(hooks))
    check_hooks(model, hooks, "hooks")
    texts = list(texts)
    if not texts:
        raise ProbingError("texts: need at least one prompt")
    pos = position if isinstance(position, Position) else parse_position(position, POSITION_FORMS_PROBING)
    ids_all = [encode(model, t) for t in texts]
    pos_all = row_positions(model, texts, ids_all, pos, fields)
    kind = pos.kind
    n_examples = sum(len(p) for p in pos_all) if kind == "all" else len(texts)
    dims = _hook_dims(model, hooks)
    total_mb = n_examples * sum(dims.values()) * 4 / 2 ** 20
    with ExitStack() as stack:
        scratch = None
        if cache_dir is None and total_mb > max_memory_mb:
            scratch = stack.enter_context(scratch_dir("tracekit-acts-"))
            cache_dir = scratch.path
        writer = None
        if cache_dir is not None:
            per_ex = max(1, sum(dims.values()) * 4)
            writer = _ChunkWriter(Path(cache_dir), hooks, int(chunk_mb * 2 ** 20 // per_ex))
        mem: dict[str, list[torch.Tensor]] = {h: [] for h in hooks}
        rows: list[int] = []
        positions: list[int] = []
        stack.enter_context(model.hooks(fwd_hooks=fwd_hooks) if fwd_hooks else nullcontext())
        bar = stack.enter_context(progress_bar(total=len(texts), desc="activations", unit="row", enabled=progress))
        for sl in chunks(len(texts), batch_size):
            batch = tokenize(model, texts[sl])
            for b in range(batch.size):
                r = sl.start + b
                ps = pos_all[r]
                if kind == "all":
                    rows += [r] * len(ps)
                    positions += ps
                else:
                    rows.append(r)
                    positions.append(-1 if kind == "mean" else ps[0])
            T = int(batch.tokens.shape[1])
            per_row = forward_row_bytes(model, T) + 4 * T * sum(dims.values())  # + the cached hooks
            step = forward_chunk_size(model, batch.size, per_row, what="probing extraction",
                                      fix="shorten the prompts or probe fewer layers / sites")
            got: dict[int, dict[str, torch.Tensor]] = {}

            def run(sub: slice, batch=batch, first=sl.start, got=got) -> None:
                got[sub.start] = _read_rows(model, row_slice(batch, sub), hooks, pos_all[first + sub.start:
                                                                                            first + sub.stop], kind)

            forward_chunks(run, batch.size, step, "probing extraction")
            parts = {h: torch.cat([got[k][h] for k in sorted(got)], 0) for h in hooks}
            if writer is not None:
                writer.add(parts)
            else:
                for h in hooks:
                    mem[h].append(parts[h])
            bar.update(batch.size)
        if writer is not None:
            writer.flush()
            (writer.dir / "index.json").write_text(json.dumps(
                {"hooks": hooks, "rows": rows, "positions": positions, "files": writer.files,
                 "position": str(pos)}))
            if scratch is not None:
                scratch.detach()  # the Activations owns it now (cleanup(); atexit/SIGTERM still cover it)
            return Activations(hooks, np.array(rows), np.array(positions), None, writer.dir, writer.files,
                               scratch=scratch)
        return Activations(hooks, np.array(rows), np.array(positions), {h: torch.cat(v, 0) for h, v in mem.items()})


def _read_rows(model: HookedModel, batch: Batch, hooks: Sequence[str], pos: Sequence[Sequence[int]], kind: str
               ) -> dict[str, torch.Tensor]:
    """One forward pass of ``batch`` (rows with read positions ``pos``, BOS counted): per hook,
    ``[n_examples, d]`` float32 on the CPU (``mean``: one example per row)."""
    _, cache = run_with_cache(model, batch, hooks)
    offs = batch.offsets
    b_idx, p_idx, seg = [], [], []  # gather indices; seg groups tokens for 'mean'
    for b in range(batch.size):
        ps = pos[b]
        for p in ps:
            b_idx.append(b)
            p_idx.append(offs[b] + p)
        if kind == "all":
            seg += list(range(len(seg), len(seg) + len(ps)))
        else:
            seg += [b] * len(ps)
    bi = torch.tensor(b_idx, device=batch.tokens.device)
    pi = torch.tensor(p_idx, device=batch.tokens.device)
    parts = {}
    for h in hooks:
        a = cache[h][bi, pi].float()
        if kind == "mean":
            sg = torch.tensor(seg, device=a.device)
            s = torch.zeros(batch.size, *a.shape[1:], device=a.device).index_add_(0, sg, a)
            cnt = torch.bincount(sg, minlength=batch.size).clamp(min=1).float()
            a = s / cnt.reshape(-1, *([1] * (a.ndim - 1)))
        parts[h] = a.reshape(a.shape[0], -1).cpu()
    del cache
    return parts


def _hook_dims(model: HookedModel, hooks: Sequence[str]) -> dict[str, int]:
    """Width of each hook's activation (per position), for memory estimates; d_model by default."""
    cfg = model.cfg
    out = {}
    for h in hooks:
        if h.endswith(("attn.hook_result", "hook_attn_in", "hook_q_input", "hook_k_input", "hook_v_input")):
            out[h] = cfg.n_heads * cfg.d_model
        elif h.endswith(("hook_z", "hook_q", "hook_k", "hook_v")):
            out[h] = cfg.n_heads * cfg.d_head
        elif h.endswith(("hook_pattern", "hook_attn_scores")):
            out[h] = cfg.n_heads * int(getattr(cfg, "n_ctx", 1024) or 1024)
        elif ".mlp.hook_" in h:
            out[h] = getattr(cfg, "d_mlp", None) or 4 * cfg.d_model
        else:
            out[h] = cfg.d_model
    return out

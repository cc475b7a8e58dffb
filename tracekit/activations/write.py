"""Writing an activation store: rows x hooks x positions as sharded safetensors, resumable.

Rows (:class:`StoreRow`: token ids and the positions read in them) are streamed in batches of
``batch_size`` rows; each batch is run once with forward hooks that keep only the read positions
(the forward pass stops once every hook has fired, when all are block hooks). Examples accumulate
until a shard holds about ``shard_mb`` MiB, then the shard is written **atomically** (a temporary
sibling renamed into place) and the manifest is rewritten atomically with the shard's record (file,
examples, rows, bytes, sha256, and the sha256 of the rows' token ids). Memory is bounded by one
shard plus one batch, whatever the number of rows.

Resuming: shards close at batch boundaries fixed by the rows, ``batch_size`` and the hook widths,
so a rerun of the same write into the same folder (same model, rows, hooks, position, dtype,
batch size and shard size: the manifest's ``plan_key``) skips every shard the manifest lists
(checked by size and by its rows' token ids), rewrites the rest and produces the same store,
byte for byte, as an uninterrupted write. The manifest's ``complete`` flag turns true last.

One writer at a time: a writer holds the folder's ``.write.lock`` (:mod:`tracekit.core.locks`, as
sweeps lock their folder) for the whole write; a second writer waits for it (saying whom it waits
for), then resumes, or finds the store complete and returns without touching it. A writer that
would change a complete store (``overwrite``, or a damaged shard to rewrite) also takes the
readers' lock exclusively and is refused while an :class:`~tracekit.activations.ActivationStore`
has the store open, so a run reading a complete store is never disturbed.

A failed write (disk full, a file-size limit, a read-only disk, no permission, a file in the way)
is an :class:`~tracekit.core.errors.OutputError` naming the store and the fix; the shard being
written is a temporary file that is removed, so the manifest lists exactly the finished shards and
a rerun resumes from them.

Conventions from SAELens' ``CacheActivationsRunner`` (one tensor per hook named by the hook, the
token ids beside them, shards of bounded size) and tracekit's caches (atomic files, a manifest with
sizes and sha256).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional, Sequence

import torch

from ..core.io import atomic_write, file_sha256, jsonable, write_errors, write_json
from ..core.locks import acquire, holder_pid, release
from ..hooks import check_hooks, enabled_hooks, fwd_hooks
from ..model.info import HookedModel
from ..tokens import Batch, forward_kwargs, pad_rows
from .chunking import F32, forward_chunk_size, forward_chunks, forward_row_bytes, row_slice
from .store import (
    FORMAT,
    MANIFEST,
    READ_LOCK,
    WRITE_LOCK,
    StoreError,
    model_identity,
    row_key,
    shard_name,
    token_ids_sha256,
)

__all__ = ["StoreRow", "write_store", "rows_sha256", "DTYPES"]

log = logging.getLogger("tracekit.activations")

#: Store dtypes: ``model`` keeps the model's activation dtype.
DTYPES = {"model": None, "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class StoreRow:
    """One input row of a store.

    Attributes:
        row_id: its id in the source (a dataset's ``row_id``, a corpus window index).
        ids: token ids fed to the model (BOS included when the model prepends one).
        read: the token indices read (into ``ids``, BOS counted).
        mean: store the mean over ``read`` as one example (position ``-1``) instead of each.
        doc_id: the corpus document the row was cut from (corpus windows only; recorded in the
            manifest's ``row_docs`` so that a tuned lens can split a store by document).
    """

    row_id: int
    ids: tuple[int, ...]
    read: tuple[int, ...]
    mean: bool = False
    doc_id: Optional[str] = None


class _AllRead(Exception):
    """Raised by the last hook to fire, to end the forward pass early."""


@torch.no_grad()
def _read_batch(model: HookedModel, batch: Batch, rows: Sequence[StoreRow], hooks: Sequence[str], dtype: Optional[torch.dtype]
                ) -> dict[str, torch.Tensor]:
    """Per hook, ``[n_examples of these rows, d]`` at the rows' read positions (``mean`` rows
    averaged in float32), on the CPU in ``dtype`` (None: the activation's own)."""
    b_idx, p_idx = [], []
    for b, (r, off) in enumerate(zip(rows, batch.offsets)):
        b_idx += [b] * len(r.read)
        p_idx += [off + p for p in r.read]
    n_ex = sum(1 if r.mean else len(r.read) for r in rows)
    seg_t = torch.tensor(_segments(rows), device=batch.tokens.device)
    bi = torch.tensor(b_idx, device=batch.tokens.device)
    pi = torch.tensor(p_idx, device=batch.tokens.device)
    got: dict[str, torch.Tensor] = {}
    stop = all(h.startswith("blocks.") for h in hooks)

    def make(name: str) -> Callable:
        def hook(act, hook=None):
            got[name] = act[bi, pi].detach().clone()
            if stop and len(got) == len(hooks):
                raise _AllRead

        return hook

    with enabled_hooks(model, hooks), fwd_hooks(model, [(h, make(h)) for h in hooks]):
        try:
            model(batch.tokens, **forward_kwargs(batch))
        except _AllRead:
            pass
    out = {}
    any_mean = any(r.mean for r in rows)
    for h in hooks:
        if h not in got:
            raise StoreError(f"hooks: {h!r} never fired in the forward pass")
        a = got[h]
        if any_mean:
            s = torch.zeros(n_ex, *a.shape[1:], device=a.device).index_add_(0, seg_t, a.float())
            cnt = torch.bincount(seg_t, minlength=n_ex).clamp(min=1).float()
            a = s / cnt.reshape(-1, *([1] * (a.ndim - 1)))
        a = a.reshape(a.shape[0], -1)
        out[h] = (a if dtype is None else a.to(dtype)).cpu().contiguous()
    return out


def _read_chunked(model: HookedModel, group: list[StoreRow], hooks: Sequence[str], dtype: Optional[torch.dtype]
                  ) -> dict[str, torch.Tensor]:
    """:func:`_read_batch` of one write batch (``batch_size`` rows, padded together) under the memory
    budget: its rows in chunks of the size the budget allows (each chunk padded to the batch's
    width: :func:`tracekit.activations.chunking.row_slice`), so the examples equal the unchunked
    pass's byte for byte and the shards, their boundaries and the plan do not depend on the budget.

    The estimate per row: the forward pass (:func:`~tracekit.activations.chunking.forward_row_bytes`;
    no logits when every hook is a block hook, as the pass stops after the last one) plus the read
    examples twice (the gathered copy and its dtype cast). The shard being filled (``shard_mb``) is
    the store's output, bounded by ``shard_mb``, and not counted.

    Raises:
        MemoryBudgetError: one row does not fit the budget (before its forward pass).
    """
    batch = pad_rows(model, [list(r.ids) for r in group], "rows")
    width = int(batch.tokens.shape[1])
    stop = all(h.startswith("blocks.") for h in hooks)
    n_read = max(len(r.read) for r in group)
    hook_elems = sum(int(model.cfg.d_model) if h.endswith(("resid_pre", "resid_mid", "resid_post")) else
                     max(int(model.cfg.d_model), int(getattr(model.cfg, "d_mlp", 0) or 0)) for h in hooks)
    per_row = forward_row_bytes(model, width, logits=not stop) + 2 * F32 * n_read * hook_elems
    chunk = forward_chunk_size(model, len(group), per_row, what="activation store write",
                               fix="shorten the rows (prompts, corpus.seq_len) or store fewer hooks")
    if chunk >= len(group):
        return _read_batch(model, batch, group, hooks, dtype)
    parts: dict[int, dict[str, torch.Tensor]] = {}

    def run(sl: slice) -> None:
        parts[sl.start] = _read_batch(model, row_slice(batch, sl), group[sl], hooks, dtype)

    forward_chunks(run, len(group), chunk, "activation store write")
    got = [parts[k] for k in sorted(parts)]
    return {h: torch.cat([p[h] for p in got], 0) for h in hooks}


def _segments(rows: Sequence[StoreRow]) -> list[int]:
    """For each read position of ``rows``, the index of the example it goes to."""
    seg, n = [], 0
    for r in rows:
        if r.mean:
            seg += [n] * len(r.read)
            n += 1
        else:
            seg += list(range(n, n + len(r.read)))
            n += len(r.read)
    return seg


def _meta_tensors(rows: Sequence[StoreRow], first_row: int) -> dict[str, torch.Tensor]:
    r_idx, pos, tok = [], [], []
    for i, r in enumerate(rows):
        if r.mean:
            r_idx.append(first_row + i)
            pos.append(-1)
            tok.append(-1)
        else:
            r_idx += [first_row + i] * len(r.read)
            pos += list(r.read)
            tok += [r.ids[p] for p in r.read]
    return {"rows": torch.tensor(r_idx, dtype=torch.int64), "positions": torch.tensor(pos, dtype=torch.int64),
            "token_ids": torch.tensor(tok, dtype=torch.int64)}


_OS_ERROR = re.compile(r"\(os error (\d+)\)")


def _write_shard(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Write one shard atomically (a temporary sibling renamed into place; removed on failure).

    Raises:
        OSError: the write failed (safetensors reports an I/O failure as ``SafetensorError``
            ``... (os error N)``; it is raised as the ``OSError`` N it names, on the temporary file).
    """
    from safetensors.torch import save_file  # lazy: only writers need it

    def save(tmp: Path) -> None:
        try:
            save_file(tensors, str(tmp))
        except OSError:
            raise
        except Exception as e:  # noqa: BLE001 - safetensors' Rust errors carry the errno in their text
            m = _OS_ERROR.search(str(e))
            if m is None:
                raise
            n = int(m.group(1))
            raise OSError(n, os.strerror(n), str(tmp)) from e

    atomic_write(path, save)


def _plan_key(ident: dict, hooks: Sequence[str], position: str, dtype: str, batch_size: int, shard_mb: float,
              source: dict) -> str:
    blob = {"format": FORMAT, "model": ident, "hooks": list(hooks), "position": position, "dtype": dtype,
            "batch_size": int(batch_size), "shard_mb": float(shard_mb), "source": source}
    return hashlib.sha256(json.dumps(jsonable(blob), sort_keys=True).encode()).hexdigest()[:16]


_TMP = re.compile(r"^\..*\.tmp-(\d+)-[0-9a-f]{8}$")


@contextlib.contextmanager
def _writer(path: Path, field: str) -> Iterator[contextlib.ExitStack]:
    """Hold ``path``'s writer lock for the block (waiting for another writer first, with a log
    line naming it); yields an exit stack for the readers' lock (:func:`_lock_out_readers`)."""
    def waiting() -> None:
        pid = holder_pid(path / WRITE_LOCK)
        log.warning("%s: another process%s is writing the activation store at %s; waiting for it to finish "
                    "(Ctrl-C to stop)", field, "" if pid is None else f" (pid {pid})", path)

    lock = acquire(path / WRITE_LOCK, wait=True, on_wait=waiting)
    try:
        with contextlib.ExitStack() as held:
            (path / READ_LOCK).touch(exist_ok=True)
            yield held
    finally:
        release(lock)


def _lock_out_readers(path: Path, field: str, held: contextlib.ExitStack, why: str) -> None:
    """Take the readers' lock exclusively until the write ends (no reader can open the store while
    it changes).

    Raises:
        StoreError: an open :class:`~tracekit.activations.ActivationStore` (in this or another
            process) is reading the complete store.
    """
    lock = acquire(path / READ_LOCK)
    if lock is None:
        raise StoreError(f"{field}: the complete store at {path} is being read (an open ActivationStore: a run's step "
                         f"reading it, in this or another process); {why} would change it under the reader: wait "
                         "for the reader to finish, then rerun, or write to another path")
    held.callback(release, lock)


def _prepare_folder(path: Path, key: str, overwrite: bool, field: str, held: contextlib.ExitStack) -> Optional[dict]:
    """The manifest to resume from, or the complete one found (None: start afresh); refuses a
    folder holding something else, and an overwrite of a complete store that is being read."""
    for f in path.iterdir():  # leftovers of a killed writer's atomic writes
        m = _TMP.match(f.name)
        if m and f.is_file() and not _pid_alive(int(m.group(1))):
            f.unlink(missing_ok=True)
    man = path / MANIFEST
    if man.is_file():
        try:
            old = json.loads(man.read_text())
        except (OSError, json.JSONDecodeError):
            old = {}
        if old.get("format") == FORMAT and old.get("plan_key") == key and not overwrite:  # resume or up to date
            return old
        if not overwrite:
            raise StoreError(f"{field}: {path} holds another activation store (model, rows, hooks, position, dtype, "
                             f"batch_size or shard_mb differ: plan {old.get('plan_key')} vs {key}); choose another "
                             "path or set overwrite: true to replace it")
        if old.get("complete"):
            _lock_out_readers(path, field, held, "overwrite: true")
    elif any(not f.name.startswith(".") for f in path.iterdir()) and not overwrite:
        raise StoreError(f"{field}: {path} is not empty and holds no activation store; choose an empty or new folder "
                         "(or overwrite: true to clear it)")
    if overwrite:
        for f in path.iterdir():
            if f.is_file() and (f.name == MANIFEST or f.name.startswith("shard-")):
                f.unlink()
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _batches(rows: Iterable[StoreRow], size: int) -> Iterator[list[StoreRow]]:
    buf: list[StoreRow] = []
    for r in rows:
        buf.append(r)
        if len(buf) >= size:
            yield buf
            buf = []
    if buf:
        yield buf


def _shard_ok(path: Path, rec: dict) -> bool:
    """A recorded shard is on disk with its recorded size and sha256."""
    f = path / rec["file"]
    return f.is_file() and f.stat().st_size == rec["bytes"] and file_sha256(f) == rec["sha256"]


def write_store(model: HookedModel, rows: Iterable[StoreRow], hooks: Sequence[str], path: str | Path, *, position: str,
                source: dict, dtype: str = "model", batch_size: int = 16, shard_mb: float = 256.0,
                overwrite: bool = False, progress: bool = False, field: str = "path") -> dict:
    """Write (or resume, or find up to date) an activation store of ``hooks`` at ``rows``' read positions.

    One writer at a time: another writer of the same folder is waited for (module docstring).

    Args:
        model: a hooked model (TransformerBridge).
        rows: the input rows, streamed (:func:`tracekit.activations.dataset_rows`, ``corpus_rows``);
            must be the same sequence on a resume.
        hooks: TransformerLens hook names (gated hooks are switched on for the write).
        path: the store folder (created; a store of another plan there is refused).
        position: the position spec the rows were read at (recorded; readers compare it).
        source: a JSON-able description of where the rows came from (recorded, part of the plan).
        dtype: ``model`` (the activations' own dtype), ``float32``, ``float16`` or ``bfloat16``.
        batch_size: rows per forward pass.
        shard_mb: target shard size in MiB (a shard closes at the first batch boundary past it).
        overwrite: delete what is at ``path`` (a store of any plan, complete or not) and write
            afresh; off, a store of another plan there is refused and the same plan resumes. A
            complete store is overwritten only while no :class:`~tracekit.activations.ActivationStore`
            has it open.
        progress: show a progress bar (rows).
        field: the config field quoted in errors about ``path``.

    Returns:
        ``{"path", "n_rows", "n_examples", "n_shards", "shards_written", "shards_reused", "bytes",
        "seconds", "up_to_date"}``.

    Raises:
        StoreError: ``path`` holds another store or other files; no rows; a hook that never fires;
            an overwrite or repair of a complete store that an open ActivationStore is reading.
        OutputError: a write failed (disk full, file-size limit, read-only disk, no permission, a
            file in the way), naming the path and the fix; the finished shards are kept and listed.
        HookError: an unknown hook.
    """
    t0 = time.time()
    hooks = list(dict.fromkeys(hooks))
    check_hooks(model, hooks, "hooks")
    if dtype not in DTYPES:
        raise StoreError(f"dtype: {dtype!r}; use one of {list(DTYPES)}")
    path = Path(path).expanduser()
    ident = model_identity(model)
    key = _plan_key(ident, hooks, position, dtype, batch_size, shard_mb, source)
    fix = ("the shards finished before are kept (the manifest lists them): rerun the same step or `tracekit "
           "cache-activations` to resume")
    with write_errors(path, field, fix, {errno.EFBIG: f"or a smaller shard_mb (now {shard_mb:g} MiB)"}):
        path.mkdir(parents=True, exist_ok=True)
        with _writer(path, field) as held:
            old = _prepare_folder(path, key, overwrite, field, held)
            if old is not None and old.get("complete"):
                if all(_shard_ok(path, s) for s in old["shards"]):  # up to date: nothing is touched
                    return _summary(old, path, 0, len(old["shards"]), time.time() - t0, True)
                _lock_out_readers(path, field, held, "repairing its damaged shard")
                old["complete"] = False  # a damaged shard: resume (the shards before it kept, it and the rest rewritten)
            return _write_shards(model, rows, hooks, path, old, key, ident, position=position, source=source,
                                 dtype=dtype, batch_size=batch_size, shard_mb=shard_mb, progress=progress, field=field,
                                 t0=t0)


def _write_shards(model: HookedModel, rows: Iterable[StoreRow], hooks: list[str], path: Path, old: Optional[dict], key: str,
                  ident: dict, *, position: str, source: dict, dtype: str, batch_size: int, shard_mb: float,
                  progress: bool, field: str, t0: float) -> dict:
    """:func:`write_store`'s write proper (the folder prepared and locked): resume from ``old``'s
    shards, write the rest, mark the manifest complete; returns the summary."""
    # Long (reason): one loop keeps the shard buffer, the manifest and the resume bookkeeping in one frame.
    done = list(old["shards"]) if old else []
    man = {"format": FORMAT, "version": 1, "complete": False, "plan_key": key, "model": ident, "hooks": hooks,
           "dtype": (old or {}).get("dtype"), "position": position, "source": source,
           "batch_size": int(batch_size), "shard_mb": float(shard_mb),
           "shapes": (old or {}).get("shapes"), "shard_examples": (old or {}).get("shard_examples"), "shards": done}
    write_json(path / MANIFEST, man)
    from ..core.progress import progress_bar

    bar = progress_bar(desc="activations", unit="row", enabled=progress)
    all_ids: list[tuple[int, ...]] = []
    row_ids: list[int] = []
    row_keys: list[str] = []
    row_docs: list[Optional[str]] = []
    shards: list[dict] = []
    buf: dict[str, list[torch.Tensor]] = {h: [] for h in hooks}
    buf_rows: list[StoreRow] = []
    counts = {"written": 0, "examples": 0}
    store_dtype = DTYPES[dtype]

    def compute(group: list[StoreRow]) -> None:
        parts = _read_chunked(model, group, hooks, store_dtype)
        if man["shapes"] is None:
            man["shapes"] = {h: [int(parts[h].shape[1])] for h in hooks}
            per_ex = sum(int(t.shape[1]) * t.element_size() for t in parts.values())
            man["shard_examples"] = max(1, int(shard_mb * 2 ** 20 // max(1, per_ex)))
            man["dtype"] = str(parts[hooks[0]].dtype).replace("torch.", "")
        for h in hooks:
            buf[h].append(parts[h])

    def flush() -> None:
        k = len(shards)
        first = len(row_ids) - len(buf_rows)
        inputs_sha = rows_sha256(buf_rows)
        meta = _meta_tensors(buf_rows, first)
        if k < len(done):  # recorded by the interrupted write: reuse it if intact, else write it again
            if done[k]["rows"] != [first, len(row_ids)] or done[k].get("inputs_sha256") != inputs_sha:
                raise StoreError(f"{field}: the rows differ from those the unfinished store at {path} was started with "
                                 f"(shard {k}); the dataset or corpus changed: set overwrite: true to write it again")
            if _shard_ok(path, done[k]):
                shards.append(done[k])
                counts["examples"] += done[k]["n_examples"]
                buf_rows.clear()
                return
            del done[k:]
            for s in range(0, len(buf_rows), batch_size):
                compute(buf_rows[s:s + batch_size])
        f = path / shard_name(k)
        _write_shard(f, {h: torch.cat(buf[h], 0) for h in hooks} | meta)
        rec = {"file": f.name, "n_examples": int(meta["rows"].shape[0]), "rows": [first, len(row_ids)],
               "bytes": f.stat().st_size, "sha256": file_sha256(f, memo=False), "inputs_sha256": inputs_sha}
        shards.append(rec)
        man["shards"] = list(shards)
        write_json(path / MANIFEST, man)
        counts["written"] += 1
        counts["examples"] += rec["n_examples"]
        for h in hooks:
            buf[h].clear()
        buf_rows.clear()

    try:
        for group in _batches(rows, batch_size):
            all_ids += [r.ids for r in group]
            row_ids += [int(r.row_id) for r in group]
            row_keys += [row_key(r.ids, r.read, r.mean) for r in group]
            row_docs += [r.doc_id for r in group]
            buf_rows.extend(group)
            k = len(shards)
            if k < len(done):
                if len(row_ids) >= done[k]["rows"][1]:
                    flush()
            else:
                compute(group)
                if sum(1 if r.mean else len(r.read) for r in buf_rows) >= man["shard_examples"]:
                    flush()
            bar.update(len(group))
        if buf_rows or len(shards) < len(done):
            flush()
    finally:
        bar.close()
    if not row_ids:
        raise StoreError("rows: nothing to store (no rows); give a dataset, prompts or a corpus with text")
    man.update({"complete": True, "shards": shards, "n_rows": len(row_ids), "n_examples": counts["examples"],
                "row_ids": row_ids, "row_keys": row_keys, "token_ids_sha256": token_ids_sha256(all_ids),
                "bytes": sum(s["bytes"] for s in shards)})
    if any(d is not None for d in row_docs):
        man["row_docs"] = row_docs
    write_json(path / MANIFEST, man)
    return _summary(man, path, counts["written"], len(shards) - counts["written"], time.time() - t0, False)


def rows_sha256(rows: Sequence[StoreRow]) -> str:
    """sha256 of rows: their token ids, read positions and ``mean`` flags (a shard's inputs; all the
    prepared rows of a store, in its plan)."""
    return token_ids_sha256([r.ids for r in rows] + [[int(r.mean), *r.read] for r in rows])


def _summary(man: dict, path: Path, written: int, reused: int, seconds: float, up_to_date: bool) -> dict:
    return {"path": str(path), "n_rows": man.get("n_rows"), "n_examples": man.get("n_examples"),
            "n_shards": len(man["shards"]), "shards_written": written, "shards_reused": reused,
            "bytes": man.get("bytes"), "seconds": round(seconds, 3), "up_to_date": up_to_date}

"""Reading an activation store: the manifest, the model identity it was made with, lazy batches.

A store is a folder (:mod:`tracekit.activations.write` writes it)::

    manifest.json              what the store holds (written last; ``complete: true`` when done)
    shard-00000.safetensors    one tensor per hook ``[n, d]`` (hook name = tensor name, as SAELens'
    shard-00001.safetensors    cached activations) plus ``rows``, ``positions``, ``token_ids`` ``[n]``
    ...

One *example* is one (row, position) read: ``rows[i]`` is the row's index in the store's row order
(``manifest["row_ids"][rows[i]]`` its id in the source: the dataset's ``row_id`` or the corpus window),
``positions[i]`` the token index read in that row (BOS counted; ``-1`` for ``mean``) and
``token_ids[i]`` the token there (``-1`` for ``mean``). A hook's activation is flattened to
``[n, d]`` (``attn.hook_z``: ``d = n_heads * d_head``; the shape is in the manifest).

Shards are read memory-mapped (``safetensors.safe_open``): :meth:`ActivationStore.iter_batches`
holds one batch of one hook at a time, whatever the store's size.

Concurrency: one writer at a time per store folder (``.write.lock``, :mod:`tracekit.core.locks`,
the lock sweeps use; a second writer waits for the first, then finds the store complete and
returns without touching it). An open :class:`ActivationStore` holds a shared ``.read.lock``
until :meth:`ActivationStore.close` (or until it is garbage-collected); a writer that would change
a *complete* store (``overwrite``, or repairing a damaged shard) is refused while it is read,
so a reader of a complete store is never affected by a writer.

The model identity (:func:`model_identity`) is tracekit's fingerprint of the embedding and
unembedding (:func:`tracekit.model.load.model_fingerprint`, as SAEs and tuned lenses record it)
plus a strided sample of *every* parameter (two models sharing embeddings but not blocks differ),
the weight processing and the dtype; a store is refused on a model whose identity differs.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence, cast

import numpy as np
import torch
from jaxtyping import Float

from ..core.errors import ConfigError
from ..core.locks import acquire, holder_pid, release
from ..model.info import HookedModel
from ..model.load import model_fingerprint, model_spec_of
from ..model.state import state_of

__all__ = ["FORMAT", "MANIFEST", "WRITE_LOCK", "READ_LOCK", "META_TENSORS", "StoreError", "ActivationStore", "model_identity",
           "token_ids_sha256", "shard_name", "row_key"]

FORMAT = "tracekit-activations"
MANIFEST = "manifest.json"
#: The writers' lock file (exclusive: one writer at a time) in a store folder.
WRITE_LOCK = ".write.lock"
#: The readers' lock file (shared while an :class:`ActivationStore` is open; exclusive while a
#: writer changes a complete store).
READ_LOCK = ".read.lock"
#: The per-example tensors every shard holds besides the hooks.
META_TENSORS = ("rows", "positions", "token_ids")
#: Identity fields compared between a store and a model (in this order in messages).
IDENTITY_KEYS = ("fingerprint", "weights_sha256", "process_weights", "dtype")


class StoreError(ConfigError):
    """An activation store that cannot be used as given (missing, unfinished, made from another
    model, or without a needed hook); the message names the field and the fix."""


def shard_name(k: int) -> str:
    """``shard-00000.safetensors`` for shard ``k``."""
    return f"shard-{k:05d}.safetensors"


def token_ids_sha256(rows: Sequence[Sequence[int]]) -> str:
    """sha256 of rows of token ids, in order (each row as int64 bytes, rows separated): the
    identity of a store's inputs."""
    h = hashlib.sha256()
    for ids in rows:
        h.update(np.asarray(list(ids), dtype=np.int64).tobytes())
        h.update(b"|")
    return h.hexdigest()


def row_key(ids: Sequence[int], read: Sequence[int], mean: bool = False) -> str:
    """The identity of one stored row's reads (16 hex digits of a sha256): its token ids, the
    positions read and whether they are averaged. Two rows with equal keys have equal activations."""
    h = hashlib.sha256(np.asarray(list(ids), dtype=np.int64).tobytes())
    h.update(b"|mean" if mean else b"|each")
    h.update(np.asarray(list(read), dtype=np.int64).tobytes())
    return h.hexdigest()[:16]


def _weights_sha256(model: HookedModel) -> str:
    """sha256 of every parameter's name, shape and a strided sample (<= 4096 values each)."""
    h = hashlib.sha256()
    for name, p in sorted(cast(Any, model).named_parameters(), key=lambda t: t[0]):  # a loaded bridge's
        flat = p.detach().flatten()
        sample = flat[:: max(1, flat.numel() // 4096)].float().cpu().numpy()
        h.update(name.encode() + str(tuple(p.shape)).encode() + sample.tobytes())
    return h.hexdigest()[:16]


def model_identity(model: HookedModel) -> dict:
    """What a store records of the model it was made with: ``name``, ``fingerprint``
    (:func:`tracekit.model.load.model_fingerprint`), ``weights_sha256`` (every parameter, sampled),
    ``process_weights``, ``prepend_bos`` and ``dtype``. Cached on the model object."""
    cached = state_of(model).store_identity
    if cached:
        return dict(cached)
    spec = model_spec_of(model)
    dtype = str(next(iter(cast(Any, model).parameters())).dtype).replace("torch.", "")
    ident = {"name": spec.name, "fingerprint": model_fingerprint(model), "weights_sha256": _weights_sha256(model),
             "process_weights": bool(spec.process_weights), "prepend_bos": bool(spec.prepend_bos), "dtype": dtype}
    state_of(model).store_identity = ident
    return dict(ident)


def _read_lock(path: Path, field: str):
    """A shared lock on ``path``'s :data:`READ_LOCK` (None: the folder is read-only, so no writer
    can change it either).

    Raises:
        StoreError: a writer is replacing or repairing the store now.
    """
    try:
        lock = acquire(path / READ_LOCK, shared=True)
    except OSError:
        return None
    if lock is None:
        pid = holder_pid(path / READ_LOCK)
        raise StoreError(f"{field}: the store at {path} is being rewritten now by another writer"
                         f"{'' if pid is None else f' (pid {pid})'} (overwrite, or a repair of a damaged shard); wait "
                         "for it to finish, then rerun")
    return lock


class ActivationStore:
    """A complete activation store opened for reading (nothing is loaded until asked).

    Attributes:
        path: the store folder.
        manifest: the parsed ``manifest.json``.
        hooks: the hook names stored, in order.
        files: the shard file names, in order.

    While open it holds a shared lock (``.read.lock``): a writer cannot overwrite or repair the
    store under it (it is refused, naming the store). :meth:`close` (or ``with ActivationStore(p)
    as store:``, or dropping the object) releases it.

    Raises (on opening):
        StoreError: no store at ``path``, or one whose write did not finish (rerun the same write:
            it resumes), or (``verify``, default) a shard missing, truncated or altered since it was
            written (:meth:`verify`), or a writer is overwriting or repairing it now.
    """

    def __init__(self, path: str | Path, field: str = "store", verify: bool = True):
        self.path = Path(path).expanduser()
        self.field = field
        self._lock = None
        man = self.path / MANIFEST
        if not man.is_file():
            raise StoreError(f"{field}: no activation store at {self.path} (no {MANIFEST}); write one with "
                             "`tracekit cache-activations CONFIG` (kind: activations) or fix the path")
        self._lock = _read_lock(self.path, field)
        try:
            self._open_manifest(man, field, verify)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Release the store's shared read lock (a writer may then overwrite or repair it)."""
        release(self._lock)
        self._lock = None

    def __enter__(self) -> "ActivationStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def _open_manifest(self, man: Path, field: str, verify: bool) -> None:
        try:
            self.manifest = json.loads(man.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise StoreError(f"{field}: unreadable {man} ({e}); write the store again") from e
        if self.manifest.get("format") != FORMAT:
            raise StoreError(f"{field}: {self.path} is not a tracekit activation store (format "
                             f"{self.manifest.get('format')!r})")
        if not self.manifest.get("complete"):
            raise StoreError(f"{field}: the store at {self.path} is unfinished ({len(self.manifest.get('shards', []))} "
                             "shard(s) written); rerun the same `tracekit cache-activations` / kind: activations "
                             "step to resume it")
        self.hooks: list[str] = list(self.manifest["hooks"])
        self.files: list[str] = [s["file"] for s in self.manifest["shards"]]
        if verify:
            self.verify()

    def verify(self) -> None:
        """Check every shard against the manifest: present, its size and its sha256 (memoised
        in-process by path, size, mtime and inode, so a store read twice is hashed once).

        Raises:
            StoreError: a missing, truncated or altered shard (naming it and the fix).
        """
        from ..core.io import file_sha256  # lazy: readers only

        for rec in self.manifest["shards"]:
            f = self.path / rec["file"]
            why = ("is missing" if not f.is_file() else
                   f"has {f.stat().st_size} bytes, not the {rec['bytes']} recorded" if f.stat().st_size != rec["bytes"]
                   else "does not match its recorded sha256" if file_sha256(f) != rec["sha256"] else None)
            if why:
                raise StoreError(f"{self.field}: shard {rec['file']} of the store at {self.path} {why} (damaged "
                                 "after it was written); rerun the step that wrote the store (kind: activations, the "
                                 "same config: it rewrites a damaged shard and those after it, keeping the ones before)")

    # ---- what it holds ----------------------------------------------------------------------
    def __len__(self) -> int:
        return int(self.manifest["n_examples"])

    @property
    def dtype(self) -> str:
        return str(self.manifest["dtype"])

    @property
    def position(self) -> str:
        """The position spec the store read (``last``, ``all``, ``END``, ``3``, ``mean`` ...)."""
        return str(self.manifest["position"])

    @property
    def row_ids(self) -> list:
        """Each stored row's id in its source (dataset ``row_id`` or corpus window index)."""
        return list(self.manifest["row_ids"])

    def width(self, hook: str) -> int:
        """The flattened width ``d`` of one hook."""
        return int(np.prod(self.manifest["shapes"][hook]))

    def _meta(self, name: str) -> np.ndarray:
        parts = [self._open(f).get_tensor(name).numpy() for f in self.files]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    @property
    def rows(self) -> np.ndarray:
        """``[n_examples]`` int64: each example's row index in the store's row order."""
        return self._meta("rows")

    @property
    def positions(self) -> np.ndarray:
        """``[n_examples]`` int64: the token index read (BOS counted; -1 = ``mean``)."""
        return self._meta("positions")

    @property
    def token_ids(self) -> np.ndarray:
        """``[n_examples]`` int64: the token at each read position (-1 = ``mean``)."""
        return self._meta("token_ids")

    def _open(self, f: str):
        from safetensors import safe_open  # lazy: only readers need it

        return safe_open(str(self.path / f), framework="pt")

    # ---- checks -----------------------------------------------------------------------------
    def check_model(self, model: HookedModel, field: Optional[str] = None) -> None:
        """Refuse the store when ``model`` is not the model it was made with.

        Raises:
            StoreError: the fingerprint, the parameters, the weight processing or the dtype differ
                (the message names what differs and the fix).
        """
        field = field or self.field
        have = model_identity(model)
        made = self.manifest.get("model", {})
        if "prepend_bos" in made and made["prepend_bos"] != have.get("prepend_bos"):
            raise StoreError(f"{field}: the store at {self.path} was written with model.prepend_bos "
                             f"{made['prepend_bos']} but this model has prepend_bos {have.get('prepend_bos')} (its rows' "
                             f"token ids and positions differ); set model.prepend_bos: {str(made['prepend_bos']).lower()} "
                             "or write the store again with this model")
        diff = [k for k in IDENTITY_KEYS if made.get(k) != have.get(k)]
        if diff:
            detail = ", ".join(f"{k} {made.get(k)!r} vs {have.get(k)!r}" for k in diff)
            raise StoreError(f"{field}: the store at {self.path} was made from another model ({made.get('name')!r}; "
                             f"{detail}: store vs this model); write a store with this model "
                             "(`tracekit cache-activations`) or drop the store field to run the model")

    def require_hooks(self, hooks: Sequence[str], field: Optional[str] = None) -> None:
        """Raises StoreError when one of ``hooks`` is not stored (naming them and the fix)."""
        missing = [h for h in hooks if h not in self.hooks]
        if missing:
            raise StoreError(f"{field or self.field}: the store at {self.path} has no {missing} (it holds "
                             f"{self.hooks}); write a store with these hooks (kind: activations, hooks: [...]) or "
                             "drop the store field")

    def match_rows(self, ids: Sequence[Sequence[int]], reads: Sequence[Sequence[int]], mean: bool = False,
                   field: Optional[str] = None) -> np.ndarray:
        """The store row holding each given row's reads: rows match by :func:`row_key` (token ids,
        positions read, ``mean``), so a subset of the stored rows, in any order, can be read.

        Args:
            ids: each row's token ids (BOS included as the model prepends it).
            reads: each row's read positions (into its ids).
            mean: the rows' reads are averaged (position ``mean``).
            field: the config field quoted in errors.

        Returns:
            ``[len(ids)]`` int64 store row indices.

        Raises:
            StoreError: a row the store does not hold (other prompts, tokenization or position).
        """
        index = {k: i for i, k in reversed(list(enumerate(self.manifest.get("row_keys", []))))}
        keys = [row_key(i, r, mean) for i, r in zip(ids, reads)]
        missing = [j for j, k in enumerate(keys) if k not in index]
        if missing:
            raise StoreError(f"{field or self.field}: the store at {self.path} does not hold {len(missing)} of these "
                             f"{len(keys)} rows (first: row {missing[0]}) at these positions (it read position "
                             f"{self.position!r} in {self.manifest.get('n_rows')} rows from "
                             f"{self.manifest.get('source', {}).get('kind')!r}); write a store from the same rows at the "
                             "same position, or drop the store field")
        return np.array([index[k] for k in keys], dtype=np.int64)

    # ---- reading ----------------------------------------------------------------------------
    def iter_batches(self, hook: str, batch_size: int = 4096
                     ) -> Iterator[Float[torch.Tensor, "batch d"]]:
        """One hook's ``[<= batch_size, d]`` activations in store order, read lazily (memory-mapped
        slices of one shard at a time), in the store's dtype on the CPU.

        Raises:
            StoreError: the hook is not stored.
        """
        self.require_hooks([hook])
        for f in self.files:
            h = self._open(f)
            sl = h.get_slice(hook)
            n = int(sl.get_shape()[0])
            for s in range(0, n, max(1, int(batch_size))):
                yield sl[s:min(n, s + batch_size)]

    def read_into(self, hooks: Sequence[str], examples: np.ndarray, out: np.ndarray, batch_size: int = 4096) -> None:
        """Copy some examples of several hooks into ``out`` (e.g. a memory-mapped array), one
        batch of one hook in memory at a time.

        Args:
            hooks: the hooks, one per leading index of ``out``.
            examples: ``[k]`` int64 store example indices, increasing.
            out: ``[len(hooks), k, d]`` array written in place (cast to its dtype).
            batch_size: examples read per slice.

        Raises:
            StoreError: a hook the store does not hold.
        """
        self.require_hooks(hooks)
        dest = np.full(len(self), -1, dtype=np.int64)
        dest[np.asarray(examples, dtype=np.int64)] = np.arange(len(examples))
        for j, hook in enumerate(hooks):
            at = 0
            for part in self.iter_batches(hook, batch_size):
                d = dest[at:at + part.shape[0]]
                keep = d >= 0
                if keep.any():
                    out[j, d[keep]] = part[torch.from_numpy(keep)].float().numpy()
                at += part.shape[0]

    def get(self, hook: str) -> Float[torch.Tensor, "n d"]:
        """One hook's whole ``[n_examples, d]`` matrix (loaded into memory)."""
        parts = [h for h in self.iter_batches(hook, 1 << 62)]
        return parts[0] if len(parts) == 1 else torch.cat(parts, 0)

"""Files written so that a reader never sees half of one: atomic writes, JSON-able values, and file
manifests (sizes and sha256) that tell a complete entry from a damaged one.

Written once and used by the runner (``status.json``, ``summary.json``, ...), results (a step's
folder), sweeps (``point.json``, ``index.parquet``) and the caches (weights, processed weights,
trained SAEs).

>>> jsonable({"p": float("nan"), "n": 3})
{'p': None, 'n': 3}
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import errno as _errno
import hashlib
import json
import math
import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Union

from .errors import OutputError, TracekitError

__all__ = ["jsonable", "atomic_write", "write_json", "atomic_folder", "replace_dir", "temp_name", "file_sha256",
           "write_files_manifest", "read_manifest", "verify_files_manifest", "ManifestInvalid", "fsync_dir",
           "WRITE_ERRNOS", "write_error", "write_errors"]


def jsonable(x: Any) -> Any:
    """Convert numpy/torch scalars and arrays to Python values and NaN/inf to None (JSON has neither)."""
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if type(x).__module__ in ("numpy", "torch") and hasattr(x, "tolist") and getattr(x, "ndim", 0) > 0:
        return jsonable(x.tolist())
    if hasattr(x, "item") and getattr(x, "ndim", 1) == 0:
        x = x.item()
    if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
        return None
    return x


def temp_name(path: Path, tag: str = "tmp") -> Path:
    """A hidden sibling of ``path`` for writing it: ``.<name>.<tag>-<pid>-<8 hex>`` (the pid lets a
    later process tell a dead writer's leftovers from a live one's)."""
    return path.parent / f".{path.name}.{tag}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def atomic_write(path: Union[str, Path], data: Union[bytes, str, Callable[[Path], None]]) -> Path:
    """Write a file so that readers see the old or the new version, never a partial one: the data
    (bytes, text, or a callable writing to the path it is given) goes to a temporary sibling that
    is renamed over ``path``. The temporary file is removed whatever is raised."""
    path = Path(path)
    tmp = temp_name(path)
    try:
        if callable(data):
            data(tmp)
        elif isinstance(data, str):
            tmp.write_text(data, encoding="utf-8")
        else:
            tmp.write_bytes(data)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def write_json(path: Union[str, Path], obj: Any) -> Path:
    """``atomic_write`` of ``obj`` as indented JSON (through :func:`jsonable`)."""
    return atomic_write(path, json.dumps(jsonable(obj), indent=2))


def fsync_dir(d: Path) -> None:
    """Flush every file under ``d`` to disk (before a rename makes the folder visible)."""
    for f in d.rglob("*"):
        if f.is_file():
            try:
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
            except OSError:
                pass


def replace_dir(tmp: Union[str, Path], dest: Union[str, Path]) -> None:
    """Rename the folder ``tmp`` to ``dest``; an existing ``dest`` is renamed aside first and deleted
    after, so ``dest`` is never half old, half new (the caller decides whether replacing is allowed).

    Raises:
        OSError: from the renames (the caller maps it with :func:`write_error`).
    """
    tmp, dest = Path(tmp), Path(dest)
    if dest.exists():
        old = temp_name(dest, "old")
        dest.rename(old)
        tmp.rename(dest)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(dest)


@contextlib.contextmanager
def atomic_folder(d: Union[str, Path]) -> Iterator[Path]:
    """Build a folder under a temporary name and rename it into place when the block ends without
    an error (replacing an existing ``d`` as a whole: no stale file survives); on any error,
    ``KeyboardInterrupt`` included, the temporary folder is removed and ``d`` is untouched.

    Yields:
        The temporary folder to write into.
    """
    d = Path(d)
    tmp = temp_name(d)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        fsync_dir(tmp)
        replace_dir(tmp, d)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


_SHA: dict[tuple, str] = {}


def file_sha256(path: Union[str, Path], memo: bool = True) -> str:
    """Hex sha256 of a file's bytes (memoised in-process by path, size, mtime and inode unless
    ``memo`` is off: a check of a cache entry hashes what is on disk now)."""
    p = Path(path)
    st = p.stat()
    key = (str(p.resolve()), st.st_size, st.st_mtime_ns, st.st_ino)
    if memo and key in _SHA:
        return _SHA[key]
    h = hashlib.sha256()
    with open(p, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    out = h.hexdigest()
    if memo:
        _SHA[key] = out
    return out


class ManifestInvalid(TracekitError):
    """A folder whose files do not match its manifest (the message says which and how); a
    :class:`~tracekit.core.errors.TracekitError` (one error root)."""


def write_files_manifest(d: Path, extra: dict | None = None) -> dict:
    """Write ``d/manifest.json`` listing every file under ``d`` with its size and sha256 (plus
    ``extra`` fields): the integrity record :func:`verify_files_manifest` checks. Returns it."""
    files = {}
    for f in sorted(p for p in d.rglob("*") if p.is_file() and p.name != "manifest.json"):
        files[f.relative_to(d).as_posix()] = {"size": f.stat().st_size, "sha256": file_sha256(f, memo=False)}
    man = {**(extra or {}), "files": files,
           "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}
    (d / "manifest.json").write_text(json.dumps(man, indent=2))
    return man


def read_manifest(d: Path) -> dict:
    """``d/manifest.json``; raises :class:`ManifestInvalid` when it cannot be read."""
    try:
        return json.loads((d / "manifest.json").read_text())
    except (OSError, ValueError) as e:
        raise ManifestInvalid(f"manifest unreadable ({type(e).__name__})") from e


def verify_files_manifest(d: Path, required: tuple[str, ...] = (),
                          defer: dict[str, Callable[[Path, str], None]] | None = None) -> dict:
    """The manifest of a folder whose files all match it (sizes, then sha256).

    Args:
        required: files the manifest must list.
        defer: ``{file: check(path, sha256)}`` for files whose sha256 is checked by the caller
            (e.g. in a background thread while a model is built) instead of now.

    Raises:
        ManifestInvalid: naming what does not match (a missing manifest or file, a truncated or
            bit-flipped file, a required file not listed).
    """
    man = read_manifest(d)
    files = man.get("files") or {}
    for name in required:
        if name not in files:
            raise ManifestInvalid(f"manifest lists no {name}")
    for name, rec in files.items():
        try:
            size = (d / name).stat().st_size
        except OSError as e:
            raise ManifestInvalid(f"{name} missing") from e
        if size != rec.get("size"):
            raise ManifestInvalid(f"{name} has {size} bytes, its manifest says {rec.get('size')} (truncated?)")
    for name, rec in files.items():
        if defer and name in defer:
            defer[name](d / name, str(rec.get("sha256")))
        elif file_sha256(d / name, memo=False) != rec.get("sha256"):
            raise ManifestInvalid(f"{name} sha256 differs from its manifest (damaged)")
    return man


#: The write failures mapped to an :class:`OutputError` naming the path and the fix: ``errno`` ->
#: ``(what happened, what to do)``.
WRITE_ERRNOS: dict[int, tuple[str, str]] = {
    _errno.ENOSPC: ("no space is left on the disk", "free space there (or choose a folder on another disk)"),
    _errno.EDQUOT: ("the disk quota is exceeded", "free space in your quota (or choose a folder on another disk)"),
    _errno.EFBIG: ("the file is larger than the file-size limit (`ulimit -f`, or the file system's largest file)",
                   "raise the limit (`ulimit -f unlimited`) or write smaller files"),
    _errno.EROFS: ("the file system is read-only", "choose a folder on a writable disk"),
    _errno.EACCES: ("permission is denied", "choose a folder you can write to, or fix its permissions"),
    _errno.EPERM: ("the operation is not permitted", "choose a folder you can write to, or fix its permissions"),
    _errno.ENOTDIR: ("a part of the path is a file, not a folder", "choose a path under a folder"),
    _errno.EEXIST: ("a file is in the way where a folder is needed", "remove it or choose another path"),
}


def _concerns(failed: str, roots: list[Union[str, Path]]) -> bool:
    """``failed`` is one of ``roots``, inside one, or a folder above one (a parent being created)."""
    f = Path(os.path.abspath(failed))
    for r in roots:
        r = Path(os.path.abspath(r))
        if f == r or f.is_relative_to(r) or r.is_relative_to(f):
            return True
    return False


def write_error(e: OSError, path: Union[str, Path], field: str, fix: str = "",
                hints: Optional[dict[int, str]] = None, roots: tuple = ()) -> Optional[OutputError]:
    """The :class:`OutputError` for a failed write (None when ``e`` is not one of :data:`WRITE_ERRNOS`,
    or names a file that is not being written, e.g. an input being read: re-raise it as it is).

    Args:
        e: the error a write raised (its ``filename``, when set, is the file that failed).
        path: what was being written (the output folder or file).
        field: the argument or config field that named ``path`` (``--to``, ``path``).
        fix: what else the user can do, appended to the errno's fix (e.g. ``rerun to resume``).
        hints: ``{errno: text}`` appended to that errno's own fix (e.g. a smaller shard size for
            ``EFBIG``).
        roots: other places being written besides ``path`` (a temporary sibling folder); an
            error naming a file outside ``path``, ``roots`` and the folders above them is not mapped.

    Returns:
        The error to raise (``raise write_error(...) from e``); its message names ``field``,
        ``path``, the file that failed, the reason and the fix.
    """
    if isinstance(e, OutputError) or e.errno not in WRITE_ERRNOS:
        return None
    failed = e.filename2 or e.filename or path  # a copy's destination is filename2 (shutil.copyfile)
    if not _concerns(str(failed), [path, *roots]):
        return None
    what, todo = WRITE_ERRNOS[e.errno]
    if hints and e.errno in hints:
        todo = f"{todo} {hints[e.errno]}"
    at = "" if str(failed) == str(path) else f" ({failed})"
    name = _errno.errorcode.get(e.errno or 0, str(e.errno))
    out = OutputError(f"{field}: cannot write {str(path)!r}{at}: {what} ({name}); {todo}" + (f"; {fix}" if fix else ""))
    out.errno = e.errno
    return out


@contextlib.contextmanager
def write_errors(path: Union[str, Path], field: str, fix: str = "",
                 hints: Optional[dict[int, str]] = None, roots: tuple = ()) -> Iterator[None]:
    """Map an ``OSError`` of :data:`WRITE_ERRNOS` raised in the block to :func:`write_error`'s
    :class:`OutputError` (others propagate unchanged). The block's own atomic writes keep what was
    written before whole; this only names the failure.

    Args:
        path: what the block writes.
        field: the argument or config field that named ``path``.
        fix: extra advice appended to the message.
        hints: ``{errno: text}`` appended to that errno's fix (:func:`write_error`).
        roots: other places the block writes (:func:`write_error`).

    Raises:
        OutputError: disk full, file-size limit, read-only, permission, a file in the way.
    """
    try:
        yield
    except OSError as e:
        err = write_error(e, path, field, fix, hints, roots)
        if err is None:
            raise
        raise err from e

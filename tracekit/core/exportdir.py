"""Export folders (``tracekit export ... --to DIR``), written once for every export: which ``DIR``
may be written, and writing it whole or not at all.

The target rule (:func:`export_target`), after resolving symlinks on both sides:

* ``DIR`` is not a SOURCE, not inside a SOURCE and does not contain a SOURCE (an export never
  writes into, or replaces, what it reads: a run, a step, an SAE or the whole SAE cache);
* ``DIR`` is a folder or does not exist yet (a file is refused);
* a non-empty ``DIR`` is replaced only with ``--force``, and only when it is a folder an export
  wrote: it holds :data:`MARKER` (``.tracekit-export.json``, written by every export) and nothing
  that record does not list. Any other folder is refused, never deleted.

:func:`export_folder` builds the export in a hidden sibling folder, writes :data:`MARKER` (the
files written, their sizes) and renames it into place, so an interrupted or failed export
(disk full, a file-size limit, a read-only disk) leaves ``DIR`` as it was; write failures are
:class:`~tracekit.core.errors.OutputError` naming ``DIR`` and the fix (:func:`tracekit.core.io.write_errors`).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import shutil
from pathlib import Path
from typing import Iterable, Iterator, Union

from .errors import OutputError
from .io import replace_dir, temp_name, write_errors

__all__ = ["MARKER", "export_target", "export_folder", "export_record"]

#: The record every export writes into its folder: ``{"format": "tracekit-export", "what",
#: "sources", "files": {relative path: size}, "created"}``.
MARKER = ".tracekit-export.json"
_FORMAT = "tracekit-export"


def export_record(d: Union[str, Path]) -> dict | None:
    """The :data:`MARKER` record of folder ``d`` (None: there is none, or it is not an export's)."""
    try:
        rec = json.loads((Path(d) / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return rec if isinstance(rec, dict) and rec.get("format") == _FORMAT and isinstance(rec.get("files"), dict) else None


def _files(d: Path) -> list[str]:
    """Every non-folder entry under ``d`` (links included, not followed), relative, ``/``-separated."""
    out = []
    for p in d.rglob("*"):
        if p.is_symlink() or not p.is_dir():
            out.append(p.relative_to(d).as_posix())
    return sorted(out)


def export_target(to: Union[str, Path], sources: Iterable[Union[str, Path]], force: bool = False,
                  field: str = "--to") -> Path:
    """``to`` checked against the target rule (module docstring) and resolved (symlinks followed).

    Args:
        to: the export folder asked for.
        sources: what the export reads (a run or step folder, an SAE folder); each resolved.
        force: replace a non-empty ``to`` that an export wrote.
        field: the argument named in errors.

    Returns:
        The resolved target folder (it may not exist yet).

    Raises:
        OutputError: ``to`` is, is inside, or contains a source; is a file; is non-empty without
            ``force``; or, with ``force``, is a folder no export wrote (or holds files its export
            did not write). The message names the path and the fix.
    """
    given = Path(to).expanduser()
    dest = given.resolve()
    shown = repr(str(given)) + ("" if str(given) == str(dest) else f" (= {str(dest)!r})")
    for s in sources:
        src = Path(s).expanduser().resolve()
        if dest == src:
            raise OutputError(f"{field}: {shown} is the SOURCE itself; give a new folder for the export")
        if dest.is_relative_to(src):
            raise OutputError(f"{field}: {shown} is inside the SOURCE {str(src)!r}; give a folder outside it")
        if src.is_relative_to(dest):
            raise OutputError(f"{field}: {shown} contains the SOURCE {str(src)!r} (writing there would replace it); "
                              "give a new folder outside it")
    if dest.exists() and not dest.is_dir():
        raise OutputError(f"{field}: {shown} is a file; give a folder")
    if dest.is_dir() and any(dest.iterdir()):
        if not force:
            raise OutputError(f"{field}: {shown} exists and is not empty; choose a new folder, or pass --force to "
                              "replace an earlier export there")
        rec = export_record(dest)
        if rec is None:
            raise OutputError(f"{field}: {shown} is not a folder `tracekit export` wrote (it has no {MARKER}); --force "
                              "replaces only an earlier export, never other files: choose a new folder, or remove it "
                              "yourself")
        extra = [f for f in _files(dest) if f != MARKER and f not in rec["files"]]
        if extra:
            raise OutputError(f"{field}: {shown} holds {len(extra)} file(s) its export did not write (first: "
                              f"{extra[0]!r}); --force replaces only what an export wrote: choose a new folder, or "
                              "move those files away")
    return dest


@contextlib.contextmanager
def export_folder(to: Union[str, Path], sources: Iterable[Union[str, Path]], what: str, force: bool = False,
                  field: str = "--to") -> Iterator[Path]:
    """Write an export folder whole or not at all.

    Yields a temporary sibling folder of the target to write into; when the block ends without an
    error, :data:`MARKER` is written (the files, their sizes, ``what`` and the sources) and the
    folder is renamed to the target (an earlier export there replaced). On any error the temporary
    folder is removed and the target is left as it was.

    Args:
        to: the export folder (checked by :func:`export_target`).
        sources: what the export reads.
        what: the kind of export recorded (``sae``, ``tables``, ``features``).
        force: replace an earlier export at ``to``.
        field: the argument named in errors.

    Raises:
        OutputError: the target rule refuses ``to``, or a write fails (disk full, file-size limit,
            read-only disk, no permission, a file where a folder is needed), naming the path.
    """
    srcs = [str(Path(s).expanduser().resolve()) for s in sources]
    dest = export_target(to, srcs, force, field)
    fix = f"{str(dest)!r} was left as it was"
    tmp = temp_name(dest)
    with write_errors(dest, field, fix, roots=(tmp,)):
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
    try:
        with write_errors(dest, field, fix, roots=(tmp,)):
            yield tmp
            files = {f: (tmp / f).lstat().st_size for f in _files(tmp)}
            rec = {"format": _FORMAT, "what": what, "sources": srcs, "files": files,
                   "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}
            (tmp / MARKER).write_text(json.dumps(rec, indent=2))
            replace_dir(tmp, dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)

"""Cache folders: list, clear, and remove what interrupted writers left (shared by every on-disk cache)."""

from __future__ import annotations

import logging
import os
import re
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .io import ManifestInvalid, read_manifest

log = logging.getLogger("tracekit.cache")



def remove_entry(d: Path) -> None:
    """Remove a cache entry folder ``d``: rename it aside first (atomic), then delete; tolerate a
    concurrent remover (a folder already gone is no error). Raises nothing."""
    trash = d.parent / f".trash-{d.name}-{uuid.uuid4().hex[:8]}"
    try:
        os.rename(d, trash)
    except OSError:
        return
    shutil.rmtree(trash, ignore_errors=True)


_TEMP = re.compile(r"\.tmp-(?:.*-)?(\d+)-[0-9a-f]{8}$")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def remove_stale_temps(root: Path) -> list[Path]:
    """Remove temporary folders left under ``root`` by writers that died (SIGKILL, power loss):
    ``.tmp-...-<pid>-<id>`` folders whose process is gone, and ``.trash-*`` folders. A live writer's
    folder is kept. Returns what was removed."""
    removed = []
    if not root.is_dir():
        return removed
    for d in root.iterdir():
        if not d.is_dir():
            continue
        m = _TEMP.search(d.name)
        legacy = re.search(r"\.tmp-[0-9a-f]{8}$", d.name) is not None  # written before names carried a pid
        stale = d.name.startswith(".trash-") or legacy or (m is not None and not _pid_alive(int(m.group(1))))
        if stale:
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
    return removed


def dir_size(d: Path) -> int:
    """The total size in bytes of the files under folder ``d`` (recursively).

    Raises:
        OSError: a file vanished or cannot be stat-ed while counting.
    """
    return sum(f.stat().st_size for f in d.rglob("*") if f.is_file())


def sizes_match(d: Path, man: dict) -> bool:
    """Every file the manifest lists exists with its size (the cheap check; a load checks sha256)."""
    return all((d / n).is_file() and (d / n).stat().st_size == r.get("size") for n, r in man.get("files", {}).items())


def dir_entries(root: Path, describe: Callable[[Path, dict], dict]) -> list[dict]:
    """One row per folder under a cache root: ``key, path, size_bytes`` plus ``describe(folder,
    manifest)`` (which sets ``valid``); a folder without a readable manifest (a leftover of an
    interrupted write) is listed with ``valid`` False."""
    if not root.is_dir():
        return []
    out = []
    for d in sorted(root.iterdir()):
        if not d.is_dir():
            continue
        row: dict[str, Any] = {"key": d.name, "path": str(d), "size_bytes": dir_size(d), "valid": False}
        try:
            row.update(describe(d, read_manifest(d)))
        except (ManifestInvalid, OSError, ValueError):
            pass
        out.append(row)
    return out


def clear_dir(root: Path) -> tuple[int, int]:
    """Remove every entry under a cache root (and leftover temporary folders); returns ``(entries
    removed, bytes freed)``."""
    if not root.is_dir():
        return 0, 0
    n = freed = 0
    for d in list(root.iterdir()):
        if d.is_dir():
            freed += dir_size(d)
            n += 0 if d.name.startswith(".") else 1
            remove_entry(d) if not d.name.startswith(".") else shutil.rmtree(d, ignore_errors=True)
    return n, freed


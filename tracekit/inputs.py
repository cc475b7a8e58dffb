"""The data files a config reads, identified by what they hold.

A result computed from a file (``pairs_file``, a ``corpus`` file or folder, a probing dataset's
``path``, an SAE directory's ``path``) depends on the file's *contents*, not its name: a sweep
resumed after ``pairs_file`` was edited must not reuse the old pairs' results, and an SAE trained on
an edited corpus is another SAE. :func:`input_files` finds every such field of a config (by name,
at any depth; pipeline references excluded) and :func:`content_hash` hashes what each holds
(sha256; a folder: its files' relative paths and contents). The hashes go into every key that
depends on them (a sweep point's ``config_hash``, the SAE cache key) and into each run's
``environment.json`` (``inputs``), so a run can be reproduced from its own record.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

from .core.io import file_sha256

__all__ = ["FILE_FIELDS", "input_files", "content_hash"]

#: Config keys whose string value (or list of strings) names a data file or folder.
FILE_FIELDS = ("pairs_file", "corpus", "path")
#: Values of those keys that name no file.
_BUILTIN = ("stdlib",)

def content_hash(path: str | os.PathLike) -> str | None:
    """sha256 of a file's bytes, or of a folder's (relative path, file hash) pairs in sorted order;
    None when nothing exists at ``path``."""
    p = Path(path).expanduser()
    if p.is_file():
        return file_sha256(p)
    if p.is_dir():
        h = hashlib.sha256()
        for f in sorted(x for x in p.rglob("*") if x.is_file()):
            h.update(str(f.relative_to(p)).encode() + b"\0" + file_sha256(f).encode())
        return h.hexdigest()
    return None


def input_files(raw: Any, prefix: str = "") -> dict[str, dict]:
    """Every data file or folder a (raw or validated) config names, by YAML path:
    ``{"experiments[0].pairs_file": {"path": absolute path, "sha256": ...}}``.

    Values that are not existing paths (``stdlib``, a hub id) are skipped; pipeline references
    (``{from: ...}``) are results of the run itself, not inputs.
    """
    if hasattr(raw, "model_dump"):
        raw = raw.model_dump(mode="json")
    out: dict[str, dict] = {}
    if isinstance(raw, dict):
        if "from" in raw:
            return out
        for k, v in raw.items():
            where = f"{prefix}.{k}" if prefix else str(k)
            if k in FILE_FIELDS and isinstance(v, (str, list)):
                for i, item in enumerate([v] if isinstance(v, str) else v):
                    if isinstance(item, str) and item not in _BUILTIN:
                        h = content_hash(item)
                        if h is not None:
                            at = where if isinstance(v, str) else f"{where}[{i}]"
                            out[at] = {"path": str(Path(item).expanduser().resolve()), "sha256": h}
            else:
                out.update(input_files(v, where))
    elif isinstance(raw, list):
        for i, v in enumerate(raw):
            out.update(input_files(v, f"{prefix}[{i}]"))
    return out

"""``tracekit cache [list|clear] [NAME ...]`` (wired into :mod:`tracekit.cli`): every cache tracekit
writes, from the one registry :data:`tracekit.core.cachedir.CACHES`.

Exit codes: 0 done; 2 an unknown cache name.
"""

from __future__ import annotations

import sys
from typing import Optional

from .core.cachedir import CACHES, cache_path, cache_root, clear_kind, kind_entries

__all__ = ["COMMANDS", "add_commands", "main", "cache_command"]

COMMANDS = ("cache",)


def add_commands(sub) -> None:
    """Add ``cache`` to the CLI's subparsers."""
    c = sub.add_parser("cache", help="list tracekit's caches (weights, trained SAEs, tuned lenses, transcoders, their "
                                     "activation stores, model info) or empty them (tracekit cache clear [NAME ...])")
    c.add_argument("action", nargs="?", choices=["list", "clear"], default="list")
    c.add_argument("names", nargs="*", metavar="NAME",
                   help=f"only these caches ({', '.join(k.name for k in CACHES)})")


def main(args) -> int:
    """``tracekit cache``; returns the exit code."""
    return cache_command(args.action, args.names)


def cache_command(action: str, names: Optional[list[str]] = None) -> int:
    """``tracekit cache [list|clear] [NAME ...]``: every cache tracekit writes, from the one registry
    :data:`tracekit.core.cachedir.CACHES` (weights with processed weights, trained SAEs, tuned lenses,
    transcoder sets, transcoder activation stores): per cache its folder, entry count and size, then
    one line per entry (size, key, created, what it holds), leftovers of killed writers included.
    ``clear`` empties every cache, or only the named ones."""
    from .model import weights_cache as cache  # lazy: the caches' modules import torch

    known = [k.name for k in CACHES]
    bad = [n for n in names or [] if n not in known]
    if bad:
        print(f"tracekit cache: unknown cache {', '.join(bad)}; the caches are: {', '.join(known)}", file=sys.stderr)
        return 2
    kinds = [k for k in CACHES if not names or k.name in names]
    root = cache_root()
    if action == "clear":
        parts, total_n, total_b = [], 0, 0
        for k in reversed(kinds):  # nested caches first (transcoders/stores before transcoders)
            n, freed = clear_kind(k)
            parts.append(f"{k.name}: {n} entr{'y' if n == 1 else 'ies'} ({freed / 2**20:.1f} MiB)")
            total_n, total_b = total_n + n, total_b + freed
        print(f"removed {total_n} entr{'y' if total_n == 1 else 'ies'} ({total_b / 2**20:.1f} MiB) from {root}: "
              + "; ".join(reversed(parts)))
        return 0
    print(f"tracekit cache: {root}" + ("" if cache.cache_enabled() else " (disabled: TRACEKIT_CACHE=off)"))
    total = n = 0
    for k in kinds:
        rows = kind_entries(k)
        size = sum(r["size_bytes"] for r in rows)
        print(f"{k.name}: {k.title} ({cache_path(k.name)}): {len(rows)} entr{'y' if len(rows) == 1 else 'ies'}, "
              f"{size / 2**20:.1f} MiB")
        if not rows:
            print("  (empty)")
        for r in rows:
            flag = "" if r["valid"] else "  [invalid or unfinished: removed on the next use]"
            what = r.get("hook") or (f"{r.get('dtype') or '?'}  {r.get('gguf_path') or '?'}" if "gguf_path" in r else "")
            print(f"  {r['size_bytes'] / 2**20:8.1f} MiB  {r['key']}  created {r.get('created') or '?'}"
                  f"{'  ' + what if what else ''}{flag}")
        total += size
        n += len(rows)
    print(f"total: {n} entr{'y' if n == 1 else 'ies'}, {total / 2**20:.1f} MiB")
    return 0

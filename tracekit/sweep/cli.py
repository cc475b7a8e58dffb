"""``tracekit sweep`` and ``tracekit results`` (wired into :mod:`tracekit.cli`)."""

from __future__ import annotations

import fnmatch
import logging
import sys
from pathlib import Path

from ..core.errors import TracekitError
from ..plotting import text_table
from .expand import _groups, check_compare, expand_sweep
from .figures import SCALES, _safe, compare
from .index import FIXED_COLUMNS, INDEX, headline_columns, load_results
from .run import run_sweep

__all__ = ["COMMANDS", "add_commands", "main"]

COMMANDS = ("sweep", "results")


def add_commands(sub) -> None:
    """Add ``sweep`` and ``results`` to the CLI's subparsers."""
    s = sub.add_parser("sweep", help="run a config's sweep block: one run per point, an index (resumable)")
    s.add_argument("config")
    s.add_argument("--out", required=True, help="the sweep folder; rerun into it to continue a stopped sweep")
    s.add_argument("--set", dest="overrides", action="append", default=[], metavar="PATH=VALUE")
    s.add_argument("--executor", choices=["local", "ray"], default="local")
    s.add_argument("--address", default=None, help="Ray cluster address (auto = the running cluster)")
    s.add_argument("--workers", type=int, default=None, help="Ray CPU actors when there are no GPUs")
    s.add_argument("--dry-run", action="store_true", help="list the points and exit (no model is loaded)")
    s.add_argument("--no-progress", action="store_true")
    r = sub.add_parser("results", help="print a sweep's index (and draw a comparison figure)")
    r.add_argument("directory")
    r.add_argument("--columns", default=None, help="comma-separated index columns or glob patterns to show "
                   "(e.g. 'lens/*'); default: the swept paths, status and each step's headline metrics")
    r.add_argument("--plot", default=None, metavar="METRIC", help="draw METRIC over points (e.g. "
                   "lens/target_prob_by_hidden_state)")
    r.add_argument("--by", default=None, help="swept path naming each series (default: all swept paths)")
    r.add_argument("--scale", choices=list(SCALES), default="auto", help="y axis of --plot (auto: log for "
                   "values spanning > 2 decades, rank axis for ranks)")
    r.add_argument("--output", default=None, help="figure file (default: DIR/compare-METRIC.png)")


def _chosen_columns(df, columns: str | None) -> list[str]:
    """``columns`` (comma-separated names or glob patterns such as ``lens/*``), or by default the
    point, the swept paths, status, seconds and each step's headline metrics
    (:func:`tracekit.sweep.index.headline_columns`).

    Raises:
        KeyError: a name or pattern that matches no column of the index.
    """
    if not columns:
        swept = [c for c in df.attrs.get("swept") or
                 [c for c in df.columns if "/" not in c and c not in FIXED_COLUMNS] if c in df.columns]
        head = [c for c in (df.attrs.get("headline") or headline_columns(df)) if c in df.columns]
        return list(dict.fromkeys(["point", *swept, "status", "seconds", *head]))
    cols: list[str] = []
    for item in (c.strip() for c in columns.split(",") if c.strip()):
        hits = [c for c in df.columns if fnmatch.fnmatchcase(c, item)] if any(x in item for x in "*?[") else \
            ([item] if item in df.columns else [])
        if not hits:
            raise KeyError(f"--columns: no column matches {item!r}; columns: {list(df.columns)}")
        cols += hits
    return list(dict.fromkeys(cols))


def _print_index(df, columns: str | None) -> None:
    """Print the index as a text table of :func:`_chosen_columns`.

    Raises:
        KeyError: a named column the index does not have.
    """
    cols = _chosen_columns(df, columns)
    rows = []
    for _, r in df[cols].iterrows():
        rows.append([(f"{v:.4g}" if isinstance(v, float) else "" if v is None else
                      repr(v) if isinstance(v, str) and v[:1].isspace() else str(v))[:40] for v in r])
    print(text_table(rows, cols))


def _results(args) -> int:
    """``tracekit results DIR``: print the index (and draw ``--plot``); 2 on a bad folder or metric."""
    try:
        df = load_results(args.directory)
        _print_index(df, args.columns)
        if args.plot:
            fig = compare(df, args.plot, by=args.by, scale=args.scale)
            dest = Path(args.output) if args.output else Path(args.directory) / f"compare-{_safe(args.plot)}.png"
            fig.savefig(dest, dpi=110, bbox_inches="tight")
            print(f"figure: {dest}")
    except (TracekitError, KeyError, ValueError) as e:
        print(f"error: {e.args[0] if isinstance(e, KeyError) and e.args else e}", file=sys.stderr)
        return 2
    failed = df[df["status"] == "failed"]
    if len(failed):
        print(f"{len(failed)} failed point(s): {failed['point'].tolist()}")
    return 0


def _dry_run(args) -> int:
    """List the points (the ``compare`` metrics are checked by :func:`expand_sweep` first)."""
    points, raw = expand_sweep(args.config, args.overrides)
    for p in points:
        print(f"point {p.index:3d} seed {p.seed:10d} hash {p.hash}  {p.label}")
    print(f"{len(points)} point(s), {len(_groups(points))} model(s)")
    unchecked = check_compare(points, raw.get("sweep") or {}, str(args.config))
    if unchecked:
        print(f"note: compare metrics of {', '.join(unchecked)} are checked when drawn (the kind declares no "
              "summary keys)")
    return 0


def _report(outcome) -> int:
    """Print what a sweep did (failed points on stderr); its exit code."""
    df = outcome.index
    n_ok = int((df["status"] == "complete").sum())
    print(f"sweep: {n_ok}/{len(df)} point(s) complete ({len(outcome.skipped)} from before, "
          f"{len(outcome.ran)} run now); "
          f"index: {outcome.out / INDEX}")
    if outcome.failed:
        print(f"{len(outcome.failed)} point(s) failed:", file=sys.stderr)
        for r in df[df["status"] == "failed"].itertuples():
            print(f"  point {r.point} ({r.label}): {str(r.error).splitlines()[0]}", file=sys.stderr)
    if outcome.interrupted:
        print("interrupted: rerun the same command to continue", file=sys.stderr)
    return outcome.exit_code


def main(args) -> int:
    """``tracekit sweep`` / ``tracekit results``; returns the exit code (2: invalid config or folder)."""
    if args.cmd == "results":
        return _results(args)
    try:
        if args.dry_run:
            return _dry_run(args)
        logging.getLogger("transformers").setLevel(logging.ERROR)
        if args.no_progress:
            from transformers.utils import logging as hf_logging  # lazy: heavy (transformers loads with a model)

            hf_logging.disable_progress_bar()
        outcome = run_sweep(args.config, args.out, args.overrides, executor=args.executor, workers=args.workers,
                            address=args.address, progress=not args.no_progress)
    except TracekitError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return _report(outcome)

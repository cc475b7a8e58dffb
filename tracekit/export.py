"""``tracekit export``: SAEs, result tables and SAE features in other tools' formats (wired into
:mod:`tracekit.cli` with :func:`add_commands` / :func:`main`).

* ``tracekit export sae SOURCE --to DIR [--model-name HUB_ID] [--force]``: a trained SAE (its cache
  folder or training hash, see ``tracekit cache list``) or a SAELens directory, written as a
  SAELens directory whose ``model_name`` is a hub id (:func:`tracekit.sae.export.export_sae`).
* ``tracekit export tables RUN_DIR --to DIR [--format csv|parquet] [--force]``: every table of a
  saved step (or of every step of a run directory), one file per table.
* ``tracekit export features RESULT_DIR --to DIR [--model-id ID] [--sae-set NAME] [--force]``: a
  ``sae_features`` result's dashboard features as SAEDashboard's Neuronpedia batch JSON
  (``batch-0.json``; :func:`tracekit.sae.export.neuronpedia_batch`).

``DIR`` follows one rule for every export (:mod:`tracekit.core.exportdir`): it is not the source,
not inside it and does not contain it (symlinks resolved); ``--force`` replaces only a folder an
earlier export wrote (it holds ``.tracekit-export.json``, listing its files), never another folder;
the export is written to a hidden sibling and renamed into place, so a failed export (disk full,
read-only disk, a file in the way: an error naming DIR) leaves DIR as it was.

Nothing heavy is imported at module top (``tracekit --help`` stays free of torch).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from .core.exportdir import export_folder, export_target

__all__ = ["COMMANDS", "add_commands", "export_tables", "main", "step_dirs"]

COMMANDS = ("export",)
_FORCE_HELP = "replace an earlier export at DIR (only a folder `tracekit export` wrote; never the source)"


def add_commands(sub) -> None:
    """Add ``export`` (with its ``sae``, ``tables`` and ``features`` sub-commands) to the CLI's subparsers."""
    e = sub.add_parser("export", help="export an SAE (SAELens directory), a run's tables (CSV/Parquet) or SAE "
                                      "features (Neuronpedia/SAEDashboard JSON)")
    es = e.add_subparsers(dest="what", required=True, metavar="{sae,tables,features}")
    s = es.add_parser("sae", help="a trained SAE (cache folder or training hash) or a SAELens directory, as a "
                                  "SAELens directory with a hub model id")
    s.add_argument("source", metavar="SOURCE", help="a SAELens directory, a trained SAE's cache folder, or its "
                                                    "training hash (`tracekit cache list`)")
    s.add_argument("--to", required=True, metavar="DIR", help="the new SAELens directory")
    s.add_argument("--model-name", default=None, metavar="HUB_ID", help="the hub id written as model_name (default: "
                   "the model's hub id when known, e.g. HuggingFaceTB/SmolLM2-135M-Instruct for smollm2-135m)")
    s.add_argument("--force", action="store_true", help=_FORCE_HELP)
    t = es.add_parser("tables", help="every table of a saved step (or of each step of a run) as CSV or Parquet")
    t.add_argument("run_dir", metavar="RUN_DIR", help="a run directory or one of its step folders")
    t.add_argument("--to", required=True, metavar="DIR")
    t.add_argument("--format", choices=["csv", "parquet"], default="csv",
                   help="csv (default; list / dict cells as JSON) or parquet")
    t.add_argument("--force", action="store_true", help=_FORCE_HELP)
    f = es.add_parser("features", help="a sae_features result's dashboard features as a Neuronpedia / SAEDashboard "
                                       "batch JSON (batch-0.json)")
    f.add_argument("result_dir", metavar="RESULT_DIR", help="a sae_features step folder (run with `dashboards:`), "
                                                            "or a run directory")
    f.add_argument("--to", required=True, metavar="DIR")
    f.add_argument("--model-id", default=None, metavar="ID", help="Neuronpedia's model id (default: the run's model "
                                                                   "name)")
    f.add_argument("--sae-set", default="tracekit", metavar="NAME", help="Neuronpedia's SAE set name")
    f.add_argument("--force", action="store_true", help=_FORCE_HELP)


# =============================================================================================
# tables


def step_dirs(run_dir: str | Path) -> list[Path]:
    """The saved step folders of ``run_dir``: itself when it is one (it has ``manifest.json``), else
    its sub-folders that are.

    Args:
        run_dir: a run directory (``tracekit run --out``) or one of its step folders.

    Returns:
        The step folders, sorted by name.

    Raises:
        ResultLoadError: none found (the message names RUN_DIR).
    """
    from .core.errors import ResultLoadError  # lazy: keeps `tracekit --help` light

    d = Path(run_dir).expanduser()
    if (d / "manifest.json").is_file():
        return [d]
    steps = sorted(p for p in d.iterdir() if (p / "manifest.json").is_file()) if d.is_dir() else []
    if not steps:
        raise ResultLoadError(f"RUN_DIR: {str(d)!r} is neither a saved step (no manifest.json) nor a run directory "
                              "holding saved steps; pass the folder `tracekit run` printed, or one of its step folders")
    return steps


def _cell(v: Any) -> Any:
    """A table cell for CSV: lists, tuples, dicts and arrays as JSON text; everything else as is."""
    if hasattr(v, "tolist") and not isinstance(v, (str, bytes)) and getattr(v, "ndim", 0):
        v = v.tolist()
    if isinstance(v, (list, tuple, dict)):
        return json.dumps(v, default=str)
    return v


def export_tables(run_dir: str | Path, to: str | Path, fmt: str = "csv", force: bool = False) -> list[Path]:
    """Write every table of a saved step (or of each step of a run directory) as one file each.

    Tables are read with :meth:`tracekit.Result.load` (today's column names). CSV: UTF-8, a header,
    no index; list / dict / array cells as JSON text. Parquet: ``DataFrame.to_parquet``. A step
    folder's tables go to ``DIR/<table>.<fmt>``; a run directory's to ``DIR/<step>/<table>.<fmt>``.

    Args:
        run_dir: a run directory or one of its step folders.
        to: the output folder (created; refused when non-empty unless ``force``).
        fmt: ``csv`` or ``parquet``.
        force: replace an earlier export at ``to`` (only a folder an export wrote).

    Returns:
        The files written, in their final place.

    Raises:
        ResultLoadError: RUN_DIR holds no saved step, or a step is incomplete.
        OutputError: ``to`` is refused by the export target rule
            (:func:`tracekit.core.exportdir.export_target`: it is, is inside or contains RUN_DIR; a
            file; non-empty without ``force``; with ``force``, a folder no export wrote), or the
            write fails (disk full, read-only, a file in the way), naming the path.
        ValueError: ``fmt`` is neither csv nor parquet.
    """
    from .results import Result  # lazy: keeps `tracekit --help` free of torch

    if fmt not in ("csv", "parquet"):
        raise ValueError(f"--format: {fmt!r}; use csv or parquet")
    dest = export_target(to, [run_dir], force)  # refused before anything is read
    steps = step_dirs(run_dir)
    single = len(steps) == 1 and (Path(run_dir).expanduser() / "manifest.json").is_file()
    written = []
    with export_folder(to, [run_dir], "tables", force) as tmp:
        for st in steps:
            res = Result.load(st)
            out = tmp if single else tmp / st.name
            out.mkdir(parents=True, exist_ok=True)
            for name, df in sorted(res.tables.items()):
                p = out / f"{name}.{fmt}"
                if fmt == "csv":
                    df.map(_cell).to_csv(p, index=False)
                else:
                    df.to_parquet(p, index=False)
                written.append(dest / p.relative_to(tmp))
    return written


# =============================================================================================
# features


def _run_model_name(step: Path) -> str | None:
    """The model name recorded in the run directory above a step (``environment.json``)."""
    env = step.parent / "environment.json"
    try:
        return json.loads(env.read_text()).get("model", {}).get("name")
    except (OSError, ValueError, AttributeError):
        return None


def export_features(result_dir: str | Path, to: str | Path, model_id: str | None = None, sae_set: str = "tracekit",
                    force: bool = False) -> list[Path]:
    """Write each ``sae_features`` step's dashboard features as SAEDashboard's Neuronpedia batch JSON.

    Args:
        result_dir: a ``sae_features`` step folder (run with ``dashboards:``), or a run directory
            (each such step goes to ``DIR/<step>/batch-0.json``).
        to: the output folder (created; refused when non-empty unless ``force``).
        model_id: Neuronpedia's model id (default: the SAE's recorded model, else the run's model name).
        sae_set: Neuronpedia's SAE set name.
        force: replace an earlier export at ``to`` (only a folder an export wrote).

    Returns:
        The batch files written.

    Raises:
        ResultLoadError: no saved step in RESULT_DIR.
        SAEError: no ``sae_features`` step with dashboards; no model id known.
        OutputError: ``to`` is refused by the export target rule (as :func:`export_tables`), or
            the write fails, naming the path.
    """
    from .core.errors import SAEError  # lazy: keeps `tracekit --help` light
    from .results import Result  # lazy: keeps `tracekit --help` free of torch
    from .sae.export import neuronpedia_batch  # lazy: keeps `tracekit --help` free of torch

    dest = export_target(to, [result_dir], force)  # refused before anything is read
    steps = [s for s in step_dirs(result_dir) if json.loads((s / "config.json").read_text()).get("kind") == "sae_features"]
    if not steps:
        raise SAEError(f"RESULT_DIR: {str(result_dir)!r} holds no sae_features step; run sae_features with a "
                       "`dashboards:` block and pass its step folder")
    single = len(steps) == 1 and (Path(result_dir).expanduser() / "manifest.json").is_file()
    batches = []
    for st in steps:
        res = Result.load(st)
        cfg = res.config.dashboards  # pyright: ignore[reportAttributeAccessIssue] - a sae_features config
        mid = model_id or _run_model_name(st)
        if not mid:
            raise SAEError("--model-id: the run records no model name; pass --model-id (Neuronpedia's model id)")
        corpus = "" if cfg is None else (cfg.corpus if isinstance(cfg.corpus, str) else ",".join(cfg.corpus))
        batches.append((st, neuronpedia_batch(res.tables, res.meta, mid, sae_set, dataset=corpus,
                                              n_tokens_in_prompt=0 if cfg is None else int(cfg.seq_len))))
    written = []
    with export_folder(to, [result_dir], "features", force) as tmp:
        for st, b in batches:
            out = tmp if single else tmp / st.name
            out.mkdir(parents=True, exist_ok=True)
            (out / "batch-0.json").write_text(json.dumps(b))
            written.append(dest / (out / "batch-0.json").relative_to(tmp))
    return written


# =============================================================================================
# CLI


def main(args) -> int:
    """``tracekit export sae|tables|features``; returns the exit code (2: a bad argument, with the
    argument named and the fix on stderr)."""
    from .core.errors import TracekitError  # lazy: keeps `tracekit --help` light

    try:
        if args.what == "sae":
            from .sae.export import export_sae  # lazy: keeps `tracekit --help` free of torch

            d = export_sae(args.source, args.to, model_name=args.model_name, force=args.force)
            cfg = json.loads((d / "cfg.json").read_text())
            name = (cfg.get("metadata") or cfg).get("model_name")
            print(f"SAELens directory: {d} (model_name {name!r}); load it with sae_lens.SAE.load_from_disk({str(d)!r}) "
                  f"or, without SAELens, tracekit.dictionaries.formats.load_saelens_dir({str(d)!r})")
        elif args.what == "tables":
            files = export_tables(args.run_dir, args.to, args.format, force=args.force)
            print(f"{len(files)} table(s) written to {args.to}")
        else:
            files = export_features(args.result_dir, args.to, args.model_id, args.sae_set, force=args.force)
            print(f"{len(files)} Neuronpedia/SAEDashboard batch file(s): " + ", ".join(str(f) for f in files))
    except (TracekitError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0

"""Command line: ``tracekit run CONFIG --out DIR``, ``tracekit validate CONFIG``, ``tracekit kinds``.

Exit codes: 0 success; 1 a step failed or (with ``--strict``) an expectation was not met;
2 invalid config / input / model that cannot be loaded (the message says which field and the fix).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tracekit", description="Mechanistic-interpretability experiments from YAML configs.")
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run a config; writes a run directory under --out")
    r.add_argument("config")
    r.add_argument("--out", default="results", help="parent folder of the run directory (default: results)")
    r.add_argument("--set", dest="overrides", action="append", default=[], metavar="PATH=VALUE",
                   help="override a config field, e.g. --set model.device=cpu --set experiments[0].top_k=5")
    r.add_argument("--strict", action="store_true", help="exit 1 when an expectation is not met")
    r.add_argument("--no-progress", action="store_true")
    v = sub.add_parser("validate", help="check a config without loading a model")
    v.add_argument("config")
    v.add_argument("--set", dest="overrides", action="append", default=[], metavar="PATH=VALUE")
    sub.add_parser("kinds", help="list experiment kinds and their fields")
    from .sweep import add_commands  # sweeps: `tracekit sweep`, `tracekit results` (tracekit.sweep)
    add_commands(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    from .config import ConfigError, load_config
    from .experiments import REGISTRY

    if args.cmd in ("sweep", "results"):  # sweeps: tracekit.sweep
        from .sweep import main as sweep_main
        return sweep_main(args)

    if args.cmd == "kinds":
        for kind, cls in sorted(REGISTRY.items()):
            fields = ", ".join(n for n in cls.model_fields if n not in ("kind",))
            print(f"{kind:24s} {cls.__name__}: {fields}")
        return 0

    try:
        config, _ = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.cmd == "validate":
        names = ", ".join(f"{s.step_name} ({s.kind})" for s in config.experiments)
        print(f"{args.config}: valid. model={config.model.name!r}; steps: {names}")
        return 0

    from .models import ModelLoadError
    from .runner import StepFailed, run_config
    from .tokens import TokenizationError

    import logging
    logging.getLogger("transformers").setLevel(logging.ERROR)
    try:
        run_dir, summary = run_config(config, args.out, stem=Path(args.config).stem,
                                      progress=not args.no_progress)
    except StepFailed as e:
        print(f"error: {e}", file=sys.stderr)
        bad_input = isinstance(e.__cause__, (TokenizationError, ValueError, OSError, KeyError))
        return 2 if bad_input else 1
    except (ModelLoadError, TokenizationError, ValueError, OSError, KeyError) as e:
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    print(f"run directory: {run_dir}")
    if "expectations_total" in summary:
        print(f"expectations met: {summary['expectations_met']}/{summary['expectations_total']}")
        if args.strict and summary["expectations_met"] < summary["expectations_total"]:
            return 1
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

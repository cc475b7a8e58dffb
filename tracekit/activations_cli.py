"""``tracekit cache-activations CONFIG`` (wired into :mod:`tracekit.cli`): write the activation
stores of a config's ``kind: activations`` steps, without a run directory.

The config is an ordinary run config (``model:`` and ``experiments:``); its ``activations`` steps
are checked against the tokenizer first, then the model is loaded once and each store is written
(or resumed after a kill, or found up to date). Other steps are skipped with a note (``tracekit run``
runs them). Exit codes: 0 done; 2 invalid config or store (:class:`tracekit.TracekitError`); 130
interrupted (rerun the same command to resume).
"""

from __future__ import annotations

import sys
from typing import Any

from .config import load_config
from .core.budget import memory_budget
from .core.errors import ConfigError, TracekitError
from .model.load import load_model
from .runner import check_config, seed_everything

__all__ = ["COMMANDS", "add_commands", "main"]

COMMANDS = ("cache-activations",)


def add_commands(sub) -> None:
    """Add ``cache-activations`` to the CLI's subparsers."""
    c = sub.add_parser("cache-activations", help="write the activation stores of a config's `kind: activations` "
                                                 "steps (resumable; read by linear_probe's store:, tuned.store, sae.train.store)")
    c.add_argument("config")
    c.add_argument("--set", dest="overrides", action="append", default=[], metavar="PATH=VALUE",
                   help="override a config field, e.g. --set experiments[0].path=stores/x")
    c.add_argument("--path", default=None, help="the store folder (overrides the path of the only activations step)")
    c.add_argument("--overwrite", action="store_true", help="replace a store of another plan at the path")
    c.add_argument("--no-progress", action="store_true")


def main(args) -> int:
    """``tracekit cache-activations``; returns the exit code."""
    try:
        config, _ = load_config(args.config, args.overrides)
        steps = [s for s in config.experiments if s.kind == "activations"]
        if not steps:
            raise ConfigError(f"{args.config}: no step of kind 'activations'; add one (kind: activations, path: ..., "
                              "hooks: [...], dataset / prompts / corpus)")
        if args.path is not None and len(steps) > 1:
            raise ConfigError(f"--path: the config has {len(steps)} activations steps; set each step's path instead")
        updates = {**({"path": args.path} if args.path else {}), **({"overwrite": True} if args.overwrite else {})}
        steps = [s.model_copy(update=updates) for s in steps]
        others = [s.step_name for s in config.experiments if s.kind != "activations"]
        if others:
            print(f"note: skipping steps {others} (not kind activations; `tracekit run` runs them)")
        prepared: dict[int, Any] = {}  # each step's checked inputs, handed to its run (prepared once)
        check_config(config.model_copy(update={"experiments": steps}), prepared=prepared)
        model = load_model(config.model)
        for i, s in enumerate(steps):
            seed_everything(config.seed)
            kw = {"inputs": prepared[i]} if i in prepared else {}
            with memory_budget(config.run.memory_budget):  # as the runner sets it around each step
                result = s.run(model, progress=not args.no_progress, check=False, **kw)
            print(result.report())
    except TracekitError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: rerun the same command to resume the store (complete shards are kept)", file=sys.stderr)
        return 130
    return 0

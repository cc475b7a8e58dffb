"""Command line: ``tracekit run``, ``validate``, ``kinds``, ``show``, ``trace``, ``sweep``, ``results``, ``cache``,
``verify``.

Exit codes: 0 success; 1 a step failed or (with ``--strict``) an expectation was not met; 2 invalid
config / input / model / output folder (every :class:`tracekit.TracekitError`; the message names the
field and the fix); 130 interrupted by Ctrl-C, 143 by SIGTERM (finished steps are kept and the run's
status says where it stopped).
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
    v = sub.add_parser("validate", help="check a config against the model's tokenizer and config (no weights)")
    v.add_argument("config")
    v.add_argument("--set", dest="overrides", action="append", default=[], metavar="PATH=VALUE")
    v.add_argument("--schema-only", action="store_true", help="check only the YAML schema (no tokenizer)")
    sub.add_parser("kinds", help="list experiment kinds and their fields")
    vf = sub.add_parser("verify", help="check tracekit's invariants on a model against plain transformers "
                                       "(a table, and verify.json)")
    vf.add_argument("model", nargs="?", default="smollm2-135m",
                    help="hub id, local directory, .gguf file or smollm2-135m (default)")
    vf.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (default auto)")
    vf.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    vf.add_argument("--tokenizer", default=None, help="tokenizer directory or hub id (default: the model's own)")
    vf.add_argument("--no-process-weights", action="store_true",
                    help="verify the model without TransformerLens' weight processing")
    vf.add_argument("--out", default=None, help="folder for verify.json (default: results/verify-<model>)")
    s = sub.add_parser("show", help="show a run directory: status, steps, headline numbers")
    s.add_argument("run_dir")
    # --- cache: every cache tracekit writes (weights, processed weights, trained SAEs) ------------
    c = sub.add_parser("cache", help="list tracekit's caches (weights, trained SAEs) or empty them (tracekit cache clear)")
    c.add_argument("action", nargs="?", choices=["list", "clear"], default="list")
    from .sweep import add_commands  # sweeps: `tracekit sweep`, `tracekit results` (tracekit.sweep)
    add_commands(sub)
    _trace_parser(sub)
    return p


# ---- tracekit trace (the "Life of a Token" report; kind token_trace) ------------------------------
def _trace_parser(sub) -> None:
    t = sub.add_parser("trace", help="trace one prompt through every stage; writes report.html/report.md")
    t.add_argument("prompt")
    t.add_argument("--target", default=None, help="next token followed, e.g. ' Paris' (default: the model's top-1)")
    t.add_argument("--foil", default=None, help="second token: attribute logit[target] - logit[foil]")
    t.add_argument("--head", default=None, help="head whose raw scores are shown, e.g. L0H6")
    t.add_argument("--model", default=None, help="model spec (name or path; default: the embedded model)")
    t.add_argument("--device", default=None, help="device for the model (default: the spec's)")
    t.add_argument("--key-max-tokens", type=int, default=1024, help="corpus tokens for the key readout (0: skip)")
    t.add_argument("--out", default="results/trace", help="output folder (default: results/trace)")


def _trace(args) -> int:
    import time

    from .errors import TracekitError
    from .experiments.trace import TokenTrace
    from .model.load import load_model

    try:
        exp = TokenTrace(prompts=args.prompt, target=args.target, foil=args.foil, head=args.head,
                         key_max_tokens=args.key_max_tokens)
    except ValueError as e:
        _err(str(e))
        return 2
    try:
        kw = {"device": args.device} if args.device else {}
        model = load_model(args.model, **kw)
        t0 = time.perf_counter()
        res = exp.run(model, progress=False)
        d = res.save(args.out)
    except TracekitError as e:
        _err(f"{type(e).__name__}: {e}")
        return 2
    print(res.report())
    print(f"report: {d / 'report.html'} ({time.perf_counter() - t0:.1f} s after the model loaded)")
    return 0


def _verify(args) -> int:
    """``tracekit verify MODEL``: every check of :mod:`tracekit.verify` against an independent
    transformers copy of the same weights; prints the table, writes verify.json; exit 0 when no
    check failed, 1 when one did, 2 when the model cannot be had."""
    import re
    from typing import cast

    import torch

    from .errors import ModelLoadError, TracekitError
    from .model.load import load_model
    from .model.source import _load_hf
    from .model.spec import DTYPES, ModelSpec, resolve_device
    from .verify import HFReference, _bridge_layers_path, verify_model

    try:
        spec = ModelSpec(name=args.model, device=args.device, dtype=args.dtype, tokenizer=args.tokenizer,
                         process_weights=not args.no_process_weights, verify=False)
        model = load_model(spec)
        dev = resolve_device(spec.device) if spec.device_map is None and not spec.n_devices else "cpu"
        hf, _, _ = _load_hf(spec, DTYPES[spec.dtype], dev)
        # transformers types PreTrainedModel.to as an unbound functools wrapper: call it as a Module's
        cast(torch.nn.Module, hf).to(next(model.parameters()).device)
        layers_path = _bridge_layers_path(model)
        if layers_path is None:  # load_model refuses a bridge without blocks
            raise ModelLoadError(f"{spec.name}: the bridge names no decoder layers (adapter.component_mapping['blocks'])")
        ref = HFReference(hf, layers_path)
    except (TracekitError, ValueError) as e:
        _err(f"{type(e).__name__}: {e}")
        return 2
    other = spec.model_copy(update={"process_weights": not spec.process_weights,
                                    "padding_side": "left" if spec.padding_side == "right" else "right"})
    rep = verify_model(model, ref, second_load=lambda: load_model(other))
    print(rep.table())
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(args.model).name or args.model).strip("_") or "model"
    out = rep.save(Path(args.out) if args.out else Path("results") / f"verify-{slug}")
    print(f"written: {out}")
    return 0 if rep.passed else 1


def _err(msg: str) -> None:
    print(f"error: {msg}", file=sys.stderr)


def _show(run_dir: str) -> int:
    from .runner import read_status

    d = Path(run_dir)
    if not d.is_dir():
        _err(f"{run_dir!r} is not a folder")
        return 2
    st = read_status(d)
    line = f"{d}: {st.get('status')}"
    if st.get("process_gone"):
        line += " (its process is gone: killed)"
    if st.get("step"):
        line += f" at step {st['step']!r}"
    print(line)
    if st.get("error"):
        print(f"  error: {st['error']}")
    for name in st.get("steps", []):
        done = name in st.get("finished", [])
        print(f"  {'done' if done else '----'}  {name}")
    summ = d / "summary.json"
    if summ.is_file():
        s = json.loads(summ.read_text())
        if "expectations_total" in s:
            print(f"  expectations met: {s['expectations_met']}/{s['expectations_total']}")
    return 0 if st.get("status") == "complete" else 1


def _cache_cmd(action: str) -> int:
    """``tracekit cache [list|clear]``: every cache tracekit writes: the weight cache (dequantised
    GGUF weights and TransformerLens' processed weights) and the trained SAEs, one line per entry
    (size, key, created, what it holds), leftovers of killed writers included."""
    from .model import weights_cache as cache
    from .sae import clear_sae_cache, sae_cache_dir, sae_cache_entries

    root = cache.cache_dir()
    if action == "clear":
        n, freed = cache.clear_cache_dir()
        n2, freed2 = clear_sae_cache()
        print(f"removed {n} weight entr{'y' if n == 1 else 'ies'} ({freed / 2**20:.1f} MiB) and {n2} SAE"
              f"{'' if n2 == 1 else 's'} ({freed2 / 2**20:.1f} MiB) from {root}")
        return 0
    print(f"tracekit cache: {root}" + ("" if cache.cache_enabled() else " (disabled: TRACEKIT_CACHE=off)"))
    total = n = 0
    sections = [(f"weights ({cache._gguf_root()})", cache.list_entries(), "load",
                 lambda r: f"{r.get('dtype') or '?'}  {r.get('gguf_path') or '?'}"),
                (f"trained SAEs ({sae_cache_dir()})", sae_cache_entries(), "training", lambda r: r.get("hook") or "?")]
    for title, rows, when, what in sections:
        print(f"{title}:")
        if not rows:
            print("  (empty)")
        for r in rows:
            flag = "" if r["valid"] else f"  [invalid or unfinished: removed on the next {when}]"
            print(f"  {r['size_bytes'] / 2**20:8.1f} MiB  {r['key']}  created {r.get('created') or '?'}  {what(r)}{flag}")
            total += r["size_bytes"]
        n += len(rows)
    print(f"  {n} entr{'y' if n == 1 else 'ies'}, {total / 2**20:.1f} MiB")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    from .config import load_config
    from .errors import TracekitError
    from .experiments import REGISTRY

    if args.cmd == "cache":
        return _cache_cmd(args.action)
    if args.cmd in ("sweep", "results"):  # sweeps: tracekit.sweep
        from .sweep import main as sweep_main
        return sweep_main(args)

    if args.cmd == "kinds":
        for kind, cls in sorted(REGISTRY.items()):
            fields = ", ".join(n for n in cls.model_fields if n not in ("kind",))
            print(f"{kind:24s} {cls.__name__}: {fields}")
        return 0
    if args.cmd == "show":
        return _show(args.run_dir)
    if args.cmd == "verify":
        return _verify(args)
    if args.cmd == "trace":
        return _trace(args)

    import logging

    logging.getLogger("transformers").setLevel(logging.ERROR)
    try:
        config, _ = load_config(args.config, args.overrides)
        if args.cmd == "validate":
            names = ", ".join(f"{s.step_name} ({s.kind})" for s in config.experiments)
            if not args.schema_only:
                from .runner import check_config

                check_config(config)
            what = "schema" if args.schema_only else "schema, tokenizer and model config"
            print(f"{args.config}: valid ({what}). model={config.model.name!r}; steps: {names}")
            return 0
    except TracekitError as e:
        _err(str(e))
        return 2

    from .runner import RunInterrupted, StepFailed, run_config

    try:
        run_dir, summary = run_config(config, args.out, stem=Path(args.config).stem, progress=not args.no_progress)
    except RunInterrupted as e:
        print(f"interrupted: {e}", file=sys.stderr)
        return 128 + int(e.signum)
    except KeyboardInterrupt:
        print("interrupted before the run started; nothing was written", file=sys.stderr)
        return 130
    except StepFailed as e:
        _err(str(e))
        return 2 if isinstance(e.__cause__, TracekitError) else 1
    except TracekitError as e:
        _err(f"{type(e).__name__}: {e}")
        return 2
    print(f"run directory: {run_dir}")
    if "expectations_total" in summary:
        print(f"expectations met: {summary['expectations_met']}/{summary['expectations_total']}")
        if args.strict and summary["expectations_met"] < summary["expectations_total"]:
            return 1
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

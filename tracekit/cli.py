"""Command line: ``tracekit run``, ``validate``, ``kinds``, ``show``, ``trace``, ``sweep``, ``results``, ``cache``,
``verify``.

Exit codes: 0 success; 1 a step failed or (with ``--strict``) an expectation was not met; 2 invalid
config / input / model / output folder (every :class:`tracekit.TracekitError`; the message names the
field and the fix); 130 interrupted by Ctrl-C, 143 by SIGTERM (finished steps are kept and the run's
status says where it stopped).

Start-up: this module imports no torch. ``tracekit --help``, ``tracekit kinds [KIND]``, ``tracekit
validate --schema-only`` and ``tracekit show`` read the generated schema
(:mod:`tracekit.core.schema_check`) instead of the kind classes; every other command imports what it
needs when it runs (``# lazy:`` imports). Sub-commands defined in other modules are listed in
:data:`PLUGIN_COMMANDS` and imported only when one of them runs.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import shutil
import sys
import textwrap
from pathlib import Path
from typing import Any, Callable, Optional

from .core import schema_check
from .core.errors import ConfigError, TracekitError
from .core.yamlconf import apply_override, load_raw

#: Sub-commands defined in other modules: command -> (module, one-line help). The module is imported
#: only when its command runs (it may import torch); it has ``add_commands(subparsers)`` adding its
#: parsers and ``main(args) -> int``. The help text here is what ``tracekit --help`` lists (a test
#: checks it equals the module's own).
PLUGIN_COMMANDS: dict[str, tuple[str, str]] = {
    "sweep": ("tracekit.sweep.cli", "run a config's sweep block: one run per point, an index (resumable)"),
    "results": ("tracekit.sweep.cli", "print a sweep's index (and draw a comparison figure)"),
    "cache-activations": ("tracekit.activations_cli", "write the activation stores of a config's `kind: activations` "
                                                      "steps (resumable; read by linear_probe's store:, tuned.store, sae.train.store)"),
    "cache": ("tracekit.cache_cli", "list tracekit's caches (weights, trained SAEs, tuned lenses, transcoders, their "
                                    "activation stores, model info) or empty them (tracekit cache clear [NAME ...])"),
    "export": ("tracekit.export", "export an SAE (SAELens directory), a run's tables (CSV/Parquet) or SAE features "
                                  "(Neuronpedia/SAEDashboard JSON)"),
}

#: Environment switches that silence library progress bars (``--no-progress``): tqdm (SAELens'
#: training bar and every other tqdm bar; read when tqdm is imported), Hugging Face datasets and hub.
QUIET_ENV = {"TQDM_DISABLE": "1", "HF_DATASETS_DISABLE_PROGRESS_BARS": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}


def _parser(argv: Optional[list[str]] = None) -> argparse.ArgumentParser:
    """The argument parser. ``argv`` picks which :data:`PLUGIN_COMMANDS` module to import (only the
    one whose command is being run; the others are listed by name and help only)."""
    p = argparse.ArgumentParser(prog="tracekit", description="Mechanistic-interpretability experiments from YAML configs.")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    r = sub.add_parser("run", help="run a config; writes a run directory under --out")
    r.add_argument("config")
    r.add_argument("--out", default="results", help="parent folder of the run directory (default: results)")
    r.add_argument("--set", dest="overrides", action="append", default=[], metavar="PATH=VALUE",
                   help="override a config field, e.g. --set model.device=cpu --set experiments[0].top_k=5")
    r.add_argument("--strict", action="store_true", help="exit 1 when an expectation is not met")
    r.add_argument("--no-progress", action="store_true", help="no progress bars (tracekit's and the libraries')")
    v = sub.add_parser("validate", help="check configs against the model's tokenizer and config (no weights); "
                                        "lists every problem, one result line per file; sweeps: every point")
    v.add_argument("config", nargs="+", help="one or more config files (a shell glob works: experiments/*.yaml); "
                                             "a config with a sweep block is expanded and every point checked")
    v.add_argument("--set", dest="overrides", action="append", default=[], metavar="PATH=VALUE",
                   help="override a field in every file")
    v.add_argument("--schema-only", action="store_true",
                   help="only keys, types, required fields, ranges and kinds, from the generated schema (fast, no "
                        "torch); the kinds' own validators and the tokenizer checks run without this flag")
    k = sub.add_parser("kinds", help="list experiment kinds; `tracekit kinds KIND` lists a kind's fields")
    k.add_argument("kind", nargs="?", default=None, help="a kind: print each field's type, default and description")
    vf = sub.add_parser("verify", help="check tracekit's invariants on a model against plain transformers "
                                       "(a table, and verify.json)")
    vf.add_argument("model", nargs="?", default="smollm2-135m",
                    help="hub id, local directory, .gguf file, gemma3-270m, or smollm2-135m (default)")
    vf.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (default auto)")
    vf.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    vf.add_argument("--tokenizer", default=None, help="tokenizer directory or hub id (default: the model's own)")
    vf.add_argument("--no-process-weights", action="store_true",
                    help="verify the model without TransformerLens' weight processing")
    vf.add_argument("--out", default=None, help="folder for verify.json (default: results/verify-<model>)")
    s = sub.add_parser("show", help="show a run directory: status, steps, headline numbers")
    s.add_argument("run_dir")
    s.add_argument("--max", type=int, default=6, help="headline numbers per step (default 6; 0: all)")
    _trace_parser(sub)
    _plugin_parsers(sub, _command_of(argv))
    return p


def _command_of(argv: Optional[list[str]]) -> Optional[str]:
    """The sub-command named in ``argv`` (its first word not starting with ``-``)."""
    return next((a for a in (sys.argv[1:] if argv is None else argv) if not a.startswith("-")), None)


def _plugin_parsers(sub, cmd: Optional[str]) -> None:
    """Add :data:`PLUGIN_COMMANDS`: the real parsers of ``cmd``'s module, placeholders for the others."""
    if cmd in PLUGIN_COMMANDS:
        importlib.import_module(PLUGIN_COMMANDS[cmd][0]).add_commands(sub)
    for name, (_, help_text) in PLUGIN_COMMANDS.items():
        if name not in sub.choices:
            sub.add_parser(name, help=help_text, add_help=False)


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

    from .experiments.trace import TokenTrace  # lazy: torch and the model only for this command
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

    import torch  # lazy: torch, transformers and the model only for this command

    from .errors import ModelLoadError
    from .model.load import load_model
    from .model.source import load_hf
    from .model.spec import DTYPES, ModelSpec, load_device
    from .verify import HFReference, bridge_layers_path, verify_model

    try:
        spec = ModelSpec(name=args.model, device=args.device, dtype=args.dtype, tokenizer=args.tokenizer,
                         process_weights=not args.no_process_weights, verify=False)
        model = load_model(spec)
        dev = load_device(spec)
        hf, _, _ = load_hf(spec, DTYPES[spec.dtype], dev)
        # transformers types PreTrainedModel.to as an unbound functools wrapper: call it as a Module's
        cast(torch.nn.Module, hf).to(next(model.parameters()).device)
        layers_path = bridge_layers_path(model)
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


def _schema() -> dict:
    """The generated kinds schema; when it is out of date (a kind's source changed since it was
    written), the same schema computed from the live classes (imports torch: seconds)."""
    data = schema_check.load_schema()
    if data is None:
        from .config import kinds_schema  # lazy: imports every kind (torch); only for a stale schema file

        data = kinds_schema()
    return data


def _plain(text: str) -> str:
    """Docstring markup as terminal text: ``:mod:`~a.b``` -> ``a.b``, double backticks -> plain."""
    text = re.sub(r":\w+:`~?([^`]+)`", r"\1", text)
    return re.sub(r"``(.+?)``", r"\1", text)


def _width() -> int:
    return max(60, min(120, shutil.get_terminal_size((100, 24)).columns))


def _wrap(text: str, indent: int) -> str:
    return textwrap.fill(_plain(text), width=_width(), initial_indent=" " * indent, subsequent_indent=" " * indent)


def _one_line(text: str, width: int) -> str:
    """The first sentence of ``text``, cut to ``width`` characters."""
    text = _plain(text)
    m = re.search(r"\.\s+(?=[A-Z])", text)
    text = text[:m.start() + 1] if m else text
    return text if len(text) <= width else text[:width - 3].rstrip() + "..."


def _field_lines(fields: list[dict]) -> list[str]:
    out = []
    for f in fields:
        default = "required" if f["default"] == "required" else f"default {f['default']}"
        extra = f"; {f['constraints']}" if f["constraints"] else ""
        out.append(f"  {f['name']}: {f['type']}  ({default}{extra})")
        out.append(_wrap(f["description"] or "(undocumented)", 6))
    return out


def _kinds(kind: Optional[str]) -> int:
    """``tracekit kinds``: one line per kind; ``tracekit kinds KIND``: every field of KIND (type,
    default, constraints, description: the rows of docs/reference/config.md) and of the config
    classes nested in it."""
    schema = _schema()
    kinds = schema["kinds"]
    if kind is None:
        width = max(map(len, kinds))
        for name, k in kinds.items():
            print(f"{name:{width}s}  {_one_line(k['summary'], _width() - width - 2)}")
        print("\n`tracekit kinds KIND` lists a kind's fields (type, default, description).")
        return 0
    if kind not in kinds:
        _err(f"unknown experiment kind {kind!r}{schema_check.close_matches(kind, kinds)} "
             f"(known kinds: {', '.join(kinds)})")
        return 2
    k = kinds[kind]
    lines = [f"kind: {kind}  ({k['class']})", _wrap(k["summary"], 2), "", "fields:"] + _field_lines(k["fields"])
    for name in k["nested"]:
        n = schema["nested"][name]
        lines += ["", f"{name} (nested):", _wrap(n["summary"], 2)] + _field_lines(n["fields"])
    print("\n".join(lines))
    return 0


def _step_names(problems: list[str], raw: Any) -> list[str]:
    """Each ``experiments[i]...: msg`` line with the step's name and kind after its path."""
    steps = raw.get("experiments") if isinstance(raw, dict) else None
    out = []
    for line in problems:
        path, sep, msg = line.partition(": ")
        if sep and path.startswith("experiments[") and isinstance(steps, list):
            i = int(path[len("experiments["):path.index("]")])
            st = steps[i] if i < len(steps) and isinstance(steps[i], dict) else {}
            if st.get("kind") is not None and "(" not in path:
                path += f" (step {st.get('name', st['kind'])!r}, kind {st['kind']})"
        out.append(path + sep + msg)
    return out


def _load_raw(args) -> dict:
    raw = load_raw(args.config)
    for a in args.overrides:
        apply_override(raw, a)
    return raw


def _validate(args) -> int:
    """``tracekit validate A.yaml [B.yaml ...]``: each file checked (every problem of a file in one
    pass), one result line per file; exit 2 when any file is invalid, else 0. Files naming the same
    model share its tokenizer and config (read once per process, :func:`tracekit.model.load_model_info`).
    A config with a ``sweep`` block is expanded and every point checked (:func:`_validate_sweep`).
    ``--schema-only`` checks the generated schema only (no torch, :mod:`tracekit.core.schema_check`)."""
    bad = [path for path in args.config if _validate_one(path, args) != 0]
    if len(args.config) > 1:
        print(f"{len(args.config) - len(bad)}/{len(args.config)} file(s) valid" +
              (f"; invalid: {', '.join(bad)}" if bad else ""))
    return 2 if bad else 0


def _validate_one(path: str, args) -> int:
    """:func:`_validate` of one file: prints its result line (stdout) or its problems (stderr)."""
    raw = None
    try:
        raw = load_raw(path)
        for a in args.overrides:
            apply_override(raw, a)
        if isinstance(raw, dict) and "sweep" in raw:
            return _validate_sweep(path, raw, args.schema_only)
        if args.schema_only:
            problems = _step_names(schema_check.check_raw(raw, _schema()), raw)
            if problems:
                raise ConfigError(f"{path}: invalid config:\n  " + "\n  ".join(problems))
            names = ", ".join(f"{s.get('name', s['kind'])} ({s['kind']})" for s in raw["experiments"])
            model = (raw.get("model") or {}).get("name", "smollm2-135m")
        else:
            from .config import parse_config  # lazy: the kind classes import torch
            from .runner import check_config  # lazy: tokenizer and model config

            config = parse_config(raw, source=str(path))
            check_config(config)
            names = ", ".join(f"{s.step_name} ({s.kind})" for s in config.experiments)
            model = config.model.name
    except TracekitError as e:
        _validate_error(path, e, raw)
        return 2
    what = "schema" if args.schema_only else "schema, tokenizer and model config"
    print(f"{path}: valid ({what}). model={model!r}; steps: {names}")
    return 0


def _validate_error(path: str, e: TracekitError, raw: Any) -> None:
    """Print a file's problems (stderr), its name first."""
    lines = _step_names(str(e).split("\n  "), raw)
    text = "\n  ".join(lines) if isinstance(e, ConfigError) else f"{type(e).__name__}: " + "\n  ".join(lines)
    _err(text if text.startswith(str(path)) else f"{path}: {text}")


def _validate_sweep(path: str, raw: dict, schema_only: bool) -> int:
    """Validate a sweep config: the grid expanded (:func:`tracekit.sweep.expand.expand_sweep`: each
    point's config parsed, the ``compare`` metrics checked against the kinds' summary keys) and each
    point checked against its model's tokenizer and config as a single config is. With
    ``schema_only``: the base config (the sweep block left out) against the schema.

    Raises:
        TracekitError: the sweep block, a point's config or a point's inputs are invalid (every
            invalid point listed, each with its parameters).
    """
    if schema_only:
        base = {k: v for k, v in raw.items() if k != "sweep"}
        problems = _step_names(schema_check.check_raw(base, _schema()), base)
        if problems:
            raise ConfigError(f"{path}: invalid config (the sweep's base config):\n  " + "\n  ".join(problems))
        print(f"{path}: base config valid (schema); the sweep's points are expanded and checked without "
              "--schema-only; run with `tracekit sweep`")
        return 0
    from .runner import check_config  # lazy: tokenizer and model config
    from .sweep.expand import check_compare, expand_sweep  # lazy: imports the kind classes (torch)

    points, _ = expand_sweep(raw, source=str(path))
    failed: list[tuple[str, TracekitError]] = []
    for p in points:
        try:
            check_config(p.config)
        except TracekitError as e:
            failed.append((f"point {p.index} ({p.label}): " + "\n    ".join(str(e).split("\n  ")), e))
    if failed:
        msg = f"{path}: {len(failed)} of {len(points)} sweep point(s) are invalid:\n  " + \
            "\n  ".join(m for m, _ in failed)
        try:
            err = type(failed[0][1])(msg)
        except TypeError:  # a subclass with its own constructor
            err = TracekitError(msg)
        raise err
    unchecked = check_compare(points, raw.get("sweep") or {}, str(path))
    note = (f"; compare metrics of {', '.join(unchecked)} are checked when drawn (the kind declares no summary "
            "keys)") if unchecked else ""
    models = len({p.model_key for p in points})
    print(f"{path}: {len(points)} configs valid (schema, tokenizer and model config; {models} model(s)){note}; "
          "run with `tracekit sweep`")
    return 0


def _fmt(v: Any) -> str:
    """A summary value as short text: numbers to 4 significant digits, lists by their first items."""
    if isinstance(v, bool) or v is None:
        return "null" if v is None else str(v).lower()
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, str):
        return repr(v) if v != v.strip() or not v else v
    if isinstance(v, list):
        return "[" + ", ".join(_fmt(x) for x in v[:4]) + (f", ... ({len(v)} items)]" if len(v) > 4 else "]")
    if isinstance(v, dict):
        items = list(v.items())
        return "{" + ", ".join(f"{k}: {_fmt(x)}" for k, x in items[:3]) + (", ...}" if len(items) > 3 else "}")
    return str(v)


def _metric(summary: dict, key: str) -> tuple[bool, Any]:
    """``(found, value)`` of a summary key, ``key[i]`` indexing a list."""
    m = re.fullmatch(r"(\w+)\[(-?\d+)\]", key)
    if m is None:
        return key in summary, summary.get(key)
    v = summary.get(m[1])
    i = int(m[2])
    ok = isinstance(v, list) and -len(v) <= i < len(v)
    return ok, v[i] if ok else None  # type: ignore[index]


def _headline(summary: dict, first: list[str], n: int) -> list[tuple[str, Any]]:
    """Headline ``(key, value)`` pairs of a step's summary: the kind's ``headline_keys`` and the
    step's expectation metrics (``first``) first, then floats, other scalars (counts ``n_*`` last),
    lists and dicts; the first ``n`` (all when ``n <= 0``)."""
    s = {k: v for k, v in summary.items() if k not in ("expectations", "steps")}
    pairs = [(k, v) for k in dict.fromkeys(first) for ok, v in [_metric(s, k)] if ok]
    seen = {k for k, _ in pairs}

    def rank(k: str) -> int:
        v = s[k]
        if isinstance(v, float):
            return 0
        if isinstance(v, (list, dict)):
            return 3
        return 2 if k.startswith("n_") else 1

    rest = sorted((k for k in s if k not in seen), key=rank)  # stable: the summary's order within a rank
    pairs += [(k, s[k]) for k in rest]
    return pairs[:n] if n > 0 else pairs


def _show(args) -> int:
    """``tracekit show RUN``: status, then one row per headline number of each step (from the step's
    saved ``summary.json``; the kind's ``headline_keys`` and the step's expectation metrics first,
    :func:`_headline`), then the expectations."""
    from .runner import read_status  # lazy: the runner imports torch; read_status itself does not need it

    d = Path(args.run_dir)
    if not d.is_dir():
        _err(f"{args.run_dir!r} is not a folder")
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
    schema = _schema()  # a stale schema file: the live classes' headline keys (else show drops them)
    rows = []
    for name in st.get("steps", []):
        done = name in st.get("finished", [])
        kind = summ = None
        expect: list = []
        try:
            kind = json.loads((d / name / "manifest.json").read_text()).get("kind")
            summ = json.loads((d / name / "summary.json").read_text())
            expect = [e.get("metric") for e in json.loads((d / name / "config.json").read_text()).get("expect") or []]
        except (OSError, ValueError, AttributeError):
            pass
        first = schema["kinds"].get(kind, {}).get("headline_keys", []) + [m for m in expect if isinstance(m, str)]
        pairs = _headline(summ, first, args.max) if isinstance(summ, dict) else []
        state = "done" if done else "----"
        if not pairs:
            rows.append([name, kind or "", state, "", ""])
        for j, (key, val) in enumerate(pairs):
            rows.append([name, kind or "", state, key, _fmt(val)] if j == 0 else ["", "", "", key, _fmt(val)])
    if rows:
        _print_table(rows, ["step", "kind", "status", "metric", "value"])
    summ_file = d / "summary.json"
    if summ_file.is_file():
        s = json.loads(summ_file.read_text())
        if "expectations_total" in s:
            print(f"expectations met: {s['expectations_met']}/{s['expectations_total']}")
    return 0 if st.get("status") == "complete" else 1


def _print_table(rows: list[list[str]], header: list[str]) -> None:
    cells = [header] + [[c[:60] for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    for r in cells:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())


def _progress_line(line: str) -> None:
    """``tracekit run``'s progress lines (model load, step start/end, ETAs): stderr, flushed, so
    stdout keeps the reports and a redirected log shows them as they happen."""
    print(line, file=sys.stderr, flush=True)


def _run(args) -> int:
    """``tracekit run CONFIG``: validate, run every step into a fresh run directory."""
    import logging

    from .config import parse_config  # lazy: the kinds and the runner import torch
    from .runner import RunInterrupted, StepFailed, run_config

    logging.getLogger("transformers").setLevel(logging.ERROR)
    try:
        config = parse_config(_load_raw(args), source=str(args.config))
    except TracekitError as e:
        _err(str(e))
        return 2
    try:
        run_dir, summary = run_config(config, args.out, stem=Path(args.config).stem, progress=not args.no_progress,
                                      progress_log=_progress_line)
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


def silence_progress() -> None:
    """Turn off every progress bar of this process and its children: tracekit's own are turned off by
    the caller (``progress=False``); this sets :data:`QUIET_ENV` (tqdm reads ``TQDM_DISABLE`` when it
    is imported, so call this first) and, when already imported, transformers' and the hub's switches."""
    os.environ.update(QUIET_ENV)
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging  # lazy: only when already imported

        hf_logging.disable_progress_bar()
    if "huggingface_hub" in sys.modules:
        from huggingface_hub.utils import disable_progress_bars  # lazy: only when already imported

        disable_progress_bars()


#: Built-in commands: name -> handler (``args -> exit code``).
COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "run": _run, "validate": _validate, "kinds": lambda a: _kinds(a.kind), "show": _show,
    "verify": _verify, "trace": _trace,
}


def main(argv: list[str] | None = None) -> int:
    """Run the command line (``argv`` default: ``sys.argv[1:]``); returns the exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parser(argv).parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if getattr(args, "no_progress", False):
        silence_progress()
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    try:
        if args.cmd in PLUGIN_COMMANDS:
            return importlib.import_module(PLUGIN_COMMANDS[args.cmd][0]).main(args)
        return COMMANDS[args.cmd](args)
    except BrokenPipeError:  # output piped into `head` and cut: not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

"""Sweeps: one config expanded over field values, every point its own run, one index.

A config with a ``sweep`` block::

    model: {name: smollm2-135m}
    seed: 0                                   # the sweep seed: each point's seed derives from it
    experiments:
      - {kind: logit_lens, name: lens, prompts: ["The capital of France is"], target: " Paris"}
    sweep:
      grid:                                   # every combination (product) of these
        model.name: [smollm2-135m, gpt2]
        experiments[0].target: [" Paris", " London"]
      zip:                                    # paired lists (same length): one axis of the grid
        experiments[0].prompts:
          capitals: ["The capital of France is"]       # a mapping names its values (index shows the name)
          rivers: ["The river through Paris is the"]
        experiments[0].name: [lens_capitals, lens_rivers]
      compare: [lens/target_prob_by_hidden_state]    # figures overlaying a metric over points (optional)
      figures: false                          # each point's own figures (PNG); default false (speed)

Any field path works (``model.name``, ``experiments[0].target``, ``seed``). Unless ``seed`` is swept,
each point's ``seed`` is derived from the sweep seed and the point's parameters
(:func:`derive_seed`) and recorded, so the same sweep gives the same numbers.

``tracekit sweep CONFIG --out DIR`` writes::

    DIR/sweep.yaml                   the config as given (after --set)
    DIR/index.parquet                the wide index: one row per point, scalar metrics (rewritten after every point)
    DIR/metrics.parquet              the long table: one row per point, step, metric and element
    DIR/index.json                   steps' kinds, headline columns, constant columns and their value
    DIR/runs/<hash>/<pNNN>-<time>/   the point's run directory (tracekit run's layout)
    DIR/runs/<hash>/point.json       the point's record: parameters, seed, status, error, timings
    DIR/compare-<metric>.png         figures named in ``compare``

``<hash>`` is :func:`config_hash` of the point's validated config. Rerunning a sweep into the same
``DIR`` continues it: a point whose hash already has a complete run (``status.json`` says
``complete``) is skipped, anything partial is deleted and redone from scratch. A failing point
records its error and the sweep goes on; the exit code is 1 when any point failed (130 when
interrupted, 2 for an invalid config). Killing the process loses at most the points in flight.

The index (:mod:`.index`): ``point``, ``label``, one column per swept path (the value, or its name
when values are named), ``status``, ``error``, ``seed``, ``config_hash``, ``run_dir`` (absolute when
loaded), ``started``, ``seconds``; ``<step>/<key>`` for every scalar of every step's summary;
``summary`` (all step summaries as JSON); ``env/...``. Lists and mappings (curves by hidden
state, rankings) are rows of the long table (``metric``, ``element``, ``index``, ``value``,
``text``), never ``key[i]`` columns; metric and ``env`` columns with one value in every point are
left out of the wide table (``index.json`` keeps the value). :func:`load_results` (wide),
:func:`load_metrics` (long), :func:`load_point` (one point's Result, from any working directory),
:func:`compare` (one metric over points; log / rank axes).

A sweep over ``target`` of a logit lens runs one lens pass for all targets
(:mod:`tracekit.experiments.onepass`), split back into per-point results equal to separate runs.

Executors: ``local`` groups the points by model so each model loads once; ``ray`` (the
``sweeps`` extra) runs one actor per GPU (or ``--workers N`` CPU actors without GPUs), each keeping
its model loaded, with points handed to actors by model (the points sharing one lens pass together,
to one actor); workers write run directories into the
shared ``DIR`` and the driver keeps the index.

Modules: :mod:`.expand` (points, seeds, hashes), :mod:`.index` (records, ``index.parquet``),
:mod:`.executors` (one point, local, Ray), :mod:`.run` (:func:`run_sweep`), :mod:`.figures`
(:func:`compare`), :mod:`.cli` (``tracekit sweep`` / ``tracekit results``).
"""

# (``X as X``: re-exported for tracekit.cli and older callers, outside ``__all__`` as before)
from .cli import COMMANDS as COMMANDS
from .cli import add_commands as add_commands
from .cli import main as main
from .executors import execute_point as execute_point
from .expand import SWEEP_KEYS as SWEEP_KEYS
from .expand import Point, config_hash, derive_seed, expand_sweep
from .figures import compare
from .index import INDEX, headline_columns, load_metrics, load_point, load_results, run_status, stable_columns
from .index import VOLATILE as VOLATILE
from .index import build_index as build_index
from .index import write_index as write_index
from .run import SweepOutcome, run_sweep

__all__ = [
    "INDEX",
    "Point",
    "SweepOutcome",
    "compare",
    "config_hash",
    "derive_seed",
    "expand_sweep",
    "headline_columns",
    "load_metrics",
    "load_point",
    "load_results",
    "run_status",
    "run_sweep",
    "stable_columns",
]

"""Path patching experiment (``kind: path_patching``): each sender (or group of senders) patched
from the source run into chosen receivers only, exactly. The method: :mod:`tracekit.circuits.paths`;
rows: :class:`tracekit.experiments.circuit_rows.CircuitRowsExperiment`::

    from tracekit import PathPatching, load_model
    rows = {"generator": {"name": "ioi", "n": 12}, "filter": "correct"}
    PathPatching(dataset=rows, senders=["a1?.h*"], receivers=["a23.h3<q>"]).run(load_model()).summary()
"""

from __future__ import annotations

import fnmatch
from typing import Literal, Union

import numpy as np
import pandas as pd
from pydantic import Field

from ..circuits.graph import build_graph
from ..circuits.paths import path_patch
from ..dataset.paired import PairedRows
from ..errors import MethodRefused
from ..model.info import HookedModel
from .base import Result, register
from .circuit_rows import CircuitRowsExperiment, Mode
from .circuits_tables import bar_chart
from .patching_tables import column, is_missing, records, where

__all__ = ["PathPatching", "PathPatchingResult"]


class PathPatchingResult(Result):
    """Result of :class:`PathPatching`.

    Tables: ``main`` (one line per variant x row, plus ``scope`` = ``mean`` lines: ``senders``,
    ``receivers``, ``value`` = the path-patched metric, ``base`` = the unpatched base run's,
    ``delta`` = value - base, ``normalized`` = (value - corrupted) / (clean - corrupted), ``effect``
    = normalized for denoising, 1 - normalized for noising); ``rows``.

    Summary keys: ``mode``, ``recipe`` (the rule for receivers in several blocks: ``wang`` or
    ``live``), ``metric``, ``n_rows``, ``receivers``, ``n_variants``, ``skipped``
    (expanded senders dropped because they write after a receiver reads), ``mean_clean``,
    ``mean_corrupted``, ``effects`` (per variant ``{senders, mean_delta, mean_effect}``, by |effect|).
    """

    config: "PathPatching"
    main_table = "main"
    table_names = ("main", "rows")
    summary_keys = ("mode", "recipe", "metric", "n_rows", "receivers", "n_variants", "skipped", "mean_clean", "mean_corrupted",
                    "effects", "chunks")

    def summary(self) -> dict:
        df = self.tables["main"]
        mean = where(df, df["scope"] == "mean").copy()
        mean = mean.assign(_a=column(mean, "effect").abs()).sort_values("_a", ascending=False)
        rows = self.tables["rows"]
        m = self.config.metric
        return {"mode": self.config.mode, "recipe": self.config.recipe, "metric": m, "n_rows": int(len(rows)),
                "receivers": list(self.meta["receivers"]), "n_variants": int(len(mean)),
                "skipped": list(self.meta.get("skipped", [])), "chunks": self.meta.get("chunks"),
                "mean_clean": float(column(rows, f"clean_{m}").mean()),
                "mean_corrupted": float(column(rows, f"corrupted_{m}").mean()),
                "effects": [{"senders": r["senders"], "mean_delta": round(float(r["delta"]), 6),
                             "mean_effect": None if is_missing(r["effect"]) else round(float(r["effect"]), 6)}
                            for r in records(mean)]}

    def report(self) -> str:
        s = self.summary()
        lines = [f"path patching ({s['mode']}, recipe {s['recipe']}) [{self.config.step_name}]: {s['n_rows']} row(s); receivers "
                 f"{', '.join(s['receivers'][:12])}{' ...' if len(s['receivers']) > 12 else ''}",
                 f"  {s['metric']} clean {s['mean_clean']:+.4f} corrupted {s['mean_corrupted']:+.4f}",
                 "  senders by |effect| (effect through the receivers only; 1 = the whole clean-corrupted gap):"]
        for e in s["effects"][:20]:
            eff = "n/a" if e["mean_effect"] is None else f"{e['mean_effect']:+.4f}"
            lines.append(f"    {eff}  (delta {e['mean_delta']:+.4f})  {e['senders']}")
        if s["skipped"]:
            lines.append(f"  skipped {len(s['skipped'])} sender(s) writing after a receiver reads")
        return "\n".join(lines)

    def figures(self) -> dict:
        import matplotlib.pyplot as plt

        s = self.summary()
        e = s["effects"][:30]
        fig, ax = plt.subplots(figsize=(6, 0.25 * len(e) + 1.4))
        bar_chart(ax, [x["senders"] for x in e], [x["mean_effect"] or 0.0 for x in e],
             f"path patching ({s['mode']}) into {', '.join(s['receivers'][:4])}{' ...' if len(s['receivers']) > 4 else ''}",
             "effect (normalized)")
        fig.tight_layout()
        return {"effects": fig}


@register
class PathPatching(CircuitRowsExperiment):
    """Exact path patching: each sender (or group of senders) patched from the source run into the
    receivers only (:mod:`tracekit.circuits.paths`).

    Fields:
        pairs / pairs_file / dataset, metric: as :class:`EdgeAttribution`.
        senders: upstream nodes, each its own variant: ``a{L}.h{H}``, ``m{L}``, ``input``, glob patterns
            (``a2?.h*``: every head of blocks 20-29, each a variant) or a list of names patched together
            (``[a20.h0, a19.h2]``). Expanded senders that write after a receiver reads are skipped (listed
            in the summary); a sender named explicitly must write before every receiver.
        receivers: downstream nodes shared by every variant: ``a{L}.h{H}`` (its q, k and v inputs),
            ``a{L}.h{H}<q>`` / ``<k>`` / ``<v>``, ``m{L}`` (MLP input), ``logits``, or glob patterns.
        mode: ``denoising`` (default; clean senders into the corrupted run) or ``noising``.
        recipe: what a receiver in a later block than the first receivers reads. ``wang`` (default;
            Wang et al. 2022's three runs, as ARENA's path patching): its input in a run with the
            senders patched and every other head and MLP frozen to the base run, i.e. the base input
            plus the senders' difference (it does not see what earlier receivers' changed outputs
            write); ``live``: its live input plus the senders' difference (it does). The same for
            receivers in one block.
        batch_size: (variant, row) runs per replay batch, or ``auto``.

    Repeats are refused, naming the field and the entry: a sender twice in one group (its
    difference would count twice), two ``senders`` entries giving the same variant, a receiver
    twice in ``receivers``.
    """

    kind: Literal["path_patching"] = "path_patching"
    senders: list[Union[str, list[str]]] = Field(min_length=1)
    receivers: list[str] = Field(min_length=1)
    mode: Mode = "denoising"
    recipe: Literal["wang", "live"] = "wang"
    batch_size: Union[int, Literal["auto"]] = "auto"

    result_class = PathPatchingResult

    def _variants(self, model: HookedModel) -> tuple[list[list[str]], list[str], list[str]]:
        """``(sender lists, receivers, skipped)`` with patterns expanded.

        Raises:
            MethodRefused: a name or pattern matching no node; an explicit sender after a receiver; a
                name repeated in a sender group or in ``receivers``; two ``senders`` entries giving the
                same variant.
        """
        graph = build_graph(model)
        _refuse_repeats("receivers", self.receivers)
        recv: list[str] = []
        for i, r in enumerate(self.receivers):
            if any(ch in r for ch in "*?["):
                hits = [d for d in graph.downstream if fnmatch.fnmatchcase(d, r)]
                if not hits:
                    raise MethodRefused(f"receivers[{i}]: {r!r} matches no downstream node")
                recv += hits
            else:
                recv += graph.receivers_of(r)
        recv = list(dict.fromkeys(recv))
        variants, skipped = [], []
        origin: dict[frozenset, int] = {}  # each variant's sender set -> the senders entry giving it

        def add(names: list[str], i: int) -> None:
            key = frozenset(names)
            if key in origin:
                raise MethodRefused(f"senders[{i}]: {'+'.join(names)} is also given by senders[{origin[key]}] "
                                    f"({self.senders[origin[key]]!r}); the same variant twice: list it once")
            origin[key] = i
            variants.append(list(names))

        def ok(s: str) -> bool:
            return all(bool(graph.mask[graph.down_index[r], graph.up_index[s]]) for r in recv)

        for i, s in enumerate(self.senders):
            names = s if isinstance(s, list) else [s]
            if isinstance(s, list):
                _refuse_repeats(f"senders[{i}]", s, "its difference would be added twice")
            if isinstance(s, str) and any(ch in s for ch in "*?["):
                hits = [u for u in graph.upstream if fnmatch.fnmatchcase(u, s)]
                if not hits:
                    raise MethodRefused(f"senders[{i}]: {s!r} matches no upstream node")
                for h in hits:
                    if ok(h):
                        add([h], i)
                skipped += [h for h in hits if not ok(h)]
                continue
            for n in names:
                if n not in graph.up_index:
                    raise MethodRefused(f"senders[{i}]: {n!r} is not an upstream node; use 'input', 'a{{L}}.h{{H}}' "
                                        f"or 'm{{L}}' (layers 0..{graph.n_layers - 1}, heads 0..{graph.n_heads - 1})")
                if not ok(n):
                    raise MethodRefused(f"senders[{i}]: {n} writes after a receiver reads ({recv[:3]}...); path "
                                        "patching needs every receiver downstream of its senders")
            add(list(names), i)
        if not variants:
            raise MethodRefused(f"senders: every sender writes after a receiver reads (skipped {skipped[:5]})")
        return variants, recv, skipped

    def check(self, model: HookedModel) -> PairedRows:
        inputs = self.prepare(model)
        self._variants(model)
        return inputs

    def _run(self, model: HookedModel, inputs: PairedRows, progress: bool = True) -> PathPatchingResult:
        clean, corr, tgt, foil = self.ids(inputs)
        variants, recv, skipped = self._variants(model)
        run = path_patch(model, clean, corr, variants, [recv] * len(variants), tgt, foil, metrics=[self.metric],
                         mode=self.mode, batch_size=self.batch_size, recipe=self.recipe)
        c, x = run.clean[:, 0].numpy(), run.corrupted[:, 0].numpy()
        base = x if self.mode == "denoising" else c
        recs = []
        row_ids = inputs.row_ids
        for j, snd in enumerate(variants):
            v = run.values[j, :, 0].numpy()
            label = "+".join(snd)
            for i in range(len(v)):
                recs.append((label, "scope_row", i, row_ids[i], v[i], base[i], c[i], x[i]))
            recs.append((label, "mean", pd.NA, pd.NA, v.mean(), base.mean(), c.mean(), x.mean()))
        df = pd.DataFrame(recs, columns=["senders", "scope", "pair", "row_id", "value", "base", "clean", "corrupted"])
        df["scope"] = df["scope"].replace({"scope_row": "row"})
        df.insert(1, "receivers", ",".join(recv))
        df["delta"] = df["value"] - df["base"]
        gap = (df["clean"] - df["corrupted"]).astype(float)
        df["normalized"] = np.where(gap.abs() >= 1e-3, (df["value"] - df["corrupted"]) / gap.where(gap != 0, 1), np.nan)
        df["effect"] = df["normalized"] if self.mode == "denoising" else 1 - df["normalized"]
        for col in ("pair", "row_id"):
            df[col] = df[col].astype("Int64")
        tables = {"main": df, "rows": self._rows_table(inputs, c, x)}
        return PathPatchingResult(self, tables, {"receivers": recv, "skipped": skipped, "recipe": run.recipe,
                                                 "variants": ["+".join(v) for v in variants],
                                                 "chunks": {"path patching replay": {"variants": run.batch_sizes}}})


def _refuse_repeats(field: str, items, why: str = "list each once") -> None:
    """Refuse a list naming one entry twice (tracekit's one duplicate policy: never silently
    double or drop an entry).

    Raises:
        MethodRefused: naming ``field``, the repeated entry and its positions.
    """
    seen: dict = {}
    for i, x in enumerate(items):
        if x in seen:
            shown = "[" + ", ".join(x) + "]" if isinstance(x, tuple) else repr(x)
            raise MethodRefused(f"{field}: {shown} is listed twice (entries {seen[x]} and {i}); {why}")
        seen[x] = i

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

from ..circuits.graph import Graph, build_graph
from ..circuits.paths import path_patch
from ..dataset.paired import PairedRows
from ..errors import MethodRefused
from ..model.info import HookedModel
from .base import Result, register
from .circuit_rows import CircuitRowsExperiment, Mode
from .circuits_tables import bar_chart
from .patching_tables import column, is_missing, records, where

__all__ = ["PathPatching", "PathPatchingResult", "HEAD_NUMBERING", "receivers_table"]

#: The head-numbering rule of path patching's node names (recorded in each result's summary).
HEAD_NUMBERING = ("senders, <q> receivers and head tables count query heads (0..{hq}); <k>/<v> receivers count "
                  "key/value heads (0..{hkv}): query head H reads key/value head H // {g}")


def receivers_table(graph: Graph, receivers: list[str]) -> pd.DataFrame:
    """One line per receiver: ``receiver, layer, input, head_idx, head_numbering, query_heads`` (the
    query heads a head input feeds, comma-separated: the group sharing a key/value head under
    grouped-query attention; empty for ``m{L}`` / ``logits``)."""
    rows = []
    for r in receivers:
        q = graph.node_query_heads(r)
        if r == "logits":
            rows.append((r, graph.n_layers, "logits", pd.NA, "", ""))
        elif q is None:
            rows.append((r, int(r[1:]), "mlp", pd.NA, "", ""))
        else:
            x = r[-2]
            rows.append((r, int(r[1:].split(".")[0]), x, int(r.split(".h")[1].split("<")[0]),
                         "query" if x == "q" else "key_value", ",".join(str(h) for h in q)))
    df = pd.DataFrame(rows, columns=["receiver", "layer", "input", "head_idx", "head_numbering", "query_heads"])
    df["head_idx"] = df["head_idx"].astype("Int64")
    return df


def _numbering_summary(meta: dict, table) -> dict:
    """``head_numbering`` and ``receiver_query_heads`` (empty for a result saved before they existed)."""
    if table is None or "n_heads" not in meta:
        return {}
    hq, hkv = int(meta["n_heads"]), int(meta["n_kv_heads"])
    rule = HEAD_NUMBERING.format(hq=hq - 1, hkv=hkv - 1, g=max(1, hq // max(1, hkv)))
    heads = {str(r["receiver"]): [int(h) for h in str(r["query_heads"]).split(",")]
             for r in records(table) if str(r["query_heads"])}
    return {"head_numbering": rule, "receiver_query_heads": heads}


class PathPatchingResult(Result):
    """Result of :class:`PathPatching`.

    Tables: ``main`` (one line per variant x row, plus ``scope`` = ``mean`` lines: ``senders``,
    ``receivers``, ``value`` = the path-patched metric, ``base`` = the unpatched base run's,
    ``delta`` = value - base, ``normalized`` = (value - corrupted) / (clean - corrupted), ``effect``
    = normalized for denoising, 1 - normalized for noising); ``rows``; ``receivers`` (one line per
    receiver: ``receiver``, ``layer``, ``input`` (q / k / v / mlp / logits), ``head_idx`` (as named:
    a query head for ``<q>``, a key/value head for ``<k>`` / ``<v>``), ``head_numbering`` (``query``
    / ``key_value``), ``query_heads`` (the query heads the input feeds: the group sharing a
    key/value head under grouped-query attention, e.g. ``"3,4,5"``)).

    Head numbering (:data:`HEAD_NUMBERING`): senders, ``<q>`` receivers and every head table count
    query heads; ``<k>`` / ``<v>`` receivers count key/value heads, and query head ``H`` reads
    key/value head ``H // (n_heads // n_kv_heads)``; a k/v receiver named by a query head is
    refused with the right name (``a23.h4<v>`` on a model with 9 query and 3 key/value heads:
    ``a23.h1<v>``, shared by query heads 3, 4, 5).

    Summary keys: ``mode``, ``recipe`` (the rule for receivers in several blocks: ``wang`` or
    ``live``), ``metric``, ``n_rows``, ``receivers``, ``n_variants``, ``skipped``
    (expanded senders dropped because they write after a receiver reads), ``mean_clean``,
    ``mean_corrupted``, ``effects`` (per variant ``{senders, mean_delta, mean_effect}``, by |effect|),
    ``head_numbering`` (the rule above, with the model's head counts), ``receiver_query_heads``
    (per head receiver, the query heads it feeds).
    """

    config: "PathPatching"
    main_table = "main"
    table_names = ("main", "rows", "receivers")
    summary_keys = ("mode", "recipe", "metric", "n_rows", "receivers", "n_variants", "skipped", "mean_clean", "mean_corrupted",
                    "effects", "chunks", "head_numbering", "receiver_query_heads")

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
                            for r in records(mean)],
                **_numbering_summary(self.meta, self.tables.get("receivers"))}

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
        kv = {r: q for r, q in (s.get("receiver_query_heads") or {}).items() if not r.endswith("<q>")}
        if kv and s.get("head_numbering"):
            lines.append(f"  head numbering: {s['head_numbering']}")
            lines.append("  k/v receivers -> query heads sharing them: " +
                         "; ".join(f"{r} -> {','.join(str(h) for h in q)}" for r, q in list(kv.items())[:12]))
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
        receivers: downstream nodes shared by every variant: ``a{L}.h{H}`` (query head ``H``'s q, k
            and v inputs: its key/value head's k and v), ``a{L}.h{H}<q>`` (query head ``H``),
            ``a{L}.h{G}<k>`` / ``<v>`` (key/value head ``G``: under grouped-query attention query head
            ``H`` reads ``G = H // (n_heads // n_kv_heads)``; a query head's number there is refused
            with the right name), ``m{L}`` (MLP input), ``logits``, or glob patterns.
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
        graph = build_graph(model)
        tables = {"main": df, "rows": self._rows_table(inputs, c, x), "receivers": receivers_table(graph, recv)}
        return PathPatchingResult(self, tables, {"receivers": recv, "skipped": skipped, "recipe": run.recipe,
                                                 "n_heads": graph.n_heads, "n_kv_heads": graph.n_kv_heads,
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

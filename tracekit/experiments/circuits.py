# pyright: reportAttributeAccessIssue=false, reportArgumentType=false, reportCallIssue=false, reportIncompatibleVariableOverride=false, reportOptionalMemberAccess=false, reportReturnType=false, reportOptionalSubscript=false, reportGeneralTypeIssues=false
"""Circuit experiments: edge attribution (``kind: edge_attribution``), exact path patching
(``kind: path_patching``) and circuits with their faithfulness curve (``kind: circuit``).

The methods live in :mod:`tracekit.circuits`; these are the YAML/notebook experiments around them.
All three read their rows as :class:`tracekit.experiments.patching.ActivationPatching` does
(``pairs``, ``pairs_file`` or a ``dataset`` whose rows have ``corrupted`` prompts of the same token
length, one ``target`` and one ``foil``), score them with one ``metric`` and use the graph of
:mod:`tracekit.circuits.graph` (nodes ``input``, ``a{L}.h{H}``, ``m{L}``; receivers
``a{L}.h{H}<q|k|v>``, ``m{L}``, ``logits``; edges ``u->v``)::

    from tracekit import Circuit, EdgeAttribution, PathPatching, load_model
    rows = {"generator": {"name": "ioi", "n": 12}, "filter": "correct"}
    EdgeAttribution(dataset=rows, method="eap_ig").run(model).tables["edges"]
    PathPatching(dataset=rows, senders=["a20.h0", "a17.h4"], receivers=["a23.h3<q>"]).run(model).summary()
    Circuit(dataset=rows, scores={"method": "eap_ig"}).run(model).summary()["cpr"]

Signs as in :mod:`tracekit.circuits`: a score estimates the patched run's metric minus the base
run's (``denoising``: base = corrupted run).
"""

from __future__ import annotations

import fnmatch
from typing import Literal, Optional, Union

import numpy as np
import pandas as pd
import torch
from pydantic import Field, field_validator, model_validator

from ..circuits.edges import EdgeScores, edge_attribution
from ..circuits.faithfulness import (
    circuit_from_edges,
    circuit_from_nodes,
    evaluate_circuits,
    faithfulness_measures,
    top_k_circuits,
)
from ..circuits.graph import build_graph
from ..circuits.paths import path_patch
from ..circuits.verification import choose_checked, compare
from ..core.errors import DatasetError
from ..dataset import DatasetSpec
from ..errors import MethodRefused
from .attribution import VerifySpec, verification_lines
from .base import Experiment, Result, StrictModel, register, row_frame
from .pairs import PromptPair
from .patching import ActivationPatching, ActivationPatchingInputs

__all__ = ["Circuit", "CircuitResult", "EdgeAttribution", "EdgeAttributionResult", "PathPatching",
           "PathPatchingResult", "ScoreSpec", "MIB_FRACTIONS"]

Metric = Literal["logit_diff", "prob", "log_prob", "kl"]
Mode = Literal["denoising", "noising"]
#: The circuit sizes (fractions of all edges) the MIB benchmark evaluates.
MIB_FRACTIONS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)


class _RowsExperiment(Experiment):
    """Rows with clean/corrupted prompts, one target and one foil each, and one metric (the fields
    and errors of :class:`tracekit.experiments.patching.ActivationPatching`)."""

    pairs: list[PromptPair] = Field(default_factory=list)
    pairs_file: Optional[str] = None
    dataset: Optional[DatasetSpec] = None
    metric: Metric = "logit_diff"

    def _rows(self) -> ActivationPatching:
        return ActivationPatching(pairs=self.pairs, pairs_file=self.pairs_file, dataset=self.dataset,
                                  metrics=[self.metric], main_metric=self.metric, sites=["resid_pre"])

    @model_validator(mode="after")
    def _one_source(self):
        self._rows()  # one of pairs / pairs_file / dataset, named in the error
        return self

    def prepare(self, model) -> ActivationPatchingInputs:
        """The rows (as activation patching prepares them), each with one target and one foil token.

        Raises:
            DatasetError: a row with several targets, or rows without corrupted prompts.
        """
        try:
            inputs = self._rows().prepare(model)
        except DatasetError as e:
            if "no corrupted prompt" not in str(e):
                raise
            where = str(e).split(": no corrupted prompt")[0]
            raise DatasetError(f"{where}: no corrupted prompt; {self.kind} compares each row's clean and corrupted "
                               "runs (same token length): add corrupted to every row (e.g. the ioi generator's "
                               "corrupt: swap_s2)") from None
        if any(len(t) != 1 for t in inputs.target_ids):
            raise DatasetError("target: circuit methods score one target (and one foil) per row; give each row "
                               "a single target")
        if not inputs.has_corrupted:
            raise DatasetError("dataset: every row needs a corrupted prompt (circuit methods compare the clean "
                               "and corrupted runs)")
        return inputs

    @staticmethod
    def ids(inputs: ActivationPatchingInputs) -> tuple[list[list[int]], list[list[int]], list[int], list[int] | None]:
        """``(clean ids, corrupted ids, target ids, foil ids)`` per row."""
        return ([list(c) for c in inputs.clean_ids], [list(x) for x in inputs.corrupted_ids],
                [int(t[0]) for t in inputs.target_ids],
                None if inputs.foil_ids is None else [int(f[0]) for f in inputs.foil_ids])

    def _rows_table(self, inputs: ActivationPatchingInputs, clean, corrupted) -> pd.DataFrame:
        m = self.metric
        recs = [{"row_id": e.row_id, f"clean_{m}": float(c), f"corrupted_{m}": float(x)}
                for e, c, x in zip(inputs.data.examples, clean, corrupted)]
        return row_frame(inputs.data, recs)


def _bar(ax, labels, values, title, xlabel):
    ax.barh(range(len(values)), values, color=["tab:blue" if v >= 0 else "tab:red" for v in values])
    ax.set_yticks(range(len(labels)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel(xlabel)
    ax.set_title(title, fontsize=9)


# ---------------------------------------------------------------------------------------------
# edge_attribution
# ---------------------------------------------------------------------------------------------

class EdgeAttributionResult(Result):
    """Result of :class:`EdgeAttribution`.

    Tables: ``edges`` (one line per edge of the graph: ``edge``, ``upstream``, ``downstream``,
    ``score`` = mean over rows in metric units, ``normalized`` = score / (mean clean - mean
    corrupted), ``abs_rank``); ``nodes`` (per upstream node the sum of its edges' scores = its
    node-level attribution, ``abs_rank``); ``rows``; ``verification`` (per checked edge
    ``approx_score``, ``exact_score`` from exact path patching of that one edge, ``approx_rank``,
    ``checked``).

    Summary keys: ``method``, ``mode``, ``metric``, ``ig_steps``, ``n_rows``, ``n_edges``,
    ``mean_clean``, ``mean_corrupted``, ``top_edges`` (``{edge, score, normalized}``),
    ``top_nodes``, ``verification`` (as :class:`tracekit.experiments.attribution.AttributionPatchingResult`'s).
    """

    config: "EdgeAttribution"
    main_table = "edges"
    table_names = ("edges", "nodes", "rows", "verification")
    summary_keys = ("method", "mode", "metric", "ig_steps", "n_rows", "n_edges", "mean_clean", "mean_corrupted",
                    "top_edges", "top_nodes", "verification")
    null_reasons = {"verification": "verify.enabled is false: the scores were not checked against exact path patching",
                    "ig_steps": "method eap takes the gradient at the base run only"}

    def summary(self) -> dict:
        e, n = self.tables["edges"], self.tables["nodes"]
        rows = self.tables["rows"]
        m = self.config.metric
        k = self.config.top_n
        return {
            "method": self.config.method, "mode": self.config.mode, "metric": m,
            "ig_steps": self.config.ig_steps if self.config.method == "eap_ig" else None,
            "n_rows": int(len(rows)), "n_edges": int(len(e)),
            "mean_clean": float(rows[f"clean_{m}"].mean()), "mean_corrupted": float(rows[f"corrupted_{m}"].mean()),
            "top_edges": [{"edge": r["edge"], "score": round(float(r["score"]), 6),
                           "normalized": None if pd.isna(r["normalized"]) else round(float(r["normalized"]), 6)}
                          for _, r in e.head(k).iterrows()],
            "top_nodes": [{"node": r["node"], "score": round(float(r["score"]), 6)} for _, r in n.head(k).iterrows()],
            "verification": self.meta.get("verification"),
        }

    def report(self) -> str:
        s = self.summary()
        lines = [f"edge attribution ({s['method']}{', ' + str(s['ig_steps']) + ' steps' if s['ig_steps'] else ''}, "
                 f"{s['mode']}) [{self.config.step_name}]: {s['n_rows']} row(s), {s['n_edges']} edges; "
                 f"{s['metric']} clean {s['mean_clean']:+.4f} corrupted {s['mean_corrupted']:+.4f}",
                 "  top edges by |score| (score: estimated change of the metric when only this edge is patched):"]
        for t in s["top_edges"][:15]:
            lines.append(f"    {t['score']:+.4f}  {t['edge']}")
        v = s["verification"]
        if v:
            lines += verification_lines(v, "exact path patching of each edge", "edges")
        else:
            lines.append("  NOT verified against exact path patching (verify.enabled: false)")
        return "\n".join(lines)

    def figures(self) -> dict:
        import matplotlib.pyplot as plt

        e = self.tables["edges"].head(25)
        fig, ax = plt.subplots(figsize=(6.5, 0.25 * len(e) + 1.2))
        _bar(ax, list(e["edge"]), e["score"].to_numpy(float),
             f"top edges, {self.config.method} ({self.config.mode})", f"score ({self.config.metric})")
        fig.tight_layout()
        figs = {"top_edges": fig}
        ver = self.tables.get("verification")
        if ver is not None and len(ver):
            fig, ax = plt.subplots(figsize=(4.6, 4.2))
            for kind, marker in (("top", "o"), ("random", "x")):
                h = ver[ver["checked"] == kind]
                ax.scatter(h["exact_score"], h["approx_score"], marker=marker, s=18, label=f"{kind} ({len(h)})")
            lim = float(np.nanmax(np.abs(ver[["exact_score", "approx_score"]].to_numpy(float)))) or 1.0
            ax.plot([-lim, lim], [-lim, lim], color="grey", lw=0.8, ls="--")
            ax.set_xlabel("exact (path patching of the edge)")
            ax.set_ylabel(f"{self.config.method} score")
            ax.legend(fontsize=7)
            fig.tight_layout()
            figs["verification"] = fig
        return figs


@register
class EdgeAttribution(_RowsExperiment):
    """Edge attribution patching (EAP) or EAP with integrated gradients (EAP-IG) over every edge of
    the model's graph, verified against exact path patching of single edges.

    Fields:
        pairs / pairs_file / dataset: the rows (as :class:`tracekit.experiments.patching.ActivationPatching`).
        metric: ``logit_diff`` (default), ``prob``, ``log_prob`` or ``kl``.
        method: ``eap`` (gradient at the base run) or ``eap_ig`` (default; gradients averaged over
            ``ig_steps`` inputs interpolated from the base run's embeddings to the source run's).
        ig_steps: interpolation steps of ``eap_ig`` (default 5, as the MIB baseline).
        mode: ``denoising`` (default; base = corrupted run) or ``noising``.
        top_n: edges and nodes listed in the summary.
        verify: :class:`tracekit.experiments.attribution.VerifySpec`: the top edges and a random
            sample of the others are path-patched exactly on the same rows.

    Raises:
        MethodRefused: a model whose blocks have post-norms, residual multipliers or parallel
            attention/MLP (edges are not terms of a sum there).
    """

    kind: Literal["edge_attribution"] = "edge_attribution"
    method: Literal["eap", "eap_ig"] = "eap_ig"
    ig_steps: int = Field(default=5, ge=1, le=512)
    mode: Mode = "denoising"
    top_n: int = Field(default=20, ge=1)
    verify: VerifySpec = Field(default_factory=VerifySpec)

    result_class = EdgeAttributionResult

    def _run(self, model, inputs: ActivationPatchingInputs, progress: bool = True) -> EdgeAttributionResult:
        clean, corr, tgt, foil = self.ids(inputs)
        es = edge_attribution(model, clean, corr, tgt, foil, metric=self.metric, mode=self.mode,
                              method=self.method, ig_steps=self.ig_steps)
        edges = es.frame()
        nodes = _node_frame(es)
        tables = {"edges": edges, "nodes": nodes, "rows": self._rows_table(inputs, es.clean, es.corrupted)}
        meta: dict = {"verification": None, "graph": {"n_upstream": len(es.graph.upstream),
                                                      "n_downstream": len(es.graph.downstream)}}
        if self.verify.enabled:
            tables["verification"], meta["verification"] = _verify_edges(model, self, es, edges, clean, corr, tgt, foil)
        else:
            tables["verification"] = pd.DataFrame(columns=["edge", "approx_score", "exact_score", "approx_rank",
                                                           "checked"])
        return EdgeAttributionResult(self, tables, meta)


def _node_frame(es: EdgeScores) -> pd.DataFrame:
    """Per upstream node (heads, MLPs, input) the sum of its outgoing edges' mean scores."""
    s = es.mean().sum(0).numpy()
    df = pd.DataFrame({"node": es.graph.upstream, "score": s})
    df["abs_rank"] = df["score"].abs().rank(ascending=False, method="first").astype(int)
    return df.sort_values("abs_rank").reset_index(drop=True)


def _verify_edges(model, cfg, es: EdgeScores, edges: pd.DataFrame, clean, corr, tgt, foil) -> tuple[pd.DataFrame, dict]:
    """Exact path patching of the top edges and a random sample of the rest (one edge per variant)."""
    top, sample = choose_checked(edges["score"].to_numpy(float), cfg.verify.top_k, cfg.verify.n_random, cfg.verify.seed)
    idx = np.r_[top, sample]
    chk = edges.iloc[idx].reset_index(drop=True)
    run = path_patch(model, clean, corr, [[u] for u in chk["upstream"]], [[v] for v in chk["downstream"]], tgt, foil,
                     metrics=[cfg.metric], mode=cfg.mode)
    base = run.corrupted[:, 0] if cfg.mode == "denoising" else run.clean[:, 0]
    exact = (run.values[:, :, 0] - base[None]).mean(1).numpy()
    table = pd.DataFrame({"edge": chk["edge"], "approx_score": chk["score"].to_numpy(float), "exact_score": exact,
                          "approx_rank": chk["abs_rank"].to_numpy(int),
                          "checked": ["top"] * len(top) + ["random"] * len(sample)})
    stats = compare(table["approx_score"].to_numpy(float), exact, list(table["edge"]),
                    (table["checked"] == "top").to_numpy(), table["approx_rank"].to_numpy(), cfg.verify.top_k)
    return table, stats


# ---------------------------------------------------------------------------------------------
# path_patching
# ---------------------------------------------------------------------------------------------

class PathPatchingResult(Result):
    """Result of :class:`PathPatching`.

    Tables: ``main`` (one line per variant x row, plus ``scope`` = ``mean`` lines: ``senders``,
    ``receivers``, ``value`` = the path-patched metric, ``base`` = the unpatched base run's,
    ``delta`` = value - base, ``normalized`` = (value - corrupted) / (clean - corrupted), ``effect``
    = normalized for denoising, 1 - normalized for noising); ``rows``.

    Summary keys: ``mode``, ``metric``, ``n_rows``, ``receivers``, ``n_variants``, ``skipped``
    (expanded senders dropped because they write after a receiver reads), ``mean_clean``,
    ``mean_corrupted``, ``effects`` (per variant ``{senders, mean_delta, mean_effect}``, by |effect|).
    """

    config: "PathPatching"
    main_table = "main"
    table_names = ("main", "rows")
    summary_keys = ("mode", "metric", "n_rows", "receivers", "n_variants", "skipped", "mean_clean", "mean_corrupted",
                    "effects")

    def summary(self) -> dict:
        df = self.tables["main"]
        mean = df[df["scope"] == "mean"].copy()
        mean = mean.assign(_a=mean["effect"].abs()).sort_values("_a", ascending=False)
        rows = self.tables["rows"]
        m = self.config.metric
        return {"mode": self.config.mode, "metric": m, "n_rows": int(len(rows)),
                "receivers": list(self.meta["receivers"]), "n_variants": int(len(mean)),
                "skipped": list(self.meta.get("skipped", [])),
                "mean_clean": float(rows[f"clean_{m}"].mean()), "mean_corrupted": float(rows[f"corrupted_{m}"].mean()),
                "effects": [{"senders": r["senders"], "mean_delta": round(float(r["delta"]), 6),
                             "mean_effect": None if pd.isna(r["effect"]) else round(float(r["effect"]), 6)}
                            for _, r in mean.iterrows()]}

    def report(self) -> str:
        s = self.summary()
        lines = [f"path patching ({s['mode']}) [{self.config.step_name}]: {s['n_rows']} row(s); receivers "
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
        _bar(ax, [x["senders"] for x in e], [x["mean_effect"] or 0.0 for x in e],
             f"path patching ({s['mode']}) into {', '.join(s['receivers'][:4])}{' ...' if len(s['receivers']) > 4 else ''}",
             "effect (normalized)")
        fig.tight_layout()
        return {"effects": fig}


@register
class PathPatching(_RowsExperiment):
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
        batch_size: (variant, row) runs per replay batch, or ``auto``.
    """

    kind: Literal["path_patching"] = "path_patching"
    senders: list[Union[str, list[str]]] = Field(min_length=1)
    receivers: list[str] = Field(min_length=1)
    mode: Mode = "denoising"
    batch_size: Union[int, Literal["auto"]] = "auto"

    result_class = PathPatchingResult

    def _variants(self, model) -> tuple[list[list[str]], list[str], list[str]]:
        """``(sender lists, receivers, skipped)`` with patterns expanded.

        Raises:
            MethodRefused: a name or pattern matching no node; an explicit sender after a receiver.
        """
        graph = build_graph(model)
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

        def ok(s: str) -> bool:
            return all(bool(graph.mask[graph.down_index[r], graph.up_index[s]]) for r in recv)

        for i, s in enumerate(self.senders):
            names = s if isinstance(s, list) else [s]
            if isinstance(s, str) and any(ch in s for ch in "*?["):
                hits = [u for u in graph.upstream if fnmatch.fnmatchcase(u, s)]
                if not hits:
                    raise MethodRefused(f"senders[{i}]: {s!r} matches no upstream node")
                variants += [[h] for h in hits if ok(h)]
                skipped += [h for h in hits if not ok(h)]
                continue
            for n in names:
                if n not in graph.up_index:
                    raise MethodRefused(f"senders[{i}]: {n!r} is not an upstream node; use 'input', 'a{{L}}.h{{H}}' "
                                        f"or 'm{{L}}' (layers 0..{graph.n_layers - 1}, heads 0..{graph.n_heads - 1})")
                if not ok(n):
                    raise MethodRefused(f"senders[{i}]: {n} writes after a receiver reads ({recv[:3]}...); path "
                                        "patching needs every receiver downstream of its senders")
            variants.append(list(names))
        if not variants:
            raise MethodRefused(f"senders: every sender writes after a receiver reads (skipped {skipped[:5]})")
        return variants, recv, skipped

    def check(self, model) -> ActivationPatchingInputs:
        inputs = self.prepare(model)
        self._variants(model)
        return inputs

    def _run(self, model, inputs: ActivationPatchingInputs, progress: bool = True) -> PathPatchingResult:
        clean, corr, tgt, foil = self.ids(inputs)
        variants, recv, skipped = self._variants(model)
        run = path_patch(model, clean, corr, variants, [recv] * len(variants), tgt, foil, metrics=[self.metric],
                         mode=self.mode, batch_size=self.batch_size)
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
        return PathPatchingResult(self, tables, {"receivers": recv, "skipped": skipped,
                                                 "variants": ["+".join(v) for v in variants]})


# ---------------------------------------------------------------------------------------------
# circuit
# ---------------------------------------------------------------------------------------------

class ScoreSpec(StrictModel):
    """How a circuit's candidate edges (or nodes) are ranked when they are not listed by hand.

    Fields:
        method: ``eap_ig`` (default), ``eap``, or ``atp`` (node level: a node's score is the sum of
            its outgoing EAP edges, which equals attribution patching of its write).
        ig_steps: interpolation steps of ``eap_ig``.
        mode: ``denoising`` (default) or ``noising``.
        rank_by: ``abs`` (largest |score|, default) or ``signed`` (largest score).
        edges_file: or read the scores from a saved ``edges`` table (Parquet or CSV with columns
            ``edge`` and ``score``, e.g. an ``edge_attribution`` step's ``edges.parquet`` through a
            pipeline reference ``{from: eap_ig, path: edges.parquet}``) instead of computing them;
            ``method`` then only names them. The rows should be the same (the file does not say).
    """

    method: Literal["eap", "eap_ig", "atp"] = "eap_ig"
    ig_steps: int = Field(default=5, ge=1, le=512)
    mode: Mode = "denoising"
    rank_by: Literal["abs", "signed"] = "abs"
    edges_file: Optional[str] = None


class CircuitResult(Result):
    """Result of :class:`Circuit`.

    Tables: ``curve`` (one line per evaluated circuit size: ``circuit_size`` = edges or nodes ranked in,
    ``fraction`` = size / all, ``n_edges`` = edges of the graph in the circuit, ``metric`` = mean
    over rows, ``faithfulness`` = (m(C) - m(empty)) / (m(full) - m(empty)), ``ci_low``/``ci_high``
    = bootstrap interval over rows); ``circuit`` (the chosen circuit's edges, or nodes, with their
    scores); ``scores`` (every edge's or node's score, ranked); ``rows`` (per row clean, corrupted,
    empty-circuit and chosen-circuit metric).

    Summary keys: ``level``, ``method``, ``ablation``, ``n_rows``, ``n_candidates`` (edges or
    nodes ranked), ``n_graph_edges``, ``mean_clean``, ``mean_corrupted``, ``mean_empty``,
    ``full_faithfulness`` (the full circuit's mean metric relative to the clean run's, measured in a
    separate forward pass: 1 unless the circuit engine is wrong), ``cpr``, ``cmd`` (MIB areas over
    fractions 0..1) with ``cpr_ci``/``cmd_ci``, ``threshold``, ``chosen`` (``{size, fraction,
    n_edges, faithfulness, ci_low, ci_high}``: the smallest evaluated circuit reaching
    ``threshold``, else the most faithful), ``circuit_heads`` / ``circuit_mlps`` (the nodes its
    edges touch, by the summed |score| of their edges in it),
    ``circuit_edges`` (its first 50 edges by score).
    """

    config: "Circuit"
    main_table = "curve"
    table_names = ("curve", "circuit", "scores", "rows")
    summary_keys = ("level", "method", "ablation", "n_rows", "n_candidates", "n_graph_edges", "mean_clean",
                    "mean_corrupted", "mean_empty", "full_faithfulness", "cpr", "cmd", "cpr_ci", "cmd_ci", "threshold",
                    "chosen", "circuit_heads", "circuit_mlps", "circuit_edges")
    null_reasons = {"cpr_ci": "one row, bootstrap: 0, or a circuit listed by hand",
                    "cmd_ci": "one row, bootstrap: 0, or a circuit listed by hand",
                    "cpr": "a circuit listed by hand is one size, not a curve", "cmd": "a circuit listed by hand is one size, not a curve",
                    "full_faithfulness": "the full model and the empty circuit score the same"}

    def summary(self) -> dict:
        out = dict(self.meta["summary"])
        return out

    def report(self) -> str:
        s = self.summary()
        ch = s["chosen"]

        def ci(v):
            return "" if v is None else f" [{v[0]:.3f}, {v[1]:.3f}]"
        lines = [f"circuit ({s['level']}, {s['method']}, ablation {s['ablation']}) [{self.config.step_name}]: "
                 f"{s['n_rows']} row(s), {s['n_candidates']} candidate {s['level']}",
                 f"  {self.config.metric}: clean {s['mean_clean']:+.4f}, corrupted {s['mean_corrupted']:+.4f}, empty "
                 f"circuit {s['mean_empty']:+.4f}; full model faithfulness {s['full_faithfulness']:.4f}",
                 (f"  CPR {s['cpr']:.3f}{ci(s['cpr_ci'])} (area under faithfulness; higher is better), "
                  f"CMD {s['cmd']:.3f}{ci(s['cmd_ci'])} (area under |1 - faithfulness|; lower is better)"
                  if s["cpr"] is not None else "  (a circuit listed by hand: faithfulness of that circuit only)"),
                 "  size  fraction  edges  faithfulness [95% CI]"]
        for _, r in self.tables["curve"].iterrows():
            c = "" if pd.isna(r["ci_low"]) else f" [{r['ci_low']:.3f}, {r['ci_high']:.3f}]"
            lines.append(f"  {int(r['circuit_size']):5d}  {r['fraction']:.4f}  {int(r['n_edges']):6d}  {r['faithfulness']:+.3f}{c}")
        lines.append(f"  chosen circuit: {ch['size']} {s['level']} ({ch['n_edges']} edges), faithfulness "
                     f"{ch['faithfulness']:+.3f} (threshold {s['threshold']})")
        if s["circuit_heads"]:
            lines.append(f"  heads: {', '.join(s['circuit_heads'][:40])}{' ...' if len(s['circuit_heads']) > 40 else ''}")
        if s["circuit_mlps"]:
            lines.append(f"  MLPs: {', '.join(s['circuit_mlps'])}")
        return "\n".join(lines)

    def figures(self) -> dict:
        import matplotlib.pyplot as plt

        c = self.tables["curve"]
        c = c[c["fraction"] > 0]
        fig, ax = plt.subplots(figsize=(5.5, 3.8))
        ax.plot(c["fraction"], c["faithfulness"], marker="o", label="circuit")
        if c["ci_low"].notna().any():
            ax.fill_between(c["fraction"], c["ci_low"], c["ci_high"], alpha=0.25, label="95% bootstrap over rows")
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.axhline(self.config.threshold, color="tab:green", lw=0.8, ls=":", label=f"threshold {self.config.threshold}")
        ax.set_xscale("log")
        ax.set_xlabel(f"fraction of {self.meta['summary']['level']} in the circuit")
        ax.set_ylabel("faithfulness (1 = full model, 0 = empty circuit)")
        s = self.summary()
        areas = f": CPR {s['cpr']:.3f}, CMD {s['cmd']:.3f}" if s["cpr"] is not None else ""
        ax.set_title(f"{s['method']} circuit, ablation {s['ablation']}{areas}", fontsize=9)
        ax.legend(fontsize=7)
        fig.tight_layout()
        return {"faithfulness": fig}


@register
class Circuit(_RowsExperiment):
    """A circuit (edges or nodes, ranked by a score or listed by hand), run with everything outside
    it ablated; its faithfulness over circuit sizes with the MIB measures
    (:mod:`tracekit.circuits.faithfulness`).

    Fields:
        pairs / pairs_file / dataset, metric: as :class:`EdgeAttribution`.
        level: ``edges`` (default: circuits of the top-k edges) or ``nodes`` (top-k heads and MLPs;
            a node circuit is every edge between its nodes).
        scores: :class:`ScoreSpec`, how candidates are ranked (default EAP-IG, 5 steps, by |score|).
        edges / nodes: a circuit listed by hand (``["a0.h1->a2.h3<q>", ...]`` / ``["a20.h0", "m3"]``);
            then only it (plus the full and empty circuits) is evaluated.
        sizes: circuit sizes evaluated: fractions in (0, 1] of the candidates and/or counts (integers
            above 1); default: the MIB fractions for edges (0.1% .. 100%) and 1, 2, 5, 10, 20, 50% and
            100% of the nodes.
        ablation: ``corrupted`` (default: each row's corrupted run), ``mean`` (mean over the clean
            prompts of the rows of the same token length), ``resample`` (another such row's writes,
            drawn with ``seed``) or ``zero``.
        threshold: the chosen circuit is the smallest evaluated one with faithfulness >= this (0.8).
        bootstrap: resamples of the rows for the intervals (0: none).
        seed: the bootstrap's seed (and the ``resample`` ablation's).
    """

    kind: Literal["circuit"] = "circuit"
    level: Literal["edges", "nodes"] = "edges"
    scores: ScoreSpec = Field(default_factory=ScoreSpec)
    edges: Optional[list[str]] = None
    nodes: Optional[list[str]] = None
    sizes: Optional[list[float]] = None
    ablation: Literal["corrupted", "mean", "zero", "resample"] = "corrupted"
    threshold: float = 0.8
    bootstrap: int = Field(default=1000, ge=0)
    seed: int = 0

    result_class = CircuitResult

    @field_validator("sizes")
    @classmethod
    def _sizes(cls, v):
        if v is not None:
            if not v:
                raise ValueError("sizes: give at least one size (a count >= 1 or a fraction in (0, 1])")
            bad = [x for x in v if x <= 0 or (x > 1 and float(x) != int(x))]
            if bad:
                raise ValueError(f"sizes: {bad[0]} is neither a count (an integer >= 1) nor a fraction in (0, 1]")
        return v

    @model_validator(mode="after")
    def _hand(self):
        if self.edges is not None and self.nodes is not None:
            raise ValueError("edges and nodes: list one circuit, as edges or as nodes, not both")
        if self.edges is not None and self.level != "edges" or self.nodes is not None and self.level != "nodes":
            raise ValueError("level: a circuit listed by hand sets the level (edges: level edges; nodes: level nodes)")
        return self

    def check(self, model) -> ActivationPatchingInputs:
        inputs = self.prepare(model)
        graph = build_graph(model)
        if self.edges is not None:
            circuit_from_edges(graph, self.edges)
        if self.nodes is not None:
            circuit_from_nodes(graph, self.nodes)
        return inputs

    def _counts(self, n: int) -> list[int]:
        """The evaluated sizes as counts of ``n`` candidates (sorted, unique, 1..n): a value in (0, 1]
        is a fraction (rounded, at least 1), a larger one a count."""
        sizes = self.sizes if self.sizes is not None else (
            list(MIB_FRACTIONS) if self.level == "edges" else [0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0])
        return sorted({max(1, min(n, int(round(x * n)))) if x <= 1 else min(n, int(x)) for x in sizes})

    def _run(self, model, inputs: ActivationPatchingInputs, progress: bool = True) -> CircuitResult:
        clean, corr, tgt, foil = self.ids(inputs)
        graph = build_graph(model)
        hand = self.edges is not None or self.nodes is not None
        es = None
        if hand:
            circ = (circuit_from_edges(graph, self.edges) if self.edges is not None
                    else circuit_from_nodes(graph, self.nodes))[None]
            counts = [len(self.edges) if self.edges is not None else len(self.nodes)]
            cand = list(self.edges or self.nodes)
            scores_df = pd.DataFrame({"name": cand, "score": np.nan})
        else:
            sp = self.scores
            es = _read_edges(graph, sp.edges_file) if sp.edges_file else edge_attribution(
                model, clean, corr, tgt, foil, metric=self.metric, mode=sp.mode,
                method="eap_ig" if sp.method == "eap_ig" else "eap", ig_steps=sp.ig_steps)
            if self.level == "edges":
                mean = es.mean()
                counts = self._counts(graph.n_edges)
                circ = top_k_circuits(graph, mean, counts, sp.rank_by)
                scores_df = es.frame().rename(columns={"edge": "name"})
            else:
                node_s = es.mean().sum(0)  # per upstream node
                names = [u for u in graph.upstream if u != "input"]
                vals = torch.stack([node_s[graph.up_index[u]] for u in names])
                key = vals.abs() if sp.rank_by == "abs" else vals
                order = torch.argsort(key, descending=True, stable=True).tolist()
                counts = self._counts(len(names))
                circ = torch.stack([circuit_from_nodes(graph, [names[i] for i in order[:k]]) for k in counts])
                scores_df = pd.DataFrame({"name": [names[i] for i in order], "score": vals[order].numpy()})
        full, empty = graph.mask.clone(), torch.zeros_like(graph.mask)
        run = evaluate_circuits(model, clean, corr, torch.cat([circ, full[None], empty[None]]), tgt, foil,
                                metrics=[self.metric], ablation=self.ablation, seed=self.seed)
        vals = run.values[:, :, 0].numpy()
        m_full, m_empty, m_c = vals[-2], vals[-1], vals[:-2]
        # candidates: every edge of the graph, or every head and MLP (a hand-listed circuit's fraction too)
        n_cand = graph.n_edges if self.level == "edges" else len(graph.upstream) - 1
        fracs = [k / n_cand for k in counts]
        meas = faithfulness_measures(m_c, m_full, m_empty, fracs, self.bootstrap, self.seed)
        curve = pd.DataFrame({"circuit_size": counts, "fraction": fracs, "n_edges": circ.flatten(1).sum(1).numpy(),
                              "metric": m_c.mean(1), "faithfulness": meas["faithfulness"],
                              "ci_low": meas["ci_low"] or [np.nan] * len(counts),
                              "ci_high": meas["ci_high"] or [np.nan] * len(counts)})
        f = np.asarray(meas["faithfulness"], float)
        reach = np.nonzero(f >= self.threshold)[0]
        j = int(reach[0]) if len(reach) else int(np.nanargmax(f)) if np.isfinite(f).any() else 0
        chosen = circ[j]
        circuit_df = _circuit_frame(graph, chosen, es)
        heads, mlps = _circuit_nodes(circuit_df)
        # the full circuit against the clean run measured separately (cached forward): 1 unless the
        # circuit engine changed something it should not have
        den = float(run.clean[:, 0].mean()) - m_empty.mean()
        summary = {
            "level": self.level, "method": "hand" if hand else self.scores.method, "ablation": self.ablation,
            "n_rows": len(clean), "n_candidates": int(n_cand), "n_graph_edges": graph.n_edges,
            "mean_clean": float(run.clean[:, 0].mean()), "mean_corrupted": float(run.corrupted[:, 0].mean()),
            "mean_empty": float(m_empty.mean()),
            "full_faithfulness": float((m_full.mean() - m_empty.mean()) / den) if abs(den) > 1e-9 else None,
            # a circuit listed by hand is one point, not a curve over sizes: no areas
            "cpr": None if hand else meas["cpr"], "cmd": None if hand else meas["cmd"],
            "cpr_ci": None if hand else meas["cpr_ci"], "cmd_ci": None if hand else meas["cmd_ci"],
            "threshold": self.threshold,
            "chosen": {"size": int(counts[j]), "fraction": float(fracs[j]), "n_edges": int(chosen.sum()),
                       "faithfulness": float(f[j]),
                       "ci_low": None if meas["ci_low"] is None else float(meas["ci_low"][j]),
                       "ci_high": None if meas["ci_high"] is None else float(meas["ci_high"][j])},
            "circuit_heads": heads, "circuit_mlps": mlps,
            "circuit_edges": list(circuit_df["edge"].head(50)),
        }
        rows = self._rows_table(inputs, run.clean[:, 0].numpy(), run.corrupted[:, 0].numpy())
        rows[f"empty_{self.metric}"] = m_empty
        rows[f"circuit_{self.metric}"] = m_c[j]
        tables = {"curve": curve, "circuit": circuit_df, "scores": scores_df.head(5000).reset_index(drop=True),
                  "rows": rows}
        return CircuitResult(self, tables, {"summary": summary, "n_scores": int(len(scores_df))})


def _read_edges(graph, path: str) -> EdgeScores:
    """Edge scores (one row: their mean) from a saved ``edges`` table.

    Raises:
        DatasetError: the file cannot be read, lacks ``edge``/``score``, or names an edge this model's
            graph does not have (another model's scores).
    """
    from pathlib import Path

    p = Path(path)
    try:
        df = pd.read_parquet(p) if p.suffix == ".parquet" else pd.read_csv(p)
    except Exception as e:  # noqa: BLE001 - re-raised naming the field
        raise DatasetError(f"scores.edges_file: cannot read {path!r} ({type(e).__name__}: {e})") from e
    if not {"edge", "score"} <= set(df.columns):
        raise DatasetError(f"scores.edges_file: {path!r} needs columns 'edge' and 'score' (has {list(df.columns)[:8]})")
    scores = torch.zeros(1, *graph.mask.shape)
    for i, (e, v) in enumerate(zip(df["edge"], df["score"])):
        try:
            d, u = graph.parse_edge(str(e), f"scores.edges_file row {i}")
        except MethodRefused as err:
            raise DatasetError(f"{err} (scores from another model?)") from None
        scores[0, d, u] = float(v)
    nan = torch.full((1,), float("nan"))
    return EdgeScores(graph, scores, nan, nan, "file", "denoising", "", 0)


def _circuit_nodes(circuit_df: pd.DataFrame) -> tuple[list[str], list[str]]:
    """The heads and MLPs a circuit's edges touch (a head through its output or its query input; an
    MLP through its output or input), ordered by the summed |score| of their edges in the circuit
    (graph order for a circuit listed by hand)."""
    weight: dict[str, float] = {}
    for _, r in circuit_df.iterrows():
        s = 0.0 if pd.isna(r["score"]) else abs(float(r["score"]))
        for n in (r["upstream"], r["downstream"]):
            if n.startswith("a") and (n.endswith("<q>") or "<" not in n) or n.startswith("m"):
                key = n.split("<")[0]
                weight[key] = weight.get(key, 0.0) + s
    order = sorted(weight, key=lambda n: (-weight[n], _node_key(n)))
    return [n for n in order if n.startswith("a")], [n for n in order if n.startswith("m")]


def _node_key(n: str) -> tuple:
    layer, _, rest = n[1:].partition(".h")
    return (int(layer), 0 if n.startswith("a") else 1, int(rest.split("<")[0]) if rest else 0)


def _circuit_frame(graph, chosen: torch.Tensor, es: Optional[EdgeScores]) -> pd.DataFrame:
    """The chosen circuit's edges with their mean scores (NaN for a circuit listed by hand), by |score|."""
    v, u = chosen.nonzero(as_tuple=True)
    score = es.mean()[v, u].numpy() if es is not None else np.full(len(v), np.nan)
    df = pd.DataFrame({"upstream": [graph.upstream[i] for i in u.tolist()],
                       "downstream": [graph.downstream[i] for i in v.tolist()], "score": score})
    df.insert(0, "edge", df["upstream"] + "->" + df["downstream"])
    return df.assign(_a=df["score"].abs()).sort_values("_a", ascending=False).drop(columns="_a").reset_index(drop=True)

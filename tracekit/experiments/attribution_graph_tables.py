"""The result of ``kind: attribution_graph`` (:class:`AttributionGraphResult`: summary, report,
figures, and the graph pages written beside the tables) and the helpers that turn the engines'
outputs into its tables. The experiment is :mod:`tracekit.experiments.attribution_graph`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, cast

import numpy as np
import pandas as pd

from ..results import MANIFEST, round_sig, shadowing_columns
from .base import Result

if TYPE_CHECKING:
    from .attribution_graph import AttributionGraphExperiment

__all__ = ["AttributionGraphResult", "VERIFICATION_KEYS", "split_verification", "tokens_from_cards", "scalar", "num", "unshadowed",
           "jsonable_of", "parquet_safe"]

#: The verification figures the summary reports per graph (and their worst value over graphs).
VERIFICATION_KEYS = ("logits_max_abs_error", "completeness_max_abs_error", "pearson", "spearman",
                     "sign_agreement", "replacement_score", "completeness_score", "replacement_score_unpruned",
                     "completeness_score_unpruned")
#: Keys where larger is worse (the summary takes the max over graphs; the others take the min).
_WORST_IS_MAX = {"logits_max_abs_error", "completeness_max_abs_error"}


# =============================================================================================
# result


class AttributionGraphResult(Result):
    """Result of :class:`AttributionGraphExperiment`: the tables of the module docstring, and the
    graph JSON and HTML pages written beside them by :meth:`save` (held in :attr:`pages` after a
    run; a loaded result reads them from its folder).

    Summary keys: ``n_graphs``; ``verification`` (the worst value over graphs of each of
    :data:`VERIFICATION_KEYS`: the errors' max, the correlations' and scores' min); the same keys
    at the top level (for ``expect:``); ``main_path`` (the first graph's top features: ``node``,
    ``layer``, ``position``, ``feature``, ``influence``, ``activation``, ``top_tokens``);
    ``graphs`` (per graph: ``row_id``, ``prompt``, ``target``, ``foil``, sizes and the
    verification figures); ``transcoders`` (the set's identity: path, cache hit, content key);
    ``settings``; ``files`` (the pages written).
    """

    config: "AttributionGraphExperiment"
    main_table = "rows"
    headline_keys = ("n_graphs", "logits_max_abs_error", "completeness_max_abs_error", "spearman", "pearson",
                     "sign_agreement", "replacement_score", "completeness_score")

    def __init__(self, config, tables, meta=None, arrays=None, pages: Optional[dict[str, str]] = None):
        super().__init__(config, tables, meta, arrays)
        #: ``file name -> text``: the graph JSON and HTML pages (written by :meth:`save`).
        self.pages: dict[str, str] = dict(pages or {})

    def summary(self) -> dict:
        recs = [{str(k): scalar(v) for k, v in r.items()} for r in _records(self.tables["rows"])]
        ver: dict[str, Any] = {}
        for k in VERIFICATION_KEYS:
            vals = [r[k] for r in recs if r.get(k) is not None]
            ver[k] = None if not vals else (max(vals) if k in _WORST_IS_MAX else min(vals))
        main_path = [{str(k): scalar(v) for k, v in r.items() if k != "row_id"}
                     for r in _records(_first_graph(self.tables["main_path"]))]
        for r in main_path:
            r["top_tokens"] = json.loads(r["top_tokens"]) if isinstance(r.get("top_tokens"), str) else r.get("top_tokens")
        out = {"n_graphs": len(recs), **ver, "verification": ver, "main_path": main_path, "graphs": recs,
               "transcoders": self.meta.get("transcoders"), "settings": self.meta.get("settings"),
               "files": self.meta.get("files", []), "verified_by_intervention": bool(self.config.verify.enabled),
               "scope": {"verification": "worst over the graphs (largest error, smallest correlation / score); "
                                         "each graph's own figures are in `graphs`",
                         "main_path": "the first graph's (its row_id in the main_path table)"}}
        return round_sig(out)

    def report(self) -> str:
        s = self.summary()

        def f(x):
            return "n/a" if x is None else f"{x:.4g}"
        tc = s.get("transcoders") or {}
        lines = [f"attribution graph [{self.config.step_name}] {s['n_graphs']} graph(s); transcoders "
                 f"{tc.get('path')} ({'cache hit' if tc.get('cache_hit') else 'loaded/trained'})"]
        for g in s["graphs"]:
            lines.append(f"  row {g['row_id']}: target {g['target']!r}" + (f" vs {g['foil']!r}" if g.get("foil") else "")
                         + f", {g['n_pos']} tokens, {g['n_features']} active features -> {g['pruned_nodes']} nodes / "
                         f"{g['pruned_edges']} edges after pruning, {f(g['seconds'])} s")
            lines.append(f"    logits max |error| {f(g['logits_max_abs_error'])}, completeness max |error| "
                         f"{f(g['completeness_max_abs_error'])}, replacement score {f(g['replacement_score'])} "
                         f"(unpruned {f(g['replacement_score_unpruned'])}), completeness score "
                         f"{f(g['completeness_score'])} (unpruned {f(g['completeness_score_unpruned'])})")
            if s["verified_by_intervention"]:
                lines.append(f"    verified by {self.config.verify.mode} in the real model ({g.get('n_checked')} "
                             f"features): pearson {f(g['pearson'])}, spearman {f(g['spearman'])}, sign agreement "
                             f"{f(g['sign_agreement'])}")
            else:
                lines.append("    NOT verified by intervention (verify.enabled: false)")
        if s["main_path"]:
            lines.append("  main path (first graph, by influence):")
            for r in s["main_path"][:10]:
                lines.append(f"    L{r['layer']} pos {r['position']} ({r.get('token')!r}) feature {r['feature']}: "
                             f"influence {f(r['influence'])}, activation {f(r['activation'])}, promotes "
                             f"{', '.join(repr(t) for t in (r.get('top_tokens') or [])[:5])}")
        if s["files"]:
            lines.append(f"  pages: {', '.join(s['files'])}")
        return "\n".join(lines)

    def figures(self) -> dict:
        import matplotlib.pyplot as plt

        figs = {}
        ver = self.tables.get("verification")
        if ver is not None and len(ver) and {"predicted", "measured"} <= set(ver.columns):
            fig, ax = plt.subplots(figsize=(4.6, 4.2))
            checked = ver["checked_as"] if "checked_as" in ver.columns else pd.Series(["checked"] * len(ver))
            for kind in dict.fromkeys(checked):
                h = ver[checked == kind]
                ax.scatter(h["measured"], h["predicted"], marker="o" if kind == "top" else "x", s=18,
                           label=f"{kind} ({len(h)})")
            lim = float(np.nanmax(np.abs(ver[["measured", "predicted"]].to_numpy(float)))) or 1.0
            ax.plot([-lim, lim], [-lim, lim], color="grey", lw=0.8, ls="--")
            ax.set_xlabel(f"measured change of the target logit ({self.config.verify.mode}, real model)")
            ax.set_ylabel("graph's prediction")
            ax.set_title("attribution graph: predicted vs measured", fontsize=9)
            ax.legend(fontsize=7)
            fig.tight_layout()
            figs["verification"] = fig
        first = _first_graph(self.tables["main_path"]).head(15)
        if len(first):
            fig, ax = plt.subplots(figsize=(6, 0.3 * len(first) + 1.2))
            labels = [f"L{int(r['layer'])} {r['token']!r} #{int(r['feature'])}" for r in _records(first)]
            ax.barh(range(len(first)), np.asarray(first["influence"], dtype=float))
            ax.set_yticks(range(len(first)), labels, fontsize=7)
            ax.invert_yaxis()
            ax.set_xlabel("influence on the logits")
            ax.set_title("main path: top features by influence", fontsize=9)
            fig.tight_layout()
            figs["main_path"] = fig
        return figs

    def _write(self, tmp: Path, figures: bool) -> None:
        """:meth:`Result._write` plus the graph pages (:attr:`pages`), listed in the manifest."""
        super()._write(tmp, figures)
        for name, text in self.pages.items():
            (tmp / name).write_text(text, encoding="utf-8")
        man = json.loads((tmp / MANIFEST).read_text())
        man["files"] = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file() and p.name != MANIFEST}
        (tmp / MANIFEST).write_text(json.dumps(man, indent=2))


def unshadowed(df: pd.DataFrame) -> pd.DataFrame:
    """``df`` with no column named like a DataFrame attribute (:func:`tracekit.results.shadowing_columns`):
    ``head`` becomes ``head_idx`` (``head_label`` when ``head_idx`` exists), any other ``c`` becomes
    ``c_``."""
    ren = {}
    for c in shadowing_columns(df):
        ren[c] = ("head_idx" if "head_idx" not in df.columns else "head_label") if c == "head" else f"{c}_"
    return df.rename(columns=ren) if ren else df


def _records(df: pd.DataFrame) -> list[dict]:
    """The rows of ``df`` as dicts (column -> cell)."""
    return cast(list[dict], df.to_dict(orient="records"))


def _first_graph(df: pd.DataFrame) -> pd.DataFrame:
    """The rows of ``df`` that belong to its first ``row_id`` (all of an empty frame)."""
    if not len(df):
        return df
    ids = np.asarray(df["row_id"])
    return cast(pd.DataFrame, df.loc[ids == ids[0]])


def scalar(v: Any) -> Any:
    """A table cell as a JSON-able scalar (NaN and pandas' NA become None)."""
    if isinstance(v, (np.integer,)):
        return int(v)
    if isinstance(v, (np.floating, float)):
        return None if not np.isfinite(v) else float(v)
    if isinstance(v, np.bool_):
        return bool(v)
    try:
        if pd.isna(v):
            return None
    except (TypeError, ValueError):
        pass
    return v


def split_verification(v: dict) -> tuple[dict, pd.DataFrame]:
    """``(figures, per-feature table)`` of a :func:`tracekit.graphs.verify.verify_graph` result:
    the intervention's ``summary`` (pearson, spearman, sign agreement, top-k recall, largest
    errors) and ``table`` (one line per checked feature). Raises nothing."""
    iv = v.get("intervention", {}) or {}
    table = pd.DataFrame(iv.get("table", []))
    summ = iv.get("summary", {}) or {}
    stats = {k: scalar(summ.get(k)) for k in ("pearson", "spearman", "sign_agreement", "top_k_recall",
                                                "max_abs_error")}
    stats.update(n_checked=len(table), metric=iv.get("metric"), baseline_metric=num(iv.get("baseline_metric")),
                 baseline_max_abs_logit_error=num(iv.get("baseline_max_abs_logit_error")),
                 largest_misses=json.dumps(jsonable_of(summ.get("largest_errors", [])[:5])))
    return stats, table


def tokens_from_cards(mp: pd.DataFrame, cards: Optional[dict]) -> pd.DataFrame:
    """The main path's ``top_tokens`` from the cards' logit readout when they carry one."""
    if not cards or not len(mp):
        return mp
    mp = mp.copy()
    for i, n in enumerate(mp["node"].tolist()):
        c = cards.get(int(n)) or {}
        toks = c.get("top_tokens") or c.get("logit_top") or c.get("promotes")
        if isinstance(toks, list) and toks:
            toks = [t.get("token", t) if isinstance(t, dict) else t for t in toks]
            mp.iloc[i, mp.columns.get_loc("top_tokens")] = json.dumps([str(t) for t in toks])
    return mp


def num(x: Any) -> Optional[float]:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if np.isfinite(v) else None


def jsonable_of(obj: Any) -> Any:
    from ..core.io import jsonable

    return jsonable(obj)


def parquet_safe(df: pd.DataFrame) -> pd.DataFrame:
    """Object columns holding lists/dicts as JSON strings (parquet writes one type per column)."""
    df = df.copy()
    for c in df.columns:
        if df[c].dtype == object and any(isinstance(v, (list, dict, tuple)) for v in df[c]):
            df[c] = [json.dumps(jsonable_of(v)) if isinstance(v, (list, dict, tuple)) else v for v in df[c]]
    return df

"""Attribution patching experiment (``kind: attribution_patching``): AtP / AtP* estimates of every
patching site's effect, checked against the exact engine in the same run.

The method lives in :mod:`tracekit.circuits.attribution` (usable from notebooks); this module is
the YAML/notebook experiment around it. It takes the rows, sites, positions, directions and metrics
of :class:`tracekit.experiments.patching.ActivationPatching` and writes the same tables, whose
``value`` is now the first-order *estimate* of the patched run's score (normalised the same way), so
an AtP result and an exact result can be read, plotted and compared alike::

    from tracekit import AttributionPatching, load_model
    res = AttributionPatching(dataset={"generator": {"name": "ioi", "n": 12}, "filter": "correct"},
                              sites=["head_out"]).run(load_model())
    res.summary()["verification"]   # pearson, spearman, top_k_recall, sign_agreement, worst_false_negatives
    res.tables["verification"]      # one line per checked site: approx vs exact effect

**Verification** (``verify``, on by default): the exact engine patches the top ``verify.top_k``
sites of the estimate and a seeded random sample of ``verify.n_random`` others on the same rows
(:mod:`tracekit.circuits.verification`); the ``verification`` table has one line per checked site
(``approx_effect``, ``exact_effect``, ``approx_rank``, ``checked`` = ``top``/``random``) and the
summary's ``verification`` the agreement per intervention.
"""

from __future__ import annotations

from typing import Literal, cast

import numpy as np
import pandas as pd
from pydantic import Field, model_validator

from .. import patching as P
from ..circuits.attribution import attribution_patch
from ..circuits.verification import choose_checked, compare, site_means
from ..model.info import HookedModel
from .base import StrictModel, register
from .patching import ActivationPatchingInputs, ActivationPatchingResult, PatchingSpec
from .patching_tables import where

__all__ = ["AttributionPatching", "AttributionPatchingResult", "VerifySpec", "verification_lines"]


class VerifySpec(StrictModel):
    """How an approximate run is checked against the exact engine.

    Fields:
        enabled: run the check (default on; off saves the exact runs' time).
        top_k: the approximation's top sites (by |effect|) patched exactly (default 20).
        n_random: a seeded random sample of the other sites patched exactly (default 20): the
            sites that can reveal false negatives.
        seed: the sample's seed.
    """

    enabled: bool = True
    top_k: int = Field(default=20, ge=1)
    n_random: int = Field(default=20, ge=0)
    seed: int = 0


class AttributionPatchingResult(ActivationPatchingResult):
    """Result of :class:`AttributionPatching`: the tables of
    :class:`tracekit.experiments.patching.ActivationPatchingResult` (``value`` = the estimate) plus
    ``verification`` (one line per exactly checked site).

    Summary keys: those of activation patching, plus ``method`` (``atp`` or ``atp*`` with the QK fix)
    and ``verification``: per intervention ``{n_checked, n_top, n_random, pearson, spearman,
    top_k_recall, sign_agreement, worst_false_negatives, note}`` (None when switched off).
    """

    config: "AttributionPatching"
    summary_keys = ActivationPatchingResult.summary_keys + ("method", "verification")
    table_names = ("main", "rows", "baselines", "tokens", "verification")
    null_reasons = {**ActivationPatchingResult.null_reasons,
                    "verification": "verify.enabled is false: the estimate was not checked against exact patching"}

    def summary(self) -> dict:
        out = super().summary()
        out["method"] = self.meta.get("method", "atp")
        out["verification"] = self.meta.get("verification")
        return out

    def report(self) -> str:
        s = self.summary()
        lines = [super().report().replace("activation patching [", f"attribution patching ({s['method']}) [", 1),
                 "  (values are first-order estimates of the patched score)"]
        for mode, v in (s["verification"] or {}).items():
            lines += verification_lines(v, f"exact patching ({mode})", "sites")
        if s["verification"] is None:
            lines.append("  NOT verified against exact patching (verify.enabled: false)")
        return "\n".join(lines)

    def figures(self) -> dict:
        figs = super().figures()
        for fig in figs.values():  # the heatmaps show the estimate, not exact patching
            ax = fig.axes[0]
            ax.set_title(f"{self.summary()['method']} ESTIMATE of " + ax.get_title(), fontsize=9)
        ver = self.tables.get("verification")
        if ver is None or not len(ver):
            return figs
        import matplotlib.pyplot as plt

        for mode, g in ver.groupby("intervention"):
            fig, ax = plt.subplots(figsize=(4.6, 4.2))
            for kind, marker in (("top", "o"), ("random", "x")):
                h = g[g["checked"] == kind]
                ax.scatter(h["exact_effect"], h["approx_effect"], marker=marker, label=f"{kind} ({len(h)})", s=18)
            lim = float(np.nanmax(np.abs(g[["exact_effect", "approx_effect"]].to_numpy(float)))) or 1.0
            ax.plot([-lim, lim], [-lim, lim], color="grey", lw=0.8, ls="--")
            ax.set_xlabel("exact effect (activation patching)")
            ax.set_ylabel(f"{self.summary()['method']} estimate")
            ax.set_title(f"{mode}: estimate vs exact, {self.config.main_metric}", fontsize=9)
            ax.legend(fontsize=7)
            fig.tight_layout()
            figs[f"verification_{mode}"] = fig
        return figs


def verification_lines(v: dict, against: str, what: str) -> list[str]:
    """Report lines of one :func:`tracekit.circuits.verification.compare` record."""
    def f(x):
        return "n/a" if x is None else f"{x:.3f}"
    lines = [f"  verified against {against}, {v['n_checked']} {what} (top {v['n_top']} + {v['n_random']} random): "
             f"pearson {f(v['pearson'])}, spearman {f(v['spearman'])}, top-k recall {f(v['top_k_recall'])}, "
             f"sign agreement {f(v['sign_agreement'])}, max |error| {f(v.get('max_abs_error'))}"]
    for w in v.get("largest_errors", [])[:3]:
        lines.append(f"    largest error: {w['site']} exact {w['exact']:+.4f}, estimate {w['approx']:+.4f} "
                     f"(rank {w['approx_rank']})")
    # a false negative worth printing: outside the estimate's top-k, yet as large (exactly) as the
    # smallest estimate inside it
    floor = v.get("top_k_floor")
    missed = [w for w in v.get("worst_false_negatives", []) if floor is not None and abs(w["exact"]) >= floor]
    for w in missed[:3]:
        lines.append(f"    missed (outside the estimate's top-k): {w['site']} exact {w['exact']:+.4f}, "
                     f"estimate {w['approx']:+.4f} (rank {w['approx_rank']})")
    if not missed and v.get("n_random"):
        lines.append(f"    no randomly checked {what[:-1]} outside the top-k has an exact effect as large as the "
                     "top-k's smallest estimate")
    return lines


@register
class AttributionPatching(PatchingSpec):
    """Attribution patching (AtP; AtP* with ``qk_fix``) over prompt pairs or a dataset, verified
    against exact patching.

    The fields of :class:`tracekit.experiments.patching.ActivationPatching` (shared through
    :class:`tracekit.experiments.patching.PatchingSpec`; ``ablations`` must stay empty: AtP
    estimates the directions), and:

    Fields:
        qk_fix: AtP*'s QK fix for ``head_q``/``head_k`` sites (exact through the softmax;
            :mod:`tracekit.circuits.qk`).
        verify: :class:`VerifySpec` (``enabled``, ``top_k``, ``n_random``, ``seed``).

    Summary keys and tables: :class:`AttributionPatchingResult`.
    """

    kind: Literal["attribution_patching"] = "attribution_patching"
    qk_fix: bool = False
    verify: VerifySpec = Field(default_factory=VerifySpec)

    result_class = AttributionPatchingResult

    @model_validator(mode="after")
    def _no_ablations(self):
        if self.ablations:
            raise ValueError(f"ablations: attribution patching estimates the directions (denoising, noising); "
                             f"{list(self.ablations)} are exact ablations: use kind activation_patching for them")
        return self

    def _run(self, model: HookedModel, inputs: ActivationPatchingInputs, progress: bool = True) -> AttributionPatchingResult:
        out = attribution_patch(
            model, [list(c) for c in inputs.clean_ids], [list(x) for x in inputs.corrupted_ids],
            P.expand_sites(self.sites), list(self.directions), self.metric_names(inputs),
            [list(t) for t in inputs.target_ids], None if inputs.foil_ids is None else [list(f) for f in inputs.foil_ids],
            layers=self.layers, neuron_layers=self.neuron_layers, neurons=self.neurons,
            positions=None if inputs.positions is None else [list(p) for p in inputs.positions], qk_fix=self.qk_fix)
        res = cast(AttributionPatchingResult, self._result(model, inputs, out))
        qk_sites = any(s.startswith(("head_q", "head_k")) for s in P.expand_sites(self.sites))
        res.meta["method"] = "atp*" if self.qk_fix and qk_sites else "atp"
        res.meta["verification"] = None
        if self.verify.enabled:
            table, stats = self._verify(model, inputs, out)
            res.tables["verification"] = table
            res.meta["verification"] = stats
        else:
            res.tables["verification"] = pd.DataFrame(columns=["intervention", "site", "label", "approx_effect",
                                                               "exact_effect", "approx_rank", "checked"])
        return res

    # ---- verification ----------------------------------------------------------------------
    def _pos_key(self, inputs: ActivationPatchingInputs):
        """``(job, pos) -> key`` of an estimated job: the named position, the position from the end
        (rows of unequal lengths) or the token index."""
        names = list(inputs.position_names)
        equal = len({len(c) for c in inputs.clean_ids}) == 1

        def key(job, pos):
            if names:
                return names[pos]
            return pos if equal else pos - job.n_pos
        return key

    def _verify(self, model: HookedModel, inputs: ActivationPatchingInputs, out: P.PatchingRun) -> tuple[pd.DataFrame, dict]:
        """Exact patching of the checked sites on the same rows; the table and the stats per intervention."""
        approx = site_means([(out, self._pos_key(inputs))], self.main_metric)
        tables, stats = [], {}
        for mode, a in approx.groupby("intervention", sort=False):
            a = a.reset_index(drop=True)
            eff = a["effect"].to_numpy(float)
            rank = pd.Series(-np.abs(np.nan_to_num(eff, nan=0.0))).rank(method="first").astype(int).to_numpy()
            top, sample = choose_checked(eff, self.verify.top_k, self.verify.n_random, self.verify.seed)
            checked = a.iloc[np.r_[top, sample]].assign(checked=["top"] * len(top) + ["random"] * len(sample),
                                                         approx_rank=rank[np.r_[top, sample]])
            exact = self._exact(model, inputs, str(mode), checked)
            keys = ["intervention", "site", "layer", "pos_key", "head_idx", "neuron"]
            m = checked.merge(cast(pd.DataFrame, exact[keys + ["effect"]]).rename(columns={"effect": "exact_effect"}), on=keys, how="left")
            m = m.rename(columns={"effect": "approx_effect"})
            m["label"] = [_label(r) for _, r in m.iterrows()]
            stats[str(mode)] = compare(m["approx_effect"].to_numpy(float), m["exact_effect"].to_numpy(float),
                                       list(m["label"]), (m["checked"] == "top").to_numpy(), m["approx_rank"].to_numpy(),
                                       self.verify.top_k)
            tables.append(m[["intervention", "site", "layer", "pos_key", "head_idx", "neuron", "label",
                             "approx_effect", "exact_effect", "approx_rank", "checked"]])
        table = pd.concat(tables, ignore_index=True)
        table["pos_key"] = table["pos_key"].astype(str).where(table["pos_key"].notna(), None)
        for c in ("head_idx", "neuron"):
            table[c] = table[c].astype("Int64")
        return table, stats

    def _exact(self, model: HookedModel, inputs: ActivationPatchingInputs, mode: str, checked: pd.DataFrame) -> pd.DataFrame:
        """Exact patching of the checked sites (one :func:`tracekit.patching.run_patching` call per
        group of equal-length rows, positions as slots), as :func:`site_means`."""
        names = list(inputs.position_names)
        clean = [list(c) for c in inputs.clean_ids]
        corr = [list(x) for x in inputs.corrupted_ids]
        lengths = [len(c) for c in clean]
        equal = len(set(lengths)) == 1
        runs = []
        for n_pos in sorted(set(lengths)):
            members = [i for i, L in enumerate(lengths) if L == n_pos]
            keys = [k for k in dict.fromkeys(checked["pos_key"].dropna().tolist())]
            if not names and not equal:  # positions from the end that exist in this group
                keys = [k for k in keys if 0 <= n_pos + int(k) < n_pos]

            def token_index(i: int, k, n_pos=n_pos) -> int:
                if names:
                    return int(inputs.positions[i][names.index(k)])
                return int(k) if equal else n_pos + int(k)

            index_rows = {}
            for site, g in checked.groupby("site", sort=False):
                axes = P.SITES[str(site)].axes
                if "pos" in axes:
                    g = where(g, g["pos_key"].isin(keys))
                if not len(g):
                    continue
                df = pd.DataFrame({"layer": g["layer"].astype(int).to_numpy()})
                for ax in axes:
                    df[ax] = ([keys.index(k) for k in g["pos_key"]] if ax == "pos"
                              else g["head_idx" if ax == "head" else "neuron"].astype(int).to_numpy())
                index_rows[site] = df
            if not index_rows:
                continue
            positions = [[token_index(i, k) for k in keys] for i in members] if keys else None
            sites = list(index_rows)
            if positions is None and any("pos" in P.SITES[s].axes for s in sites):
                continue
            run = P.run_patching(
                model, [clean[i] for i in members], [corr[i] for i in members], sites, [mode], [self.main_metric],
                [list(inputs.target_ids[i]) for i in members],
                None if inputs.foil_ids is None else [list(inputs.foil_ids[i]) for i in members],
                layers=self.layers, neuron_layers=self.neuron_layers, neurons=self.neurons,
                batch_size=self.batch_size, positions=positions, index_rows=index_rows)
            runs.append((run, lambda job, pos, keys=keys: keys[pos]))
        return site_means(runs, self.main_metric)


def _label(r) -> str:
    parts = [str(r["site"]), f"L{int(r['layer'])}"]
    if not pd.isna(r.get("head_idx")):
        parts.append(f"H{int(r['head_idx'])}")
    if not pd.isna(r.get("neuron")):
        parts.append(f"N{int(r['neuron'])}")
    if r.get("pos_key") is not None and not pd.isna(r.get("pos_key")):
        parts.append(f"pos {r['pos_key']}")
    return " ".join(parts)

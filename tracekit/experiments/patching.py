# pyright: reportAttributeAccessIssue=false, reportArgumentType=false, reportCallIssue=false, reportGeneralTypeIssues=false, reportIndexIssue=false, reportOptionalMemberAccess=false, reportOptionalSubscript=false, reportOptionalOperand=false, reportReturnType=false, reportAssignmentType=false, reportOperatorIssue=false
"""Activation patching experiment: which activations carry the information that changes the answer?

The method, the sites and the engine live in :mod:`tracekit.patching` (usable from notebooks on
their own); this module is the YAML/notebook experiment around it::

    from tracekit import ActivationPatching, load_model
    res = ActivationPatching(
        pairs=[{"clean": "The capital of France is", "corrupted": "The capital of Italy is",
                "target": " Paris", "foil": " Rome"}],
        sites=["block_every"], directions=["denoising", "noising"],
    ).run(load_model())
    res.to_frame(); res.summary()["top_sites"]; res.figures()

Sources: Meng et al. 2022 (ROME causal tracing); Wang et al. 2022 (IOI); Heimersheim & Nanda 2024
("How to use and interpret activation patching"); Zhang & Nanda 2023 (metrics).

Tables:

* ``main``: one row per direction x site x index (layer, position and/or head/neuron) x pair x
  metric, plus rows averaged over pairs (``pair`` is <NA>, ``scope`` = ``mean``). ``value`` is the
  raw metric of the patched run (``logit_diff`` in logits, ``prob`` in [0, 1], ``log_prob`` in
  nats, ``kl`` in nats); ``normalized`` = ``(value - corrupted) / (clean - corrupted)`` (clean run 1,
  corrupted run 0); NaN for a flagged pair. Mean rows average the raw values over unflagged pairs
  and normalise the averages. Ablation rows carry ``baseline_n`` (prompts averaged by ``mean``; 1
  for ``resample``) and ``baseline_source`` (the resampled prompt's index in the population).
* ``baselines``: per pair and metric the clean and corrupted scores, their gap and ``flagged``.
* ``tokens``: every prompt's tokens (pair, prompt ``clean``/``corrupted``, position, token).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import pandas as pd
import torch
from pydantic import Field, field_validator, model_validator
from tqdm.auto import tqdm

from .. import patching as P
from ..errors import PatchingError
from ..tokens import check_length, encode, single_token_id
from .base import Experiment, Indices, OptionalPrompts, Result, register
from .pairs import PromptPair, load_pairs
from .patching_tables import baselines_frame, job_frame, normalise, tokens_frame

__all__ = ["ActivationPatching", "ActivationPatchingInputs", "ActivationPatchingResult", "PromptPair", "load_pairs"]

Direction = Literal["denoising", "noising"]
Ablation = Literal["zero", "mean", "resample"]


@dataclass(frozen=True)
class ActivationPatchingInputs:
    """What :meth:`ActivationPatching.prepare` builds once: the pairs (read once from a pairs file),
    per pair the target ids and (when every pair has them) the foil ids, the clean and corrupted
    token ids (equal lengths per pair), and the baseline population's ids (None: the clean prompts)
    with its name in errors and in the result's meta."""

    pairs: tuple[PromptPair, ...]
    target_ids: tuple[tuple[int, ...], ...]
    foil_ids: tuple[tuple[int, ...], ...] | None
    clean_ids: tuple[tuple[int, ...], ...]
    corrupted_ids: tuple[tuple[int, ...], ...]
    baseline_ids: tuple[tuple[int, ...], ...] | None
    population_name: str
    population_source: str


class ActivationPatchingResult(Result):
    """Result of :class:`ActivationPatching`: tables ``main``, ``baselines``, ``tokens``."""

    config: "ActivationPatching"
    main_table = "main"

    # ---- helpers -------------------------------------------------------------------------
    def _mean_rows(self, metric: str | None = None) -> pd.DataFrame:
        df = self.tables["main"]
        df = df[df["scope"] == "mean"]
        return df[df["metric"] == (metric or self.config.main_metric)]

    def _site_label(self, r) -> str:
        parts = [f"L{int(r['layer'])}"]
        if not pd.isna(r.get("head")):
            parts.append(f"H{int(r['head'])}")
        if not pd.isna(r.get("neuron")):
            parts.append(f"N{int(r['neuron'])}")
        if not pd.isna(r.get("pos_from_end")):
            tok = r.get("token")
            parts.append(f"pos {int(r['position'])} {tok!r}" if not pd.isna(r.get("position"))
                         else f"pos {int(r['pos_from_end'])}")
        return " ".join(parts)

    def top_sites(self, k: int | None = None, direction: str | None = None, site: str | None = None,
                  metric: str | None = None) -> pd.DataFrame:
        """Mean-over-pairs rows with the largest |effect| (ties: lower layer first). ``effect`` is
        ``normalized`` for denoising and ``1 - normalized`` for noising and ablations (the damage)."""
        df = self._mean_rows(metric)
        if direction is not None:
            df = df[df["direction"] == direction]
        if site is not None:
            df = df[df["site"] == site]
        df = df[df["effect"].notna()]
        df = df.assign(_abs=df["effect"].abs()).sort_values(["_abs", "layer"], ascending=[False, True])
        return df.drop(columns="_abs").head(k or self.config.top_k)

    # ---- summary -------------------------------------------------------------------------
    def summary(self) -> dict:
        base = self.tables["baselines"]
        cfg = self.config
        out: dict = {
            "n_pairs": int(base["pair"].nunique()),
            "metrics": list(cfg.metrics),
            "main_metric": cfg.main_metric,
            "directions": sorted(self.tables["main"]["direction"].unique().tolist()),
            "sites": list(self.meta.get("sites", [])),
        }
        good = base[~base["flagged"]]
        out["clean_mean"] = {m: float(g["clean"].mean()) for m, g in base.groupby("metric")}
        out["corrupted_mean"] = {m: float(g["corrupted"].mean()) for m, g in base.groupby("metric")}
        flagged = base[base["flagged"]]
        out["flagged_pairs"] = [{"pair": int(r.pair), "metric": r.metric, "clean": float(r.clean),
                                 "corrupted": float(r.corrupted)} for r in flagged.itertuples()]
        out["n_flagged"] = int(flagged[flagged["metric"] == cfg.main_metric]["pair"].nunique())
        out["n_unflagged_pairs"] = int(good[good["metric"] == cfg.main_metric]["pair"].nunique())
        if "baseline_population" in self.meta:
            out["baseline_population"] = self.meta["baseline_population"]
        mrows = self.tables["main"][self.tables["main"]["scope"] == "mean"]
        out["mean_flagged_metrics"] = sorted(mrows[mrows["flagged"].astype(bool)]["metric"].unique().tolist())

        def rec(r) -> dict:
            d = {"direction": r["direction"], "site": r["site"], "layer": int(r["layer"]),
                 "label": self._site_label(r), "effect": round(float(r["effect"]), 6),
                 "normalized": round(float(r["normalized"]), 6),
                 "value": round(float(r["value"]), 6)}
            for c in ("position", "head", "neuron"):
                if not pd.isna(r.get(c)):
                    d[c] = int(r[c])
            if not pd.isna(r.get("token")):
                d["token"] = r["token"]
            return d

        out["top_sites"] = [rec(r) for _, r in self.top_sites().iterrows()]
        by = {}
        for (d, s), _ in self._mean_rows().groupby(["direction", "site"], sort=True):
            top = self.top_sites(k=3, direction=d, site=s)
            by[f"{d}/{s}"] = [rec(r) for _, r in top.iterrows()]
        out["top_by_site"] = by
        return out

    def report(self) -> str:
        s = self.summary()
        cfg = self.config
        lines = [(f"activation patching [{cfg.step_name}]: {s['n_pairs']} pair(s), sites {s['sites']}, "
                  f"directions {s['directions']}")]
        base = self.tables["baselines"]
        for m in cfg.metrics:
            b = base[base["metric"] == m]
            lines.append(f"  {m:10s} clean {b['clean'].mean():+.4f}  corrupted {b['corrupted'].mean():+.4f}"
                         f"  (mean over pairs; flagged {int(b['flagged'].sum())})")
        if s["flagged_pairs"]:
            lines.append(f"  FLAGGED (|clean - corrupted| < {cfg.min_denominator}): "
                         + ", ".join(f"pair {f['pair']} {f['metric']}" for f in s["flagged_pairs"]))
        lines.append(f"top sites by |effect| on {cfg.main_metric} (effect = normalized for denoising, "
                     "1 - normalized for noising/ablations; normalized: 1 = clean, 0 = corrupted):")
        lines.append(f"  {'effect':>8} {'normalized':>10}  {'direction':10s} {'site':18s} index")
        for t in s["top_sites"]:
            lines.append(f"  {t['effect']:+8.4f} {t['normalized']:+10.4f}  {t['direction']:10s} {t['site']:18s} "
                         f"{t['label']}")
        return "\n".join(lines)

    # ---- figures -------------------------------------------------------------------------
    def figures(self) -> dict:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt

        figs = {}
        df = self._mean_rows()
        toks = self.tables["tokens"]
        t0 = toks[(toks["pair"] == toks["pair"].min())]
        clean_t = t0[t0["prompt"] == "clean"].set_index("position")["token"]
        corr_t = t0[t0["prompt"] == "corrupted"].set_index("position")["token"]
        equal_len = bool(self.meta.get("equal_lengths", True))

        def pos_label(pfe) -> str:
            n = len(clean_t)
            p = n + int(pfe)
            if not equal_len or p not in clean_t.index:
                return f"{int(pfe)}"
            a, b = clean_t[p], corr_t.get(p, clean_t[p])
            lab = repr(a)[1:-1] if a == b else f"{repr(a)[1:-1]}/{repr(b)[1:-1]}"
            return f"{lab[:14]} ({p})"

        for (d, site), g in df.groupby(["direction", "site"], sort=True):
            axes = P.SITES[site].axes
            g = g.copy()
            g["layer"] = g["layer"].astype(int)
            if axes == ("pos",) or axes == ():
                col = "pos_from_end" if axes else None
                if col is None:
                    g["_c"] = 0
                    col = "_c"
                piv = g.pivot_table(index="layer", columns=col, values="normalized", aggfunc="mean")
                xl = [pos_label(c) for c in piv.columns] if axes else ["all positions"]
                xlabel = "position (token)"
            elif axes == ("head",):
                piv = g.pivot_table(index="layer", columns="head", values="normalized", aggfunc="mean")
                xl = [str(int(c)) for c in piv.columns]
                xlabel = "head" + (" (key/value head)" if P.SITES[site].kv_heads else "")
            elif axes == ("pos", "head"):
                piv = g.pivot_table(index="layer", columns=["pos_from_end", "head"], values="normalized",
                                    aggfunc="mean")
                xl = [f"{pos_label(p)} H{int(h)}" if int(h) == 0 else f"H{int(h)}" for p, h in piv.columns]
                xlabel = "position (token) x head"
            elif axes == ("neuron",):
                piv = g.pivot_table(index="layer", columns="neuron", values="normalized", aggfunc="mean")
                xl = None
                xlabel = "neuron"
            else:  # ("pos", "neuron")
                piv = g.pivot_table(index=["layer", "pos_from_end"], columns="neuron", values="normalized",
                                    aggfunc="mean")
                piv.index = [f"L{int(L)} {pos_label(p)}" for L, p in piv.index]
                xl = None
                xlabel = "neuron"
            grid = piv.to_numpy(dtype=float)
            lim = float(np.nanmax(np.abs(grid))) if np.isfinite(grid).any() else 1.0
            lim = max(lim, 1e-6)
            w = 3.5 + (0.55 * grid.shape[1] if xl is not None and grid.shape[1] <= 60 else 8)
            h = 2.0 + 0.22 * grid.shape[0]
            fig, ax = plt.subplots(figsize=(min(w, 40), min(h, 30)))
            im = ax.imshow(grid, aspect="auto", origin="lower", cmap="RdBu", vmin=-lim, vmax=lim,
                           interpolation="nearest")
            if xl is not None:
                ax.set_xticks(range(len(xl)), xl, rotation=70, fontsize=7)
            ax.set_yticks(range(len(piv.index)), [str(i) for i in piv.index], fontsize=6)
            ax.set_xlabel(xlabel)
            ax.set_ylabel("layer")
            what = {"denoising": "clean -> corrupted run", "noising": "corrupted -> clean run"}.get(
                d, f"{d} ablation of the clean run")
            ax.set_title(f"{site} patching, {d} ({what})\nnormalized {self.config.main_metric}: "
                         "1 = clean, 0 = corrupted", fontsize=9)
            fig.colorbar(im, ax=ax, fraction=0.03)
            fig.tight_layout()
            figs[f"{d}_{site}"] = fig
        return figs


@register
class ActivationPatching(Experiment):
    """Activation patching over prompt pairs, every site, both directions, with ablation baselines.

    Fields:
        pairs: inline prompt pairs (:class:`PromptPair`: ``clean``, ``corrupted``, ``target``, ``foil``).
        pairs_file: or a ``.jsonl``/``.json``/``.csv`` file of pairs (relative to the working directory).
        sites: site names or groups (``resid_pre``, ``resid_mid``, ``resid_post``, ``attn_out``,
            ``mlp_out``, ``head_out``, ``head_q|k|v``, ``head_pattern`` (each also ``_by_pos``),
            ``neuron``/``neuron_by_pos``, ``resid_pre_layer``, ...; groups ``block_every``,
            ``resid_every``, ``heads_every``, ``heads_every_by_pos``). See :mod:`tracekit.patching`.
        directions: ``denoising`` (clean activation into the corrupted run) and/or ``noising``.
        ablations: baselines on the clean run: ``zero``, ``mean`` (the site's mean over the baseline
            population, other than the pair's own clean prompt, aligned by position from the end;
            at least 2 such prompts at least as long as the pair), ``resample`` (the site from one
            other prompt of the population, drawn with ``seed``). Table columns ``baseline_n`` and
            ``baseline_source`` record the population size and the resampled prompt.
        baseline_prompts: the baseline population of ``mean``/``resample`` (default: every pair's
            clean prompt; ``baseline_source`` indexes this list).
        metrics: any of ``logit_diff``, ``prob``, ``log_prob``, ``kl`` (:mod:`tracekit.metrics`);
            ``main_metric`` ranks sites and colours the heatmaps.
        main_metric: the metric (one of ``metrics``) that ranks sites in the summary and colours the
            heatmaps (default ``logit_diff``).
        layers: block indices to patch (default all; negative from the end); ``neuron_layers``/``neurons``
            for neuron sites.
        neuron_layers: block indices whose MLP neurons (``blocks.{L}.mlp.hook_post``) are patched by
            ``neuron``/``neuron_by_pos`` sites (negative from the end); required when a neuron site is listed.
        neurons: neuron indices ``0 .. d_mlp-1`` patched in each of ``neuron_layers`` (default: all).
        seed: seed of the ``resample`` ablation's draw of the other prompt (default 0).
        min_denominator: a pair whose |clean - corrupted| score is below this is flagged and gets
            NaN normalised values (never a division by ~0).
        batch_size: variants per replay batch or ``auto`` (free memory); halves on out-of-memory.
        skip_unchanged: bit-exact no-op patches take the cached run's score (exact, faster).
        top_k: sites listed in the summary.

    Raises (from :meth:`check`, before any model work):
        TokenizationError: a target/foil that is not one token, or a pair whose prompts tokenize to
            different lengths (both tokenizations are shown side by side).
        PatchingError: missing foils for ``logit_diff``, layers/neurons out of range, a baseline
            population too small for ``mean``/``resample``; the field is named.
    """

    kind: Literal["activation_patching"] = "activation_patching"
    pairs: list[PromptPair] = Field(default_factory=list)
    pairs_file: str | None = None
    sites: list[str] = Field(default_factory=lambda: ["block_every"])
    directions: list[Direction] = Field(default_factory=lambda: ["denoising"])
    ablations: list[Ablation] = Field(default_factory=list)
    baseline_prompts: OptionalPrompts = Field(default_factory=list)
    metrics: list[Literal["logit_diff", "prob", "log_prob", "kl"]] = Field(
        default_factory=lambda: ["logit_diff", "prob", "log_prob", "kl"], min_length=1)
    main_metric: Literal["logit_diff", "prob", "log_prob", "kl"] = "logit_diff"
    layers: Indices | None = None
    neuron_layers: Indices | None = None
    neurons: Indices | None = None
    min_denominator: float = Field(default=1e-3, gt=0)
    batch_size: int | Literal["auto"] = "auto"
    skip_unchanged: bool = True
    seed: int = 0
    top_k: int = Field(default=10, ge=1)

    result_class = ActivationPatchingResult

    @field_validator("batch_size")
    @classmethod
    def _bs(cls, v):
        if isinstance(v, int) and v < 1:
            raise ValueError("batch_size must be >= 1 or 'auto'")
        return v

    @model_validator(mode="after")
    def _consistent(self):
        if not self.pairs and not self.pairs_file:
            raise ValueError("give prompt pairs: 'pairs' (a list of {clean, corrupted, target, foil}) or "
                             "'pairs_file' (.jsonl/.json/.csv)")
        if self.pairs and self.pairs_file:
            raise ValueError("give either 'pairs' or 'pairs_file', not both")
        if self.main_metric not in self.metrics:
            raise ValueError(f"main_metric {self.main_metric!r} must be one of metrics {self.metrics}")
        if not self.directions and not self.ablations:
            raise ValueError("directions and ablations are both empty; add 'denoising' to directions")
        if self.baseline_prompts and not {"mean", "resample"} & set(self.ablations):
            raise ValueError("baseline_prompts: only the 'mean' and 'resample' ablations use a baseline population; "
                             "add one to ablations or remove baseline_prompts")
        try:
            sites = P.expand_sites(self.sites)
        except P.PatchingError as e:
            raise ValueError(str(e)) from e
        if any(s.startswith("neuron") for s in sites) and not self.neuron_layers:
            raise ValueError("sites include neurons: set neuron_layers (e.g. [20, 21]) to choose the layers "
                             "whose MLP neurons are patched")
        return self

    # ---- input handling ------------------------------------------------------------------
    def all_pairs(self) -> list[PromptPair]:
        return list(self.pairs) if self.pairs else load_pairs(self.pairs_file)

    @property
    def modes(self) -> list[str]:
        return list(self.directions) + list(self.ablations)

    def _token_ids(self, model, pairs) -> tuple[list[list[int]], list[list[int]] | None]:
        """Per pair the target ids and (when every pair has them) the foil ids."""
        tids, fids = [], []
        for i, p in enumerate(pairs):
            many_t, many_f = len(p.targets) > 1, len(p.foils) > 1
            t = [single_token_id(model, x, field=f"pairs[{i}].target" + (f"[{j}]" if many_t else ""))
                 for j, x in enumerate(p.targets)]
            f = [single_token_id(model, x, field=f"pairs[{i}].foil" + (f"[{j}]" if many_f else ""))
                 for j, x in enumerate(p.foils)]
            if f and len(f) != len(t):
                raise PatchingError(f"pairs[{i}]: target has {len(t)} tokens but foil has {len(f)}; give one foil "
                                    "token per target (logit_diff pairs them up)")
            if "logit_diff" in self.metrics and not f:
                raise PatchingError(f"pairs[{i}].foil: the logit_diff metric needs a foil token (e.g. ' Rome'); "
                                    "add it or drop logit_diff from metrics")
            tids.append(t)
            fids.append(f)
        if len({len(t) for t in tids}) > 1:
            raise PatchingError("pairs[*].target: every pair needs the same number of target tokens")
        return tids, (fids if all(fids) else None)

    def _population(self, model) -> tuple[tuple[tuple[int, ...], ...] | None, str, str]:
        """``(baseline ids or None, population name for errors, population name for meta)``."""
        if not self.baseline_prompts:
            return None, "the pairs' clean prompts", "pairs.clean"
        ids = []
        for i, text in enumerate(self.baseline_prompts):
            seq = encode(model, text)
            check_length(model, seq, f"baseline_prompts[{i}]", text)
            ids.append(tuple(seq))
        return tuple(ids), "baseline_prompts", "baseline_prompts"

    def prepare(self, model) -> ActivationPatchingInputs:
        """Load the pairs, resolve target/foil ids, tokenize every clean/corrupted prompt (equal
        lengths required) and the baseline population (tokenizer only: works on a
        :class:`tracekit.model.ModelInfo`)."""
        pairs = self.all_pairs()
        field = "pairs" if self.pairs else f"pairs_file ({self.pairs_file})"
        tids, fids = self._token_ids(model, pairs)
        ids = P.check_same_length(model, [p.clean for p in pairs], [p.corrupted for p in pairs], field=field)
        for i, (c, _) in enumerate(ids):
            check_length(model, c, f"{field}[{i}]", pairs[i].clean)
        pop, pop_name, pop_meta = self._population(model)
        return ActivationPatchingInputs(
            pairs=tuple(pairs), target_ids=tuple(tuple(t) for t in tids),
            foil_ids=None if fids is None else tuple(tuple(f) for f in fids),
            clean_ids=tuple(tuple(c) for c, _ in ids), corrupted_ids=tuple(tuple(x) for _, x in ids),
            baseline_ids=pop, population_name=pop_name, population_source=pop_meta)

    def check(self, model) -> ActivationPatchingInputs:
        """:meth:`prepare`, then the layers, neurons and baseline population (tokenizer and config
        only: works on a :class:`tracekit.model.ModelInfo`)."""
        inputs = self.prepare(model)
        n = int(model.cfg.n_layers)
        P.resolve_layers(n, self.layers, "layers")
        P.resolve_layers(n, self.neuron_layers or [], "neuron_layers")
        d_mlp = int(getattr(model.cfg, "d_mlp", 0) or 0)
        for i, j in enumerate(self.neurons or []):
            if not 0 <= j < d_mlp:
                raise PatchingError(f"neurons[{i}]: {j} is out of range (the MLP has {d_mlp} neurons)")
        clean_ids = [list(c) for c in inputs.clean_ids]
        pop = inputs.baseline_ids
        for mode in ("mean", "resample"):
            if mode in self.ablations:
                P.baseline_members(clean_ids, [list(b) for b in pop] if pop is not None else clean_ids, mode,
                                   inputs.population_name)
        return inputs

    # ---- run -----------------------------------------------------------------------------
    @torch.no_grad()
    def _run(self, model, inputs: ActivationPatchingInputs, progress: bool = True) -> ActivationPatchingResult:
        tids = [list(t) for t in inputs.target_ids]
        fids = None if inputs.foil_ids is None else [list(f) for f in inputs.foil_ids]
        clean_ids, corr_ids = [list(c) for c in inputs.clean_ids], [list(x) for x in inputs.corrupted_ids]
        ids = list(zip(clean_ids, corr_ids))
        pop = None if inputs.baseline_ids is None else [list(b) for b in inputs.baseline_ids]
        pop_meta = inputs.population_source
        sites = P.expand_sites(self.sites)
        n_layers = int(model.cfg.n_layers)
        modes = self.modes
        lengths = [len(c) for c in clean_ids]
        total = P.count_variants(model, lengths, sites, len(modes), self.layers, self.neuron_layers, self.neurons)
        bar = tqdm(total=total, desc="activation patching", disable=not progress, leave=False)
        try:
            out = P.run_patching(model, clean_ids, corr_ids, sites, modes, list(self.metrics), tids, fids,
                                 layers=self.layers, neuron_layers=self.neuron_layers, neurons=self.neurons,
                                 baseline_ids=pop, seed=self.seed, batch_size=self.batch_size,
                                 skip_unchanged=self.skip_unchanged, progress=bar.update)
        finally:
            bar.close()

        tokens_df = tokens_frame(model, ids)
        baselines = baselines_frame(out, len(inputs.pairs), self.min_denominator)
        frames = [job_frame(job, tokens_df, list(self.metrics)) for job in out.jobs]
        equal = len(set(lengths)) == 1
        main = normalise(pd.concat(frames, ignore_index=True), baselines, equal, self.min_denominator)
        meta = {"n_layers": n_layers, "sites": sites, "modes": modes, "lengths": lengths,
                "equal_lengths": equal, "layers": P.resolve_layers(n_layers, self.layers),
                "neuron_layers": P.resolve_layers(n_layers, self.neuron_layers or [], "neuron_layers"),
                "hooks": {s: P.SITES[s].hook for s in sites}}
        if {"mean", "resample"} & set(modes):
            meta["baseline_population"] = {"source": pop_meta, "size": out.population_size,
                                           "min_mean": P.MIN_MEAN_POPULATION,
                                           "alignment": "position from the end; own clean prompt excluded"}
        return ActivationPatchingResult(self, {"main": main, "baselines": baselines, "tokens": tokens_df}, meta)

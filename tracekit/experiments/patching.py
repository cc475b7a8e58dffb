"""Activation patching experiment: which activations carry the information that changes the answer?

The method, the sites and the engine live in :mod:`tracekit.patching` (usable from notebooks on
their own); this module is the YAML/notebook experiment around it::

    from tracekit import ActivationPatching, load_model
    res = ActivationPatching(
        pairs=[{"clean": "The capital of France is", "corrupted": "The capital of Italy is",
                "answer": " Paris", "wrong": " Rome"}],
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
  and normalise the averages.
* ``baselines``: per pair and metric the clean and corrupted scores, their gap and ``flagged``.
* ``tokens``: every prompt's tokens (pair, prompt ``clean``/``corrupted``, position, token).
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Literal, Optional, Union

import numpy as np
import pandas as pd
import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from tqdm.auto import tqdm

from .. import patching as P
from ..models import model_device
from ..tokens import TokenizationError, single_token_id, str_tokens
from .base import Experiment, Result, register, StrictModel

__all__ = ["ActivationPatching", "ActivationPatchingResult", "PromptPair", "load_pairs"]

METRICS = ("logit_diff", "prob", "log_prob", "kl")
Direction = Literal["denoising", "noising"]
Ablation = Literal["zero", "mean", "resample"]


class PromptPair(StrictModel):
    """One clean/corrupted prompt pair.

    Fields:
        clean: the prompt with the answer (``"The capital of France is"``).
        corrupted: the same prompt with the key detail changed; must tokenize to the same length.
        answer: the clean answer token (``" Paris"``), or a list of them (one per answer/wrong pair).
        wrong: the corrupted answer (``" Rome"``), or a list as long as ``answer``; needed by
            the ``logit_diff`` metric.
    """

    model_config = ConfigDict(extra="forbid")

    clean: str
    corrupted: str
    answer: Union[str, list[str]]
    wrong: Optional[Union[str, list[str]]] = None

    @model_validator(mode="after")
    def _answer_differs_from_wrong(self):
        a = [self.answer] if isinstance(self.answer, str) else list(self.answer)
        w = [] if self.wrong is None else ([self.wrong] if isinstance(self.wrong, str) else list(self.wrong))
        same = [x for x, y in zip(a, w) if x == y]
        if same:
            raise ValueError(f"answer and wrong must differ (both {same[0]!r}): the logit difference "
                             "would be 0 for every run; set wrong to the corrupted prompt's answer")
        return self

    @property
    def answers(self) -> list[str]:
        return [self.answer] if isinstance(self.answer, str) else list(self.answer)

    @property
    def wrongs(self) -> list[str]:
        if self.wrong is None:
            return []
        return [self.wrong] if isinstance(self.wrong, str) else list(self.wrong)


def _maybe_list(v):
    if isinstance(v, str) and v.strip().startswith("["):
        try:
            return json.loads(v)
        except json.JSONDecodeError:
            return v
    if isinstance(v, float) and np.isnan(v):
        return None
    return v


def load_pairs(path: Union[str, Path], field: str = "pairs_file") -> list[PromptPair]:
    """Read prompt pairs from JSONL (one object per line), JSON (a list) or CSV (header row).

    Keys/columns: ``clean``, ``corrupted``, ``answer``, ``wrong`` (a JSON list string such as
    ``["' Paris'"]`` for several answers in CSV).

    Raises:
        ValueError: missing file, unknown extension, or a record without the needed keys; the
            message names ``field`` and the record.
    """
    p = Path(path).expanduser()
    if not p.is_file():
        raise ValueError(f"{field}: no such file {str(path)!r} (paths are relative to the working directory)")
    ext = p.suffix.lower()
    if ext == ".jsonl":
        recs = []
        for lineno, line in enumerate(p.read_text().splitlines(), start=1):
            if not line.strip():
                continue
            try:
                recs.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{field}: {p} line {lineno} is not valid JSON ({e.msg}); "
                                 "each line must be one object with clean, corrupted, answer, wrong") from e
    elif ext == ".json":
        try:
            recs = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{field}: {p} is not valid JSON ({e})") from e
        if not isinstance(recs, list):
            raise ValueError(f"{field}: {p} must hold a JSON list of pair objects")
    elif ext == ".csv":
        with p.open(newline="") as f:
            recs = [{k: _maybe_list(v) for k, v in r.items() if v not in ("", None)} for r in csv.DictReader(f)]
    else:
        raise ValueError(f"{field}: {p} must end in .jsonl, .json or .csv")
    out = []
    for i, r in enumerate(recs):
        try:
            out.append(PromptPair.model_validate(r))
        except Exception as e:  # noqa: BLE001
            raise ValueError(f"{field}: record {i} of {p} is not a pair with keys clean, corrupted, answer, "
                             f"wrong: {e}") from e
    if not out:
        raise ValueError(f"{field}: {p} holds no pairs")
    return out


class ActivationPatchingResult(Result):
    """Result of :class:`ActivationPatching`: tables ``main``, ``baselines``, ``tokens``."""

    main_table = "main"

    # ---- helpers -------------------------------------------------------------------------
    def _mean_rows(self, metric: Optional[str] = None) -> pd.DataFrame:
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

    def top_sites(self, k: Optional[int] = None, direction: Optional[str] = None, site: Optional[str] = None,
                  metric: Optional[str] = None) -> pd.DataFrame:
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
        lines = [f"activation patching [{cfg.step_name}]: {s['n_pairs']} pair(s), sites {s['sites']}, "
                 f"directions {s['directions']}"]
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

        def pos_label(pfe: int) -> str:
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
        pairs: inline prompt pairs (:class:`PromptPair`: ``clean``, ``corrupted``, ``answer``, ``wrong``).
        pairs_file: or a ``.jsonl``/``.json``/``.csv`` file of pairs (relative to the working directory).
        sites: site names or groups (``resid_pre``, ``resid_mid``, ``resid_post``, ``attn_out``,
            ``mlp_out``, ``head_out``, ``head_q|k|v``, ``head_pattern`` (each also ``_by_pos``),
            ``neuron``/``neuron_by_pos``, ``resid_pre_layer``, ...; groups ``block_every``,
            ``resid_every``, ``heads_every``, ``heads_every_by_pos``). See :mod:`tracekit.patching`.
        directions: ``denoising`` (clean activation into the corrupted run) and/or ``noising``.
        ablations: baselines on the clean run: ``zero``, ``mean`` (over the dataset's clean prompts,
            per position; pairs of one token length), ``resample`` (the site from another pair's
            clean prompt of the same length, chosen with ``seed``).
        metrics: any of ``logit_diff``, ``prob``, ``log_prob``, ``kl``; ``main_metric`` ranks sites
            and colours the heatmaps.
        layers: layers to patch (default all); ``neuron_layers``/``neurons`` for neuron sites.
        min_denominator: a pair whose |clean - corrupted| score is below this is flagged and gets
            NaN normalised values (never a division by ~0).
        batch_size: variants per replay batch or ``auto`` (free memory); halves on CUDA OOM.
        skip_unchanged: bit-exact no-op patches take the cached run's score (exact, faster).
        top_k: sites listed in the summary.

    Raises (from :meth:`check`, before any model work):
        TokenizationError: an answer that is not one token, or a pair whose prompts tokenize to
            different lengths (both tokenizations are shown side by side).
        ValueError: missing/contradictory fields, unknown sites, bad layers; the field is named.
    """

    kind: Literal["activation_patching"] = "activation_patching"
    pairs: list[PromptPair] = Field(default_factory=list)
    pairs_file: Optional[str] = None
    sites: list[str] = Field(default_factory=lambda: ["block_every"])
    directions: list[Direction] = Field(default_factory=lambda: ["denoising"])
    ablations: list[Ablation] = Field(default_factory=list)
    metrics: list[Literal["logit_diff", "prob", "log_prob", "kl"]] = Field(
        default_factory=lambda: ["logit_diff", "prob", "log_prob", "kl"], min_length=1)
    main_metric: Literal["logit_diff", "prob", "log_prob", "kl"] = "logit_diff"
    layers: Optional[list[int]] = None
    neuron_layers: Optional[list[int]] = None
    neurons: Optional[list[int]] = None
    min_denominator: float = Field(default=1e-3, gt=0)
    batch_size: Union[int, Literal["auto"]] = "auto"
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
            raise ValueError("give prompt pairs: 'pairs' (a list of {clean, corrupted, answer, wrong}) or "
                             "'pairs_file' (.jsonl/.json/.csv)")
        if self.pairs and self.pairs_file:
            raise ValueError("give either 'pairs' or 'pairs_file', not both")
        if self.main_metric not in self.metrics:
            raise ValueError(f"main_metric {self.main_metric!r} must be one of metrics {self.metrics}")
        if not self.directions and not self.ablations:
            raise ValueError("directions and ablations are both empty; add 'denoising' to directions")
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

    def _pair_ids(self, model, pairs):
        ans, wr = [], []
        for i, p in enumerate(pairs):
            a = [single_token_id(model, t, field=f"pairs[{i}].answer" + (f"[{j}]" if len(p.answers) > 1 else ""))
                 for j, t in enumerate(p.answers)]
            w = [single_token_id(model, t, field=f"pairs[{i}].wrong" + (f"[{j}]" if len(p.wrongs) > 1 else ""))
                 for j, t in enumerate(p.wrongs)]
            if "logit_diff" in self.metrics:
                if not w:
                    raise ValueError(f"pairs[{i}].wrong: the logit_diff metric needs a wrong answer token "
                                     "(e.g. ' Rome'); add it or drop logit_diff from metrics")
                if len(w) != len(a):
                    raise ValueError(f"pairs[{i}]: answer has {len(a)} tokens but wrong has {len(w)}; give "
                                     "one wrong token per answer (logit_diff pairs them up)")
            ans.append(a)
            wr.append(w or a)
        if len({len(a) for a in ans}) > 1:
            raise ValueError("pairs[*].answer: every pair needs the same number of answer tokens")
        return ans, wr

    def check(self, model) -> None:
        pairs = self.all_pairs()
        field = "pairs" if self.pairs else f"pairs_file ({self.pairs_file})"
        self._pair_ids(model, pairs)
        ids = P.check_same_length(model, [p.clean for p in pairs], [p.corrupted for p in pairs], field=field)
        n = model.cfg.n_layers
        for nm, ls in (("layers", self.layers), ("neuron_layers", self.neuron_layers)):
            for L in ls or []:
                if not -n <= L < n:
                    raise ValueError(f"{nm}: layer {L} is out of range for a {n}-layer model (0..{n - 1})")
        d_mlp = int(getattr(model.cfg, "d_mlp", 0) or 0)
        for j in self.neurons or []:
            if not 0 <= j < d_mlp:
                raise ValueError(f"neurons: {j} is out of range (the MLP has {d_mlp} neurons)")
        if "resample" in self.ablations:
            lens = [len(c) for c, _ in ids]
            lonely = [i for i, L in enumerate(lens) if lens.count(L) < 2]
            if lonely:
                raise ValueError(f"ablations: 'resample' takes each site from another pair's clean prompt of the "
                                 f"same token length, but pairs {lonely} have no other pair of their length; "
                                 "add pairs or drop 'resample'")

    # ---- run -----------------------------------------------------------------------------
    @torch.no_grad()
    def _run(self, model, progress: bool = True) -> ActivationPatchingResult:
        pairs = self.all_pairs()
        ans_ids, wrong_ids = self._pair_ids(model, pairs)
        ids = P.check_same_length(model, [p.clean for p in pairs], [p.corrupted for p in pairs])
        sites = P.expand_sites(self.sites)
        n_layers = model.cfg.n_layers
        layers = sorted({L % n_layers for L in self.layers}) if self.layers else list(range(n_layers))
        nlayers = sorted({L % n_layers for L in self.neuron_layers or []})
        modes = list(self.directions) + list(self.ablations)
        dev = model_device(model)
        lengths = [len(c) for c, _ in ids]
        groups: dict[int, list[int]] = {}
        for i, L in enumerate(lengths):
            groups.setdefault(L, []).append(i)
        gen = torch.Generator().manual_seed(self.seed)

        tok_rows = []
        for i, (c, x) in enumerate(ids):
            for nm, seq in (("clean", c), ("corrupted", x)):
                for p, (t, tid) in enumerate(zip(str_tokens(model, seq), seq)):
                    tok_rows.append({"pair": i, "prompt": nm, "position": p, "token": t, "token_id": int(tid)})
        tokens_df = pd.DataFrame(tok_rows)

        # the variants of one group: (mode, site) jobs over index rows x pairs
        def index_df(site: P.Site, n_pos: int) -> pd.DataFrame:
            lay = nlayers if site.name.startswith("neuron") else layers
            return P._index_df(model, site, n_pos, layers=lay, neurons=self.neurons)

        total = sum(len(index_df(P.SITES[s], L)) * len(g) * len(modes) for L, g in groups.items() for s in sites)
        bar = tqdm(total=total, desc="activation patching", disable=not progress, leave=False)
        frames, base_rows_out = [], []
        for L, members in sorted(groups.items()):
            n = len(members)
            toks = torch.tensor([ids[i][0] for i in members] + [ids[i][1] for i in members], device=dev)
            hooks = sorted({P.SITES[s].hook_name(l) for s in sites
                            for l in (nlayers if s.startswith("neuron") else layers)})
            run = P.cache_run(model, toks, hooks)
            A = torch.tensor([ans_ids[i] for i in members], device=dev)
            W = torch.tensor([wrong_ids[i] for i in members], device=dev)
            clean_lp = torch.log_softmax(run.logits[:n].float(), -1)
            metric_names = list(self.metrics)

            def row_metric(logits, br, A=A, W=W, clean_lp=clean_lp, n=n):
                pi = br % n
                lg = logits.float()
                lp = torch.log_softmax(lg, -1)
                out = []
                for m in metric_names:
                    if m == "logit_diff":
                        out.append(P.logit_diff(lg, A[pi], W[pi]))
                    elif m == "prob":
                        out.append(lp.gather(-1, A[pi]).exp().mean(-1))
                    elif m == "log_prob":
                        out.append(lp.gather(-1, A[pi]).mean(-1))
                    else:
                        ref = clean_lp[pi]
                        out.append((ref.exp() * (ref - lp)).sum(-1))
                return torch.stack(out, -1)

            base_vals = row_metric(run.logits, torch.arange(2 * n, device=dev)).cpu()
            for k, i in enumerate(members):
                for mi, m in enumerate(metric_names):
                    c, x = float(base_vals[k, mi]), float(base_vals[n + k, mi])
                    base_rows_out.append({"pair": i, "metric": m, "clean": c, "corrupted": x, "denominator": c - x,
                                          "flagged": bool(abs(c - x) < self.min_denominator)})

            jobs, meta_jobs = [], []
            b = torch.arange(n)
            shift = int(torch.randint(1, n, (1,), generator=gen)) if n > 1 else 0
            for mode in modes:
                for s in sites:
                    site = P.SITES[s]
                    idf = index_df(site, L)
                    V = len(idf)
                    lay_t = torch.tensor(idf["layer"].to_numpy(), dtype=torch.long)
                    source, src_rows = {}, None
                    if mode == "denoising":
                        base, src_rows = b + n, b
                    elif mode == "noising":
                        base, src_rows = b, b + n
                    elif mode == "resample":
                        base, src_rows = b, (b + shift) % n
                    else:
                        base, src_rows = b, torch.zeros_like(b)
                    for l in idf["layer"].unique().tolist():
                        act = run.acts[site.hook_name(int(l))]
                        if mode == "zero":
                            source[int(l)] = torch.zeros_like(act[:1])
                        elif mode == "mean":
                            source[int(l)] = act[:n].mean(0, keepdim=True)
                        else:
                            source[int(l)] = act
                    jobs.append(P.PatchJob(
                        site=site, layer=lay_t.repeat_interleave(n),
                        index={a: torch.tensor(idf[a].to_numpy(), dtype=torch.long).repeat_interleave(n).to(dev)
                               for a in site.axes},
                        base_rows=base.repeat(V).to(dev), source=source, src_rows=src_rows.repeat(V).to(dev)))
                    meta_jobs.append((mode, site, idf))
            results = P.patch_rows(model, run, jobs, row_metric, self.batch_size, self.skip_unchanged,
                                   progress=bar.update)
            for (mode, site, idf), vals in zip(meta_jobs, results):
                frames.append(self._frame(mode, site, idf, vals, members, L, tokens_df))
        bar.close()

        baselines = pd.DataFrame(base_rows_out).sort_values(["pair", "metric"]).reset_index(drop=True)
        main = pd.concat(frames, ignore_index=True)
        main = self._normalise(main, baselines, equal=len(groups) == 1)
        meta = {"n_layers": n_layers, "sites": sites, "modes": modes, "lengths": lengths,
                "equal_lengths": len(groups) == 1, "layers": layers, "neuron_layers": nlayers,
                "hooks": {s: P.SITES[s].hook for s in sites}}
        return ActivationPatchingResult(self, {"main": main, "baselines": baselines, "tokens": tokens_df}, meta)

    def _frame(self, mode, site, idf, vals, members, L, tokens_df) -> pd.DataFrame:
        n = len(members)
        V = len(idf)
        M = len(self.metrics)
        rep = idf.loc[idf.index.repeat(n)].reset_index(drop=True)
        df = pd.DataFrame({
            "direction": mode, "site": site.name,
            "hook": [site.hook_name(int(l)) for l in rep["layer"]],
            "layer": rep["layer"].astype("int64"),
            "position": rep["pos"].astype("Int64") if "pos" in rep else pd.array([pd.NA] * len(rep), dtype="Int64"),
            "head": rep["head"].astype("Int64") if "head" in rep else pd.array([pd.NA] * len(rep), dtype="Int64"),
            "neuron": rep["neuron"].astype("Int64") if "neuron" in rep else pd.array([pd.NA] * len(rep), dtype="Int64"),
            "pair": pd.array(np.tile(np.asarray(members), V), dtype="Int64"),
        })
        df["pos_from_end"] = (df["position"] - L).astype("Int64")
        tk = tokens_df[tokens_df["prompt"] == "clean"][["pair", "position", "token"]].astype(
            {"pair": "Int64", "position": "Int64"})
        df = df.merge(tk, on=["pair", "position"], how="left")
        v = vals.numpy().reshape(V * n, M)
        out = pd.concat([df.assign(metric=m, value=v[:, k]) for k, m in enumerate(self.metrics)], ignore_index=True)
        return out

    def _normalise(self, main: pd.DataFrame, baselines: pd.DataFrame, equal: bool) -> pd.DataFrame:
        b = baselines.set_index(["pair", "metric"])
        key = list(zip(main["pair"].astype(int), main["metric"]))
        clean = b["clean"].reindex(key).to_numpy()
        corr = b["corrupted"].reindex(key).to_numpy()
        main["normalized"] = P.normalize(main["value"].to_numpy(), clean, corr, self.min_denominator)
        main["flagged"] = b["flagged"].reindex(key).to_numpy()
        main["scope"] = "pair"
        # mean over unflagged pairs, normalising the averages
        good = main[~main["flagged"]].copy()
        good["_clean"] = clean[~main["flagged"].to_numpy()]
        good["_corr"] = corr[~main["flagged"].to_numpy()]
        keys = ["direction", "site", "hook", "layer", "pos_from_end", "head", "neuron", "metric"]
        if good.empty:
            mean = main.iloc[0:0].copy()
        else:
            agg = good.groupby(keys, dropna=False, sort=False).agg(
                value=("value", "mean"), _clean=("_clean", "mean"), _corr=("_corr", "mean"),
                position=("position", "first"), token=("token", "first")).reset_index()
            agg["normalized"] = P.normalize(agg["value"].to_numpy(), agg["_clean"].to_numpy(),
                                            agg["_corr"].to_numpy(), self.min_denominator)
            mean_flag = np.abs(agg["_clean"].to_numpy() - agg["_corr"].to_numpy()) < self.min_denominator
            mean = agg.drop(columns=["_clean", "_corr"])
            if not equal:
                mean["position"] = pd.array([pd.NA] * len(mean), dtype="Int64")
                mean["token"] = None
            mean["pair"] = pd.array([pd.NA] * len(mean), dtype="Int64")
            # the averaged clean/corrupted gap can vanish even when no single pair's does
            mean["flagged"] = mean_flag
            mean["scope"] = "mean"
        cols = ["scope", "direction", "site", "hook", "layer", "position", "pos_from_end", "token", "head", "neuron",
                "pair", "metric", "value", "normalized", "flagged"]
        out = pd.concat([main[cols], mean[cols]], ignore_index=True)
        # effect: how far the patch moves the run it was applied to, towards the other run
        # (denoising: normalized; noising and ablations of the clean run: 1 - normalized)
        out["effect"] = np.where(out["direction"] == "denoising", out["normalized"], 1.0 - out["normalized"])
        for c in ("position", "pos_from_end", "head", "neuron", "pair"):
            out[c] = out[c].astype("Int64")
        return out

"""Attribution graph experiment (``kind: attribution_graph``): one verified attribution graph per prompt.

The method lives in :mod:`tracekit.graphs` (usable from notebooks): the local replacement model
(frozen attention patterns and normalisation scales, every MLP replaced by its transcoder plus an
error node) and the adjacency of direct effects between active features, error nodes, token
embeddings and the output logits (:func:`tracekit.graphs.attribution.build_graph`), pruning by
influence (:func:`tracekit.graphs.prune.prune_graph`), the replacement and completeness scores
(:func:`tracekit.graphs.prune.graph_scores`), verification by intervention in the real model
(:func:`tracekit.graphs.verify.verify_graph`), the split of edges by attention head and the QK
attribution of named heads (:mod:`tracekit.graphs.heads`), and the tables, circuit-tracer /
Neuronpedia JSON and offline HTML page (:mod:`tracekit.graphs.tables`, ``.export``, ``.view``,
``.cards``). This module is the YAML/notebook experiment around them::

    from tracekit import AttributionGraphExperiment, load_model
    res = AttributionGraphExperiment(
        prompts="The capital of China is Beijing. The capital of France is", target=" Paris", foil=" Beijing",
        transcoders={"path": "transcoders/smollm2"}).run(load_model())
    res.summary()["verification"]   # logits / completeness errors, pearson, spearman, scores
    res.tables["main_path"]         # the top features by influence, with the tokens they promote
    res.save("out/")                # + graph_<row>.json (Neuronpedia) and graph_<row>.html

**Transcoders** (``transcoders``): :class:`tracekit.dictionaries.spec.TranscoderSpec`, a saved set
(``path``) or a ``train`` block (trained on the first run, loaded from the content-keyed cache on
later runs: :func:`tracekit.dictionaries.train.load_transcoders`). The graph needs one transcoder
per block; a set missing a layer, or trained for another model, is refused by name before the model
runs.

**Rows**: ``prompts`` with a one-token ``target`` (and optional ``foil``), or a ``dataset`` whose
rows carry their own; one graph per row, at most ``max_rows``. The graph explains the logits at the
last position; the verification follows the target logit (minus the foil's, with a foil).

**Verification** (``verify``, on by default; Ameisen et al. 2025, "Circuit Tracing", Sections
3-4): (a) the replacement model with its error nodes reproduces the model's logits
(``logits_max_abs_error``); (b) each node's input is the sum of its incoming edges plus its bias
(``completeness_max_abs_error``); (c) the top ``verify.top_k`` features by influence and a seeded
random sample of ``verify.n_random`` others are ablated (or scaled) in the real model, error nodes
held fixed, and the measured change of the target logit is compared with the graph's prediction
(``pearson``, ``spearman``, ``sign_agreement``; one line per checked feature in the
``verification`` table); (d) the replacement and completeness scores of the pruned and unpruned
graph.

Tables (every one with a ``row_id`` column): ``rows`` (one line per row's graph: the row's fields,
sizes, errors, scores, seconds), ``nodes`` / ``edges`` (the pruned graph: :func:`tracekit.graphs.tables.graph_tables`),
``verification``, ``main_path`` (the top features by influence and their top tokens), ``head_ov``
(the top edges into the target logit split by attention head) and ``head_qk`` (the QK attribution
of the named ``heads``; empty without). Files beside them: ``graph_<row_id>.json`` (circuit-tracer /
Neuronpedia graph JSON) and ``graph_<row_id>.html`` (the offline graph page, with feature cards).
"""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Optional, Union, cast

import pandas as pd
import torch
from pydantic import Field, field_validator, model_validator

from ..core.errors import ConfigError, DatasetError, MethodRefused
from ..dictionaries.spec import TranscoderSpec
from ..model.info import HookedModel, ModelInfo
from ..model.load import model_fingerprint
from ..trace import parse_head
from .attribution_graph_tables import (
    VERIFICATION_KEYS,
    AttributionGraphResult,
    jsonable_of,
    num,
    parquet_safe,
    split_verification,
    tokens_from_cards,
    unshadowed,
)
from .base import (
    DatasetSpec,
    Experiment,
    OptionalPrompts,
    Rows,
    StrictModel,
    check_dataset_fields,
    check_row_targets,
    dataset_meta,
    kind_dataset,
    prompt_rows,
    register,
    row_frame,
)

__all__ = ["AttributionGraphExperiment", "AttributionGraphResult", "AttributionGraphInputs", "GraphVerifySpec",
           "CardsSpec"]

class GraphVerifySpec(StrictModel):
    """How each graph is checked by intervention in the real model.

    Fields:
        enabled: run the intervention check (default on; the logit-reproduction and completeness
            errors and the scores are always reported: they cost no forward pass).
        top_k: features with the largest influence on the logits checked (default 10).
        n_random: a seeded random sample of the other active features checked (default 10): the
            ones that can show what the pruned graph misses.
        seed: the sample's seed.
        mode: ``ablate`` (the feature set to zero) or ``scale`` (the feature's activation set to
            ``scale`` x itself; :func:`tracekit.graphs.verify.verify_graph`); error nodes held fixed
            either way.
        scale: the factor of ``scale`` mode (default 0.0; ignored by ``ablate``).
    """

    enabled: bool = True
    top_k: int = Field(default=10, ge=1)
    n_random: int = Field(default=10, ge=0)
    seed: int = 0
    mode: Literal["ablate", "scale"] = "ablate"
    scale: float = 0.0


class CardsSpec(StrictModel):
    """Feature cards shown in the graph page (top activating contexts, logit readout).

    Fields:
        enabled: draw the cards (default on).
        features: cards for at most this many features of the pruned graph, by influence (default 30).
        contexts: top activating contexts per feature (default 5; read from ``store``, else from a
            short stdlib corpus pass).
        top_tokens: tokens of the logit readout per feature (default 8).
        store: an activation store (``tracekit activations``) to read the contexts from (default
            none).
        corpus_tokens: without a store, the stdlib corpus tokens read for the contexts (default 4096).
    """

    enabled: bool = True
    features: int = Field(default=30, ge=1)
    contexts: int = Field(default=5, ge=0)
    top_tokens: int = Field(default=8, ge=1)
    store: Optional[str] = None
    corpus_tokens: int = Field(default=4096, ge=64)


@dataclass(frozen=True)
class AttributionGraphInputs:
    """What :meth:`AttributionGraphExperiment.prepare` builds once: the rows (token ids, target and
    foil ids) and the named heads as ``(layer, head)``."""

    data: Rows
    heads: tuple[tuple[int, int], ...]


# =============================================================================================
# the kind


@register
class AttributionGraphExperiment(Experiment):
    """Attribution graphs (Ameisen et al. 2025; circuit-tracer) of prompts or dataset rows over a set
    of transcoders, pruned, verified by intervention and written as tables, JSON and an HTML page.

    Fields:
        transcoders: the transcoder set (:class:`tracekit.dictionaries.spec.TranscoderSpec`: ``path``
            or ``train``); one per block of the model.
        prompts: one string or a list (or give ``dataset``): one graph per prompt.
        target: with ``prompts``: the token followed (one token, leading space included), a string
            for every prompt or a list with one per prompt.
        foil: optional, the same way: the verification then follows ``logit[target] - logit[foil]``.
        dataset: the rows (:class:`tracekit.dataset.DatasetSpec`), each with its own target and foil.
        max_rows: at most this many graphs (rows); more rows are refused (set ``dataset.limit``).
        desired_logit_prob: the logit nodes cover this share of the probability at the last position
            (default 0.95, as circuit-tracer).
        max_n_logits: at most this many logit nodes (default 10).
        max_feature_nodes: at most this many feature nodes (the most influential; default: all
            active features).
        node_threshold: pruning keeps the nodes that carry this share of the influence on the
            logits (default 0.8).
        edge_threshold: and the edges that carry this share (default 0.98).
        zero_bos: drop the BOS position's features and errors from the graph (default on: its
            residual stream is a constant attention sink).
        batch_size: rows of the adjacency per backward pass (default: chosen under the memory budget).
        verify: :class:`GraphVerifySpec` (``enabled``, ``top_k``, ``n_random``, ``seed``, ``mode``).
        heads: attention heads (``"L5H3"``) whose pattern is attributed to query- and key-side
            features (QK attribution; table ``head_qk``).
        head_split_edges: the top edges into the target logit split by attention head (OV circuit;
            table ``head_ov``; 0: none). Not defined where a post-attention norm rescales the heads'
            sum (Gemma 2/3): left at its default, the split is skipped there and each row's
            ``head_split_skipped`` says why; set explicitly, the kind refuses (``MethodRefused``).
        main_path: features listed in the ``main_path`` table and summary (default 15).
        cards: :class:`CardsSpec` (``enabled``, ``features``, ``contexts``, ``top_tokens``, ``store``).

    Summary keys and tables: :class:`AttributionGraphResult`.
    """

    kind: Literal["attribution_graph"] = "attribution_graph"
    transcoders: TranscoderSpec
    prompts: OptionalPrompts = Field(default_factory=list)
    target: Union[str, list[str], None] = None
    foil: Union[str, list[str], None] = None
    dataset: Optional[DatasetSpec] = None
    max_rows: int = Field(default=4, ge=1)
    desired_logit_prob: float = Field(default=0.95, gt=0, le=1)
    max_n_logits: int = Field(default=10, ge=1)
    max_feature_nodes: Optional[int] = Field(default=None, ge=1)
    node_threshold: float = Field(default=0.8, gt=0, le=1)
    edge_threshold: float = Field(default=0.98, gt=0, le=1)
    zero_bos: bool = True
    batch_size: Optional[int] = Field(default=None, ge=1)
    verify: GraphVerifySpec = Field(default_factory=GraphVerifySpec)
    heads: list[str] = Field(default_factory=list)
    head_split_edges: int = Field(default=10, ge=0)
    main_path: int = Field(default=15, ge=1)
    cards: CardsSpec = Field(default_factory=CardsSpec)

    result_class = AttributionGraphResult

    @model_validator(mode="after")
    def _rows(self):
        check_dataset_fields(self.prompts, self.dataset, self.target, self.foil)
        if self.dataset is None and self.target is None:
            raise ValueError("target: give the token the graph explains (one token, e.g. ' Paris'), a string for "
                             "every prompt or a list with one per prompt")
        if self.dataset is None and len(self.prompts) > self.max_rows:
            raise ValueError(f"prompts: {len(self.prompts)} prompts, but max_rows is {self.max_rows} (one graph per "
                             "prompt); raise max_rows or give fewer prompts")
        return self

    @field_validator("heads")
    @classmethod
    def _head_names(cls, v: list[str]):
        for i, h in enumerate(v):
            if not isinstance(h, str) or not h.strip().upper().startswith("L") or "H" not in h.upper():
                raise ValueError(f"heads[{i}]: {h!r} is not a head; write it as 'L<layer>H<head>', e.g. 'L5H3'")
        return v

    # ---- checks before any forward pass ----------------------------------------------------
    def prepare(self, model: HookedModel) -> AttributionGraphInputs:
        """The rows (prompts tokenized, target/foil ids; every row needs a one-token target) and the
        named heads, tokenizer and config only (works on a :class:`tracekit.model.ModelInfo`).

        Raises:
            TokenizationError: a target or foil that is not one token (naming the field).
            DatasetError: rows without a target, or more rows than ``max_rows``.
            AttentionError: a head name that is malformed or out of range (naming ``heads[i]``).
        """
        if self.dataset is None:
            data = prompt_rows(model, self.prompts, self.target, self.foil)
        else:
            data = kind_dataset(model, None, self.dataset)
        check_row_targets(data, "dataset" if self.dataset is not None else "prompts", "an attribution graph")
        if len(data) > self.max_rows:
            raise DatasetError(f"dataset: {len(data)} rows, but max_rows is {self.max_rows} (one graph per row); set "
                               f"dataset.limit: {self.max_rows} or raise max_rows")
        heads = tuple(cast(tuple[int, int], parse_head(h, model, f"heads[{i}]")) for i, h in enumerate(self.heads))
        return AttributionGraphInputs(data, heads)

    def check(self, model: HookedModel) -> AttributionGraphInputs:
        """:meth:`prepare`, plus the model's architecture and the transcoder set against the model
        (its model, one transcoder per block, the hooks it reads and writes), before any weight is read.

        Raises:
            MethodRefused: an architecture the local replacement model does not support (by name).
            SAEError / ConfigError: transcoders for another model, or missing a block (naming
                ``transcoders``).
        """
        inputs = self.prepare(model)
        check_graph_model(model)
        check_transcoders(self.transcoders, model)
        return inputs

    # ---- the run ---------------------------------------------------------------------------
    def _run(self, model: HookedModel, inputs: AttributionGraphInputs, progress: bool = True) -> AttributionGraphResult:
        from ..dictionaries.train import load_transcoders

        loaded = load_transcoders(self.transcoders, model, field="transcoders", progress=progress)
        dset = loaded.dictionaries
        missing = sorted(set(range(int(model.cfg.n_layers))) - set(dset.layers))
        if missing:
            raise MethodRefused(f"transcoders: the set at {loaded.path} has no transcoder for layers {missing}; an "
                                "attribution graph replaces every MLP (give a set covering every block)")
        tables: dict[str, list[pd.DataFrame]] = {k: [] for k in ("nodes", "edges", "verification", "main_path",
                                                                 "head_ov", "head_qk")}
        graph_rows, pages, files = [], {}, []
        for e in inputs.data.examples:
            rec, parts, row_pages = self._one_graph(model, dset, e, inputs.heads, progress)
            graph_rows.append(rec)
            for k, df in parts.items():
                if df is not None and len(df):
                    df = df.copy()
                    if "row_id" in df.columns:
                        df = df.drop(columns=["row_id"])
                    df.insert(0, "row_id", e.row_id)
                    tables[k].append(df)
            pages.update(row_pages)
            files += list(row_pages)
        out = {"rows": row_frame(inputs.data, graph_rows)}
        for k, dfs in tables.items():
            out[k] = pd.concat(dfs, ignore_index=True) if dfs else pd.DataFrame({"row_id": pd.Series([], dtype="int64")})
        for k in ("nodes", "edges", "verification", "main_path", "head_ov", "head_qk"):
            out[k] = unshadowed(parquet_safe(out[k]))
        meta = {"transcoders": {"path": loaded.path, "cache_hit": bool(loaded.cache_hit), **jsonable_of(loaded.info),
                                "metadata": jsonable_of(dset.metadata)},
                "transcoder_stats": jsonable_of(loaded.stats),
                "settings": self._settings(), "files": files, "dataset": dataset_meta(inputs.data),
                "heads": [f"L{L}H{H}" for L, H in inputs.heads]}
        return AttributionGraphResult(self, out, meta, pages=pages)

    def _settings(self) -> dict:
        return {"desired_logit_prob": self.desired_logit_prob, "max_n_logits": self.max_n_logits,
                "max_feature_nodes": self.max_feature_nodes, "node_threshold": self.node_threshold,
                "edge_threshold": self.edge_threshold, "zero_bos": self.zero_bos, "batch_size": self.batch_size,
                "verify": self.verify.model_dump(mode="json")}

    def _one_graph(self, model: HookedModel, dset, e, heads, progress: bool):
        """One row's graph: built, pruned, scored, verified, split by head, tabled, rendered."""
        from ..graphs.attribution import build_graph
        from ..graphs.cards import feature_cards
        from ..graphs.export import graph_json
        from ..graphs.prune import graph_scores, prune_graph
        from ..graphs.tables import graph_tables
        from ..graphs.view import write_graph_html

        t0 = time.perf_counter()
        g = build_graph(model, dset, torch.tensor(e.ids, dtype=torch.long), prompt=e.prompt, target=e.target_id,
                        foil=e.foil_id, desired_logit_prob=self.desired_logit_prob, max_n_logits=self.max_n_logits,
                        max_feature_nodes=self.max_feature_nodes, zero_bos=self.zero_bos, batch_size=self.batch_size,
                        progress=progress)
        t_build = time.perf_counter() - t0
        pr = prune_graph(g, node_threshold=self.node_threshold, edge_threshold=self.edge_threshold)
        scores = graph_scores(g, pr)
        ver_stats: dict[str, Any] = {}
        ver_table: Optional[pd.DataFrame] = None
        if self.verify.enabled:
            v = verify_graph_call(model, dset, g, self.verify, self.node_threshold, self.edge_threshold)
            ver_stats, ver_table = split_verification(v)
        influence = _node_influence(g, pr)
        mp = self._main_path(model, dset, g, influence)
        nodes_df, edges_df = graph_tables(g, pr)
        head_ov = head_qk = None
        head_split_skipped = None
        if self.head_split_edges or heads:
            from ..graphs.heads import qk_attribution
            from ..graphs.replacement import LocalReplacementModel

            lrm = LocalReplacementModel(model, dset, g.token_ids)  # one frozen replacement model for both
            if self.head_split_edges:
                try:
                    head_ov = self._split_by_head(model, dset, g, pr, lrm)
                except MethodRefused as err:
                    # The default split is an extra: on a model where it is not defined (a post-attention
                    # norm) the graph still stands; the row says why its head_ov is empty. Asked for by
                    # name (head_split_edges set in the config), it refuses.
                    if "head_split_edges" in self.model_fields_set:
                        raise
                    head_split_skipped = str(err)
            if heads:
                head_qk = qk_attribution(model, dset, g, [f"L{L}H{H}" for L, H in heads], replacement=lrm)
            del lrm
        cards = None
        if self.cards.enabled:
            feats = [int(i) for i in mp["node"].head(self.cards.features)] if len(mp) else []
            feats += [int(i) for i in _kept_features(g, pr, influence) if int(i) not in feats][:max(0, self.cards.features - len(feats))]
            cards = feature_cards(model, dset, g, feats, store=self.cards.store, contexts=self.cards.contexts,
                                  top_tokens=self.cards.top_tokens, max_tokens=self.cards.corpus_tokens)
            mp = tokens_from_cards(mp, cards)
        slug = f"{self.step_name}-row{e.row_id}"
        gj = graph_json(g, pr, slug=slug, cards=cards, node_threshold=self.node_threshold)
        pruned = scores.get("pruned") or {}
        folded = scores.get("pruned_folded") or {}
        verification = {**{k: g.verification.get(k) for k in ("logits_max_abs_error", "completeness_max_abs_error")},
                        **ver_stats, "replacement_score": pruned.get("replacement"),
                        "completeness_score": pruned.get("completeness"),
                        "replacement_score_unpruned": scores.get("replacement"),
                        "completeness_score_unpruned": scores.get("completeness"),
                        "replacement_score_folded": folded.get("replacement"),
                        "completeness_score_folded": folded.get("completeness")}
        with tempfile.TemporaryDirectory() as td:
            shown = {**verification, **({"checked features": ver_table} if ver_table is not None else {})}
            p = write_graph_html(g, pr, Path(td) / "graph.html", cards=cards, verification=shown,
                                 title=f"Attribution graph: {e.prompt!r} -> {e.row.target!r}")
            html = Path(p).read_text(encoding="utf-8")
        seconds = time.perf_counter() - t0
        node_mask = torch.as_tensor(pr.node_mask)
        edge_mask = torch.as_tensor(pr.edge_mask)
        rec = {"row_id": e.row_id, "prompt": e.prompt, "target": e.row.target, "foil": e.row.foil,
               "n_pos": g.n_pos, "n_features": g.n_features, "n_logits": g.n_logits, "n_nodes": g.n_nodes,
               "n_edges": int(torch.count_nonzero(g.adjacency)), "pruned_nodes": int(node_mask.sum()),
               "pruned_edges": int(pruned.get("n_edges", int(edge_mask.sum()))), "build_seconds": t_build,
               "seconds": seconds, "n_checked": ver_stats.get("n_checked"),
               **{k: num(verification.get(k)) for k in VERIFICATION_KEYS},
               **{k: num(verification.get(k)) for k in ("replacement_score_folded", "completeness_score_folded",
                                                          "top_k_recall", "baseline_max_abs_logit_error")},
               "verify_metric": ver_stats.get("metric"), "largest_misses": ver_stats.get("largest_misses")}
        rec["head_split_skipped"] = head_split_skipped
        rec["backward_passes"] = num(g.settings.get("backward_passes"))
        rec["n_active_features"] = num(g.settings.get("n_active_features"))
        parts = {"nodes": nodes_df, "edges": edges_df, "verification": ver_table, "main_path": mp,
                 "head_ov": head_ov, "head_qk": head_qk}
        pages = {f"graph_{e.row_id}.json": json.dumps(jsonable_of(gj), allow_nan=False), f"graph_{e.row_id}.html": html}
        return rec, parts, pages

    def _main_path(self, model: HookedModel, dset, g, influence: torch.Tensor) -> pd.DataFrame:
        """The top ``main_path`` feature nodes by influence: node, layer, position, token, feature,
        influence, activation, and the tokens their decoder direction promotes (direct logit
        readout ``W_dec[f] @ W_U``, replaced by the card's readout when cards are drawn)."""
        nf = g.n_features
        if nf == 0:
            return pd.DataFrame(columns=["node", "layer", "position", "token", "feature", "influence", "activation",
                                         "top_tokens"])
        inf = influence[:nf].float()
        order = torch.argsort(inf, descending=True)[:self.main_path]
        recs = []
        W_U = _unembed(model)
        for n in order.tolist():
            layer, pos, feat = (int(x) for x in g.features[n].tolist())
            toks: list[str] = []
            if W_U is not None:
                d = dset[layer]
                vec = d.W_dec[feat].detach().to(W_U.device, W_U.dtype) @ W_U
                top = torch.topk(vec, k=min(self.cards.top_tokens, vec.shape[-1])).indices.tolist()
                toks = [model.tokenizer.decode([t]) for t in top]
            recs.append({"node": n, "layer": layer, "position": pos, "token": g.tokens[pos], "feature": feat,
                         "influence": float(inf[n]), "activation": float(g.activations[n]),
                         "top_tokens": json.dumps(toks)})
        return pd.DataFrame(recs)

    def _split_by_head(self, model: HookedModel, dset, g, pr, lrm) -> Optional[pd.DataFrame]:
        """The ``head_split_edges`` strongest edges into the target logit node (from the pruned
        graph's nodes) split by attention head (:func:`tracekit.graphs.heads.split_edges_by_head`)."""
        from ..graphs.heads import split_edges_by_head

        tgt = _target_logit_node(g)
        if tgt is None:
            return None
        row = g.adjacency[tgt].float().abs() * torch.as_tensor(pr.node_mask, dtype=torch.float32)
        row[g.logit_offset:] = 0
        k = min(self.head_split_edges, int(torch.count_nonzero(row)))
        if k == 0:
            return None
        srcs = torch.topk(row, k).indices.tolist()
        return split_edges_by_head(model, dset, g, [(tgt, int(s)) for s in srcs], replacement=lrm)


# =============================================================================================
# checks and helpers (module level: the benchmark and tests call them)


#: Architectures whose blocks the local replacement model cannot linearise, by the config field that
#: marks them (TransformerLens ``HookedTransformerConfig`` names) -> why.
UNSUPPORTED: dict[str, str] = {
    "parallel_attn_mlp": "attention and MLP read the same residual stream in parallel (GPT-J / NeoX style); "
                         "the transcoder's input is then not the MLP's own hook_mlp_in",
    "num_experts": "mixture-of-experts MLPs (one transcoder cannot stand for the routed experts)",
    "attn_only": "an attention-only model has no MLP to replace with a transcoder",
}


def check_graph_model(model: HookedModel) -> None:
    """Refuse, by name, a model whose architecture the attribution graph does not support, from
    its config only (works on a :class:`tracekit.model.ModelInfo`).

    Raises:
        MethodRefused: the architecture and why (:data:`UNSUPPORTED`).
    """
    cfg = model.cfg
    for name, why in UNSUPPORTED.items():
        if getattr(cfg, name, None):
            arch = getattr(cfg, "original_architecture", None) or getattr(cfg, "model_name", "this model")
            raise MethodRefused(f"attribution_graph: {arch} is not supported: {why} (cfg.{name} is set)")


def check_transcoders(spec: TranscoderSpec, model: HookedModel) -> None:
    """The transcoder set of ``spec`` against the model before any weight is read (works on a
    :class:`tracekit.model.ModelInfo`): one transcoder per block, hooks the model has, and (a saved
    set) widths that are the model's, read from the set's ``config.yaml`` and the safetensors
    headers only. The set's fingerprint is checked when it loads
    (:func:`tracekit.dictionaries.train.load_transcoders`), still before any graph is built.

    Raises:
        SAEError: a hook the model lacks or widths of another model (naming ``transcoders``).
        ConfigError: a block without a transcoder, an unreadable set folder.
    """
    from ..dictionaries.spec import transcoder_hooks

    n = int(model.cfg.n_layers)
    if spec.train is not None:
        layers = list(range(n)) if spec.train.layers is None else [int(x) for x in spec.train.layers]
        _cover(layers, n)
        for L in layers:
            transcoder_hooks(model, L, spec.train, field="transcoders.train")
        return
    _check_saved_set(Path(str(spec.path)).expanduser(), model, n)


def _cover(layers: list[int], n: int) -> None:
    missing = sorted(set(range(n)) - set(layers))
    if missing:
        raise ConfigError(f"transcoders: no transcoder for layers {missing} of the model's {n}; an attribution graph "
                          "replaces every MLP (train or give a set covering every block)")


def _check_saved_set(path: Path, model: HookedModel, n: int) -> None:
    """A saved set's config and tensor shapes (headers only) against the model."""
    import yaml
    from safetensors import safe_open

    from ..core.errors import SAEError
    from ..hooks import check_hooks

    cfile = path / "config.yaml" if path.is_dir() else path
    if not cfile.is_file():
        raise ConfigError(f"transcoders.path: {path} holds no config.yaml (a transcoder set in circuit-tracer's "
                          "layout: per-layer safetensors and a config listing them)")
    try:
        cfg = yaml.safe_load(cfile.read_text(encoding="utf-8"))
        entries = [(int(e["layer"]), cfile.parent / str(e.get("filepath", f"layer_{int(e['layer'])}.safetensors")))
                   for e in cfg["transcoders"]]
    except (OSError, yaml.YAMLError, KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"transcoders.path: {cfile} is not a transcoder set config ({type(e).__name__}: {e})") from e
    widths = {int(model.cfg.d_model)} | ({int(model.cfg.d_mlp)} if getattr(model.cfg, "d_mlp", None) else set())
    for L, f in entries:
        if not 0 <= L < n:
            raise SAEError(f"transcoders.path: {cfile} has a transcoder for layer {L}, but the model has {n} blocks "
                           f"(0..{n - 1}); the set was made for another model ({cfg.get('model_name') or 'unnamed'})")
        for key in ("feature_input_hook", "feature_output_hook"):
            site = str(cfg.get(key, ""))
            hook = site if site.startswith("blocks.") else f"blocks.{L}.{site}"
            try:
                check_hooks(model, [hook], f"transcoders ({key})")
            except Exception as e:  # noqa: BLE001 - HookError or a ModelInfo's refusal
                raise SAEError(f"transcoders.path: layer {L} reads/writes {hook!r}, which this model lacks ({e}); the "
                               "set was made for another model") from e
        if not f.is_file():
            raise ConfigError(f"transcoders.path: {f} (layer {L}) is missing")
        with safe_open(str(f), framework="pt") as fh:
            shapes = {k: tuple(fh.get_slice(k).get_shape()) for k in fh.keys() if k in ("W_enc", "W_dec")}
        bad = {k: s for k, s in shapes.items() if (s[0] if k == "W_enc" else s[1]) not in widths}
        if bad:
            raise SAEError(f"transcoders.path: layer {L}'s transcoder has shapes {bad}, not this model's widths "
                           f"{sorted(widths)} (d_model, d_mlp); the set was made for another model "
                           f"({cfg.get('model_name') or 'unnamed'})")
    _cover([L for L, _ in entries], n)
    fp = (cfg.get("metadata") or {}).get("tracekit_fingerprint")
    if fp is not None and not isinstance(model, ModelInfo) and fp != model_fingerprint(model):
        raise SAEError(f"transcoders.path: {path} was trained by tracekit on another model "
                       f"({(cfg.get('metadata') or {}).get('model') or cfg.get('model_name') or 'unnamed'}, fingerprint "
                       f"{fp}, not this model's {model_fingerprint(model)}); train them on this model "
                       "(transcoders.train) or load the model they were trained on")


def verify_graph_call(model: HookedModel, dset, g, spec: GraphVerifySpec, node_threshold: float,
                      edge_threshold: float) -> dict:
    """:func:`tracekit.graphs.verify.verify_graph` with the kind's ``verify`` settings. Raises what it raises."""
    from ..graphs.verify import verify_graph

    return verify_graph(model, dset, g, top_k=spec.top_k, n_random=spec.n_random, seed=spec.seed, mode=spec.mode,
                        scale=spec.scale, node_threshold=node_threshold, edge_threshold=edge_threshold)


def _node_influence(g, pr) -> torch.Tensor:
    """``[n_nodes]`` each node's influence on the logits (the pruning's, else computed here as
    circuit-tracer's ``compute_node_influence`` on the row-normalised |adjacency|)."""
    inf = getattr(pr, "node_influence", None)
    if inf is not None:
        return torch.as_tensor(inf).float().cpu()
    A = g.adjacency.float().abs()
    A = A / A.sum(dim=1, keepdim=True).clamp_min(1e-12)
    w = g.logit_weights()
    total, cur = torch.zeros_like(w), w
    for _ in range(g.n_layers + 2):
        cur = cur @ A
        total += cur
    return total


def _kept_features(g, pr, influence: torch.Tensor) -> list[int]:
    """Feature nodes kept by the pruning, by influence (descending)."""
    mask = torch.as_tensor(pr.node_mask)[:g.n_features].bool()
    idx = torch.nonzero(mask).flatten()
    return idx[torch.argsort(influence[idx], descending=True)].tolist()


def _target_logit_node(g) -> Optional[int]:
    """Node index of the target's logit node (None when the target is not among the logit nodes)."""
    tid = g.target.get("id")
    if tid is None:
        return None
    hits = torch.nonzero(g.logit_ids == int(tid)).flatten()
    return g.logit_offset + int(hits[0]) if hits.numel() else None


def _unembed(model: HookedModel) -> Optional[torch.Tensor]:
    """``[d_model, d_vocab]`` the unembedding (None when the model does not expose it)."""
    W_U = getattr(model, "W_U", None)
    return W_U.detach() if isinstance(W_U, torch.Tensor) else None

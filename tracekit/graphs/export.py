"""An attribution graph as the JSON circuit-tracer writes and Neuronpedia's graph viewer reads.

The layout is circuit-tracer's ``create_graph_files`` (``circuit_tracer/utils/create_graph_files.py``)
and its pydantic models (``circuit_tracer/frontend/graph_models.py``: ``Model``, ``Metadata``,
``QParams``, ``Node``, ``Link``), field for field and in the same order:

* ``metadata``: ``slug``, ``scan``, ``transcoder_list``, ``prompt_tokens`` (newline, tab and
  carriage return shown as ``⏎``, ``→``, ``↵``, as circuit-tracer's ``process_token``), ``prompt``,
  ``node_threshold``;
* ``qParams``: ``pinnedIds``, ``supernodes``, ``linkType`` (``both``), ``clickedId``, ``sg_pos``;
* ``nodes``: the kept nodes that have a kept edge, plus every token embedding and logit:
  ``node_id``, ``feature``, ``layer`` (a string: the block, ``"E"`` for embeddings,
  ``str(n_layers + 1)`` for logits), ``ctx_idx``, ``feature_type`` (``cross layer transcoder`` |
  ``mlp reconstruction error`` | ``embedding`` | ``logit``), ``token_prob``, ``is_target_logit``,
  ``run_idx``, ``reverse_ctx_idx``, ``jsNodeId``, ``clerp``, ``influence`` (the cumulative influence
  share, as circuit-tracer writes it; None for logits), ``activation`` (features only);
* ``links``: ``source``, ``target`` (node ids), ``weight`` (the direct effect, the target's units).

A feature's ``feature`` field is its index in its layer's transcoder (circuit-tracer's
``num_features=None`` form for a custom transcoder set); ``clerp`` is the card's short label when
feature cards are given (:func:`tracekit.graphs.cards.feature_cards`), else empty.

Loading it: circuit-tracer's local server (``circuit_tracer.frontend.local_server.serve(data_dir)``)
reads every graph listed in ``graph-metadata.json`` of ``data_dir`` (:func:`write_graph_json` keeps
that list up to date); Neuronpedia's graph page takes the same file as an upload.

Source: circuit-tracer (Hanna, Piotrowski, Lindsey, Ameisen 2025), ``create_graph_files.py``,
``frontend/graph_models.py``, ``frontend/utils.py``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Optional

from ..core.errors import AttributionError, OutputError
from .graph import AttributionGraph
from .tables import PruneLike, graph_masks, node_ids, target_logit_index

__all__ = ["process_token", "graph_json", "write_graph_json", "FEATURE_TYPES"]

#: The JSON's ``feature_type`` of each node type (circuit-tracer's strings).
FEATURE_TYPES = {"feature": "cross layer transcoder", "error": "mlp reconstruction error", "token": "embedding",
                 "logit": "logit"}


def process_token(token: str) -> str:
    """A token as the viewer shows it: newline, tab and carriage return as ``⏎``, ``→``, ``↵``
    (circuit-tracer ``frontend/utils.py``). Raises nothing."""
    return token.replace("\n", "⏎").replace("\t", "→").replace("\r", "↵")


def _num(x: Any) -> Optional[float]:
    x = float(x)
    return x if math.isfinite(x) else None


def _node(node_id: str, feature: int, layer: str, ctx_idx: int, feature_type: str, js: str, *, token_prob: float = 0.0,
          is_target_logit: bool = False, clerp: str = "", influence: Optional[float] = None,
          activation: Optional[float] = None) -> dict[str, Any]:
    """One node, keys in circuit-tracer's ``Node`` order."""
    return {"node_id": node_id, "feature": int(feature), "layer": layer, "ctx_idx": int(ctx_idx),
            "feature_type": feature_type, "token_prob": float(token_prob), "is_target_logit": bool(is_target_logit),
            "run_idx": 0, "reverse_ctx_idx": 0, "jsNodeId": js, "clerp": clerp, "influence": influence,
            "activation": activation}


def _scan(graph: AttributionGraph, scan: Optional[str]) -> str:
    if scan:
        return str(scan)
    d = graph.dictionaries or {}
    for k in ("scan", "name", "key", "path"):
        if d.get(k):
            return str(d[k])
    return f"tracekit-{graph.model.get('name', 'model')}-transcoders"


def graph_json(graph: AttributionGraph, prune: Optional[PruneLike], *, slug: str,
               cards: Optional[dict[int, dict]] = None, scan: Optional[str] = None,
               node_threshold: Optional[float] = None) -> dict[str, Any]:
    """The graph (pruned by ``prune``) as circuit-tracer's / Neuronpedia's graph JSON (module docstring).

    Args:
        graph: the attribution graph.
        prune: its pruning (``PruneResult``); None keeps every node and non-zero edge (influence None).
        slug: the graph's name in the viewer (``metadata.slug``; also the file name).
        cards: node index -> feature card (:func:`tracekit.graphs.cards.feature_cards`); a card's
            ``clerp`` becomes the node's label.
        scan: the transcoder set's name (``metadata.scan``); default: ``graph.dictionaries``'
            ``scan`` / ``name`` / ``key`` / ``path``, else ``tracekit-<model>-transcoders``.
        node_threshold: recorded in ``metadata.node_threshold``; default the pruning's
            ``node_threshold`` attribute or ``graph.settings["node_threshold"]`` (else None).

    Returns:
        A JSON-able dict (``json.dumps`` with ``allow_nan=False`` succeeds).

    Raises:
        AttributionError: an empty slug; ``prune`` of another graph (shapes).
    """
    if not str(slug).strip():
        raise AttributionError("slug: give the graph a non-empty name (it is the viewer's id and the file name)")
    nm, em, _, cum = graph_masks(graph, prune)
    ids = node_ids(graph)
    L, nf, npos = graph.n_layers, graph.n_features, graph.n_pos
    cards = cards or {}
    tgt = target_logit_index(graph)
    tok = graph.token_ids.tolist()
    nodes: dict[int, dict[str, Any]] = {}
    for i in nm.nonzero().flatten().tolist():
        infl = _num(cum[i])
        if i < nf:
            layer, pos, f = (int(v) for v in graph.features[i].tolist())
            nodes[i] = _node(ids[i], f, str(layer), pos, FEATURE_TYPES["feature"], f"{layer}_{f}-0",
                             clerp=str(cards.get(i, {}).get("clerp", "")), influence=infl,
                             activation=_num(graph.activations[i]))
        elif i < graph.token_offset:
            layer, pos = divmod(i - nf, npos)
            nodes[i] = _node(ids[i], -1, str(layer), pos, FEATURE_TYPES["error"], f"{layer}_{pos}-0", influence=infl)
        elif i < graph.logit_offset:
            pos = i - graph.token_offset
            nodes[i] = _node(ids[i], pos, "E", pos, FEATURE_TYPES["token"], f"E_{int(tok[pos])}-{pos}", influence=infl)
        else:
            j = i - graph.logit_offset
            vid, prob = int(graph.logit_ids[j]), float(graph.logit_probs[j])
            nodes[i] = _node(ids[i], vid, str(L + 1), npos - 1, FEATURE_TYPES["logit"], f"L_{vid}-{npos - 1}",
                             token_prob=prob, is_target_logit=j == tgt,
                             clerp=f'Output "{process_token(graph.logit_tokens[j])}" (p={prob:.3f})')
    adj = graph.adjacency.detach().cpu()
    dst, src = em.nonzero(as_tuple=True)
    links = [{"source": ids[s], "target": ids[t], "weight": float(w)}
             for s, t, w in zip(src.tolist(), dst.tolist(), adj[dst, src].tolist()) if s in nodes and t in nodes]
    connected = {e["source"] for e in links} | {e["target"] for e in links}
    used = [n for n in nodes.values() if n["node_id"] in connected or n["feature_type"] in ("embedding", "logit")]
    if node_threshold is None:
        node_threshold = getattr(prune, "node_threshold", None) or graph.settings.get("node_threshold")
    meta = {"slug": str(slug), "scan": _scan(graph, scan), "transcoder_list": [],
            "prompt_tokens": [process_token(t) for t in graph.tokens], "prompt": graph.prompt,
            "node_threshold": None if node_threshold is None else float(node_threshold)}
    qparams = {"pinnedIds": [], "supernodes": [], "linkType": "both", "clickedId": "", "sg_pos": ""}
    return {"metadata": meta, "qParams": qparams, "nodes": used, "links": links}


def write_graph_json(graph: AttributionGraph, prune: Optional[PruneLike], path: str | Path, *, slug: str,
                     cards: Optional[dict[int, dict]] = None, scan: Optional[str] = None,
                     node_threshold: Optional[float] = None) -> Path:
    """Write :func:`graph_json` to ``path`` and list it in ``graph-metadata.json`` beside it (the
    index circuit-tracer's local server reads; an entry of the same slug is replaced).

    Args:
        graph: the attribution graph.
        prune: its pruning (``PruneResult``), or None.
        path: a ``.json`` file, or a folder (the file is then ``<folder>/<slug>.json``).
        slug: the graph's name in the viewer.
        cards: node index -> feature card (labels).
        scan: the transcoder set's name (:func:`graph_json`).
        node_threshold: recorded in the metadata (:func:`graph_json`).

    Returns:
        The JSON file's path.

    Raises:
        AttributionError: as :func:`graph_json`.
        OutputError: the file or the index cannot be written (naming the path).
    """
    data = graph_json(graph, prune, slug=slug, cards=cards, scan=scan, node_threshold=node_threshold)
    p = Path(path).expanduser()
    out = p if p.suffix == ".json" else p / f"{slug}.json"
    index = out.parent / "graph-metadata.json"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(data, indent=2, allow_nan=False, ensure_ascii=False), encoding="utf-8")
        listed = {"graphs": []}
        if index.is_file():
            try:
                listed = json.loads(index.read_text(encoding="utf-8"))
            except json.JSONDecodeError:
                listed = {"graphs": []}
        graphs = [g for g in listed.get("graphs", []) if g.get("slug") != data["metadata"]["slug"]]
        graphs.append(data["metadata"])
        index.write_text(json.dumps({"graphs": graphs}, indent=2, ensure_ascii=False), encoding="utf-8")
    except OSError as e:
        raise OutputError(f"graph JSON: cannot write {out} or {index} ({e}); choose a writable folder") from e
    return out

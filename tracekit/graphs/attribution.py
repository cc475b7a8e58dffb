"""Building an attribution graph: the adjacency of direct effects in the local replacement model.

Algorithm (Ameisen et al. 2025, "Circuit Tracing", methods; circuit-tracer
``circuit_tracer/attribution.py``), on the :class:`~tracekit.graphs.replacement.LocalReplacementModel`:

1. a clean run records the active transcoder features, the error vectors and the token embeddings;
2. **logit nodes**: the most probable next tokens whose probabilities add up to ``desired_logit_prob``
   (at most ``max_n_logits``), plus the ``target`` and ``foil`` ids when given; each reads the
   demeaned pre-transform logit (the unembedding column minus the mean column);
3. **rows by batched backward passes**: one forward pass of ``batch_size`` copies of the prompt
   through the replacement model (no gradient through attention patterns, norm scales or MLPs;
   zero leaves added at every write), then per batch of target nodes one ``torch.autograd.grad`` of
   the sum of their inputs (row ``b``'s target is read from copy ``b``, so rows do not mix). The
   gradient at each write, contracted with the source's vector (``a_s W_dec[s]``, the error vector,
   the token embedding), is the direct effect ``A[target, source]``; no ``.grad`` is ever written;
4. with ``max_feature_nodes``, feature rows are computed in order of partial influence on the logit
   nodes (circuit-tracer's ``compute_partial_influences``, re-ranked after every few batches) and
   only the visited features become nodes.

Exactness, checked on every graph (``graph.verification``):

* ``logits_max_abs_error``: the replacement model (error nodes included) run forward against the
  model's logits, every position;
* ``completeness_max_abs_error``: each row's input (feature pre-activation, demeaned logit) minus
  the sum of its incoming edges minus its **bias term**, the target's input in the replacement
  model with every source *node* zeroed (features that are not nodes (the BOS position under
  ``zero_bos``, features beyond ``max_feature_nodes``) keep their activations; ``b_enc``, ``b_dec``,
  norm and attention biases, positional embeddings are constants), computed by one extra forward
  pass. ``graph.node_bias`` holds it and ``graph.node_input`` the input.

``zero_bos`` (circuit-tracer's default): when the first token is a special token (the BOS the
model prepends), its features are not nodes and its error and token nodes have no edges; their
contributions go to the bias term, so the replacement model still reproduces the model exactly
(circuit-tracer instead zeroes them in the model).

Memory (``run.memory_budget``): one backward row holds the forward pass's saved tensors of one copy
of the prompt (:func:`backward_row_bytes`: per block about ``14 T d + 3 H T^2 + 6 T d_mlp``
elements, plus the leaves and their gradients, ``2 (L + 1) T d`` float32) and its edges (one
float32 per candidate source node), so the batch size is
:func:`tracekit.core.budget.chunk_rows` of it; the dense adjacency grows with the active features
(``n_nodes^2`` float32 on the CPU), never with features x positions x layers squared.
"""

from __future__ import annotations

import time
from typing import Any, Optional

import torch
from jaxtyping import Int

from ..core.budget import bytes_of, chunk_rows, current_budget, format_bytes
from ..core.errors import MemoryBudgetError
from ..core.progress import progress_bar
from ..dictionaries.dictionary import DictionarySet
from ..hooks import state_guard
from ..model.info import HookedModel
from .graph import AttributionGraph
from .replacement import LocalReplacementModel

__all__ = ["build_graph", "backward_row_bytes", "salient_logits", "partial_influences"]


def backward_row_bytes(model: HookedModel, n_pos: int) -> int:
    """Bytes one row (one copy of the prompt) of a batched backward pass holds: the forward pass's
    saved tensors per block (about ``14 T d`` residual-width, ``2 T d_head (3 H + 2 H_kv)`` q/k/v,
    ``3 H T^2`` scores/pattern, ``6 T d_mlp`` MLP, in the model's dtype), the leaves and their
    gradients (``2 (L + 1) T d`` float32) and a block's worth of backward temporaries. Raises nothing."""
    cfg = model.cfg
    L, d, H = int(cfg.n_layers), int(cfg.d_model), int(cfg.n_heads)
    Hkv = int(getattr(cfg, "n_key_value_heads", None) or H)
    dh = int(getattr(cfg, "d_head", None) or d // H)
    dm = int(getattr(cfg, "d_mlp", None) or 4 * d)
    dt = getattr(cfg, "dtype", None)
    dt = dt if isinstance(dt, torch.dtype) else torch.float32
    T = int(n_pos)
    block = 14 * T * d + 2 * T * dh * (3 * H + 2 * Hkv) + 3 * H * T * T + 6 * T * dm
    return bytes_of((L + 2) * block, dtype=dt) + bytes_of(2 * (L + 1), T, d)


@torch.no_grad()
def salient_logits(logits: torch.Tensor, *, desired_logit_prob: float = 0.95, max_n_logits: int = 10,
                   extra: tuple[Optional[int], ...] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """The smallest set of most probable tokens whose probabilities reach ``desired_logit_prob``
    (at most ``max_n_logits``; circuit-tracer's ``compute_salient_logits``), then ``extra`` ids not
    already in it.

    Args:
        logits: ``[d_vocab]`` the last position's logits (after the output transform).

    Returns:
        ``(ids [k], probs [k])`` (float32 probabilities). Raises nothing.
    """
    probs = torch.softmax(logits.float(), -1)
    k = min(int(max_n_logits), probs.shape[0])
    top_p, top_i = torch.topk(probs, k)
    cut = int(torch.searchsorted(torch.cumsum(top_p, 0), torch.tensor(float(desired_logit_prob)))) + 1
    ids = top_i[:cut].tolist()
    for e in extra:
        if e is not None and int(e) not in ids:
            ids.append(int(e))
    t = torch.tensor(ids, dtype=torch.long)
    return t, probs[t.to(probs.device)].cpu()


def partial_influences(edges: torch.Tensor, logit_p: torch.Tensor, row_to_node: torch.Tensor,
                       max_iter: int = 128) -> torch.Tensor:
    """Influence of every column on the logit nodes through the rows computed so far
    (circuit-tracer's ``compute_partial_influences``: row-normalised absolute edges, powers summed).

    Args:
        edges: ``[rows, n_cols]`` computed rows. logit_p: ``[n_logits]`` the logit nodes' probabilities
            (the last ``n_logits`` columns). row_to_node: ``[rows]`` the column index of each row's node.

    Returns:
        ``[n_cols]`` influences. Raises RuntimeError: no convergence in ``max_iter`` steps (a cycle).
    """
    norm = edges.abs()
    norm = norm / norm.sum(1, keepdim=True).clamp(min=1e-8)
    infl = torch.zeros(edges.shape[1])
    prod = torch.zeros(edges.shape[1])
    prod[-len(logit_p):] = logit_p
    for _ in range(max_iter):
        prod = prod[row_to_node] @ norm
        if not prod.any():
            return infl
        infl += prod
    raise RuntimeError("attribution graph: partial influences did not converge")


def _special_ids(model: HookedModel) -> set[int]:
    tok = getattr(model, "tokenizer", None)
    out: set[int] = set()
    if tok is None:
        return out
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        v = getattr(tok, name, None)
        if isinstance(v, int):
            out.add(v)
    try:
        out.update(int(i) for i in tok.all_special_ids)
    except Exception:  # noqa: BLE001 - a tokenizer without the attribute
        pass
    return out


def _decode(model: HookedModel, ids: list[int]) -> list[str]:
    tok = getattr(model, "tokenizer", None)
    if tok is None:
        return [str(i) for i in ids]
    return [tok.decode([int(i)]) for i in ids]


def build_graph(model: HookedModel, dictionaries: DictionarySet, token_ids: Int[torch.Tensor, " n_pos"], *,
                prompt: str = "", target: Optional[int] = None, foil: Optional[int] = None,
                desired_logit_prob: float = 0.95, max_n_logits: int = 10, max_feature_nodes: Optional[int] = None,
                zero_bos: bool = True, batch_size: Optional[int] = None, progress: bool = False) -> AttributionGraph:
    """The attribution graph of one prompt (module docstring).

    Args:
        model: a hooked model (TransformerBridge; TransformerLens 3.9 or 4; any device).
        dictionaries: one transcoder per block (``blocks.L.mlp.hook_in`` -> ``blocks.L.hook_mlp_out``).
        token_ids: ``[n_pos]`` the prompt's token ids, BOS included when the model prepends one.
        prompt: the prompt text (kept on the graph).
        target: vocabulary id the verification follows (always a logit node); foil: its contrast id.
        desired_logit_prob: share of next-token probability the logit nodes cover.
        max_n_logits: most logit nodes (before ``target``/``foil`` are added).
        max_feature_nodes: most feature nodes, chosen by partial influence (None: every active feature).
        zero_bos: leave the first position out of the nodes when it is a special token.
        batch_size: rows per backward pass (None: from the memory budget).
        progress: a bar over the backward rows (off: a line with the rows done and the ETA every
            30 s, :func:`tracekit.core.progress.progress_bar`).

    Returns:
        :class:`~tracekit.graphs.graph.AttributionGraph` with ``adjacency[target, source]`` (float32,
        CPU; feature and logit rows filled), ``verification["logits_max_abs_error"]`` (logits) and
        ``["completeness_max_abs_error"]`` (target units), ``node_bias`` / ``node_input``, and
        ``settings`` (every option, batch size, backward passes, wall time, per-row bytes).

    Raises:
        MethodRefused: the model or dictionaries cannot give an exact local replacement model
            (:class:`~tracekit.graphs.replacement.LocalReplacementModel`).
        MemoryBudgetError: one backward row, or the dense adjacency, does not fit the memory budget
            (raised before the backward passes).
        ValueError: ``token_ids`` is empty or not 1-D.
    """
    t0 = time.perf_counter()
    ids = torch.as_tensor(token_ids, dtype=torch.long).flatten().cpu()
    if ids.numel() == 0:
        raise ValueError("attribution graph: token_ids is empty")
    with state_guard(model):
        return _build(model, dictionaries, ids, prompt=prompt, target=target, foil=foil,
                      desired_logit_prob=float(desired_logit_prob), max_n_logits=int(max_n_logits),
                      max_feature_nodes=max_feature_nodes, zero_bos=bool(zero_bos), batch_size=batch_size,
                      progress=progress, t0=t0)


def _build(model: HookedModel, dictionaries: DictionarySet, ids: torch.Tensor, *, prompt: str, target, foil,
           desired_logit_prob: float, max_n_logits: int, max_feature_nodes, zero_bos: bool, batch_size,
           progress: bool, t0: float) -> AttributionGraph:
    m: Any = model
    rep = LocalReplacementModel(model, dictionaries, ids)
    L, T = rep.n_layers, rep.n_pos
    dev = rep.device
    bos = bool(zero_bos and int(ids[0]) in _special_ids(model))

    # ---- candidate feature nodes (sorted by layer, position, feature) ----
    feats, acts_all, owner = [], [], []
    for layer in range(L):
        af = rep.active[layer]
        keep = af.pos != 0 if bos else torch.ones_like(af.pos, dtype=torch.bool)
        idx = torch.nonzero(keep).flatten()
        feats.append(torch.stack([torch.full_like(af.pos[idx], layer), af.pos[idx], af.feat[idx]], 1).cpu())
        acts_all.append(af.acts[idx].cpu())
        owner.append(idx.cpu())
    cand = torch.cat(feats) if feats else torch.zeros(0, 3, dtype=torch.long)
    cand_acts = torch.cat(acts_all) if acts_all else torch.zeros(0)
    n_cand = int(cand.shape[0])
    n_feat = n_cand if max_feature_nodes is None else min(int(max_feature_nodes), n_cand)
    layer_start = [0]
    for o in owner:
        layer_start.append(layer_start[-1] + len(o))

    # ---- logit nodes ----
    logit_ids, logit_p = salient_logits(rep.logits[0, -1], desired_logit_prob=desired_logit_prob,
                                        max_n_logits=max_n_logits, extra=(target, foil))
    n_log = int(logit_ids.shape[0])
    W_U = m.W_U.detach()
    ubar = (W_U[:, logit_ids.to(W_U.device)] - W_U.mean(-1, keepdim=True)).float()  # [d_model, n_logits]

    # ---- sizes, budget ----
    err_off, tok_off = n_cand, n_cand + L * T
    log_off = tok_off + T
    n_cols = log_off + n_log  # columns over every candidate feature (restricted at the end)
    n_nodes_final = n_feat + L * T + T + n_log
    adj_bytes = bytes_of(n_nodes_final, n_nodes_final) + bytes_of(n_feat + n_log, n_cols)
    cpu_budget = current_budget("cpu")
    if adj_bytes > cpu_budget.bytes:
        raise MemoryBudgetError(
            f"attribution graph: the dense adjacency of {n_nodes_final} nodes ({n_cand} active features) needs "
            f"{format_bytes(adj_bytes)} but the memory budget allows {format_bytes(cpu_budget.bytes)} "
            f"({cpu_budget.source}); set max_feature_nodes lower or raise run.memory_budget.")
    per_row = backward_row_bytes(model, T) + bytes_of(n_cols)  # + the row's edges on the device
    n_rows = n_feat + n_log
    fixed = bytes_of(L, T, int(m.cfg.d_model)) * 6
    bs_budget = chunk_rows(per_row, max(1, n_rows), what="attribution graph backward pass", device=dev, fixed=fixed,
                           unit="backward row (one copy of the prompt)",
                           fix="shorten the prompt or run on a device with more memory")
    bs = max(1, min(int(batch_size) if batch_size else bs_budget, n_rows))

    # ---- source vectors ----
    dec_vecs = []  # per layer: [n_L, d] = a_s W_dec[s] (float32)
    for layer in range(L):
        af, d = rep.active[layer], rep.dicts[layer]
        o = owner[layer].to(af.pos.device)
        dec_vecs.append((af.acts[o][:, None] * d.W_dec.detach()[af.feat[o]].float()))
    err_vecs = rep.errors.clone()  # [L, T, d]
    tok_vecs = rep.embed.float().clone()  # [T, d]
    if bos:
        err_vecs[:, 0] = 0
        tok_vecs[0] = 0

    # ---- the forward pass of the batch, kept for every backward pass ----
    fwd: dict[str, Any] = {"run": rep.run(batch=bs, grad=True, stop_at_final=True)}
    fwd["leaves"] = [fwd["run"].leaves[layer] for layer in range(L)] + [fwd["run"].leaves["tokens"]]
    segments: list[list[tuple[int, int, int]]] = []  # per layer: (position, start, end) runs of features
    for k in range(L):
        pos_k = cand[layer_start[k]:layer_start[k + 1], 1]
        ps, counts = torch.unique_consecutive(pos_k, return_counts=True)
        ends = torch.cumsum(counts, 0).tolist()
        segments.append([(int(p), e - int(c), e) for p, c, e in zip(ps.tolist(), counts.tolist(), ends)])

    def rows_for(targets: list[tuple[str, int]]) -> torch.Tensor:
        """Rows [len(targets), n_cols] for targets ('feature', cand index) / ('logit', i)."""
        run = fwd["run"]
        kinds = [k for k, _ in targets]
        idx = torch.tensor([i for _, i in targets], dtype=torch.long)
        is_f = torch.tensor([k == "feature" for k in kinds], dtype=torch.bool)
        rows_b = torch.arange(len(targets))
        parts = []
        if bool(is_f.any()):
            fb, fi = rows_b[is_f], idx[is_f]
            for layer in torch.unique(cand[fi, 0]).tolist():
                sel = cand[fi, 0] == layer
                b = fb[sel].to(dev)
                pos, f = cand[fi[sel], 1].to(dev), cand[fi[sel], 2].to(dev)
                d = rep.dicts[layer]
                x = run.reads[layer][b, pos].to(d.W_enc.dtype)  # [n, d_in]
                parts.append((x * d.W_enc.detach().T[f]).sum())
        if bool((~is_f).any()):
            lb, li = rows_b[~is_f].to(dev), idx[~is_f].to(dev)
            parts.append((run.final[lb, -1].float() * ubar.T[li].to(run.final.device)).sum())
        total = torch.stack([p.float() for p in parts]).sum()
        grads = torch.autograd.grad(total, fwd["leaves"], retain_graph=True, allow_unused=True)
        out = torch.zeros(len(targets), n_cols, dtype=torch.float32, device=dev)  # one copy to the CPU per pass
        nb = len(targets)
        for layer in range(L):
            g = grads[layer]
            if g is None:
                continue
            g = g[:nb].float()
            out[:, err_off + layer * T: err_off + (layer + 1) * T] = (g * err_vecs[layer].to(g.device)).sum(-1)
            V = dec_vecs[layer]
            base = layer_start[layer]
            for p, s0, s1 in segments[layer]:  # the layer's features at one position: one matmul
                out[:, base + s0: base + s1] = g[:, p, :] @ V[s0:s1].T.to(g.device)
        g = grads[L]
        if g is not None:
            out[:, tok_off:tok_off + T] = (g[:nb].float() * tok_vecs.to(g.device)).sum(-1)
        return out.cpu()

    n_passes = 0
    edge_rows = torch.zeros(n_rows, n_cols, dtype=torch.float32)
    row_node = torch.zeros(n_rows, dtype=torch.long)  # column index of each row's node
    bar = progress_bar(total=n_rows, desc="attribution graph backward passes", unit="row", enabled=progress)
    # logit rows first
    for s0 in range(0, n_log, bs):
        batch = [("logit", i) for i in range(s0, min(n_log, s0 + bs))]
        edge_rows[s0:s0 + len(batch)] = rows_for(batch)
        row_node[s0:s0 + len(batch)] = torch.arange(s0, s0 + len(batch)) + log_off
        n_passes += 1
        bar.update(len(batch))
    st = n_log
    visited = torch.zeros(n_cand, dtype=torch.bool)
    update_interval = 4
    while int(visited.sum()) < n_feat:
        if n_feat == n_cand:
            pending = torch.nonzero(~visited).flatten()
        else:
            infl = partial_influences(edge_rows[:st], logit_p, row_node[:st])
            rank = torch.argsort(infl[:n_cand], descending=True)
            pending = rank[~visited[rank]][:min(update_interval * bs, n_feat - int(visited.sum()))]
        for s0 in range(0, len(pending), bs):
            idx = pending[s0:s0 + bs]
            edge_rows[st:st + len(idx)] = rows_for([("feature", int(i)) for i in idx])
            row_node[st:st + len(idx)] = idx
            visited[idx] = True
            st += len(idx)
            n_passes += 1
            bar.update(len(idx))
    bar.close()
    fwd.clear()  # free the batch's autograd graph before the verification passes

    # ---- the bias term: the targets' inputs with every source node zeroed ----
    selected = torch.nonzero(visited).flatten()  # ascending: sorted by layer, position, feature
    fscale: dict[int, torch.Tensor] = {}
    for layer in range(L):
        af = rep.active[layer]
        s = torch.ones(af.pos.shape[0], device=af.acts.device)
        sel = selected[(selected >= layer_start[layer]) & (selected < layer_start[layer + 1])] - layer_start[layer]
        s[owner[layer][sel].to(s.device)] = 0.0
        fscale[layer] = s
    escale = torch.zeros(L, T, device=dev)
    tscale = torch.zeros(T, device=dev)
    if bos:
        escale[:, 0] = 1.0
        tscale[0] = 1.0
    zrun = rep.run(batch=1, feature_scale=fscale, error_scale=escale, token_scale=tscale, stop_at_final=True)
    n_passes_fwd = 4  # clean run, pattern probe, the batch forward, this one
    bias_f = torch.zeros(n_feat)
    input_f = torch.zeros(n_feat)
    for layer in range(L):
        in_layer = (selected >= layer_start[layer]) & (selected < layer_start[layer + 1])
        if not bool(in_layer.any()):
            continue
        af = rep.active[layer]
        k = owner[layer][selected[in_layer] - layer_start[layer]].to(af.pos.device)
        bias_f[in_layer] = af.pre_of(rep.dicts[layer], zrun.reads[layer])[0][k].cpu()
        input_f[in_layer] = af.pre[k].cpu()
    zl = zrun.pre_logits[0]
    bias_l = (zl[logit_ids.to(zl.device)] - zl.mean()).cpu()
    cl = rep.pre_logits
    input_l = (cl[logit_ids.to(cl.device)] - cl.mean()).cpu()

    # ---- assemble the adjacency over the nodes ----
    order = torch.argsort(row_node[n_log:])  # feature rows by candidate index (= selected order)
    frows = edge_rows[n_log:][order]
    cols = torch.cat([selected, torch.arange(n_cand, n_cols)])
    n_nodes = n_nodes_final
    adj = torch.zeros(n_nodes, n_nodes, dtype=torch.float32)
    adj[:n_feat] = frows[:, cols]
    adj[n_nodes - n_log:] = edge_rows[:n_log][:, cols]
    node_bias = torch.zeros(n_nodes)
    node_input = torch.zeros(n_nodes)
    node_bias[:n_feat], node_input[:n_feat] = bias_f, input_f
    node_bias[n_nodes - n_log:], node_input[n_nodes - n_log:] = bias_l, input_l

    # ---- verification (a), (b) ----
    full = rep.run(batch=1)
    n_passes_fwd += 1
    assert full.logits is not None
    logit_err = float((full.logits.float() - rep.logits.float()).abs().max())
    logit_err_last = float((full.logits[0, -1].float() - rep.logits[0, -1].float()).abs().max())
    rows_idx = torch.cat([torch.arange(n_feat), torch.arange(n_nodes - n_log, n_nodes)])
    resid = node_input[rows_idx] - adj[rows_idx].sum(1) - node_bias[rows_idx]
    comp_err = float(resid.abs().max()) if resid.numel() else 0.0

    feats_final = cand[selected]
    acts_final = cand_acts[selected]
    tokens = _decode(model, ids.tolist())
    tgt: dict[str, Any] = {}
    if target is not None:
        tgt = {"id": int(target), "token": _decode(model, [int(target)])[0]}
        if foil is not None:
            tgt.update({"foil_id": int(foil), "foil_token": _decode(model, [int(foil)])[0]})
    dset_meta = dict(dictionaries.metadata)
    dset_meta.setdefault("hooks", [[rep.dicts[k].hook_in, rep.dicts[k].hook_out] for k in range(L)])
    settings = {
        "desired_logit_prob": desired_logit_prob, "max_n_logits": max_n_logits,
        "max_feature_nodes": max_feature_nodes, "zero_bos": zero_bos, "bos_zeroed": bos,
        "batch_size": bs, "batch_size_budget": bs_budget, "backward_passes": n_passes,
        "forward_passes": n_passes_fwd, "backward_row_bytes": per_row, "n_active_features": n_cand,
        "n_feature_nodes": n_feat, "n_logit_nodes": n_log, "logit_prob_covered": float(logit_p.sum()),
        "bias_term": "target input with every source node zeroed (one forward pass)",
        "logit_nodes_read": "pre-transform logit minus its vocabulary mean (last position)",
        "replacement": rep.describe(), "wall_s": round(time.perf_counter() - t0, 3),
    }
    graph = AttributionGraph(
        prompt=prompt, token_ids=ids, tokens=tokens, n_layers=L, features=feats_final, activations=acts_final,
        logit_ids=logit_ids, logit_probs=logit_p.float(), logit_tokens=_decode(model, logit_ids.tolist()),
        adjacency=adj, error_norms=rep.errors.norm(dim=-1).float().cpu(), target=tgt,
        model={"name": str(getattr(m.cfg, "model_name", "")), "n_layers": L, "d_model": int(m.cfg.d_model)},
        dictionaries=dset_meta, settings=settings,
        verification={"logits_max_abs_error": logit_err, "logits_max_abs_error_last": logit_err_last,
                      "completeness_max_abs_error": comp_err},
        node_bias=node_bias, node_input=node_input)
    return graph

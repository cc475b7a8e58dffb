# Over 600 lines (reason): one report's engine, section by section (each section a few engine calls on the same
# prompt), plus the small Jinja rendering helpers the kind's report uses.
"""The "Life of a Token" trace: one prompt through every stage of the model, one report.

Like the article "Life of a Token" (after Chrome's "Life of a Pixel"), :func:`token_trace` follows
one prompt through a model and collects, per stage, the numbers tracekit's engines compute:

1. tokenization (ids, leading-space marker, BOS), 2. embedding (norms, nearest tokens, vector
analogies), 3. attention: the heads that matter for this prompt (ranked by their direct logit
attribution; each typed by :func:`type_heads`, which says what the type was measured on), each as a query x key pattern, the last position's attention of every head, and the raw
scores of one head (GPT-2's article head L0H6 on GPT-2 models, else the prompt's top head),
4. FFN neurons as key-value memories at the block where the target jumps (Geva et al. 2021/2022),
5. direct logit attribution per component (Elhage et al. 2021), 6. logit lens (nostalgebraist
2020), 7. SAE features (not configured: placeholder), 8. output distribution and sampling
(temperature / top-k / top-p as Hugging Face's logits warpers apply them), 9. cost arithmetic
(parameters by part, KV-cache bytes, decode arithmetic intensity).

Every section is computed by an existing engine (:mod:`tracekit.logit_lens`, :mod:`tracekit.dla`,
:mod:`tracekit.neurons`, :mod:`tracekit.attention`); this module shapes tidy tables only; the report
(HTML + Markdown) is rendered from the tables by :func:`render_html` / :func:`render_markdown`.

Notebook use (a doctest, run on a tiny model)::

    >>> from tracekit.trace import token_trace
    >>> tr = token_trace(model, "The capital of China is Beijing. The capital of France is", target=" Paris")
    >>> "lens" in tr.tables and "jump_layer" in tr.meta
    True
"""

from __future__ import annotations

import base64
import io
import re
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, cast

import numpy as np
import pandas as pd
import torch

from .attention import classify_heads, head_scores
from .core.sites import hook
from .dla import logit_attribution
from .errors import AttentionError, TokenizationError
from .fastpath import residual_stream
from .hooks import enabled_hooks, fwd_hooks
from .logit_lens import landmarks, logit_lens
from .model.context import context_length
from .model.info import HookedModel
from .model.load import bos_info, model_device
from .model.readout import Readout
from .neurons import key_readout, value_readout
from .tokens import show_token, single_token_id, token_texts, tokenize

__all__ = ["TraceTables", "token_trace", "TRACE_RENAMES", "SAMPLING_SETTINGS", "ANALOGIES", "ARTICLE", "DEVICE_RIDGE",
           "render_html", "render_markdown", "SECTIONS", "parse_head", "is_gpt2", "shown_head", "PATTERN_WINDOW",
           "type_heads", "TYPE_DOMINANCE", "PREV_CHECK_SEQ_LEN", "PREV_CHECK_SEQS"]


@dataclass
class _LastRow:
    """The last query position's attention of one layer (``scores``/``weights`` ``[head, 1, k]``)."""

    tokens: list
    layer: int
    scores: torch.Tensor
    weights: torch.Tensor


class _Read(Exception):
    """Raised by the last hook read to end a forward pass early (no logits)."""


def _forward_keeping(model: HookedModel, batch, names: Sequence[str], keep, what: str) -> None:
    """One forward pass of the one-prompt ``batch`` with ``keep(act, hook)`` on each of ``names``,
    ended after the last of them fires (the ``[pos, vocab]`` logits of a long prompt, 2 GB for
    2,048 tokens of Gemma 3, are never computed). Refused first when the forward pass does not fit
    the memory budget (:func:`tracekit.model.readout.forward_row_bytes`; ``keep`` holds one query
    row or a small window). Raises MemoryBudgetError."""
    from .core.budget import chunk_rows
    from .model.load import model_device
    from .model.readout import forward_row_bytes

    T = int(batch.tokens.shape[1])
    chunk_rows(forward_row_bytes(model, T), 1, what=what, device=model_device(model), unit=f"prompt ({T} tokens)",
               fix="shorten the prompt")
    seen: set = set()

    def fn(act, hook):
        keep(act, hook)
        seen.add(hook.name)
        if len(seen) == len(set(names)):
            raise _Read

    with enabled_hooks(model, names), fwd_hooks(model, [(n, fn) for n in names]):
        try:
            model(batch.tokens)
        except _Read:
            pass


@torch.no_grad()
def _attention(model: HookedModel, prompt: str, layers: Sequence[int]) -> list:
    """Every layer's attention *from the last position* (``.tokens``, ``.layer``, ``.scores`` and
    ``.weights`` ``[head, 1, key]``), from ONE forward pass that keeps only that row of each
    ``hook_attn_scores`` / ``hook_pattern``: the report shows the last position's attention, and a
    full ``[head, q, k]`` pattern of every layer grows with the square of the prompt (13 GB for a
    2,456-token prompt on SmolLM2). ``tests/integration/test_trace.py`` checks the rows equal the
    engine's ``attention_pattern`` layer by layer."""
    names = [n for L in layers for n in (hook("head_scores", L), hook("head_pattern", L))]
    batch = tokenize(model, [prompt])
    q = batch.lengths[0] - 1
    got: dict = {}

    def keep(act, hook):
        got[hook.name] = act[0, :, q:q + 1, : q + 1].detach().float().cpu().clone()  # not a view of [h, q, k]

    _forward_keeping(model, batch, names, keep, "trace report attention")
    toks = token_texts(model, batch.ids[0])
    return [_LastRow(toks, L, got[hook("head_scores", L)], got[hook("head_pattern", L)])
            for L in layers]


#: Query and key positions shown per head in the small multiples (the last ones of the prompt).
PATTERN_WINDOW = 32


@torch.no_grad()
def _head_patterns(model: HookedModel, prompt: str, heads: Sequence[tuple[int, int]], window: int = PATTERN_WINDOW) -> pd.DataFrame:
    """The full ``[query, key]`` attention pattern of each of ``heads`` (``(layer, head)``), the last
    ``window`` query and key positions, from one forward pass that keeps only those heads: a tidy
    table ``component`` (``"L3H1"``), ``layer``, ``head_idx``, ``query_pos``, ``key_pos``,
    ``query_token``, ``key_token``, ``weight`` (causal: keys after the query are absent).
    ``tests/integration/test_trace.py`` checks it equals the attention engine's pattern."""
    layers = sorted({L for L, _ in heads})
    names = [hook("head_pattern", L) for L in layers]
    batch = tokenize(model, [prompt])
    n = batch.lengths[0]
    lo = max(0, n - window)
    got: dict = {}

    def keep(act, hook):
        got[hook.name] = act[0, :, lo:n, lo:n].detach().float().cpu().clone()

    _forward_keeping(model, batch, names, keep, "trace report head patterns")
    toks = token_texts(model, batch.ids[0])
    frames = []
    for L, H in heads:
        w = got[hook("head_pattern", L)][H]
        q, k = np.tril_indices(n - lo)
        frames.append(pd.DataFrame({"component": f"L{L}H{H}", "layer": L, "head_idx": H, "query_pos": q + lo,
                                    "key_pos": k + lo, "query_token": [toks[i + lo] for i in q],
                                    "key_token": [toks[i + lo] for i in k], "weight": w[q, k].numpy().astype(float)}))
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(
        columns=["component", "layer", "head_idx", "query_pos", "key_pos", "query_token", "key_token", "weight"])


def shown_head(model: HookedModel, head: Optional[tuple[int, int]], ranked: Sequence[tuple[int, int]]) -> tuple[tuple[int, int], str]:
    """The head whose raw scores the trace shows, and why: ``head`` when given (``"given"``); on a
    GPT-2 with a head 6 in layer 0, the article's L0H6 (``"article (GPT-2)"``); else the prompt's top
    head, ``ranked[0]`` (``"top head by DLA"``).

    Args:
        model: the model (its ``cfg`` and architecture).
        head: ``(layer, head)`` from :func:`parse_head`, or None.
        ranked: the prompt's heads, best first (at least one).

    Returns:
        ``((layer, head), source)``.
    """
    if head is not None:
        return head, "given"
    if is_gpt2(model) and int(model.cfg.n_heads) > 6:
        return (0, 6), "article (GPT-2)"
    return ranked[0], "top head by DLA"


def is_gpt2(model: HookedModel) -> bool:
    """Whether ``model`` is a GPT-2 (the article's model; its head L0H6 is shown only there)."""
    arch = str(getattr(model.cfg, "architecture", "") or getattr(model.cfg, "original_architecture", "") or "")
    cfg = getattr(getattr(model, "original_model", None), "config", None)
    return arch.startswith("GPT2") or getattr(cfg, "model_type", None) == "gpt2"



#: Section ids and titles, in report order.
SECTIONS = [
    ("tokenization", "1. Tokenization"),
    ("embedding", "2. Embedding"),
    ("attention", "3. Attention"),
    ("ffn", "4. FFN as key-value memory"),
    ("residual", "5. Residual stream: direct logit attribution"),
    ("lens", "6. Logit lens"),
    ("sae", "7. SAE features"),
    ("output", "8. Output and sampling"),
    ("cost", "9. Cost arithmetic"),
]

#: Vector-arithmetic checks: (name, a, b, c, expected) means a - b + c ~ expected.
ANALOGIES = [
    ("king - man + woman", " king", " man", " woman", " queen"),
    ("France + Tokyo - Japan", " Tokyo", " Japan", " France", " Paris"),
]

#: Sampling settings shown in section 8 (temperature, top_k, top_p; None = off).
SAMPLING_SETTINGS = [
    ("greedy", 0.0, None, None),
    ("T=1", 1.0, None, None),
    ("T=0.7", 0.7, None, None),
    ("T=1.5", 1.5, None, None),
    ("top-k=10", 1.0, 10, None),
    ("top-p=0.9", 1.0, None, 0.9),
]

#: The seed article's numbers on GPT-2 Small (shown beside tracekit's when the model is gpt2).
ARTICLE = {
    "model": "gpt2",
    "prompt_ids": {"The capital of France is": [464, 3139, 286, 4881, 318]},
    "prompt": "The capital of China is Beijing. The capital of France is",
    "target": " Paris",
    "target_id": 6342,
    "final_prob": 0.7467,
    "jump_layer": 8,
    "jump_from_prob": 0.0055,
    "jump_to_prob": 0.8835,
    "L0H6_weights": {" France": 0.35, " capital": 0.35, "The": 0.22},
    "L0H6_scores": {" France": -5.20, " capital": -5.34, " of": -24.02},
    "kv_bytes_per_token_llama31_8b_fp16": 131072,
    "decode_intensity": 1.0,
    "a100_ridge": 156.0,
}

#: Peak dense bf16/fp16 FLOP/s over memory bandwidth (bytes/s) -> ridge point (FLOP/byte).
DEVICE_RIDGE = {
    "A100": 312e12 / 2.039e12,
    "H100": 989e12 / 3.35e12,
    "H200": 989e12 / 4.8e12,
    "L4": 121e12 / 0.3e12,
    "A10": 125e12 / 0.6e12,
    "T4": 65e12 / 0.32e12,
}


@dataclass
class TraceTables:
    """The trace of one prompt (the engine's output; the kind is :class:`tracekit.TokenTrace`):
    ``tables`` (section name -> tidy DataFrame) and ``meta`` (headline
    numbers: target, jump/emergence, logit, sums; JSON-able)."""

    tables: dict = field(default_factory=dict)
    meta: dict = field(default_factory=dict)


def parse_head(spec, model: HookedModel, field_name: str = "head") -> Optional[tuple[int, int]]:
    """``"L0H6"`` / ``[0, 6]`` to (layer, head); None stays None (the trace then picks the head:
    L0H6 on GPT-2, the article's, else the prompt's top head by direct logit attribution).

    Args:
        spec: the head, ``"L<layer>H<head>"`` or ``[layer, head]``, or None.
        model: the model (or a :class:`tracekit.model.ModelInfo`): its ``cfg.n_layers`` / ``cfg.n_heads``.
        field_name: the config field named in errors.

    Returns:
        ``(layer, head)`` or None.

    Raises:
        AttentionError: malformed or out of range (naming ``field_name``).
    """
    n_layers, n_heads = int(model.cfg.n_layers), int(model.cfg.n_heads)
    if spec is None:
        return None
    if isinstance(spec, str):
        m = re.fullmatch(r"\s*L(\d+)\s*H(\d+)\s*", spec, re.I)
        if not m:
            raise AttentionError(f"{field_name}: {spec!r} is not a head; write it as 'L<layer>H<head>', e.g. 'L0H6'")
        L, H = int(m.group(1)), int(m.group(2))
    else:
        L, H = (int(x) for x in spec)
    if not (0 <= L < n_layers and 0 <= H < n_heads):
        raise AttentionError(f"{field_name}: L{L}H{H} does not exist; the model has {n_layers} layers of "
                            f"{n_heads} heads (L0H0..L{n_layers - 1}H{n_heads - 1})")
    return L, H


def _tok_id(model: HookedModel, text: str) -> Optional[int]:
    try:
        return single_token_id(model, text, field="analogy")
    except TokenizationError:
        return None


# ---------------------------------------------------------------------------------------------
# sections


def _tokenization(model: HookedModel, batch) -> pd.DataFrame:

    ids = list(batch.ids[0])
    toks = token_texts(model, ids)  # a piece of a character shows its bytes, not '\ufffd'
    bos = bos_info(model)
    rows = []
    for i, (t, tid) in enumerate(zip(toks, ids)):
        is_bos = bool(bos["prepend_bos"] and i == 0 and tid == bos["bos_token_id"])
        rows.append({"position": i, "token": t, "token_id": int(tid), "is_bos": is_bos,
                     "leading_space": (not is_bos) and t[:1] in (" ", "\u0120", "\u2581")})
    return pd.DataFrame(rows)


@torch.no_grad()
def _embedding(model: HookedModel, ids: list[int], n_nearest: int):
    W_E = cast(Any, model).W_E.detach().float().cpu()  # a loaded bridge's embedding
    norms = W_E[ids].norm(dim=-1)
    W_pos = getattr(model, "W_pos", None) if hook("pos_embed") in model.hook_dict else None
    pos_norm = [float(W_pos[i].float().norm()) for i in range(len(ids))] if W_pos is not None else [None] * len(ids)
    norms_df = pd.DataFrame({"position": range(len(ids)), "token": token_texts(model, ids), "token_id": ids,
                             "embed_norm": norms.numpy(), "pos_embed_norm": pos_norm})
    unit = W_E / W_E.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    last = ids[-1]
    cos = unit @ unit[last]
    cos[last] = -2.0
    v, i = cos.topk(min(n_nearest, len(cos) - 1))
    nearest = pd.DataFrame({"rank": range(1, len(v) + 1), "token": token_texts(model, i.tolist()),
                            "token_id": i.tolist(), "cosine": v.numpy()})
    rows = []
    for name, a, b, c, exp in ANALOGIES:
        words = [a, b, c, exp]
        wid = [_tok_id(model, w) for w in words]
        row = {"analogy": name, "expected": exp, "status": "ok", "rank": None, "top5": None}
        if any(x is None for x in wid):
            bad = [w for w, x in zip(words, wid) if x is None]
            row["status"] = f"skipped: {', '.join(repr(w) for w in bad)} not a single token"
            rows.append(row)
            continue
        q = unit[wid[0]] - unit[wid[1]] + unit[wid[2]]
        sims = unit @ (q / q.norm())
        sims[wid[:3]] = -2.0  # the inputs are excluded, as in word2vec's analogy evaluation
        row["rank"] = int((sims > sims[wid[3]]).sum()) + 1
        row["top5"] = ", ".join(show_token(t) for t in token_texts(model, sims.topk(5).indices.tolist()))
        rows.append(row)
    return norms_df, nearest, pd.DataFrame(rows)


#: Positions of the lens grid (the last ones of the prompt).
LENS_GRID = 16


#: Repeated random tokens of the trace's previous-token check (Olsson et al. 2022): tokens per copy
#: (at most what the context allows) and sequences; the check is one short extra forward pass.
PREV_CHECK_SEQ_LEN, PREV_CHECK_SEQS = 20, 2
#: Attention mass at or above which a head is typed by a key (the default ``dominance`` of
#: :func:`tracekit.attention.classify_heads`).
TYPE_DOMINANCE = 0.4
_POSITIONAL = {"self": "self", "first": "first-token", "previous": "previous-token", "spread": "diffuse",
               "content": "content"}


def _random_prev_scores(model: HookedModel) -> tuple[pd.DataFrame, str]:
    """Every head's previous-token and induction scores on repeated random tokens
    (:func:`tracekit.attention.head_scores`) and what they were measured on."""
    n_ctx = context_length(model)
    seq_len = min(PREV_CHECK_SEQ_LEN, ((n_ctx or 10 ** 6) - 1) // 2)
    if seq_len < 2:  # a context too short for BOS + 2 x 2 tokens: no check (type_heads says so)
        return pd.DataFrame(columns=["layer", "head_idx", "prev_token_score", "induction_score"]), "no random tokens"
    sc = head_scores(model, seq_len, PREV_CHECK_SEQS, seed=0)
    return sc, f"random tokens ({PREV_CHECK_SEQS} x 2 x {seq_len})"


def type_heads(labels: pd.DataFrame, attention: pd.DataFrame, random_scores: pd.DataFrame, random_on: str,
               positions: Optional[dict[str, int]] = None, dominance: float = TYPE_DOMINANCE) -> pd.DataFrame:
    """Type each head from behaviour that separates the types, and say what each type was measured on.

    A head that puts most of the last token's attention on the previous token of ONE prompt may be a
    previous-token head or a head that seeks the token that happens to sit there (a subject mover
    whose subject ends right before the last token). So:

    1. the one-prompt label (:func:`tracekit.attention.classify_heads`) is ``previous`` and the
       head's previous-token score on repeated random tokens (Olsson et al. 2022; ``random_scores``)
       is >= ``dominance``: ``previous-token`` (``previous-token (attends SUBJ)`` when the previous
       token is a named position), measured on those random tokens;
    2. else the last token's strongest key is a named position of the traced row (``SUBJ``, ``S1``,
       ...; ``positions``) with weight >= ``dominance``: ``"attends SUBJ"`` (``"attends S1/S2"`` when
       names share the key), measured on ``this prompt (last token), named positions``;
    3. else a one-prompt ``previous`` label is ``content``: the head attends the previous token
       here but not on random tokens, so what it seeks is the token (``top_key_token``);
    4. else the one-prompt label (``self``, ``first-token``, ``diffuse``, ``content``), measured on
       ``this prompt (last token)``.

    Args:
        labels: per head: ``layer, head, self, first, previous, entropy_norm, max_key_weight, label``
            (one-prompt labels at the last token).
        attention: ``layer, head, key_pos, key_token, weight`` of the last token.
        random_scores: :func:`tracekit.attention.head_scores` (``layer, head_idx, prev_token_score,
            induction_score``); ``random_on`` says on what it was measured.
        positions: the traced row's named positions (name -> token index, BOS counted) or None;
            a name at the last token itself (``END``) is left out (the ``self`` label says it).
        dominance: attention probability at or above which a key types a head.

    Returns:
        ``labels`` plus ``top_key_pos, top_key_token, top_key_weight, top_key_role`` (named
        positions at the top key, ``/``-joined, or ``""``), ``prev_token_score_random,
        induction_score_random`` (probabilities), ``type`` and ``measured_on``.
    """
    at_pos: dict[int, list[str]] = {}
    last = int(cast(pd.Series, attention["key_pos"]).max())  # the query (the last token) attends keys 0..last
    for name, p in (positions or {}).items():
        if int(p) != last:  # a name at the query itself (END) would call a self head "attends END"
            at_pos.setdefault(int(p), []).append(str(name))
    a = attention.sort_values(["layer", "head", "weight", "key_pos"], ascending=[True, True, False, True])
    top = a.drop_duplicates(["layer", "head"]).set_index(["layer", "head"])
    rs = random_scores.set_index(["layer", "head_idx"])
    rows = []
    for r in labels.to_dict("records"):
        L, H = int(r["layer"]), int(r["head"])
        t = top.loc[(L, H)]
        kpos, ktok, kw = int(t["key_pos"]), t["key_token"], float(t["weight"])
        role = "/".join(at_pos.get(kpos, []))
        prev_r = float(rs.loc[(L, H), "prev_token_score"]) if (L, H) in rs.index else float("nan")
        ind_r = float(rs.loc[(L, H), "induction_score"]) if (L, H) in rs.index else float("nan")
        if r["label"] == "previous" and prev_r >= dominance:
            ty = "previous-token" + (f" (attends {role})" if role else "")
            on = random_on + ("; this prompt, named positions" if role else "")
        elif role and kw >= dominance:
            ty, on = f"attends {role}", "this prompt (last token), named positions"
        elif r["label"] == "previous" and np.isnan(prev_r):
            ty, on = "previous (this prompt only)", "this prompt (last token); no random-token check"
        elif r["label"] == "previous":
            ty, on = "content", f"this prompt; {random_on} say not previous-token"
        else:
            ty, on = _POSITIONAL[str(r["label"])], "this prompt (last token)"
        rows.append({**r, "top_key_pos": kpos, "top_key_token": ktok, "top_key_weight": kw, "top_key_role": role,
                     "prev_token_score_random": prev_r, "induction_score_random": ind_r, "type": ty,
                     "measured_on": on})
    return pd.DataFrame(rows)


def _attention_section(model: HookedModel, prompt: str, head: tuple[int, int],
                       positions: Optional[dict[str, int]] = None):
    rows, labels, picked = [], [], None
    for ap in _attention(model, prompt, range(int(model.cfg.n_layers))):
        L = ap.layer
        q = len(ap.tokens) - 1
        w = ap.weights[:, 0, : q + 1].numpy()
        H = w.shape[0]
        rows.append(pd.DataFrame({"layer": L, "head": np.repeat(np.arange(H), q + 1), "key_pos": np.tile(np.arange(q + 1), H),
                                  "key_token": np.tile(np.asarray(ap.tokens[: q + 1], dtype=object), H),
                                  "weight": w.reshape(-1).astype(float)}))
        cl = classify_heads(ap.weights, queries=[q], rows=[0])
        cl.insert(0, "layer", L)
        labels.append(cl)
        if L == head[0]:
            picked = pd.DataFrame({"layer": L, "head": head[1], "key_pos": range(q + 1), "key_token": ap.tokens[:q + 1],
                                   "score": ap.scores[head[1], 0, : q + 1].numpy(),
                                   "weight": ap.weights[head[1], 0, : q + 1].numpy()})
    lab = pd.concat(labels, ignore_index=True)
    att = pd.concat(rows, ignore_index=True)
    scores, random_on = _random_prev_scores(model)
    assert picked is not None, "the shown head's block is among every block"
    return att, type_heads(lab, att, scores, random_on, positions), picked


def _top_heads(ranked: pd.DataFrame, attention: pd.DataFrame, head_types: pd.DataFrame) -> pd.DataFrame:
    """The ranked heads (``heads_dla`` rows, best first) with their type (:func:`type_heads`), what
    it was measured on, and the key token the last position attends to most."""
    rows = []
    for i, (L, H, dla) in enumerate(zip(ranked["layer"].tolist(), ranked["head"].tolist(),
                                        ranked["contribution"].tolist())):
        L, H = int(L), int(H)
        a = cast(pd.DataFrame, attention[(attention["layer"] == L) & (attention["head"] == H)])
        best = a.loc[cast(pd.Series, a["weight"]).idxmax()]
        sel = cast(pd.DataFrame, head_types[(head_types["layer"] == L) & (head_types["head"] == H)])
        ty, on = cast(pd.Series, sel["type"]).tolist(), cast(pd.Series, sel["measured_on"]).tolist()
        rows.append({"rank": i + 1, "component": f"L{L}H{H}", "layer": L, "head": H, "dla": float(dla),
                     "type": str(ty[0]) if ty else "", "measured_on": str(on[0]) if on else "",
                     "top_key_pos": int(best["key_pos"]),
                     "top_key_token": best["key_token"], "top_key_weight": float(best["weight"])})
    return pd.DataFrame(rows)


def _corpus_name(corpus) -> str:
    """A corpus source in words, for the report's "contexts from:" line: the default offline corpus
    as what it is (Python's documentation), a path or list of paths as given."""
    from .corpus import STDLIB

    if corpus is None or corpus == STDLIB:
        return "stdlib corpus (Python's documentation: reference-manual topics and standard-library docstrings)"
    return str(corpus) if isinstance(corpus, str) else ", ".join(str(c) for c in corpus)


def _ffn_section(model: HookedModel, dla, layer: int, n_neurons: int, n_values: int, key_top_n: int, max_tokens: int, corpus,
                 target_only=None, key_prompts: Optional[Sequence[str]] = None, key_prompts_name: str = ""):
    """The jump block's top neurons by ``dla``'s contribution (the logit difference when a foil is
    set); ``target_only``: the attribution of the target logit alone (adds ``contribution_target``).
    Their top-activating contexts come from ``key_prompts`` (the run's dataset, one document per
    prompt) when given, else from ``corpus``; the last value returned says which (``source``
    ``dataset`` or ``corpus``, ``name``, ``n_tokens`` read, ``n_documents`` for a dataset)."""
    contrib = dla.neuron_contrib[layer]
    act = dla.neuron_act[layer]
    order = contrib.argsort(descending=True)[:n_neurons].tolist()  # the neurons that write the target most
    rows, values = [], []
    for r, n in enumerate(order):
        sign = 1.0 if float(act[n]) >= 0 else -1.0
        vr = value_readout(model, layer, n, k=n_values, sign=sign)
        prom = vr[vr["side"] == "promoted"]
        rows.append({"rank": r + 1, "layer": layer, "neuron": n, "activation": float(act[n]),
                     "logit_per_activation": float(dla.neuron_value[layer][n]), "contribution": float(contrib[n]),
                     **({"contribution_target": float(target_only.neuron_contrib[layer][n])} if target_only else {}),
                     "promotes": ", ".join(show_token(t) for t in prom["token"])})
        values.append(vr)
    neurons = pd.DataFrame(rows)
    contexts = pd.DataFrame(columns=["layer", "neuron", "rank", "activation", "token", "context"])
    source: dict[str, Any] = ({"source": "dataset", "name": key_prompts_name or "the run's dataset",
                               "n_documents": len(key_prompts)} if key_prompts else
                              {"source": "corpus", "name": _corpus_name(corpus)})
    source["n_tokens"] = 0
    if max_tokens > 0 and order:
        signs = [1.0 if float(act[n]) >= 0 else -1.0 for n in order]
        docs = [(f"row {i}", p) for i, p in enumerate(key_prompts)] if key_prompts else None
        kr = key_readout(model, [(layer, n) for n in order], corpus, top_n=key_top_n, max_tokens=max_tokens, signs=signs,
                         progress=False, documents=docs)
        contexts = cast(pd.DataFrame, kr.contexts[["layer", "neuron", "rank", "activation", "token", "context"]])
        source["n_tokens"] = int(kr.n_tokens)
    return neurons, pd.concat(values, ignore_index=True) if values else pd.DataFrame(), contexts, source


def _sampling(model: HookedModel, logits: torch.Tensor, target_id: int, seed: int, n_samples: int):
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    rows = []
    base = logits.float().reshape(1, -1)
    no_ids = cast(torch.LongTensor, None)  # the warpers read only the scores; transformers types input_ids
    for name, temp, k, p in SAMPLING_SETTINGS:
        x = base.clone()
        if temp == 0.0:
            probs = torch.zeros_like(x)
            probs[0, int(x.argmax())] = 1.0
        else:
            x = TemperatureLogitsWarper(temp)(no_ids, x)
            if k is not None:
                x = TopKLogitsWarper(k)(no_ids, x)
            if p is not None:
                x = TopPLogitsWarper(p)(no_ids, x)
            probs = x.softmax(-1)
        kept = int((probs > 0).sum())
        g = torch.Generator().manual_seed(seed)
        draws = torch.multinomial(probs[0], n_samples, replacement=True, generator=g).tolist()
        top = probs[0].topk(min(3, kept))  # runners-up only among the kept tokens (no 0% ties: BOS, EOS, pad)
        rows.append({"setting": name, "temperature": temp, "top_k": k, "top_p": p, "kept_tokens": kept,
                     "target_prob": float(probs[0, target_id]),
                     "top3": ", ".join(f"{show_token(t)} {v:.1%}" for t, v in zip(token_texts(model, top.indices.tolist()),
                                                                                top.values.tolist())),
                     "seed": seed, "samples": " | ".join(show_token(t) for t in token_texts(model, draws))})
    return pd.DataFrame(rows)


#: Parameter-name patterns -> the part of the model they belong to (first match wins).
_PARAM_PARTS = [
    (r"wpe|pos_embed|position_embed", "pos_embed"),
    (r"wte|embed_tokens|embed\.|w_e\b|word_embed", "embed"),
    (r"lm_head|unembed|w_u\b", "unembed"),
    (r"norm|ln_|\bln|layernorm", "norms"),
    (r"attn|attention|self_attn|q_proj|k_proj|v_proj|o_proj", "attention"),
    (r"mlp|ffn|fc|gate_proj|up_proj|down_proj", "mlp"),
]


def _param_part(name: str) -> str:
    n = name.lower()
    return next((part for pat, part in _PARAM_PARTS if re.search(pat, n)), "other")


def _tied(model: HookedModel) -> bool:
    cfg = getattr(getattr(model, "original_model", None), "config", None)
    v = getattr(model.cfg, "tie_word_embeddings", None)
    return bool(v if v is not None else getattr(cfg, "tie_word_embeddings", False))


def _cost(model: HookedModel, n_tokens: int, device_name: Optional[str]):
    """Parameters of the model as published: shared tensors once; with tied embeddings the
    unembedding is the embedding (weight processing folds the final norm into a separate copy, which
    is not counted); all-zero tensors that weight processing adds (e.g. an unembedding bias) are
    not counted either."""
    seen, parts = set(), {}
    dtype = None
    tied = _tied(model)
    for name, p in cast(Any, model).named_parameters():  # a loaded bridge's parameters
        if p.data_ptr() in seen:  # tied weights counted once
            continue
        seen.add(p.data_ptr())
        dtype = dtype or p.dtype
        part = _param_part(name)
        if (part == "unembed" and tied and p.ndim == 2) or not bool(p.detach().ne(0).any()):
            continue
        parts[part] = parts.get(part, 0) + p.numel()
    total = sum(parts.values())
    params = pd.DataFrame([{"part": k, "parameters": int(v), "share": v / total} for k, v in parts.items()])
    cfg = model.cfg
    bytes_per = torch.finfo(dtype).bits // 8 if dtype is not None and dtype.is_floating_point else 4
    kv_heads = int(getattr(cfg, "n_key_value_heads", None) or cfg.n_heads)
    per_tok = 2 * int(cfg.n_layers) * kv_heads * int(cfg.d_head) * bytes_per
    kv = pd.DataFrame([{"context_tokens": c, "kv_cache_bytes": per_tok * c, "dtype": str(dtype).replace("torch.", "")}
                       for c in (1, n_tokens, 1024, 128 * 1024)])
    # batch-1 decode: ~2 FLOPs per parameter per token; bytes = weights read once + KV cache read
    flops = 2 * total
    moved = total * bytes_per + per_tok * n_tokens
    ridge = None
    if device_name:
        for k, v in DEVICE_RIDGE.items():
            if k.lower() in device_name.lower():
                ridge = v
                break
    meta = {"parameters": int(total), "tied_embeddings": tied,
            "dtype": str(dtype).replace("torch.", ""), "bytes_per_value": bytes_per,
            "kv_heads": kv_heads, "kv_bytes_per_token": per_tok, "decode_flops_per_token": flops,
            "decode_bytes_per_token": moved, "decode_intensity": flops / moved, "device": device_name,
            "ridge_point": ridge}
    return params, kv, meta


def _device_name(model: HookedModel) -> Optional[str]:

    dev = model_device(model)
    if dev.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(dev)
    return None


# ---------------------------------------------------------------------------------------------
# the engine


#: Columns of the trace's tables that would shadow a DataFrame attribute (``df.head``, ``df.rank``,
#: ``df.first``), renamed as in every kind (tracekit.results.RENAMED_COLUMNS); ``rank`` is a vocabulary
#: rank in the lens/final/analogy tables and a place in a top list elsewhere.
TRACE_RENAMES: dict[str, str] = {
    "head": "head_idx", "self": "self_weight", "first": "first_weight", "previous": "previous_weight",
    "lens.rank": "vocab_rank", "final_topk.rank": "vocab_rank", "analogies.rank": "vocab_rank",
    "nearest.rank": "top_rank", "neurons.rank": "top_rank", "neuron_values.rank": "top_rank",
    "neuron_contexts.rank": "top_rank", "top_heads.rank": "top_rank",
}


def _renamed(tables: dict[str, pd.DataFrame]) -> dict[str, pd.DataFrame]:
    out = {}
    for name, df in tables.items():
        ren = {c: TRACE_RENAMES.get(f"{name}.{c}", TRACE_RENAMES.get(str(c))) for c in df.columns}
        out[name] = df.rename(columns={c: n for c, n in ren.items() if n})
    return out


@torch.no_grad()
def token_trace(
    model: HookedModel,
    prompt: str,
    target: Optional[str] = None,
    foil: Optional[str] = None,
    head=None,
    top_neurons: int = 5,
    value_tokens: int = 5,
    key_contexts: int = 3,
    key_max_tokens: int = 1024,
    corpus=None,
    n_nearest: int = 10,
    top_k: int = 10,
    seed: int = 0,
    n_samples: int = 5,
    top_heads: int = 6,
    positions: Optional[dict[str, int]] = None,
    key_prompts: Optional[Sequence[str]] = None,
    key_prompts_name: str = "",
) -> TraceTables:
    """Trace ``prompt`` through every stage (module docstring) and return its tables.

    Args:
        model: a hooked model (TransformerBridge in compatibility mode).
        prompt: the text.
        target: the next token followed (exactly one token, leading space included); default: the
            model's own top-1 prediction.
        foil: optional second token; attribution (components, heads, neurons) then splits
            ``logit[target] - logit[foil]``; the neurons table adds ``contribution_target`` (the
            target logit alone).
        head: the head whose raw (pre-softmax) scores are shown, ``"L0H6"`` or ``[0, 6]``; default:
            L0H6 on GPT-2 (the article's head), else the prompt's top head by |DLA|.
        top_neurons: neurons shown at the jump block (largest positive direct contribution to the
            attributed logit (difference)).
        value_tokens: promoted tokens per neuron (value readout).
        key_contexts: top-activating corpus contexts per neuron.
        key_max_tokens: corpus text tokens read for them (0 skips the key readout).
        corpus: the corpus (default: the offline stdlib corpus, Python's documentation; see
            :mod:`tracekit.corpus`), read when ``key_prompts`` is not given.
        key_prompts: prompts the contexts are read from instead of ``corpus`` (the run's own
            dataset: contexts of the task's own text), one document each.
        key_prompts_name: what ``key_prompts`` are, in words (``meta["key_corpus"]["name"]``).
        n_nearest: nearest tokens (cosine, embedding matrix) of the last token.
        top_k: final tokens listed.
        seed: seed of the sampling draws (``torch.Generator``).
        n_samples: draws per sampling setting.
        top_heads: heads shown as query x key patterns (ranked by |direct logit attribution|).
        positions: the traced row's named positions (``{"SUBJ": 4, "END": 5}``: token indices of
            the prompt, BOS counted), or None; a head whose last-token attention peaks on one is typed
            by it (``attends SUBJ``; :func:`type_heads`).

    Units: probabilities in [0, 1], logits, ranks (1 = top), bytes.

    Returns:
        :class:`TraceTables`: the tables (module docstring of :mod:`tracekit.experiments.trace`) and
        the headline numbers.

    Raises:
        TokenizationError: target/foil not one token, prompt too long.
        AttentionError: bad head.
        AttributionError: an architecture whose residual stream is not embed + attention + MLP.
        MemoryBudgetError: the prompt's forward pass (or the lens readout of its last positions)
            does not fit ``run.memory_budget``; the attention sections keep one query row and stop
            before the logits, the lens reads chunks of vectors (:mod:`tracekit.core.budget`).
    """
    # Long (reason): one section of the report per block, in report order; each block is a few engine calls on the same cached run.
    import time

    clock = [time.perf_counter()]
    timings: dict[str, float] = {}

    def lap(name: str) -> None:
        now = time.perf_counter()
        timings[name] = round(now - clock[0], 3)
        clock[0] = now

    L_head = parse_head(head, model)  # None: picked once the heads are ranked (below)
    batch = tokenize(model, [prompt])
    ids = [int(i) for i in batch.ids[0]]

    last_resid = residual_stream(model, batch, [hook("resid_post", int(model.cfg.n_layers) - 1)],
                                 positions=batch.last)[0]  # the last position only: no [pos, vocab] logits
    logits = Readout(model).logits(last_resid)[0].float().cpu()
    if target is None:
        top1: str = model.tokenizer.decode([int(logits.argmax())])
        target = top1
    target_id = single_token_id(model, target, field="target")
    foil_id = single_token_id(model, foil, field="foil") if foil is not None else None
    tables: dict[str, pd.DataFrame] = {}
    meta: dict = {"prompt": prompt, "target": target, "target_id": target_id, "foil": foil, "foil_id": foil_id,
                  "n_layers": int(model.cfg.n_layers), "n_heads": int(model.cfg.n_heads)}

    lap("forward")
    # 1. tokenization
    tables["tokens"] = _tokenization(model, batch)
    lap("tokenization")
    # 2. embedding
    tables["embedding_norms"], tables["nearest"], tables["analogies"] = _embedding(model, ids, n_nearest)
    lap("embedding")
    # 6. logit lens (first: the jump picks the FFN block)
    # the report shows the lens at the last position and a grid of the last LENS_GRID positions: the
    # cost is that, not every position of a long prompt (a 2,456-token prompt took 6 min before)
    pl = logit_lens(model, [prompt], [target], position=range(-min(len(ids), LENS_GRID), 0), top_k=top_k)[0]
    hs = [p.hidden_state for p in pl.points]
    last = len(pl.positions) - 1
    probs = pl.target_prob[:, last, 0].tolist()
    ranks = pl.target_rank[:, last, 0].tolist()
    lm = landmarks(hs, probs, ranks)
    tables["lens"] = pd.DataFrame({
        "hidden_state": hs, "layer": [p.layer for p in pl.points], "hook": [p.hook for p in pl.points],
        "prob": probs, "rank": [int(r) for r in ranks],
        "top1": token_texts(model, pl.topk_ids[:, last, 0].tolist()), "top1_prob": pl.topk_probs[:, last, 0].numpy()})
    H, P = pl.topk_ids.shape[:2]
    prompt_tokens = token_texts(model, pl.ids)
    tables["lens_grid"] = pd.DataFrame({
        "hidden_state": np.repeat(hs, P), "position": np.tile(pl.positions, H),
        "token": np.tile([prompt_tokens[p] for p in pl.positions], H),
        "top1": token_texts(model, pl.topk_ids[:, :, 0].reshape(-1).tolist()),
        "top1_prob": pl.topk_probs[:, :, 0].reshape(-1).numpy()})
    meta.update({"jump_layer": lm["jump_layer"], "jump": lm["jump"],
                 "emergence_hidden_state": lm["emergence_hidden_state"], "emergence_layer": lm["emergence_layer"],
                 "target_prob": float(pl.final_log_prob[last, 0].exp())})
    lap("lens")
    # 5. direct logit attribution (with the neurons of the jump block); with a foil, a second call
    # attributes the target logit alone, so the FFN table can show both
    jl = lm["jump_layer"]
    ffn_layer = jl if jl is not None and jl >= 0 else int(model.cfg.n_layers) - 1
    dla = logit_attribution(model, [prompt], target, foil, position="last", neuron_layers=[ffn_layer])[0]
    dla_t = (logit_attribution(model, [prompt], target, None, position="last", neuron_layers=[ffn_layer])[0]
             if foil is not None else None)
    comp = dla.components_frame().drop(columns=["prompt_idx", "position"])
    tables["components"] = comp
    assert dla.attributed is not None, "DirectAttribution fills attributed (with the logit by default)"
    meta.update({"logit": float(dla.logit), "attributed": float(dla.attributed), "output_transform": dla.transform,
                 "components_sum": float(cast(pd.Series, comp["contribution"]).sum()),
                 "ffn_layer": ffn_layer, "target_logit": float((dla_t or dla).logit)})
    hf = dla.heads_frame()
    tables["heads_dla"] = cast(pd.DataFrame, hf[hf["head"] >= 0]).drop(columns=["prompt_idx"]).reset_index(drop=True)
    lap("residual")
    # 3. attention: the heads ranked by |direct logit attribution|; the raw scores of the article's
    # head on GPT-2, else of the prompt's top head
    hd = tables["heads_dla"]
    ranked = hd.iloc[np.argsort(-np.abs(hd["contribution"].to_numpy(dtype=float)), kind="stable")]
    picked = [(int(L), int(H)) for L, H in zip(ranked["layer"].head(top_heads), ranked["head"].head(top_heads))]
    L_head, meta["head_source"] = shown_head(model, L_head, picked)
    meta["head"] = f"L{L_head[0]}H{L_head[1]}"
    tables["attention"], tables["head_types"], tables["head_scores"] = _attention_section(model, prompt, L_head,
                                                                                          positions)
    tables["top_heads"] = _top_heads(ranked.head(top_heads), tables["attention"], tables["head_types"])
    tables["head_patterns"] = _head_patterns(model, prompt, picked)
    meta["pattern_window"] = PATTERN_WINDOW
    lap("attention")
    # 4. FFN neurons
    tables["neurons"], tables["neuron_values"], tables["neuron_contexts"], meta["key_corpus"] = _ffn_section(
        model, dla, ffn_layer, top_neurons, value_tokens, key_contexts, key_max_tokens, corpus, dla_t, key_prompts,
        key_prompts_name)
    meta["key_max_tokens"] = key_max_tokens
    lap("ffn")
    # 8. output and sampling
    p_all = logits.softmax(-1)
    lp_all = logits.log_softmax(-1)
    tv, ti = p_all.topk(min(top_k, p_all.numel()))
    tables["final_topk"] = pd.DataFrame({"rank": range(1, len(tv) + 1), "token": token_texts(model, ti.tolist()),
                                         "token_id": ti.tolist(), "prob": tv.numpy(), "log_prob": lp_all[ti].numpy(),
                                         "logit": logits[ti].numpy()})
    meta["final_topk_mass"] = float(tv.sum())
    meta["final_target_rank"] = int((p_all > p_all[target_id]).sum()) + 1
    tables["sampling"] = _sampling(model, logits, target_id, seed, n_samples)
    lap("output")
    # 9. cost
    tables["params"], tables["kv_cache"], meta["cost"] = _cost(model, len(ids), _device_name(model))
    lap("cost")
    meta["timings_s"] = timings
    return TraceTables(_renamed(tables), meta)


# ---------------------------------------------------------------------------------------------
# report rendering (from tables + meta only, so a loaded result renders the same report)


def fig_to_data_uri(fig) -> str:
    """A matplotlib figure as an inline ``data:image/png;base64,...`` URI (closes the figure)."""
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    try:
        fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    finally:
        plt.close(fig)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _fmt(v, col: str = "") -> str:
    """A cell: floats to 4 significant digits; counts (parameters, bytes) with thousands separators;
    ids, positions and ranks as plain integers."""
    if v is None or (isinstance(v, float) and np.isnan(v)):
        return ""
    big = "bytes" in col or "parameters" in col or "tokens" in col
    if isinstance(v, (float, np.floating)):
        return f"{float(v):,.0f}" if big and abs(float(v)) >= 1e4 else f"{float(v):.4g}"
    if isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_)):
        return f"{int(v):,}" if big else str(int(v))
    return str(v)


#: Report table columns holding one token's text (shown with :func:`tracekit.tokens.show_token`).
_TOKEN_COLUMNS = ("token", "key_token", "query_token", "top1", "expected", "top_key_token")


def table_rows(df: pd.DataFrame, max_rows: int = 60) -> tuple[list[str], list[list[str]]]:
    """Column names and formatted cells; token columns through :func:`tracekit.tokens.show_token`
    (the one display of a token: ``repr`` so spaces are visible, a piece of a character as its bytes)."""
    cols = list(df.columns)
    rows = []
    for rec in df.head(max_rows).itertuples(index=False):
        rows.append([show_token(v) if isinstance(v, str) and c in _TOKEN_COLUMNS else _fmt(v, c)
                     for c, v in zip(cols, rec)])
    return cols, rows


def _md_code(s) -> str:
    """Inline Markdown code for any text: a backtick fence longer than any backtick run inside."""
    s = str(s)
    run = max((len(m) for m in re.findall(r"`+", s)), default=0)
    fence = "`" * (run + 1)
    pad = " " if s.startswith("`") or s.endswith("`") else ""
    return f"{fence}{pad}{s}{pad}{fence}"


def _env(html: bool = True):
    """Jinja environment: HTML escaped for the HTML report; Markdown is text (never HTML-escaped).
    ``pyrepr`` shows a string with its quotes and spaces (:func:`tracekit.tokens.show_token`: a
    piece of a character as its bytes), Unicode as it is (unlike ``tojson``'s
    ``\u4e2d`` escapes); ``mdcode`` makes Markdown inline code of any text."""
    import jinja2

    env = jinja2.Environment(loader=jinja2.PackageLoader("tracekit", "templates"), autoescape=html,
                             trim_blocks=True, lstrip_blocks=True)
    env.filters["pyrepr"] = show_token
    env.filters["mdcode"] = _md_code
    return env


def render_html(context: dict) -> str:
    """The self-contained HTML report (figures inline, no external resource)."""
    return _env(html=True).get_template("trace.html.j2").render(**context)


def render_markdown(context: dict) -> str:
    """The Markdown version of the report (figures referenced as the PNG files saved beside it)."""
    return _env(html=False).get_template("trace.md.j2").render(**context)


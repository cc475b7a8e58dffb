"""Logit lens: the next-token distribution each layer's residual stream would give.

Method (nostalgebraist, "interpreting GPT: the logit lens", 2020; tuned-lens' ``LogitLens`` in
``tuned_lens/nn/lenses.py``): take the residual stream after (or before) each block, apply the
model's final norm -- *recomputed* for that vector -- and the unembedding, and read off a
distribution over the vocabulary. It answers "at which layer does ' Paris' appear?".

Layer conventions (``layers:``; the table's ``hook`` column names the hook read for each row):

* ``hidden_states`` (default, Hugging Face ``output_hidden_states`` numbering): layer 0 is the
  embedding output (``blocks.0.hook_resid_pre``), layer ``L >= 1`` is the output of block
  ``L-1`` (``blocks.{L-1}.hook_resid_post``); ``n_layers + 1`` rows, the last equals the model's
  own output distribution;
* ``resid_post``: layer ``L`` is the output of block ``L`` (``blocks.{L}.hook_resid_post``);
  the last equals the model's output;
* ``resid_pre``: layer ``L`` is the input of block ``L`` (``blocks.{L}.hook_resid_pre``).

Units: ``prob`` is a probability in [0, 1]; ``log_prob`` natural log; ``rank`` is 1 for the
top token (1 + the number of tokens with a strictly larger probability); ``entropy`` in nats.
"""

from __future__ import annotations

from typing import Literal, Optional, Union

import numpy as np
import pandas as pd
import torch
from pydantic import Field
from tqdm.auto import tqdm

from ..readout import Readout
from ..tokens import TokenizationError, chunks, encode, single_token_id, str_tokens, tokenize, run_with_cache
from .base import Experiment, Prompts, Result, register

__all__ = ["LogitLens", "LogitLensResult", "lens_hooks", "emergence_layer"]

LayerConvention = Literal["hidden_states", "resid_post", "resid_pre"]


def lens_hooks(n_layers: int, convention: str) -> list[tuple[int, str]]:
    """(layer label, hook name) pairs read by a layer convention, in order."""
    if convention == "hidden_states":
        return [(0, "blocks.0.hook_resid_pre")] + [
            (L + 1, f"blocks.{L}.hook_resid_post") for L in range(n_layers)
        ]
    if convention == "resid_post":
        return [(L, f"blocks.{L}.hook_resid_post") for L in range(n_layers)]
    if convention == "resid_pre":
        return [(L, f"blocks.{L}.hook_resid_pre") for L in range(n_layers)]
    raise ValueError(f"layers: unknown convention {convention!r}; use hidden_states, resid_post or resid_pre")


def emergence_layer(layers: list[int], ranks: list[int]) -> Optional[int]:
    """First layer from which the target stays top-1 through the last layer (None if never)."""
    out = None
    for L, r in zip(reversed(layers), reversed(ranks)):
        if r == 1:
            out = L
        else:
            break
    return out


class LogitLensResult(Result):
    """Tables: ``main`` (one row per prompt x position x layer x target; without targets one row per
    prompt x position x layer), ``topk`` (prompt x position x layer x k), ``tokens`` (the
    tokenization of every prompt), ``final`` (the model's own output distribution's top-k and
    targets at each read position)."""

    main_table = "main"

    # ---- summary -------------------------------------------------------------------------
    def _last_rows(self) -> pd.DataFrame:
        df = self.tables["main"]
        return df[df["is_last"]]

    def summary(self) -> dict:
        df = self._last_rows()
        cfg = self.config
        out: dict = {
            "layer_convention": cfg.layers,
            "layers": sorted(df["layer"].unique().tolist()),
            "hooks": df.drop_duplicates("layer").sort_values("layer")["hook"].tolist(),
            "n_prompts": int(df["prompt_idx"].nunique()),
        }
        first = df[df["prompt_idx"] == 0].drop_duplicates("layer").sort_values("layer")
        out["top1_by_layer"] = first["top1"].tolist()
        out["top1_prob_by_layer"] = first["top1_prob"].round(6).tolist()
        out["entropy_by_layer"] = first["entropy"].round(6).tolist()
        fin = self.tables["final"]
        fin = fin[fin["is_last"]]
        out["final_top1"] = fin[fin["prompt_idx"] == 0]["top1"].iloc[0]
        if "target" not in df.columns or df["target"].isna().all():
            return out
        targets = [t for t in df["target"].dropna().unique().tolist()]
        out["targets"] = targets
        per_prompt = []
        for (pi, tgt), g in df.groupby(["prompt_idx", "target"], sort=True):
            g = g.sort_values("layer")
            f = fin[(fin["prompt_idx"] == pi)]
            per_prompt.append({
                "prompt_idx": int(pi),
                "target": tgt,
                "target_prob_final": float(f[f["target"] == tgt]["target_prob"].iloc[0]),
                "target_prob_by_layer": g["prob"].round(6).tolist(),
                "target_rank_by_layer": g["rank"].astype(int).tolist(),
                "target_logprob_by_layer": g["log_prob"].round(5).tolist(),
                "emergence_layer": emergence_layer(g["layer"].tolist(), g["rank"].astype(int).tolist()),
            })
        head = [p for p in per_prompt if p["target"] == targets[0]]
        if len(head) == 1:
            out.update({k: v for k, v in head[0].items() if k not in ("prompt_idx",)})
        else:
            out["target"] = targets[0]
            out["target_prob_final"] = float(np.mean([p["target_prob_final"] for p in head]))
            out["target_prob_by_layer"] = np.mean([p["target_prob_by_layer"] for p in head], 0).round(6).tolist()
            out["target_rank_by_layer"] = np.median([p["target_rank_by_layer"] for p in head], 0).tolist()
            out["emergence_layer_by_prompt"] = [p["emergence_layer"] for p in head]
            out["emergence_layer"] = None if any(p["emergence_layer"] is None for p in head) else max(
                p["emergence_layer"] for p in head)
        if len(per_prompt) > 1:
            out["per_prompt"] = per_prompt
        if len(head) == 1:
            probs = head[0]["target_prob_by_layer"]
            jumps = np.diff(probs)
            j = int(np.argmax(jumps)) if len(jumps) else 0
            layers = out["layers"]
            out["largest_jump"] = {"from_layer": layers[j], "to_layer": layers[j + 1] if len(layers) > 1 else layers[j],
                                   "from_prob": probs[j], "to_prob": probs[j + 1] if len(probs) > 1 else probs[j]}
        return out

    def report(self) -> str:
        """Per-layer table of the first prompt's last position (and target, if any)."""
        df = self._last_rows()
        df = df[df["prompt_idx"] == 0]
        has_t = "target" in df.columns and df["target"].notna().any()
        if has_t:
            df = df[df["target"] == df["target"].dropna().iloc[0]]
        df = df.sort_values("layer")
        lines = [f"logit lens [{self.config.step_name}] layers={self.config.layers} prompt 0: "
                 f"{df['prompt'].iloc[0]!r}"]
        head = f"{'layer':>5} {'hook':28s} {'top-1':>14} {'p(top-1)':>9}"
        if has_t:
            head += f" {'p(' + repr(df['target'].iloc[0]) + ')':>12} {'rank':>7}"
        lines.append(head)
        for r in df.itertuples():
            line = f"{r.layer:>5} {r.hook:28s} {r.top1!r:>14} {r.top1_prob:9.4f}"
            if has_t:
                line += f" {r.prob:12.4%} {r.rank:>7}"
            lines.append(line)
        fin = self.tables["final"]
        fin = fin[(fin["prompt_idx"] == 0) & fin["is_last"]]
        line = f"model output top-1: {fin['top1'].iloc[0]!r} ({fin['top1_prob'].iloc[0]:.4%})"
        if has_t:
            fin = fin[fin["target"] == df["target"].iloc[0]]
            em = emergence_layer(df["layer"].tolist(), df["rank"].astype(int).tolist())
            line += f"; p({df['target'].iloc[0]!r}) = {fin['target_prob'].iloc[0]:.4%}; emergence layer: {em}"
        lines.append(line)
        return "\n".join(lines)

    # ---- figures -------------------------------------------------------------------------
    def figures(self) -> dict:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt

        figs = {}
        df = self._last_rows()
        conv = self.config.layers
        if "target" in df.columns and df["target"].notna().any():
            fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
            for (pi, tgt), g in df.groupby(["prompt_idx", "target"]):
                g = g.sort_values("layer")
                lab = f"{tgt!r}" + (f" (prompt {pi})" if df["prompt_idx"].nunique() > 1 else "")
                a1.plot(g["layer"], g["prob"], marker="o", ms=3, label=lab)
                a2.plot(g["layer"], g["rank"], marker="o", ms=3, label=lab)
            a1.set_xlabel(f"layer ({conv})"); a1.set_ylabel("target probability")
            a1.set_title("Logit lens: target probability by layer"); a1.set_ylim(-0.02, 1.02)
            a2.set_yscale("log"); a2.invert_yaxis(); a2.set_xlabel(f"layer ({conv})")
            a2.set_ylabel("target rank (1 = top)"); a2.set_title("target rank (log scale)")
            a1.legend(fontsize=7); a1.grid(alpha=.3); a2.grid(alpha=.3)
            fig.tight_layout()
            figs["target_by_layer"] = fig

        m = self.tables["main"]
        m0 = m[m["prompt_idx"] == 0]
        if "target" in m0.columns and m0["target"].notna().any():
            m0 = m0[m0["target"] == m0["target"].dropna().iloc[0]]
        pos = sorted(m0["position"].unique().tolist())
        layers = sorted(m0["layer"].unique().tolist())
        grid = np.zeros((len(layers), len(pos)))
        labels = [["" for _ in pos] for _ in layers]
        li = {L: i for i, L in enumerate(layers)}
        pj = {p: j for j, p in enumerate(pos)}
        for r in m0.itertuples():
            grid[li[r.layer], pj[r.position]] = r.top1_prob
            labels[li[r.layer]][pj[r.position]] = r.top1
        toks = self.tables["tokens"]
        toks0 = toks[toks["prompt_idx"] == 0].set_index("position")["token"]
        fig, ax = plt.subplots(figsize=(max(4, 1.1 * len(pos) + 2), max(3, 0.28 * len(layers) + 1.5)))
        im = ax.imshow(grid, aspect="auto", origin="lower", cmap="Blues", vmin=0, vmax=1)
        for i in range(len(layers)):
            for j in range(len(pos)):
                ax.text(j, i, labels[i][j][:10], ha="center", va="center", fontsize=6,
                        color="white" if grid[i, j] > 0.6 else "black")
        ax.set_xticks(range(len(pos)), [repr(toks0.get(p, "?"))[1:-1][:12] for p in pos], rotation=60, fontsize=7)
        ax.set_yticks(range(len(layers)), layers, fontsize=6)
        ax.set_xlabel("input token (position)"); ax.set_ylabel(f"layer ({conv})")
        ax.set_title("Logit lens: top-1 next token (colour = its probability)")
        fig.colorbar(im, ax=ax, fraction=0.03)
        fig.tight_layout()
        figs["top1_grid"] = fig
        return figs


@register
class LogitLens(Experiment):
    """Logit lens over prompts: per layer, target probability / log-prob / rank, entropy, top-k.

    Fields:
        prompts: one string or a list (batched with padding; each prompt's last real token is read).
        target: a token string or list of them (each exactly one token, leading space included),
            tracked at every read position; optional.
        positions: ``last`` (each prompt's last real token) or ``all`` (the classic grid picture).
        layers: layer convention, see the module docstring.
        top_k: number of top tokens kept per row.
        batch_size: prompts per forward pass.

    Raises (from :meth:`check`/:meth:`run`):
        TokenizationError: a target is not exactly one token (the message shows its tokenization).
    """

    kind: Literal["logit_lens"] = "logit_lens"
    prompts: Prompts
    target: Optional[Union[str, list[str]]] = None
    positions: Literal["last", "all"] = "last"
    layers: LayerConvention = "hidden_states"
    top_k: int = Field(default=10, ge=1, le=1000)
    batch_size: int = Field(default=8, ge=1)

    result_class = LogitLensResult

    @property
    def targets(self) -> list[str]:
        if self.target is None:
            return []
        return [self.target] if isinstance(self.target, str) else list(self.target)

    def check(self, model) -> None:
        for i, p in enumerate(self.prompts):
            if not encode(model, p):
                raise TokenizationError(f"prompts[{i}]: {p!r} tokenizes to nothing; give a non-empty prompt "
                                        "(or set model.prepend_bos: true)")
        for j, t in enumerate(self.targets):
            single_token_id(model, t, field="target" if isinstance(self.target, str) else f"target[{j}]")

    @torch.no_grad()
    def _run(self, model, progress: bool = True) -> LogitLensResult:
        readout = Readout(model)
        n_layers = model.cfg.n_layers
        hooks = lens_hooks(n_layers, self.layers)
        hook_names = [h for _, h in hooks]
        tgt_ids = [single_token_id(model, t) for t in self.targets]
        k = min(self.top_k, model.cfg.d_vocab)

        main_rows, topk_rows, tok_rows, final_rows = [], [], [], []
        bar = tqdm(total=len(self.prompts), desc="logit lens", disable=not progress, leave=False)
        for sl in chunks(len(self.prompts), self.batch_size):
            prompts = self.prompts[sl]
            batch = tokenize(model, prompts)
            logits, cache = run_with_cache(model, batch, hook_names)
            resid = torch.stack([cache[h] for h in hook_names])  # [L, b, pos, d]
            for b, prompt in enumerate(prompts):
                pi = sl.start + b
                idx = batch.real_index(b)
                toks = str_tokens(model, batch.ids[b])
                for p, t in enumerate(toks):
                    tok_rows.append({"prompt_idx": pi, "position": p, "token": t, "token_id": batch.ids[b][p]})
                read = idx[-1:] if self.positions == "last" else idx
                positions = [len(idx) - 1] if self.positions == "last" else list(range(len(idx)))
                lp = readout.log_probs(resid[:, b, read])  # [L, P, vocab]
                final_lp = torch.log_softmax(logits[b, read].float(), -1)  # [P, vocab]
                self._rows(model, pi, prompt, positions, toks, hooks, lp, final_lp, tgt_ids, k,
                           main_rows, topk_rows, final_rows, n_real=len(idx))
            bar.update(len(prompts))
            del cache, resid, logits
        bar.close()
        tables = {
            "main": pd.DataFrame(main_rows),
            "topk": pd.DataFrame(topk_rows),
            "tokens": pd.DataFrame(tok_rows),
            "final": pd.DataFrame(final_rows),
        }
        meta = {"n_layers": n_layers, "hooks": hook_names, "d_vocab": int(model.cfg.d_vocab)}
        return LogitLensResult(self, tables, meta)

    def _rows(self, model, pi, prompt, positions, toks, hooks, lp, final_lp, tgt_ids, k,
              main_rows, topk_rows, final_rows, n_real):
        probs = lp.exp()
        ent = -(probs * lp).sum(-1)  # [L, P]
        top_p, top_i = probs.topk(k, dim=-1)  # [L, P, k]
        tok = model.tokenizer
        decode = {int(i): tok.decode([int(i)]) for i in top_i.unique().tolist()}
        if tgt_ids:
            t = torch.tensor(tgt_ids, device=lp.device)
            t_lp = lp[..., t]  # [L, P, T]
            t_rank = (lp.unsqueeze(-1) > t_lp.unsqueeze(-2)).sum(-2) + 1  # [L, P, T]
        for li, (L, hook) in enumerate(hooks):
            for pj, p in enumerate(positions):
                base = {
                    "prompt_idx": pi, "prompt": prompt, "position": p, "token": toks[p],
                    "is_last": p == n_real - 1, "layer": L, "hook": hook,
                    "entropy": float(ent[li, pj]), "top1": decode[int(top_i[li, pj, 0])],
                    "top1_id": int(top_i[li, pj, 0]), "top1_prob": float(top_p[li, pj, 0]),
                }
                if tgt_ids:
                    for ti, (tname, tid) in enumerate(zip(self.targets, tgt_ids)):
                        main_rows.append({**base, "target": tname, "target_id": tid,
                                          "prob": float(t_lp[li, pj, ti].exp()),
                                          "log_prob": float(t_lp[li, pj, ti]),
                                          "rank": int(t_rank[li, pj, ti])})
                else:
                    main_rows.append({**base, "target": None})
                for r in range(k):
                    topk_rows.append({"prompt_idx": pi, "position": p, "layer": L, "k": r + 1,
                                      "token": decode[int(top_i[li, pj, r])], "token_id": int(top_i[li, pj, r]),
                                      "prob": float(top_p[li, pj, r])})
        fprobs = final_lp.exp()
        f_p, f_i = fprobs.topk(min(k, fprobs.shape[-1]), -1)
        for pj, p in enumerate(positions):
            row = {"prompt_idx": pi, "position": p, "is_last": p == n_real - 1, "top1": tok.decode([int(f_i[pj, 0])]),
                   "top1_prob": float(f_p[pj, 0]),
                   "topk_tokens": [tok.decode([int(i)]) for i in f_i[pj].tolist()],
                   "topk_probs": [float(x) for x in f_p[pj].tolist()]}
            if tgt_ids:
                for tname, tid in zip(self.targets, tgt_ids):
                    final_rows.append({**row, "target": tname, "target_prob": float(fprobs[pj, tid])})
            else:
                final_rows.append({**row, "target": None, "target_prob": float("nan")})

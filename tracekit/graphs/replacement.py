"""The local replacement model of one prompt: the model made linear in its source nodes.

For a prompt, circuit tracing (Ameisen et al. 2025, "Circuit Tracing", methods; circuit-tracer
``circuit_tracer/replacement_model.py``) freezes everything nonlinear at the values of the clean run
and replaces each MLP by a transcoder plus an error term:

* **attention patterns** frozen: ``blocks.L.attn.hook_pattern`` returns the clean pattern (detached),
  so attention is the linear map ``z = pattern @ v`` of its values;
* **every normalisation's scale** frozen, measured rather than assumed: each norm between the
  residual stream and a reader (``ln1``, ``ln2``, the post-norms ``ln1_post`` / ``ln2_post`` of
  Gemma 2/3-style sandwich blocks, ``ln_final``) has the affine form ``y = w * centre(x) / sigma + b``
  (:func:`tracekit.model.norms.measure_norm` asks the module); its output hook returns
  ``y_clean + J (x - x_clean)`` with ``J v = w * centre(v) / sigma_run`` and ``sigma_run`` the
  clean run's scale (:func:`tracekit.model.norms.run_sigma`). In the clean run the values are the
  model's own bits; the gradient is ``J``; on any other input it is the frozen-scale norm. This is the
  generic form of circuit-tracer's stop-gradient on ``hook_scale``: it works whether or not a family's
  norm fires ``hook_scale``;
* **each MLP** replaced, at the dictionary's output hook (``blocks.L.hook_mlp_out``: on post-norm
  blocks the bridge puts it *after* the post-feedforward norm, so the transcoder predicts the
  normed output; ``blocks.L.mlp.hook_out``: before it, the post-norm then frozen), by
  ``sum_f a_f W_dec[f] + b_dec + W_skip x + error``: the features' writes (source nodes), the decoder
  bias (a constant), a skip transcoder's skip term (a linear path from the MLP input) and the error
  vector ``error = hook_out(clean) - transcoder(x_clean)`` (a constant: an error node);
* **the logits**: logit nodes read the pre-transform logit (``unembed(ln_final(resid))``, before a
  final soft-cap such as Gemma 2's ``cap * tanh(x / cap)``; a linear output multiplier is also not
  applied), minus its mean over the vocabulary: circuit-tracer's demeaned unembedding.

Source nodes and their vectors: feature ``(L, p, f)`` writes ``a_f W_dec[f]`` at position ``p`` of
layer ``L``'s output hook; error node ``(L, p)`` writes ``error[L, p]`` there; token node ``p`` writes
the value of ``hook_embed`` at ``p`` (the token embedding, after any embedding multiplier; learned
positional embeddings are a constant). A target reads: a feature's pre-activation
``x_L[p] @ W_enc[:, f] + b_enc[f]`` (``x_L`` the dictionary's input hook), a logit node the demeaned
pre-transform logit at the last position. Under the freezes every target is an affine function of
the source writes, so ``target = sum_s A[t, s] + bias_t`` exactly (:meth:`LocalReplacementModel.run`
computes both sides).

Supported dictionary hooks (a transcoder per block, every block covered): input
``blocks.L.mlp.hook_in`` (the MLP's input, after ``ln2``), ``blocks.L.ln2.hook_out`` (the same
tensor), ``blocks.L.ln2.hook_normalized`` (only where it equals the MLP's input in the clean run: a
processed model whose norm weights are folded) or ``blocks.L.hook_resid_mid`` (the residual before ``ln2``; linear as it is); output
``blocks.L.hook_mlp_out`` or ``blocks.L.mlp.hook_out``. Other pairs, gated dictionaries, blocks
without a dictionary and norms that are not of the affine form are refused by name
(:class:`tracekit.errors.MethodRefused`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from jaxtyping import Float, Int

from ..core.errors import MethodRefused
from ..dictionaries.dictionary import Dictionary, DictionarySet
from ..hooks import fwd_hooks
from ..model.info import HookedModel
from ..model.norms import AffineNorm, measure_norm, run_sigma

__all__ = ["LocalReplacementModel", "ActiveFeatures", "NormSite", "ReplacementRun", "INPUT_SITES", "OUTPUT_SITES"]

#: Dictionary input hooks (suffixes after ``blocks.L.``) the replacement model reads, and the hook it
#: reads each at (the same tensor, in the linearised graph).
INPUT_SITES = {"mlp.hook_in": "mlp.hook_in", "ln2.hook_out": "mlp.hook_in", "hook_resid_mid": "ln2.hook_in",
               "ln2.hook_in": "ln2.hook_in", "ln2.hook_normalized": "mlp.hook_in"}
#: Input hooks read at another hook only when the two hold the same tensor in the clean run (checked).
_SAME_AS_READ = ("ln2.hook_normalized",)
#: Dictionary output hooks (suffixes) the replacement model replaces.
OUTPUT_SITES = ("hook_mlp_out", "mlp.hook_out")


def _is_norm(module) -> bool:
    name = type(module).__name__.lower()
    return "norm" in name and hasattr(module, "hook_in") and hasattr(module, "hook_out")


@dataclass
class NormSite:
    """One normalisation frozen at its clean-run scale.

    Attributes:
        name: module path (``blocks.0.ln1``, ``ln_final``); its hooks are ``name.hook_in`` / ``name.hook_out``.
        norm: the measured affine form.
        x_clean: ``[1, pos, d]`` its clean input. y_clean: ``[1, pos, d]`` its clean output.
        sigma: ``[1, pos, 1]`` the clean run's scale (float32).
    """

    name: str
    norm: AffineNorm
    x_clean: torch.Tensor = field(repr=False)
    y_clean: torch.Tensor = field(repr=False)
    sigma: torch.Tensor = field(repr=False)

    def linear(self, v: Float[torch.Tensor, "... pos d"]) -> Float[torch.Tensor, "... pos d"]:
        """``J v = w * centre(v) / sigma`` (the frozen-scale norm without its bias), in ``v``'s dtype."""
        w = self.norm.weight.to(v.device)
        return (w * self.norm.centre(v.float()) / self.sigma.to(v.device)).to(v.dtype)

    def frozen(self, x: Float[torch.Tensor, "batch pos d"]) -> Float[torch.Tensor, "batch pos d"]:
        """``y_clean + J (x - x_clean)``: the clean output in the clean run, the frozen norm elsewhere."""
        return self.y_clean.to(x.dtype) + self.linear(x - self.x_clean.to(x.dtype))


@dataclass
class ActiveFeatures:
    """The active features of one layer in the clean run (sorted by position, then feature).

    Attributes:
        pos: ``[n]`` positions. feat: ``[n]`` feature indices. acts: ``[n]`` activations (float32).
        pre: ``[n]`` pre-activations (float32).
    """

    pos: torch.Tensor
    feat: torch.Tensor
    acts: torch.Tensor
    pre: torch.Tensor

    def pre_of(self, d: Dictionary, x: Float[torch.Tensor, "batch pos d_in"]) -> Float[torch.Tensor, "batch n"]:
        """These features' pre-activations on input ``x`` (float32, differentiable in ``x``)."""
        xs = x[:, self.pos, :].to(d.W_enc.dtype)
        if d.apply_b_dec_to_input:
            xs = xs - d.b_dec.detach()
        return ((xs * d.W_enc.detach().T[self.feat]).sum(-1) + d.b_enc.detach()[self.feat]).float()


@dataclass
class ReplacementRun:
    """What one forward pass of the local replacement model returns.

    Attributes:
        logits: ``[batch, pos, d_vocab]`` the model's output logits (after its output transform);
            None when the run stopped at the final norm.
        pre_logits: ``[batch, d_vocab]`` pre-transform logits at the last position (``[batch, 0]`` in a
            run with gradients).
        reads: ``layer -> [batch, pos, d_in]`` each dictionary's input (in the autograd graph when
            the run has gradients).
        final: ``[batch, pos, d_model]`` the final norm's output (in the graph likewise).
        leaves: ``layer -> [batch, pos, d_out]`` zero tensors added at each output hook, and
            ``"tokens"`` at ``hook_embed`` (only with ``grad=True``): the gradient with respect to a
            leaf is the gradient with respect to that write.
    """

    logits: Optional[torch.Tensor]
    pre_logits: torch.Tensor
    reads: dict[int, torch.Tensor]
    final: torch.Tensor
    leaves: dict[Any, torch.Tensor]


class LocalReplacementModel:
    """The local replacement model of one prompt (module docstring).

    Args:
        model: a hooked model (TransformerBridge, TransformerLens 3.9 or 4).
        dictionaries: one transcoder per block (``blocks.L.mlp.hook_in`` -> ``blocks.L.hook_mlp_out``).
        token_ids: ``[pos]`` the prompt's token ids (BOS included when the model prepends one).

    Attributes (clean run, detached, batch 1 unless said):
        layers: blocks, ascending. read_hooks / write_hooks: ``layer -> hook``.
        norms: the frozen :class:`NormSite` s. patterns: ``layer -> [1, heads, pos, pos]``.
        x_in: ``layer -> [1, pos, d_in]`` dictionary inputs. out_true: ``layer -> [1, pos, d_out]``.
        active: ``layer -> ActiveFeatures`` the active features (positions, indices, activations, pre-activations).
        errors: ``[n_layers, pos, d_out]`` error vectors. embed: ``[pos, d_model]`` ``hook_embed`` values.
        logits: ``[1, pos, d_vocab]`` the model's logits. pre_logits: ``[d_vocab]`` last position, pre-transform.

    Raises:
        MethodRefused: a block without a dictionary, an unsupported hook pair or activation, a norm
            that is not affine, a block whose attention pattern or norm hooks do not fire.
    """

    def __init__(self, model: HookedModel, dictionaries: DictionarySet, token_ids: Int[torch.Tensor, " pos"]):
        self.model: Any = model  # a loaded bridge: its blocks, ln_final, unembed and hooks are read
        self.dictionaries = dictionaries
        cfg = model.cfg
        self.n_layers = int(cfg.n_layers)
        dev = next(iter(self.model.parameters())).device
        self.device = dev
        self.arch = str(getattr(cfg, "original_architecture", None) or getattr(cfg, "architecture", None)
                        or type(model).__name__)
        self.tokens = torch.as_tensor(token_ids, dtype=torch.long).reshape(1, -1).to(dev)
        self.n_pos = int(self.tokens.shape[1])
        self._check_dictionaries()
        self.norms: list[NormSite] = []
        self._norm_modules = self._find_norms()
        self._clean_run()

    # -- validation -------------------------------------------------------------------------
    def _check_dictionaries(self) -> None:
        missing = [L for L in range(self.n_layers) if L not in self.dictionaries.dictionaries]
        if missing:
            raise MethodRefused(
                f"attribution graph: the local replacement model replaces every MLP; blocks {missing} have no "
                f"transcoder in the dictionary set (layers {self.dictionaries.layers}). Give one transcoder per block.")
        self.read_hooks: dict[int, str] = {}
        self.write_hooks: dict[int, str] = {}
        self.dicts: dict[int, Dictionary] = {}
        self._same_checks: list[tuple[int, str, str]] = []
        for L in range(self.n_layers):
            d = self.dictionaries[L]
            pre = f"blocks.{L}."
            sin = d.hook_in[len(pre):] if d.hook_in.startswith(pre) else None
            sout = d.hook_out[len(pre):] if d.hook_out.startswith(pre) else None
            if sin not in INPUT_SITES or sout not in OUTPUT_SITES:
                raise MethodRefused(
                    f"attribution graph: transcoder of layer {L} reads {d.hook_in!r} and writes {d.hook_out!r}; the "
                    f"local replacement model supports inputs {[pre + s for s in INPUT_SITES]} and outputs "
                    f"{[pre + s for s in OUTPUT_SITES]} (a per-block MLP transcoder).")
            if d.activation == "gated":
                raise MethodRefused(f"attribution graph: transcoder of layer {L} is gated; a gated dictionary's "
                                    "activation is not a function of the pre-activation the graph attributes "
                                    "(use relu, topk or jumprelu transcoders).")
            if d.d_out != int(self.model.cfg.d_model):
                raise MethodRefused(f"attribution graph: transcoder of layer {L} writes width {d.d_out}, the "
                                    f"residual stream has {int(self.model.cfg.d_model)}.")
            for hk in (pre + INPUT_SITES[sin], pre + sout):
                if hk not in self.model.hook_dict:
                    raise MethodRefused(f"attribution graph: hook {hk!r} does not exist on this model "
                                        f"(transcoder of layer {L}).")
            self.read_hooks[L] = pre + INPUT_SITES[sin]
            self.write_hooks[L] = pre + sout
            if sin in _SAME_AS_READ:
                self._same_checks.append((L, d.hook_in, self.read_hooks[L]))
            self.dicts[L] = d

    def _find_norms(self) -> list[tuple[str, Any]]:
        out = []
        for L, blk in enumerate(self.model.blocks):
            for name, child in blk.named_children():
                if _is_norm(child):
                    out.append((f"blocks.{L}.{name}", child))
        out.append(("ln_final", self.model.ln_final))
        return out

    # -- the clean run ----------------------------------------------------------------------
    @torch.no_grad()
    def _clean_run(self) -> None:
        cache: dict[str, torch.Tensor] = {}

        def save(act, hook, name):
            cache[name] = act.detach()
            return act

        names = [f"{n}.hook_{io}" for n, _ in self._norm_modules for io in ("in", "out")]
        names += [f"blocks.{L}.attn.hook_pattern" for L in range(self.n_layers)]
        names += list(self.read_hooks.values()) + list(self.write_hooks.values()) + ["hook_embed"]
        names += [h for _, h, _ in self._same_checks]
        names = list(dict.fromkeys(names))
        hooks = [(n, _partial(save, name=n)) for n in names if n in self.model.hook_dict]
        with fwd_hooks(self.model, hooks):
            logits = self.model(self.tokens)
        self.logits = logits.detach()
        for n, mod in self._norm_modules:
            xi, xo = cache.get(f"{n}.hook_in"), cache.get(f"{n}.hook_out")
            if xi is None or xo is None:
                raise MethodRefused(f"attribution graph: the norm {n} did not fire its hook_in/hook_out, so its "
                                    f"scale cannot be frozen; {self.arch} is not supported.")
            d = int(xi.shape[-1])
            norm = measure_norm(mod, d)
            if not norm.exact:
                raise MethodRefused(f"attribution graph: the norm {n} is not of the form w * centre(x) / sigma + b "
                                    f"(max deviation {norm.max_error:.3g}); its scale cannot be frozen exactly.")
            sigma = run_sigma(norm, xi, xo).unsqueeze(-1)
            site = NormSite(n, norm, xi, xo, sigma)
            # the frozen map must give the module's own output: J x_clean + b == y_clean
            recon = site.linear(xi.float()) + norm.bias.to(xi.device)
            err = float((recon - xo.float()).abs().max())
            tol = (1e-4 if xo.dtype == torch.float32 else 2e-2) * max(1.0, float(xo.float().abs().max()))
            if err > tol:
                raise MethodRefused(f"attribution graph: the frozen norm {n} does not give its own output on the "
                                    f"clean run (max error {err:.3g} > {tol:.3g}); its scale cannot be frozen exactly.")
            self.norms.append(site)
        self.patterns: dict[int, torch.Tensor] = {}
        for L in range(self.n_layers):
            p = cache.get(f"blocks.{L}.attn.hook_pattern")
            if p is None:
                raise MethodRefused(f"attribution graph: block {L}'s attention pattern (blocks.{L}.attn.hook_pattern) "
                                    f"does not fire, so it cannot be frozen; {self.arch} is not supported.")
            self.patterns[L] = p
        if "hook_embed" not in cache:
            raise MethodRefused("attribution graph: hook_embed does not fire; the token nodes cannot be read.")
        self.embed = cache["hook_embed"][0]
        for L in range(self.n_layers):
            for hk in (self.read_hooks[L], self.write_hooks[L]):
                if hk not in cache:
                    raise MethodRefused(f"attribution graph: hook {hk!r} does not fire on this model, so the "
                                        f"transcoder of layer {L} cannot be attached; {self.arch} is not supported.")
        for L, h, r in self._same_checks:
            if h not in cache or not torch.equal(cache[h], cache[r]):
                raise MethodRefused(f"attribution graph: transcoder of layer {L} reads {h!r}, which on {self.arch} is "
                                    f"not the MLP's input {r!r} (it is not linear in the residual stream under "
                                    f"the frozen norm scale); train the transcoders on {r!r}.")
        self._check_patterns_used()
        self.x_in: dict[int, torch.Tensor] = {}
        self.out_true: dict[int, torch.Tensor] = {}
        self.active: dict[int, ActiveFeatures] = {}
        errs = []
        for L in range(self.n_layers):
            d = self.dicts[L]
            x, y = cache[self.read_hooks[L]], cache[self.write_hooks[L]]
            self.x_in[L], self.out_true[L] = x, y
            pre = d.pre_acts(x[0])
            acts = d.activate(pre, x[0])
            pos, feat = torch.nonzero(acts, as_tuple=True)  # row-major: sorted by position, then feature
            self.active[L] = ActiveFeatures(pos, feat, acts[pos, feat].float(), pre[pos, feat].float())
            pred = d.decode(acts) + d.skip_out(x[0])
            errs.append((y[0].to(pred.dtype) - pred).float())
            del pre, acts
        self.errors = torch.stack(errs)
        final = next(s for s in self.norms if s.name == "ln_final")
        self.final_clean = final.y_clean
        self.pre_logits = self.model.unembed(final.y_clean)[0, -1].float()

    @torch.no_grad()
    def _check_patterns_used(self) -> None:
        """A probe pass with every attention pattern zeroed: each block's ``attn.hook_z`` must then be
        zero (the forward pass uses the hooked pattern; some bridges only report it, and freezing
        it there would freeze nothing). Raises MethodRefused naming the blocks."""
        z: dict[int, torch.Tensor] = {}

        def zero(act, hook):
            return torch.zeros_like(act)

        def save(act, hook, L):
            z[L] = act.detach()
            return act

        hooks: list[tuple[str, Callable]] = [(f"blocks.{L}.attn.hook_pattern", zero) for L in range(self.n_layers)]
        hooks += [(f"blocks.{L}.attn.hook_z", _partial(save, L=L)) for L in range(self.n_layers)
                  if f"blocks.{L}.attn.hook_z" in self.model.hook_dict]
        with fwd_hooks(self.model, hooks):
            self.model(self.tokens)
        bad = [L for L in range(self.n_layers) if L not in z or bool(z[L].abs().max() > 0)]
        if bad:
            raise MethodRefused(
                f"attribution graph: in blocks {bad} the forward pass does not use the hooked attention pattern "
                "(blocks.L.attn.hook_pattern is only reported, or attn.hook_z does not fire), so the pattern "
                f"cannot be frozen; {self.arch}'s bridge is not supported by the local replacement model.")

    # -- the replacement forward ------------------------------------------------------------
    def run(self, *, batch: int = 1, feature_scale: Optional[dict[int, torch.Tensor]] = None,
            error_scale: Optional[Float[torch.Tensor, "n_layers pos"]] = None,
            token_scale: Optional[Float[torch.Tensor, " pos"]] = None,
            linear_features: Optional[dict[int, torch.Tensor]] = None, grad: bool = False,
            stop_at_final: bool = False, extra_hooks: Optional[list[tuple[str, Callable]]] = None) -> ReplacementRun:
        """One forward pass of the local replacement model over ``batch`` copies of the prompt.

        Args:
            batch: copies of the prompt (rows of a batched backward pass).
            feature_scale: ``layer -> [n_active]`` multipliers of the layer's active features' clean
                activations (order of :class:`ActiveFeatures`; default 1).
            error_scale: ``[n_layers, pos]`` multipliers of the error vectors (default 1).
            token_scale: ``[pos]`` multipliers of the token embeddings (default 1).
            linear_features: ``layer -> [n_active]`` bool mask of active features held active: their
                activation moves one for one with their pre-activation (``a = a_clean * scale + pre -
                pre_clean``), so the replacement model stays linear while features respond (used to
                check the graph's multi-hop predictions). Others keep their (scaled) clean activation.
            grad: add zero leaves at every write (``ReplacementRun.leaves``) and record the graph.
            stop_at_final: stop the forward pass after the final norm (no ``[batch, pos, d_vocab]``
                logits are computed: ``ReplacementRun.logits`` is None), as the backward passes need.
            extra_hooks: more forward hooks, run after the replacement's own.

        Returns:
            :class:`ReplacementRun`. Units: logits; the model's dtype for activations.

        Raises:
            Exception: nothing of its own; the caller's hooks' and the model's errors propagate
                (every hook is removed whatever is raised).
        """
        B = int(batch)
        m = self.model
        live: dict[str, torch.Tensor] = {}
        reads: dict[int, torch.Tensor] = {}
        leaves: dict[Any, torch.Tensor] = {}
        norm_by_name = {s.name: s for s in self.norms}
        final_holder: dict[str, torch.Tensor] = {}

        def norm_in(act, hook, name):
            live[name] = act
            return act

        def norm_out(act, hook, name):
            y = norm_by_name[name].frozen(live.pop(name))
            if name == "ln_final":
                final_holder["y"] = y
                if stop_at_final:
                    raise _StopForward
            return y

        def pattern(act, hook, L):
            return self.patterns[L].to(act.dtype).expand(act.shape[0], *self.patterns[L].shape[1:]).detach()

        def read(act, hook, L):
            reads[L] = act
            return act

        def write(act, hook, L):
            d = self.dicts[L]
            x = reads[L]
            af = self.active[L]
            a = af.acts
            if feature_scale is not None and L in feature_scale:
                a = a * feature_scale[L].to(a)
            a = a[None]  # [1, n_active]: the same for every copy unless features respond
            if linear_features is not None and L in linear_features:
                mask = linear_features[L].to(a.device).float()
                a = a + (af.pre_of(d, x) - af.pre) * mask  # [batch, n_active]
            W = d.W_dec.detach()[af.feat]  # [n_active, d_out]
            writes = a.to(W.dtype)[..., None] * W  # [1 or batch, n_active, d_out]
            out = torch.zeros(a.shape[0], self.n_pos, W.shape[1], dtype=W.dtype, device=W.device)
            out = out.index_add(1, af.pos, writes) + d.b_dec.detach()
            if d.W_skip is not None:
                out = out + x.to(d.W_skip.dtype) @ d.W_skip.detach().T
            e = self.errors[L]
            if error_scale is not None:
                e = e * error_scale[L].to(e)[:, None]
            out = (out + e.to(out.dtype)).to(act.dtype)
            if out.shape[0] != act.shape[0]:
                out = out.expand(act.shape[0], -1, -1)
            if grad:
                leaf = torch.zeros_like(out, requires_grad=True)
                leaves[L] = leaf
                out = out + leaf
            return out

        def embed(act, hook):
            out = self.embed.to(act.dtype)
            if token_scale is not None:
                out = out * token_scale.to(out)[:, None]
            out = out.expand(act.shape[0], -1, -1)
            if grad:
                leaf = torch.zeros_like(out, requires_grad=True)
                leaves["tokens"] = leaf
                out = out + leaf
            return out

        hooks: list[tuple[str, Callable]] = [("hook_embed", embed)]
        for L in range(self.n_layers):
            hooks.append((f"blocks.{L}.attn.hook_pattern", _partial(pattern, L=L)))
        for s in self.norms:
            hooks.append((f"{s.name}.hook_in", _partial(norm_in, name=s.name)))
            hooks.append((f"{s.name}.hook_out", _partial(norm_out, name=s.name)))
        for L in range(self.n_layers):  # after the norms: a read at ln2.hook_out sees the frozen norm
            hooks.append((self.read_hooks[L], _partial(read, L=L)))
            hooks.append((self.write_hooks[L], _partial(write, L=L)))
        hooks += list(extra_hooks or [])
        toks = self.tokens.expand(B, -1)
        logits: Optional[torch.Tensor] = None
        with fwd_hooks(m, hooks), (torch.enable_grad() if grad else torch.no_grad()):
            try:
                logits = m(toks)
            except _StopForward:
                logits = None
        fin = final_holder["y"]
        pre_logits = torch.zeros(B, 0)
        if not grad:  # a batch of backward rows needs no logits ([batch, d_vocab] would be large)
            with torch.no_grad():
                pre_logits = m.unembed(fin[:, -1:, :].detach())[:, 0].float()
        return ReplacementRun(logits.detach() if logits is not None else None, pre_logits, reads, fin, leaves)

    # -- identity ---------------------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        """What was frozen and replaced, for ``graph.settings``. Raises nothing."""
        return {"norms_frozen": [s.name for s in self.norms],
                "norms_centred": [s.name for s in self.norms if s.norm.centred],
                "patterns_frozen": self.n_layers,
                "read_hooks": [self.read_hooks[L] for L in range(self.n_layers)],
                "write_hooks": [self.write_hooks[L] for L in range(self.n_layers)],
                "skip": [L for L in range(self.n_layers) if self.dicts[L].W_skip is not None]}


class _StopForward(Exception):
    """Raised inside the final norm's hook to end a forward pass early (caught in ``run``)."""


def _partial(fn, **kw):
    def f(act, hook):
        return fn(act, hook, **kw)
    return f

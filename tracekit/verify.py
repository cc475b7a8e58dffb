"""``tracekit verify``: the invariants every method relies on, checked on one model against plain
``transformers``.

A number from tracekit is only as good as the path it went through: the bridge's forward pass,
the readout (final norm + unembedding + the family's output transform), the write path of every
block (post-norms, multipliers), the patching engine's replays, the attention patterns. Each has
an identity that must hold on *any* model; this module checks them on the user's own model (hub
id, directory or GGUF; any device and dtype) on a few built-in prompts, against an independent
Hugging Face copy of the same weights run by the test itself (:class:`HFReference`, eager
attention, hooks on its own decoder layers):

=====================  ===========================================================================
check                  identity (tolerance: :func:`tolerance`, natural-log probabilities or logits)
=====================  ===========================================================================
forward                bridge log-probs == transformers' log-probs, every position (float16 / bfloat16:
                       against transformers on the same weights in float32, within a multiple of
                       transformers' own half-precision error; plus ``forward_mean``, the mean error)
lens_final             the lens of the last hidden state == the model's output
lens_hidden_states     the lens of every hidden state == the model's own head (final norm, unembedding,
                       output transform) applied by transformers to that hidden state
dla_sum                direct logit attribution: parts + biases == the (pre-transform) logit difference,
                       and that logit difference == transformers'
dla_heads              heads + b_O == each attention output (through post-norms)
neurons_sum            neurons + b_out == each MLP output (through post-norms)
patch_full_residual    patching the whole clean residual into the corrupted run gives the clean run
patch_vs_hf            one residual patch (layer, position) == the same patch hand-hooked into transformers
attention_patterns     every head's pattern == transformers' eager ``output_attentions``
batching               batched (left and right padding) == one prompt at a time (lens, DLA)
second_load            loading the same weights with another spec changes neither model
=====================  ===========================================================================

A check is ``pass`` / ``fail`` (a wrong number: the method must not be used) / ``refused`` (the
method refuses this model with a reason, which is a correct outcome) / ``skipped``. The report
prints as a table (:meth:`VerifyReport.table`) with the versions of tracekit, TransformerLens,
transformers and torch, and saves as ``verify.json``.

At load (:func:`tracekit.model.load_model`, unless ``model.verify: false``) the fast subset runs:
``forward`` against the Hugging Face model *before* the bridge wraps it (no second copy; in float16 /
bfloat16 against a float32 copy of it made for the probe only, :func:`tracekit.model.checks.forward_checks`),
and ``lens_final``; a failure refuses the model, naming the architecture. The run's
``environment.json`` records the result.
"""

from __future__ import annotations

import json
import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, cast

import torch
from jaxtyping import Float, Int

from .core.sites import hook
from .dla import DirectAttribution, logit_attribution
from .errors import AttentionError, TokenizationError, TracekitError
from .fastpath import lens_readout, residual_stream
from .model.architectures import MethodRefused, architecture_name
from .model.checks import HALF, PROMPTS, Check, forward_checks, load_checks, max_abs, model_dtype, probe_ids, tolerance  # noqa: F401 - re-exported
from .model.info import HookedModel
from .model.load import float32_logits, model_spec_of
from .model.readout import output_transform
from .model.writepath import write_paths
from .patching import batched_activation_patch, layer_pos_setter, layer_setter
from .tokens import encode, pad_ids, run_with_cache, single_token_id, tokenize

__all__ = ["Check", "VerifyReport", "HFReference", "verify_model", "tolerance", "probe_ids", "load_checks",
           "PROMPTS", "versions", "bridge_layers_path"]


def versions() -> dict:
    """Versions of what produced the numbers (tracekit, TransformerLens, transformers, torch, Python)."""
    from importlib import metadata

    out = {}
    for pkg in ("tracekit", "transformer-lens", "transformers", "torch"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    out["python"] = platform.python_version()
    return out


@dataclass
class VerifyReport:
    """The result of :func:`verify_model`.

    Attributes:
        model: the model's name. architecture: its Hugging Face architecture.
        dtype, device, process_weights: how it was loaded. level: ``full`` or ``load``.
        checks: one :class:`Check` per identity. versions: package versions.
    """

    model: str
    architecture: str
    dtype: str
    device: str
    process_weights: bool
    level: str
    checks: list[Check] = field(default_factory=list)
    versions: dict = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        """No check failed (refusals are correct outcomes)."""
        return not any(c.status == "fail" for c in self.checks)

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.checks if c.status == "fail"]

    def status(self, name: str) -> Optional[str]:
        for c in self.checks:
            if c.name == name:
                return c.status
        return None

    def to_dict(self) -> dict:
        d = asdict(self)
        d["passed"] = self.passed
        return d

    def save(self, path) -> Path:
        """Write ``verify.json`` (``path`` is a folder or a ``.json`` file)."""
        p = Path(path)
        if p.suffix != ".json":
            p.mkdir(parents=True, exist_ok=True)
            p = p / "verify.json"
        p.write_text(json.dumps(self.to_dict(), indent=2, default=str) + "\n")
        return p

    def table(self) -> str:
        """The report as a plain-text table (paste it into an appendix)."""
        head = (f"tracekit verify: {self.model} ({self.architecture}), {self.dtype} on {self.device}, "
                f"weights {'processed' if self.process_weights else 'unprocessed'}\n"
                + "  ".join(f"{k} {v}" for k, v in self.versions.items() if v) + "\n")
        rows = [("check", "method", "value", "tolerance", "result", "detail")]
        for c in self.checks:
            rows.append((c.name, c.method, "-" if c.value is None else f"{c.value:.2e}",
                         "-" if c.tolerance is None else f"{c.tolerance:.1e}", c.status, c.detail))
        widths = [max(len(r[i]) for r in rows) for i in range(5)]
        lines = ["  ".join(r[i].ljust(widths[i]) for i in range(5)) + "  " + r[5] for r in rows]
        verdict = "PASSED" if self.passed else f"FAILED ({', '.join(c.name for c in self.failed)})"
        return head + "\n".join(lines) + f"\n{verdict}: {sum(c.status == 'pass' for c in self.checks)} passed, " \
            f"{sum(c.status == 'refused' for c in self.checks)} refused with a reason, " \
            f"{len(self.failed)} failed"


# ---------------------------------------------------------------------------------------------
# the independent reference


class HFReference:
    """An independent ``transformers`` copy of the model, run with its own hooks (eager attention).

    Args:
        hf_model: a causal LM that no bridge wraps (a fresh ``from_pretrained`` of the same weights,
            built with ``attn_implementation="eager"``: switching a built model's implementation is
            not reliable in every family, e.g. Falcon).
        layers_path: the module path of its decoder layers (``model.layers``; the bridge's adapter
            names it: ``bridge.adapter.component_mapping["blocks"].name``).
    """

    def __init__(self, hf_model, layers_path: str):
        self.hf = hf_model.eval()
        self.layers = hf_model.get_submodule(layers_path)
        self.n_layers = len(self.layers)

    @property
    def device(self) -> torch.device:
        return next(self.hf.parameters()).device

    @torch.no_grad()
    def run(self, ids: Int[torch.Tensor, "b p"], attention_mask=None, attentions: bool = False,
            replace: Optional[Callable[[int, torch.Tensor], Optional[torch.Tensor]]] = None) -> dict:
        """One forward: ``logits`` (after the output transform), ``pre_logits`` (the unembedding's
        output), ``hidden`` (``n_layers + 1`` tensors: the input of block 0, then every block's
        output), ``attentions`` (per layer, or None). ``replace(i, x)`` may return a new value for
        hidden state ``i`` (the input of block ``i``; ``i = n_layers``: the last block's output)."""
        hidden: list = [None] * (self.n_layers + 1)
        pre: list = []
        handles = []

        def pre_hook(mod, args, kwargs, i):
            x = args[0] if args else kwargs["hidden_states"]
            if replace is not None:
                new = replace(i, x)
                if new is not None:
                    x = new
                    if args:
                        args = (new,) + tuple(args[1:])
                    else:
                        kwargs = {**kwargs, "hidden_states": new}
            hidden[i] = x.detach()
            return args, kwargs

        def post_hook(mod, args, out, i):
            seq = isinstance(out, (tuple, list))
            x = out[0] if seq else out
            if i == self.n_layers - 1 and replace is not None:
                new = replace(self.n_layers, x)
                if new is not None:
                    x = new
                    out = type(out)([new, *out[1:]]) if seq else new
            hidden[i + 1] = x.detach()
            return out

        try:
            for i, layer in enumerate(self.layers):
                handles.append(layer.register_forward_pre_hook(
                    lambda m, a, k, i=i: pre_hook(m, a, k, i), with_kwargs=True))
                handles.append(layer.register_forward_hook(lambda m, a, o, i=i: post_hook(m, a, o, i)))
            head = self.hf.get_output_embeddings()
            if head is not None:
                handles.append(head.register_forward_hook(lambda m, a, o: pre.append(o.detach())))
            kw = {"attention_mask": attention_mask} if attention_mask is not None else {}
            out = self.hf(ids.to(self.device), output_attentions=attentions, use_cache=False, **kw)
        finally:
            for h in handles:
                h.remove()
        atts = getattr(out, "attentions", None) if attentions else None
        return {"logits": out.logits.float(), "pre_logits": pre[-1].float() if pre else None, "hidden": hidden,
                "attentions": atts}

    @torch.no_grad()
    def head_log_probs(self, ids: Int[torch.Tensor, "b p"], state: Float[torch.Tensor, "b p d"], attention_mask=None
                       ) -> Float[torch.Tensor, "b p vocab"]:
        """The model's own head (final norm, unembedding, output transform) applied by
        ``transformers`` to ``state`` in place of the last block's output."""
        r = self.run(ids, attention_mask, replace=lambda i, x: state.to(x.dtype) if i == self.n_layers else None)
        return torch.log_softmax(r["logits"], -1)

    @torch.no_grad()
    def head_log_probs_many(self, ids: Int[torch.Tensor, "1 p"], states: Sequence[torch.Tensor], chunk: int = 16
                            ) -> list[Float[torch.Tensor, "p vocab"]]:
        """:meth:`head_log_probs` of one prompt for several states (``[1, p, d]`` each), run as
        batches of ``chunk`` copies of the prompt (one forward per chunk)."""
        out = []
        for s in range(0, len(states), chunk):
            part = torch.cat([x.reshape(1, *x.shape[-2:]) for x in states[s:s + chunk]])
            rep = ids.reshape(1, -1).expand(part.shape[0], -1)
            out += list(self.head_log_probs(rep, part))
        return out


def _attributed(d: DirectAttribution) -> float:
    """``d.attributed``, which ``DirectAttribution`` fills (with the logit by default)."""
    assert d.attributed is not None, "DirectAttribution fills attributed"
    return d.attributed


def bridge_layers_path(model: HookedModel) -> Optional[str]:
    """The dotted name of a loaded bridge's decoder-layer list in the wrapped transformers model
    (its adapter's ``component_mapping["blocks"]``, e.g. ``"model.layers"``); None when ``model`` is
    not a bridge. Raises nothing."""
    try:
        return cast(Any, model).adapter.component_mapping["blocks"].name  # a loaded bridge's adapter
    except Exception:  # noqa: BLE001 - not a bridge
        return None


# ---------------------------------------------------------------------------------------------
# probes


def _pick_tokens(model: HookedModel, log_probs: torch.Tensor, k: int = 2) -> list[str]:
    """``k`` single-token strings among the most probable next tokens (for target/foil)."""

    out = []
    for i in log_probs.argsort(descending=True).tolist()[:200]:
        s = model.tokenizer.decode([i])
        try:
            if single_token_id(model, s) == i and s not in out:
                out.append(s)
        except Exception:  # noqa: BLE001 - strings that do not round-trip are skipped
            continue
        if len(out) == k:
            break
    return out


def _refusal(e: Exception) -> Optional[str]:

    return str(e) if isinstance(e, TracekitError) else None


def _run_check(checks: list[Check], name: str, method: str, fn: Callable[[], tuple[float, float, str]]) -> None:
    """Run one check; a TracekitError is a refusal (correct), anything else a failure."""
    try:
        val, tol, detail = fn()
        checks.append(Check(name, method, val, tol, "pass" if val <= tol else "fail", detail))
    except Exception as e:  # noqa: BLE001 - every outcome is recorded
        why = _refusal(e)
        if why is not None:
            checks.append(Check(name, method, None, None, "refused", why.splitlines()[0][:300]))
        else:
            checks.append(Check(name, method, None, None, "fail", f"{type(e).__name__}: {e}"[:300]))


@torch.no_grad()
def verify_model(model: HookedModel, reference: Optional[HFReference] = None, prompts: Sequence[str] = PROMPTS,
                 second_load: Optional[Callable[[], HookedModel]] = None, level: str = "full") -> VerifyReport:
    """Check every invariant of the module docstring on ``model``.

    Args:
        model: a loaded tracekit model (TransformerBridge).
        reference: an independent ``transformers`` copy (:class:`HFReference`); without it only the
            checks that need none run (``lens_final``, DLA/neuron identities, full-residual
            patching, batching).
        prompts: two or more prompts of different token lengths (the built-in ones by default).
        second_load: a callable loading the same weights with another spec (the ``second_load``
            check compares both models with the reference before and after).
        level: recorded in the report.

    Returns:
        A :class:`VerifyReport` (check ``report.passed``).
    """
    # Long (reason): one closure per check (each reads the shared prompts, reference run and tolerance); the checks read top to bottom in the order the report lists them.

    spec = model_spec_of(model)
    dt = model_dtype(model)
    dev = next(cast(Any, model).parameters()).device  # a loaded bridge's module
    rep = VerifyReport(model=str(spec.name), architecture=architecture_name(model), dtype=str(dt).replace("torch.", ""),
                       device=str(dev), process_weights=bool(spec.process_weights), level=level, versions=versions())
    checks = rep.checks
    n_layers = int(model.cfg.n_layers)
    tol = tolerance(dt)
    prompts = list(prompts)
    first = encode(model, prompts[0])
    ids0 = torch.tensor([first], device=dev)
    P = ids0.shape[1]

    def bridge_lp(ids):
        return torch.log_softmax(model(ids.to(dev)).float(), -1)

    ref0 = reference.run(ids0, attentions=True) if reference is not None else None

    # forward
    if reference is not None:
        assert ref0 is not None  # run above whenever there is a reference

        try:  # float16 / bfloat16: against a float32 copy of the reference (forward_checks)
            ref32 = float32_logits(reference.hf, ids0) if dt in HALF else None
            checks += forward_checks(bridge_lp(ids0), ref0["logits"], ref32, dt)
        except Exception as e:  # noqa: BLE001 - every outcome is recorded
            checks.append(Check("forward", "load", None, None, "fail", f"{type(e).__name__}: {e}"[:300]))

    # lens
    hooks = [hook("resid_pre", 0)] + [hook("resid_post", L) for L in range(n_layers)]
    own_lp = bridge_lp(ids0)[0]
    tgt_ids = own_lp[-1].argsort(descending=True)[:3].tolist() + [int(own_lp[-1].argmin())]

    def c_lens_final():
        resid = residual_stream(model, pad_ids(model, [first]), hooks[-1:], positions=None)[0, 0]
        r = lens_readout(model, resid, tgt_ids, top_k=5)
        err = max_abs(r["target_log_prob"].to(dev) - own_lp[:, tgt_ids])
        err = max(err, max_abs(r["top_prob"].to(dev) - own_lp.exp().topk(5, -1).values))
        return err, tol, "lens of the last hidden state vs the model's output (targets, top-5)"
    _run_check(checks, "lens_final", "logit_lens", c_lens_final)

    if reference is not None:
        assert ref0 is not None

        def c_lens_hidden():
            resid = residual_stream(model, pad_ids(model, [first]), hooks, positions=None)[:, 0]
            r = lens_readout(model, resid, tgt_ids, top_k=5)
            worst = 0.0
            wants = reference.head_log_probs_many(ids0, ref0["hidden"])
            for h in range(n_layers + 1):
                want = wants[h].to(dev)
                worst = max(worst, max_abs(r["target_log_prob"][h].to(dev) - want[:, tgt_ids]),
                            max_abs(r["entropy"][h].to(dev) - (-(want.exp() * want).sum(-1))))
            return worst, tol * 10, (f"lens of all {n_layers + 1} hidden states vs transformers' own head on its "
                                     "hidden states (targets, entropy)")
        _run_check(checks, "lens_hidden_states", "logit_lens", c_lens_hidden)

    # DLA and neurons
    picks = _pick_tokens(model, own_lp[-1])

    def c_dla():
        if len(picks) < 2:
            raise RuntimeError("no two single-token strings among the top predictions")
        d = logit_attribution(model, prompts[0], picks[0], picks[1])[0]
        attributed = _attributed(d)
        err = abs(d.total() - attributed)
        detail = f"parts + biases vs {'logit difference' if d.transform == 'none' else d.transform + ' (pre-transform)'}"
        if ref0 is not None:  # there is a reference

            want = ref0["logits"][0, -1] if output_transform(model).linear else ref0["pre_logits"][0, -1]
            t, f = (single_token_id(model, p) for p in picks)
            err = max(err, abs(attributed - float(want[t] - want[f])))
            detail += "; vs transformers' logit difference"
        return err, tolerance(dt, abs(attributed)), detail
    _run_check(checks, "dla_sum", "dla", c_dla)

    def c_heads():
        d = logit_attribution(model, prompts[0], picks[0], picks[1])[0]
        err = max_abs(d.heads.sum(-1) + d.attn_bias - d.attn)
        paths = {wp.describe() for wp in write_paths(model, "attn") if wp is not None}
        return err, tolerance(dt, max_abs(d.attn)), f"per layer; attention writes: {', '.join(sorted(paths))}"
    _run_check(checks, "dla_heads", "dla", c_heads)

    def c_neurons():
        d = logit_attribution(model, prompts[0], picks[0], picks[1], neuron_layers="all")[0]
        err = max(abs(float(d.neuron_contrib[L].sum()) + float(d.mlp_bias[L]) - float(d.mlp[L])) for L in d.neuron_contrib)
        paths = {wp.describe() for wp in write_paths(model, "mlp") if wp is not None}
        return err, tolerance(dt, max_abs(d.mlp)), f"per layer; MLP writes: {', '.join(sorted(paths))}"
    _run_check(checks, "neurons_sum", "neurons", c_neurons)

    # patching
    corrupt = ids0.clone()
    corrupt[0, P // 2] = int(ids0[0, P // 2 - 1]) if P > 2 else int(ids0[0, 0])
    clean_lp = bridge_lp(ids0)[:, -1]

    def c_full():
        def metric(lg, b):
            return (torch.log_softmax(lg.float(), -1) - clean_lp[b]).abs().max(-1).values
        vals = batched_activation_patch(model, corrupt, ids0, metric, layer_setter, "resid_pre_layer",
                                        layers=sorted({0, n_layers // 2, n_layers - 1}), skip_unchanged=False)
        return max_abs(vals), tol, "denoising the whole residual stream of a layer (first, middle, last) gives the clean run"
    _run_check(checks, "patch_full_residual", "patching", c_full)

    if reference is not None:
        assert ref0 is not None

        def c_vs_hf():
            import pandas as pd

            L, p = max(1, n_layers // 2), P // 2
            got = []

            def metric(lg, b):
                got.append(torch.log_softmax(lg.float(), -1))
                return torch.zeros(lg.shape[0], device=lg.device)
            idf = pd.DataFrame({"layer": [L], "pos": [p]})
            batched_activation_patch(model, corrupt, ids0, metric, layer_pos_setter, "resid_pre", index_df=idf,
                                     skip_unchanged=False)
            clean_h = ref0["hidden"][L][:, p].clone()

            def repl(i, x):
                if i != L:
                    return None
                x = x.clone()
                x[:, p] = clean_h.to(x.dtype)
                return x
            want = torch.log_softmax(reference.run(corrupt, replace=repl)["logits"][:, -1], -1).to(dev)
            return max_abs(got[-1] - want), tol, f"resid_pre of block {L} at position {p} vs the same patch hooked into transformers"
        _run_check(checks, "patch_vs_hf", "patching", c_vs_hf)

    # attention
    if reference is not None:
        assert ref0 is not None

        def c_att():

            atts = ref0["attentions"]
            if not atts:
                raise AttentionError("transformers returns no attention weights for this architecture")
            worst, n = 0.0, 0
            att_layers = [L for L in range(n_layers) if hook("head_pattern", L) in model.hook_dict]
            if not att_layers:
                raise MethodRefused("no block of this model has attention patterns")
            hf_att = [a for a in atts if a is not None]
            if len(hf_att) != len(att_layers):
                raise RuntimeError(f"transformers returned {len(hf_att)} attention maps for {len(att_layers)} "
                                   "attention blocks")
            names = [hook("head_pattern", L) for L in att_layers]
            _, cache = run_with_cache(model, pad_ids(model, [first]), names)  # the patterns of every layer, one pass
            for name, a in zip(names, hf_att):
                worst = max(worst, max_abs(cache[name][0].float() - a[0].float().to(dev)))
                n += 1
            return worst, tol, f"softmax weights of every head of {n} attention blocks vs eager output_attentions"
        _run_check(checks, "attention_patterns", "attention", c_att)

    # batching
    def c_batch():

        if len({len(encode(model, p)) for p in prompts}) < 2:
            raise TokenizationError("prompts: give prompts of different token lengths, or batching pads nothing")
        worst = 0.0
        singles = []
        for p in prompts:
            b1 = tokenize(model, [p])
            res = residual_stream(model, b1, hooks, positions=b1.last)
            singles.append(lens_readout(model, res, tgt_ids, top_k=3)["target_log_prob"])
        for side in ("left", "right"):
            bb = tokenize(model, prompts, padding_side=side)
            res = residual_stream(model, bb, hooks, positions=bb.last)
            r = lens_readout(model, res, tgt_ids, top_k=3)["target_log_prob"]
            for i in range(len(prompts)):
                worst = max(worst, max_abs(r[:, i] - singles[i][:, 0]))
        detail = "lens of every hidden state at the last token, left and right padding vs one by one"
        if len(picks) == 2:
            try:
                many = logit_attribution(model, prompts, picks[0], picks[1])
                for i, p in enumerate(prompts):
                    one = logit_attribution(model, [p], picks[0], picks[1])[0]
                    worst = max(worst, abs(_attributed(one) - _attributed(many[i])), max_abs(one.heads - many[i].heads))
                detail += "; DLA heads"
            except Exception as e:  # noqa: BLE001 - a refused DLA is reported by dla_sum
                if _refusal(e) is None:
                    raise
        return worst, tol, detail
    _run_check(checks, "batching", "batching", c_batch)

    if second_load is not None:
        def c_second():
            before = bridge_lp(ids0)
            other = second_load()
            after = bridge_lp(ids0)
            other_lp = torch.log_softmax(other(ids0.to(dev)).float(), -1)
            err = max_abs(after - before)
            want = torch.log_softmax(ref0["logits"].to(dev), -1) if ref0 is not None else before
            err = max(err, max_abs(other_lp - want))
            return err, tol, "first model unchanged by the second load; second model == transformers"
        _run_check(checks, "second_load", "load", c_second)
    return rep

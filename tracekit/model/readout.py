"""Reading the residual stream in vocabulary space: final norm, unembedding and the model's own
output transform, written once.

Every method that reads a residual-stream vector as a next-token distribution goes through
:class:`Readout`: the logit lens (nostalgebraist 2020), activation patching's replays, direct logit
attribution, FFN value-vector readout (Geva et al. 2022) and SAE decoder readout. As in
tuned-lens' ``Unembed`` (``tuned_lens/nn/unembed.py``), the final LayerNorm/RMSNorm is
*recomputed* from the vector being read, never borrowed from the final layer's cached scale; so
reading the last block's output gives exactly the model's own logits (tested on every architecture
the bridge supports, tests/conformance).

The path from residual to logits is ``transform(unembed(final_norm(resid)))``, where ``transform``
is the family's post-unembedding step, which TransformerLens keeps in the architecture adapter
(``adapter.apply_output_logits_transform``): Gemma 2's final logit soft-cap
``cap * tanh(logits / cap)``, Granite's ``logits / logits_scaling``, Cohere's ``logits *
logit_scale``, Falcon-H1's ``lm_head_multiplier``. Dropping it gives log-probabilities off by many
nats on Gemma 2 (the bug this module's conformance tests pin).

Two readings:

* **recomputed** (:meth:`Readout.logits`, :meth:`Readout.log_probs`): the distribution the model
  would output if ``resid`` were its final residual (transform included);
* **frozen scale** (:meth:`Readout.direction`): with the final norm's scale ``1/sigma`` fixed at a
  run's value, the norm is linear, so a residual write ``c`` moves the (target - foil) logit by
  ``c . u_eff / sigma``. A *linear* output transform (a multiplier) is folded into ``u_eff``, so the
  attribution is of the model's own logits; a *nonlinear* one (soft-cap) cannot be: attributions
  are then of the **pre-transform** logits, and :attr:`OutputTransform.linear` says so. Direct
  logit attribution, neuron and SAE-feature attribution use this.

The final norm's weight, bias and centring are *measured* by calling the module
(:func:`tracekit.model.norms.measure_norm`), so ``(1 + w)`` norms (Gemma, Nemotron), parameter-free and
bias-free LayerNorms, and weight-processed (folded) norms are read as the forward pass applies them.

Memory (``run.memory_budget``, :mod:`tracekit.core.budget`): a readout holds ``[rows, d_vocab]``
tensors (262,144 floats = 1 MiB per row on Gemma 3), so every engine that reads out many vectors
asks :func:`readout_chunk` how many rows to read at once and :func:`chunked_log_probs` reads them;
:func:`forward_row_bytes` estimates what one row of a forward pass holds. On the CPU the
unembedding matmul gives each row the same bits for any chunk of at least :data:`MIN_READOUT_ROWS`
rows (1-3 rows take another kernel), so chunks are whole groups of that many rows and a shorter
last chunk is padded to it: a chunked readout equals an unchunked one exactly.

Units: ``logits`` are unnormalised; ``log_probs`` are natural-log probabilities; ``probs`` sum to 1.
In compatibility mode with ``process_weights`` the unembedding is centred (except under a soft-cap,
where TransformerLens leaves it), which shifts every logit of a position by the same constant:
probabilities and logit differences are unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
from jaxtyping import Float

from ..core.budget import bytes_of, chunk_rows
from .norms import AffineNorm, _eps, measure_norm
from .state import state_of

if TYPE_CHECKING:  # only for the annotations: model.info imports the loader (a cycle at run time)
    from .info import HookedModel

__all__ = ["Readout", "OutputTransform", "output_transform", "output_transform_fn", "READOUT_TEMPS",
           "MIN_READOUT_ROWS", "readout_bytes", "readout_chunk", "forward_row_bytes", "chunked_log_probs"]

#: float32 ``[d_vocab]`` vectors one row's readout holds at its peak: the logits (and their float32
#: copy or transformed copy), the log-softmax and its internal temporary, the probabilities and a
#: product or comparison over the vocabulary (a generous count).
READOUT_TEMPS = 6
#: Rows per readout group: on the CPU (MKL) a matmul of 1-3 rows takes another kernel than one of
#: 4 or more, whose rows all get the same bits; chunks are whole groups (the last padded).
MIN_READOUT_ROWS = 4


def _attr(obj, name):
    try:
        return getattr(obj, name)
    except (AttributeError, TypeError):
        return None


@dataclass(frozen=True)
class OutputTransform:
    """The family's post-unembedding transform, as measured on probe logits.

    Attributes:
        kind: ``identity`` | ``scale`` (a constant multiplier) | ``nonlinear`` (e.g. a soft-cap).
        multiplier: the constant for ``identity`` (1.0) and ``scale``; None when nonlinear.
        description: what it is, for tables and error messages (e.g. ``"final logit soft-cap 30.0"``).
    """

    kind: str
    multiplier: Optional[float]
    description: str

    @property
    def linear(self) -> bool:
        """True when attributions of the output logits add up exactly (identity or a multiplier)."""
        return self.kind != "nonlinear"

    @property
    def scale(self) -> float:
        """The multiplier of a linear transform (1.0 for identity); 1.0 when nonlinear (attributions
        are then in pre-transform logits)."""
        if not self.linear:
            return 1.0
        assert self.multiplier is not None, "a linear output transform has a multiplier"
        return float(self.multiplier)


def output_transform_fn(model: HookedModel) -> Optional[Callable[[torch.Tensor], torch.Tensor]]:
    """The model's post-unembedding logits transform as a function of logits (any shape, applied
    elementwise): the bridge adapter's ``apply_output_logits_transform``, else a soft cap
    ``cap * tanh(x / cap)`` from ``cfg.output_logits_soft_cap``; None when the logits are used as
    they are. Raises nothing."""
    adapter = _attr(model, "adapter")
    fn: Optional[Callable[[torch.Tensor], torch.Tensor]] = _attr(adapter, "apply_output_logits_transform")
    if callable(fn):
        return fn
    cap = _attr(getattr(model, "cfg", None), "output_logits_soft_cap")
    if isinstance(cap, (int, float)) and cap > 0:  # HookedTransformer applies the cap in forward
        return lambda x: cap * torch.tanh(x / cap)
    return None


@torch.no_grad()
def output_transform(model: HookedModel) -> OutputTransform:
    """Measure the model's post-unembedding transform (cached on the model)."""
    st = state_of(model)
    if st.output_transform is not None:
        return st.output_transform
    fn = output_transform_fn(model)
    if fn is None:
        out = OutputTransform("identity", 1.0, "none")
    else:
        x = torch.tensor([-40.0, -3.0, -0.01, 0.01, 3.0, 40.0])
        y = fn(x.clone()).float()
        m = float(y[3] / x[3])
        if torch.allclose(y, m * x, rtol=1e-5, atol=1e-7):
            if abs(m - 1.0) < 1e-7:
                out = OutputTransform("identity", 1.0, "none")
            else:
                out = OutputTransform("scale", m, f"logits x {m:g}")
        else:
            cap = _attr(getattr(model, "cfg", None), "output_logits_soft_cap")
            desc = f"final logit soft-cap {float(cap):g}" if isinstance(cap, (int, float)) and cap > 0 \
                else "a nonlinear post-unembedding transform"
            out = OutputTransform("nonlinear", None, desc)
    st.output_transform = out
    return out


class Readout:
    """Final norm + unembedding + output transform of a hooked model, applied to residual vectors.

    Args:
        model: a TransformerBridge (or HookedTransformer) with ``ln_final`` and ``unembed``.
    """

    def __init__(self, model: HookedModel):
        self.model: Any = model  # a loaded bridge: its ln_final, unembed and W_U modules are read

    # ---- recomputed norm ------------------------------------------------------------------
    @torch.no_grad()
    def normalize(self, resid: Float[torch.Tensor, "... d_model"]) -> Float[torch.Tensor, "... d_model"]:
        """The final norm recomputed on ``resid`` (its own mean/scale)."""
        return self.model.ln_final(resid)

    @torch.no_grad()
    def pre_transform_logits(self, resid: Float[torch.Tensor, "... d_model"]) -> Float[torch.Tensor, "... d_vocab"]:
        """``unembed(final_norm(resid))``: the logits before the family's output transform
        (what direct logit attribution decomposes under a soft-cap)."""
        return self.model.unembed(self.model.ln_final(resid))

    @torch.no_grad()
    def apply_transform(self, logits: Float[torch.Tensor, "... d_vocab"]) -> Float[torch.Tensor, "... d_vocab"]:
        """The family's post-unembedding transform (soft-cap, scaling; identity for most)."""
        fn = output_transform_fn(self.model)
        return logits if fn is None else fn(logits)

    @torch.no_grad()
    def logits(self, resid: Float[torch.Tensor, "... d_model"]) -> Float[torch.Tensor, "... d_vocab"]:
        """Logits (unnormalised) that the model would output if ``resid`` were its final residual."""
        return self.apply_transform(self.pre_transform_logits(resid))

    @torch.no_grad()
    def log_probs(self, resid: Float[torch.Tensor, "... d_model"]) -> Float[torch.Tensor, "... d_vocab"]:
        """Natural-log next-token probabilities, computed in float32."""
        return torch.log_softmax(self.logits(resid).float(), dim=-1)

    # ---- frozen scale ---------------------------------------------------------------------
    @property
    def transform(self) -> OutputTransform:
        """The measured output transform (:class:`OutputTransform`)."""
        return output_transform(self.model)

    @property
    def final_norm(self) -> AffineNorm:
        """The final norm's measured affine form (cached on the model)."""
        st = state_of(self.model)
        if st.final_norm is None:
            st.final_norm = measure_norm(self.model.ln_final, int(self.model.cfg.d_model),
                                         device=self.W_U.device)
        return st.final_norm

    @property
    def is_layernorm(self) -> bool:
        """True for LayerNorm (centres, may have a bias), False for RMSNorm (measured)."""
        return self.final_norm.centred

    @torch.no_grad()
    def norm_params(self) -> tuple[Float[torch.Tensor, " d_model"], Optional[Float[torch.Tensor, " d_model"]], bool]:
        """``(weight, bias or None, is_layernorm)`` of the final norm as the forward pass applies it
        (float32, on the unembedding's device; measured, see :mod:`tracekit.model.norms`)."""
        n = self.final_norm
        b = n.bias if bool(n.bias.ne(0).any()) else None
        return n.weight, b, n.centred

    @torch.no_grad()
    def scale(self, resid: Float[torch.Tensor, "... d_model"]) -> Float[torch.Tensor, "... 1"]:
        """The final norm's per-vector scale ``1/sigma`` recomputed from ``resid`` (LayerNorm: of the
        centred vector; RMSNorm: of the raw vector), float32. Equals ``1 / ln_final.hook_scale``."""

        x = self.final_norm.centre(resid.float())
        eps = _eps(self.model.ln_final, float(getattr(self.model.cfg, "eps", 1e-5)))
        return (x.pow(2).mean(-1, keepdim=True) + eps).rsqrt()

    @torch.no_grad()
    def unembed_direction(self, target_id: int, foil_id: Optional[int] = None) -> tuple[Float[torch.Tensor, " d_model"], float]:
        """``(u, b)``: the unembedding column difference ``W_U[:, t] - W_U[:, f]`` times the output
        multiplier (when linear), and the matching ``b_U`` term, both in output-logit units."""
        W_U = self.W_U
        u = W_U[:, int(target_id)].float()
        if foil_id is not None:
            u = u - W_U[:, int(foil_id)].float()
        bias = 0.0
        b_U = _attr(self.model, "b_U")
        if isinstance(b_U, torch.Tensor):
            bias = float(b_U[int(target_id)]) - (float(b_U[int(foil_id)]) if foil_id is not None else 0.0)
        m = self.transform.scale
        return u * float(m), bias * float(m)

    @torch.no_grad()
    def direction(self, target_id: int, foil_id: Optional[int] = None) -> tuple[Float[torch.Tensor, " d_model"], float]:
        """The residual direction read by the (target - foil) logit through a frozen final-norm scale.

        Returns:
            ``(u_eff, bias)``: ``u_eff = centre(w * (W_U[:, t] - W_U[:, f])) * m`` (``w`` the final
            norm's measured weight, ``centre`` for LayerNorm, ``m`` the output multiplier when the
            transform is linear), so a residual write ``c`` contributes ``c . u_eff / sigma`` logits;
            ``bias = (b_norm . u + b_U[t] - b_U[f]) * m``, independent of the input. Under a nonlinear
            transform (soft-cap) these are **pre-transform** logits (:attr:`transform`).
        """
        u, bias = self.unembed_direction(target_id, foil_id)
        n = self.final_norm
        ue = n.adjoint(u.to(n.weight.device))
        bias += float(n.bias.to(u.device) @ u)
        return ue, bias

    @torch.no_grad()
    def vocab_projection(self, vectors: Float[torch.Tensor, "... d_model"]) -> Float[torch.Tensor, "... d_vocab"]:
        """Residual-space vectors read in vocabulary space at final-norm scale 1: ``(centre(v) * w) @ W_U``,
        centred over the vocabulary (logits per unit of the vector; Geva et al. 2022's value readout,
        SAE decoder readout). Centring makes it independent of ``process_weights``. A linear output
        multiplier is applied; under a soft-cap the projection is in pre-cap logits."""
        n = self.final_norm
        v = vectors.float().to(n.weight.device)
        W_U = self.W_U
        scores = ((n.centre(v) * n.weight).to(W_U.dtype) @ W_U).float()
        if self.transform.linear:
            scores = scores * self.transform.scale
        return scores - scores.mean(-1, keepdim=True)

    @property
    def W_U(self) -> Float[torch.Tensor, "d_model d_vocab"]:
        """The unembedding matrix (in the model's processed basis)."""
        return self.model.W_U


def readout_bytes(model: HookedModel, extra_vocab: int = 0) -> int:
    """Bytes one residual vector's vocabulary readout holds at its peak: :data:`READOUT_TEMPS`
    (+ ``extra_vocab``) float32 ``[d_vocab]`` vectors, plus its ``[d_model]`` input and norm output.
    Raises nothing."""
    cfg = model.cfg
    return bytes_of(READOUT_TEMPS + int(extra_vocab), int(cfg.d_vocab)) + bytes_of(4, int(cfg.d_model))


def forward_row_bytes(model: HookedModel, n_tokens: int, logits: bool = False) -> int:
    """Bytes one row of ``n_tokens`` tokens holds at the peak of a forward pass, in the model's dtype:
    the residual stream and a few ``[tokens, d_model]`` activations of one block (6), its MLP hidden
    activations (3 ``[tokens, d_mlp]``: gate, up, product), its attention scores, pattern and mask
    (3 ``[heads, tokens, tokens]``), and with ``logits`` the ``[tokens, d_vocab]`` logits in float32
    and a copy. Blocks run one at a time, so this does not grow with the number of layers; the
    weights are not counted (the budget is a share of the memory free once they are loaded).
    Raises nothing."""
    cfg = model.cfg
    d = int(cfg.d_model)
    d_mlp = int(getattr(cfg, "d_mlp", None) or 4 * d)
    heads = int(getattr(cfg, "n_heads", 1) or 1)
    dtype = getattr(cfg, "dtype", None)
    dt = dtype if isinstance(dtype, torch.dtype) else torch.float32
    T = max(1, int(n_tokens))
    out = bytes_of(T, 6 * d + 3 * d_mlp, dtype=dt) + bytes_of(3 * heads, T, T, dtype=dt)
    if logits:
        out += bytes_of(2, T, int(cfg.d_vocab))
    return out


def readout_chunk(model: HookedModel, n: int, *, what: str, cap: Optional[int] = None, fixed: int = 0,
                  per_row: Optional[int] = None, fix: Optional[str] = None) -> int:
    """How many of ``n`` vectors to read out at once under the memory budget: a multiple of
    :data:`MIN_READOUT_ROWS` (or ``n``), at most ``cap``.

    Args:
        n: vectors to read. what: the engine, for messages. cap: the engine's own chunk limit
            (e.g. 512), kept so results under a large budget are those of before.
        fixed: bytes held anyway while reading (e.g. the batch's residuals).
        per_row: bytes per vector (default :func:`readout_bytes`).
        fix: what else could be changed, for the refusal message.

    Raises:
        MemoryBudgetError: one group of :data:`MIN_READOUT_ROWS` vectors (plus ``fixed``) does not
            fit the budget.
    """
    from .load import model_device

    g = MIN_READOUT_ROWS
    per = int(per_row if per_row is not None else readout_bytes(model))
    n = max(1, int(n))
    groups = chunk_rows(per * min(g, n), -(-n // g), what=what, device=model_device(model), fixed=fixed,
                        unit=f"group of {min(g, n)} vectors" if n > 1 else "vector", fix=fix)
    c = min(n, groups * g)
    if cap is not None:
        c = min(c, max(g, (int(cap) // g) * g) if int(cap) >= g else int(cap))
    return max(1, c)


@torch.no_grad()
def chunked_log_probs(readout: Readout, flat: Float[torch.Tensor, "n d_model"], sl: slice,
                      translate: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
                      ) -> Float[torch.Tensor, "r d_vocab"]:
    """``readout.log_probs(translate(flat[sl]))`` (``translate``: e.g. a tuned lens' translator;
    None: the vectors as they are), with a chunk shorter than :data:`MIN_READOUT_ROWS` (the last of
    several) padded with copies of its last row, so each row gets the bits it gets in a bigger
    chunk. Raises nothing."""
    x = flat[sl]
    r = x.shape[0]
    pad = 0 < r < MIN_READOUT_ROWS and r < flat.shape[0]
    if pad:
        x = torch.cat([x, x[-1:].expand(MIN_READOUT_ROWS - r, -1)])
    if translate is not None:
        x = translate(x)
    lp = readout.log_probs(x)
    return lp[:r] if pad else lp

"""Reading the residual stream in vocabulary space: the final norm + unembedding, written once.

Every method that reads a residual-stream vector as a next-token distribution goes through
:class:`Readout`: the logit lens (nostalgebraist 2020), activation patching's replays, direct logit
attribution, FFN value-vector readout (Geva et al. 2022) and SAE decoder readout. As in
tuned-lens' ``Unembed`` (``tuned_lens/nn/unembed.py``), the final LayerNorm/RMSNorm is
*recomputed* from the vector being read, never borrowed from the final layer's cached scale; so
reading the last block's output gives exactly the model's own logits (tested).

Two readings:

* **recomputed** (:meth:`Readout.logits`, :meth:`Readout.log_probs`): the distribution the model
  would output if ``resid`` were its final residual;
* **frozen scale** (:meth:`Readout.direction` + :meth:`Readout.norm_params`): with the final norm's
  scale ``1/sigma`` fixed at a run's value (``ln_final.hook_scale``), the norm is linear, so a
  residual write ``c`` moves the (target - foil) logit by ``c . u_eff / sigma``. Direct logit
  attribution, neuron and SAE-feature attribution use this.

Units: ``logits`` are unnormalised; ``log_probs`` are natural-log probabilities; ``probs`` sum to 1.
In compatibility mode with ``process_weights`` the unembedding is centred, which shifts every
logit of a position by the same constant: probabilities and logit differences are unchanged.
"""

from __future__ import annotations

from typing import Optional

import torch
from jaxtyping import Float

__all__ = ["Readout"]


def _attr(obj, name):
    try:
        return getattr(obj, name)
    except (AttributeError, TypeError):
        return None


class Readout:
    """Final norm + unembedding of a hooked model, applied to arbitrary residual vectors.

    Args:
        model: a TransformerBridge / HookedTransformer with ``ln_final`` and ``unembed``.
    """

    def __init__(self, model):
        self.model = model

    # ---- recomputed norm ------------------------------------------------------------------
    @torch.no_grad()
    def normalize(self, resid: Float[torch.Tensor, "... d_model"]) -> Float[torch.Tensor, "... d_model"]:
        """The final norm recomputed on ``resid`` (its own mean/scale)."""
        return self.model.ln_final(resid)

    @torch.no_grad()
    def logits(self, resid: Float[torch.Tensor, "... d_model"]) -> Float[torch.Tensor, "... d_vocab"]:
        """Logits (unnormalised) that the model would output if ``resid`` were its final residual."""
        return self.model.unembed(self.model.ln_final(resid))

    @torch.no_grad()
    def log_probs(self, resid: Float[torch.Tensor, "... d_model"]) -> Float[torch.Tensor, "... d_vocab"]:
        """Natural-log next-token probabilities, computed in float32."""
        return torch.log_softmax(self.logits(resid).float(), dim=-1)

    # ---- frozen scale ---------------------------------------------------------------------
    @property
    def is_layernorm(self) -> bool:
        """True for LayerNorm (centres, may have a bias), False for RMSNorm."""
        rms = _attr(self.model.ln_final, "uses_rms_norm")
        if rms is None:
            rms = str(getattr(self.model.cfg, "normalization_type", "LN") or "LN").startswith("RMS")
        return not rms

    @torch.no_grad()
    def norm_params(self) -> tuple[Float[torch.Tensor, " d_model"], Optional[Float[torch.Tensor, " d_model"]], bool]:
        """``(weight, bias or None, is_layernorm)`` of the final norm as the forward pass applies it
        (float32, on the unembedding's device).

        With ``process_weights`` (fold_ln) the weight is all ones and its values live in ``W_U``;
        without, they are the trained values. RMSNorm has no bias and does not centre.
        """
        lf = self.model.ln_final
        d = int(self.model.cfg.d_model)
        w = None
        for name in ("weight", "w"):
            w = _attr(lf, name)
            if isinstance(w, torch.Tensor):
                break
            w = None
        dev = self.W_U.device
        w = torch.ones(d, device=dev) if w is None else w.detach().float().to(dev)
        if getattr(self.model.cfg, "rmsnorm_uses_offset", False):
            w = 1.0 + w
        b = None
        is_ln = self.is_layernorm
        if is_ln:
            comp = _attr(lf, "original_component")
            b = _attr(comp, "bias") if comp is not None else _attr(lf, "b")
            b = b.detach().float().to(dev) if isinstance(b, torch.Tensor) else None
        return w, b, is_ln

    @torch.no_grad()
    def scale(self, resid: Float[torch.Tensor, "... d_model"]) -> Float[torch.Tensor, "... 1"]:
        """The final norm's per-vector scale ``1/sigma`` recomputed from ``resid`` (LayerNorm: of the
        centred vector; RMSNorm: of the raw vector), float32. Equals ``1 / ln_final.hook_scale``."""
        x = resid.float()
        if self.is_layernorm:
            x = x - x.mean(-1, keepdim=True)
        eps = float(getattr(self.model.cfg, "eps", 1e-5))
        return (x.pow(2).mean(-1, keepdim=True) + eps).rsqrt()

    @torch.no_grad()
    def direction(self, target_id: int, foil_id: Optional[int] = None) -> tuple[Float[torch.Tensor, " d_model"], float]:
        """The residual direction read by the (target - foil) logit through a frozen final-norm scale.

        Returns:
            ``(u_eff, bias)``: ``u_eff = w * (W_U[:, t] - W_U[:, f])`` (centred over ``d_model`` for
            LayerNorm), so a residual write ``c`` contributes ``c . u_eff / sigma`` logits;
            ``bias = b_norm . u + b_U[t] - b_U[f]`` logits, independent of the input.
        """
        W_U = self.W_U
        u = W_U[:, int(target_id)].float()
        if foil_id is not None:
            u = u - W_U[:, int(foil_id)].float()
        w, b, is_ln = self.norm_params()
        ue = u * w
        if is_ln:
            ue = ue - ue.mean()
        bias = float(b @ u) if b is not None else 0.0
        b_U = _attr(self.model, "b_U")
        if isinstance(b_U, torch.Tensor):
            bias += float(b_U[int(target_id)]) - (float(b_U[int(foil_id)]) if foil_id is not None else 0.0)
        return ue, bias

    @torch.no_grad()
    def vocab_projection(self, vectors: Float[torch.Tensor, "... d_model"]) -> Float[torch.Tensor, "... d_vocab"]:
        """Residual-space vectors read in vocabulary space at final-norm scale 1: ``(centre(v) * w) @ W_U``,
        centred over the vocabulary (logits per unit of the vector; Geva et al. 2022's value readout,
        SAE decoder readout). Centring makes it independent of ``process_weights``."""
        w, _, is_ln = self.norm_params()
        v = vectors.float().to(w.device)
        if is_ln:
            v = v - v.mean(-1, keepdim=True)
        W_U = self.W_U
        scores = ((v * w).to(W_U.dtype) @ W_U).float()
        return scores - scores.mean(-1, keepdim=True)

    @property
    def W_U(self) -> Float[torch.Tensor, "d_model d_vocab"]:
        """The unembedding matrix (in the model's processed basis)."""
        return self.model.W_U

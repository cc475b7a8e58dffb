"""Reading the residual stream in vocabulary space: the final norm + unembedding, written once.

Every method that reads a residual-stream vector as a next-token distribution goes through
:class:`Readout`: the logit lens (nostalgebraist 2020), direct logit attribution, FFN value-vector
readout (Geva et al. 2022) and SAE decoder readout. As in tuned-lens' ``Unembed``
(``tuned_lens/nn/unembed.py``), the final LayerNorm/RMSNorm is *recomputed* from the vector being
read, never borrowed from the final layer's cached scale; so reading the last block's output gives
exactly the model's own logits (tested).

Units: ``logits`` are unnormalised; ``log_probs`` are natural-log probabilities; ``probs`` sum to 1.
In compatibility mode with ``process_weights`` the unembedding is centred, which shifts every
logit of a position by the same constant: probabilities and logit differences are unchanged.
"""

from __future__ import annotations

import torch
from jaxtyping import Float


class Readout:
    """Final norm + unembedding of a hooked model, applied to arbitrary residual vectors.

    Args:
        model: a TransformerBridge / HookedTransformer with ``ln_final`` and ``unembed``.
    """

    def __init__(self, model):
        self.model = model

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

    @torch.no_grad()
    def final_scale(self, resid: Float[torch.Tensor, "... d_model"]) -> Float[torch.Tensor, "... 1"]:
        """The final norm's per-vector scale 1/sigma (LayerNorm: of the centred vector; RMSNorm:
        of the raw vector), as used by direct logit attribution through the run's final scale."""
        x = resid.float()
        norm_type = str(getattr(self.model.cfg, "normalization_type", "LN") or "LN")
        eps = float(getattr(self.model.cfg, "eps", 1e-5))
        if norm_type.startswith("LN"):
            x = x - x.mean(-1, keepdim=True)
        return (x.pow(2).mean(-1, keepdim=True) + eps).rsqrt()

    @property
    def W_U(self) -> Float[torch.Tensor, "d_model d_vocab"]:
        return self.model.W_U

    def directions(self, token_ids) -> Float[torch.Tensor, "d_model n"]:
        """Unembedding columns of the given tokens (in the model's processed basis)."""
        return self.model.W_U[:, torch.as_tensor(token_ids, device=self.model.W_U.device)]

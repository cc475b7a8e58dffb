"""Saved probe directions of a ``linear_probe`` run, as tensors."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from ..errors import ProbingError

__all__ = ["load_probe_directions"]


def load_probe_directions(source: Any, site: str = "resid_post", bias: bool = False,
                          normalize: bool = False) -> dict[int, Any]:
    """Fitted probe directions of a ``linear_probe`` run, as tensors keyed by layer (block index).

    Args:
        source: a :class:`~tracekit.experiments.probing.LinearProbeResult` or a saved step directory
            (``<run>/<step>/`` holding ``arrays.safetensors``).
        site: ``resid_pre`` (layer 0 of it is the embedding baseline) | ``resid_mid`` | ``resid_post`` |
            ``attn_out`` | ``mlp_out``, or an explicit hook's site (``mlp.hook_post``, ``hook_mlp_in``, ...).
        bias: also return the bias: values become ``(weight, bias)``.
        normalize: scale each row to unit L2 norm (for use as steering / ablation directions).

    Returns:
        ``{layer: Float[Tensor, "n_out d"]}`` in the model's own activation basis (the
        standardisation used for fitting is undone: ``act @ W.T + b`` is the probe's logit).
        ``n_out`` = number of classes (multiclass; row order = the result's ``meta["classes"]``),
        or 1 (binary: the direction of ``classes[1]``; regression).

    Raises:
        ProbingError: the directory has no ``arrays.safetensors`` (run with save_directions: true),
            ``site: resid`` (renamed), or no directions for that site (the message lists the saved ones).
    """
    if site == "resid":
        raise ProbingError("site: 'resid' was renamed to 'resid_post' (block outputs; or 'resid_pre', block inputs)")
    if isinstance(source, (str, Path)):
        p = Path(source) / "arrays.safetensors"
        if not p.exists():
            raise ProbingError(f"{p}: no saved probe directions (run with save_directions: true)")
        from safetensors.torch import load_file

        arrays = load_file(str(p))
    else:
        arrays = source.arrays
    out: dict[int, Any] = {}
    for k, v in arrays.items():
        m = re.fullmatch(r"probe\.(.+)\.(-?\d+)\.weight", k)
        if m and m.group(1) == site:
            L = int(m.group(2))
            w = v.float()
            if normalize:
                w = w / w.norm(dim=-1, keepdim=True).clamp(min=1e-12)
            out[L] = (w, arrays[f"probe.{site}.{L}.bias"].float()) if bias else w
    if not out:
        sites = sorted({re.sub(r"^probe\.|\.-?\d+\.(weight|bias)$", "", k) for k in arrays if k.startswith("probe.")})
        raise ProbingError(f"site: no probe directions for site {site!r}; saved sites: {sites}")
    return dict(sorted(out.items()))

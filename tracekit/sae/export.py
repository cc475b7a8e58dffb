"""Exports of SAEs and features to other tools' formats.

* :func:`export_sae`: a trained SAE (its cache folder or training hash) or any SAELens directory,
  written as a SAELens directory (``cfg.json`` + ``sae_weights.safetensors`` + ``sparsity.safetensors``
  when present) whose ``model_name`` is a Hugging Face hub id, so ``sae_lens.SAE.load_from_disk``
  and ``HookedSAETransformer`` users find the model.
* :func:`neuronpedia_batch`: a ``sae_features`` result's dashboard features in the batch JSON that
  SAEDashboard's ``NeuronpediaRunner`` writes (``batch-<n>.json``: ``NeuronpediaDashboardBatch`` of
  ``sae_dashboard/neuronpedia/neuronpedia_dashboard.py``, jbloomAus/SAEDashboard), the input of
  Neuronpedia's importer (``convert-saedashboard-to-neuronpedia-export.py`` in
  hijohnnylin/neuronpedia ``utils/neuronpedia-utils``).

sae_lens is not needed (an optional extra): the exported directory is read back with tracekit's own
SAELens-format reader (:func:`tracekit.dictionaries.formats.load_saelens_dir`) as a check, and also
with SAELens where it imports.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from ..compat import has_sae_lens
from ..core.errors import SAEError
from ..core.exportdir import export_folder, export_target
from ..dictionaries.formats import load_saelens_dir
from ..model.spec import EMBEDDED_ALIASES, EMBEDDED_HUB_NAME
from .dashboard import _where
from .train import sae_cache_dir

__all__ = ["NEURONPEDIA_ACTIVATION_KEYS", "NEURONPEDIA_FEATURE_KEYS", "export_sae", "hub_model_id",
           "neuronpedia_batch", "resolve_sae_source"]

#: The keys of one feature of a ``NeuronpediaDashboardBatch`` (SAEDashboard's
#: ``NeuronpediaDashboardFeature.to_dict``), in its order.
NEURONPEDIA_FEATURE_KEYS = (
    "feature_index", "neuron_alignment_indices", "neuron_alignment_values", "neuron_alignment_l1",
    "correlated_neurons_indices", "correlated_neurons_l1", "correlated_neurons_pearson",
    "correlated_features_indices", "correlated_features_l1", "correlated_features_pearson",
    "neg_str", "neg_values", "pos_str", "pos_values", "frac_nonzero", "freq_hist_data_bar_values",
    "freq_hist_data_bar_heights", "logits_hist_data_bar_heights", "logits_hist_data_bar_values",
    "n_prompts_total", "n_tokens_in_prompt", "dataset", "decoder_weights_dist", "activations")
#: The keys of one activation record (``NeuronpediaDashboardActivation.to_dict`` without DFA).
NEURONPEDIA_ACTIVATION_KEYS = ("bin_min", "bin_max", "bin_contains", "tokens", "values")

_SAE_FILES = ("cfg.json", "sae_weights.safetensors")
_HASH = re.compile(r"^[0-9a-f]{6,16}$")


# =============================================================================================
# SAE -> SAELens directory


def hub_model_id(name: str | None) -> str | None:
    """The Hugging Face hub id of a tracekit model name, when known.

    Args:
        name: a tracekit model name (``smollm2-135m``, a hub id such as ``gpt2``, a folder or a
            ``.gguf`` file).

    Returns:
        ``HuggingFaceTB/SmolLM2-135M-Instruct`` for the embedded model's aliases, the name itself
        for a hub id, None for a local folder or file (or no name).
    """
    if not name:
        return None
    if name in EMBEDDED_ALIASES:
        return EMBEDDED_HUB_NAME
    if (name.endswith(".gguf") or name.startswith((".", "/", "~")) or "\\" in name or name.count("/") > 1
            or Path(name).expanduser().exists()):
        return None
    return name


def resolve_sae_source(source: str, cache_dir: Path | None = None) -> Path:
    """The SAELens directory a ``tracekit export sae`` SOURCE names.

    Args:
        source: a directory with ``cfg.json`` + ``sae_weights.safetensors`` (a SAELens directory or
            a trained SAE's cache folder), or a trained SAE's training hash (the 16 hex digits of
            ``tracekit cache list``; a unique prefix of 6 or more digits is enough).
        cache_dir: the trained SAEs' cache (default :func:`tracekit.sae.sae_cache_dir`).

    Returns:
        The directory.

    Raises:
        SAEError: SOURCE is neither (the message names SOURCE and how to list the cache), or a
            prefix matches several trained SAEs.
    """
    root = Path(cache_dir) if cache_dir is not None else sae_cache_dir()
    p = Path(source).expanduser()
    if p.is_dir():
        missing = [f for f in _SAE_FILES if not (p / f).is_file()]
        if missing:
            raise SAEError(f"SOURCE: {source!r} is a folder without {' and '.join(missing)}; give a SAELens directory "
                           "(cfg.json + sae_weights.safetensors) or a trained SAE's hash (`tracekit cache list`)")
        return p
    if _HASH.match(source.lower()):
        hits = sorted(d for d in root.glob(f"{source.lower()}*") if d.is_dir() and not d.name.startswith("."))
        if len(hits) == 1:
            return resolve_sae_source(str(hits[0]), root)
        if len(hits) > 1:
            raise SAEError(f"SOURCE: the hash prefix {source!r} matches {len(hits)} trained SAEs "
                           f"({', '.join(h.name for h in hits)}); give more digits")
    raise SAEError(f"SOURCE: {source!r} is neither a SAELens directory (cfg.json + sae_weights.safetensors) nor the "
                   f"hash of a trained SAE in {root}; list the trained SAEs with `tracekit cache list`")


def export_sae(source: str | Path, to: str | Path, model_name: str | None = None, force: bool = False,
               cache_dir: Path | None = None) -> Path:
    """Write an SAE as a SAELens directory whose ``model_name`` is a hub id.

    The weights (``sae_weights.safetensors``) and sparsity (``sparsity.safetensors``, when present)
    are copied byte for byte; ``cfg.json`` is SOURCE's with ``model_name`` set (in ``metadata`` for
    SAELens >= 6, else at the top level), tracekit's own model name kept as
    ``metadata.tracekit_model`` and a trained SAE's cache key as ``metadata.tracekit_training_hash``.
    The written directory is read back with :func:`tracekit.dictionaries.formats.load_saelens_dir`
    and, where SAELens imports, with ``SAE.load_from_disk``.

    Args:
        source: see :func:`resolve_sae_source`.
        to: the new folder (created; refused when non-empty unless ``force``).
        model_name: the hub id to record (default: :func:`hub_model_id` of the recorded model).
        force: replace an earlier export at ``to`` (only a folder an export wrote).
        cache_dir: the trained SAEs' cache (default :func:`tracekit.sae.sae_cache_dir`).

    Returns:
        The written directory.

    Raises:
        SAEError: SOURCE unknown or unreadable; no hub id known and no ``model_name``; the written
            directory cannot be read back (by tracekit's reader, or by SAELens where it imports).
        OutputError: ``to`` is refused by the export target rule (it is, is inside or contains
            SOURCE; a file; non-empty without ``force``; with ``force``, a folder no export wrote:
            :func:`tracekit.core.exportdir.export_target`), or the write fails (disk full, read-only,
            a file in the way), naming the path.
    """
    src = resolve_sae_source(str(source), cache_dir)
    dest = export_target(to, [src], force)  # refused before anything is read
    try:
        cfg = json.loads((src / "cfg.json").read_text())
    except (OSError, ValueError) as e:
        raise SAEError(f"SOURCE: cannot read {src / 'cfg.json'}: {e}") from e
    meta = cfg.get("metadata") if isinstance(cfg.get("metadata"), dict) else None
    where = meta if meta is not None else cfg
    recorded = where.get("model_name")
    hub = model_name or hub_model_id(where.get("tracekit_model") or recorded)
    if not hub:
        raise SAEError(f"--model-name: the SAE records model {recorded!r}, a local file or folder, not a hub id; "
                       "pass --model-name HUB_ID (e.g. HuggingFaceTB/SmolLM2-135M-Instruct)")
    where["model_name"] = hub
    if recorded and recorded != hub:
        where.setdefault("tracekit_model", recorded)
    rec = src / "tracekit_train.json"
    if rec.is_file():
        try:
            key = json.loads(rec.read_text()).get("key")
        except (OSError, ValueError):
            key = None
        if key:
            where["tracekit_training_hash"] = key
    with export_folder(to, [src], "sae", force) as tmp:
        for f in ("sae_weights.safetensors", "sparsity.safetensors"):
            if (src / f).is_file():
                shutil.copyfile(src / f, tmp / f)
        (tmp / "cfg.json").write_text(json.dumps(cfg, indent=2))
        _check_loads(tmp)
    return dest


def _check_loads(d: Path) -> None:
    """Read ``d`` back to check the export: with tracekit's SAELens-format reader, and with SAELens
    where it imports.

    Raises:
        SAEError: either cannot load it.
    """
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            load_saelens_dir(d, device="cpu")
    except Exception as e:  # noqa: BLE001 - any reader failure is reported as the export's
        raise SAEError(f"SOURCE: the exported directory cannot be read back: {type(e).__name__}: {e}") from e
    if not has_sae_lens():
        return
    from sae_lens import SAE  # lazy: optional extra

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            SAE.load_from_disk(str(d), device="cpu")
    except Exception as e:  # noqa: BLE001 - any SAELens failure is reported as the export's
        raise SAEError(f"SOURCE: SAELens cannot load the exported directory: {type(e).__name__}: {e}") from e


# =============================================================================================
# features -> SAEDashboard / Neuronpedia batch JSON


def _layer_of(hook: str | None) -> int:
    """The block index of a TransformerLens hook name (``blocks.5.hook_resid_post`` -> 5; 0 if none)."""
    m = re.match(r"blocks\.(\d+)\.", str(hook or ""))
    return int(m.group(1)) if m else 0


def _round3(xs) -> list[float]:
    """Floats rounded to 3 decimals, as SAEDashboard's converter writes them."""
    return [round(float(x), 3) for x in xs]


def neuronpedia_batch(tables: dict[str, pd.DataFrame], meta: dict, model_id: str, sae_set: str,
                      dataset: str = "", n_tokens_in_prompt: int = 0, bins: int = 40) -> dict:
    """A ``sae_features`` result's dashboard features as one SAEDashboard / Neuronpedia batch.

    Filled from the result's tables: ``pos_str`` / ``pos_values`` and ``neg_str`` / ``neg_values``
    (the ``vocab`` table: the decoder row through the final norm and unembedding, centred over the
    vocabulary; SAEDashboard's are ``W_dec @ W_U``, uncentred), ``frac_nonzero`` (active corpus
    tokens / tokens scanned), ``freq_hist_data_bar_values`` / ``_heights`` (bin centres / token counts
    of the positive activations, ``bins`` bins), ``activations`` (the top-activating contexts, as
    SAEDashboard's "TOP ACTIVATIONS" group: ``bin_min = -1``, ``bin_max`` = the top activation,
    ``bin_contains = -1``; tokens decoded, values rounded to 3 decimals). Left empty (not computed
    here): neuron alignment, correlated neurons / features, the logits histogram, the decoder
    weight distribution.

    Args:
        tables: the result's tables (``contexts``, ``vocab``, ``density``).
        meta: the result's meta (``dashboard_features``, ``dashboard_tokens``, ``hook``, and
            ``dashboard_windows`` when recorded).
        model_id: Neuronpedia's model id (e.g. ``gpt2-small``).
        sae_set: Neuronpedia's SAE set name.
        dataset: the corpus named in each feature.
        n_tokens_in_prompt: the corpus window length (tokens).
        bins: histogram bins.

    Returns:
        ``{"model_id", "layer", "sae_set", "features": [...]}`` (:data:`NEURONPEDIA_FEATURE_KEYS`).

    Raises:
        SAEError: the result has no dashboards (run ``sae_features`` with ``dashboards:``).
    """
    ctx = tables.get("contexts")
    feats = [int(f) for f in meta.get("dashboard_features", [])]
    if ctx is None or not feats:
        raise SAEError("RESULT_DIR: the result has no feature dashboards; run sae_features with a `dashboards:` block")
    vocab = tables.get("vocab", pd.DataFrame(columns=["feature", "side", "top_rank", "token", "logit"]))
    dens = tables.get("density", pd.DataFrame(columns=["feature", "activation"]))
    n_tok = int(meta.get("dashboard_tokens", 0))
    n_win = meta.get("dashboard_windows")
    if n_win is None and n_tokens_in_prompt:
        n_win = math.ceil(n_tok / n_tokens_in_prompt)  # older results: full windows, the last one shorter
    out = []
    for f in feats:
        v = _where(vocab, "feature", f)
        pos = _where(v, "side", "promoted").sort_values("top_rank")
        neg = _where(v, "side", "suppressed").sort_values("top_rank")
        vals = _where(dens, "feature", f)["activation"].to_numpy(dtype=float)
        counts, edges = np.histogram(vals, bins=bins) if len(vals) else (np.zeros(0), np.zeros(1))
        c = _where(ctx, "feature", f).sort_values("top_rank")
        top = float(c["activation"].to_numpy(dtype=float).max()) if len(c) else 0.0
        acts = [{"bin_min": -1, "bin_max": round(top, 3), "bin_contains": -1, "tokens": json.loads(t),
                 "values": _round3(json.loads(a))} for t, a in zip(c["tokens"], c["token_acts"])]
        feat: dict[str, Any] = {k: [] for k in NEURONPEDIA_FEATURE_KEYS}
        feat.update(feature_index=f, neg_str=[str(t) for t in neg["token"]], neg_values=_round3(neg["logit"]),
                    pos_str=[str(t) for t in pos["token"]], pos_values=_round3(pos["logit"]),
                    frac_nonzero=(len(vals) / n_tok) if n_tok else 0.0,
                    freq_hist_data_bar_values=_round3((edges[:-1] + edges[1:]) / 2),
                    freq_hist_data_bar_heights=[float(x) for x in counts],
                    n_prompts_total=int(n_win or 0), n_tokens_in_prompt=int(n_tokens_in_prompt), dataset=str(dataset),
                    activations=acts)
        out.append(feat)
    return {"model_id": model_id, "layer": _layer_of(meta.get("hook")), "sae_set": sae_set, "features": out}

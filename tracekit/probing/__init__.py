"""Linear probing across layers, with its controls built in.

A linear probe asks "is property X linearly decodable from layer L's activations?" (Alain &
Bengio 2016, "Understanding intermediate layers using linear classifier probes"). It is easy to
fool oneself with, so every function here is written around the controls that make a probe
result mean something (Hewitt & Liang 2019, "Designing and interpreting probes with control
tasks"; Belinkov 2022, "Probing classifiers: promises, shortcomings, and advances").

Modules (each notebook-usable on a model + strings/arrays):

* :mod:`.data` -- :class:`ProbeDataset` (text, label, group, template) from a JSONL/JSON/CSV/TSV
  file read as text (:func:`load_probe_dataset`) or the built-in countries set (:func:`country_dataset`);
* :mod:`.extract` -- :func:`probe_hooks` (site x layer -> hook; layers are block indices),
  :func:`extract_activations` (one batched forward pass per batch, positions via
  :class:`tracekit.tokens.Position`, optional ``fwd_hooks``; spilled to a scratch folder on disk
  above a memory budget), :class:`Activations`;
* :mod:`.splits` -- group-held-out splits (checked), inner folds grouped the same way, shuffled labels;
* :mod:`.fit` -- :func:`fit_probe` (one probe) and :func:`probe_layers` (every layer with its controls,
  bootstrap and decision rule: what ``kind: linear_probe`` runs);
* :mod:`.metrics` -- metrics and the bootstrap over the held-out unit;
* :mod:`.directions` -- :func:`load_probe_directions` from a result.

Notebook use (a doctest, run on a tiny model)::

    >>> from tracekit.probing import country_dataset, probe_hooks, extract_activations, probe_layers
    >>> ds = country_dataset("continent")
    >>> targets = probe_hooks(model.cfg.n_layers, ["resid_post"])
    >>> with extract_activations(model, ds.texts, [h for *_, h in targets], "last") as acts:
    ...     out = probe_layers(acts, ds, targets, group_by="entity")
    >>> table = out.main[["site", "layer", "accuracy", "vs_shuffled", "beats_controls"]]
    >>> len(table) == len(targets)          # one row per (site, layer) probed
    True
"""

from .data import (
    COUNTRY_TEMPLATES,
    ProbeDataset,
    country_dataset,
    load_countries,
    load_probe_dataset,
    probe_dataset_from_frame,
    read_table,
)
from .directions import load_probe_directions
from .extract import EMBEDDING_HOOK, SITES, Activations, extract_activations, probe_hooks, row_positions
from .fit import FittedProbe, LayerProbes, ProbingWarning, fit_probe, probe_layers
from .metrics import bootstrap_metrics, bootstrap_weights, percentile_ci, probe_metrics, split_bootstrap_weights
from .splits import (
                     Split,
                     SplitLeakError,
                     check_no_overlap,
                     control_labels,
                     group_kfold,
                     group_split,
                     held_out_units,
                     inner_splits,
)

__all__ = [
    "ProbeDataset", "load_probe_dataset", "probe_dataset_from_frame", "read_table", "country_dataset", "load_countries", "COUNTRY_TEMPLATES",
    "SITES", "EMBEDDING_HOOK", "probe_hooks", "row_positions", "Activations", "extract_activations",
    "Split", "SplitLeakError", "group_split", "group_kfold", "check_no_overlap", "control_labels", "inner_splits",
    "held_out_units",
    "FittedProbe", "fit_probe", "ProbingWarning", "LayerProbes", "probe_layers",
    "probe_metrics", "bootstrap_weights", "split_bootstrap_weights", "bootstrap_metrics", "percentile_ci",
    "load_probe_directions",
]

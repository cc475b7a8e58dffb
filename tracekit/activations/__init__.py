"""An activation store: rows x hooks x positions cached once on disk, read lazily by other methods.

A store is a folder of sharded safetensors (one tensor per hook, plus each example's row, position
and token id) with a ``manifest.json`` (model identity, hooks, dtype, position, row ids, the sha256
of the rows' token ids, the shard list, ``complete``). :func:`write_store` writes one in bounded
memory and resumes a killed write; :class:`ActivationStore` reads it memory-mapped; probing
(``linear_probe``'s ``store:``) reads it instead of running the model, and a store made from another
model (or lacking a hook) is refused. ``kind: activations`` and ``tracekit cache-activations CONFIG``
write stores from a dataset, prompts or a corpus.

Notebook use (a doctest, run on a tiny model)::

    >>> import tempfile
    >>> from tracekit.activations import ActivationStore, prompt_rows, write_store
    >>> path = tempfile.mkdtemp()
    >>> info = write_store(model, prompt_rows(model, ["The capital of France is", "Hello"], "last"),
    ...                    ["blocks.0.hook_resid_post"], path, position="last", source={"kind": "prompts"})
    >>> store = ActivationStore(path)
    >>> store.get("blocks.0.hook_resid_post").shape[0]   # one example per prompt
    2
"""

from .rows import STORE_POSITION_FORMS, corpus_rows, dataset_rows, prompt_rows, store_position
from .store import FORMAT, MANIFEST, ActivationStore, StoreError, model_identity, shard_name, token_ids_sha256
from .write import DTYPES, StoreRow, write_store

__all__ = ["ActivationStore", "StoreError", "StoreRow", "write_store", "model_identity", "token_ids_sha256",
           "shard_name", "dataset_rows", "prompt_rows", "corpus_rows", "store_position", "STORE_POSITION_FORMS",
           "DTYPES", "FORMAT", "MANIFEST"]

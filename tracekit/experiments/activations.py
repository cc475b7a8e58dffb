"""Writing an activation store as an experiment kind (``kind: activations``).

The rows (a ``dataset``, ``prompts`` or a ``corpus``) x ``hooks`` (or ``sites`` x ``layers``) x
``position`` are run once and written to ``path`` as sharded safetensors with a manifest
(:mod:`tracekit.activations`); a killed write resumes when the step is run again, and a complete
store with the same plan is found up to date without a forward pass. Other steps read the store
(``linear_probe``'s ``store:``, ``tuned: {store: ...}``, ``sae: {train: {store: ...}}``). The result
lists the shards and the hooks; the activations stay in the store, not in the result.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass
from typing import ClassVar, Literal, Optional, Union

import pandas as pd
from pydantic import Field, field_validator, model_validator

from ..activations import (
    ActivationStore,
    StoreRow,
    corpus_rows,
    dataset_rows,
    prompt_rows,
    store_position,
    write_store,
)
from ..activations.write import rows_sha256
from ..core.strict import StrictModel
from ..dataset import DatasetSpec, PreparedDataset
from ..hooks import check_hooks
from ..inputs import input_files
from ..model.context import check_window
from ..model.info import HookedModel
from ..probing import probe_hooks
from ..tokens import PositionSpec
from .base import Experiment, Indices, OptionalPrompts, Result, dataset_meta, register

__all__ = ["CacheActivations", "CacheActivationsInputs", "CacheActivationsResult", "CorpusSource"]

SiteName = Literal["resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out"]


class CorpusSource(StrictModel):
    """Corpus windows as the rows of a store (:func:`tracekit.corpus.token_windows`).

    Fields:
        source: ``stdlib`` (default: offline English text shipped with Python), a ``.txt``/``.md``/
            ``.jsonl`` file, a folder of them, or a list.
        seq_len: tokens per window, BOS included (default 128).
        max_tokens: text tokens stored at most (BOS excluded; default 4096; null: the whole corpus).
        packed: pack documents into windows of exactly ``seq_len`` tokens across document ends (as
            SAELens packs its training contexts) and store every position, the BOS included: the
            store an SAE trains from (``sae.train.store``, with ``context_size`` = ``seq_len``).
            Needs position ``all``. Default false: one document per window, text tokens only.
    """

    source: Union[str, list[str]] = "stdlib"
    seq_len: int = Field(default=128, ge=2)
    max_tokens: Optional[int] = Field(default=4096, ge=1)
    packed: bool = False


@dataclass(frozen=True)
class CacheActivationsInputs:
    """What :meth:`CacheActivations.prepare` builds once: the hooks, and the rows of a dataset or prompts
    (token ids and read positions; None for a corpus, which is streamed during the run)."""

    hooks: tuple[str, ...]
    rows: Optional[tuple[StoreRow, ...]]
    data: Optional[PreparedDataset]

    @property
    def ids(self) -> tuple[tuple[int, ...], ...]:
        """Each row's token ids (as every kind's inputs: ``.ids``); empty for a corpus (streamed in the run)."""
        return tuple(tuple(r.ids) for r in self.rows or ())


class CacheActivationsResult(Result):
    """Tables: ``shards`` (``file``, ``n_examples``, ``row_start``, ``row_end``, ``bytes``, ``sha256``)
    and ``hooks`` (``hook``, ``width``). Summary: ``path``, ``n_rows``, ``n_examples``, ``n_shards``,
    ``shards_written`` / ``shards_reused`` (this run / a killed run before), ``megabytes``,
    ``seconds``, ``up_to_date`` (the store was complete already), ``hooks``, ``position``, ``dtype``."""

    config: "CacheActivations"
    main_table = "shards"

    def summary(self) -> dict:
        m = self.meta
        return {"path": m.get("path"), "n_rows": m.get("n_rows"), "n_examples": m.get("n_examples"),
                "n_shards": m.get("n_shards"), "shards_written": m.get("shards_written"),
                "shards_reused": m.get("shards_reused"), "megabytes": round(float(m.get("bytes") or 0) / 2 ** 20, 3),
                "seconds": m.get("seconds"), "up_to_date": m.get("up_to_date"),
                "hooks": self.tables["hooks"]["hook"].tolist(), "position": m.get("position"),
                "dtype": m.get("dtype")}

    def report(self) -> str:
        s = self.summary()
        state = "already complete" if s["up_to_date"] else \
            f"{s['shards_written']} shard(s) written, {s['shards_reused']} reused"
        return "\n".join([
            f"activation store: {s['path']} ({state})",
            f"{s['n_rows']} rows -> {s['n_examples']} examples at position {s['position']!r}, "
            f"{len(s['hooks'])} hook(s), {s['dtype']}, {s['n_shards']} shard(s), {s['megabytes']:.2f} MiB, "
            f"{s['seconds']} s",
            "read it with linear_probe's store: / tuned.store / sae.train.store (packed corpus) = " + str(s["path"])
            + ", or tracekit.activations.ActivationStore"])


@register
class CacheActivations(Experiment):
    """Cache activations once into a reusable store (sharded safetensors + manifest).

    Fields:
        path: the store folder (created; relative to the working directory). A store of another plan
            there is refused unless ``overwrite``; the same plan resumes or is found up to date.
        prompts: the rows as prompt strings (give one of ``prompts``, ``dataset``, ``corpus``).
        dataset: the rows (:class:`tracekit.dataset.DatasetSpec`: ``rows``, ``path`` or ``generator``);
            named positions (``END``, ``SUBJ``) come from it.
        corpus: corpus windows as rows (:class:`CorpusSource`), for SAE-style token streams.
        hooks: TransformerLens hook names (gated hooks such as ``blocks.1.hook_mlp_in`` are switched on).
        sites: instead of (or beside) ``hooks``: probe sites ``resid_pre``, ``resid_mid``, ``resid_post``,
            ``attn_out``, ``mlp_out`` at every block of ``layers``, plus the embedding baseline
            ``blocks.0.hook_resid_pre`` -- exactly the hooks ``linear_probe`` reads with these sites and layers.
        layers: ``all`` or block indices for ``sites`` (negative counts from the end).
        position: an int (BOS counted), ``last``, ``all`` (every real token, BOS excluded), ``mean``,
            ``token:<text>`` (prompts, dataset) or a named position of the dataset's rows. Default:
            ``last``, or ``all`` on a corpus.
        dtype: ``model`` (default: the activations' own dtype), ``float32``, ``float16``, ``bfloat16``.
        batch_size: rows per forward pass (part of the plan: a resume needs the same).
        shard_mb: target shard size in MiB (a shard closes at the first batch boundary past it).
        overwrite: delete what is at ``path`` (a store of any plan, complete or not) and write it
            afresh (a complete store only while no run has it open for reading). Off (default): a store of another plan there is refused, the same plan resumes
            or is up to date. The plan includes the rows' content (prompts and dataset rows, a
            corpus' files, the Python version of the ``stdlib`` corpus), so an edited input is
            another plan.
    """

    kind: Literal["activations"] = "activations"
    writes_store: ClassVar[str] = "path"  # the field naming the store it writes (read by tracekit.runner.check_config)
    path: str
    prompts: OptionalPrompts = Field(default_factory=list)
    dataset: Optional[DatasetSpec] = None
    corpus: Optional[CorpusSource] = None
    hooks: list[str] = Field(default_factory=list)
    sites: list[SiteName] = Field(default_factory=list)
    layers: Union[Literal["all"], Indices] = "all"
    position: Optional[PositionSpec] = None
    dtype: Literal["model", "float32", "float16", "bfloat16"] = "model"
    batch_size: int = Field(default=16, ge=1)
    shard_mb: float = Field(default=256.0, gt=0)
    overwrite: bool = False

    result_class = CacheActivationsResult

    @field_validator("position")
    @classmethod
    def _pos(cls, v):
        if v is not None:
            store_position(v, "position")
        return v

    @model_validator(mode="after")
    def _one_source(self):
        given = [k for k, v in (("prompts", self.prompts), ("dataset", self.dataset), ("corpus", self.corpus)) if v]
        if len(given) != 1:
            raise ValueError(f"give exactly one of prompts, dataset, corpus as the rows (got {given or 'none'})")
        if not self.hooks and not self.sites:
            raise ValueError("hooks: give the hooks to store (TransformerLens names, e.g. blocks.3.hook_resid_post) "
                             "or sites (with layers)")
        if self.corpus is not None and self.corpus.packed and self.position not in (None, "all"):
            raise ValueError(f"position: a packed corpus (corpus.packed: true) stores every position of its windows; "
                             f"got {self.position!r}: set position: all (or leave it out) or drop corpus.packed")
        return self

    @property
    def position_spec(self) -> str:
        """The position as recorded in the store (``last``, ``all``, ``END``, ``3``...)."""
        if self.position is None:
            return "all" if self.corpus is not None else "last"
        return str(store_position(self.position, "position"))

    def _hooks(self, model: HookedModel) -> list[str]:
        out = list(self.hooks)
        if self.sites:
            layers = None if self.layers == "all" else self.layers
            out += [h for _, _, h in probe_hooks(int(model.cfg.n_layers), self.sites, layers)]
        return list(dict.fromkeys(out))

    def prepare(self, model: HookedModel) -> CacheActivationsInputs:
        """Check the hooks, prepare the dataset or prompts and resolve the position in every row
        (tokenizer and config only: works on a :class:`tracekit.model.ModelInfo`). A corpus is
        streamed during the run.

        Raises:
            HookError: an unknown hook. TokenizationError / DatasetError: a position that does not
                resolve in a row, or a bad dataset. ConfigError: ``corpus.seq_len`` longer than the
                model's context.
        """
        hooks = self._hooks(model)
        check_hooks(model, hooks, "hooks")
        if self.corpus is not None:
            check_window(model, self.corpus.seq_len, "corpus.seq_len")
        data = None
        if self.dataset is not None:
            data = self.dataset.prepare(model, "dataset", batch_size=self.batch_size)
            rows = tuple(dataset_rows(model, data, self.position_spec))
        elif self.prompts:
            rows = tuple(prompt_rows(model, self.prompts, self.position_spec))
        else:
            rows = None
        return CacheActivationsInputs(tuple(hooks), rows, data)

    def _source(self, inputs: CacheActivationsInputs) -> dict:
        """Where the rows come from, recorded in the manifest and part of the store's plan, with
        their content: the prepared rows' keys (prompts, dataset), or the corpus files' sha256 and
        the Python version (whose documentation the ``stdlib`` corpus is)."""
        if self.dataset is not None:
            src = {"kind": "dataset", "dataset": self.dataset.model_dump(mode="json")}
        elif self.corpus is not None:
            src = {"kind": "corpus", **self.corpus.model_dump(mode="json")}
        else:
            src = {"kind": "prompts", "n_prompts": len(self.prompts)}
        if inputs.rows is not None:
            src["rows_sha256"] = rows_sha256(inputs.rows)
        else:
            assert self.corpus is not None
            src["content_sha256"] = {k: v["sha256"] for k, v in input_files({"corpus": self.corpus.source}).items()}
            names = [self.corpus.source] if isinstance(self.corpus.source, str) else list(self.corpus.source)
            if "stdlib" in names:
                src["python"] = platform.python_version()
        return src

    def _run(self, model: HookedModel, inputs: CacheActivationsInputs, progress: bool = True) -> CacheActivationsResult:
        """Write (or resume) the store (:func:`tracekit.activations.write_store`) and describe it."""
        if inputs.rows is not None:
            rows = iter(inputs.rows)
        else:
            assert self.corpus is not None
            rows = corpus_rows(model, self.corpus.source, self.corpus.seq_len, self.corpus.max_tokens,
                               self.position_spec, corpus_field="corpus.source", packed=self.corpus.packed,
                               seq_field="corpus.seq_len")
        info = write_store(model, rows, inputs.hooks, self.path, position=self.position_spec, source=self._source(inputs),
                           dtype=self.dtype, batch_size=self.batch_size, shard_mb=self.shard_mb,
                           overwrite=self.overwrite, progress=progress)
        store = ActivationStore(self.path, "path", verify=False)  # just written or checked by write_store
        man = store.manifest
        shards = pd.DataFrame([{"file": s["file"], "n_examples": s["n_examples"], "row_start": s["rows"][0],
                                "row_end": s["rows"][1], "bytes": s["bytes"], "sha256": s["sha256"]}
                               for s in man["shards"]])
        hooks = pd.DataFrame({"hook": store.hooks, "width": [store.width(h) for h in store.hooks]})
        meta = {**info, "bytes": man.get("bytes"), "position": store.position,
                "dtype": man.get("dtype") or str(man["model"]["dtype"]), "token_ids_sha256": man["token_ids_sha256"],
                "store_model": man["model"]}
        if inputs.data is not None:
            meta["dataset"] = dataset_meta(inputs.data)
        return CacheActivationsResult(self, {"shards": shards, "hooks": hooks}, meta)

"""``kind: token_trace`` -- the "Life of a Token" report: one prompt through every stage.

The engine is :func:`tracekit.trace.token_trace` (it calls the lens, attention, attribution and
neuron engines); this module validates the config and stores the engine's tables; the result class
that renders the report is in :mod:`tracekit.experiments.trace_tables`. ``save`` writes the usual tables/figures plus ``report.html`` (self-contained: figures are
inline base64 PNGs, no network), ``report.md`` and a CSV file of every table the report cuts to its
top rows (``components.csv``, ...; linked from both reports).

Tables: ``tokens``, ``embedding_norms``, ``nearest``, ``analogies``, ``attention`` (last position,
every layer x head x key), ``head_types`` (each head's type and ``measured_on``: what the type was
measured on, :func:`tracekit.trace.type_heads`; a dataset row's named positions type a head that
attends one, ``attends SUBJ``), ``head_scores`` (the picked head's raw scores and
weights), ``top_heads`` (the heads ranked by |direct logit attribution|), ``head_patterns`` (their
query x key patterns, the last :data:`tracekit.trace.PATTERN_WINDOW` positions), ``neurons``
(with a foil: ``contribution`` to the logit difference and ``contribution_target`` to the target
logit alone), ``neuron_values``, ``neuron_contexts``, ``components`` (direct logit
attribution, sums to the logit), ``heads_dla``, ``lens``, ``lens_grid``, ``final_topk``,
``sampling``, ``params``, ``kv_cache``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional, Union

from pydantic import Field, field_validator, model_validator

from ..core.errors import DatasetError
from ..model.info import HookedModel
from ..model.load import bos_info, model_spec_of
from ..tokens import single_token_id
from ..trace import (
    parse_head,
    token_trace,
)
from .base import (
    DatasetSpec,
    Experiment,
    OptionalPrompts,
    check_dataset_fields,
    encode_prompts,
    kind_dataset,
    register,
)
from .trace_tables import MAX_TABLE_ROWS, TOP_COMPONENTS, TokenTraceResult

__all__ = ["TokenTrace", "TokenTraceInputs", "TokenTraceResult", "MAX_TABLE_ROWS", "TOP_COMPONENTS"]

@dataclass(frozen=True)
class TokenTraceInputs:
    """What :meth:`TokenTrace.prepare` builds once: the prompt's token ids, the target and foil ids
    (None: the model's top-1 / no foil) and the head shown as ``(layer, head)`` (None: picked by the run);
    ``key_prompts``: the dataset's prompts the FFN contexts are read from (empty: the corpus)."""

    ids: tuple[int, ...]
    target_id: Optional[int]
    foil_id: Optional[int]
    head: Optional[tuple[int, int]]
    prompt: str = ""
    target: Optional[str] = None
    foil: Optional[str] = None
    row_id: Optional[int] = None
    #: the dataset row's named positions (name -> token index, BOS counted); empty for prompts
    positions: tuple[tuple[str, int], ...] = ()
    key_prompts: tuple[str, ...] = ()
    key_prompts_name: str = ""


@register
class TokenTrace(Experiment):
    """The "Life of a Token" trace of one prompt: every stage in one report.

    Engine: :func:`tracekit.trace.token_trace`.

    Fields:
        prompts: the text traced (one prompt; a string or a list of one); or
        dataset / row: a dataset (:mod:`tracekit.dataset`) and the index of the row traced (default 0,
            after ``filter``): its prompt, its own target and foil.
        target: the next token followed (exactly one token, leading space included); default: the
            model's top-1 prediction.
        foil: optional second token; the attribution splits ``logit[target] - logit[foil]``.
        head: head whose raw scores are shown, ``"L0H6"`` or ``[0, 6]``; default: L0H6 on GPT-2 (the
            article's head), else the prompt's top head by |direct logit attribution|.
        top_heads: heads drawn as query x key patterns (ranked by |direct logit attribution|).
        top_neurons, value_tokens, key_contexts, key_max_tokens: FFN section sizes (``key_max_tokens``
            0 skips the corpus key readout).
        key_corpus: where the FFN neurons' top-activating contexts come from: default the run's own
            dataset's prompts when a dataset is given (contexts of the task's text), else the offline
            ``stdlib`` corpus (Python's documentation); or ``stdlib`` / a text, JSONL or directory
            path (:mod:`tracekit.corpus`). The report says which ("contexts from: ...").
        top_k: final tokens listed; seed, n_samples: sampling draws.
    """

    kind: Literal["token_trace"] = "token_trace"
    prompts: OptionalPrompts = Field(default_factory=list, description="The text traced through the model: one prompt (a string, or a list "
                             "of one; sweep it to trace several).")
    target: Optional[str] = Field(default=None, description="Next token followed (one token, leading space "
                                  "included); default: the model's top-1 prediction.")
    foil: Optional[str] = Field(default=None, description="Optional second token: attribution of "
                                "logit[target] - logit[foil].")
    head: Optional[Union[str, list[int]]] = Field(default=None, description="Head whose raw attention scores are "
                                                  "shown, e.g. 'L0H6'; default: L0H6 on GPT-2 (the article's "
                                                  "head), else the prompt's top head by |direct logit attribution|.")
    top_heads: int = Field(default=6, ge=1, le=24, description="Heads drawn as query x key attention patterns, "
                           "ranked by |direct logit attribution| to the target (minus the foil).")
    top_neurons: int = Field(default=5, ge=1, le=100, description="Neurons shown at the lens jump block.")
    value_tokens: int = Field(default=5, ge=1, le=100, description="Promoted tokens listed per neuron.")
    key_contexts: int = Field(default=3, ge=1, le=50, description="Top-activating corpus contexts per neuron.")
    key_max_tokens: int = Field(default=1024, ge=0, description="Corpus text tokens read for the key readout "
                                "(0 skips it).")
    key_corpus: Optional[str] = Field(default=None, description="Where the FFN neurons' top-activating contexts "
                                      "come from: default the dataset's prompts when a dataset is given, else the "
                                      "offline 'stdlib' corpus (Python's documentation); or 'stdlib' or a text/JSONL "
                                      "file or directory.")
    dataset: Optional[DatasetSpec] = Field(default=None, description="Rows to trace one of (instead of prompts); "
                                           "the row's own target and foil are followed.")
    row: int = Field(default=0, ge=0, description="Index of the dataset row traced (after the dataset's filter).")
    top_k: int = Field(default=10, ge=1, le=1000, description="Final tokens listed.")
    seed: int = Field(default=0, description="Seed of the sampling draws.")
    n_samples: int = Field(default=5, ge=1, le=100, description="Draws per sampling setting.")

    result_class = TokenTraceResult
    retired = {"answer": "target", "wrong": "foil", "prompt": "prompts"}

    @field_validator("prompts")
    @classmethod
    def _one_prompt(cls, v):
        if len(v) > 1:
            raise ValueError(f"a token trace follows one prompt, got {len(v)}; use one step per prompt (or a sweep)")
        return v

    @model_validator(mode="after")
    def _rows(self):
        check_dataset_fields(self.prompts, self.dataset, self.target if self.dataset is not None else None,
                             self.foil if self.dataset is not None else None)
        if self.dataset is None and self.row:
            raise ValueError("row selects a dataset row; give dataset (or drop row)")
        return self

    @field_validator("head")
    @classmethod
    def _head(cls, v):
        if isinstance(v, list) and len(v) != 2:
            raise ValueError("give a head as 'L0H6' or [layer, head]")
        return v

    def prepare(self, model: HookedModel) -> TokenTraceInputs:
        """Tokenize the prompt, resolve the target/foil ids and the head shown (tokenizer and config
        only: works on a :class:`tracekit.model.ModelInfo`).

        Raises:
            CorpusError: ``key_corpus`` names no readable corpus (naming ``key_corpus``), before any work.
        """
        if self.key_corpus is not None:
            from ..corpus import iter_documents

            next(iter_documents(self.key_corpus, field="key_corpus"), None)  # lazy: opens the first source only
        if self.dataset is None:
            ids = encode_prompts(model, self.prompts)[0]
            target_id = single_token_id(model, self.target, field="target") if self.target is not None else None
            foil_id = single_token_id(model, self.foil, field="foil") if self.foil is not None else None
            return TokenTraceInputs(ids, target_id, foil_id, parse_head(self.head, model), self.prompts[0],
                                    self.target, self.foil)
        data = kind_dataset(model, None, self.dataset)
        if self.row >= len(data):
            raise DatasetError(f"row: {self.row} is out of range for a dataset of {len(data)} rows "
                               f"(after {dict(data.dropped) or 'no drops'}); use 0..{len(data) - 1}")
        e = data.examples[self.row]
        own = self.key_corpus is None  # the contexts come from the dataset's own prompts
        return TokenTraceInputs(e.ids, e.target_id, e.foil_id, parse_head(self.head, model), e.prompt,
                                e.row.target, e.row.foil, e.row_id,
                                positions=tuple((str(k), int(v)) for k, v in e.positions.items()),
                                key_prompts=tuple(x.prompt for x in data.examples) if own else (),
                                key_prompts_name=f"the run's dataset ({data.source}, {len(data)} prompts)" if own else "")

    def _run(self, model: HookedModel, inputs: TokenTraceInputs, progress: bool = True) -> TokenTraceResult:
        # The engine (tracekit.trace.token_trace) takes the prompt string and tokenizes it in each of
        # its stages (lens, attribution, attention; no ids parameter yet).
        tr = token_trace(model, inputs.prompt, inputs.target, inputs.foil, self.head, self.top_neurons, self.value_tokens,
                         self.key_contexts, self.key_max_tokens, corpus=self.key_corpus, top_k=self.top_k,
                         seed=self.seed, n_samples=self.n_samples, top_heads=self.top_heads,
                         positions=dict(inputs.positions) or None,
                         key_prompts=inputs.key_prompts or None, key_prompts_name=inputs.key_prompts_name)
        meta = {**tr.meta, "row_id": inputs.row_id, "model": model_spec_of(model).model_dump(mode="json"), "tokenization": bos_info(model)}
        return TokenTraceResult(self, tr.tables, meta)

"""Every kind tokenizes its prompts once, in ``prepare``; ``_run`` reuses the prepared ids.

Each call of :func:`tracekit.tokens.encode` (which ``tokenize`` and ``single_token_id`` go through)
is counted per text, with where it came from: inside a kind's ``prepare``, or later in the run,
from a kind module itself or from an engine. Where an engine takes prompt strings and tokenizes
them itself (it has no ids parameter yet), the kind keeps the engine call and says so in ``_run``;
:data:`ENGINE_TOKENIZES` names those engines. The kind modules never tokenize a prompt again.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

import tracekit as tk
from helpers import KIND_EXAMPLES, counting_encodes, kind_run, make_tiny
from tracekit.experiments.base import REGISTRY

#: Kinds whose engine still takes prompt strings (each prompt is tokenized there once more per call).
ENGINE_TOKENIZES = {
    "neuron_attribution": "tracekit.neurons.neuron_contributions / neuron_intervention",
    "attention_pattern": "tracekit.attention.attention_pattern",
    "linear_probe": "tracekit.probing.extract_activations",
    "sae_features": "tracekit.sae.feature_decomposition / feature_intervention",
    "token_trace": "tracekit.trace.token_trace",
}


@pytest.fixture(scope="module")
def model():
    m = make_tiny("gpt2")
    m(torch.tensor([[464, 3139]]))  # the bridge wires its own capture hooks on a first forward
    return m


def _prompts(exp) -> list[str]:
    """Every prompt text a kind tokenizes (pairs: clean and corrupted; probes: the dataset rows)."""
    if exp.kind == "activation_patching":
        return [t for p in exp.all_pairs() for t in (p.clean, p.corrupted)] + list(exp.baseline_prompts)
    if exp.kind == "linear_probe":
        return list(exp.dataset.load(exp.task).texts)
    return list(getattr(exp, "prompts", None) or [])


@pytest.fixture()
def encodes(monkeypatch):
    """A list of ``(text, in_prepare, caller module)``, one per ``tracekit.tokens.encode`` call
    (helpers.counting_encodes: inside a kind's prepare, module of the first caller outside tracekit.tokens)."""
    return counting_encodes(monkeypatch)


def _exp(kind: str):
    return REGISTRY[kind].model_validate({"kind": kind, **KIND_EXAMPLES[kind]})


@pytest.mark.parametrize("kind", sorted(REGISTRY))
def test_run_tokenizes_each_prompt_once(kind):
    exp = _exp(kind)
    prompts = _prompts(exp)
    # the run of exp's config on the tiny GPT-2 is shared with test_kinds / test_notebook (helpers.kind_run),
    # which counts every encode call during it
    encodes = kind_run(kind).encodes
    prepared = Counter(t for t, in_prepare, _ in encodes if in_prepare)
    later = [(t, caller) for t, in_prepare, caller in encodes if not in_prepare and t in prompts]
    for p in prompts:
        assert prepared[p] == 1, f"{kind}: prepare tokenized {p!r} {prepared[p]} times"
    kind_calls = [(t, c) for t, c in later if c.startswith("tracekit.experiments")]
    assert not kind_calls, f"{kind}: the kind tokenized prompts again after prepare: {kind_calls}"
    if kind not in ENGINE_TOKENIZES:
        assert not later, f"{kind}: prompts tokenized again during the run: {later}"
    else:  # documented: the engine takes strings; nothing else tokenizes the prompts again
        assert all(not c.startswith("tracekit.experiments") for _, c in later)


def test_runner_path_prepares_once(model, encodes):
    """``run(check=False)`` (the runner's call, after checking on a ModelInfo) prepares once too."""
    exp = _exp("activation_patching")
    exp.run(model, progress=False, check=False)
    counts = Counter(t for t, _, _ in encodes)
    assert all(counts[p] == 1 for p in _prompts(exp)), counts


@pytest.mark.parametrize("kind", sorted(k for k in REGISTRY if k not in ("sae_eval", "sae_train", "transcoder_train")))
def test_check_on_model_info_prepares_the_same_ids(kind, model):
    """``check`` returns the prepared inputs; on a ModelInfo (no weights) they equal the loaded model's."""
    exp = _exp(kind)
    info = tk.load_model_info(tk.model_spec_of(model).model_copy())
    from_info, from_model = exp.check(info), exp.prepare(model)
    assert type(from_info) is type(from_model)
    assert _ids(from_info) == _ids(from_model) and len(_ids(from_model)) > 0


def _ids(inputs) -> tuple:
    if hasattr(inputs, "clean_ids"):
        return inputs.clean_ids + inputs.corrupted_ids
    if hasattr(inputs, "ids"):
        return inputs.ids
    return tuple(tuple(e.ids) for e in inputs.data.examples)  # kinds that keep their Rows (attribution_graph)


@pytest.mark.parametrize("kind", ["sae_eval", "sae_train", "transcoder_train"])
def test_kinds_without_prompts_prepare_nothing(kind, model):
    assert _exp(kind).prepare(model) is None


def test_tracekit_run_prepares_each_step_once(model, tmp_path, monkeypatch):
    """``tracekit run`` (:func:`tracekit.runner.run_config`): the check before the run prepares each
    step's inputs on a ModelInfo, and the step's run reuses them (``Experiment.run(inputs=...)``):
    ``prepare`` runs once per step. A dataset with ``filter: correct`` needs the weights to pick its
    rows, so that step prepares again on the loaded model (twice); numbers equal a direct run."""
    from tracekit.config import parse_config
    from tracekit.runner import run_config

    calls: Counter = Counter()
    for kind in ("logit_lens", "activation_patching", "direct_logit_attribution"):
        cls = REGISTRY[kind]
        orig = cls.prepare

        def counting(self, m, _orig=orig):
            calls[self.step_name] += 1
            return _orig(self, m)

        monkeypatch.setattr(cls, "prepare", counting)
    spec = tk.model_spec_of(model).model_dump(mode="json")
    steps = [{"kind": "logit_lens", "name": "lens", **KIND_EXAMPLES["logit_lens"]},
             {"kind": "activation_patching", "name": "patch", **KIND_EXAMPLES["activation_patching"]},
             {"kind": "direct_logit_attribution", "name": "filtered",
              "dataset": {"generator": {"name": "capitals", "n": 4}, "filter": "correct"}}]
    cfg = parse_config({"model": spec, "experiments": steps})
    run_dir, summary = run_config(cfg, tmp_path, "once", progress=False, log=lambda *a, **k: None, figures=False)
    assert calls["lens"] == 1 and calls["patch"] == 1, calls
    assert calls["filtered"] == 2, calls
    direct = _exp("logit_lens").run(model, progress=False).summary()
    assert summary["steps"]["lens"] == direct == tk.Result.load(run_dir / "lens").summary()

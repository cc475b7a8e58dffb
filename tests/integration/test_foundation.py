"""The shared foundation: positions, BOS default, context length, special tokens, readable tokens,
one weight load per model, no state surviving a call, atomic results, notebook figures."""

from __future__ import annotations

import json

import matplotlib.pyplot as plt
import pytest
import torch

import tracekit as tk
from helpers import GPT2_BPE, make_perturbed, make_tiny
from tracekit.errors import ResultLoadError, TokenizationError
from tracekit.hooks import state_guard
from tracekit.tokens import encode, parse_position, single_token_id, tokenize

# ---- positions -------------------------------------------------------------------------------

def test_position_forms_and_errors(tiny_gpt2):
    text = "The capital of France is"
    ids = encode(tiny_gpt2, text)
    assert parse_position(-1).resolve(tiny_gpt2, text, ids) == [len(ids) - 1]
    assert parse_position("last").resolve(tiny_gpt2, text, ids) == [len(ids) - 1]
    assert parse_position("2").resolve(tiny_gpt2, text, ids) == [2]
    assert parse_position("token: France").resolve(tiny_gpt2, text, ids) == [ids.index(4881)]
    first = 1 if ids[0] == tiny_gpt2.tokenizer.bos_token_id else 0  # `all` skips a prepended BOS
    assert parse_position("all").resolve(tiny_gpt2, text, ids) == list(range(first, len(ids)))
    assert parse_position("all").resolve(tiny_gpt2, text, ids, skip_bos=False) == list(range(len(ids)))
    with pytest.raises(TokenizationError, match="out of range"):
        parse_position(40).resolve(tiny_gpt2, text, ids)
    with pytest.raises(TokenizationError, match="does not occur"):
        parse_position("token: Rome").resolve(tiny_gpt2, text, ids)
    with pytest.raises(TokenizationError, match="token: is"):
        parse_position(" is")  # a bare token string: the message shows the token: form
    with pytest.raises(TokenizationError, match="not accepted here"):
        parse_position("mean", allowed=("int", "last"))


# ---- BOS -------------------------------------------------------------------------------------

def test_bos_default_follows_the_tokenizer():
    """GPT-2's tokenizer adds no BOS: under the default the article's ids start at 464."""
    m = make_tiny("gpt2", prepend_bos="auto")
    assert tk.model_spec_of(m).prepend_bos is False
    assert encode(m, "The capital of France is") == [464, 3139, 286, 4881, 318]
    res = tk.LogitLens(prompts=["The capital of France is"]).run(m, progress=False)
    assert res.meta["tokenization"] == {"prepend_bos": False, "bos_token": None, "bos_token_id": None}
    forced = make_tiny("gpt2", prepend_bos=True)
    assert encode(forced, "The")[0] == forced.tokenizer.bos_token_id
    assert tk.LogitLens(prompts=["The"]).run(forced, progress=False).meta["tokenization"]["bos_token_id"] == 50256


def test_bos_default_when_the_tokenizer_adds_one():
    from transformers import GPT2TokenizerFast

    from tracekit.model.spec import tokenizer_adds_bos

    tok = GPT2TokenizerFast.from_pretrained(GPT2_BPE)
    assert tokenizer_adds_bos(tok) is False
    tok2 = GPT2TokenizerFast.from_pretrained(GPT2_BPE, add_bos_token=True)
    assert tokenizer_adds_bos(tok2) is True
    assert tk.ModelSpec(prepend_bos="auto").resolved_prepend_bos(tok2) is True


def test_special_token_text_is_text(tiny_gpt2):
    """A prompt containing the BOS string no longer gets a second BOS (control token)."""
    m = make_tiny("gpt2", prepend_bos=True)
    ids = encode(m, "<|endoftext|> hello")
    assert ids.count(50256) == 1 and ids[0] == 50256


# ---- context length --------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_prompt_longer_than_context_is_refused_before_work(arch):
    m = make_tiny(arch)
    n_ctx = int(m.cfg.n_ctx)
    long = "hello " * (n_ctx + 5)
    with pytest.raises(TokenizationError, match=rf"prompts\[1\].*longer than the model's context of {n_ctx}"):
        tk.LogitLens(prompts=["short", long]).check(m)
    with pytest.raises(TokenizationError, match="context"):
        tokenize(m, [long])


# ---- readable tokens -------------------------------------------------------------------------

def test_non_english_target_shows_bytes_and_suggests_only_text(tiny_gpt2):
    with pytest.raises(TokenizationError) as e:
        single_token_id(tiny_gpt2, "巴黎")
    msg = str(e.value)
    assert "\ufffd" not in msg  # no replacement characters
    assert "<bytes" in msg and "'巴'" in msg
    assert "such as" not in msg or "'\\ufffd'" not in msg


# ---- one load per model ----------------------------------------------------------------------

def test_other_padding_or_bos_or_processing_does_not_reload_weights(monkeypatch):
    import tracekit.model.load as M
    import tracekit.model.source as S

    spec = tk.ModelSpec(name="llama", random_init=True, tokenizer=GPT2_BPE, device="cpu", seed=123,
                        config_overrides={"num_hidden_layers": 2, "tie_word_embeddings": True})
    first = M.load_model(spec)
    calls = []
    real = S.load_hf
    monkeypatch.setattr(S, "load_hf", lambda *a, **k: calls.append(1) or real(*a, **k))
    x = torch.tensor([[464, 3139, 286, 4881, 318]])
    ref = torch.log_softmax(first(x).float(), -1)
    for upd in ({"padding_side": "left"}, {"prepend_bos": False}, {"process_weights": False}):
        other = M.load_model(spec.model_copy(update=upd))
        assert other is not first
        assert (torch.log_softmax(other(x).float(), -1) - ref).abs().max() < 1e-5
    assert calls == []  # no second read of the weights
    assert torch.equal(torch.log_softmax(first(x).float(), -1), ref)  # the first model is untouched


# ---- no state survives a call ----------------------------------------------------------------

@pytest.mark.parametrize("exc", [RuntimeError("CUDA out of memory"), KeyboardInterrupt()])
def test_state_guard_removes_hooks_and_flags_whatever_is_raised(exc):
    m = make_perturbed("gpt2")
    x = torch.tensor([[464, 3139, 286, 4881, 318]])
    ref = m(x).clone()
    hooks_before = {name: set(getattr(mod, "_forward_hooks", {})) | set(getattr(mod, "_forward_pre_hooks", {}))
                    for name, mod in m.named_modules()}

    def poison(act, hook):
        return act * 0

    with pytest.raises(type(exc)):
        with state_guard(m):
            m.add_hook("blocks.0.hook_resid_post", poison)
            m.blocks[1].register_forward_hook(lambda mod, i, o: o * 0)
            m.set_use_hook_mlp_in(True)
            raise exc
    assert torch.equal(m(x), ref)
    assert not m.cfg.use_hook_mlp_in
    after = {name: set(getattr(mod, "_forward_hooks", {})) | set(getattr(mod, "_forward_pre_hooks", {}))
             for name, mod in m.named_modules()}
    assert after == hooks_before


def test_state_guard_keeps_the_bridges_own_lazy_hooks():
    """TransformerLens wires hook_mlp_in capture hooks on the first forward and remembers it with a
    flag: a guard around that first forward must keep them, or hook_mlp_in would never fire again."""
    from helpers import make_tiny as fresh_tiny

    m = fresh_tiny("gpt2", seed=99)  # a model that has not run yet
    with state_guard(m):
        m(torch.tensor([[464, 3139]]))
    from tracekit.tokens import run_with_cache, tokenize

    _, cache = run_with_cache(m, tokenize(m, ["The capital of France is"]), ["blocks.1.hook_mlp_in"])
    assert cache["blocks.1.hook_mlp_in"].abs().sum() > 0


def test_user_hooks_added_before_a_run_are_kept():
    m = make_tiny("gpt2")
    with m.hooks(fwd_hooks=[("blocks.0.hook_resid_post", lambda a, hook: a)]):
        tk.LogitLens(prompts=["a b"]).run(m, progress=False)
        assert m.hook_dict["blocks.0.hook_resid_post"].fwd_hooks  # still there inside the user's block
    assert not m.hook_dict["blocks.0.hook_resid_post"].fwd_hooks


# ---- results ---------------------------------------------------------------------------------

def test_interrupted_save_leaves_nothing_that_loads(tmp_path, monkeypatch):
    m = make_tiny("gpt2")
    res = tk.LogitLens(prompts=["a b"], target=" Paris").run(m, progress=False)
    from matplotlib.figure import Figure

    def fail(*a, **k):
        raise RuntimeError("killed while writing figures")

    monkeypatch.setattr(Figure, "savefig", fail)
    with pytest.raises(RuntimeError):
        res.save(tmp_path / "r")
    assert not (tmp_path / "r").exists() and not list(tmp_path.iterdir())  # temp folder removed too
    # a folder without a complete manifest is refused with what is missing
    monkeypatch.undo()
    d = res.save(tmp_path / "ok")
    (d / "main.parquet").unlink()
    with pytest.raises(ResultLoadError, match="main.parquet is missing"):
        tk.Result.load(d)
    (d / "manifest.json").unlink()
    with pytest.raises(ResultLoadError, match="did not finish"):
        tk.Result.load(d)


def test_save_into_an_existing_folder_replaces_it(tmp_path):
    m = make_tiny("gpt2")
    res = tk.LogitLens(prompts=["a b"], target=" Paris").run(m, progress=False)
    d = res.save(tmp_path / "r")
    (d / "stale.parquet").write_text("old")
    res.save(d)
    assert not (d / "stale.parquet").exists()
    assert json.loads((d / "manifest.json").read_text())["kind"] == "logit_lens"


def test_plot_leaves_only_the_returned_figure_open():
    m = make_tiny("gpt2")
    res = tk.LogitLens(prompts=["a b"], target=" Paris", position="all").run(m, progress=False)
    plt.close("all")
    for _ in range(12):
        res.plot()
    assert len(plt.get_fignums()) == 12
    plt.close("all")


def test_figures_stay_readable_with_many_prompts():
    m = make_tiny("gpt2")
    res = tk.LogitLens(prompts=[f"prompt number {i} is" for i in range(64)], target=" Paris",
                       batch_size=64).run(m, progress=False)
    fig = res.figures()["target_by_layer"]
    w, h = fig.get_size_inches() * fig.dpi
    assert h < 1000 and len(fig.axes[0].get_legend().get_texts()) <= 3
    plt.close("all")

"""End to end on the real embedded model (SmolLM2-135M-Instruct, GGUF Q4_1 -> float32)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import tracekit as tk

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "The capital of China is Beijing. The capital of France is"


@pytest.mark.slow
def test_main_job_through_the_cli(tmp_path):
    """The README's main job: ' Paris' is the final top-1 for the few-shot prompt."""
    r = subprocess.run([sys.executable, "-m", "tracekit.cli", "run",
                        str(ROOT / "experiments/paris_logit_lens_smollm2.yaml"), "--out", str(tmp_path),
                        "--no-progress", "--strict"], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    run_dir = next(tmp_path.iterdir())
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["final_top1"] == " Paris"
    assert s["target_rank_by_hidden_state"][-1] == 1
    assert s["emergence_layer"] == 28 and s["jump_layer"] == 29  # README: top-1 from block 28's output on
    assert s["target_prob_final"] > 0.5
    assert s["expectations_met"] == s["expectations_total"]
    assert (run_dir / "paris" / "top1_grid.png").exists()


@pytest.mark.slow
def test_embedded_lens_last_layer_equals_output(embedded_model):

    res = tk.LogitLens(prompts=[PROMPT, "The capital of Italy is"], target=[" Paris", " Rome"]).run(
        embedded_model, progress=False)
    df = res.to_frame()
    last = df[df["hidden_state"] == df["hidden_state"].max()].merge(res.tables["final"],
                                                                    on=["prompt_idx", "position", "target"])
    assert (last["prob"] - last["target_prob"]).abs().max() < 1e-5
    s = res.summary()
    assert s["emergence_layer_by_row"][0] is not None
    # BOS default follows the tokenizer: SmolLM2's adds none, so no <|im_start|> is prepended
    bos = embedded_model.tokenizer.bos_token_id
    toks = res.tables["tokens"]
    assert (toks["token_id"] == bos).sum() == 0
    assert res.meta["tokenization"] == {"prepend_bos": False, "bos_token": None, "bos_token_id": None}


@pytest.mark.slow
def test_model_info_reads_the_warm_weight_cache(embedded_model, monkeypatch):
    """Once the weights are cached, checking a config reads the tokenizer and config from the cache
    entry (no GGUF parse), and they are the loaded model's."""
    import tracekit.model.info as I
    import tracekit.model.source as S

    def no_parse(*a, **k):
        raise AssertionError("the GGUF was parsed although the cache has the entry")

    monkeypatch.setattr(S, "_tokenizer_for", no_parse)
    monkeypatch.setattr(I, "_INFO", {})
    info = I.load_model_info(tk.ModelSpec(device="cpu", padding_side="left"))  # not the loaded spec: no shortcut
    assert info.cfg.n_layers == embedded_model.cfg.n_layers and info.cfg.d_mlp == embedded_model.cfg.d_mlp
    text = "The capital of China is Beijing. The capital of France is"
    from tracekit.tokens import encode

    assert encode(info, text, prepend_bos=False) == encode(embedded_model, text, prepend_bos=False)
    assert tk.model_spec_of(embedded_model).prepend_bos == info.tracekit_spec.prepend_bos


@pytest.mark.slow
def test_verify_passes_every_check_on_the_embedded_model(tmp_path, capsys):
    """`tracekit verify` on the embedded default: every check within tolerance (none refused)."""
    from tracekit.cli import main

    rc = main(["verify", "--device", "cpu", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    rep = json.loads((tmp_path / "verify.json").read_text())
    assert rep["architecture"] == "LlamaForCausalLM" and rep["passed"]
    assert {c["status"] for c in rep["checks"]} == {"pass"}, out

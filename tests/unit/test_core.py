"""tracekit.core and the model-free pieces above it (metrics, positions, the output transform,
probing splits): no model loads here, every test runs in milliseconds."""

from __future__ import annotations

import json
import signal
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch

from tracekit.core import io, paths, signals, sites
from tracekit.core.errors import AttentionError, AttributionError, PatchingError, ProbingError, TracekitError
from tracekit.core.strict import Indices, Prompts, StrictModel

# ----------------------------------------------------------------------------------- field paths


@pytest.mark.parametrize("text,keys", [
    ("model.name", ("model", "name")),
    ("experiments[0].target", ("experiments", 0, "target")),
    ("experiments.0.target", ("experiments", 0, "target")),
    ("a['key with spaces'].b", ("a", "key with spaces", "b")),
    ('summary["p[8]"]', ("summary", "p[8]")),
    ("x[-1]", ("x", -1)),
])
def test_paths_parse_and_format_round_trip(text, keys):
    assert paths.parse(text) == keys
    assert paths.parse(paths.fmt(keys)) == keys if not any(isinstance(k, str) and ("[" in k or " " in k)
                                                             for k in keys) else True


@pytest.mark.parametrize("bad", ["", "a..b[", "a[x"])
def test_paths_refuse_unparsable(bad):
    with pytest.raises(paths.PathError):
        paths.parse(bad)


def test_paths_get_names_what_exists():
    cfg = {"experiments": [{"kind": "logit_lens", "layers": [1, 2]}]}
    assert paths.get(cfg, "experiments[0].layers[-1]") == 2
    with pytest.raises(KeyError, match=r"experiments\[0\] has no key 'target'; keys: \['kind', 'layers'\]"):
        paths.get(cfg, "experiments[0].target")
    with pytest.raises(IndexError, match=r"experiments has 1 items; \[3\] is out of range"):
        paths.get(cfg, "experiments[3]")
    with pytest.raises(TypeError, match="is a list"):
        paths.get(cfg, "experiments.kind")


def test_paths_set_creates_mappings_not_list_items():
    cfg: dict = {"experiments": [{}]}
    value = [1, 2]
    paths.set_path(cfg, "experiments[0].layers", value)
    value.append(3)  # copied: the config does not change with the caller's list
    paths.set_path(cfg, "model.device", "cpu")
    assert cfg == {"experiments": [{"layers": [1, 2]}], "model": {"device": "cpu"}}
    with pytest.raises(paths.PathError, match=r"index \[2\] does not exist \(the list has 1 item\)"):
        paths.set_path(cfg, "experiments[2].target", "x")
    with pytest.raises(paths.PathError, match="not inside a mapping"):
        paths.set_path(cfg, "model.device.x", 1)


# ------------------------------------------------------------------------------- strict configs


class _Cfg(StrictModel):
    retired = {"answer": "target", "prompt": "prompts; a list now"}
    retired_values = {"sites": {"resid": "resid_post"}}
    prompts: Prompts
    target: str = " x"
    sites: list[str] = ["resid_pre"]
    layers: Indices = [0]


def test_strict_refuses_unknown_and_non_finite():
    with pytest.raises(ValueError, match="targte"):
        _Cfg(prompts="a", targte=" y")
    with pytest.raises(ValueError, match="finite"):
        class F(StrictModel):
            x: float
        F(x=float("inf"))


def test_retired_keys_and_values_are_named_all_at_once():
    with pytest.raises(ValueError) as e:
        _Cfg(prompt="a", answer=" b", sites=["resid_pre", "resid"])
    msg = str(e.value)
    assert "'prompt' was renamed to 'prompts' (a list now)" in msg
    assert "'answer' was renamed to 'target'" in msg
    assert "sites[1]: 'resid' was renamed to 'resid_post'" in msg


def test_prompts_and_indices_types():
    assert _Cfg(prompts="one").prompts == ["one"]
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        _Cfg(prompts=["a", ""])
    with pytest.raises(ValueError, match="at least 1"):
        _Cfg(prompts=[])
    with pytest.raises(ValueError, match="selects nothing"):
        _Cfg(prompts="a", layers=[])


# ---------------------------------------------------------------------------- atomic writes, io


def test_atomic_write_leaves_no_temp_and_keeps_old_file_on_failure(tmp_path):
    p = tmp_path / "out.json"
    io.write_json(p, {"a": np.float32(1.5), "b": torch.tensor([1, 2]), "c": float("nan")})
    assert json.loads(p.read_text()) == {"a": 1.5, "b": [1, 2], "c": None}

    def boom(tmp):
        tmp.write_text("half")
        raise OSError("disk full")
    with pytest.raises(OSError, match="disk full"):
        io.atomic_write(p, boom)
    assert json.loads(p.read_text())["a"] == 1.5  # the earlier file is intact
    assert [q.name for q in tmp_path.iterdir()] == ["out.json"]  # no temporary left


def test_files_manifest_detects_a_flipped_byte(tmp_path):
    d = tmp_path / "entry"
    d.mkdir()
    (d / "w.bin").write_bytes(bytes(range(256)))
    io.write_files_manifest(d, {"key": "k"})
    assert io.verify_files_manifest(d, required=("w.bin",))["key"] == "k"
    raw = bytearray((d / "w.bin").read_bytes())
    raw[100] ^= 1
    (d / "w.bin").write_bytes(bytes(raw))  # same size
    with pytest.raises(io.ManifestInvalid, match="sha256"):
        io.verify_files_manifest(d, required=("w.bin",))
    (d / "w.bin").write_bytes(bytes(raw[:10]))
    with pytest.raises(io.ManifestInvalid):
        io.verify_files_manifest(d)


def test_atomic_folder_is_all_or_nothing(tmp_path):
    target = tmp_path / "run"
    with pytest.raises(RuntimeError):
        with io.atomic_folder(target) as tmp:
            (tmp / "a.txt").write_text("x")
            raise RuntimeError("killed")
    assert not target.exists() and not list(tmp_path.iterdir())
    with io.atomic_folder(target) as tmp:
        (tmp / "a.txt").write_text("x")
    assert (target / "a.txt").read_text() == "x"


# -------------------------------------------------------------------------------- interrupts


def test_interrupt_handlers_stack_and_restore():
    before = signal.getsignal(signal.SIGTERM)
    seen: list[str] = []
    with signals.interrupt_handler(lambda s: seen.append("outer"), (signal.SIGTERM,)):
        with signals.interrupt_handler(lambda s: seen.append("inner"), (signal.SIGTERM,)):
            signal.raise_signal(signal.SIGTERM)
        signal.raise_signal(signal.SIGTERM)
    assert seen == ["inner", "outer"]  # the innermost handler runs; popping re-exposes the outer one
    assert signal.getsignal(signal.SIGTERM) == before


# -------------------------------------------------------------------------------- sites


def _fake_model(n_layers=4, n_heads=2, d_mlp=8, kv=None):
    # a HookedModel without weights (as a ModelInfo): the checks read the config only
    def refuse(*a, **k):
        raise AssertionError("the checks do not run the model")

    return SimpleNamespace(cfg=SimpleNamespace(n_layers=n_layers, n_heads=n_heads, d_mlp=d_mlp,
                                               n_key_value_heads=kv), tokenizer=None, hook_dict={},
                           __call__=refuse, run_with_cache=refuse, run_with_hooks=refuse, hooks=refuse)


def test_hook_names_come_from_one_table():
    assert sites.hook("resid_pre", 3) == "blocks.3.hook_resid_pre"
    assert sites.hook("head_out", 0) == "blocks.0.attn.hook_z"
    assert sites.hook("neuron", 2) == "blocks.2.mlp.hook_post"
    for name, spec in sites.SITE_TABLE.items():
        assert spec.template.startswith("blocks.{layer}.") or "{layer}" not in spec.template, name
        assert sites.hook(name, 0) == spec.template.format(layer=0)
    with pytest.raises(KeyError):
        sites.hook("nonexistent_site", 0)


def test_layer_checks_accept_negative_and_name_the_field():
    m = _fake_model()
    assert sites.check_layers(m, "all") == [0, 1, 2, 3]
    assert sorted(sites.check_layers(m, [-1, 0])) == [0, 3]
    assert sites.check_layer(m, -4) == 0
    with pytest.raises(sites.SiteError, match=r"sweep\.layers\[1\]: layer 4 out of range for a 4-layer model"):
        sites.check_layers(m, [0, 4], field="sweep.layers")
    with pytest.raises(sites.SiteError, match="not a layer list"):
        sites.check_layers(m, "first")


def test_site_errors_are_each_methods_error():
    e = sites.SiteError("x")
    assert isinstance(e, (TracekitError)) and all(isinstance(e, t) for t in
                                                    (AttributionError, AttentionError, PatchingError, ProbingError))


def test_head_and_neuron_checks_read_the_config_without_weights():
    m = _fake_model(kv=1)
    assert sites.check_heads(m, "all", layer=0) == [0, 1]
    assert sites.check_heads(m, None, layer=0, kv=True) == [0]
    with pytest.raises(sites.SiteError, match="head 2 out of range: block 0 has 2 \\(query\\) heads"):
        sites.check_heads(m, [2])
    assert sites.check_neurons(m, 1, [0, 7]) == [0, 7]
    with pytest.raises(sites.SiteError, match=r"neuron 8 \(and 1 more\) out of range: the MLP of block 1 has 8"):
        sites.check_neurons(m, 1, [8, 9])


# ------------------------------------------------------------------------------- metrics


def test_metrics_against_hand_computation():
    from tracekit.metrics import kl_div, logit_diff, normalize, target_log_prob, target_prob

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 11, generator=g)
    tgt = torch.tensor([[2], [5], [7]])
    foil = torch.tensor([[3], [1], [0]])
    p = torch.softmax(logits, -1)
    assert torch.allclose(target_prob(logits, tgt), p.gather(1, tgt)[:, 0], atol=1e-6)
    assert torch.allclose(target_log_prob(logits, tgt), p.gather(1, tgt)[:, 0].log(), atol=1e-6)
    want = logits.gather(1, tgt)[:, 0] - logits.gather(1, foil)[:, 0]
    assert torch.allclose(logit_diff(logits, tgt, foil), want, atol=1e-6)
    ref = torch.log_softmax(logits, -1)
    assert float(kl_div(logits, ref).abs().max()) < 1e-6
    other = torch.log_softmax(logits.roll(1, 0), -1)
    hand = (other.exp() * (other - ref)).sum(-1)
    assert torch.allclose(kl_div(logits, other), hand, atol=1e-6) and float(hand.min()) > 0
    assert normalize(3.0, 3.0, 1.0) == 1.0 and normalize(1.0, 3.0, 1.0) == 0.0
    assert np.isnan(normalize(1.0, 1.0 + 1e-6, 1.0))  # a gap of ~0 cannot be measured against


# ------------------------------------------------------------------------------- positions


def test_positions_parse_every_form():
    from tracekit.core.errors import TokenizationError
    from tracekit.tokens import parse_position

    assert parse_position("last").kind == "last"
    assert parse_position(-2).index == -2
    p = parse_position("token: Paris")
    assert p.kind == "token" and p.text.strip() == "Paris"
    with pytest.raises(TokenizationError, match="position"):
        parse_position("middle")


# ---------------------------------------------------------------------------- output transform


def test_output_transform_measured_from_the_cap():
    from tracekit.model.readout import output_transform

    capped = SimpleNamespace(cfg=SimpleNamespace(output_logits_soft_cap=30.0))
    t = output_transform(capped)
    assert t.kind == "nonlinear" and t.multiplier is None and "soft-cap 30" in t.description
    plain = SimpleNamespace(cfg=SimpleNamespace(output_logits_soft_cap=0.0))
    assert output_transform(plain).kind == "identity"
    scaled = SimpleNamespace(adapter=SimpleNamespace(apply_output_logits_transform=lambda x: x * 0.125),
                             cfg=SimpleNamespace())
    t = output_transform(scaled)
    assert t.kind == "scale" and abs(t.multiplier - 0.125) < 1e-6


# ------------------------------------------------------------------------------- probing splits


def _probe_ds():
    from tracekit.probing.data import ProbeDataset

    rows = [{"text": f"{t} {e}", "label": e % 2, "group": f"e{e}", "template": f"t{t}"}
            for e in range(10) for t in range(4)]
    return ProbeDataset(pd.DataFrame(rows))


@pytest.mark.parametrize("group_by", ["entity", "template", "both"])
def test_group_splits_never_share_a_group(group_by):
    from tracekit.probing.splits import check_no_overlap, group_split

    ds = _probe_ds()
    s = group_split(ds, group_by=group_by, test_size=0.3, seed=1)
    check_no_overlap(ds, s)
    f = ds.frame
    if group_by in ("entity", "both"):
        assert not set(f.loc[s.train, "group"]) & set(f.loc[s.test, "group"])
    if group_by in ("template", "both"):
        assert not set(f.loc[s.train, "template"]) & set(f.loc[s.test, "template"])
    assert len(set(s.train) | set(s.test) | set(s.dropped)) == len(f)
    again = group_split(ds, group_by=group_by, test_size=0.3, seed=1)
    assert np.array_equal(s.test, again.test)  # same seed, same split


def test_kfold_covers_every_entity_once():
    from tracekit.probing.splits import group_kfold

    ds = _probe_ds()
    folds = group_kfold(ds, k=5, group_by="entity", seed=0)
    tested = np.concatenate([f.test for f in folds])
    assert sorted(tested.tolist()) == list(range(len(ds.frame)))


def test_leak_is_refused():
    from tracekit.probing.splits import Split, SplitLeakError, check_no_overlap

    ds = _probe_ds()
    leak = Split(train=np.array([0, 1]), test=np.array([2]), dropped=np.array([], dtype=int), group_by="entity")
    with pytest.raises(SplitLeakError):
        check_no_overlap(ds, leak)

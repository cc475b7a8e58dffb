"""tracekit.compat: the TransformerLens 3.9 / 4.x differences and the optional SAELens.

These run in both environments (default: TL 3.9 + SAELens; second: TL 4.x, no SAELens): the
SAELens-missing case is simulated by replacing the package metadata lookups.
"""

from __future__ import annotations

from importlib import metadata

import pytest

from tracekit import compat
from tracekit.core.errors import ConfigError, SAEError


@pytest.fixture
def fresh_status():
    compat.sae_lens_status.cache_clear()
    compat.tl_version.cache_clear()
    yield
    compat.sae_lens_status.cache_clear()
    compat.tl_version.cache_clear()


def _fake_metadata(monkeypatch, tl: str, sae_requires: list[str] | None):
    def version(name):
        if name == "transformer-lens":
            return tl
        if name == "sae-lens" and sae_requires is not None:
            return "6.54.12"
        raise metadata.PackageNotFoundError(name)

    def requires(name):
        if name == "sae-lens" and sae_requires is not None:
            return sae_requires
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(compat.metadata, "version", version)
    monkeypatch.setattr(compat.metadata, "requires", requires)


def test_version_reads_the_installed_transformer_lens(fresh_status):
    assert compat.tl_version() == metadata.version("transformer-lens")
    assert compat.tl_major() in (3, 4)


@pytest.mark.parametrize("sae_requires", [None, ["transformer-lens<4.0.0,>=2.16.1", "torch>=2"]],
                         ids=["not-installed", "pinned-below-4"])
def test_sae_lens_missing_is_one_clear_refusal(monkeypatch, fresh_status, sae_requires):
    _fake_metadata(monkeypatch, "4.3.0", sae_requires)
    reason = compat.sae_lens_status(import_check=False)
    assert reason is not None and "#738" in reason and "4.3.0" in reason
    with pytest.raises(SAEError, match=r"sae: SAE support needs SAELens.*#738.*Fix: .*tracekit\[sae\]"):
        compat.require_sae_lens("sae", import_check=False)
    assert compat.sae_lens_status(import_check=True) == reason  # the import is not even tried


def test_sae_lens_that_allows_this_transformer_lens_is_accepted(monkeypatch, fresh_status):
    _fake_metadata(monkeypatch, "3.9.0", ["transformer-lens<4.0.0,>=2.16.1", 'pytest; extra == "dev"'])
    assert compat.sae_lens_status(import_check=False) is None
    _fake_metadata(monkeypatch, "4.3.0", ["transformer-lens<5,>=3.9"])  # a future SAELens that allows 4.x
    compat.sae_lens_status.cache_clear(); compat.tl_version.cache_clear()
    assert compat.sae_lens_status(import_check=False) is None


def test_an_sae_config_is_refused_at_validation_naming_the_field(monkeypatch, fresh_status):
    """Without SAELens a config with an ``sae:`` block fails validation (before any model loads),
    with the YAML path and the fix."""
    from tracekit.config import parse_config
    from tracekit.experiments import sae as _sae  # noqa: F401  (registers the SAE kinds)

    _fake_metadata(monkeypatch, "4.3.0", None)
    cfg = {"model": {"name": "gpt2"}, "experiments": [{"kind": "sae_features", "sae": {"path": "x"},
                                                     "prompts": ["The capital of France is"], "target": " Paris"}]}
    with pytest.raises(ConfigError) as e:
        parse_config(cfg)
    msg = str(e.value)
    assert "sae" in msg and "#738" in msg and "tracekit[sae]" in msg


def test_check_hook_to_add_calls_the_installed_form():
    calls = []

    class TL3:
        def check_hooks_to_add(self, hook_point_name):
            calls.append(("3.9", hook_point_name))

    class TL4:
        def check_hooks_to_add(self, hook_point, hook_point_name, hook, dir="fwd", is_permanent=False):
            calls.append(("4.x", hook_point, hook_point_name, hook, dir))

    fn = lambda x, hook: x
    compat.check_hook_to_add(TL3(), "HP", "blocks.0.hook_resid_pre", fn)
    compat.check_hook_to_add(TL4(), "HP", "blocks.0.hook_resid_pre", fn)
    assert calls == [("3.9", "blocks.0.hook_resid_pre"), ("4.x", "HP", "blocks.0.hook_resid_pre", fn, "fwd")]


def test_moved_names_resolve_on_the_installed_version():
    assert compat.official_model_name("gpt2-small") == "gpt2"
    assert compat.hook_alias_map({}) == {}
    with pytest.raises(ImportError, match="compat.py"):
        compat._moved("no_such_name", "transformer_lens.no_such_module", "transformer_lens")

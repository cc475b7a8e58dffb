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


def test_only_a_release_is_refused_at_validation_naming_the_field_and_sae_path(monkeypatch, fresh_status):
    """Without SAELens a config whose ``sae:`` is a SAELens directory (``path``) or a training validates
    (tracekit reads SAELens directories itself); a pretrained release (``release`` + ``id``: SAELens'
    registry) fails validation, before any model loads, with the YAML path, SAELens issue #738, and
    both fixes (``sae.path`` to a downloaded directory; the SAELens environment)."""
    from tracekit.config import parse_config
    from tracekit.experiments import sae as _sae  # noqa: F401  (registers the SAE kinds)

    _fake_metadata(monkeypatch, "4.3.0", None)
    base = {"kind": "sae_features", "prompts": ["The capital of France is"], "target": " Paris"}
    for sae in ({"path": "x"}, {"train": {"hook": "blocks.1.hook_resid_pre"}}):
        parse_config({"model": {"name": "gpt2"}, "experiments": [{**base, "sae": sae}]})
    cfg = {"model": {"name": "gpt2"},
           "experiments": [{**base, "sae": {"release": "gpt2-small-res-jb", "id": "blocks.8.hook_resid_pre"}}]}
    with pytest.raises(ConfigError) as e:
        parse_config(cfg)
    msg = str(e.value)
    assert "experiments[0].sae" in msg and "release" in msg and "#738" in msg
    assert "sae.path" in msg and "tracekit[sae]" in msg


def test_a_release_is_refused_at_load_where_sae_lens_does_not_import(monkeypatch, fresh_status):
    """The same refusal at load time (``import_check``: SAELens installed but not importable)."""
    from tracekit.sae.spec import require_release_support

    monkeypatch.setattr(compat, "_sae_lens_metadata_problem", lambda: "SAELens pins transformer-lens<4 (#738)")
    with pytest.raises(SAEError, match=r"^sae\.release: a SAELens pretrained release .*needs SAELens.*#738.*sae\.path"):
        require_release_support("sae.release")

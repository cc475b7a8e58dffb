"""``HookedModel``: the runtime check looks members up statically (no property runs) and agrees with
the Protocol's own member list."""

import typing

from tracekit.core.protocols import _MEMBERS, HookedModel


class _Counting:
    """A model-like object whose ``hook_dict`` property counts its evaluations (a bridge's rebuilds
    every hook alias)."""

    evaluated = 0

    def __init__(self):
        self.cfg = object()
        self.tokenizer = object()

    @property
    def hook_dict(self) -> dict:
        type(self).evaluated += 1
        return {}

    def __call__(self, *a, **k): ...
    def run_with_cache(self, *a, **k): ...
    def run_with_hooks(self, *a, **k): ...
    def hooks(self, *a, **k): ...


def test_members_are_the_protocols():
    assert sorted(_MEMBERS) == sorted(typing._get_protocol_attrs(HookedModel))  # type: ignore[attr-defined]


def test_the_check_runs_no_property_and_still_refuses():
    m = _Counting()
    assert isinstance(m, HookedModel)
    assert _Counting.evaluated == 0
    del m.tokenizer
    assert not isinstance(m, HookedModel)
    assert not isinstance(object(), HookedModel)

"""Config reading: YAML 1.2 numbers, anchors, duplicate keys, non-finite values, retired names.

Each test pins a silent wrong answer the old loader gave (PyYAML's YAML 1.1 rules, shared alias
objects, last-wins duplicates, `.inf` tolerances).
"""

from __future__ import annotations

import math
import textwrap

import pytest

from tracekit.config import apply_override, load_config, parse_config, yaml_load
from tracekit.errors import ConfigError, TracekitError
from tracekit.experiments.base import Expectation


def write(tmp_path, text: str, name: str = "c.yaml"):
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return p


def test_yaml12_floats_are_numbers():
    d = yaml_load("a: 1e-6\nb: 1E3\nc: -2.5e+2\nd: .5\ne: 10\nf: 0x1f\ng: 0o17")
    assert d == {"a": 1e-6, "b": 1000.0, "c": -250.0, "d": 0.5, "e": 10, "f": 31, "g": 15}
    assert isinstance(d["a"], float) and isinstance(d["e"], int)
    # YAML 1.2 core schema: only true/false are booleans; `no` is a string (a plausible token)
    assert yaml_load("a: no\nb: yes\nc: true\nd: False") == {"a": "no", "b": "yes", "c": True, "d": False}


def test_expectation_with_exponent_value_is_met(tmp_path):
    """`value: 1e-6` used to be the string '1e-6' and never met; now it is a number."""
    cfg = yaml_load("{metric: m, value: 1e-6, atol: 1e-3}")
    e = Expectation.model_validate(cfg)
    assert e.value == 1e-6
    assert e.check({"m": 0.0005})["met"] is True
    assert e.check({"m": 0.01})["met"] is False


def test_numeric_bounds_must_be_numbers():
    with pytest.raises(Exception, match="atol"):
        Expectation.model_validate({"metric": "m", "value": 1.0, "atol": "1e-3"})
    with pytest.raises(Exception, match="min"):
        Expectation.model_validate({"metric": "m", "min": "low"})
    with pytest.raises(Exception, match="atol"):
        Expectation.model_validate({"metric": "m", "value": " Paris", "atol": 0.1})


@pytest.mark.parametrize("bad", [".inf", "-.inf", ".nan"])
def test_non_finite_numbers_are_config_errors(tmp_path, bad):
    """`atol: .inf` made every expectation "met" (stored as null, reading like an exact match)."""
    p = write(tmp_path, f"""
        experiments:
          - kind: logit_lens
            prompts: ["a"]
            expect: [{{metric: target_prob_final, value: 0.5, atol: {bad}}}]
    """)
    with pytest.raises(ConfigError, match=r"experiments\[0\]\.expect\[0\]\.atol"):
        load_config(p)
    with pytest.raises(ConfigError, match="value"):
        load_config(write(tmp_path, f"""
            experiments:
              - {{kind: logit_lens, prompts: ["a"], expect: [{{metric: m, value: {bad}}}]}}
        """, "d.yaml"))


def test_duplicate_keys_name_both_lines(tmp_path):
    p = write(tmp_path, """\
        model:
          name: gpt2
        seed: 1
        model:
          name: smollm2-135m
        experiments: [{kind: logit_lens, prompts: [a]}]
    """)
    with pytest.raises(ConfigError, match=r"'model' appears twice.*line 1 and line 4"):
        load_config(p)


def test_anchor_override_changes_only_the_named_path(tmp_path):
    """With aliases, --set experiments[1].prompts[0]=... also changed step 0 (one shared object)."""
    p = write(tmp_path, """
        common: &p ["The capital of France is"]
        experiments:
          - {kind: logit_lens, name: a, prompts: *p}
          - {kind: logit_lens, name: b, prompts: *p}
    """)
    from tracekit.config import load_raw

    raw = load_raw(p)
    raw.pop("common")
    apply_override(raw, "experiments[1].prompts[0]=The capital of Italy is")
    cfg = parse_config(raw)
    assert cfg.experiments[0].prompts == ["The capital of France is"]
    assert cfg.experiments[1].prompts == ["The capital of Italy is"]


def test_set_values_follow_yaml12(tmp_path):
    raw = {"experiments": [{"kind": "logit_lens", "prompts": ["a"], "expect": [{"metric": "m", "value": 1}]}]}
    apply_override(raw, "experiments[0].expect[0].value=1e-6")
    apply_override(raw, "experiments[0].target= Paris")
    assert raw["experiments"][0]["expect"][0]["value"] == 1e-6
    assert raw["experiments"][0]["target"] == " Paris"  # unquoted strings kept verbatim (leading space)


def test_every_error_is_a_tracekit_error(tmp_path):
    with pytest.raises(TracekitError):
        load_config(tmp_path / "missing.yaml")
    assert issubclass(ConfigError, ValueError)


def test_unicode_step_names_allowed_path_separators_refused():
    cfg = parse_config({"experiments": [{"kind": "logit_lens", "name": "巴黎-lens", "prompts": ["a"]}]})
    assert cfg.experiments[0].step_name == "巴黎-lens"
    for bad in ("a/b", "..", ".hidden", "a\\b"):
        with pytest.raises(ConfigError, match="step name"):
            parse_config({"experiments": [{"kind": "logit_lens", "name": bad, "prompts": ["a"]}]})


def test_inf_in_a_float_field_is_refused():
    with pytest.raises(ConfigError, match="finite"):
        parse_config({"experiments": [{"kind": "logit_lens", "prompts": ["a"],
                                       "expect": [{"metric": "m", "min": math.inf}]}]})

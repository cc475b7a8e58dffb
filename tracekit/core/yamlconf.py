"""Config files without the kinds: YAML 1.2 reading and ``--set`` overrides (no torch, no pydantic).

The CLI's fast paths (``tracekit validate --schema-only``, ``tracekit kinds``) and
:mod:`tracekit.config` both read configs with these functions; :mod:`tracekit.config` re-exports
them. See :mod:`tracekit.config` for the YAML rules (YAML 1.2 core schema, duplicate keys refused,
anchors expanded).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from . import paths
from .errors import ConfigError

__all__ = ["yaml_load", "apply_override", "load_raw"]


# ---------------------------------------------------------------------------------------------
# YAML 1.2 core schema on PyYAML

_FLOAT_12 = re.compile(r"""^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$""", re.X)
_INT_12 = re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$")
_BOOL_12 = re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$")


class _Loader12(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2 core-schema scalars and duplicate-key detection."""

    def construct_mapping(self, node, deep=False):
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                hash(key)
            except TypeError:
                continue
            if key in seen:
                raise ConfigError(f"{key_node.start_mark.name}: key {key!r} appears twice in one mapping, at line "
                                  f"{seen[key]} and line {line}; YAML keeps only the last, silently. Remove one.")
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def _construct_int(loader, node):
    v = loader.construct_scalar(node)
    if v.startswith("0o"):
        return int(v[2:], 8)
    return int(v, 0) if v.startswith("0x") else int(v)


def _construct_float(loader, node):
    v = loader.construct_scalar(node).lower()
    if v.endswith("inf"):
        return float("-inf") if v.startswith("-") else float("inf")
    if v.endswith("nan"):
        return float("nan")
    return float(v)


_Loader12.yaml_implicit_resolvers = {
    k: [(tag, rx) for tag, rx in v if tag not in ("tag:yaml.org,2002:float", "tag:yaml.org,2002:int",
                                                  "tag:yaml.org,2002:bool")]
    for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader12.add_implicit_resolver("tag:yaml.org,2002:bool", _BOOL_12, list("tTfF"))
_Loader12.add_implicit_resolver("tag:yaml.org,2002:int", _INT_12, list("-+0123456789"))
_Loader12.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT_12, list("-+0123456789."))
_Loader12.add_constructor("tag:yaml.org,2002:int", _construct_int)
_Loader12.add_constructor("tag:yaml.org,2002:float", _construct_float)


def _unshare(x: Any) -> Any:
    """A copy of a YAML tree in which no two places share one object (anchors/aliases expanded)."""
    if isinstance(x, dict):
        return {k: _unshare(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_unshare(v) for v in x]
    return x


def yaml_load(text: str, source: str = "<string>") -> Any:
    """Parse YAML text with the YAML 1.2 core schema (see the module docstring).

    Raises:
        ConfigError: invalid YAML or a duplicate key (naming both lines).
    """
    try:
        loader = _Loader12(text)
        loader.name = source
        try:
            data = loader.get_single_data()
        finally:
            loader.dispose()
    except yaml.YAMLError as e:
        raise ConfigError(f"{source}: not valid YAML: {e}") from e
    return _unshare(data)


def apply_override(raw: dict, assignment: str) -> dict:
    """Apply one ``path=value`` override (value parsed as YAML) to a raw config dict in place.

    Paths: ``model.device``, ``experiments[0].target``, ``experiments.0.target``.

    Raises:
        ConfigError: malformed assignment or a path through a missing list index.
    """
    if "=" not in assignment:
        raise ConfigError(f"--set {assignment!r}: expected path=value, e.g. model.device=cpu")
    path, _, value_s = assignment.partition("=")
    try:
        paths.parse(path)
    except paths.PathError as e:
        raise ConfigError(f"--set {assignment!r}: {e}") from e
    try:
        value = yaml_load(value_s, f"--set {path}") if value_s.strip() else value_s
    except ConfigError:
        value = value_s
    if isinstance(value, str) and not value_s.lstrip().startswith(("'", '"')):
        # YAML would strip a leading space, and " Paris" is a different token from "Paris".
        value = value_s
    try:
        paths.set_path(raw, path, value, copy_value=False)
    except paths.PathError as e:
        raise ConfigError(f"--set {path.strip()}: {e}") from e
    return raw


def load_raw(path: str | Path) -> dict:
    """Read a YAML config file. Raises ConfigError on missing files or YAML syntax errors."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} not found")
    raw = yaml_load(p.read_text(encoding="utf-8"), str(p))
    if raw is None:
        raise ConfigError(f"{p}: the file is empty")
    return raw

"""YAML field paths, written once: ``model.name``, ``experiments[0].target``, ``a['key with spaces']``.

Used by ``--set`` overrides (:mod:`tracekit.config`), sweep axes (:mod:`tracekit.sweep`), pipeline
references and expectations (summary keys such as ``target_prob_by_hidden_state[8]``).

>>> parse("experiments[0].target")
('experiments', 0, 'target')
>>> fmt(("experiments", 1, "layers", 0))
'experiments[1].layers[0]'
>>> get({"a": [{"b": 5}]}, "a[0].b")
5
>>> cfg = {"experiments": [{"kind": "logit_lens"}]}
>>> set_path(cfg, "experiments[0].target", " Paris"); set_path(cfg, "model.device", "cpu"); cfg
{'experiments': [{'kind': 'logit_lens', 'target': ' Paris'}], 'model': {'device': 'cpu'}}
"""

from __future__ import annotations

import copy
import re
from typing import Any, Union

from .errors import TracekitError

__all__ = ["PathError", "parse", "fmt", "get", "set_path"]

Loc = tuple[Union[str, int], ...]

_SEG = re.compile(r"\[(-?\d+)\]|\[(?:'([^']*)'|\"([^\"]*)\")\]|\.?([^.\[\]]+)")


class PathError(TracekitError, ValueError):
    """A path that cannot be parsed, or that runs through a missing item or a non-container; callers
    add the YAML field they were reading (``--set``, ``sweep``, a reference). A :class:`TracekitError`
    (one error root) and a ``ValueError`` (as before)."""


def parse(path: Union[str, Loc]) -> Loc:
    """The keys of a path: names (str) and list indices (int); ``a.0`` is ``a[0]``.

    Raises:
        PathError: an empty or unparsable path.
    """
    if isinstance(path, tuple):
        return path
    s = str(path).strip()
    keys: list[Union[str, int]] = []
    pos = 0
    while pos < len(s):
        m = _SEG.match(s, pos)
        if not m or m.end() == pos:
            raise PathError(f"cannot parse the field path {path!r} at {s[pos:]!r} (write e.g. experiments[0].target)")
        idx, q1, q2, name = m.groups()
        if idx is not None:
            keys.append(int(idx))
        elif q1 is not None or q2 is not None:
            keys.append(q1 if q1 is not None else q2)  # type: ignore[arg-type]
        else:
            keys.append(int(name) if name.isdigit() else name)
        pos = m.end()
    if not keys:
        raise PathError(f"empty field path {path!r}")
    return tuple(keys)


def fmt(loc: Union[str, Loc]) -> str:
    """``('experiments', 0, 'target')`` -> ``experiments[0].target``."""
    if isinstance(loc, str):
        return loc
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else ("." if out else "") + str(part)
    return out


def get(obj: Any, path: Union[str, Loc]) -> Any:
    """The value at ``path`` in nested mappings and lists (negative indices count from the end).

    Raises:
        KeyError / IndexError / TypeError: naming the part of the path that failed and what exists.
    """
    done: list = []
    for part in parse(path):
        where = fmt(tuple(done)) or "the top level"
        if isinstance(obj, dict):
            if part not in obj:
                raise KeyError(f"{where} has no key {part!r}; keys: {sorted(map(str, obj))}")
            obj = obj[part]
        elif isinstance(obj, (list, tuple)):
            if not isinstance(part, int):
                raise TypeError(f"{where} is a list; index it with [i]")
            if not -len(obj) <= part < len(obj):
                raise IndexError(f"{where} has {len(obj)} items; [{part}] is out of range")
            obj = obj[part]
        else:
            raise TypeError(f"{where} is {obj!r}, not a mapping or list")
        done.append(part)
    return obj


def set_path(obj: Any, path: Union[str, Loc], value: Any, copy_value: bool = True) -> None:
    """Set ``path`` in nested mappings/lists in place; missing mapping keys are created (a mapping,
    or a list when the next key is an index); list items must exist.

    Raises:
        PathError: the path runs through a missing list item or through a non-container (the
            message names the part; callers name the path and the field).
    """
    keys = parse(path)
    for j, k in enumerate(keys):
        last = j == len(keys) - 1
        if isinstance(k, int):
            if not isinstance(obj, list) or not -len(obj) <= k < len(obj):
                n = len(obj) if isinstance(obj, list) else 0
                raise PathError(f"index [{k}] does not exist (the list has {n} item{'' if n == 1 else 's'})")
        elif not isinstance(obj, dict):
            raise PathError(f"{k!r} is not inside a mapping")
        node: Any = obj  # a list when k is an index, a mapping when it is a key (checked above)
        if last:
            node[k] = copy.deepcopy(value) if copy_value else value
        else:
            if isinstance(node, dict) and k not in node:
                node[k] = [] if isinstance(keys[j + 1], int) else {}
            obj = node[k]

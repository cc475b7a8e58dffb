"""Text corpora streamed as token windows, for FFN key readout (Geva et al. 2021).

A corpus is a sequence of *documents* (``(doc_id, text)``); each document is tokenized on its own
and cut into *windows* of at most ``seq_len`` tokens (exactly one BOS per window when the model
spec's ``prepend_bos`` is on), and windows are padded into batches. Nothing is held beyond the
current document and batch, so memory is bounded by ``batch_size x seq_len`` however large the
corpus is; ``max_tokens`` bounds the work.

Sources (:func:`iter_documents`):

* ``"stdlib"`` (default): English text shipped with Python, offline: the reference-manual topics
  of ``pydoc_data.topics.topics`` (split into prose paragraphs; code and grammar blocks dropped)
  interleaved with docstrings of standard-library modules, classes and functions (read with
  ``ast`` from the source files, nothing is imported);
* a ``.txt`` / ``.md`` file (one document per blank-line-separated paragraph);
* a ``.jsonl`` file (one document per line, text in the ``text`` field or ``jsonl_field``);
* a directory (its ``.txt``, ``.md`` and ``.jsonl`` files, sorted).

Windows are numbered in stream order (``window`` id), which does not depend on the batch size, so
a key readout batched or one-by-one names the same contexts (tested).
"""

from __future__ import annotations

import ast
import itertools
import json
import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Optional, Sequence, Union

from .model.context import check_window
from .model.info import HookedModel
from .tokens import Batch, encode, pad_ids

__all__ = ["Window", "iter_documents", "stdlib_documents", "token_windows", "packed_windows", "window_batches",
           "CorpusError", "STDLIB"]

STDLIB = "stdlib"

# Modules whose docstrings join the default corpus (read from source, never imported).
_DOC_MODULES = ("abc", "argparse", "bisect", "calendar", "collections/__init__", "contextlib", "copy",
                "csv", "dataclasses", "datetime", "decimal", "difflib", "email/message", "enum",
                "fractions", "functools", "gettext", "heapq", "html/parser", "inspect", "ipaddress",
                "json/__init__", "logging/__init__", "mailbox", "os", "pathlib", "pickle", "pprint",
                "queue", "random", "shutil", "smtplib", "socket", "statistics", "string", "subprocess",
                "tarfile", "tempfile", "textwrap", "threading", "typing", "unittest/case",
                "urllib/parse", "uuid", "warnings", "zipfile")


from .errors import CorpusError  # noqa: E402  (re-exported)


@dataclass(frozen=True)
class Window:
    """One model input cut from a document.

    Attributes:
        window: index in stream order (0, 1, ...).
        doc_id: the document's id (``topic:if#3``, ``file.jsonl:12``, ...).
        start: index of the window's first text token within the document's tokens.
        ids: token ids fed to the model (BOS first when the model prepends one).
        n_prefix: number of non-text tokens at the start of ``ids`` (1 for BOS, else 0).
    """

    window: int
    doc_id: str
    start: int
    ids: tuple[int, ...]
    n_prefix: int


def _is_prose(par: str) -> bool:
    lines = par.splitlines()
    if not lines or lines[0].startswith((" ", "\t")):
        return False  # code, grammar productions, indented examples
    if re.fullmatch(r"[*=\-~^\"]+", lines[-1].strip() or "x"):
        return False  # section headings with underlines
    words = par.split()
    if len(words) < 8:
        return False
    alpha = sum(c.isalpha() or c.isspace() for c in par) / max(1, len(par))
    return alpha > 0.8


def _paragraphs(text: str) -> Iterator[str]:
    for par in re.split(r"\n\s*\n", text):
        if _is_prose(par):
            yield " ".join(line.strip() for line in par.splitlines())


def _topic_docs() -> Iterator[tuple[str, str]]:
    try:
        from pydoc_data.topics import topics
    except ImportError:  # pragma: no cover - stripped Python builds
        return
    for key in sorted(topics):
        for j, par in enumerate(_paragraphs(topics[key])):
            yield f"topic:{key}#{j}", par


def _docstring_docs() -> Iterator[tuple[str, str]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    for mod in _DOC_MODULES:
        path = root / f"{mod}.py"
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (OSError, SyntaxError, UnicodeDecodeError):
            continue
        nodes = [tree] + [n for n in ast.walk(tree)
                          if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
        for node in nodes:
            doc = ast.get_docstring(node)
            if not doc:
                continue
            name = getattr(node, "name", "<module>")
            for j, par in enumerate(_paragraphs(doc)):
                yield f"doc:{mod.replace('/', '.')}.{name}#{j}", par


def stdlib_documents() -> Iterator[tuple[str, str]]:
    """The default offline English corpus: reference-manual topics (``pydoc_data``) interleaved
    with standard-library docstrings, prose paragraphs only, in a fixed order."""
    for a, b in itertools.zip_longest(_topic_docs(), _docstring_docs()):
        if a is not None:
            yield a
        if b is not None:
            yield b


def _file_docs(path: Path, jsonl_field: str, field: str) -> Iterator[tuple[str, str]]:
    if path.suffix == ".jsonl":
        with path.open(encoding="utf-8") as f:
            for i, line in enumerate(f):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise CorpusError(f"{field}: {path}:{i + 1} is not valid JSON ({e})") from e
                text = obj.get(jsonl_field) if isinstance(obj, dict) else obj if isinstance(obj, str) else None
                if not isinstance(text, str):
                    raise CorpusError(
                        f"{field}: {path}:{i + 1} has no string field {jsonl_field!r}; "
                        "set the JSONL text field (jsonl_field) to the key holding the text")
                yield f"{path.name}:{i}", text
    else:
        text = path.read_text(encoding="utf-8", errors="replace")
        for j, par in enumerate(p.strip() for p in re.split(r"\n\s*\n", text)):
            if par:
                yield f"{path.name}#{j}", par


def iter_documents(source: Union[str, Sequence[str], None] = None, jsonl_field: str = "text",
                   field: str = "corpus") -> Iterator[tuple[str, str]]:
    """Documents ``(doc_id, text)`` of a corpus source, streamed lazily.

    Args:
        source: ``None``/``"stdlib"`` (default corpus), a file or directory path, or a list of them.
        jsonl_field: the key holding the text in ``.jsonl`` records.
        field: config field name quoted in errors.

    Raises:
        CorpusError: a path does not exist, has an unsupported suffix, or a JSONL line is bad.
    """
    if source is None or source == STDLIB:
        yield from stdlib_documents()
        return
    sources = [source] if isinstance(source, str) else list(source)
    for s in sources:
        if s == STDLIB:
            yield from stdlib_documents()
            continue
        p = Path(s).expanduser()
        if p.is_dir():
            files = sorted(f for f in p.rglob("*") if f.suffix in (".txt", ".md", ".jsonl"))
            if not files:
                raise CorpusError(f"{field}: directory {s!r} has no .txt, .md or .jsonl files")
        elif p.is_file():
            if p.suffix not in (".txt", ".md", ".jsonl", ".text", ""):
                raise CorpusError(f"{field}: {s!r} must be a .txt, .md or .jsonl file (or a directory)")
            files = [p]
        else:
            raise CorpusError(f"{field}: no such file or directory {s!r}; give a text/JSONL file, "
                              f"a directory of them, or {STDLIB!r} for the default corpus")
        for f in files:
            yield from _file_docs(f, jsonl_field, field)


def token_windows(model: HookedModel, documents: Iterable[tuple[str, str]], seq_len: int = 64,
                  max_tokens: Optional[int] = None, min_tokens: int = 4, field: str = "seq_len") -> Iterator[Window]:
    """Cut documents into windows of at most ``seq_len`` model tokens (BOS included).

    ``seq_len`` is checked when this is called (not at the first window): it must fit the model's
    context (:func:`tracekit.model.context.check_window`), whatever the documents' lengths.

    Args:
        model: hooked model (tokenizer, ``prepend_bos`` from its spec).
        documents: ``(doc_id, text)`` pairs, e.g. from :func:`iter_documents`.
        seq_len: tokens per window including BOS; must be > 1.
        max_tokens: stop once this many text tokens have been yielded (None: the whole corpus).
        min_tokens: drop trailing windows with fewer text tokens than this.
        field: the config field that sets ``seq_len``, named in errors.

    Raises:
        CorpusError: ``seq_len`` < 2.
        ConfigError: ``seq_len`` longer than the model's context.
    """
    if seq_len < 2:
        raise CorpusError(f"{field}: must be at least 2, got {seq_len}")
    check_window(model, seq_len, field)
    return _token_windows(model, documents, seq_len, max_tokens, min_tokens)


def _token_windows(model: HookedModel, documents: Iterable[tuple[str, str]], seq_len: int, max_tokens: Optional[int],
                   min_tokens: int) -> Iterator[Window]:
    bos = encode(model, "", prepend_bos=True) if _has_bos(model) else []
    n_prefix = len(bos)
    width = seq_len - n_prefix
    n_win = 0
    n_tok = 0
    for doc_id, text in documents:
        ids = encode(model, text, prepend_bos=False)
        for start in range(0, len(ids), width):
            chunk = ids[start:start + width]
            if len(chunk) < min_tokens:
                continue
            if max_tokens is not None and n_tok >= max_tokens:
                return
            if max_tokens is not None:
                chunk = chunk[: max_tokens - n_tok]
            yield Window(n_win, doc_id, start, tuple(bos + chunk), n_prefix)
            n_win += 1
            n_tok += len(chunk)


def packed_windows(model: HookedModel, documents: Iterable[tuple[str, str]], seq_len: int, skip_tokens: int = 0,
                   max_tokens: Optional[int] = None, field: str = "seq_len") -> Iterator[tuple[int, ...]]:
    """Windows of exactly ``seq_len`` tokens packed across documents, as SAELens packs its training
    contexts: documents are tokenized one by one and concatenated, each followed by the tokens of a
    blank line (text), then cut into windows of ``seq_len`` tokens, BOS first when the model prepends
    one. The tail shorter than a window is dropped. Deterministic.

    Args:
        model: hooked model (tokenizer, ``prepend_bos`` from its spec).
        documents: ``(doc_id, text)`` pairs, e.g. from :func:`iter_documents`.
        seq_len: tokens per window, BOS included.
        skip_tokens: text tokens skipped first (whole windows: a window never starts mid-skip).
        max_tokens: stop once this many text tokens have been yielded (None: the whole corpus).
        field: the config field that sets ``seq_len``, named in errors.

    Returns:
        An iterator of each window's token ids (``seq_len`` of them); ``seq_len`` is checked when this
        is called.

    Raises:
        CorpusError: ``seq_len`` leaves no room for text after the BOS.
        ConfigError: ``seq_len`` longer than the model's context
            (:func:`tracekit.model.context.check_window`).
    """
    bos = encode(model, "", prepend_bos=True) if _has_bos(model) else []
    width = seq_len - len(bos)
    if width < 1:
        raise CorpusError(f"{field}: {seq_len} leaves no room for text after the BOS; raise it")
    check_window(model, seq_len, field)
    return _packed_windows(model, documents, bos, width, skip_tokens, max_tokens)


def _packed_windows(model: HookedModel, documents: Iterable[tuple[str, str]], bos: list[int], width: int, skip_tokens: int,
                    max_tokens: Optional[int]) -> Iterator[tuple[int, ...]]:
    sep = encode(model, "\n\n", prepend_bos=False)
    buf: list[int] = []
    seen = n_out = 0
    for _, text in documents:
        buf.extend(encode(model, text, prepend_bos=False) + sep)
        while len(buf) >= width:
            chunk, buf = buf[:width], buf[width:]
            if seen < skip_tokens:
                seen += width
                continue
            yield tuple(bos + chunk)
            n_out += 1
            if max_tokens is not None and n_out * width >= max_tokens:
                return


def _has_bos(model: HookedModel) -> bool:
    from .model.load import model_spec_of

    return bool(model_spec_of(model).prepend_bos)


def window_batches(model: HookedModel, windows: Iterable[Window], batch_size: int = 16,
                   padding_side: str = "right") -> Iterator[tuple[Batch, list[Window]]]:
    """Group windows into padded :class:`~tracekit.tokens.Batch` es of ``batch_size``."""
    it = iter(windows)
    while True:
        group = list(itertools.islice(it, max(1, int(batch_size))))
        if not group:
            return
        yield pad_ids(model, [list(w.ids) for w in group], padding_side), group

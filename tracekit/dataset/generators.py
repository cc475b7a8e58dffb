"""Built-in dataset generators: ``ioi``, ``capitals``, ``induction``.

Each is seeded, builds :class:`~tracekit.dataset.rows.Row` s for the model in use and keeps only
rows whose names and answers are single tokens for that model's tokenizer, counting what it drops
(``dropped`` in the result).

* ``ioi`` (indirect object identification; Wang et al. 2022, "Interpretability in the Wild", their
  ``ioi_dataset.py`` templates, names, places and objects): "When Mary and John went to the store,
  John gave a drink to" -> target `` Mary`` (the indirect object, IO), foil `` John`` (the subject,
  S). Rows alternate ABBA (IO named first) and BABA (S named first), so the two orders are balanced
  (``group``). Named positions: ``IO``, ``S1`` (first mention of S), ``S2`` (second), ``END`` (last
  token). Corrupted counterpart (``corrupt``): ``swap_s2`` (S2 replaced by the IO name: the
  corrupted prompt's answer is the clean foil), ``abc`` (S2 replaced by a third name C, Wang et al.'s
  ABC distribution), or ``none``.
* ``capitals``: "The capital of France is" -> `` Paris`` for the built-in countries table;
  ``few_shot: true`` prefixes the seed article's "The capital of China is Beijing. " (China itself
  is then left out). Named positions ``SUBJ`` (the last token of the country) and ``END`` (the last
  token), resolved on the prompt as written, few-shot prefix included. Counterfactual pairs
  (``corrupt``; the IOI generator's name swap applied to the subject: Zhang & Nanda 2024, "Towards
  Best Practices of Activation Patching", symmetric token replacement for factual recall):
  ``country`` (default) replaces the subject by another country of the table whose name is as many
  tokens for this model's tokenizer (a seeded draw, never the row's own country, whose capital is
  one token): the corrupted prompt's answer is that country's capital, which is the row's foil, so
  logit(target) - logit(foil) is the clean-vs-corrupted logit difference and ``SUBJ`` / ``END`` are
  the same token indices in both prompts. Rows whose country has no such partner are dropped and
  counted (``dropped``); ``none``: no corrupted prompt, the foil another row's capital. ROME-style
  corruption (Gaussian noise on the subject's embeddings) is not a pair: it is the
  ``causal_tracing`` kind's job.
* ``induction``: ``seq_len`` random single-token words, then the same words again without the last:
  the answer is the last word (an induction head at ``END`` attends to ``SRC``, the first copy of
  the answer, after ``PREV``, the first copy of the current token). Foil: a word not in the row.
"""

from __future__ import annotations

import itertools
import random
from collections import Counter
from collections.abc import Sequence
from importlib import resources

from ..core.errors import DatasetError
from ..model.info import HookedModel
from ..tokens import encode
from .rows import At, PositionValue, Row

__all__ = ["IOI_TEMPLATES", "IOI_NAMES", "generate", "GENERATORS", "ioi", "capitals", "induction", "GeneratorError",
           "MAX_DRAWS", "CORRUPT", "MAX_UNPAIRED_SHARE"]

#: Wang et al. 2022's BABA templates (``[B]`` = S, ``[A]`` = IO), the answer " [A]" removed.
#: ABBA rows swap the first two names.
IOI_TEMPLATES: tuple[str, ...] = (
    "Then, [B] and [A] went to the [PLACE]. [B] gave a [OBJECT] to",
    "Then, [B] and [A] had a lot of fun at the [PLACE]. [B] gave a [OBJECT] to",
    "Then, [B] and [A] were working at the [PLACE]. [B] decided to give a [OBJECT] to",
    "Then, [B] and [A] were thinking about going to the [PLACE]. [B] wanted to give a [OBJECT] to",
    "Then, [B] and [A] had a long argument, and afterwards [B] said to",
    "After [B] and [A] went to the [PLACE], [B] gave a [OBJECT] to",
    "When [B] and [A] got a [OBJECT] at the [PLACE], [B] decided to give it to",
    "When [B] and [A] got a [OBJECT] at the [PLACE], [B] decided to give the [OBJECT] to",
    "While [B] and [A] were working at the [PLACE], [B] gave a [OBJECT] to",
    "While [B] and [A] were commuting to the [PLACE], [B] gave a [OBJECT] to",
    "After the lunch, [B] and [A] went to the [PLACE]. [B] gave a [OBJECT] to",
    "Afterwards, [B] and [A] went to the [PLACE]. [B] gave a [OBJECT] to",
    "Then, [B] and [A] had a long argument. Afterwards [B] said to",
    "The [PLACE] [B] and [A] went to had a [OBJECT]. [B] gave it to",
    "Friends [B] and [A] found a [OBJECT] at the [PLACE]. [B] gave it to",
)
#: Wang et al. 2022's first names (kept per model when `` Name`` is one token).
IOI_NAMES: tuple[str, ...] = (
    "Michael", "Christopher", "Jessica", "Matthew", "Ashley", "Jennifer", "Joshua", "Amanda", "Daniel", "David",
    "James", "Robert", "John", "Joseph", "Andrew", "Ryan", "Brandon", "Jason", "Justin", "Sarah", "William",
    "Jonathan", "Stephanie", "Brian", "Nicole", "Nicholas", "Anthony", "Heather", "Eric", "Elizabeth", "Adam",
    "Megan", "Melissa", "Kevin", "Steven", "Thomas", "Timothy", "Christina", "Kyle", "Rachel", "Laura", "Lauren",
    "Amber", "Brittany", "Danielle", "Richard", "Kimberly", "Jeffrey", "Amy", "Crystal", "Michelle", "Tiffany",
    "Jeremy", "Benjamin", "Mark", "Emily", "Aaron", "Charles", "Rebecca", "Jacob", "Stephen", "Patrick", "Sean",
    "Erin", "Jamie", "Kelly", "Samantha", "Nathan", "Sara", "Dustin", "Paul", "Angela", "Tyler", "Scott",
    "Katherine", "Andrea", "Gregory", "Erica", "Mary", "Travis", "Lisa", "Kenneth", "Bryan", "Lindsey", "Kristen",
    "Jose", "Alexander", "Jesse", "Katie", "Lindsay", "Shannon", "Vanessa", "Courtney", "Christine", "Alicia",
    "Cody", "Allison", "Bradley", "Samuel",
)
_PLACES = ("store", "garden", "restaurant", "school", "hospital", "office", "house", "station")
_OBJECTS = ("ring", "kiss", "bone", "basketball", "computer", "necklace", "drink", "snack")
#: Common nouns for ``induction`` rows (kept per model when `` word`` is one token).
_WORDS = (
    "apple", "table", "river", "house", "music", "paper", "stone", "water", "light", "chair", "green", "money",
    "horse", "night", "world", "power", "field", "glass", "plant", "heart", "board", "train", "cloud", "bread",
    "story", "voice", "phone", "dream", "earth", "metal", "ocean", "smile", "sugar", "truth", "video", "wheel",
    "forest", "garden", "window", "doctor", "market", "bridge", "island", "castle", "letter", "silver", "winter",
    "summer", "animal", "school", "family", "friend", "number", "camera", "dinner", "engine", "flower", "guitar",
    "hammer", "jacket", "kitten", "ladder", "mirror", "pepper", "rocket", "tunnel", "planet", "circle", "butter",
    "carpet", "coffee", "desert", "finger", "hunter", "lemon", "tiger", "zebra", "piano", "robot", "queen",
)
FEW_SHOT_CAPITALS = "The capital of China is Beijing. "


#: Every redraw loop stops after this many draws per row asked for, then fails saying what is short.
MAX_DRAWS = 1000

#: Per generator, the ``corrupt`` values it takes; the first is its default.
CORRUPT: dict[str, tuple[str, ...]] = {"ioi": ("swap_s2", "abc", "none"), "capitals": ("country", "none")}

#: ``capitals`` with ``corrupt: country`` refuses when more than this share of its usable rows have
#: no country of the same token length to swap in (the pairs would no longer sample the table).
MAX_UNPAIRED_SHARE = 0.5


class GeneratorError(DatasetError):
    """A generator option the draw cannot satisfy (too few usable names, words or capitals; names
    that collide); ``option`` names the option (``names``, ``n``, ``seq_len``), so the message is
    reported at its YAML path (``dataset.generator.names``)."""

    def __init__(self, option: str, message: str):
        super().__init__(message)
        self.option = option


def _plural(k: int, one: str, many: str | None = None) -> str:
    """``1 capital is`` / ``2 capitals are``: ``k`` and the word in the number it takes."""
    return f"{k} {one if k == 1 else (many or one + 's')}"


def _one_token(model: HookedModel, word: str) -> bool:
    return len(encode(model, word, prepend_bos=False)) == 1


def _ioi_names(model: HookedModel, pool: list[str]) -> tuple[list[str], dict[str, int]]:
    """The names of ``pool`` the ioi draw can use, checked before any draw.

    A row draws 3 distinct names (IO, S and a third, C, for ``corrupt: abc``), each one token with a
    leading space, no two the same token, and none the start of another (`` Sara`` in `` Sarah``:
    a text position of one would find the other).

    Raises:
        GeneratorError: a name given twice; fewer than 3 one-token names; no 3 names free of each
            other (the message lists the colliding pairs).
    """
    count = Counter(pool)
    twice = [x for x, c in count.items() if c > 1]
    if twice:
        raise GeneratorError("names", "; ".join(f"{x!r} is given {'twice' if count[x] == 2 else f'{count[x]} times'}"
                                                for x in twice) + "; give each name once (a row's IO and S must differ)")
    ids = {x: encode(model, " " + x, prepend_bos=False) for x in pool}
    usable = [x for x in pool if len(ids[x]) == 1]
    dropped = {"names not one token": len(pool) - len(usable)}
    not_one = [x for x in pool if len(ids[x]) != 1]
    if len(usable) < 3:
        why = f" ({', '.join(repr(x) for x in not_one[:8])}{' ...' if len(not_one) > 8 else ''} not)" if not_one else ""
        raise GeneratorError("names", f"ioi draws 3 distinct names per row (IO, S and a third for corrupt: abc); "
                                      f"{_plural(len(pool), 'name is', 'names are')} given, {len(usable)} of them one "
                                      f"token with a leading space for this model{why}; give at least 3 names that are")
    same_tok = {}
    for x in usable:
        same_tok.setdefault(ids[x][0], []).append(x)
    clash = [v for v in same_tok.values() if len(v) > 1]
    if clash:
        raise GeneratorError("names", "; ".join(" / ".join(repr(x) for x in v) for v in clash) + " are the same token "
                             "for this model; give names that are distinct tokens")
    collide = {(a, b) for a in usable for b in usable if a != b and (" " + b).startswith(" " + a)}
    free = lambda a, b: (a, b) not in collide and (b, a) not in collide  # noqa: E731
    ok = any(free(a, b) and free(a, c) and free(b, c) for a, b, c in itertools.combinations(usable, 3))
    if not ok:
        pairs = ", ".join(f"' {a}' starts ' {b}'" for a, b in sorted(collide))
        raise GeneratorError("names", f"ioi draws 3 names per row, none the start of another (a text position of one "
                                      f"would find the other); no 3 of the {len(usable)} one-token names are free of "
                                      f"each other ({pairs}); add names that start no other name")
    return usable, dropped


def ioi(model: HookedModel, n: int = 64, seed: int = 0, corrupt: str = "swap_s2",
        names: Sequence[str] | None = None) -> tuple[list[Row], dict[str, int]]:
    """IOI rows (see the module docstring). Returns ``(rows, dropped)``.

    Args:
        model: the model whose tokenizer decides which names are one token.
        n: number of rows (ABBA and BABA alternate: ``n`` even gives an exact balance).
        seed: seeds the names, templates, places and objects drawn.
        corrupt: ``swap_s2`` | ``abc`` | ``none``.
        names: the first names to draw from (default :data:`IOI_NAMES`).

    Raises:
        GeneratorError: (a ``ValueError``) checked before drawing: a name given twice, fewer than 3
            names that are one token, two names that are one token, no 3 names of which none starts
            another (``Sara`` / ``Sarah``); or, with few such triples, no free triple within
            :data:`MAX_DRAWS` draws. Each names the colliding names and the fix.
    """
    if corrupt not in CORRUPT["ioi"]:
        raise GeneratorError("corrupt", f"ioi takes corrupt: {' | '.join(CORRUPT['ioi'])}, not {corrupt!r}")
    pool = [str(x) for x in names] if names is not None else list(IOI_NAMES)
    usable, dropped = _ioi_names(model, pool)
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        for _ in range(MAX_DRAWS):
            io, s, c = rng.sample(usable, 3)
            ws = (" " + io, " " + s, " " + c)
            if not any(a != b and b.startswith(a) for a in ws for b in ws):
                break  # no name is a prefix of another (" Sara" in " Sarah") so text positions are exact
        else:
            raise GeneratorError("names", f"ioi: {MAX_DRAWS} draws of 3 names found none where no name starts "
                                          "another; most of the names collide (one is the start of another): add "
                                          "names that start no other name")
        tpl = IOI_TEMPLATES[rng.randrange(len(IOI_TEMPLATES))]
        place, obj = rng.choice(_PLACES), rng.choice(_OBJECTS)
        order = "ABBA" if i % 2 == 0 else "BABA"
        first, second = (io, s) if order == "ABBA" else (s, io)
        head, _, tail = tpl.partition("[B] and [A]")
        text = (head + f"{first} and {second}" + tail).replace("[PLACE]", place).replace("[OBJECT]", obj)
        prompt = text.replace("[B]", s)
        corrupted = {"swap_s2": text.replace("[B]", io), "abc": text.replace("[B]", c), "none": None}[corrupt]
        rows.append(Row(prompt=prompt, target=" " + io, foil=" " + s, group=order, corrupted=corrupted,
                        positions={"IO": At(text=" " + io, occurrence=0), "S1": At(text=" " + s, occurrence=0),
                                   "S2": At(text=" " + s, occurrence=-1), "END": -1},
                        template=IOI_TEMPLATES.index(tpl), io_name=io, s_name=s))  # type: ignore[call-arg]
    return rows, dropped


def _countries() -> list[dict[str, str]]:
    import csv

    with resources.files("tracekit").joinpath("data/countries.csv").open("r", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def _token_len(model: HookedModel, text: str) -> int:
    return len(encode(model, text, prepend_bos=False))


def _partners(model: HookedModel, usable: list[dict[str, str]], prefix: str) -> dict[str, list[dict[str, str]]]:
    """Per country (of ``usable``) the other countries whose `` phrase`` is as many tokens for
    this model and whose whole prompt is as long too (so ``SUBJ`` and ``END`` are the same indices
    in the clean and the corrupted prompt), in table order."""
    subj = {r["country"]: _token_len(model, " " + r["phrase"]) for r in usable}
    full = {r["country"]: _token_len(model, f"{prefix}The capital of {r['phrase']} is") for r in usable}
    cap = {r["country"]: encode(model, " " + r["capital"], prepend_bos=False)[0] for r in usable}
    return {r["country"]: [q for q in usable if q["country"] != r["country"] and subj[q["country"]] == subj[r["country"]]
                           and full[q["country"]] == full[r["country"]] and cap[q["country"]] != cap[r["country"]]]
            for r in usable}


def capitals(model: HookedModel, n: int | None = None, seed: int = 0, few_shot: bool = False,
             corrupt: str = "country") -> tuple[list[Row], dict[str, int]]:
    """Capital-city rows from the built-in countries table (see the module docstring).

    Args:
        model: the model whose tokenizer decides which capitals are one token and which countries
            are as long as which.
        n: keep at most this many rows (a seeded sample); default all usable rows.
        seed: seeds the sample, the foils and the swapped-in countries.
        few_shot: prefix :data:`FEW_SHOT_CAPITALS` (China is then left out).
        corrupt: ``country`` (default): each row's ``corrupted`` prompt names another country of the
            same token length (seeded, never the row's own), its capital is the row's ``foil`` and
            the extra column ``corrupt_country`` names it; rows without such a partner are dropped
            (``dropped["country without a partner of its token length"]``). ``none``: no
            corrupted prompt, the foil another row's capital. Noise corruption of the subject
            (ROME) is the ``causal_tracing`` kind's, not a generator's.

    Returns:
        ``(rows, dropped)``: rows with ``prompt``, ``target`` (the capital), ``foil``, ``group``
        (the continent), ``positions`` ``SUBJ`` (last token of the country) and ``END``,
        ``corrupted`` (with ``corrupt: country``) and the extra columns ``country`` (and
        ``corrupt_country``); ``dropped`` counts the rows left out and why.

    Raises:
        GeneratorError: (a ``ValueError``) ``n`` < 2, fewer than 2 capitals that are one token (a
            row's foil is another row's capital), an unknown ``corrupt``, or (``corrupt:
            country``) more than :data:`MAX_UNPAIRED_SHARE` of the usable rows, or all but one,
            without a country of the same token length (naming the option and the fix).
    """
    if n is not None and n < 2:
        raise GeneratorError("n", f"capitals needs n >= 2 (a row's foil is another row's capital); n is {n}")
    if corrupt not in CORRUPT["capitals"]:
        raise GeneratorError("corrupt", f"capitals takes corrupt: {' | '.join(CORRUPT['capitals'])}, not {corrupt!r}")
    table = [r for r in _countries() if not (few_shot and r["country"] == "China")]
    usable = [r for r in table if _one_token(model, " " + r["capital"])]
    dropped = {"capital not one token": len(table) - len(usable)}
    if len(usable) < 2:
        k = len(usable)
        raise GeneratorError("name", f"capitals needs 2 capitals that are one token for this model (a row's foil is "
                                     f"another row's capital); only {_plural(k, 'capital')} of the {len(table)} "
                                     f"{'is' if k == 1 else 'are'}; use another generator or give rows")
    prefix = FEW_SHOT_CAPITALS if few_shot else ""
    partners: dict[str, list[dict[str, str]]] = {}
    if corrupt == "country":
        partners = _partners(model, usable, prefix)
        alone = [r["country"] for r in usable if not partners[r["country"]]]
        dropped["country without a partner of its token length"] = len(alone)
        if len(alone) > MAX_UNPAIRED_SHARE * len(usable) or len(usable) - len(alone) < 2:
            raise GeneratorError(
                "corrupt", f"capitals with corrupt: country swaps each row's country for another of the same token "
                           f"length; {len(alone)} of the {len(usable)} usable countries ({', '.join(alone[:8])}"
                           f"{' ...' if len(alone) > 8 else ''}) have none for this model's tokenizer, too many to "
                           f"drop (more than {MAX_UNPAIRED_SHARE:.0%}); set corrupt: none (rows without corrupted "
                           "prompts: logit lens, probes, causal tracing) or give rows with your own corrupted prompts")
        usable = [r for r in usable if partners[r["country"]]]
    rng = random.Random(seed)
    if n is not None and n < len(usable):
        usable = sorted(rng.sample(usable, n), key=usable.index)
    rows = []
    for i, r in enumerate(usable):
        prompt = f"{prefix}The capital of {r['phrase']} is"
        positions: dict[str, PositionValue] = {"SUBJ": At(text=r["phrase"]), "END": -1}
        if corrupt == "country":
            other = partners[r["country"]][rng.randrange(len(partners[r["country"]]))]
            rows.append(Row(prompt=prompt, target=" " + r["capital"], foil=" " + other["capital"],
                            corrupted=f"{prefix}The capital of {other['phrase']} is", group=r["continent"],
                            positions=positions,
                            country=r["country"], corrupt_country=other["country"]))  # type: ignore[call-arg]
            continue
        foil = usable[(i + 1 + rng.randrange(len(usable) - 1)) % len(usable)]["capital"]
        rows.append(Row(prompt=prompt, target=" " + r["capital"], foil=" " + foil, group=r["continent"],
                        positions=positions, country=r["country"]))  # type: ignore[call-arg]
    return rows, dropped


def induction(model: HookedModel, n: int = 32, seed: int = 0, seq_len: int = 10) -> tuple[list[Row], dict[str, int]]:
    """Repeated random-word rows (see the module docstring).

    Args:
        n: number of rows; seq_len: words per copy (>= 2).

    Raises:
        GeneratorError: (a ``ValueError``) ``seq_len`` < 2, fewer than ``seq_len + 1`` built-in
            words that are one token, or fewer than ``n`` rows that tokenize word by word within
            ``20 n`` draws.
    """
    if seq_len < 2:
        raise GeneratorError("seq_len", f"induction needs seq_len >= 2 (the answer follows a repeated word); seq_len "
                                        f"is {seq_len}")
    words = [w for w in _WORDS if _one_token(model, " " + w)]
    dropped = {"words not one token": len(_WORDS) - len(words), "rows that do not tokenize word by word": 0}
    if len(words) < seq_len + 1:
        fix = (f"use seq_len <= {len(words) - 1}" if len(words) >= 3 else
               "this model's tokenizer splits the built-in words: give rows instead")
        raise GeneratorError("seq_len", f"induction draws seq_len + 1 = {seq_len + 1} distinct words per row (seq_len "
                                        f"words and a foil); only {len(words)} of the "
                                        f"{len(_WORDS)} built-in words {'is' if len(words) == 1 else 'are'} one token "
                                        f"for this model; {fix}")
    rng = random.Random(seed)
    rows: list[Row] = []
    tries = 0
    while len(rows) < n and tries < 20 * n:
        tries += 1
        seq = rng.sample(words, seq_len + 1)
        body, foil = seq[:seq_len], seq[seq_len]
        prompt = "".join(" " + w for w in body + body[:-1])
        if len(encode(model, prompt, prepend_bos=False)) != 2 * seq_len - 1:
            dropped["rows that do not tokenize word by word"] += 1
            continue
        rows.append(Row(prompt=prompt, target=" " + body[-1], foil=" " + foil,
                        positions={"SRC": seq_len - 1, "PREV": seq_len - 2, "END": -1}))
    if len(rows) < n:
        raise GeneratorError("n", f"induction: only {_plural(len(rows), 'row')} of the n = {n} asked for tokenize "
                                  f"word by word after {tries} draws (this tokenizer merges the words); lower n or "
                                  "seq_len, or give rows")
    return rows, dropped


#: name -> generator function.
GENERATORS = {"ioi": ioi, "capitals": capitals, "induction": induction}


def generate(model: HookedModel, name: str, **options) -> tuple[list[Row], dict[str, int]]:
    """Rows of the built-in generator ``name`` (one of :data:`GENERATORS`) for ``model``.

    Raises:
        GeneratorError: options the draw cannot satisfy, checked before drawing (``option`` names the
            option); every redraw loop is bounded (:data:`MAX_DRAWS`).
    """
    return GENERATORS[name](model, **options)

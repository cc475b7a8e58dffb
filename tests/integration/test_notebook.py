"""Notebook use: the rich display of results (``_repr_html_``), top-site helpers (``n``/``k``,
families, by-construction residual lines ranked apart), legends and palettes, summary rounding.

``check_result_html`` is the one check of a result's display; ``tests/integration/test_kinds.py``
can call it on every kind's result. Here it runs on the cheap kinds of ``KIND_EXAMPLES`` (the
others are marked ``slow``)."""

from __future__ import annotations

import base64
import math
import re
from html.parser import HTMLParser

import matplotlib.pyplot as plt
import numpy as np
import pytest

import tracekit as tk
from helpers import KIND_EXAMPLES, kind_run, make_perturbed, make_tiny
from tracekit import plotting
from tracekit.results import round_sig

#: Kinds of KIND_EXAMPLES that run in about a second on the tiny GPT-2 (the rest: slow).
FAST_KINDS = ("logit_lens", "direct_logit_attribution", "head_scan", "path_patching")


class _Tags(HTMLParser):
    """Collects start/end tags and attributes; fails on tags left open."""

    VOID = {"img", "br", "hr", "meta", "link", "input"}

    def __init__(self):
        super().__init__()
        self.stack: list[str] = []
        self.attrs: list[tuple[str, str, str | None]] = []

    def handle_starttag(self, tag, attrs):
        self.attrs += [(tag, k, v) for k, v in attrs]
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag, attrs):
        self.attrs += [(tag, k, v) for k, v in attrs]

    def handle_endtag(self, tag):
        assert self.stack and self.stack[-1] == tag, f"</{tag}> closes {self.stack[-1:]}"
        self.stack.pop()


def check_result_html(res) -> str:
    """``res._repr_html_()`` is one balanced, self-contained block (no script, stylesheet, external
    URL; images inline PNG) naming the kind, with every headline key and its numbers (4 significant
    digits), and the main figure whenever the result draws figures. Returns the HTML."""
    open_before = set(plt.get_fignums())  # figures other tests left open are not this display's
    html = res._repr_html_()
    assert html.startswith('<div class="tracekit-result">') and html.endswith("</div>")
    p = _Tags()
    p.feed(html)
    p.close()
    assert not p.stack, f"unclosed tags {p.stack}"
    low = html.lower()
    assert "<script" not in low and "<link" not in low and "<iframe" not in low and "@import" not in low
    for tag, k, v in p.attrs:
        if k in ("src", "href"):
            assert tag == "img" and k == "src" and v and v.startswith("data:image/png;base64,"), (tag, k, v)
    assert res.config.kind in html
    head = res.headline()
    assert head, "a result shows at least one headline number"
    for key, v in head:
        assert f">{key}<" in html, key
        if isinstance(v, float) and math.isfinite(v):
            assert f"{v:.4g}" in html, (key, v)
        elif isinstance(v, int) and not isinstance(v, bool):
            assert str(v) in html, (key, v)
    figs = res.figures()
    n_figs = len(figs)
    for f in figs.values():
        plt.close(f)
    imgs = [v for t, k, v in p.attrs if t == "img" and k == "src"]
    if n_figs:
        assert len(imgs) == 1, "the main figure, inline"
        png = base64.b64decode(str(imgs[0]).split(",", 1)[1])
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 1000
    assert len(html) < 400_000, "small enough for a notebook cell"
    assert set(plt.get_fignums()) <= open_before, "the display leaves no open figure"
    return html


@pytest.fixture(scope="module")
def tiny():
    return make_tiny("gpt2")


def _kind_params():
    return [k if k in FAST_KINDS else pytest.param(k, marks=pytest.mark.slow) for k in sorted(KIND_EXAMPLES)]


@pytest.mark.parametrize("kind", _kind_params())
def test_repr_html_of_every_kind(kind, tmp_path):
    # KIND_EXAMPLES[kind] run on the tiny GPT-2, shared with test_kinds / test_prepare_once (helpers.kind_run)
    res = kind_run(kind).result
    html = check_result_html(res)
    res.save(tmp_path / "r", figures=False)
    back = tk.Result.load(tmp_path / "r")
    # a loaded result shows the same table of numbers (the figure is redrawn from the same tables)
    assert html.split("<img")[0] == check_result_html(back).split("<img")[0]


def test_repr_html_escapes_prompt_text_and_survives_a_failing_figure(tiny, monkeypatch):
    res = tk.LogitLens(prompts=["<script>alert(1)</script> & the capital of France is"], target=" Paris").run(
        tiny, progress=False)
    check_result_html(res)
    card = plotting.html_card("<b>t</b>", [("<k>", "<script>alert(1)</script> & x")], notes=["a<b"])
    assert "<script>" not in card and "&lt;script&gt;alert(1)&lt;/script&gt; &amp; x" in card
    assert "&lt;b&gt;t&lt;/b&gt;" in card and "&lt;k&gt;" in card and "a&lt;b" in card
    # a figure that raises: the numbers still show, with the reason
    monkeypatch.setattr(type(res), "figures", lambda self: (_ for _ in ()).throw(RuntimeError("boom")))
    html = res._repr_html_()
    assert "main figure not drawn: RuntimeError: boom" in html and "target_prob_final" in html
    assert "<img" not in html


def test_format_value_rounds_to_significant_digits_and_cuts_long_values():
    assert plotting.format_value(4.128123e-06) == "4.128e-06"
    assert plotting.format_value(np.float32(0.96213)) == "0.9621"
    assert plotting.format_value(None) == "null" and plotting.format_value(True) == "true"
    assert plotting.format_value(" Paris") == "' Paris'"  # a leading space stays visible
    assert plotting.format_value(list(range(100))) == "[0, 1, 2, 3, 4, 5, … (100 items)]"
    assert len(plotting.format_value({f"k{i}": "x" * 50 for i in range(20)})) == 160


# ---- summary rounding -----------------------------------------------------------------------------
def test_round_sig_keeps_small_probabilities_and_agrees_for_float32():
    p = 4.128123456e-06
    assert round_sig(p) == 4.12812e-06  # 6 significant digits, not 6 decimals (round(p, 6) == 4e-06)
    # the same number through float32 (a table column) and float64 (a scalar) reads the same
    assert round_sig(np.float32(p)) == round_sig(p)
    assert round_sig(np.float32(4e-06)) == 4e-06  # not 3.99999989e-06
    out = round_sig({"a": [np.float32(0.1), 1, True, None, "x", float("nan")], "b": (2.0000001,)})
    assert out["a"][0] == 0.1 and out["a"][1:5] == [1, True, None, "x"] and math.isnan(out["a"][5])
    assert out["b"] == [2.0] and type(out["a"][1]) is int and type(out["a"][2]) is bool


# ---- palettes and legends -------------------------------------------------------------------------
def test_series_styles_stay_distinct_beyond_ten_series():
    from matplotlib import colors, rcParams

    default = [colors.to_rgba(c["color"]) for c in rcParams["axes.prop_cycle"]]
    ten = plotting.series_styles(10)
    assert [colors.to_rgba(s["color"]) for s in ten] == default[:10]  # matplotlib's own first
    for n in (11, 12, 20, 21, 40, 80):
        st = plotting.series_styles(n)
        assert len({(s["color"], s["linestyle"]) for s in st}) == n, n
    fig, ax = plotting.plt().subplots()
    plotting.curves(ax, [0, 1], {f"s{i}": [i, i + 1] for i in range(12)})  # 12 = MAX_SERIES: one line each
    pairs = {(ln.get_color() if isinstance(ln.get_color(), str) else tuple(ln.get_color()), ln.get_linestyle())
             for ln in ax.get_lines()}
    assert len(ax.get_lines()) == 12 and len(pairs) == 12
    plt.close(fig)


def test_short_text_keeps_the_end_of_the_prompt():
    assert plotting.short_text("The capital of France is") == "The capital of France is"
    s = plotting.short_text("The capital of China is Beijing.\nThe capital of France is", 24)
    assert s == "…he capital of France is"
    assert len(s) == 24 and s.startswith("…") and s.endswith("capital of France is") and "\n" not in s


def _legend_texts(fig) -> list[str]:
    return [t.get_text() for ax in fig.axes if ax.get_legend() for t in ax.get_legend().get_texts()]


def test_legends_name_prompts_by_their_text(tiny):
    prompts = ["The capital of France is", "Hello world, the capital of Spain is"]
    lens = tk.LogitLens(prompts=prompts, target=[" Paris", " Madrid"]).run(tiny, progress=False)
    texts = _legend_texts(lens.figures()["target_by_layer"])
    ps = tk.Patchscope(prompts=prompts, target=[" Paris", " Madrid"], hidden_states=[0, 2], top_k=2,
                       n_generate=0).run(tiny, progress=False)
    texts += _legend_texts(ps.figures()["target_by_hidden_state"])
    plt.close("all")
    for p in prompts:
        short = plotting.short_text(p, 28)[1:] if len(p) > 28 else p
        assert sum(short in t for t in texts) == 2, (p, texts)
    assert not any(re.fullmatch(r"(prompt|row) \d+", t) for t in texts), texts


# ---- activation patching: top_sites ---------------------------------------------------------------
PAIRS: list = [{"clean": "The capital of France is", "corrupted": "The capital of Italy is", "target": " Paris",
          "foil": " Rome"},
         {"clean": "The capital of Spain is", "corrupted": "The capital of Japan is", "target": " Madrid",
          "foil": " Tokyo"}]


@pytest.fixture(scope="module")
def patched():
    m = make_perturbed("gpt2")
    return tk.ActivationPatching(pairs=PAIRS, sites=["resid_pre", "resid_post", "resid_pre_layer", "head_out",
                                                     "mlp_out"],
                                 directions=["denoising", "noising"], ablations=["zero"], metrics=["logit_diff"],
                                 min_denominator=1e-6, top_k=6).run(m, progress=False)


def test_top_sites_n_and_k_agree_and_conflicts_fail(patched):
    a, b = patched.top_sites(n=3), patched.top_sites(k=3)
    assert len(a) == 3 and a.equals(b)
    assert patched.top_sites(3).equals(a)  # positional, as before
    assert patched.top_sites(n=3, k=3).equals(a)
    with pytest.raises(TypeError, match="not both"):
        patched.top_sites(n=3, k=4)
    with pytest.raises(ValueError, match="family: unknown"):
        patched.top_sites(family="resdi")
    assert len(patched.top_sites()) == 6  # the config's top_k


def test_trivial_residual_lines_are_exactly_the_source_run(patched):
    """The lines flagged by construction restore the source run: effect 1 within float32 replay error
    (2e-5 logits, tested against TransformerLens in test_patching), for both directions."""
    t = patched.top_sites(n=10_000, family="resid", trivial=True)
    d = t[t["intervention"].isin(["denoising", "noising"])]
    triv = d[d["trivial"]]
    # whole-layer residual (3 layers x 2 directions), last block's resid_post at the last token (x2),
    # block 0's resid_pre at the one changed token (x2)
    assert len(triv) == 3 * 2 + 2 + 2
    assert set(triv[triv["site"] == "resid_pre"]["layer"]) == {0}
    assert set(triv[triv["site"] == "resid_pre"]["pos_from_end"]) == {-2}  # ' France'/' Italy'
    assert set(triv[triv["site"] == "resid_post"]["pos_from_end"]) == {-1}
    assert np.abs(triv["effect"].to_numpy(dtype=float) - 1).max() < 1e-4
    # the same site one block later / one position off is not flagged
    rest = d[~d["trivial"] & d["site"].isin(["resid_pre", "resid_post"])]
    assert len(rest) > 0 and not ((rest["site"] == "resid_post") & (rest["layer"] == 2) & (rest["pos_from_end"] == -1)).any()


def test_top_sites_rank_components_apart_from_the_residual_stream(patched):
    from tracekit.experiments.patching_tables import site_label

    s = patched.summary()
    top = patched.top_sites()
    assert set(top["family"]) <= {"heads", "mlp"} and not top["trivial"].any()
    assert s["top_sites_families"] == sorted(set(top["family"]))
    assert [(r["site"], r["layer"], r["label"]) for r in s["top_sites"]] == \
        [(r["site"], int(r["layer"]), site_label(r.to_dict())) for _, r in top.iterrows()]
    # components ranked by |effect| over every component line that is not flagged
    mean = patched.tables["main"]
    mean = mean[(mean["scope"] == "mean") & ~mean["site"].str.startswith("resid")]
    assert abs(top["effect"].iloc[0]) == pytest.approx(mean["effect"].abs().max(), abs=1e-12)
    # the residual stream on its own list, without the by-construction lines
    resid = patched.top_sites(family="resid")
    assert set(resid["family"]) == {"resid"} and not resid["trivial"].any()
    assert [r["label"] for r in s["top_resid_sites"]] == [site_label(r.to_dict()) for _, r in resid.iterrows()]
    heads = patched.top_heads(n=4)
    assert len(heads) == 4 and set(heads["site"]) == {"head_out"}
    assert heads.equals(patched.top_sites(n=4, family="heads"))
    both = patched.top_sites(n=50, family=["mlp", "heads"])
    assert set(both["family"]) == {"mlp", "heads"}
    assert "residual stream, ranked apart" in patched.report()

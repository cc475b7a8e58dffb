"""The token-trace report in a real browser: headless Chromium opens ``report.html`` from disk with
every non-file request blocked; every section renders (figures decoded, tables shown) with no console
error and no failed request; nothing is clipped (no element scrolls its content, nothing wider than
the page, and the full-page screenshot is as tall as the document); a screenshot is saved next to
the report. A tiny-model version runs in the default suite; the embedded-model one is ``slow``.

Needs ``chromium`` (``apt-get install -y chromium``) and Playwright's Python package (``pip install
playwright``; no browser download: the system Chromium is used). Skips with the reason otherwise.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

import tracekit as tk
from tracekit.experiments.trace import TOP_COMPONENTS
from tracekit.trace import SECTIONS

PROMPT = "The capital of China is Beijing. The capital of France is"
CHROMIUM = os.environ.get("TRACEKIT_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser") \
    or "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--no-first-run"]


def _browser_or_skip():
    try:
        from playwright.sync_api import sync_playwright  # noqa: F401
    except ImportError:
        pytest.skip("playwright is not installed (pip install playwright)")
    if not Path(CHROMIUM).is_file():
        pytest.skip(f"no chromium at {CHROMIUM} (apt-get install -y chromium, or set TRACEKIT_CHROMIUM)")


def _render(report: Path, shot: Path) -> dict:
    from playwright.sync_api import sync_playwright

    errors, failed, blocked, requested = [], [], [], []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=ARGS)
        try:
            page = browser.new_page(viewport={"width": 1200, "height": 900})

            def route(r):
                url = r.request.url
                requested.append(url)
                if url.startswith(("file:", "data:")):
                    r.continue_()
                else:
                    blocked.append(url)
                    r.abort()

            page.route("**/*", route)
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.on("requestfailed", lambda r: failed.append(r.url))
            page.goto(report.resolve().as_uri(), wait_until="load")
            info = page.evaluate("""() => ({
                sections: [...document.querySelectorAll('section.stage')].map(s => ({
                    id: s.id, height: s.getBoundingClientRect().height,
                    imgs: [...s.querySelectorAll('img')].map(i => [i.complete, i.naturalWidth]),
                    tables: s.querySelectorAll('table').length})),
                doc_height: document.documentElement.scrollHeight,
                doc_width: document.documentElement.scrollWidth,
                view_width: document.documentElement.clientWidth,
                // elements that hide part of their content (a scroll box or a clip)
                clipped: [...document.querySelectorAll('body *')].filter(e => {
                    const st = getComputedStyle(e);
                    const hides = [st.overflowX, st.overflowY].some(o => o !== 'visible');
                    return hides && (e.scrollHeight > e.clientHeight + 1 || e.scrollWidth > e.clientWidth + 1);
                }).map(e => e.tagName + (e.className ? '.' + e.className : '')),
                // tables or figures wider than the page body
                too_wide: [...document.querySelectorAll('table, figure img')].filter(
                    e => e.getBoundingClientRect().right > document.body.getBoundingClientRect().right + 1
                ).map(e => e.dataset.table || e.alt),
            })""")
            page.screenshot(path=str(shot), full_page=True)
        finally:
            browser.close()
    from PIL import Image

    with Image.open(shot) as im:
        shot_height = im.size[1]
    return {"errors": errors, "failed": failed, "blocked": blocked, "requested": requested,
            "shot_height": shot_height, **info}


def _check_not_clipped(out: dict) -> None:
    """Nothing hidden: no scroll box or clip, nothing wider than the page, and the full-page
    screenshot is the whole document (its height is the document's)."""
    assert out["clipped"] == [], out["clipped"]
    assert out["too_wide"] == [], out["too_wide"]
    assert out["doc_width"] <= out["view_width"], (out["doc_width"], out["view_width"])
    assert out["shot_height"] == out["doc_height"], (out["shot_height"], out["doc_height"])


def test_tiny_report_is_not_clipped_in_chromium(tmp_path):
    """The same browser checks on a tiny model with a foil (fast: in the default suite)."""
    from helpers import make_tiny

    _browser_or_skip()
    model = make_tiny("llama")
    res = tk.TokenTrace(prompts=PROMPT, target=" Paris", foil=" Beijing", key_max_tokens=0,
                        top_neurons=3).run(model, progress=False)
    d = res.save(tmp_path / "trace")
    out = _render(d / "report.html", d / "screenshot.png")
    assert out["errors"] == [] and out["failed"] == [] and out["blocked"] == [], out
    assert [s["id"] for s in out["sections"]] == [k for k, _ in SECTIONS]
    _check_not_clipped(out)


@pytest.mark.slow
def test_report_renders_offline_in_chromium(embedded_model, tmp_path):
    _browser_or_skip()
    res = tk.TokenTrace(prompts=PROMPT, target=" Paris", foil=" Beijing", key_max_tokens=512).run(
        embedded_model, progress=False)
    d = res.save(tmp_path / "trace")
    out = _render(d / "report.html", d / "screenshot.png")
    assert out["errors"] == [] and out["failed"] == [] and out["blocked"] == [], out
    _check_not_clipped(out)
    # SmolLM2 is not GPT-2: the raw-score head is the prompt's top head, not the article's L0H6
    assert res.meta["head_source"] == "top head by DLA" and res.meta["head"] == res.tables["top_heads"]["component"][0]
    assert len(res.tables["components"]) > TOP_COMPONENTS and (d / "components.csv").is_file()
    assert [s["id"] for s in out["sections"]] == [k for k, _ in SECTIONS]
    for s in out["sections"]:
        assert s["height"] > 20, s
        assert all(ok and w > 0 for ok, w in s["imgs"]), s  # every inline figure decoded
        if s["id"] != "sae":
            assert s["tables"], s
        if s["id"] not in ("sae", "tokenization"):
            assert s["imgs"], s
    shot = d / "screenshot.png"
    assert shot.is_file() and shot.stat().st_size > 10_000
    keep = os.environ.get("TRACEKIT_SCREENSHOT_DIR")
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, Path(keep) / "trace_report.png")

"""Every kind of report in a real browser: headless Chromium (driven by Playwright) opens each
report's index.html at a laptop's viewport and finds no console or page error, every image loaded,
every figure captioned and nothing wider than the viewport (a wide table scrolls inside its own
frame). A full-page screenshot of each is kept in LAB_SCREENSHOTS (default: the test's temporary
folder), e.g. `LAB_SCREENSHOTS=/tmp/shots pytest tests/test_reports_browser.py`."""

from __future__ import annotations

import math
import os
import re
from datetime import UTC, datetime
from pathlib import Path

import pytest

from tests.support import require
from vllm_lab import cli
from vllm_lab.reports import build
from vllm_lab.reports.pdf import chromium
from vllm_lab.store import Store

# Untimed: reports of the predictor's runs and Chromium's rendering, no live window (make test).
pytestmark = [pytest.mark.integration, pytest.mark.untimed]

KINDS = ("sweep", "combo", "tune", "stress", "claims", "autotune", "quarterly")
VIEWPORT = {"width": 1280, "height": 800}  # a typical laptop
SETS = ["load.mode=open", "load.shape.level=20", "load.stop.duration_s=5"]

# What the page holds once loaded: its width, its images, its figures, and the elements that
# widen it (wider than the viewport, not inside a frame that scrolls), for the failure message.
INSPECT = """() => {
  const scrolls = e => { for (let a = e.parentElement; a; a = a.parentElement)
                           if (getComputedStyle(a).overflowX !== 'visible') return true;
                         return false; };
  const name = e => e.tagName.toLowerCase() + (e.className ? '.' + e.className : '');
  return {
    width: document.documentElement.scrollWidth,
    viewport: window.innerWidth,
    images: document.images.length,
    broken: [...document.images].filter(i => !(i.complete && i.naturalWidth > 0)).map(i => i.alt),
    uncaptioned: [...document.querySelectorAll('figure')].filter(f => !f.querySelector('figcaption'))
                   .map(f => f.querySelector('img')?.alt ?? name(f)),
    wide: [...document.body.querySelectorAll('*')]
            .filter(e => e.scrollWidth > window.innerWidth && !scrolls(e)
                         && getComputedStyle(e).overflowX === 'visible').map(name),
    cut: [...document.querySelectorAll('.table-wrap')].filter(w => w.scrollWidth > w.clientWidth + 1)
           .map(w => [...w.querySelectorAll('thead tr:last-child th')].map(h => h.textContent).join(' | ')),
  };
}"""


@pytest.fixture(scope="module")
def browser():
    """Headless Chromium, the one the PDF is printed with, driven by Playwright."""
    exe = chromium()
    require(None if exe else "Chromium is not installed (scripts/install-system-deps.sh installs it)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        require("Playwright is not installed (make venv installs the dev extras)")
    with sync_playwright() as playwright:
        # Root (a container, CI) cannot use Chromium's sandbox.
        browser = playwright.chromium.launch(executable_path=exe, args=["--no-sandbox"])
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> dict[str, Path]:
    """One report of each kind, its index.html by kind: the lab's own commands on the twin's
    predictor (seconds, no server) into one store, then the quarterly report of this quarter."""
    out = tmp_path_factory.mktemp("reports")
    common = ["--backend", "predict", "--out", str(out)]
    sets = [arg for s in SETS for arg in ("--set", s)]
    commands = {
        "sweep": ["sweep", *common, *sets, "--param", "max-num-seqs", "--values", "8,32,128"],
        "combo": ["combo", *common, *sets, "--grid", "max-num-seqs=8,64 max-num-batched-tokens=2048,8192"],
        "tune": ["tune", *common, *sets, "--trials", "6", "--seed", "0"],
        # Levels around the predicted capacity, runs long enough for the knee to show.
        "stress": ["stress", *common, "--set", "load.stop.duration_s=20", "--shape", "ramp",
                   "--refine", "0"],
        "claims": ["claims", *common, "--hardware", "cpu-demo", "--set", "load.stop.duration_s=3"],
        "autotune": ["autotune", *common, "--scenario", "realtime-chat", "--trials", "6", "--seed", "0"],
    }
    for kind, argv in commands.items():
        assert cli.main([*argv, "--experiment", kind]) == 0, f"lab {kind} failed"
    # The predictor has no hosts, so its pages have no host-time section: two experiments are
    # given the span a command on real hosts keeps, and their pages rebuilt with it.
    with Store(out / "lab.db") as store:
        for kind in ("sweep", "claims"):
            runs = store.runs(kind)
            store.update_meta(kind, host_time=[{"began": runs["started"].min() - 5.0,
                                                "provisioned_s": 3.0, "stops_s": 1.0,
                                                "ended": runs["ended"].max() + 2.0}])
    for kind in ("sweep", "claims"):
        build(out / "lab.db", kind, out)
        assert "Time on the hosts" in (out / kind / "index.html").read_text()
    now = datetime.now(UTC)
    period = f"{now.year}Q{(now.month - 1) // 3 + 1}"
    assert cli.main(["quarterly", "--out", str(out), "--period", period, "--no-pdf"]) == 0
    return {kind: out / kind / "index.html" for kind in commands} | {
        "quarterly": out / "quarterly" / period / "index.html"}


@pytest.fixture(scope="module")
def screenshots(tmp_path_factory) -> Path:
    """Where the screenshots go: LAB_SCREENSHOTS to keep them, else the test's temporary folder."""
    kept = os.environ.get("LAB_SCREENSHOTS")
    folder = Path(kept) if kept else tmp_path_factory.mktemp("screenshots")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@pytest.mark.parametrize("kind", KINDS)
def test_a_report_reads_well_in_a_browser(browser, reports, screenshots, kind):
    page = browser.new_page(viewport=VIEWPORT)
    errors: list[str] = []
    page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
    page.on("pageerror", lambda exc: errors.append(f"page error: {exc}"))
    try:
        page.goto(reports[kind].as_uri(), wait_until="load")
        found = page.evaluate(INSPECT)
        # Saved before the checks: a page that fails them is the one worth looking at.
        page.screenshot(path=screenshots / f"{kind}.png", full_page=True)
    finally:
        page.close()
    assert errors == [], f"{kind}: the browser reported errors"
    assert found["images"] > 0 and found["broken"] == [], f"{kind}: images that did not load"
    assert found["uncaptioned"] == [], f"{kind}: figures without a caption"
    assert found["width"] <= found["viewport"], \
        f"{kind}: {found['width']} px wide in a {found['viewport']} px window, widened by {found['wide']}"
    # A table wider than its frame hides columns behind a scroll bar: every column fits.
    assert found["cut"] == [], f"{kind}: tables whose columns do not fit 1280 px: {found['cut']}"


# A4 less the 12 mm margins of the quarterly report's @page, in CSS pixels (96 per inch).
A4_CONTENT = {"width": round(186 / 25.4 * 96), "height": round(273 / 25.4 * 96)}


def test_the_quarterly_pdf_has_no_blank_pages(browser, reports, tmp_path):
    # Each section used to start a page of its own: 8 pages, most of them blank. The PDF now
    # takes about the pages its content fills when printed.
    from vllm_lab.reports.pdf import print_pdf
    pdf = print_pdf(reports["quarterly"], tmp_path / "report.pdf").read_bytes()
    pages = len(re.findall(rb"/Type\s*/Page[^s]", pdf))
    page = browser.new_page(viewport=A4_CONTENT)
    try:
        page.emulate_media(media="print")
        page.goto(reports["quarterly"].as_uri(), wait_until="load")
        height = page.evaluate("document.documentElement.scrollHeight")
    finally:
        page.close()
    assert 0 < pages <= math.ceil(height / A4_CONTENT["height"]) + 1, (pages, height)

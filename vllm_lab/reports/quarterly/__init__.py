"""The quarterly report: every experiment of a period (runs started within it), read from the store.

It compares the baseline now with the previous period, names per scenario and GPU the best
configuration found and its margin, summarises the sweeps, combinations and stress tests, names
each autotune's best (by ``analysis.autotune.outcome``, as its own report does), where the hosts'
time went, the monitoring probes (regression watch), the troubleshooting findings, and writes the recommended
flag changes as ready scenario files. Output: ``index.html`` (figures embedded), ``report.md``,
``report.pdf`` (headless Chromium prints the HTML) and ``recommended/*.yaml`` beside them.

Its seams are its modules: ``period`` (which quarter), ``data`` (the store's runs and sample
figures), ``vllm_lab.analysis.quarterly`` (the tables), ``charts`` (the figures), ``recommended`` (the
scenario files) and ``document`` (the page).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from vllm_lab import outdir
from vllm_lab.analysis.quarterly import (
    all_findings,
    autotune_summary,
    baseline_comparison,
    best_configurations,
    findings_table,
    host_time_summary,
    point_means,
    stress_summary,
    sweep_rollup,
    sweep_summary,
    watch_summary,
)
from vllm_lab.reports import page
from vllm_lab.reports.pdf import ReportError, chromium, print_pdf
from vllm_lab.reports.quarterly.charts import (
    caption,
    figure_baseline,
    figure_best,
    figure_combos,
    figure_stress,
    figure_sweeps,
    figure_watch,
)
from vllm_lab.reports.quarterly.data import load_runs, sample_figures
from vllm_lab.reports.quarterly.document import quarterly_page, sections
from vllm_lab.reports.quarterly.period import Period, parse_period
from vllm_lab.reports.quarterly.recommended import recommendations

__all__ = ["Period", "ReportError", "all_findings", "autotune_summary", "baseline_comparison",
           "best_configurations", "build", "chromium", "findings_table", "host_time_summary", "load_runs", "parse_period",
           "point_means", "print_pdf", "recommendations", "sample_figures", "stress_summary",
           "sweep_rollup", "sweep_summary", "watch_summary"]


def build(store_path: Path, period_text: str, out_root: Path, pdf: bool = True,
          say: Callable[[str], Any] = lambda line: None) -> Path:
    """Write the period's report folder (HTML, Markdown, PDF, figures, scenario files); return
    index.html. ``say`` hears each stage as it ends (the command prints them: a large store takes
    a while to read, and the PDF a while to print)."""
    period = parse_period(period_text)
    store_path = Path(store_path)
    if not store_path.exists():
        raise ReportError(f"{store_path}: no store; run an experiment first or pass OUT=<folder>")
    runs = load_runs(store_path, period.previous_start, period.end)
    before = runs[runs["started"] < period.start]
    now = runs[runs["started"] >= period.start].copy()
    if now.empty:
        raise ReportError(f"{store_path}: no runs started in {period.name} "
                          f"({datetime.fromtimestamp(period.start, UTC):%Y-%m-%d} to "
                          f"{datetime.fromtimestamp(period.end, UTC):%Y-%m-%d}, UTC)")
    now = now.join(sample_figures(store_path, now))
    say(f"{period.name}: {len(now)} runs of {now['experiment_id'].nunique()} experiments read "
        f"({len(before)} of the period before)")
    folder = outdir.make_folder(out_root, out_root / "quarterly" / period.name)
    outdir.no_links_within(out_root, folder)  # its files are written one by one
    text = caption(now, period)
    points = point_means(now)
    cmp = baseline_comparison(now, before)
    best = best_configurations(now)
    sweeps, stress, watch = sweep_summary(now), stress_summary(store_path, now), watch_summary(now)
    autotunes = autotune_summary(store_path, now)
    hours = host_time_summary(store_path, period.start, period.end)
    found = findings_table(all_findings(now), now)
    recs = recommendations(best, now, folder / "recommended")
    figures = {"baseline": figure_baseline(cmp, folder, text),
               "best": figure_best(best, folder, text),
               "sweeps": figure_sweeps(points, folder, text),
               "combos": figure_combos(points, folder, text),
               "stress": figure_stress(points, stress, folder, text),
               "watch": figure_watch(now, folder, text)}
    say(f"{period.name}: analyses done, {sum(f is not None for f in figures.values())} figures drawn")
    parts = sections(period, now, cmp, best, sweeps, stress, watch, found, recs, figures, points,
                     autotunes, hours)
    index = page.write_page(quarterly_page(period, parts, text), folder)
    best.drop(columns=["serve", "base_serve"], errors="ignore").to_csv(folder / "best.csv", index=False)
    if pdf:
        say(f"{period.name}: page written; printing the PDF")
        print_pdf(index, folder / "report.pdf")
    return index

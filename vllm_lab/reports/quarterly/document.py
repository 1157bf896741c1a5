"""The quarterly report's page: its sections (lead sentence, tables, figures) written by the shared
page writer, in a layout that prints to A4."""

from __future__ import annotations

import html
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from vllm_lab.analysis import host_time
from vllm_lab.analysis.points import BEST_RULE, STATISTIC
from vllm_lab.analysis.quarterly import sweep_rollup
from vllm_lab.reports import page
from vllm_lab.reports.page import Block, fmt
from vllm_lab.reports.quarterly.period import Period
from vllm_lab.reports.quarterly.recommended import interval_text

CSS = """
body{font-family:"DejaVu Sans",system-ui,sans-serif;max-width:1180px;margin:1.5em auto;color:#222;
     font-size:14px;line-height:1.4}
h1{margin-bottom:.2em} h2{border-bottom:2px solid #dde;padding-bottom:.2em;margin-top:1.6em}
table{border-collapse:collapse;font-size:12px;margin:.6em 0;width:100%}
td,th{border:1px solid #ccc;padding:3px 6px;text-align:left;vertical-align:top}
th{background:#f0f2f6} tr:nth-child(even) td{background:#fafafa}
td.num{text-align:right;white-space:nowrap}
figure{margin:.8em 0} img{max-width:100%} .lead{font-size:1.05em;background:#eef4fb;padding:.5em .7em}
.ctx{color:#555;white-space:pre-line;font-size:12px} code{font-size:12px}
@page{size:A4;margin:12mm}
@media print{body{max-width:none;margin:0;font-size:11px} table{font-size:9px}
  h2{break-after:avoid} .lead{break-after:avoid} figure,tr,.lead{break-inside:avoid}
  thead{display:table-header-group}}
"""


@dataclass
class Section:
    """One section of the report: a title, a lead sentence, tables and figures."""

    title: str
    lead: str
    tables: list[tuple[list[str], list[list[str]]]]
    figures: list[Path]
    notes: list[str]


def section_table(df: pd.DataFrame, columns: list[tuple[str, str, str]], limit: int = 40):
    """(header, rows) for ``columns`` = [(column, heading, format)], at most ``limit`` rows."""
    header = [h for _, h, _ in columns]
    rows = [[fmt(r.get(c), k or "fixed") for c, _, k in columns] for r in df.head(limit).to_dict("records")]
    return header, rows


def sections(period: Period, runs: pd.DataFrame, cmp: pd.DataFrame, best: pd.DataFrame,
             sweeps: pd.DataFrame, stress: pd.DataFrame, watch: pd.DataFrame,
             found: pd.DataFrame, recs: pd.DataFrame, figures: dict[str, Path | None],
             points: pd.DataFrame, autotunes: pd.DataFrame, hours: pd.DataFrame) -> list[Section]:
    """The report's sections in order, from the period's analyses and figures."""
    return [_overview(runs), _baseline(period, cmp, figures), _best(best, figures),
            _tuning(sweeps, stress, points, figures), _autotune(autotunes), _host_time(hours),
            _watch(watch, figures), _findings(found), _recommended(recs)]


def _figures(figures: dict[str, Path | None], *names: str) -> list[Path]:
    return [f for f in (figures.get(n) for n in names) if f]


def _overview(runs: pd.DataFrame) -> Section:
    by_step = runs.groupby("step").size().to_dict()
    by_status = runs.groupby("status").size().to_dict()
    return Section(
        "The period at a glance",
        f"{len(runs):,} runs in {runs['experiment_id'].nunique():,} experiments, "
        f"{pd.to_datetime(runs['started'].min(), unit='s'):%Y-%m-%d} to "
        f"{pd.to_datetime(runs['started'].max(), unit='s'):%Y-%m-%d} (UTC).",
        [(["step", "runs"], [[k, f"{v:,}"] for k, v in sorted(by_step.items())]),
         (["status", "runs"], [[k, f"{v:,}"] for k, v in sorted(by_status.items())])],
        [], [f"GPUs: {', '.join(sorted(runs['gpu_model'].unique()))}",
             (f"hosts: {runs['host'].nunique()}, vLLM versions: "
             f"{', '.join(sorted(runs['vllm_version'].unique()))}")])


def _baseline(period: Period, cmp: pd.DataFrame, figures: dict[str, Path | None]) -> Section:
    slower = cmp[cmp["verdict"] == "slower"] if len(cmp) else cmp
    return Section(
        f"Baseline: {period.name} against {period.previous}",
        (f"{len(slower)} of {len(cmp)} baselines are significantly slower than last period."
         if len(cmp) else "No baseline runs this period."),
        [section_table(cmp, [("label", "scenario · GPU", ""), ("runs_now", "runs", ""),
                      ("output_throughput_now", "tok/s now", ""),
                      ("output_throughput_before", "tok/s before", ""),
                      ("throughput_change", "change", "pct"), ("p_value", "p", "p"),
                      ("ttft_p99_now", "TTFT p99 now (ms)", "ms"),
                      ("ttft_p99_before", "before (ms)", "ms"),
                      ("tpot_p99_now", "TPOT p99 now (ms)", "ms"), ("verdict", "verdict", "")])],
        _figures(figures, "baseline"), [])


def _best(best: pd.DataFrame, figures: dict[str, Path | None]) -> Section:
    shown = best.assign(
        vs_base=[interval_text(r["margin_vs_baseline"], r["margin_low"], r["margin_high"])
                 for _, r in best.iterrows()],
        vs_runner=[interval_text(r["vs_runner_up"], r["vs_runner_up_low"], r["vs_runner_up_high"])
                   for _, r in best.iterrows()]) if len(best) else best
    return Section(
        "Best configuration per scenario",
        f"Each tuning experiment's best by the rule its own report states ({BEST_RULE}; a "
        f"search's on the figure its objective maximizes, e.g. output tokens per joule); per "
        f"scenario and GPU the one with the highest goodput, and its goodput against the baseline "
        f"and the runner-up with the 95% interval of the difference: an interval that holds 0 is "
        f"no gain. Figures: {STATISTIC}.",
        [section_table(shown, [("label", "scenario · GPU", ""), ("point", "flags varied", ""),
                       ("goodput", "goodput req/s", ""), ("base_goodput", "baseline req/s", ""),
                       ("vs_base", "against the baseline", ""),
                       ("vs_runner", "against the runner-up", ""),
                       ("ttft_p99", "TTFT p99 ms", "ms"), ("tpot_p99", "TPOT p99 ms", "ms"),
                       ("experiment_id", "experiment", "")])],
        _figures(figures, "best"), [])


def _tuning(sweeps: pd.DataFrame, stress: pd.DataFrame, points: pd.DataFrame,
            figures: dict[str, Path | None]) -> Section:
    return Section(
        "Sweeps, combinations and stress tests",
        f"{len(sweeps)} sweeps, {points[points['step'].isin(('combo', 'tune'))]['experiment_id'].nunique()} "
        f"combination searches, {len(stress)} stress tests.",
        [section_table(sweep_rollup(sweeps),
                [("label", "scenario · GPU", ""), ("param", "flag", ""), ("sweeps", "sweeps", ""),
                 ("best_values", "best under SLO (how often)", ""),
                 ("gain_median", "best's goodput vs defaults (median)", "pct"),
                 ("real_gains", "gains outside the noise", ""), ("latest", "latest sweep", "")],
                limit=60),
         section_table(stress, [("label", "scenario · GPU", ""), ("levels", "levels", ""),
                         ("knee", "knee req/s", ""),
                         ("max_sustainable", "max sustainable req/s", ""),
                         ("peak_throughput", "peak tok/s", ""),
                         ("ttft_p99_at_peak_s", "TTFT p99 at peak ms", "ms"),
                         ("experiment_id", "experiment", "")], limit=30)],
        _figures(figures, "sweeps", "combos", "stress"), [])


def _autotune(autotunes: pd.DataFrame) -> Section:
    rules = sorted(set(autotunes["rule"])) if len(autotunes) else []
    return Section(
        "Autotune: the best found",
        (f"{len(autotunes)} autotune(s), each one's best as its own report names it: "
         + "; ".join(rules) + ". Its SLO capacity stands against vLLM's defaults', with the "
         "autotune's verdict; each candidate's staircase is among the stress tests above."
         if len(autotunes) else "No autotune this period."),
        [section_table(autotunes, [("label", "scenario · GPU", ""), ("best", "best", ""),
                                   ("best_flags", "its flags", ""),
                                   ("best_capacity", "SLO capacity req/s", ""),
                                   ("defaults_capacity", "defaults req/s", ""),
                                   ("gain", "gain", "pct"), ("verdict", "verdict", "text"),
                                   ("backend", "measured on", ""),
                                   ("experiment_id", "experiment", "")])] if len(autotunes) else [],
        [], [])


def _host_time(hours: pd.DataFrame) -> Section:
    if not len(hours):
        return Section("Host time", "No experiment of this period kept its time on real hosts "
                       "(the predictor's have none).", [], [], [])
    # The period's parts summed, read by the account's own shares (spans and hosts not summed).
    spent = host_time.HostTime({p: hours[f"{p}_s"].sum() for p in host_time.PARTS},
                               spans=0, hosts=0)
    return Section(
        "Host time: where the hosts' minutes went",
        (f"{spent.total_s / 60:,.1f} host minutes over {len(hours)} experiment(s): the steady "
         f"windows, the only part the figures come from, {spent.share('measuring'):.0%}; server "
         f"starts and stops {spent.share('starts'):.0%}; warm-up {spent.share('warmup'):.0%}; the "
         f"load after each window {spent.share('drain'):.0%}; the lab's own (provisioning and "
         f"between runs) {spent.overhead_share:.0%}."),
        [section_table(hours, [("experiment_id", "experiment", ""), ("step", "step", ""),
                               ("host_minutes", "host minutes", ""),
                               ("measuring", "windows", "share"), ("starts", "starts", "share"),
                               ("warmup", "warm-up", "share"), ("drain", "drain", "share"),
                               ("lab", "lab's own", "share")])],
        [], [])


def _watch(watch: pd.DataFrame, figures: dict[str, Path | None]) -> Section:
    total_reg = int(watch["regressions"].sum()) if len(watch) else 0
    return Section(
        "Monitoring: the regression watch",
        f"{int(watch['probes'].sum()) if len(watch) else 0} probes on {len(watch)} deployments; "
        f"{total_reg} flagged as a regression against their recorded baseline.",
        [section_table(watch, [("host", "deployment", ""), ("label", "scenario · GPU", ""),
                        ("probes", "probes", ""), ("failed", "failed", ""),
                        ("throughput_first", "tok/s first", ""),
                        ("throughput_last", "tok/s last", ""),
                        ("ttft_p99_median", "TTFT p99 median (ms)", "ms"),
                        ("gpu_util_mean", "GPU util %", ""), ("kv_usage_max", "KV max", ""),
                        ("regressions", "regressions", "")])],
        _figures(figures, "watch"), [])


def _findings(found: pd.DataFrame) -> Section:
    return Section(
        "Findings",
        f"{int(found['runs'].sum()) if len(found) else 0} runs show a pattern of the tuning guide's "
        "troubleshooting list; per pattern, scenario and GPU, the latest run's numbers and the flag "
        "to try.",
        [section_table(found, [("title", "finding", ""), ("label", "scenario · GPU", ""),
                        ("runs", "runs", ""), ("evidence", "numbers (latest run)", ""),
                        ("flags", "try", "")], limit=30)], [], [])


def _recommended(recs: pd.DataFrame) -> Section:
    rows = [[r["label"], fmt(r["changes"], "fixed"), r["margin"], str(r["file"].name)]
            for r in recs.to_dict("records")]
    return Section(
        "Recommended flag changes",
        "Ready scenario files, written next to this report, for a best whose gain over the "
        "baseline is outside the noise: run `make baseline SCENARIO=<file>` to confirm a change "
        "on your own traffic before adopting it.",
        [(["scenario · GPU", "change", "goodput vs baseline", "file"], rows)], [], [])


def quarterly_page(period: Period, parts: list[Section], caption: str) -> page.Page:
    """The whole report as one page: a section per part, tables and figures in order."""
    e = html.escape
    title = f"Quarterly report {period.name}"
    blocks = [Block(f"<h1>{e(title)}</h1>", [f"# {title}", ""]),
              Block(f'<p class="ctx">{e(caption)}</p>', ["```", caption, "```", ""])]
    for s in parts:
        blocks.append(Block(f"<h2>{e(s.title)}</h2>", [f"## {s.title}", ""]))
        blocks.append(Block(f'<p class="lead">{e(s.lead)}</p>', [s.lead, ""]))
        for header, rows in s.tables:
            if rows:
                blocks.append(Block(page.html_table(header, rows, numeric_class=True),
                                    page.md_table(header, rows) + [""]))
        if s.notes:
            blocks.append(page.notes(s.notes))
            blocks.append(Block(md=[""]))
        blocks.append(Block("".join(page.img(f) for f in s.figures),
                            [line for f in s.figures for line in page.md_img(f)] + [""]))
    blocks.append(Block(f'<p style="color:#888;font-size:11px">Built from the store alone: make report '
                        f"PERIOD={period.name}</p>"))
    return page.Page(title, blocks, CSS)

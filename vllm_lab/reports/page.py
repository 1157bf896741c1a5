"""The one page writer and formatter of every report: index.html (self-contained) and report.md.

A page is a list of blocks, each with its HTML and its Markdown, written in order; the tables,
figures and notes of every report go through the same functions here, so a number reads the same
on every page and in both files.
"""

from __future__ import annotations

import base64
import html
import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from vllm_lab import inputs
from vllm_lab.flags import redact
from vllm_lab.reports.figures import caption_for

# The stylesheet of an experiment's page; the quarterly report brings its own (print layout).
CSS = """body{font-family:system-ui,sans-serif;max-width:1200px;margin:2em auto;padding:0 1em;color:#222}
table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #ccc;padding:3px 6px;text-align:left}
td.num{text-align:right;white-space:nowrap}
th{background:#f3f3f3}img{max-width:100%}.headline{font-size:1.2em;background:#eef7ee;padding:.6em}
.ctx{color:#555;white-space:pre-line}"""
# Every page's tables fit it: a wide or long table scrolls inside its frame, its header stays in
# view, and its column groups are named above the columns. Figures carry a one-line caption. A file
# shown as it is (best.yaml: its first comment is one long line) wraps rather than widen the page.
TABLE_CSS = """
.table-wrap{max-width:100%;max-height:75vh;overflow:auto;margin:.6em 0;border:1px solid #ddd}
.table-wrap table{margin:0}
.table-wrap thead{position:sticky;top:0;z-index:1}
.table-wrap thead tr.groups th{text-align:center;font-weight:600;background:#e6e9ef}
figcaption{color:#555;font-size:13px;margin:.2em 0 1em}
pre{white-space:pre-wrap;overflow-wrap:break-word;background:#f7f7f7;padding:.6em}
@media print{.table-wrap{max-height:none;overflow:visible;border:0}
  .table-wrap thead{position:static}}"""
FOOTER_STYLE = "color:#888;font-size:12px"
_NUMERIC = re.compile(r"[-+<–]?[\d,.]+%?( ± [\d,.]+)?|–")


# -- the formatter ----------------------------------------------------------------------------

def fmt(v: Any, style: str = "sig") -> str:
    """One value as a table shows it.

    Styles: ``sig`` three significant digits, never an exponent (thousands whole, with
    separators), a missing value "–"; ``fixed`` whole numbers from 100 up, two decimals below; ``pct`` a signed percentage;
    ``share`` a part of a whole, in whole percent;
    ``ms`` seconds as whole milliseconds; ``p`` a p-value; ``text`` the value as written, a missing
    one empty. A mapping reads ``k=v, ...`` ("defaults" when empty).
    """
    missing = v is None or (isinstance(v, (float, np.floating)) and np.isnan(v))
    if style == "text":
        return "" if v is None or (np.isscalar(v) and pd.isna(v)) else str(v)
    if missing:
        return "–"
    if style == "pct":
        return f"{v:+.1%}"
    if style == "share":
        return f"{v:.0%}"
    if style == "ms":
        return f"{v * 1000:.0f}"
    if style == "p":
        return f"{v:.3f}" if v >= 0.001 else "<0.001"
    if isinstance(v, dict):
        return ", ".join(f"{k}={x}" for k, x in v.items()) or "defaults"
    if isinstance(v, (float, np.floating)):
        if style == "fixed":
            return f"{v:,.0f}" if float(v).is_integer() or abs(v) >= 100 else f"{v:.2f}"
        return significant(float(v))
    return str(v)


def significant(v: float, digits: int = 3) -> str:
    """``v`` to ``digits`` significant digits, positional (never an exponent), thousands whole
    with separators; what rounding left of zero (1e-13 of a difference) reads 0."""
    if abs(v) < 1e-9:
        return "0"
    if abs(v) >= 10 ** (digits - 1) - 0.5:
        return f"{v:,.0f}"
    v = float(f"{v:.{digits - 1}e}")  # rounded first: 9.996 is 10.0, not 10.00
    decimals = digits - 1 - int(np.floor(np.log10(abs(v))))
    return f"{v:.{decimals}f}"


# -- what every figure and page states --------------------------------------------------------

@dataclass
class Context:
    """What every figure states: hardware, model, vLLM version, backend, workload."""

    hardware: str
    model: str
    vllm_version: str
    backend: str
    workload: str
    load: str
    slo: dict[str, Any]
    serve: dict[str, Any]

    @property
    def caption(self) -> str:
        """Two lines: hardware, model, vLLM version and backend; the workload and the load."""
        backend = {"twin": "twin (simulated)", "predict": "twin predictor (simulated)"}.get(
            self.backend, self.backend)
        return (f"{self.hardware} · {self.model} · vLLM {self.vllm_version} · {backend}\n"
                f"workload: {self.workload} · load: {self.load}")

    @property
    def slo_text(self) -> str:
        """The SLO in a phrase ("" when there is none)."""
        return ", ".join(f"{k} p{v['percentile']:g} ≤ {v['threshold_ms']:g} ms"
                         for k, v in self.slo.items() if v)


def context(runs: pd.DataFrame, swept: Sequence[str] = ()) -> Context:
    """The context of an experiment's runs (its first run's scenario, the swept flags named)."""
    # Redacted again: a store written before secrets were redacted on the way in still holds them.
    first = redact(json.loads(runs.iloc[0]["scenario_json"]))
    # The swept flags vary by point: the header names them instead of the first point's value.
    first["serve"] = {k: ("swept" if k in swept else v) for k, v in first["serve"].items()}
    w, ld = first["workload"], first["load"]
    shape = ld["shape"]
    unit = "users" if ld["mode"] == "closed" else "req/s"
    if ld["mode"] == "replay":
        rp = ld.get("replay") or {}
        pace = f"at a mean {rp['rate']:g} req/s" if rp.get("rate") else f"at {rp.get('speed', 1):g}x"
        load = f"trace replayed {pace}, {ld['stop']['duration_s']:g} s per run"
    else:
        load = (f"{ld['mode']} loop, {shape['kind']} {shape['level']:g} {unit}, "
                f"{ld['stop']['duration_s']:g} s per run")
    source = f"trace {Path(w['path']).name} ({w.get('trace_format')})" if w["source"] == "trace" \
        else w["source"]
    return Context(hardware=runs.iloc[0]["gpu_model"], model=str(first["serve"].get("model")),
                   vllm_version=runs.iloc[0]["vllm_version"], backend=runs.iloc[0]["backend"],
                   workload=f"{source} via /v1/{w['api']}", load=load, slo=first.get("slo") or {},
                   serve=first["serve"])


# -- blocks ------------------------------------------------------------------------------------

@dataclass
class Block:
    """A piece of a page: its HTML (with its own line breaks) and its Markdown lines."""

    html: str = ""
    md: list[str] = field(default_factory=list)


def md_cell(text: str) -> str:
    """A Markdown table cell: no pipe, no line break."""
    return text.replace("|", "/").replace("\n", " ")


def md_table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    """A Markdown table's lines."""
    return (["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
            + ["| " + " | ".join(md_cell(c) for c in r) + " |" for r in rows])


def html_table(header: Sequence[str], rows: Iterable[Sequence[str]], numeric_class: bool = False,
               groups: Sequence[str] | None = None) -> str:
    """An HTML table in a frame that scrolls, its header sticky: ``groups`` (one name per column,
    "" for none) adds a row naming runs of columns; with ``numeric_class`` numbers get class "num"
    (right-aligned)."""
    head = "<tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in header) + "</tr>"
    if groups and any(groups):
        spans: list[list[Any]] = []
        for g in groups:
            if spans and spans[-1][0] == g:
                spans[-1][1] += 1
            else:
                spans.append([g, 1])
        head = ('<tr class="groups">' + "".join(
            f'<th colspan="{n}">{html.escape(g)}</th>' if n > 1 else f"<th>{html.escape(g)}</th>"
            for g, n in spans) + "</tr>" + head)

    def cell(text: str) -> str:
        if numeric_class and _NUMERIC.fullmatch(text):
            return f'<td class="num">{html.escape(text)}</td>'
        return f"<td>{html.escape(text)}</td>"

    body = "".join("<tr>" + "".join(cell(c) for c in r) + "</tr>" for r in rows)
    return f'<div class="table-wrap"><table><thead>{head}</thead><tbody>{body}</tbody></table></div>'


def frame_rows(df: pd.DataFrame, style: str = "sig") -> tuple[list[str], list[list[str]]]:
    """A frame's header and its rows formatted in ``style``."""
    return [str(c) for c in df.columns], [[fmt(v, style) for v in r] for r in df.itertuples(index=False)]


def table(df: pd.DataFrame, style: str = "sig", groups: Sequence[str] | None = None) -> Block:
    """A frame as a table block, its column ``groups`` named above it on the HTML page."""
    header, rows = frame_rows(df, style)
    return Block(html_table(header, rows, numeric_class=True, groups=groups) + "\n",
                 md_table(header, rows))


def img(path: Path) -> str:
    """A PNG embedded in the page with its one-line caption (what to look at)."""
    data = base64.b64encode(inputs.read_bytes(path, inputs.DATA_BYTES, "figure")).decode()
    text = caption_for(path)
    cap = f"<figcaption>{html.escape(text)}</figcaption>" if text else ""
    return f'<figure><img alt="{path.stem}" src="data:image/png;base64,{data}">{cap}</figure>'


def md_img(path: Path) -> list[str]:
    """A PNG beside report.md, with its caption in italics under it."""
    text = caption_for(path)
    return [f"![{path.stem}]({path.name})"] + ([f"*{text}*", ""] if text else [])


def heading(text: str) -> Block:
    """A section's heading."""
    return Block(f"<h2>{html.escape(text)}</h2>\n", ["", f"## {text}", ""])


def notes(items: Sequence[str]) -> Block:
    """A bulleted list."""
    return Block("<ul>" + "".join(f"<li>{html.escape(n)}</li>" for n in items) + "</ul>\n",
                 [f"- {n}" for n in items])


def footer(command: str, md: bool = False) -> Block:
    """The line saying how to rebuild the page from the store alone."""
    return Block(f'<p style="{FOOTER_STYLE}">Rebuilt from the store alone: {html.escape(command)}</p>\n',
                 [f"Rebuilt from the store alone: `{command}`"] if md else [])


# -- the writer --------------------------------------------------------------------------------

@dataclass
class Page:
    """A whole page: the <title>, its stylesheet and its blocks in order."""

    title: str
    blocks: list[Block]
    css: str = CSS

    def html(self) -> str:
        """The self-contained HTML page."""
        return (f'<!doctype html><html><head><meta charset="utf-8"><title>{html.escape(self.title)}'
                f"</title>\n<style>{self.css}{TABLE_CSS}</style></head><body>\n"
                + "".join(b.html for b in self.blocks) + "</body></html>")

    def markdown(self) -> str:
        """The Markdown page."""
        return "\n".join(line for b in self.blocks for line in b.md) + "\n"


def write_page(page: Page, folder: Path) -> Path:
    """Write report.md and index.html into ``folder``; return the path of index.html."""
    (folder / "report.md").write_text(page.markdown())
    index = folder / "index.html"
    index.write_text(page.html())
    return index

"""The quarterly report's period: a calendar quarter in UTC and the one before it."""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime

from vllm_lab.reports.pdf import ReportError


@dataclass(frozen=True)
class Period:
    """A calendar quarter in UTC: its name, [start, end) in Unix seconds, and the one before."""

    name: str
    start: float
    end: float
    previous: str
    previous_start: float


_PERIOD = re.compile(r"^(\d{4})-?Q([1-4])$", re.IGNORECASE)


def parse_period(text: str) -> Period:
    """PERIOD=2026Q4 as a Period (UTC quarters), or ReportError naming the expected form."""
    match = _PERIOD.match(text.strip())
    if not match:
        raise ReportError(f"PERIOD {text!r} is not a quarter; write it as YYYYQn, e.g. 2026Q4")
    year, quarter = int(match.group(1)), int(match.group(2))

    def first_day(y: int, q: int) -> float:
        y, q = y + (q - 1) // 4, (q - 1) % 4 + 1
        return datetime(y, 3 * q - 2, 1, tzinfo=UTC).timestamp()

    prev_year, prev_q = (year, quarter - 1) if quarter > 1 else (year - 1, 4)
    return Period(f"{year}Q{quarter}", first_day(year, quarter), first_day(year, quarter + 1),
                  f"{prev_year}Q{prev_q}", first_day(prev_year, prev_q))

"""The section every experiment's page ends with: where its time on the hosts went
(``analysis.host_time``), in minutes and shares; none on the predictor or for a store from before
the commands kept their span."""

from __future__ import annotations

import pandas as pd

from vllm_lab.analysis import host_time
from vllm_lab.reports import page
from vllm_lab.reports.page import Block

TITLE = "Time on the hosts"


def section(exp: dict, runs: pd.DataFrame) -> list[Block]:
    """The heading, the table of parts and the sentence that reads it."""
    spent = host_time.account(exp.get("meta") or {}, runs)
    if spent is None:
        return []
    shown = spent.table()
    shown["minutes"] = shown["minutes"].map(lambda m: f"{m:.2f}")
    shown["share"] = shown["share"].map(lambda s: page.fmt(s, "share"))
    return [page.heading(TITLE), page.table(shown, "text"), Block(md=[""]),
            page.notes([sentence(spent)]), Block(md=[""])]


def sentence(spent: host_time.HostTime) -> str:
    """The section's reading in one sentence."""
    hosts = f"{spent.hosts} host{'s' if spent.hosts > 1 else ''}"
    return (f"{spent.total_s / 60:.1f} host minutes on {hosts}: the steady windows, the only "
            f"part the figures come from, took {spent.share('measuring'):.0%}, server starts and "
            f"stops {spent.share('starts'):.0%}, warm-up {spent.share('warmup'):.0%}, and the "
            f"lab's own (provisioning and between runs) {spent.overhead_share:.0%}.")

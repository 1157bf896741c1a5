"""Where an experiment's host time went (analysis.host_time), read from its commands' spans and
its runs' parts, and the section its page ends with."""

import json

import pandas as pd
import pytest

from vllm_lab.analysis import host_time
from vllm_lab.reports import host_time as section


def _run(host: str, started: float, **parts: float) -> dict:
    """A stored run: its window as a column, the rest in its summary JSON (as the store keeps it)."""
    window = parts.pop("duration_s")
    return {"host": host, "started": started, "duration_s": window, "summary_json": json.dumps(parts)}


def test_a_commands_span_is_split_into_its_runs_parts_and_the_labs_own():
    """One command of 200 s on one host: a start of 60 s before its first run, two runs of 30-s
    windows with their warm-up cut and drain, a 5-s stop, 10 s of provisioning; the rest, 48 s, is
    the lab's own."""
    meta = {"host_time": [{"began": 1000.0, "provisioned_s": 10.0, "ended": 1200.0, "stops_s": 5.0}]}
    runs = pd.DataFrame([
        _run("h", 1075.0, server_start_s=60.0, warmup_runs_s=0.0, warmup_s=2.0, duration_s=30.0, drain_s=4.0),
        _run("h", 1120.0, warmup_s=3.0, duration_s=30.0, drain_s=3.0),
        _run("h", 5000.0, server_start_s=99.0, duration_s=99.0),  # another command's
    ])
    spent = host_time.account(meta, runs)
    assert spent.parts == {"starts": 65.0, "warmup": 5.0, "measuring": 60.0, "drain": 7.0,
                           "provisioning": 10.0, "lab": 53.0}
    assert spent.total_s == 200.0 and (spent.spans, spent.hosts) == (1, 1)
    assert spent.share("measuring") == pytest.approx(0.30)
    assert spent.overhead_share == pytest.approx(63 / 200)
    table = spent.table()
    assert list(table["part"])[-1] == "total" and table["share"].iloc[:-1].sum() == pytest.approx(1.0)


def test_a_command_on_two_hosts_counts_its_span_once_a_host():
    """Two hosts busy for the same 100 s are 200 host seconds, provisioning too."""
    meta = {"host_time": [{"began": 0.0, "provisioned_s": 5.0, "ended": 100.0, "stops_s": 0.0}]}
    runs = pd.DataFrame([_run("a", 10.0, duration_s=40.0), _run("b", 10.0, duration_s=40.0)])
    spent = host_time.account(meta, runs)
    assert spent.total_s == 200.0 and spent.hosts == 2
    assert spent.parts["provisioning"] == 10.0 and spent.parts["measuring"] == 80.0


def test_an_experiment_without_spans_has_no_account_and_its_page_no_section():
    """The predictor's experiments, and those of a store from before the spans were kept."""
    runs = pd.DataFrame([_run("", 10.0, duration_s=40.0)])
    assert host_time.account({}, runs) is None
    assert section.section({"meta": {}}, runs) == []


def test_the_section_reads_the_parts_as_minutes_and_shares():
    meta = {"host_time": [{"began": 0.0, "provisioned_s": 6.0, "ended": 600.0, "stops_s": 6.0}]}
    runs = pd.DataFrame([_run("h", 100.0, server_start_s=90.0, duration_s=420.0, drain_s=6.0)])
    blocks = section.section({"meta": meta}, runs)
    md = "\n".join(line for b in blocks for line in b.md)
    assert "## Time on the hosts" in md and "| steady windows (the figures) | 7.00 | 70% |" in md
    assert ("10.0 host minutes on 1 host: the steady windows, the only part the "
            "figures come from, took 70%, server starts and stops 16%, warm-up 0%, and the lab's "
            "own (provisioning and between runs) 13%.") in md

"""The regression watch: a small probe load on a schedule against a live deployment, stored as step
"watch", each probe judged against the deployment's recorded baseline.

A baseline is ``repeats`` probes on the deployment (``--baseline``, or automatically the first
time). A later probe is a regression when a metric is worse than the baseline's one-sided 99%
prediction interval: mean ± t(0.99, n-1) · sd · sqrt(1 + 1/n), so the run-to-run spread the
baseline showed sets the bar, not a fixed percentage. The sd is floored at a small share of the
mean (``SD_FLOOR``) because three identical repeats would otherwise flag any difference at all.

Failed requests are judged as a measured run's are (``load.failed_requests_threshold``, timeouts
aside): a probe past it is ``failed-requests`` and a regression whatever its latencies, and a
baseline with such a probe is refused (a deployment that fails is no reference), the one before
it kept.
"""

from __future__ import annotations

import json
import math
import re
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scipy.special import stdtrit  # scipy.stats' t.ppf, without its ~0.9 s import

from vllm_lab import outdir, scenarios
from vllm_lab.flags import redact_url
from vllm_lab.run_summary import RunSummary
from vllm_lab.store import RunRecord, RunStatus, Store, run_identity

# metric -> +1 when higher is better, -1 when lower is better.
METRICS = {"output_throughput": +1, "ttft_p50": -1, "tpot_p50": -1, "e2e_p50": -1}
CONFIDENCE = 0.99
NEW_BASELINE = "new-baseline"  # a baseline's probes until all of them passed
SD_FLOOR = 0.01  # share of the mean: the probe's own measurement resolution
# The probe: short fixed-length requests from a few users, so it costs the deployment little.
PROBE = ["workload.source=synthetic", 'workload.input={"dist": "fixed", "mean": 64}',
         'workload.output={"dist": "fixed", "mean": 32}', "load.mode=closed",
         "load.shape.level=4", "load.stop.duration_s=8", "run.warmup_requests=0", "run.clean=false"]


class WatchError(RuntimeError):
    """The watch cannot do what was asked; the message is one sentence for the user."""


@dataclass
class Verdict:
    """A probe judged against the baseline: per metric the bound, and what regressed."""

    regressed: list[str]
    lines: list[str]
    baseline_runs: int


def experiment_id(url: str) -> str:
    """One watch experiment per deployment: ``watch-<host>-<port>`` (never a user or password)."""
    netloc, slash, path = url.split("://", 1)[-1].partition("/")
    host = netloc.rsplit("@", 1)[-1]  # user:password@ left out
    return "watch-" + re.sub(r"[^A-Za-z0-9]+", "-", host + slash + path).strip("-")


def served_model(url: str, api_key: str | None = None) -> str:
    """The model the deployment serves, from /v1/models."""
    req = urllib.request.Request(url + "/v1/models",
                                 headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return str(json.loads(r.read())["data"][0]["id"])
    except (urllib.error.URLError, OSError, KeyError, IndexError, json.JSONDecodeError) as e:
        raise WatchError(f"{redact_url(url)}: the deployment does not answer /v1/models ({e}); "
                         f"is it running (make monitor shows the targets)?") from None


def probe_scenario(model: str, hardware: str | None = None, overrides: list[str] | None = None):
    """The probe as a resolved scenario: the default scenario, the probe load, the served model."""
    return scenarios.resolve("default", hardware, [*PROBE, f"serve.model={model}", *(overrides or [])])


def probe(url: str, store_path: Path, role: str, workdir: Path, hardware: str | None = None,
          overrides: list[str] | None = None, api_key: str | None = None) -> RunRecord:
    """Run one probe against ``url``, store it (step watch, point {"role": role}); its record."""
    from vllm_lab.failures import request_failures
    from vllm_lab.summary import summarize
    from vllm_lab.traffic import run_load  # Locust's gevent patching stays out of plain imports

    model = served_model(url, api_key)
    scenario = probe_scenario(model, hardware, overrides)
    exp = experiment_id(url)
    with Store(store_path) as store:
        store.create_experiment(exp, "watch", scenario.name, {"url": redact_url(url), "probe": PROBE})
        index = len(store.runs(exp))  # every probe its own run, a crashed one too
        started = time.time()
        folder = outdir.no_links_within(workdir.parent, workdir / exp / str(index))  # OUT/.work/...
        result = run_load(url, model, scenario.workload, scenario.load, folder,
                          seed=index, api_key=api_key)
        ended = time.time()
        summary = RunSummary.of(summarize(result.samples, scenario.slo,
                                          server_metrics=result.server_metrics, load=scenario.load))
        failures = request_failures(result.samples)
        summary.update(failures.as_summary())
        status, error = _probe_status(failures, scenario.load.failed_requests_threshold)
        record = RunRecord(
            experiment_id=exp, run_key=run_identity({**scenario.to_record(), "url": redact_url(url)}, index),
            step="watch", scenario_name=scenario.name, scenario=scenario.to_record(),
            status=status, started=started, ended=ended,
            point={"role": role}, repeat=index, host=redact_url(url), gpu_model=scenario.hardware.name,
            vllm_version=scenario.vllm_version, backend="live", summary=summary,
            error=error)
        if role == "probe":
            verdict = judge(store.runs(exp), summary, error)
            summary.regression = bool(verdict.regressed)
            summary.regressed_metrics = verdict.regressed
            record.summary = summary
        store.record_run(record, result.samples, result.server_metrics)
        return record


def _probe_status(failures, threshold: float) -> tuple[RunStatus, str]:
    """How a probe ended: ``crashed`` when nothing was served, ``failed-requests`` past the
    threshold (a measured run's rule), else ``ok``."""
    if failures.requests == 0 or failures.failed == failures.requests:
        return RunStatus.CRASHED, "no request of the probe succeeded" + (
            f": {failures.message()}" if failures.requests else "")
    if failures.rate > threshold:
        return RunStatus.FAILED_REQUESTS, (f"{failures.message()} (threshold {threshold:.0%}: "
                                           f"load.failed_requests_threshold)")
    return RunStatus.OK, ""


def bound(values: list[float], direction: int) -> float:
    """The worst value a new probe may show before it counts as a regression."""
    n = len(values)
    mean = sum(values) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else 0.0
    sd = max(sd, SD_FLOOR * abs(mean))
    t = stdtrit(max(n - 1, 1), CONFIDENCE)
    return mean - direction * t * sd * math.sqrt(1 + 1 / n)


def judge(runs, summary: Mapping[str, Any], failed: str = "") -> Verdict:
    """Compare a probe's summary with the baseline probes of ``runs`` (a watch experiment's rows);
    ``failed``, why the probe's requests failed: a regression whatever its figures say."""
    summary = RunSummary.of(summary)
    base = runs[(runs["point"].map(lambda p: p.get("role")) == "baseline") & (runs["status"] == "ok")]
    if len(base) < 2:
        raise WatchError("the deployment has fewer than 2 baseline probes; record one with "
                         "make watch BASELINE=1")
    regressed, lines = [], []
    if failed:
        regressed.append("failed_requests")
        lines.append(f"failed requests: {failed} REGRESSION")
    for metric, direction in METRICS.items():
        values = [float(v) for v in base[metric].dropna()]
        value = summary.figure(metric)
        if len(values) < 2 or value is None:
            continue
        limit = bound(values, direction)
        worse = (value < limit) if direction > 0 else (value > limit)
        mean = sum(values) / len(values)
        lines.append(f"{metric}: {value:.4g} vs baseline {mean:.4g} (n={len(values)}; "
                     f"{'lower' if direction > 0 else 'upper'} bound {limit:.4g})"
                     + (" REGRESSION" if worse else ""))
        if worse:
            regressed.append(metric)
    return Verdict(regressed, lines, len(base))


def run_schedule(store_path: Path, url: str | None = None, inventory: Path | None = None,
                 every_s: float = 0, count: int = 1, baseline: bool = False, repeats: int = 3,
                 probe_overrides: list[str] | None = None, hardware: str | None = None,
                 workdir: Path = Path("reports/.work"),
                 echo: Callable[[str], None] = print) -> bool:
    """Probe each deployment ``count`` times, ``every_s`` apart; return whether any regressed."""
    if url:
        urls = [url.rstrip("/")]
    else:
        from vllm_lab.monitor import scrape_targets
        urls = [t.url for t in scrape_targets(inventory or Path("inventory/local.yml"))]
    if repeats < 2:
        raise WatchError(f"a baseline needs at least 2 probes to know its spread (got REPEATS={repeats})")
    regressed = False
    for round_ in range(max(count, 1)):
        if round_:
            time.sleep(every_s)
        for target in urls:
            regressed |= _round(target, store_path, baseline and round_ == 0, repeats,
                                probe_overrides, hardware, workdir, echo)
    return regressed


def _round(url, store_path, new_baseline, repeats, overrides, hardware, workdir, echo) -> bool:
    exp = experiment_id(url)
    with Store(store_path) as store:
        runs = store.runs(exp)
    have = int(((runs["point"].map(lambda p: p.get("role")) == "baseline")
                & (runs["status"] == "ok")).sum()) if len(runs) else 0
    if new_baseline or have < 2:
        _record_baseline(url, store_path, exp, repeats, overrides, hardware, workdir, echo)
    record = probe(url, store_path, "probe", workdir, hardware, overrides)
    with Store(store_path) as store:
        verdict = judge(store.runs(exp), record.summary, record.error)
    echo(f"{redact_url(url)}: probe {'REGRESSION in ' + ', '.join(verdict.regressed) if verdict.regressed else 'ok'}"
         f" (against {verdict.baseline_runs} baseline probes)")
    for line in verdict.lines:
        echo(f"  {line}")
    return bool(verdict.regressed)


def _record_baseline(url, store_path, exp, repeats, overrides, hardware, workdir, echo) -> None:
    """``repeats`` probes as the new baseline; the old one is retired (role ``old-baseline``) only
    once every new probe passed, and a failing one ends the watch with a WatchError: its probes
    become ``refused-baseline`` and the old baseline stays."""
    echo(f"{redact_url(url)}: recording a baseline of {repeats} probes")
    for i in range(repeats):
        record = probe(url, store_path, NEW_BASELINE, workdir, hardware, overrides)
        if record.status != RunStatus.OK:
            with Store(store_path) as store:
                store.relabel_points(exp, {"role": NEW_BASELINE}, {"role": "refused-baseline"})
            raise WatchError(f"{redact_url(url)}: baseline probe {i + 1} of {repeats} is {record.status} "
                             f"({record.error.splitlines()[0]}); a baseline is not taken while the "
                             f"deployment fails, the one before is kept")
        s = record.summary
        echo(f"  baseline {i + 1}/{repeats}: {s.output_throughput or 0:.0f} tok/s, "
             f"TTFT p50 {(s.ttft_p50 or 0) * 1000:.0f} ms")
    with Store(store_path) as store:
        store.relabel_points(exp, {"role": "baseline"}, {"role": "old-baseline"})
        store.relabel_points(exp, {"role": NEW_BASELINE}, {"role": "baseline"})

"""One command's experiment: its id, its scenario, the plan's points and the settings, taken through
``plans.execute`` (in rounds when PRECISION= asks) within ``stopping.take``, then reported.

Resume is the store's: a point already recorded is not taken again (``store.finished_keys``;
``store.RETRIED_ON_RESUME`` says what a resume retries).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from vllm_lab import lint as lint_mod
from vllm_lab import plans
from vllm_lab.backends import Backend, PredictBackend
from vllm_lab.commands import precision, stopping
from vllm_lab.commands.naming import experiment_id
from vllm_lab.commands.settings import Settings
from vllm_lab.progress import Progress, closing_table, point_label
from vllm_lab.scenarios import Scenario
from vllm_lab.store import Store


def lint_notes(points: Sequence[plans.Point], say: Callable[[str], Any] = print) -> None:
    """A value vLLM would refuse is still a data point: it is measured (and recorded as refused).
    Each distinct scenario is linted once, however many repeats it has."""
    seen: set[str] = set()
    for point in points:
        if point.serve_key in seen:
            continue
        seen.add(point.serve_key)
        for f in lint_mod.lint(point.scenario):
            if f.severity == "error":
                say(f"  note: {point_label(point.values)}: {f.message}")


@dataclass
class Experiment:
    """The runs of one command: its id and step, the scenario, the plan's points and the settings."""

    id: str
    step: str
    scenario: Scenario
    points: list[plans.Point]
    meta: dict[str, Any]
    settings: Settings

    @classmethod
    def build(cls, settings: Settings, step: str, scenario: Scenario, points: list[plans.Point],
              meta: dict[str, Any], param: str | None = None) -> Experiment:
        """The experiment for these points, its id named (or found, to resume) in the store."""
        return cls(experiment_id(settings, step, scenario, param), step, scenario, points, meta, settings)

    def todo(self) -> list[plans.Point]:
        """The points a run would take: those not in the store yet, and those a resume retries
        (store.RETRIED_ON_RESUME)."""
        with Store(self.settings.store_path) as store:
            done = store.finished_keys(self.id)
        return [p for p in self.points if p.key not in done]

    def run(self, say: Callable[[str], Any] = print) -> int:
        """Take the points not yet recorded and build the report (0); a stop (the deadline,
        Ctrl-C) raises ``stopping.Stopped`` after saying how many runs are left."""
        from vllm_lab import reports
        s = self.settings
        if s.backend == "predict":
            for point in self.points:
                PredictBackend.check(point.scenario)  # every point, before the first is taken
        shown = Progress(self.step, self.id, s.backend, s.out,
                         window_s=self.points[0].scenario.load.stop.duration_s)
        counts = stopping.take(s, self.id, shown, lambda backend: self.take(backend, shown, say),
                               self.account)
        index = reports.build(s.store_path, self.id, s.out)
        say(f"runs taken now: {counts or 'none (all were already recorded)'}")
        with Store(s.store_path) as store:
            closing_table(store.runs(self.id))
        say(f"report: {index}")
        return 0

    def take(self, backend: Backend, shown: Progress, say: Callable[[str], Any]) -> dict[str, int]:
        """The points not yet recorded, on every host; in rounds when PRECISION= is set."""
        s, hosts = self.settings, self.settings.hosts()
        if s.precision is not None:
            return precision.take_rounds(self, backend, hosts, shown, say)
        plan = plans.Plan(self.id, self.step, self.points, self.meta)
        return plans.execute(plan, backend, s.store_path, s.out / ".work", hosts, progress=shown)

    def account(self) -> stopping.Account:
        """How many runs are done and left; the work folders of those now in the store go, an
        interrupted run's are kept for a look."""
        todo = self.todo()
        left = {p.key for p in todo}
        work = self.settings.out / ".work" / self.id
        for point in self.points:
            if point.key not in left:
                shutil.rmtree(work / point.key, ignore_errors=True)
        return stopping.Account(f"{len(self.points) - len(todo)} of {len(self.points)} runs done, "
                                f"{len(todo)} left")

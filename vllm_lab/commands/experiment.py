"""One command's experiment: its id, its scenario, the plan's points and the settings, taken through
``plans.execute`` within ``stopping.take``, then reported. With PRECISION= (``precision``) the
points are taken in rounds until their intervals are that narrow.

Resume is the store's: a point already recorded is not taken again (``store.finished_keys``;
``store.RETRIED_ON_RESUME`` says what a resume retries).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from vllm_lab import lint as lint_mod
from vllm_lab import outdir, plans
from vllm_lab.analysis import host_time
from vllm_lab.backends import Backend, PredictBackend
from vllm_lab.commands import stopping
from vllm_lab.commands.naming import experiment_id
from vllm_lab.commands.plan_record import META_KEY
from vllm_lab.commands.settings import Settings
from vllm_lab.progress import Progress, closing_table, point_label
from vllm_lab.scenarios import Scenario
from vllm_lab.store import Store


def _identity(point: plans.Point) -> str:
    """A point apart from its repeat index."""
    return dataclasses.replace(point, repeat=0).key


def counted(counts: dict[str, int]) -> str:
    """Runs by status as a person says it: "4 ok, 1 unsteady"."""
    return ", ".join(f"{n} {status}" for status, n in counts.items()) or \
        "none (all were already recorded)"


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
        """The experiment for these points, its id named (or found, to resume) in the store; its
        meta keeps the plan it was made with (``plan_record``), so a resume cannot mix two."""
        if settings.plan is not None:
            meta = {**meta, META_KEY: settings.plan}
        return cls(experiment_id(settings, step, scenario, param), step, scenario, points, meta, settings)

    def todo(self) -> list[plans.Point]:
        """The points a run would take: those not in the store yet, and those a resume retries
        (store.RETRIED_ON_RESUME)."""
        with Store(self.settings.store_path) as store:
            done = store.finished_keys(self.id)
        return [p for p in self.points if p.key not in done]

    def run(self, say: Callable[[str], Any] = print) -> int:
        """Take the points not yet recorded, build the report and say its results (0); a stop
        (the deadline, Ctrl-C) raises ``stopping.Stopped`` after saying how many runs are left."""
        return self.finish(self.take_all(say), say)

    def take_all(self, say: Callable[[str], Any] = print) -> dict[str, int]:
        """Take the points not yet recorded: the runs taken, by status."""
        s = self.settings
        plans.check_inputs(self.points)  # a workload file that cannot be read: before any start
        if s.backend == "predict":
            for point in self.points:
                PredictBackend.check(point.scenario)  # every point, before the first is taken
        shown = Progress(self.step, self.id, s.backend, s.out,
                         window_s=self.points[0].scenario.load.stop.duration_s)
        return stopping.take(s, self.id, shown, lambda backend: self.take(backend, shown, say),
                             self.account)

    def finish(self, counts: dict[str, int], say: Callable[[str], Any] = print) -> int:
        """Build the report, then say the runs taken, the closing table and headline the page
        has, and where the page is (0)."""
        from vllm_lab import reports
        from vllm_lab.reports.console import results
        from vllm_lab.reports.host_time import sentence
        s = self.settings
        index = reports.build(s.store_path, self.id, s.out)
        say(f"runs taken now: {counted(counts)}")
        closing_table(results(s.store_path, self.id))
        with Store(s.store_path) as store:
            spent = host_time.account(store.experiment(self.id)["meta"], store.runs(self.id))
        if spent is not None:
            say(sentence(spent))
        say(f"report: {index}")
        return 0

    def take(self, backend: Backend, shown: Progress, say: Callable[[str], Any]) -> dict[str, int]:
        """The points not yet recorded, on every host; in rounds when PRECISION= is set."""
        s, hosts = self.settings, self.settings.hosts()
        if s.precision is not None:
            return self.take_rounds(backend, hosts, shown, say)
        plan = plans.Plan(self.id, self.step, self.points, self.meta)
        return plans.execute(plan, backend, s.store_path, s.out / ".work", hosts, progress=shown)

    def take_rounds(self, backend: Backend, hosts: Sequence[str | None], shown: Progress,
                    say: Callable[[str], Any]) -> dict[str, int]:
        """Repeat each point until its intervals are as narrow as PRECISION asks or the cap is hit.
        The first round takes each point's planned runs back to back in one server start (as
        ``vllm bench sweep``'s --num-runs does: on a GPU a start costs more than three runs); each
        round after takes the next repeat of every point still open, so a drift of the host over
        time lands on every open point alike instead of passing for an effect."""
        s, target = self.settings, self.settings.precision
        base: dict[str, plans.Point] = {}
        for point in self.points:
            base.setdefault(_identity(point), dataclasses.replace(point, repeat=0))
        planned = max(max(p.repeat for p in self.points) + 1, target.min_repeats)
        counts: dict[str, int] = {}
        still, reached = list(base), {}
        for r in range(planned - 1, max(target.max_repeats, planned)):
            repeats = range(r + 1) if r == planned - 1 else (r,)
            plan = plans.Plan(self.id, self.step, [dataclasses.replace(base[i], repeat=k)
                                                   for i in still for k in repeats], self.meta)
            for status, n in plans.execute(plan, backend, s.store_path, s.out / ".work", hosts,
                                           progress=shown).items():
                counts[status] = counts.get(status, 0) + n
            with Store(s.store_path) as store:
                reached = target.judge(store.runs(self.id), base, r + 1)
            still = [i for i in still if not reached[i]["reached"]]
            if not still:
                break
        self.record_precision(base, reached, say)
        return counts

    def record_precision(self, base: dict[str, plans.Point], reached: dict[str, dict],
                         say: Callable[[str], Any]) -> None:
        """Say which points reached the precision and which hit the cap; keep it, with the host's
        run-to-run noise, in the experiment's meta."""
        target = self.settings.precision
        for i, verdict in reached.items():
            widths = ", ".join(f"±{verdict[m]:.1%} {m}" for m in target.targets if m in verdict)
            how = "reached" if verdict["reached"] else f"cap of {target.max_repeats} runs hit"
            say(f"precision {how}: {point_label(base[i].values)}: {widths} after {verdict['runs']} runs")
        noise = target.noise(reached)
        with Store(self.settings.store_path) as store:
            store.update_meta(self.id, precision={"targets": target.targets,
                                                  "max_repeats": target.max_repeats,
                                                  "points": {point_label(base[i].values): v
                                                             for i, v in reached.items()}},
                              host_noise_cv=noise)
        if noise:
            say("host noise (run-to-run CV, median over points): "
                + ", ".join(f"{m} {v:.1%}" for m, v in noise.items()))

    def account(self) -> stopping.Account:
        """How many runs are done and left; the work folders of those now in the store go, an
        interrupted run's are kept for a look."""
        todo = self.todo()
        left = {p.key for p in todo}
        work = outdir.work_folder(self.settings.out) / self.id
        for point in self.points:
            if point.key not in left:
                outdir.remove_tree(work.parent, work / point.key)
        return stopping.Account(f"{len(self.points) - len(todo)} of {len(self.points)} runs done, "
                                f"{len(todo)} left")

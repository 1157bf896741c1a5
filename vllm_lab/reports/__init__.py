"""Reports from the store alone: index.html (self-contained), report.md, CSV and PNG (and a PDF).

Each step of the method gets its picture; ``BUILDERS`` says which module draws which step:

- baseline and sweep (and any step without its own): ``reports.sweep``, a table of points and the
  throughput, latency and server figures against the swept value;
- combo and tune: ``reports.combo``, heat maps, the Pareto front, the search's history;
- stress: ``reports.stress``, the staircase and its knee, or a spike or soak against time;
- claims: ``reports.claims``, the guide's claims and their verdicts;
- autotune: ``reports.autotune``, the defaults against the best, ``best.yaml`` and ``summary.json``;
- a period (PERIOD=2026Q4): ``reports.quarterly``.

They share ``reports.page`` (the page writer, the formatter, the context every figure states) and
``reports.figures`` (saving a figure); what a page shows is read by ``vllm_lab.analysis``. A report
reads only the store: what it compares against (the twin's prediction) was recorded with the runs.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display on lab machines; before any report module imports pyplot
import pandas as pd

from vllm_lab import outdir, search
from vllm_lab.analysis.autotune import STEP as AUTOTUNE
from vllm_lab.analysis.autotune import load_record
from vllm_lab.reports import autotune, claims, combo, stress, sweep
from vllm_lab.store import Store, StoreError, experiment_dir

Builder = Callable[[Store, dict, pd.DataFrame, Path], Path]
# Step -> the function writing its report folder (store, experiment, runs, folder) -> index.html.
BUILDERS: dict[str, Builder] = {
    "baseline": sweep.build, "sweep": sweep.build, "combo": combo.build_combo,
    "tune": combo.build_tune, "stress": stress.build_stress, "claims": claims.build_claims,
    AUTOTUNE: autotune.build,
}


def build(store_path: Path, experiment_id: str, out_root: Path) -> Path:
    """Write the experiment's report folder under ``out_root`` and return the path of its index.html."""
    with Store(store_path) as store:
        exp = _experiment(store, experiment_id)
        runs = store.runs(experiment_id)
        if runs.empty and exp["step"] != AUTOTUNE:  # an autotune's runs are its candidates'
            raise StoreError(f"{store_path}: experiment {experiment_id} has no runs yet, so no "
                             f"report; make report takes an experiment with runs (make status "
                             f"names the newest)")
        folder = outdir.make_folder(out_root, experiment_dir(out_root, experiment_id))
        outdir.no_links_within(out_root, folder)  # its files are written one by one
        return BUILDERS.get(exp["step"], sweep.build)(store, exp, runs, folder)


def _experiment(store: Store, experiment_id: str) -> dict:
    """The experiment's row; an autotune from a store written before its experiment was recorded
    is known by its study."""
    try:
        return store.experiment(experiment_id)
    except StoreError:
        if load_record(store.path, experiment_id, search.storage_url(None, store.path)) is None:
            raise
        return {"id": experiment_id, "step": AUTOTUNE, "meta": {}}


def build_quarterly(store_path: Path, period: str, out_root: Path, pdf: bool = True) -> Path:
    """Write the quarterly report of ``period`` (e.g. 2026Q4); see ``reports.quarterly``."""
    from vllm_lab.reports import quarterly

    return quarterly.build(store_path, period, out_root, pdf)

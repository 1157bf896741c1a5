"""The quarterly report's recommended flag changes, written as ready scenario files."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pandas as pd

from vllm_lab.reports.scenario_files import write_scenario_file


def gain_text(b) -> str:
    """The best's goodput against the baseline with its 95% interval: "+25% (+8% to +42%)"."""
    return interval_text(b["margin_vs_baseline"], b["margin_low"], b["margin_high"])


def interval_text(rel: float, low: float, high: float) -> str:
    """A relative effect and its 95% interval as a person reads it ("–" when unknown)."""
    if rel is None or not np.isfinite(rel):
        return "–"
    if low == high:
        return f"{rel:+.1%}"
    return f"{rel:+.0%} ({low:+.0%} to {high:+.0%})"


def recommendations(best: pd.DataFrame, runs: pd.DataFrame, folder: Path) -> pd.DataFrame:
    """Write one ready scenario file per scenario and GPU whose best flags differ from its baseline."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    for _, b in best.iterrows():
        changes = {k: v for k, v in b["serve"].items() if b["base_serve"].get(k) != v}
        if not changes or not b["gain_is_real"]:
            continue  # a gain inside the noise of the repeats is no reason to change
        source = runs[(runs["label"] == b["label"]) & (runs["experiment_id"] == b["experiment_id"])]
        scenario = source["scenario"].iloc[-1]
        # The best point's flags, and enough repeats to confirm it against the baseline.
        scenario = {**scenario, "serve": b["serve"], "run": {**(scenario.get("run") or {}), "repeats": 3}}
        gpu = (scenario.get("hardware") or {}).get("gpu") or "gpu"
        name = re.sub(r"[^A-Za-z0-9_.-]+", "-", f"{b['scenario_name']}-{gpu}")
        path = folder / f"{name}.yaml"
        comment = (f"# {b['label']}: the best configuration of the period (experiment "
                   f"{b['experiment_id']}).\n# Changed from the baseline: "
                   + ", ".join(f"{k}: {b['base_serve'].get(k, 'default')} -> {v}"
                               for k, v in changes.items())
                   + f"\n# Check it before adopting it:  make baseline SCENARIO={path}\n")
        write_scenario_file(path, scenario, {}, f"Recommended by the quarterly report: "
                            f"{b['scenario_name']} on {b['gpu_model']}, goodput "
                            f"{gain_text(b)} vs baseline", comment)
        rows.append({"label": b["label"], "file": path, "changes": changes, "margin": gain_text(b)})
    return pd.DataFrame(rows)

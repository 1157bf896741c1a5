"""The quarterly report's recommended flag changes, written as ready scenario files."""

from __future__ import annotations

import re
from pathlib import Path

import pandas as pd

from vllm_lab.reports.scenario_files import write_scenario_file


def recommendations(best: pd.DataFrame, runs: pd.DataFrame, folder: Path) -> pd.DataFrame:
    """Write one ready scenario file per scenario and GPU whose best flags differ from its baseline."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    for _, b in best.iterrows():
        changes = {k: v for k, v in b["serve"].items() if b["base_serve"].get(k) != v}
        if not changes or not (b["margin_vs_baseline"] > 0):
            continue
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
                            f"{b['margin_vs_baseline']:+.0%} vs baseline", comment)
        rows.append({"label": b["label"], "file": path, "changes": changes,
                     "margin": b["margin_vs_baseline"]})
    return pd.DataFrame(rows)

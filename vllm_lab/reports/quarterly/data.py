"""The quarterly report's reading of the store: the period's runs and a few figures per run from
its raw samples.

It stays small on a large store: runs come from one query over the period, and raw samples are read
per run, only the columns it needs, and reduced to a few figures per run before the next one (two
quarters with a million requests build in seconds, in a few hundred MB).
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from vllm_lab import search
from vllm_lab.analysis.points import RANKED
from vllm_lab.store import Store, read_samples

# The only sample columns read: prompt lengths (long requests) and the request status.
SAMPLE_COLUMNS = ["prompt_tokens", "status"]


def load_runs(store_path: Path, start: float, end: float) -> pd.DataFrame:
    """Runs started in [start, end), with their scenario decoded and the sweep parameter named."""
    with Store(store_path) as store:
        runs = store.runs_between(start, end)
        exps = store.experiments()
    runs["scenario"] = runs["scenario_json"].map(json.loads)
    runs["label"] = runs["scenario_name"] + " · " + runs["gpu_model"]
    metas = {r.id: json.loads(r.meta_json) for r in exps.itertuples()}
    runs["params"] = runs["experiment_id"].map(lambda e: _params(metas.get(e, {})))
    # vLLM's defaults, the point each tuning experiment's effects are read against (if recorded).
    runs["reference"] = runs["experiment_id"].map(lambda e: metas.get(e, {}).get("reference"))
    # The figure each experiment's best is named by on its own page (a search's objective's).
    runs["ranked_by"] = runs["experiment_id"].map(
        lambda e: search.RANKED_BY.get(metas.get(e, {}).get("objective"), RANKED))
    return runs.drop(columns=["scenario_json"])


def _params(meta: dict[str, Any]) -> list[str]:
    return list(meta.get("params") or ([meta["param"]] if meta.get("param") else []))


def _run_sample_figures(path: Path) -> tuple[float, float, float]:
    """One run's prompt p50, p99 and error count, from two columns of its samples file."""
    try:
        table = read_samples(path, SAMPLE_COLUMNS)
    except (OSError, ValueError, KeyError):
        return (np.nan, np.nan, np.nan)
    prompts = table["prompt_tokens"].dropna().to_numpy(dtype=float)
    errors = float(np.sum(table["status"].to_numpy() != "ok"))
    if not len(prompts):
        return (np.nan, np.nan, errors)
    p50, p99 = np.percentile(prompts, [50, 99])
    return (float(p50), float(p99), errors)


def sample_figures(store_path: Path, runs: pd.DataFrame, threads: int = 4) -> pd.DataFrame:
    """Per run (same index as ``runs``): prompt_p50, prompt_p99, sample_errors from its samples.

    Files are read one at a time per thread (pyarrow releases the GIL), so at most ``threads``
    runs' samples are in memory at once.
    """
    with Store(store_path) as store:
        paths = store.samples_files(runs)
    with ThreadPoolExecutor(max_workers=threads) as pool:
        rows = list(pool.map(lambda p: _run_sample_figures(p) if p else (np.nan,) * 3, paths))
    return pd.DataFrame(rows, columns=["prompt_p50", "prompt_p99", "sample_errors"],
                        index=runs.index)

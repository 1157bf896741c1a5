"""The committed example stores (reports/examples), read back by the tests that hold the twin to
what real GPUs measured."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from vllm_lab.scenarios import Scenario

EXAMPLES = Path(__file__).resolve().parents[2] / "reports/examples"


def stored_scenario(scenario_json: str) -> Scenario:
    """A stored run's scenario as it ran, its model named by its shape: the host's model folder
    (and the tokenizer in it) is not on this machine."""
    raw = json.loads(scenario_json)
    raw["serve"]["model"] = "meta-llama/Meta-Llama-3-8B-Instruct"
    raw["workload"].pop("tokenizer", None)
    return Scenario.model_validate(raw)


def ok_runs(example: str, *experiments: str, statuses: tuple[str, ...] = ("ok",)) -> pd.DataFrame:
    """The ok runs of ``experiments`` in an example's store (or those of ``statuses``)."""
    from vllm_lab.store import Store

    with Store(EXAMPLES / example / "lab.db") as store:
        runs = pd.concat([store.runs(e) for e in experiments], ignore_index=True)
    return runs[runs["status"].isin(statuses)]


def predicted(run) -> dict:
    """The predictor's summary of a stored run's scenario, as it ran (``stored_scenario``)."""
    from vllm_lab.backends import PredictBackend

    return PredictBackend().measure(stored_scenario(run["scenario_json"]), None, Path(".")).summary

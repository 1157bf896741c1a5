"""The committed example stores (reports/examples), read back by the tests that hold the twin to
what real GPUs measured."""

from __future__ import annotations

import json
from pathlib import Path

from vllm_lab.scenarios import Scenario

EXAMPLES = Path(__file__).resolve().parents[2] / "reports/examples"


def stored_scenario(scenario_json: str) -> Scenario:
    """A stored run's scenario as it ran, its model named by its shape: the host's model folder
    (and the tokenizer in it) is not on this machine."""
    raw = json.loads(scenario_json)
    raw["serve"]["model"] = "meta-llama/Meta-Llama-3-8B-Instruct"
    raw["workload"].pop("tokenizer", None)
    return Scenario.model_validate(raw)

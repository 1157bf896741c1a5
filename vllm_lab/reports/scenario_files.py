"""Ready scenario files written beside a report: a best configuration to run again or adopt."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from vllm_lab import search
from vllm_lab.flags import is_secret


def plain(value: Any) -> Any:
    """Numpy scalars (inside containers too) as plain YAML types."""
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    return value


def write_scenario_file(path: Path, scenario: dict[str, Any], values: dict[str, Any], note: str,
                        comment: str = "") -> Path:
    """Write ``scenario`` (as recorded in the store) with ``values`` applied as a ready scenario
    file at ``path``; ``comment`` lines go on top."""
    scenario = dict(scenario)
    # No key in a report, not even a masked one (a store from before redaction holds it): the
    # server gets it again from the inventory, the vault or the environment.
    scenario["serve"] = {k: v for k, v in scenario["serve"].items() if not is_secret(k)}
    path.write_text(comment + search.scenario_file(plain(scenario), plain(values), note))
    return path

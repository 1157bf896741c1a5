"""What autotune searches: the flags the twin models (ranked on the predictor), the flags it does
not (tried live from a space's ``measure:`` section on real vLLM), and the scenario a candidate runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vllm_lab import flags as flagcat
from vllm_lab import lint, plans, search, stress
from vllm_lab.inputs import shown
from vllm_lab.scenarios import Scenario, ScenarioError

# Flags the twin's engine and step-time model react to (twin/engine.py resolve_flags, steptime.py):
# only these can be ranked on the predictor.
MODELLED = ("max-num-seqs", "max-num-batched-tokens", "long-prefill-token-threshold",
            "gpu-memory-utilization", "block-size", "kv-cache-dtype", "enable-prefix-caching",
            "enforce-eager", "api-server-count", "async-scheduling")
# Serving flags of vLLM 0.26 the twin does not model, and why: a ranking on the predictor would
# call every value equal, so they are left to a live sweep.
MEASURE_ONLY = {**flagcat.PREDICTOR_IGNORES,
                **{k: flagcat.UNMODELLED_WHY[k] for k in ("enable-chunked-prefill",)}}
DEFAULT_SPACE = "autotune"


def load_space(spec: str | None, scenario: Scenario) -> search.SearchSpace:
    """SPACE (default scenarios/spaces/autotune.yaml), holding only flags the twin models."""
    spec = spec if spec and spec != "default" else DEFAULT_SPACE
    space = search.load_space(spec, scenario, measure=True)
    path = Path(spec) if Path(spec).suffix else search.SPACE_DIR / f"{spec}.yaml"
    for param, values in space.measure.items():
        if param not in MEASURE_ONLY:
            raise ScenarioError(f"{path}: key measure.{param}: only flags the twin does not model "
                                f"are tried live this way (allowed: {', '.join(MEASURE_ONLY)}); "
                                f"put a modelled flag under space:")
        if not values:
            raise ScenarioError(f"{path}: key measure.{param}: give at least one value to try")
        for value in values:
            bad = [f for f in lint.lint(scenario.with_serve(**{param: value}))
                   if f.severity == "error" and f.key == param]
            if bad:
                raise ScenarioError(f"{path}: key measure.{param}: {shown(value, param)}: {bad[0].message}")
    for param in space.space:
        if param in MEASURE_ONLY:
            raise ScenarioError(f"{path}: key space.{param}: the twin does not model it "
                                f"({MEASURE_ONLY[param]}), so the predictor cannot rank it; measure "
                                f"it with make sweep PARAM={param} (autotune searches "
                                f"{', '.join(MODELLED)})")
        if param not in MODELLED:
            raise ScenarioError(f"{path}: key space.{param}: not a flag autotune can search "
                                f"(allowed: {', '.join(MODELLED)})")
    return space


def defaults_scenario(scenario: Scenario, space: search.SearchSpace) -> Scenario:
    """The scenario with vLLM's defaults for every searched flag (its other flags are kept)."""
    return scenario.model_copy(update={"serve": {k: v for k, v in scenario.serve.items()
                                                 if k not in space.space}})


def open_loop(scenario: Scenario, duration_s: float) -> Scenario:
    """The scenario as capacity levels: open-loop Poisson arrivals at a constant rate."""
    s = stress.stress_scenario(scenario, "step")
    return plans.apply_value(s, "load.stop.duration_s", float(duration_s))


def with_flags(scenario: Scenario, flags: dict[str, Any]) -> Scenario:
    """The scenario with serve ``flags`` set."""
    return scenario.with_serve(**flags) if flags else scenario


def measure_section(space: search.SearchSpace, backend: str) -> dict[str, list[Any]]:
    """The measure-only flags to try: on real vLLM only; the twin and its predictor would read each
    as no change, and a candidate measured for nothing costs minutes."""
    return dict(space.measure) if backend not in ("twin", "predict") else {}

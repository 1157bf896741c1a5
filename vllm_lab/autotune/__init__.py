"""The headline method: the serving flags that carry the most traffic within the SLO, found offline
and confirmed on the real thing within a budget of GPU minutes.

1. ``ranking``: Optuna on the twin's predictor over the flags the twin models (``space``), each
   configuration ranked by its predicted SLO capacity (bracketed, then bisected).
2. ``candidates``: vLLM's defaults, the measure-only variants and the top configurations, each
   with its staircase centred on what was measured before it.
3. ``measure``: each candidate's capacity staircase on the backend while ``budget`` (GPU_MINUTES)
   allows; ``records`` keeps the plan and the minutes spent in the store.

``analysis.autotune`` reads the outcome back (the capacities, the best, the verdict) and
``reports.autotune`` writes the report; ``commands.autotune`` runs it all under DEADLINE.
"""

from vllm_lab.analysis.autotune import NOISE, Candidate, Capacity, Plan, capacity_from_levels
from vllm_lab.autotune.budget import MEASURING, Measuring, measuring
from vllm_lab.autotune.candidates import (
           best_measured,
           plan_candidates,
           refine_level,
           staircase_centre,
)
from vllm_lab.autotune.measure import Settings, search_and_measure
from vllm_lab.autotune.ranking import OBJECTIVES, newest_study, predicted_slo_capacity
from vllm_lab.autotune.space import (
           MEASURE_ONLY,
           MODELLED,
           defaults_scenario,
           load_space,
           open_loop,
           with_flags,
)

__all__ = ["MEASURE_ONLY", "MEASURING", "MODELLED", "NOISE", "OBJECTIVES", "Candidate", "Capacity", "Measuring", "Plan",
           "Settings", "best_measured", "capacity_from_levels", "defaults_scenario", "load_space",
           "measuring", "newest_study", "open_loop", "plan_candidates", "predicted_slo_capacity",
           "refine_level", "search_and_measure", "staircase_centre", "with_flags"]

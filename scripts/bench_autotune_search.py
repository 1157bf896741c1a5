"""Benchmark: does autotune's search find the gain on the chat traffic, whatever its seed?

realtime-chat on the H200 preset, the default space, the predictor's SLO capacity of 30-s levels
(autotune's own call). For each seed, the best predicted capacity over the defaults' as autotune
searches (vLLM's defaults and each flag moved alone first, then TPE) and as TPE alone searches,
with TRIALS in all; prints each seed's gain and the lowest and median per way.

    make bench NAME=autotune-search [ARGS="20 40"]      # trial counts (default: 20 40)
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from unittest import mock

from vllm_lab import autotune, plans, search
from vllm_lab.autotune import ranking
from vllm_lab.autotune.ranking import predicted_slo_capacity, run_search, saturation, top_configs
from vllm_lab.scenarios import resolve

SEEDS = (0, 1, 2, 3, 4, 5)
STEP_S = 30.0


def best_gain(base, space, trials: int, seed: int, anchored: bool, start: float,
              defaults: float) -> float:
    """The best predicted SLO capacity one search finds, over the defaults' (a ratio less 1)."""
    with tempfile.TemporaryDirectory() as d, mock.patch.object(
            search, "one_at_a_time", search.one_at_a_time if anchored else lambda *_: []):
        study = run_search(base, space, f"s{seed}", f"sqlite:///{d}/s.db", trials, seed, start,
                           STEP_S, say=lambda _: None)
        found = top_configs(study, 1)
        return found[0].predicted / defaults - 1 if found else -1.0  # nothing held the SLO


def main(argv: list[str]) -> int:
    counts = [int(a) for a in argv] or [20, 40]
    scenario = plans.apply_value(resolve("realtime-chat", "h200"), "load.stop.duration_s", STEP_S)
    space = autotune.load_space(None, scenario)
    base = autotune.open_loop(autotune.defaults_scenario(scenario, space), STEP_S)
    start = 0.8 * saturation(base).value  # where autotune starts each bisection
    defaults = predicted_slo_capacity(base, start, STEP_S).value
    print(f"realtime-chat, h200: the defaults' predicted SLO capacity {defaults:.2f} req/s; "
          f"seeds {', '.join(map(str, SEEDS))}")
    for trials in counts:
        for anchored, way in ((False, "TPE alone"), (True, "autotune (one flag at a time, then TPE)")):
            t0 = time.time()
            gains = [best_gain(base, space, trials, s, anchored, start, defaults) for s in SEEDS]
            print(f"{trials} trials, {way}: " + " ".join(f"{g:+.0%}" for g in gains)
                  + f" | lowest {min(gains):+.0%}, median {statistics.median(gains):+.0%} "
                    f"({(time.time() - t0) / len(SEEDS):.0f} s a search, {ranking.prediction_processes(ranking.BATCH)} "
                    f"processes)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

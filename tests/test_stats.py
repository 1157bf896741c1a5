"""Intervals cover what they claim, warm-up is found where it is, and the "best" of points that
cannot be told apart is the cheapest of them."""

import math

import numpy as np

from vllm_lab import stats


def test_t_interval_covers_the_true_mean_95_percent_of_the_time():
    rng = np.random.default_rng(7)
    hits = sum(stats.mean_ci(rng.normal(100, 5, size=4)).overlaps(stats.Estimate(100, 100, 100, 1))
               for _ in range(4000))
    assert 0.93 <= hits / 4000 <= 0.97


def test_one_value_has_an_unbounded_interval_and_nan_is_ignored():
    one = stats.mean_ci([5.0, math.nan])
    assert one.mean == 5.0 and one.n == 1 and one.relative == math.inf
    assert not stats.precise_enough([5.0], 0.02)
    assert stats.precise_enough([100.0, 100.5, 99.8, 100.2], 0.02)


def test_mser_cuts_a_warm_up_ramp_and_leaves_a_steady_series_alone():
    rng = np.random.default_rng(3)
    ramp = np.linspace(0, 6000, 20)  # 20 s of a server filling up, then 80 s at 6000 tok/s
    series = np.concatenate([ramp, rng.normal(6000, 60, 80)])
    cut = stats.mser_truncation(series)
    assert 15 <= cut <= 25
    assert stats.mser_truncation(rng.normal(6000, 60, 100)) <= 10
    assert stats.mser_truncation([1.0, 2.0, 3.0]) == 0


def test_batch_means_give_a_narrow_interval_on_a_long_steady_run():
    rng = np.random.default_rng(5)
    est = stats.batch_means_ci(rng.normal(5000, 250, 600))
    assert est.low < 5000 < est.high and est.relative < 0.02


def test_effect_is_significant_only_when_the_interval_excludes_zero():
    rng = np.random.default_rng(11)
    base = rng.normal(100, 2, 5)
    big = stats.effect(rng.normal(120, 2, 5), base)
    assert big.significant and 0.15 < big.relative < 0.25 and big.low > 0
    noise = stats.effect(rng.normal(100, 2, 5), base)
    assert not noise.significant
    assert not stats.effect([130.0], [100.0]).significant  # one run each: cannot tell


def test_the_best_is_the_cheapest_setting_within_noise_of_the_top():
    # max-num-seqs at 64 closed-loop users: 64, 256 and 1024 cannot change the batch.
    rng = np.random.default_rng(1)
    runs = {8: rng.normal(2000, 40, 3), 64: rng.normal(6000, 120, 3),
            256: rng.normal(6050, 120, 3), 1024: rng.normal(6100, 120, 3)}
    choice = stats.choose(runs, cost=float)
    assert choice.best == 64 and set(choice.within_noise) == {64, 256, 1024}
    assert choice.top in (64, 256, 1024)
    latency = stats.choose({"a": [0.50, 0.51, 0.49], "b": [0.30, 0.31, 0.29]}, cost=lambda k: 0,
                           higher_is_better=False)
    assert latency.best == "b" and latency.within_noise == ("b",)


def test_repeats_are_interleaved_across_points():
    assert stats.interleaved(["a", "b"], 2) == [("a", 0), ("b", 0), ("a", 1), ("b", 1)]


def test_cv_of_a_host():
    assert math.isclose(stats.cv([98.0, 100.0, 102.0]), 0.02)
    assert math.isnan(stats.cv([1.0]))


def test_a_sweep_report_names_the_cheapest_point_within_noise_of_the_top():
    import pandas as pd

    from vllm_lab.analysis.points import best_point, within_noise

    # The H200 example's max-num-seqs at 64 users, one run each: 64, 256 and 1024 cannot change
    # the batch; 256 reads 3.8% under 1024, within a single run's noise; 64 reads 23% under.
    table = pd.DataFrame({"max-num-seqs": [64, 256, 1024], "runs": 1, "ok_runs": 1,
                          "goodput": [41.9, 52.7, 54.8], "goodput_cv": float("nan"),
                          "output_throughput": [5371.0, 6753.0, 7020.0], "meets_slo": True})
    best = best_point(table)
    assert best["max-num-seqs"] == 256
    assert sorted(table.loc[within_noise(table, best), "max-num-seqs"]) == [256, 1024]
    # Three repeats each with a 1% spread tell 256 and 1024 apart.
    table["runs"] = table["ok_runs"] = 3
    table["goodput_cv"] = 0.01
    assert best_point(table)["max-num-seqs"] == 1024

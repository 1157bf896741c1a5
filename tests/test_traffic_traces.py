"""Traces: the shipped synthetic traces in every format, strict parsing, replay times, prompts that
share what the trace says they share, the predictor and Locust replaying them, energy figures."""

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from tests.support.scripted_server import running
from vllm_lab import scenarios
from vllm_lab.backends import PredictBackend
from vllm_lab.energy import energy_view
from vllm_lab.traffic import Load, Workload, run_load
from vllm_lab.traffic.arrivals import planned_arrivals
from vllm_lab.traffic.spec import Replay
from vllm_lab.traffic.traces import TraceError, load_trace, replay_times, trace_requests
from vllm_lab.traffic.workloads import WorkloadGenerator

TRACES = Path(__file__).resolve().parents[1] / "scenarios" / "traces"
SHIPPED = {"mooncake-synthetic.jsonl": "mooncake", "azure-synthetic.csv": "azure",
           "burstgpt-synthetic.csv": "burstgpt", "requests-synthetic.jsonl": "jsonl"}


@pytest.mark.parametrize("name", list(SHIPPED))
def test_the_shipped_traces_load_in_time_order(name):
    t = load_trace(TRACES / name, SHIPPED[name])
    times = np.array([r.t_s for r in t.requests])
    assert len(times) >= 1000 and times[0] == 0.0 and (np.diff(times) >= 0).all()
    assert 500 < times[-1] < 700  # ten minutes of traffic
    assert all(r.prompt_tokens >= 1 and r.output_tokens >= 1 for r in t.requests)
    if SHIPPED[name] == "burstgpt":
        assert t.skipped > 0  # its failed requests (0 response tokens) are left out, and counted
    if SHIPPED[name] == "mooncake":
        assert sum(bool(r.blocks) for r in t.requests) == len(t.requests)


def _write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return p


@pytest.mark.parametrize("fmt, name, text, says", [
    ("mooncake", "m.jsonl", ('{"timestamp": 0, "input_length": 10, "output_length": 5}\n'
                             '{"timestamp": 5, "input_length": -3, "output_length": 5}\n'),
     "line 2: field 'input_length': expected a whole number >= 1, got -3"),
    ("mooncake", "m.jsonl", ('{"timestamp": 0, "input_length": 600, "output_length": 5, '
                             '"hash_ids": [1]}\n'), "line 1: field 'input_length': 600 tokens need more"),
    ("mooncake", "m.jsonl", '{"timestamp": 0, "input_length": 6}\n', "line 1: field 'output_length': missing"),
    ("jsonl", "r.jsonl", '{"timestamp": 0, "prompt_tokens": 4, "output_tokens": 2}\nnot json\n',
     "line 2: not JSON"),
    ("jsonl", "r.jsonl", '{"timestamp": "soon", "prompt_tokens": 4, "output_tokens": 2}\n',
     "line 1: field 'timestamp': expected a number, got 'soon'"),
    ("jsonl", "r.jsonl", '{"timestamp": 1, "prompt_tokens": 4, "output_tokens": 2.5}\n',
     "line 1: field 'output_tokens': expected a whole number >= 1, got 2.5"),
    ("azure", "a.csv", "TIMESTAMP,ContextTokens\n2023-11-16 18:15:46.1,4\n",
     "line 1: the header lacks 'GeneratedTokens'"),
    ("azure", "a.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.1,4,2\nyesterday,4,2\n",
     "line 3: field 'TIMESTAMP': expected a date and time, got 'yesterday'"),
    ("burstgpt", "b.csv", "Timestamp,Model,Request tokens,Response tokens\n1.5,ChatGPT,ten,4\n",
     "line 2: field 'Request tokens': expected a whole number, got 'ten'"),
])
def test_a_bad_row_is_one_sentence_naming_file_line_and_field(tmp_path, fmt, name, text, says):
    path = _write(tmp_path, name, text)
    with pytest.raises(TraceError) as e:
        load_trace(path, fmt)
    assert str(path) in str(e.value) and says in str(e.value), str(e.value)
    assert "\n" not in str(e.value)


def test_a_trace_that_is_not_text_or_too_big_is_refused(tmp_path, monkeypatch):
    binary = tmp_path / "b.jsonl"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(TraceError, match="is not UTF-8 text"):
        load_trace(binary, "jsonl")
    from vllm_lab.traffic import traces

    monkeypatch.setattr(traces, "MAX_BYTES", 10)
    with pytest.raises(TraceError, match="more than the 0 MiB a trace may be"):
        load_trace(_write(tmp_path, "big.jsonl", "x" * 100), "jsonl")


def test_replay_times_follow_speed_window_and_rate():
    w = Workload(source="trace", path=TRACES / "requests-synthetic.jsonl", trace_format="jsonl")
    whole = trace_requests(w)
    load = Load(mode="replay", replay={"start_s": 100, "duration_s": 200})
    rows = trace_requests(w, load)
    assert len(rows) == sum(100 <= r.t_s < 300 for r in whole) and rows[0].t_s >= 0
    assert replay_times(rows, Replay(speed=2))[-1] == pytest.approx(rows[-1].t_s / 2)
    # A target rate rescales time: the 200 s window becomes as long as len(rows) / 10 s.
    at_rate = replay_times(rows, Replay(duration_s=200, rate=10))
    window_s = 200 * at_rate[-1] / rows[-1].t_s
    assert len(rows) / window_s == pytest.approx(10)
    # The planned schedule is the replay's, capped by the stop conditions like any other.
    capped = Load(mode="replay", replay={"speed": 4}, stop={"duration_s": 600, "max_requests": 50})
    got = list(planned_arrivals(capped, 0, w))
    assert got == pytest.approx([r.t_s / 4 for r in whole[:50]])


def test_a_replay_needs_a_trace_in_one_sentence():
    with pytest.raises(scenarios.ScenarioError, match="load.mode replay sends a trace's requests"):
        scenarios.resolve("default", overrides=["load.mode=replay"])


def test_mooncake_prompts_share_the_blocks_their_hash_ids_share():
    w = Workload(source="trace", path=TRACES / "mooncake-synthetic.jsonl", trace_format="mooncake")
    rows = trace_requests(w)
    gen = WorkloadGenerator(w, seed=0)
    # Two requests whose hash ids begin alike begin with the same words (512 a block).
    pairs = [(i, j) for i in range(60) for j in range(i + 1, 60)
             if rows[i].blocks[:2] == rows[j].blocks[:2] and len(rows[i].blocks) > 2]
    i, j = pairs[0]
    a, b = gen.request(i).turns[0], gen.request(j).turns[0]
    assert a.text.split(" ")[:1024] == b.text.split(" ")[:1024]
    assert a.prompt_tokens == rows[i].prompt_tokens == len(a.text.split(" "))  # 1 word, 1 token
    assert gen.request(i).turns[0].max_tokens == rows[i].output_tokens
    # A different seed is another text, shared all the same.
    other = WorkloadGenerator(w, seed=1)
    assert other.request(i).turns[0].text != a.text
    assert other.request(i).turns[0].text.split(" ")[:1024] == other.request(j).turns[0].text.split(" ")[:1024]


def _trace_scenario(name, *extra):
    return scenarios.resolve("default", overrides=[
        "workload.source=trace", f"workload.path={TRACES / name}",
        f"workload.trace_format={SHIPPED[name]}", "load.mode=replay", "load.stop.duration_s=900",
        *extra])


def test_the_predictor_replays_a_trace_at_its_times_and_hits_its_shared_blocks():
    s = _trace_scenario("mooncake-synthetic.jsonl", "load.replay={speed: 2}")
    m = PredictBackend().measure(s, None, Path("."))
    rows = trace_requests(s.workload, s.load)
    assert m.status == "ok" and len(m.samples) == len(rows)
    assert np.allclose(np.sort(m.samples.scheduled_ts), [r.t_s / 2 for r in rows])
    assert m.summary["window_reason"].endswith("to the last scheduled arrival")
    # The conversations' earlier turns are in the prefix cache: far less prefill than prompt.
    from vllm_lab.models import load_model_shape
    from vllm_lab.prediction import predicted_requests
    from vllm_lab.twin.predictor import Open, predict
    from vllm_lab.twin.profile import load_profile

    reqs = predicted_requests(s, len(rows))
    p = predict(s.serve, load_profile("h200-llama-3-8b"), load_model_shape("llama-3-8b"), reqs,
                Open(rate=2.0, times=[r.t_s / 2 for r in rows]))
    assert p.requests.cached_tokens.sum() > 0.5 * p.requests.prompt_tokens.sum()
    # And the energy figures come from the twin's power model, named as such.
    assert m.summary["energy_source"] == "the twin's power model"
    assert 121 < m.summary["power_mean_w"] < 700 and m.summary["output_tokens_per_joule"] > 0


def test_energy_is_read_from_the_counter_else_from_power_samples():
    ts = np.arange(0.0, 11.0)
    counter = pd.DataFrame({"ts": ts, "name": "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION",
                            "labels": '{"gpu": "0", "source": "nvml"}', "value": 1e6 + ts * 300_000})
    power = pd.DataFrame({"ts": ts, "name": "DCGM_FI_DEV_POWER_USAGE",
                          "labels": '{"gpu": "0", "source": "nvidia-smi"}', "value": 250.0})
    both = pd.concat([counter, power])
    got = energy_view(both, 2.0, 6.0, output_tokens=4000)
    assert got["energy_j"] == pytest.approx(1200) and got["energy_source"] == "energy counter"
    assert got["power_mean_w"] == pytest.approx(300) and got["output_tokens_per_joule"] == pytest.approx(4000 / 1200)
    only_power = energy_view(power, 2.0, 6.0, output_tokens=4000)
    assert only_power["energy_j"] == pytest.approx(1000) and only_power["energy_source"] == "power samples"
    assert energy_view(power.iloc[:0], 2.0, 6.0, 10) == {}


@pytest.mark.integration
def test_locust_replays_a_trace_as_one_schedule_over_two_processes(tmp_path):
    rows = [{"timestamp": round(0.05 * k + (0.4 if k > 30 else 0.0), 3), "prompt_tokens": 8 + k % 5,
             "output_tokens": 4 + k % 3, "prefix_id": "sys" if k % 2 else None} for k in range(60)]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({k: v for k, v in r.items() if v is not None}) + "\n"
                            for r in rows))
    w = Workload(source="trace", path=path, trace_format="jsonl")
    load = Load(mode="replay", replay={"speed": 0.5}, stop={"duration_s": 60})
    with running("--ttft-ms", "10", "--itl-ms", "2", "--no-precise") as url:
        r = run_load(url, "ok", w, load, tmp_path / "run", processes=2, scrape_metrics=False)
    df = r.samples.sort_values("index")
    assert list(df["index"]) == list(range(60)) and df.worker.nunique() == 2
    got = df.scheduled_ts.to_numpy() - df.scheduled_ts.min()
    want = np.array([row["timestamp"] * 2 for row in rows])  # speed 0.5: twice as slow
    # Both processes anchor the schedule at their master's one start (`lab_go`), so the planned
    # times agree to the clock reading's microseconds however loaded the host (each process's own
    # spawning_complete put one 23 ms behind the other under a loaded suite).
    assert np.abs(got - want).max() < 0.002
    assert (df.target_output_tokens.to_numpy() == [row["output_tokens"] for row in rows]).all()
    # The trace's 60 requests take 7 s at half speed: the run ends with them, not at its 60 s.
    assert r.stop_reason == "schedule"
    assert sorted(w["index"] for w in r.workers) == [0, 1]  # a share each (runner.check_shares)


def test_two_processes_with_one_share_of_the_schedule_are_not_a_measurement():
    """Once in CI both forked processes of a replay read share 0 and sent the even half of the
    schedule twice: such a run is refused, not summarized as the load it was asked for."""
    from vllm_lab.traffic.runner import TrafficError, check_shares

    replay, closed = Load(mode="replay"), Load(mode="closed")
    check_shares([{"index": 0}, {"index": 1}], replay)
    check_shares([{"index": 0}, {"index": 0}], closed)  # a closed loop's users share one pool
    with pytest.raises(TrafficError, match=r"took the schedule's shares \[0, 0\]: two sent the same"):
        check_shares([{"index": 0}, {"index": 0}], replay)


def test_stress_levels_scale_the_traces_own_pattern():
    from vllm_lab import stress

    s = stress.stress_scenario(_trace_scenario("requests-synthetic.jsonl"), "step")
    assert s.load.mode == "replay"  # stressed as itself, not turned into Poisson arrivals
    for point, level in zip(stress.staircase_points(s, [5.0, 20.0]), (5.0, 20.0)):
        load = point.scenario.load
        times = np.fromiter(planned_arrivals(load, 0, point.scenario.workload), float)
        assert load.replay.rate == level and len(times) / times[-1] == pytest.approx(level, rel=0.02)


def test_tune_can_maximize_tokens_per_joule_under_the_slo():
    from vllm_lab import search
    from vllm_lab.run_summary import RunSummary

    s = _trace_scenario("requests-synthetic.jsonl", "load.replay={speed: 4}")
    m = PredictBackend().measure(s, None, Path("."))
    got = search.objective_values(RunSummary.of(m.summary), "energy", s)
    assert got == [pytest.approx(m.summary["output_tokens_per_joule"])] and got[0] > 0
    assert search.directions("energy") == ["maximize"] and "energy" in search.CONSTRAINED


def test_an_open_loop_ends_once_every_arrival_of_its_schedule_has_ended():
    from vllm_lab.traffic.shapes import stop_reason
    from vllm_lab.traffic.spec import Stop

    stop = Stop(duration_s=60)
    assert stop_reason(stop, 7.0, 60, 0, finished=59, scheduled=60) is None  # one still in flight
    assert stop_reason(stop, 7.0, 60, 0, finished=60, scheduled=60) == "schedule"
    assert stop_reason(stop, 7.0, 60, 0, finished=60) is None  # no schedule: the duration ends it
    assert stop_reason(stop, 60.0, 60, 0, finished=10, scheduled=60) == "duration"

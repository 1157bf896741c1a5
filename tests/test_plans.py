"""Plan logic: ladders, grouping by serve flags, restarts, resume, failures recorded as data."""

import re

import pandas as pd
import pytest

from vllm_lab import backends, plans, scenarios, serving
from vllm_lab.backends import LiveBackend, Measurement
from vllm_lab.scenarios import ScenarioError
from vllm_lab.store import Store


@pytest.fixture
def base():
    return scenarios.resolve("default")


def test_ladders_fit_the_hardware(base):
    # max-num-seqs binds below the 32 users the default scenario keeps in flight: a quarter, a
    # half and all of them; vLLM's default on an H200 (1024) is the reference, and every value
    # between runs the same batch. The first command's ladder: it must show where the cap binds.
    assert plans.default_values("max-num-seqs", base) == [8, 16, 32, 1024]
    # The same load on a GPU vLLM gives its smaller defaults (under 70 GiB, or an A100): 256.
    for gpu in ("cpu-demo", "a100-80g"):
        assert plans.default_values("max-num-seqs", scenarios.resolve("default", gpu)) == [8, 16, 32, 256]
    # More users than vLLM's default: the default itself is the limit the ladder divides.
    crowd = scenarios.resolve("default", None, ["load.shape.level=2048"])
    assert plans.kv_sequences(crowd) == 1841 and plans.default_values("max-num-seqs", crowd) == [256, 512, 1024]
    # On a 24 GB card the KV cache holds 110 sequences of the workload's mean length, fewer than
    # the 2048 users: the cache binds, and vLLM's default there (256) is the reference.
    small = scenarios.resolve("default", "rtx3090", ["load.shape.level=2048"])
    assert plans.kv_sequences(small) == 110
    assert plans.default_values("max-num-seqs", small) == [27, 55, 110, 256]
    # H200: vLLM's default max-num-seqs is 1024, and a token budget below it is refused.
    assert min(plans.default_values("max-num-batched-tokens", base)) >= 1024
    small = scenarios.resolve("default", "rtx3090")
    assert min(plans.default_values("max-num-batched-tokens", small)) >= 256
    # An 8B model in bf16 needs ~15 GiB: on a 24 GB card the ladder starts above that.
    assert min(plans.default_values("gpu-memory-utilization", small)) > 15 / 23.7
    assert plans.default_values("tensor-parallel-size", base) == [1]
    assert max(plans.default_values("max-model-len", base)) == 131072
    with pytest.raises(ScenarioError, match="no default ladder"):
        plans.default_values("seed", base)


def test_every_ladder_holds_vllms_default_on_the_gpu(base):
    for param in ("max-num-seqs", "max-num-batched-tokens", "gpu-memory-utilization", "block-size",
                  "dtype", "kv-cache-dtype", "enable-prefix-caching", "enforce-eager"):
        assert plans.reference_value(param, base) in plans.default_values(param, base), param
    assert plans.reference_value("gpu-memory-utilization", base) == 0.92
    assert plans.reference_value("max-num-seqs", scenarios.resolve("default", "a100-80g")) == 256
    assert plans.reference_point(base, ["max-num-seqs", "load.shape.level"]) is None


@pytest.mark.parametrize("param, backend", [("pipeline-parallel-size", "predict"),
                                            ("pipeline-parallel-size", "twin"),
                                            ("stream-interval", "predict")])
def test_a_flag_the_backend_does_not_model_is_refused(param, backend):
    with pytest.raises(ScenarioError, match=f"PARAM={param}: BACKEND={backend} does not model it"):
        plans.check_modelled(param, backend)
    plans.check_modelled(param, "vllm")
    plans.check_modelled("stream-interval", "twin")  # the twin's server streams at the interval


@pytest.mark.parametrize("param, says", [
    ("max-num-partial-prefills", ("vLLM 0.26.0 refuses to start with any value but 1 (since "
                                  "0.11.0): its V1 engine has no concurrent partial prefills")),
    ("swap-space", "was removed in vLLM 0.18.0 (target 0.26.0)"),
    ("enable-chunked-prefill", "has no effect since vLLM 0.10.0 (target 0.26.0)"),
    ("cpu-offload-gb", "has no effect since vLLM 0.26.0 (target 0.26.0): the V2 model runner")])
def test_a_flag_vllm_changed_is_not_swept(base, param, says):
    # Each value would stop the start, or read alike: a sweep of it measures nothing.
    with pytest.raises(ScenarioError, match=re.escape(f"PARAM={param}: {says}")):
        plans.check_param(param, base)


def test_values_are_typed_by_the_flag():
    assert plans.parse_values("max-num-seqs", "8, 16,32") == [8, 16, 32]
    assert plans.parse_values("enforce-eager", "false,true") == [False, True]
    assert plans.parse_values("gpu-memory-utilization", "0.8,0.9") == [0.8, 0.9]
    with pytest.raises(ScenarioError, match="'x' is not a value of max-num-seqs"):
        plans.parse_values("max-num-seqs", "8,x")


@pytest.mark.parametrize("param, text, sentence", [
    ("max-num-seqs", "8,0", "VALUES: 0 is out of range: must be an int >= 1 (max-num-seqs)"),
    ("block-size", "16,7", "VALUES: 7 is not allowed: must be one of 1, 8, 16, 32, 64, 128, 256"),
    ("dtype", "bfloat16,float17", "VALUES: 'float17' is not allowed: must be one of auto,"),
    ("gpu-memory-utilization", "0.9,1.5", "VALUES: 1.5 is out of range"),
])
def test_values_vllm_would_refuse_are_a_sentence_before_any_run(param, text, sentence):
    # vLLM's parser refuses them: a sweep that ran the rest and recorded a failed start would
    # spend a server start on the user's typo.
    with pytest.raises(ScenarioError) as err:
        plans.parse_values(param, text)
    assert str(err.value).startswith(sentence)


def test_sweep_points_change_only_the_swept_flag(base):
    points = plans.sweep_points(base, "max-num-seqs", [8, 16], repeats=2)
    assert [(p.values["max-num-seqs"], p.repeat) for p in points] == [(8, 0), (8, 1), (16, 0), (16, 1)]
    assert all(p.scenario.serve["model"] == base.serve["model"] for p in points)
    assert len({p.key for p in points}) == 4
    assert [len(g) for g in plans.group_by_server(points)] == [2, 2]


def test_load_parameter_shares_one_server(base):
    points = plans.sweep_points(base, "load.shape.level", [4, 16, 64])
    assert [p.scenario.load.shape.level for p in points] == [4, 16, 64]
    assert len(plans.group_by_server(points)) == 1


class FakeBackend:
    """Measures instantly; fails the points it is told to, the way a live server would."""

    name = "fake"

    def __init__(self, fail=None, interrupt_at=None):
        self.fail = fail or {}
        self.measured = []
        self.interrupt_at = interrupt_at

    def measure(self, scenario, host, workdir):
        seqs = scenario.serve.get("max-num-seqs")
        if self.interrupt_at is not None and len(self.measured) == self.interrupt_at:
            raise KeyboardInterrupt
        self.measured.append(seqs)
        if seqs in self.fail:
            return Measurement(status=self.fail[seqs], started=0, ended=1, error="boom")
        samples = pd.DataFrame({"request_id": ["a"], "ttft_s": [0.1]})
        return Measurement(status="ok", started=0, ended=1, samples=samples,
                           summary={"output_throughput": float(seqs)})

    def close(self, host):
        pass


def test_failures_are_data_and_resume_skips_finished(base, tmp_path):
    points = plans.sweep_points(base, "max-num-seqs", [8, 16, 32, 64])
    plan = plans.Plan("exp", "sweep", points, {"param": "max-num-seqs"})
    backend = FakeBackend(fail={16: "oom"}, interrupt_at=3)
    with pytest.raises(KeyboardInterrupt):
        plans.execute(plan, backend, tmp_path / "lab.db", tmp_path / "work")
    runs = Store(tmp_path / "lab.db").runs("exp")
    assert dict(zip(runs["point"].map(lambda p: p["max-num-seqs"]), runs["status"])) == \
        {8: "ok", 16: "oom", 32: "ok"}
    resumed = FakeBackend(fail={16: "oom"})
    counts = plans.execute(plan, resumed, tmp_path / "lab.db", tmp_path / "work")
    assert resumed.measured == [64] and counts == {"ok": 1}
    assert len(Store(tmp_path / "lab.db").runs("exp")) == 4


@pytest.mark.parametrize("status, started_again", [("oom", False), ("failed-start", False),
                                                    ("timeout", True), ("crashed", True)])
def test_a_server_that_failed_to_start_for_memory_is_not_started_for_each_repeat(
        base, tmp_path, status, started_again):
    points = plans.sweep_points(base, "max-num-seqs", [8, 16], repeats=3)
    backend = FakeBackend(fail={16: status})
    plans.execute(plans.Plan("exp", "sweep", points, {}), backend, tmp_path / "lab.db", tmp_path / "w")
    assert backend.measured.count(16) == (3 if started_again else 1) and backend.measured.count(8) == 3
    runs = Store(tmp_path / "lab.db").runs("exp")
    failed = runs[runs["point"].map(lambda p: p["max-num-seqs"]) == 16]
    assert list(failed["status"]) == [status] * 3  # every repeat recorded, as the failure it would be
    if not started_again:
        assert sum(failed["error"].str.startswith("not started again: the same server failed to start "
                                                  "before (boom)")) == 2


def test_a_resume_does_not_start_again_a_server_whose_recorded_repeat_ran_out_of_memory(base, tmp_path):
    """An H200 resume once spent 3 minutes starting a gpu-memory-utilization=0.98 server whose
    first two repeats, recorded by an earlier call, had run out of memory."""
    points = plans.sweep_points(base, "max-num-seqs", [8, 16], repeats=3)
    plan = plans.Plan("exp", "sweep", points, {})
    first = plans.Plan("exp", "sweep", points[:4], {})  # a call that ended after 16's first repeat
    plans.execute(first, FakeBackend(fail={16: "oom"}), tmp_path / "lab.db", tmp_path / "w")
    resumed = FakeBackend(fail={16: "oom"})
    plans.execute(plan, resumed, tmp_path / "lab.db", tmp_path / "w")
    assert resumed.measured == []
    runs = Store(tmp_path / "lab.db").runs("exp")
    sixteen = runs[runs["point"].map(lambda p: p["max-num-seqs"]) == 16]
    assert list(sixteen["status"]) == ["oom"] * 3 and len(runs) == 6
    again = "not started again: the same server failed to start before (boom)"
    assert sorted(sixteen["error"]) == ["boom", again, again]


def test_points_spread_over_hosts(base, tmp_path):
    seen = {}

    class HostBackend(FakeBackend):
        def measure(self, scenario, host, workdir):
            seen.setdefault(host, []).append(scenario.serve["max-num-seqs"])
            return super().measure(scenario, host, workdir)

    points = plans.sweep_points(base, "max-num-seqs", [8, 16, 32, 64])
    plans.execute(plans.Plan("e", "sweep", points, {}), HostBackend(), tmp_path / "lab.db",
                  tmp_path / "w", hosts=["a", "b"])
    assert seen == {"a": [8, 32], "b": [16, 64]}


def test_live_backend_restarts_only_when_serve_flags_change(base, tmp_path, monkeypatch):
    starts, stops = [], []

    def fake_start(flags, **kw):
        starts.append(flags.get("max-num-seqs"))
        return serving.Instances([serving.Instance("h", "http://127.0.0.1:9", 9, "/tmp/log")])

    monkeypatch.setattr(serving, "start", fake_start)
    monkeypatch.setattr(serving, "stop", lambda inv, limit=None, **kw: stops.append(limit))
    monkeypatch.setattr(backends, "_get", lambda url, timeout=5.0: 200)
    monkeypatch.setattr(backends, "_post", lambda *a, **k: 200)
    live = LiveBackend("twin", tmp_path / "inv.yml")
    for p in plans.sweep_points(base, "max-num-seqs", [8, 8, 16]) + \
            plans.sweep_points(base.with_serve(**{"max-num-seqs": 16}), "load.shape.level", [1, 2]):
        live._ensure_server(p.scenario, None)
    # serve.yml alone replaces a healthy server whose flags changed (the role stops it first).
    assert starts == [8, 16] and stops == []
    # The same flags on another simulated GPU: the twin started for the last one cannot serve it.
    live._ensure_server(scenarios.resolve("default", "cpu-demo", ["serve.max-num-seqs=16"]), None)
    assert starts == [8, 16, 16] and stops == []
    # A server that no longer answers is stopped by the stop playbook first.
    monkeypatch.setattr(backends, "_get", lambda url, timeout=5.0: 0)
    live._ensure_server(plans.sweep_points(base, "max-num-seqs", [8])[0].scenario, None)
    assert starts == [8, 16, 16, 8] and stops == [None] and not live._starting


@pytest.mark.parametrize("cause, status", [("oom", "oom"), ("refused-flag", "failed-start"),
                                           ("start-timeout", "timeout"), ("crashed", "crashed")])
def test_start_failures_are_classified(base, tmp_path, monkeypatch, cause, status):
    def failing_start(flags, **kw):
        raise serving.ServeError(cause, "log tail line", host="h")

    monkeypatch.setattr(serving, "start", failing_start)
    m = LiveBackend("twin", tmp_path / "inv.yml").measure(base, None, tmp_path)
    assert m.status == status and m.error.startswith(cause) and "log tail line" in m.error


def test_a_run_counts_only_its_own_gpus_telemetry():
    import json as _json

    import pandas as pd

    from vllm_lab.backends import own_gpus
    from vllm_lab.summary import _server_view

    def row(gpu, util, source="nvidia-smi"):
        return {"ts": 1.0, "name": "DCGM_FI_DEV_GPU_UTIL", "value": util,
                "labels": _json.dumps({"gpu": gpu, "source": source})}

    metrics = pd.DataFrame([row("0", 90.0), row("1", 10.0)])
    # Two servers on one host, one GPU each: GPU 1's neighbour does not count.
    assert _server_view(own_gpus(metrics, "0"))["gpu_util_mean"] == 90.0
    # One server over both GPUs (tensor parallel): utilization is their mean, not their sum.
    assert _server_view(own_gpus(metrics, "0,1"))["gpu_util_mean"] == 50.0
    assert _server_view(own_gpus(metrics, ""))["gpu_util_mean"] == 50.0


def test_live_backend_sends_load_from_the_remote_load_generators(tmp_path, monkeypatch):
    from vllm_lab.traffic import runner
    from vllm_lab.traffic.runner import WorkerHost

    hosts = [WorkerHost("here", "127.0.0.1", local=True), WorkerHost("lg1", "10.0.0.2")]
    monkeypatch.setattr(runner, "loadgen_workers", lambda inv: hosts)
    assert [w.name for w in LiveBackend("twin", tmp_path / "inv.yml")._load_generators()] == ["lg1"]

    def no_group(inv):
        raise RuntimeError("no hosts in group loadgen")

    monkeypatch.setattr(runner, "loadgen_workers", no_group)
    assert LiveBackend("twin", tmp_path / "inv.yml")._load_generators() is None  # the load runs here

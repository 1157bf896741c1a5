"""A twin started with an API key, measured end to end by the live backend: a scenario that does not
pass the key is failed-requests with the 401 hint; the key from the scenario, from the role (as the
inventory or vault gives it) or from the lab's environment makes the run ok. The key appears
nowhere on disk after the runs (store, samples, reports, traffic config) nor in any argv the lab
starts."""

import secrets
import subprocess
from pathlib import Path

import pytest

from tests.support.processes import TwinProcess
from vllm_lab import reports as report
from vllm_lab import scenarios, serving
from vllm_lab.backends import LiveBackend
from vllm_lab.plans import Plan, Point, _record
from vllm_lab.store import Store

pytestmark = pytest.mark.integration

KEY = "sk-lab-" + secrets.token_hex(8)


@pytest.fixture(scope="module")
def twin(tmp_path_factory):
    t = TwinProcess(tmp_path_factory.mktemp("twin"), "--api-key", KEY)
    yield t
    t.stop()


@pytest.fixture
def argvs(monkeypatch):
    """Every command line the lab starts during the test."""
    seen: list[list[str]] = []
    real = subprocess.Popen

    def spy(args, *a, **kw):
        seen.append([str(x) for x in args])
        return real(args, *a, **kw)

    monkeypatch.setattr(subprocess, "Popen", spy)
    return seen


def _scenario(twin):
    return scenarios.resolve("default", overrides=[
        f"serve.model={twin.model}", "workload.source=synthetic", "workload.input.mean=16",
        "workload.output.mean=8", "load.shape.level=2", "load.stop.duration_s=2",
        "run.warmup_requests=1", "run.clean=false"])


def _backend(env_key=None) -> LiveBackend:
    b = LiveBackend("twin", Path("inventory/local.yml"), api_key=env_key, processes=1)
    b._workers = []  # the load runs here: no inventory lookup
    return b


def _instance(twin, role_key="") -> serving.Instance:
    return serving.Instance(host="localhost", url=twin.url, port=twin.port, log_path="", api_key=role_key)


def test_a_key_the_load_generator_does_not_send_is_failed_requests_with_the_hint(twin, tmp_path):
    m = _backend().measure_on(_scenario(twin), _instance(twin), tmp_path)
    assert m.status == "failed-requests", (m.status, m.error)
    assert "HTTP 401" in m.error and "serve.api-key" in m.error and "VLLM_API_KEY" in m.error
    assert m.summary["failed_requests_rate"] == 1.0


# Runs this short (8 tokens) are judged on a client lag of a few ms: marked timing, run alone.
@pytest.mark.timing
@pytest.mark.parametrize("where", ["scenario", "role", "environment"])
def test_the_key_from_wherever_the_server_got_it_makes_the_run_ok_and_leaves_no_trace(
        twin, tmp_path, argvs, where):
    s = _scenario(twin)
    if where == "scenario":
        s = s.with_serve(**{"api-key": KEY})
    instance = _instance(twin, KEY if where == "role" else "")
    backend = _backend(KEY if where == "environment" else None)
    work, out = tmp_path / "work", tmp_path / "reports"
    m = backend.measure_on(s, instance, work)
    assert m.status == "ok", m.error
    assert m.summary["failed_requests"] == 0 and m.summary["output_throughput"] > 0
    assert KEY not in repr(instance)

    plan = Plan("sweep-key", "sweep", [Point(s, {"where": where}, 0)], {"params": ["where"]})
    st = Store(out / "lab.db")
    st.create_experiment(plan.experiment_id, plan.step, s.name, {**plan.meta, "base": s.to_record()})
    st.record_run(_record(plan, plan.points[0], backend, m), m.samples, m.server_metrics)
    st.close()
    report.build(out / "lab.db", plan.experiment_id, out)

    assert argvs and not [a for a in argvs if any(KEY in x for x in a)]
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert any(p.name == "traffic_config.json" for p in files)
    assert any(p.name == "report.md" for p in files) and any(p.suffix == ".parquet" for p in files)
    leaked = [p for p in files if KEY.encode() in p.read_bytes()]
    assert not leaked

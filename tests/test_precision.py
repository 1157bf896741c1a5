"""PRECISION: each point is repeated (its first runs in one server start, then round after round) until its intervals are as narrow as asked
or the cap is hit; the verdicts and the host's noise are kept with the experiment."""

import time

import numpy as np
import pytest

from vllm_lab.backends import Measurement
from vllm_lab.commands import backend as command_backend
from vllm_lab.commands.precision import Precision, PrecisionError
from vllm_lab.commands.settings import Settings, Source
from vllm_lab.commands.sweep import sweep
from vllm_lab.store import Store

pytestmark = pytest.mark.usefixtures("shared_predictions")  # tests/conftest.py


class NoisyBackend:
    """max-num-seqs=8 reads with a 6% spread run to run, 64 with 0.3%; every run is recorded
    with the order it ran in, so the test can see how the rounds group."""

    name = "predict"

    def __init__(self):
        self.rng = np.random.default_rng(4)
        self.order: list[int] = []

    def measure(self, scenario, host, workdir):
        seqs = int(scenario.serve["max-num-seqs"])
        self.order.append(seqs)
        spread = 0.06 if seqs == 8 else 0.003
        tok = float(self.rng.normal(1000.0 * seqs ** 0.5, 1000.0 * seqs ** 0.5 * spread))
        summary = {"output_throughput": tok, "ttft_p50": 0.1, "tpot_p50": 0.01, "goodput": tok / 100,
                   "meets_slo": True, "requests": 10.0, "errors": 0.0}
        return Measurement("ok", time.time(), time.time(), host="fake", summary=summary)

    def close(self, host):
        pass


def test_points_repeat_in_one_start_then_in_rounds_until_precise_or_capped(tmp_path, monkeypatch, capsys):
    backend = NoisyBackend()
    monkeypatch.setattr(command_backend, "make_backend", lambda settings, exp_id="", hooks=None: backend)
    settings = Settings(backend="predict", out=tmp_path, experiment="prec",
                        precision=Precision.parse("throughput=2%,max=6"))
    # The scenario's own max-num-seqs (the sweep's reference point) is one of the two swept.
    code = sweep(settings, Source("default", None, ("serve.max-num-seqs=64",)), "max-num-seqs", "8,64")
    assert code == 0
    out = capsys.readouterr().out
    assert "precision reached: max-num-seqs=64" in out and "after 3 runs" in out
    assert "precision cap of 6 runs hit: max-num-seqs=8" in out
    # The first three runs of each point share its server start; then only the imprecise one goes on.
    assert backend.order[:6] == [8, 8, 8, 64, 64, 64] and set(backend.order[6:]) == {8}
    assert len(backend.order) == 9
    store = Store(tmp_path / "lab.db")
    meta = store.experiment("prec")["meta"]
    store.close()
    points = meta["precision"]["points"]
    assert points["max-num-seqs=64"]["reached"] and not points["max-num-seqs=8"]["reached"]
    assert points["max-num-seqs=8"]["runs"] == 6
    assert 0 < meta["host_noise_cv"]["output_throughput"] < 0.1


@pytest.mark.parametrize("text", ["throughput", "speed=2%", "throughput=200%", "max=1", "ttft=x", ","])
def test_a_bad_precision_is_one_sentence(text):
    with pytest.raises(PrecisionError) as e:
        Precision.parse(text)
    assert "\n" not in str(e.value) and "PRECISION=default" in str(e.value)


def test_default_precision():
    p = Precision.parse("default")
    assert p.targets == {"output_throughput": 0.02, "ttft_p50": 0.05, "tpot_p50": 0.05}
    assert p.max_repeats == 10

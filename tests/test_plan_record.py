"""An experiment's plan is part of it: recorded when it is made, restored by a resume, and a
variable that contradicts it refused in one sentence (on the predictor: seconds, no process)."""

import json
import shutil

import pytest

from vllm_lab import cli
from vllm_lab.commands import plan_record
from vllm_lab.commands.settings import Settings
from vllm_lab.store import Store

pytestmark = pytest.mark.usefixtures("shared_predictions")  # tests/conftest.py

A100 = {"LAB_MAKE_PARAM": "max-num-seqs", "LAB_MAKE_BACKEND": "predict",
        "LAB_MAKE_HARDWARE": "a100-80g", "LAB_MAKE_VALUES": "16,32", "LAB_MAKE_DURATION": "10",
        "LAB_MAKE_SET": "load.shape.level=4"}


def _make(monkeypatch, tmp_path, **variables) -> int:
    for key in [*A100, "LAB_MAKE_RESUME", "LAB_MAKE_EXPERIMENT", "LAB_MAKE_OUT"]:
        monkeypatch.delenv(key, raising=False)
    for name, value in {"OUT": str(tmp_path), **variables}.items():
        monkeypatch.setenv(f"LAB_MAKE_{name}", value)
    return cli.main(["make", "sweep"])


@pytest.fixture(scope="module")
def a100_made(tmp_path_factory):
    """The a100 sweep made once (seconds on the predictor); each test takes a copy of its folder."""
    out = tmp_path_factory.mktemp("a100")
    variables = {k.removeprefix("LAB_MAKE_"): v for k, v in A100.items()}
    with pytest.MonkeyPatch.context() as monkeypatch:
        assert _make(monkeypatch, out, EXPERIMENT="a100", **variables) == 0
    return out


def _a100(made, tmp_path) -> None:
    shutil.copytree(made, tmp_path, dirs_exist_ok=True)


def test_the_plan_is_recorded_when_the_experiment_is_made(a100_made):
    with Store(a100_made / "lab.db") as store:
        made_by = store.experiment("a100")["meta"][plan_record.META_KEY]
    assert made_by["command"] == "sweep"
    assert made_by["options"] == {"--hardware": ["a100-80g"], "--set": ["load.shape.level=4",
                                                                          "load.stop.duration_s=10"],
                                  "--backend": ["predict"], "--param": ["max-num-seqs"],
                                  "--values": ["16,32"]}


def test_a_resume_without_the_variables_restores_the_plan(monkeypatch, tmp_path, capsys, a100_made):
    _a100(a100_made, tmp_path)
    capsys.readouterr()
    assert _make(monkeypatch, tmp_path, PARAM="max-num-seqs", RESUME="1", EXPERIMENT="a100") == 0
    out = capsys.readouterr().out
    assert out.startswith("resuming a100 as planned: HARDWARE=a100-80g DURATION=10 "
                          "SET=load.shape.level=4 BACKEND=predict VALUES=16,32\n")
    with Store(tmp_path / "lab.db") as store:
        runs = store.runs("a100")
    # 16, 32 and vLLM's default on an A100 (256), the sweep's reference
    assert len(runs) == 3 and set(runs["gpu_model"]) == {"NVIDIA A100 80GB"}
    assert {json.loads(s)["load"]["stop"]["duration_s"] for s in runs["scenario_json"]} == {10}


def test_resume_without_experiment_finds_it_by_its_plan(monkeypatch, tmp_path, capsys, a100_made):
    _a100(a100_made, tmp_path)
    capsys.readouterr()
    assert _make(monkeypatch, tmp_path, PARAM="max-num-seqs", RESUME="1") == 0
    assert capsys.readouterr().out.startswith("resuming a100 as planned:")


@pytest.mark.parametrize("variable, value, planned", [
    ("HARDWARE", "h200", "HARDWARE=a100-80g"), ("DURATION", "30", "DURATION=10 SET=load.shape.level=4"),
    ("VALUES", "8,1024", "VALUES=16,32"), ("BACKEND", "vllm", "BACKEND=predict"),
])
def test_a_variable_that_contradicts_the_plan_is_refused_in_one_sentence(
        monkeypatch, tmp_path, capsys, a100_made, variable, value, planned):
    _a100(a100_made, tmp_path)
    capsys.readouterr()
    assert _make(monkeypatch, tmp_path, PARAM="max-num-seqs", RESUME="1", EXPERIMENT="a100",
                 **{variable: value}) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"lab: EXPERIMENT=a100 was planned with {planned}, and {variable}={value} "
                          f"contradicts it: leave {variable} out") and err.count("\n") == 1
    with Store(tmp_path / "lab.db") as store:
        assert len(store.runs("a100")) == 3  # nothing was measured into it


def test_the_resume_command_names_the_restored_plan():
    command = cli._make_resume_command(
        "sweep", {"LAB_MAKE_PARAM": "max-num-seqs", "LAB_MAKE_RESUME": "1"},
        {"--hardware": ["a100-80g"], "--set": ["load.stop.duration_s=10", "serve.x=1"],
         "--values": ["16,32"]})
    assert command("a100") == ("make sweep PARAM=max-num-seqs HARDWARE=a100-80g DURATION=10 "
                               "SET=serve.x=1 VALUES=16,32 RESUME=1 EXPERIMENT=a100")


def test_without_a_command_line_the_resume_command_comes_from_the_plan():
    plan = plan_record.record("sweep", {"--hardware": ["a100-80g"], "--param": ["max-num-seqs"]})
    settings = Settings(backend="predict", plan=plan).planned(values="16,32")
    assert settings.resume_with("a100") == ("scripts/lab.py sweep --hardware=a100-80g "
                                            "--param=max-num-seqs --values=16,32 --resume "
                                            "--experiment=a100")

"""Scenario schema, composition of layers, and the one-sentence errors for bad input."""

from pathlib import Path

import pytest

from vllm_lab import scenarios
from vllm_lab.scenarios import ScenarioError


def write(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """A scenario folder with one hardware preset and one scenario."""
    write(tmp_path, "hardware/h200.yaml", (scenarios.SCENARIO_DIR / "hardware/h200.yaml").read_text())
    write(tmp_path, "hardware/small.yaml", """
hardware: {name: Small, gpu: small, memory_gib: 24, bandwidth_gbs: 900, tflops_bf16: 70,
           tflops_fp16: 70, tflops_fp32: 35, twin_profile: cpu-demo}
serve: {dtype: float16, max-num-batched-tokens: 8192}
""")
    write(tmp_path, "chat.yaml", """
serve: {model: llama-3-8b, max-num-batched-tokens: 4096}
workload: {source: sharegpt-like}
load: {mode: closed, shape: {level: 8}}
slo: {ttft: {threshold_ms: 500}}
""")
    return tmp_path


def test_every_shipped_scenario_resolves():
    for name in scenarios.available()["scenarios"]:
        for hw in scenarios.available()["hardware"]:
            s = scenarios.resolve(name, hw)
            assert s.serve["model"] and s.hardware.memory_gib > 0


def test_layers_compose_later_wins(folder):
    s = scenarios.resolve("chat", "small", ["serve.max-num-seqs=64", "load.shape.level=32"], folder=folder)
    assert s.serve["dtype"] == "float16"  # from the preset
    assert s.serve["max-num-batched-tokens"] == 4096  # the scenario beats the preset
    assert s.serve["max-num-seqs"] == 64 and s.load.shape.level == 32  # overrides beat both
    assert s.hardware.name == "Small"
    assert s.sources[2:] == ["override 'serve.max-num-seqs=64'", "override 'load.shape.level=32'"]
    assert s.sources[0].endswith("hardware/small.yaml") and s.sources[1].endswith("chat.yaml")


def test_resolved_scenario_round_trips(folder):
    s = scenarios.resolve("chat", folder=folder)
    again = scenarios.Scenario.model_validate(s.to_record())
    assert again == s
    assert s.slo.ttft.percentile == 99.0 and s.slo.targets().keys() == {"ttft"}


def test_default_hardware_is_h200(folder):
    assert scenarios.resolve("chat", folder=folder).hardware.gpu == "h200"


@pytest.mark.parametrize("text, expected", [
    ("serve: {model: m}\nworkload: {}\nload: {}\nslo: {ttft: {threshold_ms: 5, percentil: 90}}",
     "unknown key slo.ttft.percentil (did you mean percentile?)"),
    ("serve: {model: m}\nworkload: {}\nload: {mode: sometimes}", "key load.mode"),
    ("serve: {model: m}\nworkload: {}\nload: {shape: {level: -3}}", "key load.shape.level"),
    ("serve: {model: m}\nworkload: {}\nlod: {}", "unknown key lod (did you mean load?)"),
    ("serve: {}\nworkload: {}\nload: {}", "serve.model is required"),
    ("serve: {model: m}\nload: {}", "key workload is required"),
    # A NUL byte names no file: the operating system refuses such a path before looking.
    ('hardware_preset: "h\\0"\nserve: {model: m}\nworkload: {}\nload: {}',
     "key hardware_preset must be a preset name"),
    ('serve: {model: m}\nworkload: {source: sharegpt-file, path: "a\\0b"}\nload: {}',
     "key workload.path: Value error, a file path cannot hold a NUL byte"),
])
def test_bad_scenarios_get_one_sentence_naming_file_and_key(folder, text, expected):
    write(folder, "bad.yaml", text)
    with pytest.raises(ScenarioError) as err:
        scenarios.resolve("bad", folder=folder)
    message = str(err.value)
    assert expected in message and "bad.yaml" in message and "\n" not in message


def test_broken_yaml_names_file_and_line(folder):
    write(folder, "broken.yaml", "serve:\n  model: m\n  max-num-seqs: [1, 2\nload: {}\n")
    with pytest.raises(ScenarioError, match=r"broken.yaml line \d+: broken YAML"):
        scenarios.resolve("broken", folder=folder)


def test_missing_file_and_bad_override(folder):
    with pytest.raises(ScenarioError, match="nope.yaml: no such scenario file"):
        scenarios.resolve("nope", folder=folder)
    with pytest.raises(ScenarioError, match="write section.key=value"):
        scenarios.resolve("chat", overrides=["max-num-seqs"], folder=folder)
    with pytest.raises(ScenarioError, match="no such scenario file"):
        scenarios.resolve("chat", hardware="tpu", folder=folder)


def test_override_error_names_the_override(folder):
    with pytest.raises(ScenarioError, match=r"override 'load.shape.levl=3': unknown key load.shape.levl"):
        scenarios.resolve("chat", overrides=["load.shape.levl=3"], folder=folder)


def test_a_flag_given_no_value_is_vllms_default(folder):
    # The way back from a template's flags to vLLM's own, e.g. make stress on realtime-chat's
    # traffic with SET="serve.enforce-eager= serve.max-num-seqs=": the flag is not passed at all.
    s = scenarios.resolve("chat", "small", ["serve.max-num-batched-tokens=", "serve.dtype=null"],
                          folder=folder)
    assert "max-num-batched-tokens" not in s.serve and "dtype" not in s.serve
    assert s.serve["model"] == "llama-3-8b"
    with pytest.raises(ScenarioError, match="serve.model is required"):
        scenarios.resolve("chat", overrides=["serve.model="], folder=folder)

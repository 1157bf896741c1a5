"""Each lint rule both ways: the flag that draws it, and the corrected flag that does not."""

import pytest

from vllm_lab import flags, lint, scenarios


def findings(*overrides: str, scenario: str = "default", version: str | None = None):
    layers = scenarios.load_layers(scenario, overrides=list(overrides))
    s = scenarios.validate(layers)
    if version:
        s = s.model_copy(update={"vllm_version": version})
    return lint.lint(s, layers, known_flags=set(flags.FLAGS))


def messages(*overrides: str, **kw) -> str:
    return " | ".join(str(f) for f in findings(*overrides, **kw))


@pytest.mark.parametrize("bad, good, expected", [
    # unknown key -> nearest allowed key
    ("serve.max-num-seq=64", "serve.max-num-seqs=64", "nearest allowed key: max-num-seqs"),
    ("serve.max_num_seqs=64", "serve.max-num-seqs=64", "nearest allowed key: max-num-seqs"),
    # wrong type and out of range -> the range
    ("serve.max-num-seqs=lots", "serve.max-num-seqs=8", "must be an int >= 1"),
    ("serve.gpu-memory-utilization=1.5", "serve.gpu-memory-utilization=0.9", "must be a float > 0.0 and <= 1.0"),
    ("serve.dtype=fp64", "serve.dtype=bfloat16", "must be one of auto, half"),
    ("serve.enforce-eager=sometimes", "serve.enforce-eager=true", "true or false"),
    # removed and always-on flags -> what to write instead
    ("serve.swap-space=8", "serve.kv-offloading-size=8", "kv-offloading-size"),
    ("serve.enable-chunked-prefill=true", "serve.max-num-batched-tokens=4096", "always on in the V1 engine"),
    # V0's concurrent partial prefills: V1 refuses to start with any value but 1
    ("serve.max-num-partial-prefills=2", "serve.max-num-partial-prefills=1",
     ("vLLM 0.26.0 refuses to start with any value but 1 (since 0.11.0): its V1 engine has no "
      "concurrent partial prefills")),
    ("serve.max-long-partial-prefills=4", "serve.max-long-partial-prefills=1", "long-prefill-token-threshold caps"),
    # attention backends
    ("serve.block-size=8", "serve.block-size=16", "FlashAttention backends (multiples of 16)"),
    # scheduler invariant
    ("serve.max-num-batched-tokens=128", "serve.max-num-batched-tokens=2048", "smaller than max-num-seqs"),
    # model and hardware limits
    ("serve.max-model-len=200000", "serve.max-model-len=8192", "max_position_embeddings (131072)"),
    ("serve.tensor-parallel-size=2", "serve.tensor-parallel-size=1", "needs 2 GPUs"),
    ("serve.gpu-memory-utilization=0.05", "serve.gpu-memory-utilization=0.5", "do not fit"),
])
def test_rule_both_ways(bad, good, expected):
    extra = ("serve.max-num-seqs=256",) if "batched" in bad else ()
    assert expected in messages(bad, *extra)
    assert findings(good, *extra) == []


def test_finding_names_file_and_key():
    f = findings(scenario="guide/realtime-chat")
    assert [x.key for x in f] == ["block-size"]
    assert f[0].source == "scenarios/guide/realtime-chat.yaml" and f[0].severity == "error"


def test_two_guide_templates_draw_findings_and_corrections_are_clean():
    drawn = [name for name in ("high-concurrency-api", "realtime-chat", "offline-batch")
             if findings(scenario=f"guide/{name}")]
    assert len(drawn) >= 2
    for name in ("high-concurrency-api", "realtime-chat", "offline-batch"):
        assert findings(scenario=name) == []


def test_target_version_decides_what_is_removed():
    assert "removed in vLLM 0.18.0" in messages("serve.swap-space=4", version="0.26.0")
    assert "swap-space" not in flags.changes_for("0.17.1")


def test_cpu_offload_is_a_warning_that_names_the_runner_that_offloads():
    # vLLM 0.26 accepts the flag and offloads nothing on dense models (its V2 model runner).
    found = findings("serve.cpu-offload-gb=4")
    assert [(f.severity, f.key) for f in found] == [("warning", "cpu-offload-gb")]
    assert "VLLM_USE_V2_MODEL_RUNNER=0" in found[0].message


def test_tp_must_divide_heads():
    out = messages("serve.tensor-parallel-size=3", "hardware.gpu_count=4")
    assert "does not divide the model's 32 attention heads" in out


def test_defaults_follow_the_gpu():
    assert flags.engine_defaults(140.4, "h200")["max-num-seqs"] == 1024
    assert flags.engine_defaults(79.3, "NVIDIA A100 80GB")["max-num-batched-tokens"] == 2048
    assert flags.engine_defaults(23.7)["max-num-seqs"] == 256


def test_cli_lint_exit_codes(capsys):
    from vllm_lab.cli import main
    assert main(["lint", "--scenario", "guide/realtime-chat"]) == 1
    assert "block-size" in capsys.readouterr().out
    assert main(["lint", "--scenario", "realtime-chat"]) == 0
    assert main(["lint", "--all"]) == 0
    out = capsys.readouterr().out
    # The guide's templates as written are wrong on purpose: --all names them, prints no error.
    assert "error:" not in out and "not linted: guide/high-concurrency-api" in out
    assert main(["lint", "--scenario", "missing-one"]) == 2
    assert "no such scenario file" in capsys.readouterr().err


def test_cli_lint_all_exits_non_zero_when_it_prints_an_error(capsys, monkeypatch):
    from vllm_lab import scenarios
    from vllm_lab.cli import main
    shipped = scenarios.available()
    monkeypatch.setattr(scenarios, "available",
                        lambda *a: {**shipped, "scenarios": ["default", "guide/realtime-chat"]})
    assert main(["lint", "--all"]) == 1
    assert "error:" in capsys.readouterr().out

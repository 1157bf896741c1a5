"""vllm_lab.cli in this process: the parser, one sentence and exit status 2 for a command line it
cannot take, 0 for a finished command, 130 for Ctrl-C, and a predicted baseline end to end.
(`lab make`'s argument lists are tests/test_make_input.py's; `lab lint` is tests/test_lint.py's.)"""

from __future__ import annotations

import pytest
import yaml

from vllm_lab import cli
from vllm_lab.commands import show
from vllm_lab.store import Store


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def sentence(err: str) -> str:
    """The one line the lab prints for a bad input, without its prefix."""
    assert err.startswith("lab: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err.removeprefix("lab: ").strip()


def test_every_command_is_in_the_parser():
    sub = next(a for a in cli.build_parser()._actions if a.dest == "command")
    assert set(sub.choices) >= {"lint", "show", "baseline", "sweep", "calibrate", "report", "combo",
                                "tune", "stress", "claims", "monitor", "watch", "findings", "quarterly"}
    # Every make target the Makefile hands over is a command (quarterly: make report PERIOD=).
    assert set(cli.MAKE_TARGETS) <= set(sub.choices)


def test_help_lists_the_commands_and_exits_0(capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: lab ") and "sweep" in out and "quarterly" in out


@pytest.mark.parametrize("argv, says", [
    ([], "the following arguments are required: command"),
    (["bogus"], "argument command: invalid choice: 'bogus' (choose from 'lint', 'show', "),
    (["sweep", "--backend", "predict"], "the following arguments are required: --param"),
    (["quarterly"], "the following arguments are required: --period"),
    (["baseline", "--backend", "gpu"], "argument --backend: invalid choice: 'gpu' (choose from 'twin', 'vllm', 'predict')"),
    (["baseline", "--repeats", "0"], "argument --repeats: '0' is not allowed: a whole number, 1 or more"),
    (["baseline", "--loadgen-processes", "two"], "argument --loadgen-processes: 'two' is not allowed"),
    (["baseline", "--experiment", "../x"], "argument --experiment: '../x' is not an experiment name: use 1-128"),
    (["baseline", "--no-such-option"], "unrecognized arguments: --no-such-option"),
    (["show", "--scenario", "nope"], "scenarios/nope.yaml: no such scenario file"),
    (["show", "--set", "serve.api-key=sk-1"], "override serve.api-key: a secret is not taken on the command line"),
])
def test_a_bad_command_line_is_one_sentence_and_exit_2(capsys, argv, says):
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == "" and says in sentence(err)


def test_show_prints_the_resolved_scenario_with_its_overrides(capsys):
    code, out, err = run(capsys, "show", "--hardware", "cpu-demo", "--set", "serve.max-num-seqs=64")
    assert code == 0 and err == ""
    shown = yaml.safe_load(out)
    assert shown["serve"]["max-num-seqs"] == 64 and shown["hardware"]["gpu"] == "cpu-demo"
    assert shown["sources"][-1] == "override 'serve.max-num-seqs=64'"


def test_ansible_verbosity_is_refused_only_where_ansible_runs(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("ANSIBLE_VERBOSITY", "2")
    code, _, err = run(capsys, "baseline", "--backend", "twin", "--out", str(tmp_path))
    assert code == 2 and sentence(err).startswith("ANSIBLE_VERBOSITY='2': the lab reads Ansible's")
    assert not (tmp_path / "lab.db").exists()
    assert run(capsys, "show")[0] == 0


def test_report_and_findings_without_experiments_name_the_store(capsys, tmp_path):
    for command in ("report", "findings"):
        code, _, err = run(capsys, command, "--out", str(tmp_path))
        assert code == 2
        assert sentence(err) == f"{tmp_path}/lab.db: no experiments yet; run make baseline or make sweep first"


def test_ctrl_c_is_exit_130_with_a_sentence(capsys, monkeypatch):
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(show, "main", interrupted)
    code, _, err = run(capsys, "show")
    assert code == 130 and err == "lab: interrupted; finished runs are in the store\n"


def test_a_predicted_baseline_is_recorded_and_reported(capsys, tmp_path):
    code, out, err = run(capsys, "baseline", "--backend", "predict", "--hardware", "cpu-demo",
                         "--out", str(tmp_path), "--experiment", "cli-baseline", "--repeats", "2",
                         "--set", "load.shape.level=2")
    assert code == 0, err
    assert f"report: {tmp_path}/cli-baseline/index.html" in out
    store = Store(tmp_path / "lab.db")
    runs = store.runs("cli-baseline")
    store.close()
    assert len(runs) == 2 and set(runs["status"]) == {"ok"} and set(runs["backend"]) == {"predict"}
    # The report rebuilds from the store alone; findings read the same runs.
    code, out, _ = run(capsys, "report", "--out", str(tmp_path))
    assert code == 0 and out == f"report: {tmp_path}/cli-baseline/index.html\n"
    code, out, _ = run(capsys, "findings", "--out", str(tmp_path), "--experiment", "cli-baseline")
    assert code == 0 and out.endswith("cli-baseline: 0 finding(s) over 2 run(s)\n")
    code, _, err = run(capsys, "findings", "--out", str(tmp_path), "--experiment", "other")
    assert code == 2 and "other" in sentence(err)


def test_a_full_disk_is_exit_74_in_one_sentence_and_leaves_no_half_file(tmp_path, capsys, monkeypatch):
    import errno
    from pathlib import Path

    import pandas as pd

    from vllm_lab.backends import PredictBackend

    def full(self, path, *args, **kwargs):
        Path(path).write_bytes(b"PAR1 half a file")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(pd.DataFrame, "to_parquet", full)
    monkeypatch.setattr(PredictBackend, "MAX_REQUESTS", 64)
    rc = cli.main(["sweep", "--backend", "predict", "--hardware", "cpu-demo", "--out", str(tmp_path),
                   "--param", "max-num-seqs", "--values", "8", "--repeats", "1", "--experiment", "full",
                   "--set", "load.shape.level=2"])
    err = capsys.readouterr().err
    assert rc == cli.EXIT_IO and err.count("\n") == 1 and "No space left on device" in err, err
    assert "that run is not recorded" in err and "Traceback" not in err
    assert not list(tmp_path.rglob("*.tmp*"))
    assert len(Store(tmp_path / "lab.db").runs("full")) == 0


def test_two_commands_in_the_same_second_get_two_experiment_ids(tmp_path, monkeypatch):
    import time

    from vllm_lab import scenarios
    from vllm_lab.commands.naming import experiment_id
    from vllm_lab.commands.settings import Settings

    monkeypatch.setattr(time, "strftime", lambda fmt, *a: "-20261201-120000")  # one second
    scenario = scenarios.resolve("default", "cpu-demo")
    settings = Settings(backend="predict", out=tmp_path)
    ids = [experiment_id(settings, "sweep", scenario, "max-num-seqs") for _ in range(3)]
    assert ids == ["sweep-default-max-num-seqs-20261201-120000",
                   "sweep-default-max-num-seqs-20261201-120000-2",
                   "sweep-default-max-num-seqs-20261201-120000-3"]

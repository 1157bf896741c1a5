"""Property: whatever the scenario document or the make variables say, the lab ends with a clean
result or one sentence and a non-zero exit: never a traceback, never a write outside OUT."""

import contextlib
import io
import os
import tempfile
from pathlib import Path
from unittest import mock

import pytest
import yaml

hypothesis = pytest.importorskip("hypothesis")  # a dev dependency (pyproject.toml)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_lab import cli
from vllm_lab.backends import PredictBackend

pytestmark = pytest.mark.usefixtures("shared_predictions")  # tests/conftest.py

# Pieces a hostile or clumsy make variable is made of: shell and make syntax, paths, numbers.
TOKENS = ["a", "x", "7", "8", "16", "-1", "0", "1e12", ".", "..", "/", "-", "_", ",", " ", "=",
          ";", "|", "&", "$", "(", ")", "`", "'", '"', "\\", "*", "#", "\n", "$(touch F)", "$(shell touch F)",
          "max-num-seqs", "load.shape.level", "serve.", "load.shape.level=", "serve.max-num-seqs=",
          "not-a-flag", "2026Q4", "default", "cpu-demo", "../../x", "/tmp/x"]
words = st.lists(st.sampled_from(TOKENS), max_size=8).map("".join)

def mostly(valid: list[str]):
    """A valid value most of the time, so runs happen too, and any hostile string the rest."""
    return st.one_of(st.sampled_from(valid), st.sampled_from(valid), words)


VARIABLES = st.fixed_dictionaries({}, optional={
    "EXPERIMENT": st.one_of(words, st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,12}", fullmatch=True)),
    "PARAM": mostly(["max-num-seqs", "load.shape.level", "max-logprobs", "not-a-flag"]),
    "VALUES": mostly(["8,16", "-1,2", "1, 2", "2", "1e12"]),
    "SET": mostly(["load.stop.duration_s=2", 'serve.served-model-name="a b"', "load.shape.level=1e12"]),
    "REPEATS": st.sampled_from(["", "1", "0", "-2", "2", "x", "1.5"]),
    "DURATION": st.sampled_from(["", "2", "0", "-1", "abc", "1e400"]),
    "GRID": mostly(["max-num-seqs=8,16 load.shape.level=1,2"]), "PARAMS": words,
    "PERIOD": mostly(["2026Q4"]), "SCENARIO": mostly(["default", "realtime-chat"]),
    "HARDWARE": st.sampled_from(["cpu-demo", "h200", "nope", "../x", "$(touch F)"]),
    "RESUME": st.sampled_from(["", "1", "0", "x"]), "LEVELS": words, "SHAPE": words, "CLAIMS": words,
})
TARGETS = st.sampled_from(["baseline", "sweep", "combo", "show", "lint", "report", "findings"])

scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**15, 10**15), st.floats(allow_nan=True),
                    st.text(max_size=12), st.sampled_from(["../../x", "auto", "closed", "open", "chat"]))
KEYS = ["serve", "workload", "load", "slo", "run", "name", "description", "vllm_version", "hardware",
        "hardware_preset", "model", "max-num-seqs", "shape", "level", "stop", "duration_s", "mode",
        "source", "ttft", "threshold_ms", "repeats", "kind", "junk"]
documents = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.sampled_from(KEYS), inner, max_size=5)),
    max_leaves=20)


def files_under(root: Path) -> set[Path]:
    return {p for p in root.rglob("*") if p.is_file()}


@contextlib.contextmanager
def sandbox():
    """A scratch tree to work in: OUT is sandbox/a/b/out and the working folder sandbox/a/b/cwd,
    so a name that climbs out of OUT still lands where the test can see it."""
    with tempfile.TemporaryDirectory(prefix="lab-property-") as tmp:
        root = Path(tmp)
        cwd = root / "a" / "b" / "cwd"
        cwd.mkdir(parents=True)
        here = os.getcwd()
        os.chdir(cwd)
        try:
            yield root, root / "a" / "b" / "out"
        finally:
            os.chdir(here)


def run_lab(argv: list[str], env: dict[str, str]) -> tuple[int, str]:
    """cli.main in this process; any exception escaping it is a traceback the user would see."""
    err = io.StringIO()
    with mock.patch.dict(os.environ, env, clear=False), contextlib.redirect_stderr(err), \
            contextlib.redirect_stdout(io.StringIO()):
        rc = cli.main(argv)
    return rc, err.getvalue()


def assert_clean_or_one_sentence(rc: int, err: str) -> None:
    if rc == 0:
        return
    assert "Traceback" not in err
    if rc == 1 and not err:
        return  # lint found errors in the scenario: its findings are the output
    lines = err.splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("lab: "), (rc, err)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(target=TARGETS, variables=VARIABLES)
def test_any_make_variables_give_a_result_or_one_sentence(target, variables):
    env = {f"LAB_MAKE_{k}": v for k, v in variables.items()}
    env.setdefault("LAB_MAKE_HARDWARE", "cpu-demo")
    env["LAB_MAKE_BACKEND"] = "predict"  # nothing is launched: no Ansible, no server
    env["LAB_MAKE_SET"] = "load.shape.level=2 " + env.get("LAB_MAKE_SET", "")
    with sandbox() as (root, out), mock.patch.object(PredictBackend, "MAX_REQUESTS", 64):
        env["LAB_MAKE_OUT"] = str(out)
        before = files_under(root)
        rc, err = run_lab(["make", target], env)
        hypothesis.event(f"{target} rc {rc}")
        assert_clean_or_one_sentence(rc, err)
        outside = {p for p in files_under(root) - before if out not in p.parents}
        assert not outside, f"written outside OUT: {outside}"
    assert not Path("/tmp/x").exists()


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(doc=documents, target=st.sampled_from(["show", "lint"]))
def test_any_scenario_document_gives_a_result_or_one_sentence(doc, target):
    with sandbox() as (root, _out):
        path = root / "scenario.yaml"
        path.write_text(yaml.safe_dump(doc))
        before = files_under(root)
        rc, err = run_lab([target, "--scenario", str(path)], {})
        assert_clean_or_one_sentence(rc, err)
        assert files_under(root) == before


# Overrides (SET=, --set) built from the schema's own paths and hostile values: what the YAML
# reader makes of each value (numbers, NaN, nesting, aliases) must end in a result or a sentence.
PATHS = ["serve.max-num-seqs", "serve.model", "serve.api-key", "serve.tensor-parallel-size",
         "load.shape.level", "load.stop.duration_s", "load.mode", "load.request_timeout_s",
         "workload.source", "workload.path", "workload.input", "slo.ttft.threshold_ms", "run.repeats",
         "run.seed", "hardware.gpus", "nope.key", "serve", "load", ""]
VALUES = ["1", "0", "-1", "1e400", ".nan", "-.inf", "null", "[]", "{}", "[1, [2, [3]]]", "&a [*a]",
          '{"dist": "fixed", "mean": 64}', "x" * 200, "../../x", "/dev/zero", "'", '"', "{", "true",
          # PyYAML's constructors' own errors: a date that is none, a tag its text cannot take,
          # integers past Python's digit limit (in decimal and in binary)
          "2001-13-45", "!!float abc", "!!int ''", "!!timestamp x", "!!bool x", "9" * 5000,
          "0b" + "1" * 20_000]
overrides = st.lists(st.tuples(st.sampled_from(PATHS), st.sampled_from(["=", "", "=="]),
                               st.one_of(st.sampled_from(VALUES), words)).map("".join), max_size=4)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(sets=overrides, target=st.sampled_from(["show", "lint"]))
def test_any_overrides_give_a_result_or_one_sentence(sets, target):
    with sandbox() as (root, _out):
        before = files_under(root)
        rc, err = run_lab([target, "--hardware", "cpu-demo", *[x for s in sets for x in ("--set", s)]], {})
        assert_clean_or_one_sentence(rc, err)
        assert files_under(root) == before  # show and lint write nothing at all


# A workload file (workload.path) as it may come: text lines, JSON of any shape, bytes that are
# no UTF-8; a sweep on the predictor reads it before anything runs.
records = st.one_of(st.dictionaries(st.sampled_from(["prompt", "output_tokens", "input_tokens", "text",
                                                     "conversations", "timestamp"]), scalars, max_size=3),
                    scalars)
workload_bytes = st.one_of(
    st.lists(records, max_size=4).map(lambda rs: "\n".join(yaml.safe_dump(r, default_flow_style=True).strip()
                                                          for r in rs).encode()),
    st.binary(max_size=64))


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(content=workload_bytes, source=st.sampled_from(["jsonl-file", "sharegpt-file"]))
def test_any_workload_file_gives_a_result_or_one_sentence(content, source):
    with sandbox() as (root, out), mock.patch.object(PredictBackend, "MAX_REQUESTS", 64):
        path = root / "prompts.jsonl"
        path.write_bytes(content)
        before = files_under(root)
        rc, err = run_lab(["sweep", "--backend", "predict", "--hardware", "cpu-demo", "--out", str(out),
                           "--param", "max-num-seqs", "--values", "8", "--repeats", "1",
                           "--set", f"workload.source={source}", "--set", f"workload.path={path}",
                           "--set", "load.shape.level=2"], {})
        assert_clean_or_one_sentence(rc, err)
        outside = {p for p in files_under(root) - before if out not in p.parents}
        assert not outside, f"written outside OUT: {outside}"


# A scenario file as typed, not as yaml.safe_dump writes it: scalars PyYAML reads as dates,
# tagged values, huge integers, under any of the schema's keys and at any line.
typed_scalars = st.sampled_from(["2001-13-45", "2001-02-29", "2001-01-01 25:00:00", "!!float abc",
                                 "!!int ''", "!!float ''", "!!timestamp x", "!!bool x",
                                 "9" * 5000, "0b" + "1" * 20_000, "1:" * 300 + "0", "!!binary '@@@'",
                                 "8", "auto", "'2001-13-45'"])


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(section=st.sampled_from(["serve", "workload", "load", "slo", "run"]),
       key=st.sampled_from(KEYS), value=typed_scalars, where=st.sampled_from(["top", "section"]))
def test_any_scalar_as_typed_gives_a_result_or_one_sentence(section, key, value, where):
    text = (f"description: {value}\n" if where == "top"
            else f"name: x\n{section}:\n  {key}: {value}\n")
    with sandbox() as (root, _out):
        path = root / "scenario.yaml"
        path.write_text(text)
        rc, err = run_lab(["show", "--hardware", "cpu-demo", "--scenario", str(path)], {})
        assert_clean_or_one_sentence(rc, err)
        if rc and "cannot be read as" in err:
            assert f"scenario.yaml line {1 if where == 'top' else 3}: cannot be read as" in err

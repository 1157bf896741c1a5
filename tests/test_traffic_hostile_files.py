"""Workload and trace files with hostile values: integers past Python's digit limit, numbers past a
float's range, token counts past any model's context, nesting past reading, a FIFO for a trace.
Each is one sentence naming the file, the line (and field where there is one) and what is allowed;
never a traceback, an OverflowError or a prompt of terabytes built before anything runs."""

from __future__ import annotations

import contextlib
import io
import os

import pytest

from vllm_lab import cli
from vllm_lab.traffic.spec import Load, Workload
from vllm_lab.traffic.traces import MAX_TOKENS, TraceError, load_trace
from vllm_lab.traffic.workloads import WorkloadError, check_workload

DIGITS = "9" * 5000     # past Python's 4300-digit limit: json cannot even read it
WIDE = "9" * 400        # an integer json reads, past any float
HUGE = "1000000000000"  # a whole number past MAX_TOKENS


@pytest.mark.parametrize("fmt, row, says", [
    ("jsonl", f'{{"timestamp": 0, "prompt_tokens": {DIGITS}, "output_tokens": 2}}',
     "line 2: a number of more than 4,300 digits; token counts are whole numbers up to 10,000,000"),
    ("jsonl", f'{{"timestamp": 0, "prompt_tokens": {WIDE}, "output_tokens": 2}}',
     ("line 2: field 'prompt_tokens': expected at most 10,000,000 tokens (past any model's context), "
     "got a number of 400 characters")),
    ("jsonl", f'{{"timestamp": 0, "prompt_tokens": 4, "output_tokens": {HUGE}}}',
     (f"line 2: field 'output_tokens': expected at most 10,000,000 tokens (past any model's context), "
     f"got {HUGE}")),
    ("jsonl", f'{{"timestamp": {WIDE}, "prompt_tokens": 4, "output_tokens": 2}}',
     "line 2: field 'timestamp': expected a finite time >= 0, got a number of 400 characters"),
    ("jsonl", '{"timestamp": 1e999, "prompt_tokens": 4, "output_tokens": 2}',
     "line 2: field 'timestamp': expected a finite time >= 0, got inf"),
    ("jsonl", '{"timestamp": 0, "prompt_tokens": NaN, "output_tokens": 2}',
     "line 2: field 'prompt_tokens': expected a whole number >= 1, got nan"),
    ("jsonl", "[" * 100_000 + "]" * 100_000, "line 2: nested too deeply to read"),
    ("mooncake", f'{{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [{DIGITS}]}}',
     "line 2: a number of more than 4,300 digits"),
    ("burstgpt", f"{DIGITS},ChatGPT,4,4", ("line 3: field 'Timestamp': expected a finite time >= 0, "
                                          "got a number of 5,000 characters")),
    ("burstgpt", f"1.5,ChatGPT,{HUGE}0000000000,4", ("line 3: field 'Request tokens': expected at most "
                                                     "10,000,000 tokens")),
    ("azure", f"2023-11-16 18:15:46.1,4,{WIDE}", ("line 3: field 'GeneratedTokens': expected at most "
                                                 "10,000,000 tokens")),
])
def test_a_hostile_value_in_a_trace_is_one_sentence_naming_file_line_and_whats_allowed(tmp_path, fmt, row, says):
    header, good = {
        "jsonl": ("", '{"timestamp": 0, "prompt_tokens": 4, "output_tokens": 2}'),
        "mooncake": ("", '{"timestamp": 0, "input_length": 10, "output_length": 2}'),
        "burstgpt": ("Timestamp,Model,Request tokens,Response tokens\n", "1.0,ChatGPT,4,4"),
        "azure": ("TIMESTAMP,ContextTokens,GeneratedTokens\n", "2023-11-16 18:15:46.0,4,2"),
    }[fmt]
    path = tmp_path / f"trace.{'csv' if header else 'jsonl'}"
    path.write_text(f"{header}{good}\n{row}\n")
    with pytest.raises(TraceError) as e:
        load_trace(path, fmt)
    message = str(e.value)
    assert message.startswith(f"{path}: ") and says in message, message
    assert "\n" not in message and "sys.set_int_max_str_digits" not in message


def test_a_trace_at_the_token_bound_is_read(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(f'{{"timestamp": 0, "prompt_tokens": {MAX_TOKENS}, "output_tokens": 1}}\n')
    assert load_trace(path, "jsonl").requests[0].prompt_tokens == MAX_TOKENS


def test_a_trace_that_is_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path):
    path = tmp_path / "t.jsonl"
    os.mkfifo(path)
    with pytest.raises(TraceError, match=f"workload.path: {path} is not a regular file"):
        load_trace(path, "jsonl")


@pytest.mark.parametrize("line, says", [
    (f'{{"prompt": "hi", "output_tokens": {DIGITS}}}',
     ("line 2: a number of more than 4,300 digits; each line is an object with a 'prompt' (text) and "
     "an optional 'output_tokens' (a whole number from 1 to 10,000,000)")),
    (f'{{"prompt": "hi", "output_tokens": {WIDE}}}',
     ("line 2: 'output_tokens' must be a whole number from 1 to 10,000,000 (past any model's context), "
     "not a number of about 400 digits")),
    (f'{{"prompt": "hi", "output_tokens": {HUGE}}}',
     (f"line 2: 'output_tokens' must be a whole number from 1 to 10,000,000 (past any model's context), "
     f"not {HUGE}")),
    ('{"prompt": "hi", "output_tokens": 1e400}', "line 2: 'output_tokens' must be a whole number"),
    ("[" * 100_000, "line 2: nested too deeply to read"),
    ('{"prompt": "hi", ', "line 2: not JSON (Expecting property name enclosed in double quotes"),
])
def test_a_hostile_value_in_a_jsonl_prompt_file_is_one_sentence(tmp_path, line, says):
    path = tmp_path / "prompts.jsonl"
    path.write_text(f'{{"prompt": "hello", "output_tokens": 4}}\n{line}\n')
    with pytest.raises(WorkloadError) as e:
        check_workload(Workload(source="jsonl-file", path=path))
    message = str(e.value)
    assert message.startswith(f"workload.path: {path} ") and says in message, message
    assert "\n" not in message and "sys.set_int_max_str_digits" not in message


def test_a_sharegpt_file_with_an_integer_past_the_digit_limit_is_one_sentence(tmp_path):
    path = tmp_path / "share.json"
    path.write_text(f'[{{"conversations": [{{"value": "hi"}}, {{"value": {DIGITS}}}]}}]')
    with pytest.raises(WorkloadError) as e:
        check_workload(Workload(source="sharegpt-file", path=path))
    assert str(e.value) == (f"workload.path: {path}: not a ShareGPT JSON file (a number of more than "
                            f"4,300 digits); it is a JSON list of conversations of text turns")


def test_a_trace_of_a_huge_prompt_is_refused_before_any_prompt_is_built(tmp_path):
    """The load generators build each prompt: a trillion tokens would be terabytes of text."""
    path = tmp_path / "t.jsonl"
    path.write_text(f'{{"timestamp": 0, "prompt_tokens": {HUGE}, "output_tokens": 2}}\n')
    with pytest.raises(TraceError, match="expected at most 10,000,000 tokens"):
        check_workload(Workload(source="trace", trace_format="jsonl", path=path), Load(mode="replay"))


@pytest.mark.parametrize("value", [DIGITS, WIDE, HUGE])
def test_the_lab_ends_on_a_hostile_trace_with_one_sentence_and_exit_2(tmp_path, value):
    """`make sweep` on the predictor, as a user would run it: one line naming file and line, rc 2."""
    path = tmp_path / "trace.jsonl"
    path.write_text(f'{{"timestamp": 0, "prompt_tokens": 4, "output_tokens": 2}}\n'
                    f'{{"timestamp": 1, "prompt_tokens": {value}, "output_tokens": 2}}\n')
    out, err = tmp_path / "out", io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = cli.main(["sweep", "--backend", "predict", "--hardware", "cpu-demo", "--out", str(out),
                       "--param", "max-num-seqs", "--values", "8", "--set", "workload.source=trace",
                       "--set", "workload.trace_format=jsonl", "--set", f"workload.path={path}",
                       "--set", "load.mode=replay"])
    lines = err.getvalue().splitlines()
    assert rc == 2 and len(lines) == 1, err.getvalue()
    assert lines[0].startswith(f"lab: {path}: line 2: ") and "Traceback" not in lines[0], lines


@pytest.mark.parametrize("override", ["workload.input={dist: fixed, mean: 1e12}",
                                      "workload.output.max=99999999999999",
                                      "workload.input={dist: lognormal, mean: 100, std: 1e300}"])
def test_lengths_past_any_context_in_a_scenario_are_one_sentence_before_anything_runs(override, capsys):
    """The bound a file's token counts have holds for a scenario's length distributions too."""
    rc = cli.main(["show", "--scenario", "default", "--set", override])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert f"less than or equal to {MAX_TOKENS}" in err and override.split("=")[0] in err

"""Bounded input (vllm_lab/inputs.py): what a user hands the lab is a regular UTF-8 file of bounded
size, YAML or JSON that cannot expand or nest without bound; each refusal is one sentence."""

import os

import pytest

from vllm_lab import inputs


def test_only_a_regular_file_of_bounded_size_is_read(tmp_path):
    with pytest.raises(inputs.InputError, match="no such scenario"):
        inputs.read_text(tmp_path / "nope.yaml", what="scenario")
    with pytest.raises(inputs.InputError, match="a device; the file must be a regular file"):
        inputs.read_bytes("/dev/zero")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(inputs.InputError, match="a FIFO"):  # refused at once, no writer awaited
        inputs.read_bytes(fifo)
    with pytest.raises(inputs.InputError, match="a folder"):
        inputs.read_bytes(tmp_path)
    big = tmp_path / "big"
    big.write_bytes(b"x" * 2048)
    with pytest.raises(inputs.InputError, match="may hold at most"):
        inputs.read_bytes(big, limit=1024)


def test_text_that_is_no_utf8_names_its_line(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_bytes(b"name: a\nmodel: \xff\n")
    with pytest.raises(inputs.InputError, match=r"line 2: not UTF-8 text \(byte 0xff\)"):
        inputs.read_text(path)


def test_aliases_cannot_expand_without_bound():
    bomb = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{c}: &{c} [*{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}]\n"
        for p, c in zip("abcdefgh", "bcdefghi"))
    with pytest.raises(inputs.InputError, match="more than 200,000 values once its aliases"):
        inputs.load_yaml(bomb, "bomb.yaml")
    with pytest.raises(inputs.InputError, match="nested"):
        inputs.load_yaml("[" * 100 + "]" * 100, "deep.yaml")
    with pytest.raises(inputs.InputError, match="nested too deeply"):
        inputs.load_json("[" * 100_000 + "]" * 100_000, "deep.json")
    assert inputs.load_yaml("a: &a [1, 2]\nb: *a\n", "ok.yaml") == {"a": [1, 2], "b": [1, 2]}


def test_values_in_sentences_are_cut_and_secrets_hidden():
    assert inputs.shown("x" * 500).endswith("…") and len(inputs.shown("x" * 500)) == inputs.SHOWN_CHARS
    assert inputs.shown("s3cret", key="serve.api-key") == "***"


@pytest.mark.parametrize("text, kind", [
    ("description: 2001-13-45\n", "timestamp"),      # PyYAML's timestamp constructor: ValueError
    ("a: 1\nb: !!float abc\n", "float"),
    ("a: 1\nb: !!int ''\n", "int"),                  # IndexError
    ("a: 1\nb: !!timestamp x\n", "timestamp"),        # AttributeError
    ("a: 1\nb: !!bool x\n", "bool"),                 # KeyError
    ("a: 1\nb: " + "9" * 10_000 + "\n", "int"),      # past Python's digit limit
    ("a: 1\nb: 0b" + "1" * 20_000 + "\n", "int"),    # read in binary, never printable
])
def test_a_value_its_tag_cannot_take_is_one_sentence_naming_the_line(text, kind):
    with pytest.raises(inputs.InputError) as e:
        inputs.load_yaml(text, "s.yaml")
    line = text.count("\n", 0, text.rindex(":")) + 1
    assert str(e.value).startswith(f"s.yaml line {line}: cannot be read as {kind}")
    assert "\n" not in str(e.value) and "sys." not in str(e.value)
    with pytest.raises(inputs.InputError, match=r"^override x: cannot be read as"):
        inputs.load_yaml(text.splitlines()[-1].split(": ", 1)[1], "override x", lines=False)


def test_a_constructor_error_never_shows_the_value():
    with pytest.raises(inputs.InputError) as e:
        inputs.load_yaml("api-key: !!float sk-LEAKED-123\n", "s.yaml")
    assert "LEAKED" not in str(e.value)


def test_values_in_sentences_hide_secrets_by_each_nested_key_and_urls_userinfo():
    shown = inputs.shown({"model": "", "api-key": "sk-LEAKED-123", "x": [{"hf-token": "hf_LEAKED"}],
                          "url": "postgresql://u:s3cret@PW@db:5432/x"}, key="serve", chars=1000)
    assert "LEAKED" not in shown and "s3cret" not in shown and "PW@" not in shown
    assert "'api-key': '***'" in shown and "postgresql://***@db:5432/x" in shown

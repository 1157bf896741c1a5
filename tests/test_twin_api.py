"""The twin's OpenAI API as vLLM 0.26 serves it, checked with the `openai` client against a real
twin process: completions and chat, streamed and not, usage, finish reasons, refusals, tokenizer
routes. The server is started in its own process group and stopped by its id."""

from __future__ import annotations

import json
import shutil
import urllib.error
import urllib.request

import openai
import pytest

from tests.support.processes import TwinProcess
from tests.test_twin_server import _model_folder, _profile

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("twin-api")
    return _model_folder(tmp), _profile(tmp)


@pytest.fixture(scope="module")
def twin(env):
    model, profile = env
    server = TwinProcess(model.parent, model=str(model), profile=profile, startup_s=0.3,
                         health_timeout_s=30)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(twin):
    return openai.OpenAI(base_url=twin.url + "/v1", api_key="unused", max_retries=0)


def _post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_completion_usage_and_finish_reasons(client, twin):
    """A reply cut by max_tokens ends with "length"; one that stopped sooner with "stop"."""
    reasons = []
    for i in range(30):
        r = client.completions.create(model=twin.model, prompt=f"request number {i} of the test",
                                      max_tokens=24)
        choice = r.choices[0]
        assert r.usage.completion_tokens == len(choice.text.split())
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
        if r.usage.completion_tokens < 24:
            assert choice.finish_reason == "stop"
        else:
            assert choice.finish_reason == "length"
        reasons.append(choice.finish_reason)
    assert reasons.count("length") >= 20  # replies run ~200 tokens: most are cut at 24
    # /metrics counts finish reasons the same way (this test runs first on its server).
    text = urllib.request.urlopen(twin.url + "/metrics").read().decode()
    counts = {}
    for line in text.splitlines():
        if line.startswith("vllm:request_success_total{"):
            reason = line.split('finished_reason="')[1].split('"')[0]
            counts[reason] = float(line.rsplit(" ", 1)[1])
    assert counts.get("length", 0) == reasons.count("length")
    assert counts.get("stop", 0) == reasons.count("stop")


def test_ignore_eos_always_runs_to_length(client, twin):
    r = client.completions.create(model=twin.model, prompt="x", max_tokens=5,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 5


def test_chat_streamed_and_not(client, twin):
    messages = [{"role": "user", "content": "Say something."}]
    full = client.chat.completions.create(model=twin.model, messages=messages, max_tokens=12)
    assert full.object == "chat.completion"
    assert full.choices[0].message.role == "assistant"
    assert full.choices[0].finish_reason in ("stop", "length")
    chunks = list(client.chat.completions.create(
        model=twin.model, messages=messages, max_tokens=12, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.prompt_tokens == full.usage.prompt_tokens
    assert usage.completion_tokens == len(text.split())
    assert finish == ["length" if usage.completion_tokens == 12 else "stop"]


def test_completion_stream_and_logprobs(client, twin):
    stream = client.completions.create(model=twin.model, prompt="hello", max_tokens=6, stream=True,
                                       logprobs=2, extra_body={"ignore_eos": True})
    chunks = [c for c in stream]
    tokens = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert len(tokens) == 6 and chunks[-1].choices[0].finish_reason == "length"
    full = client.completions.create(model=twin.model, prompt="hello", max_tokens=4, logprobs=3,
                                     echo=True, extra_body={"ignore_eos": True})
    lp = full.choices[0].logprobs
    assert full.choices[0].text.startswith("hello")
    assert lp.token_logprobs[0] is None and all(v < 0 for v in lp.token_logprobs[1:])
    assert len(lp.tokens) == len(lp.text_offset) == full.usage.prompt_tokens + 4
    assert all(len(t) == 3 for t in lp.top_logprobs[1:])
    chat = client.chat.completions.create(
        model=twin.model, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
        logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 2 for c in content)


def test_n_and_prompt_lists(client, twin):
    r = client.completions.create(model=twin.model, prompt=["one prompt", "another prompt here"],
                                  max_tokens=5, n=2, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.usage.completion_tokens == 20
    chat = client.chat.completions.create(
        model=twin.model, messages=[{"role": "user", "content": "hi"}], max_tokens=4, n=3,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    seen: dict[int, str] = {}
    usage = None
    for c in chat:
        for ch in c.choices:
            seen[ch.index] = seen.get(ch.index, "") + (ch.delta.content or "")
        usage = c.usage or usage
    assert sorted(seen) == [0, 1, 2] and usage.completion_tokens == 12


@pytest.mark.parametrize("kwargs, param, words", [
    ({"temperature": -1}, "temperature", "temperature must be non-negative"),
    ({"top_p": 2}, "top_p", "top_p must be in (0, 1]"),
    ({"extra_body": {"priority": "high"}}, "priority", "priority must be an integer"),
    ({"stream_options": {"include_usage": True}}, "stream_options",
     "Stream options can only be defined when `stream=True`"),
])
def test_bad_sampling_is_400_in_vllm_shape(client, twin, kwargs, param, words):
    for call in (lambda: client.completions.create(model=twin.model, prompt="x", max_tokens=2,
                                                   **kwargs),
                 lambda: client.chat.completions.create(
                     model=twin.model, messages=[{"role": "user", "content": "x"}], max_tokens=2,
                     **kwargs)):
        with pytest.raises(openai.BadRequestError) as err:
            call()
        assert err.value.status_code == 400
        body = err.value.body
        assert set(body) == {"message", "type", "param", "code"}
        assert body["param"] == param and body["code"] == 400 and words in body["message"]


def test_unknown_path_is_fastapi_404(twin):
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(twin.url + "/v1/no-such-route")
    assert err.value.code == 404 and json.loads(err.value.read()) == {"detail": "Not Found"}


def test_tokenize_and_detokenize(twin, env):
    from tokenizers import Tokenizer

    prompt = "def tokenize(prompt): return the ids"
    expected = Tokenizer.from_file(str(env[0] / "tokenizer.json")).encode(prompt).ids
    status, body = _post(twin.url + "/tokenize", {"model": twin.model, "prompt": prompt})
    assert status == 200 and body["tokens"] == expected and body["count"] == len(expected)
    assert body["max_model_len"] == 2048 and body["token_strs"] is None
    status, back = _post(twin.url + "/detokenize", {"model": twin.model, "tokens": expected})
    assert status == 200 and back["prompt"].endswith(prompt)
    status, chat = _post(twin.url + "/tokenize",
                         {"messages": [{"role": "user", "content": "hi"}]})
    assert status == 200 and chat["count"] > 3
    status, bad = _post(twin.url + "/detokenize", {"tokens": ["x"]})
    assert status == 400 and bad["error"]["param"] == "tokens"


def test_cancelled_stream_leaves_no_traceback(client, twin):
    for n in (1, 3):
        stream = client.completions.create(model=twin.model, prompt="long", max_tokens=500, n=n,
                                           stream=True, extra_body={"ignore_eos": True})
        next(iter(stream))
        stream.close()  # the client goes away after the first event
    # The server still answers, and said nothing about the disconnect.
    status, _body = _post(twin.url + "/v1/completions",
                          {"model": twin.model, "prompt": "after", "max_tokens": 2})
    assert status == 200
    assert "Traceback" not in twin.output() and "Error handling request" not in twin.output()


def test_tokenizer_flag_is_used(env, tmp_path):
    """--tokenizer FOLDER counts prompts with that folder's tokenizer.json, as vLLM does."""
    from tokenizers import Tokenizer

    model, profile = env
    bare = tmp_path / "bare-model"
    bare.mkdir()
    shutil.copy(model / "config.json", bare / "config.json")
    server = TwinProcess(tmp_path, "--tokenizer", str(model), model=str(bare), profile=profile,
                         startup_s=0.2, health_timeout_s=30)
    try:
        prompt = "def tokenizer_flag(): count the prompt"
        expected = len(Tokenizer.from_file(str(model / "tokenizer.json")).encode(prompt).ids)
        status, body = _post(server.url + "/v1/completions",
                             {"model": str(bare), "prompt": prompt, "max_tokens": 1})
        assert status == 200 and body["usage"]["prompt_tokens"] == expected
    finally:
        server.stop()

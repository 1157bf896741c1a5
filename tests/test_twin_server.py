"""The twin's server, started as `vllm serve` would be: API shapes, errors, metrics, refusals."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.support.processes import TwinProcess

pytestmark = pytest.mark.integration

MAX_LEN = 2048
SERVE = [sys.executable, "-m", "vllm_lab.twin.server", "serve"]


def _profile(tmp: Path) -> str:
    """`cpu-demo` when helper profiles ship it, else a small H200-like profile file."""
    from vllm_lab.twin.profile import available_profiles

    if "cpu-demo" in available_profiles():
        return "cpu-demo"
    path = tmp / "test-profile.yaml"
    path.write_text(
        "name: test\nhardware: {name: NVIDIA H200, memory_gib: 139.8, bandwidth_gbs: 4800,\n"
        "  tflops: {bf16: 989, fp16: 989, fp32: 67, fp8: 1979}, gpu_count: 8}\n"
        "model: smollm-135m\ncoefficients: {gemm_efficiency: 0.5, attention_efficiency: 0.4,\n"
        "  bandwidth_efficiency: 0.7, step_overhead_s: 0.01, seq_overhead_s: 0.0001,\n"
        "  eager_layer_overhead_s: 0.0001, frontend_latency_s: 0.002,\n"
        "  cuda_graph_memory_gib: 1.0, non_torch_memory_gib: 1.5}\n")
    return str(path)


def _model_folder(tmp: Path) -> Path:
    """A model folder with config.json, a small BPE tokenizer.json and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from vllm_lab.models import KNOWN_SHAPES

    out = tmp / "model"
    out.mkdir()
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    text = [Path(__file__).read_text()] * 3
    tok.train_from_iterator(text, trainers.BpeTrainer(
        vocab_size=600, special_tokens=special, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(out / "tokenizer.json"))
    template = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}"
                "<|end_header_id|>\n\n{{ m['content'] }}<|eot_id|>{% endfor %}"
                "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
                "{% endif %}")
    (out / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "chat_template": template}))
    cfg = KNOWN_SHAPES["smollm-135m"].to_config()
    cfg["max_position_embeddings"] = MAX_LEN
    (out / "config.json").write_text(json.dumps(cfg))
    return out



def start_twin(model: Path, profile: str, *extra: str) -> TwinProcess:
    """A twin serving ``model`` with ``profile``, its log beside the model folder."""
    return TwinProcess(model.parent, *extra, model=str(model), profile=profile, startup_s=0.5,
                       health_timeout_s=30)


def _post(url: str, body: dict, headers: dict | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("twin")
    return _model_folder(tmp), _profile(tmp)


@pytest.fixture(scope="module")
def twin(env):
    server = start_twin(*env)
    yield server
    server.stop()


def test_health_version_and_models(twin):
    assert urllib.request.urlopen(twin.url + "/health").status == 200
    assert json.load(urllib.request.urlopen(twin.url + "/version")) == {"version": "0.26.0"}
    models = json.load(urllib.request.urlopen(twin.url + "/v1/models"))
    assert models["object"] == "list"
    card = models["data"][0]
    assert card["id"] == twin.model and card["owned_by"] == "vllm"
    assert card["max_model_len"] == MAX_LEN
    log = twin.output()
    assert "GPU KV cache size:" in log and "Maximum concurrency for 2,048 tokens" in log
    assert "Starting vLLM server on http://127.0.0.1:" in log


def test_completion_usage_matches_the_folder_tokenizer(twin, env):
    from tokenizers import Tokenizer

    prompt = "def test_completion_usage(twin): return the usage of the prompt"
    expected = len(Tokenizer.from_file(str(env[0] / "tokenizer.json")).encode(prompt).ids)
    status, raw = _post(twin.url + "/v1/completions",
                        {"model": twin.model, "prompt": prompt, "max_tokens": 7,
                         "ignore_eos": True})
    assert status == 200, raw
    body = json.loads(raw)
    assert body["object"] == "text_completion"
    assert body["usage"] == {"prompt_tokens": expected, "total_tokens": expected + 7,
                             "completion_tokens": 7, "prompt_tokens_details": None}
    assert body["choices"][0]["finish_reason"] == "length"
    assert len(body["choices"][0]["text"].split()) == 7


def test_streaming_with_usage_and_done(twin):
    status, raw = _post(twin.url + "/v1/completions", {
        "model": twin.model, "prompt": "hello there", "max_tokens": 5, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True}})
    assert status == 200
    events = [e for e in raw.decode().split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 5
    text = "".join(c["choices"][0]["text"] for c in chunks[:-1])
    assert len(text.split()) == 5
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"


def test_min_tokens_and_eos(twin):
    # Without ignore_eos the simulated model stops on its own, but never before min_tokens.
    status, raw = _post(twin.url + "/v1/completions", {
        "model": twin.model, "prompt": "a b c", "max_tokens": 400, "min_tokens": 300})
    body = json.loads(raw)
    assert status == 200
    assert 300 <= body["usage"]["completion_tokens"] <= 400


def test_too_long_prompt_is_refused_as_vllm_does(twin):
    status, raw = _post(twin.url + "/v1/completions", {
        "model": twin.model, "prompt": list(range(5, 2005)), "max_tokens": 100})
    assert status == 400
    err = json.loads(raw)["error"]
    assert err["type"] == "BadRequestError" and err["code"] == 400
    assert err["message"].startswith(
        "This model's maximum context length is 2048 tokens. However, you requested 100 output "
        "tokens and your prompt contains 2000 input tokens, for a total of 2100 tokens.")


def test_unknown_model_is_404(twin):
    status, raw = _post(twin.url + "/v1/completions", {"model": "nope", "prompt": "x"})
    assert status == 404
    assert json.loads(raw)["error"] == {"message": "The model `nope` does not exist.",
                                        "type": "NotFoundError", "param": "model", "code": 404}


def test_openai_client_unchanged(twin):
    import openai

    client = openai.OpenAI(base_url=twin.url + "/v1", api_key="EMPTY")
    done = client.completions.create(model=twin.model, prompt="hi", max_tokens=4,
                                     extra_body={"ignore_eos": True})
    assert done.usage.completion_tokens == 4
    stream = client.chat.completions.create(
        model=twin.model, messages=[{"role": "user", "content": "hello"}], max_tokens=6,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(content.split()) == 6
    assert chunks[-1].usage.completion_tokens == 6
    full = client.chat.completions.create(
        model=twin.model, messages=[{"role": "user", "content": "hello"}], max_tokens=3,
        extra_body={"ignore_eos": True})
    assert full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 3


def test_metrics_parse_with_vllm_names_and_types(twin):
    from prometheus_client.parser import text_string_to_metric_families

    _post(twin.url + "/v1/completions", {"model": twin.model, "prompt": "warm", "max_tokens": 3})
    text = urllib.request.urlopen(twin.url + "/metrics").read().decode()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    expected = {
        "vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge",
        "vllm:kv_cache_usage_perc": "gauge", "vllm:num_preemptions": "counter",
        "vllm:prompt_tokens": "counter", "vllm:generation_tokens": "counter",
        "vllm:time_to_first_token_seconds": "histogram",
        "vllm:inter_token_latency_seconds": "histogram",
        "vllm:e2e_request_latency_seconds": "histogram",
        "vllm:request_queue_time_seconds": "histogram", "vllm:request_success": "counter",
        "vllm:prefix_cache_queries": "counter", "vllm:prefix_cache_hits": "counter",
        "vllm:cache_config_info": "gauge", "DCGM_FI_DEV_GPU_UTIL": "gauge",
        "DCGM_FI_DEV_FB_USED": "gauge", "DCGM_FI_DEV_FB_FREE": "gauge",
        "DCGM_FI_DEV_POWER_USAGE": "gauge", "twin:event_loop_lag_seconds": "histogram",
        "twin:coalesced_tokens": "counter",
    }
    for name, kind in expected.items():
        assert name in fams, name
        assert fams[name].type == kind, name
    ttft = fams["vllm:time_to_first_token_seconds"]
    les = [s.labels["le"] for s in ttft.samples if s.name.endswith("_bucket")]
    assert les[:3] == ["0.001", "0.005", "0.01"] and les[-2:] == ["2560.0", "+Inf"]
    assert ttft.samples[0].labels["model_name"] == twin.model
    assert ttft.samples[0].labels["engine"] == "0"
    info = fams["vllm:cache_config_info"].samples[0].labels
    assert {"block_size", "num_gpu_blocks", "gpu_memory_utilization"} <= set(info)
    gpu = fams["DCGM_FI_DEV_FB_USED"].samples[0].labels
    assert {"gpu", "UUID", "modelName"} <= set(gpu)
    gen = fams["vllm:generation_tokens"].samples[0].value
    assert gen >= 3


def test_ground_truth_and_reset_prefix_cache(twin):
    status, _ = _post(twin.url + "/reset_prefix_cache", {})
    assert status == 200
    truth = json.load(urllib.request.urlopen(twin.url + "/twin/ground_truth"))
    assert truth["requests"] and {"ttft_s", "tpot_s", "id"} <= set(truth["requests"][0])
    assert "p99" in truth["lag_s"]


def test_api_key_guards_v1(env):
    server = start_twin(*env, "--api-key", "sekret")
    try:
        status, raw = _post(server.url + "/v1/completions", {"prompt": "x", "max_tokens": 2})
        assert status == 401 and json.loads(raw) == {"error": "Unauthorized"}
        status, _ = _post(server.url + "/v1/completions", {"prompt": "x", "max_tokens": 2},
                          {"Authorization": "Bearer sekret"})
        assert status == 200
        assert urllib.request.urlopen(server.url + "/health").status == 200
    finally:
        server.stop()


def test_the_scenario_hardware_reaches_the_twin_through_its_environment(env, monkeypatch):
    """The lab starts a twin with the scenario's GPU (VLLM_TWIN_HARDWARE, the one schema's JSON):
    the twin simulates that GPU, and says so in its DCGM series."""
    from vllm_lab import scenarios

    preset = scenarios.resolve("default", "a100-80g").hardware
    for key, value in preset.environment().items():
        monkeypatch.setenv(key, value)
    server = start_twin(*env)
    try:
        text = urllib.request.urlopen(server.url + "/metrics").read().decode()
        assert f'modelName="{preset.name}"' in text
    finally:
        server.stop()


@pytest.mark.parametrize(("flags", "words"), [
    (["--swap-space", "4"], "unrecognized arguments: --swap-space"),
    (["--dtype", "int3"], "argument --dtype: invalid choice: 'int3'"),
    (["--max-num-seqs", "many"], "argument --max-num-seqs: invalid int value: 'many'"),
    (["--gpu-memory-utilization", "1.5"], "Input should be less than or equal to 1"),
    (["--max-num-partial-prefills", "2", "--twin-startup-seconds", "0"],
     "Concurrent Partial Prefill is not supported"),
])
def test_refused_flags_exit_nonzero_with_vllm_wording(env, flags, words):
    run = subprocess.run([*SERVE, str(env[0]), "--twin-profile", env[1], *flags],
                         check=False, capture_output=True, text=True, timeout=30)
    assert run.returncode != 0
    assert words in run.stderr


def test_engine_start_failure_prints_vllm_lines(env, tmp_path):
    run = subprocess.run([*SERVE, str(env[0]), "--twin-profile", env[1],
                          "--gpu-memory-utilization", "0.01", "--twin-startup-seconds", "0"],
                         check=False, capture_output=True, text=True, timeout=30)
    assert run.returncode != 0
    assert "EngineCore failed to start." in run.stderr
    assert "Engine core initialization failed" in run.stderr


def test_config_file_and_cli_precedence(env, tmp_path):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(f"model: {env[0]}\nmax-num-seqs: 8\nswap_space: 4\n")
    run = subprocess.run([*SERVE, "--config", str(cfg), "--twin-profile", env[1]],
                         check=False, capture_output=True, text=True, timeout=30)
    assert run.returncode != 0 and "unrecognized arguments: --swap-space" in run.stderr
    from vllm_lab.twin.server import parse_serve_args

    cfg.write_text(f"model: {env[0]}\nmax-num-seqs: 8\nblock-size: 32\n")
    args = parse_serve_args(["serve", "--config", str(cfg), "--max-num-seqs", "4"])
    assert args.model == str(env[0])
    assert args.flags["max-num-seqs"] == 4 and args.flags["block-size"] == 32


def test_release_hands_first_tokens_out_first_and_keeps_token_order():
    """A step's first tokens are handed out (and written) before the rest of the step, and a
    deferred rest is handed out before the next step: each request's tokens stay in order."""
    import asyncio
    from types import SimpleNamespace as NS

    from vllm_lab.twin import server as srv

    metric = NS(observe=lambda *a: None)
    metrics = NS(ttft=metric, itl=metric, observe_finished=lambda *a, **k: None)
    engine = NS(profile=NS(coefficients=NS(frontend_token_s=0.0)))

    def out(rid, toks):
        return NS(request_id=rid, new_token_ids=toks, finished=False, finish_reason=None,
                  num_cached_tokens=0)

    async def main():
        loop = srv.EngineLoop(engine, metrics)
        reqs = {rid: srv._Req(rid=rid, arrival=0.0, prompt_ids=[1], max_tokens=8, min_tokens=0,
                              ignore_eos=True, eos_after=None) for rid in ("old", "new")}
        reqs["old"].first_plan = reqs["old"].last_plan = 0.5  # already streaming
        loop.reqs = dict(reqs)
        woken = []

        async def handler(r):
            await r.event.wait()
            woken.append(r.rid)

        tasks = [asyncio.create_task(handler(r)) for r in reqs.values()]
        await asyncio.sleep(0)
        loop._release(NS(outputs=[out("old", [7]), out("new", [9])]), 1.0, 1.1)
        assert reqs["new"].pending == [9] and reqs["old"].pending == []
        loop._release(NS(outputs=[out("old", [8])]), 1.1, 1.2)
        assert reqs["old"].pending == [7, 8] and reqs["old"].n_out == 2
        await asyncio.gather(*tasks)
        assert woken == ["new", "old"]

    asyncio.run(main())


def test_the_priority_policy_lets_urgent_requests_pass_the_queue(env, tmp_path):
    """Locust sends a workload's priorities; --scheduling-policy priority admits the smaller one
    first when the batch is full (8 users against 2 sequences), fcfs in arrival order."""
    from vllm_lab.traffic.runner import run_load
    from vllm_lab.traffic.spec import Lengths, Load, Workload

    w = Workload(source="synthetic", input=Lengths(mean=20), output=Lengths(mean=40),
                 priorities={-1: 0.3, 0: 0.7})
    medians = {}
    for policy in ("fcfs", "priority"):
        server = start_twin(*env, "--scheduling-policy", policy, "--max-num-seqs", "2")
        try:
            r = run_load(server.url, server.model, w, Load(mode="closed", shape={"level": 8},
                                                           stop={"duration_s": 4}),
                         tmp_path / policy, scrape_metrics=False)
        finally:
            server.stop()
        ok = r.samples[r.samples.status == "ok"]
        assert set(ok.priority) == {-1, 0}
        medians[policy] = {p: ok[ok.priority == p].ttft_s.median() for p in (-1, 0)}
    assert medians["priority"][-1] < 0.5 * medians["priority"][0]
    assert medians["fcfs"][-1] > 0.5 * medians["fcfs"][0]

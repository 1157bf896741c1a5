"""Workloads, specs, arrivals, shapes, samples and scraping: pure functions, no processes."""

import glob
import json
import sysconfig
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from pydantic import ValidationError
from scipy import stats

from vllm_lab.traffic import samples
from vllm_lab.traffic.arrivals import client_overloaded, interarrival_gaps, schedule
from vllm_lab.traffic.scrape import parse_metrics
from vllm_lab.traffic.shapes import level_at, saturated
from vllm_lab.traffic.spec import Lengths, Load, Shape, Workload
from vllm_lab.traffic.workloads import WorkloadGenerator, sample_lengths

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """A real byte-level BPE tokenizer.json trained on the standard library's sources."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    files = sorted(glob.glob(sysconfig.get_paths()["stdlib"] + "/*.py"))[:150]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=6000, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    texts = (Path(f).read_text(encoding="utf-8", errors="ignore") for f in files)
    tok.train_from_iterator(texts, trainer)
    d = tmp_path_factory.mktemp("model")
    tok.save(str(d / "tokenizer.json"))
    return d


def test_spec_is_strict_with_defaults():
    assert Workload().source == "sharegpt-like" and Load().mode == "closed"
    with pytest.raises(ValidationError, match="extra"):
        Workload(sourse="alpaca-like")
    with pytest.raises(ValidationError, match="path"):
        Workload(source="jsonl-file")
    with pytest.raises(ValidationError, match="api: chat"):
        Workload(turns=3)
    with pytest.raises(ValidationError):
        Lengths(dist="normal", mean=10)  # a normal needs a spread
    with pytest.raises(ValidationError):
        Load(mode="opne")


def test_lab_scenarios_validate():
    import yaml

    # Anchored to the checkout, not the working directory: run from elsewhere it must still check.
    paths = sorted((REPO / "scenarios").glob("*.yaml")) + sorted((REPO / "scenarios/guide").glob("*.yaml"))
    assert len(paths) >= 4, f"no scenario files found under {REPO / 'scenarios'}"
    checked = 0
    for path in paths:
        doc = yaml.safe_load(path.read_text())
        if "workload" in doc:
            Workload.model_validate(doc["workload"])
            checked += 1
        if "load" in doc:
            Load.model_validate(doc["load"])
    assert checked >= 4  # the shipped scenarios and the guide's each say their traffic


@pytest.mark.parametrize(("preset", "mean_in", "mean_out"),
                         [("sharegpt-like", 161, 338), ("alpaca-like", 19.3, 58.5)])
def test_presets_match_paper_means(preset, mean_in, mean_out):
    ins, outs = Workload(source=preset).lengths()
    rng = np.random.default_rng(0)
    assert sample_lengths(ins, rng, 200_000).mean() == pytest.approx(mean_in, rel=0.03)
    assert sample_lengths(outs, rng, 200_000).mean() == pytest.approx(mean_out, rel=0.03)


def test_length_distributions_respect_bounds():
    rng = np.random.default_rng(1)
    u = sample_lengths(Lengths(dist="uniform", min=10, max=20), rng, 10_000)
    assert u.min() == 10 and u.max() == 20
    n = sample_lengths(Lengths(dist="normal", mean=100, std=10, min=1, max=1000), rng, 10_000)
    assert n.mean() == pytest.approx(100, rel=0.01) and n.std() == pytest.approx(10, rel=0.05)
    assert set(sample_lengths(Lengths(mean=7), rng, 5)) == {7}


def test_same_seed_same_requests_whatever_the_order_or_worker():
    w = Workload(source="sharegpt-like")
    a, b, c = WorkloadGenerator(w, 42), WorkloadGenerator(w, 42), WorkloadGenerator(w, 43)
    seq_a = [a.request(i) for i in range(20)]
    # Another worker asking for the same indices in another order gets the same requests.
    seq_b = {i: b.request(i) for i in reversed(range(20))}
    assert all(seq_a[i].turns == seq_b[i].turns for i in range(20))
    assert [r.turns[0].text for r in seq_a] != [c.request(i).turns[0].text for i in range(20)]


def test_prompts_land_within_5_percent_with_a_tokenizer(tokenizer_dir):
    gen = WorkloadGenerator(Workload(source="sharegpt-like", tokenizer=tokenizer_dir), 0)
    assert gen.builder.approximation is None
    for i in range(30):
        t = gen.request(i).turns[0]
        got = gen.builder.count(t.text)
        assert abs(got - t.prompt_tokens) <= max(1, 0.05 * t.prompt_tokens), (got, t.prompt_tokens)


def test_synthetic_prompts_are_exact_without_tokenizing_each(tokenizer_dir, monkeypatch):
    # Built from words the tokenizer holds as one token each: exact, and no tokenizer call per
    # prompt (a call costs milliseconds in the loop that times every other stream).
    gen = WorkloadGenerator(Workload(source="synthetic", input=Lengths(mean=300, dist="uniform",
                                                                      min=1, max=600),
                                     output=Lengths(mean=8), tokenizer=tokenizer_dir), 0)
    assert gen.builder.words is not None and len(gen.builder.words) >= 16
    turns = [gen.request(i).turns[0] for i in range(40)]
    assert all(gen.builder.count(t.text) == t.prompt_tokens for t in turns)

    def no_encode(*_a, **_kw):
        raise AssertionError("tokenizer called while building a prompt")

    monkeypatch.setattr(gen.builder.tokenizer, "encode", no_encode, raising=False)
    assert gen.request(99).turns[0].text


def test_a_tokenizer_without_enough_one_token_words_falls_back_to_trimming(tmp_path):
    # A vocabulary of little more than bytes holds few common words whole: prompts are then
    # built by encoding and trimming, and still land within 5%.
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    files = sorted(glob.glob(sysconfig.get_paths()["stdlib"] + "/*.py"))[:20]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator((Path(f).read_text(encoding="utf-8", errors="ignore") for f in files),
                            trainers.BpeTrainer(vocab_size=300, show_progress=False,
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(tmp_path / "tokenizer.json"))
    gen = WorkloadGenerator(Workload(source="synthetic", input=Lengths(mean=200),
                                     output=Lengths(mean=8), tokenizer=tmp_path), 0)
    assert gen.builder.words is None and gen.builder.approximation is None
    for i in range(5):
        t = gen.request(i).turns[0]
        assert abs(gen.builder.count(t.text) - t.prompt_tokens) <= 10


def test_without_tokenizer_the_approximation_is_stated():
    gen = WorkloadGenerator(Workload(source="alpaca-like"), 0)
    assert "1 token per common English word" in gen.builder.approximation
    t = gen.request(3).turns[0]
    assert len(t.text.split()) == t.prompt_tokens


def test_shared_prefix_and_ignore_eos_body(tokenizer_dir):
    w = Workload(source="synthetic", input=Lengths(mean=200), output=Lengths(mean=50),
                 shared_prefix_ratio=0.5, tokenizer=tokenizer_dir)
    gen = WorkloadGenerator(w, 0)
    r1, r2 = gen.request(1), gen.request(2)
    assert r1.system == r2.system and abs(gen.builder.count(r1.system) - 100) <= 5
    path, body = gen.body(r1, "m")
    assert path == "/v1/completions" and body["prompt"].startswith(r1.system)
    assert body["ignore_eos"] is True and body["max_tokens"] == 50
    assert body["stream_options"] == {"include_usage": True} and body["stream"] is True


def test_multi_turn_chat_resends_history():
    w = Workload(source="alpaca-like", api="chat", turns=3)
    gen = WorkloadGenerator(w, 0)
    spec = gen.request(0)
    hist = [{"role": "user", "content": spec.turns[0].text}, {"role": "assistant", "content": "x"}]
    path, body = gen.body(spec, "m", turn=1, history=hist)
    assert path == "/v1/chat/completions" and len(spec.turns) == 3
    assert body["messages"][:2] == hist and body["messages"][2]["content"] == spec.turns[1].text


def test_file_sources(tmp_path):
    share = [{"conversations": [{"from": "human", "value": f"question {i} " * 5},
                                {"from": "gpt", "value": "answer " * 40}]} for i in range(10)]
    (tmp_path / "sg.json").write_text(json.dumps(share))
    gen = WorkloadGenerator(Workload(source="sharegpt-file", path=tmp_path / "sg.json"), 0)
    texts = {gen.request(i).turns[0].text for i in range(10)}
    assert len(texts) == 10 and gen.request(0).turns[0].max_tokens == 70  # 280 chars / 4
    (tmp_path / "p.jsonl").write_text('{"prompt": "hello there"}\n{"prompt": "hi", "output_tokens": 9}\n')
    gen = WorkloadGenerator(Workload(source="jsonl-file", path=tmp_path / "p.jsonl"), 0)
    assert {gen.request(i).turns[0].text for i in range(2)} == {"hello there", "hi"}
    assert gen.request(0).ignore_eos is False  # the file decides when replies end
    (tmp_path / "bad.jsonl").write_text('{"text": "x"}\n')
    with pytest.raises(ValueError, match="line 1 has no 'prompt' key"):
        WorkloadGenerator(Workload(source="jsonl-file", path=tmp_path / "bad.jsonl"), 0).request(0)


def test_poisson_schedule_is_exponential_and_gamma_is_bursty():
    rng = np.random.default_rng(5)
    times = np.fromiter(schedule(rng, lambda t: 50.0, until=100.0), float)
    gaps = np.diff(times)
    assert stats.kstest(gaps, "expon", args=(0, 1 / 50)).pvalue > 0.01
    assert len(times) == pytest.approx(5000, rel=0.05)
    g = interarrival_gaps(np.random.default_rng(0), 10.0, 50_000, "gamma", burstiness=0.25)
    assert g.mean() == pytest.approx(0.1, rel=0.02) and g.std() / g.mean() == pytest.approx(2, rel=0.05)


def test_shapes_levels():
    assert level_at(Shape(kind="constant", level=8), 100) == 8
    ramp = Shape(kind="ramp", start_level=0, level=10, ramp_s=10)
    assert [level_at(ramp, t) for t in (0, 5, 10, 20)] == [0, 5, 10, 10]
    step = Shape(kind="step", start_level=2, level=8, steps=4, step_s=10)
    assert [level_at(step, t) for t in (0, 10, 25, 99)] == [2, 4, 6, 8]
    spike = Shape(kind="spike", level=20, spike_factor=4, spike_at_s=10, spike_s=5)
    assert [level_at(spike, t) for t in (0, 12, 16)] == [5, 20, 5]


def test_saturation_needs_both_ttft_and_queue_growth():
    t = np.linspace(0, 20, 100)
    flat_q = np.zeros(10)
    qt = np.linspace(0, 20, 10)
    assert saturated(t, 0.1 + 0.05 * t, qt, np.linspace(0, 50, 10))
    assert not saturated(t, 0.1 + 0.05 * t, qt, flat_q)
    assert not saturated(t, np.full(100, 0.1), qt, np.linspace(0, 50, 10))


def test_overload_rule():
    assert not client_overloaded(0.002, 0.001, 0.5, 0.010)
    assert client_overloaded(0.050, 0.001, 0.5, 0.010)
    assert client_overloaded(0.001, 0.030, 0.5, 0.010)
    assert client_overloaded(0.001, 0.001, 0.99, 0.010)


def test_merge_pools_raw_samples(tmp_path):
    rows = [{"request_id": f"w{w}-{i}", "worker": f"w{w}", "start_ts": float(i), "status": "ok",
             "error": "", "ttft_s": float(w * 10 + i), "e2e_s": 1.0, "tpot_s": 0.1,
             "itl_s": [0.1, 0.1], "output_tokens": 10} for w in (0, 1) for i in range(10)]
    for w in (0, 1):
        with open(tmp_path / f"w{w}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows if r["worker"] == f"w{w}")
            f.write('{"torn": ')  # a killed worker's last line
    df = samples.merge_dir(tmp_path)
    assert list(df.columns) == list(samples.COLUMNS) and len(df) == 20
    pooled = samples.summarize(df)["ttft_p50_s"]
    assert pooled == pytest.approx(np.percentile([r["ttft_s"] for r in rows], 50))
    assert isinstance(df["itl_s"].iloc[0], list)


def test_parse_metrics_rows():
    text = ('# TYPE vllm:num_requests_waiting gauge\n'
            'vllm:num_requests_waiting{model_name="m"} 3\n'
            '# TYPE DCGM_FI_DEV_GPU_UTIL gauge\nDCGM_FI_DEV_GPU_UTIL{gpu="0"} 87\n')
    df = pd.DataFrame(parse_metrics(text, 1.0), columns=["ts", "name", "labels", "value"])
    assert df.set_index("name")["value"].to_dict() == {"vllm:num_requests_waiting": 3.0,
                                                       "DCGM_FI_DEV_GPU_UTIL": 87.0}
    assert json.loads(df["labels"].iloc[0]) == {"model_name": "m"}


def test_priorities_are_drawn_per_request_and_sent_beside_the_same_lengths():
    plain = WorkloadGenerator(Workload(source="sharegpt-like"), 7)
    mixed = WorkloadGenerator(Workload(source="sharegpt-like", priorities={-1: 0.2, 0: 0.8}), 7)
    specs = [mixed.request(i) for i in range(2000)]
    urgent = [s for s in specs if s.priority == -1]
    assert {s.priority for s in specs} == {-1, 0} and abs(len(urgent) / 2000 - 0.2) < 0.03
    # A stream of its own: the lengths are those of the same workload without priorities.
    assert [s.turns[0].max_tokens for s in specs[:50]] == [plain.request(i).turns[0].max_tokens
                                                          for i in range(50)]
    assert mixed.body(urgent[0], "m")[1]["priority"] == -1
    assert "priority" not in mixed.body(next(s for s in specs if s.priority == 0), "m")[1]
    with pytest.raises(ValidationError, match="summing to 1"):
        Workload(source="sharegpt-like", priorities={-1: 0.5, 0: 0.6})

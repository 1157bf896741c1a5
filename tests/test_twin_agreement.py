"""The live twin and the predictor are one model: the same scenario gives the same figures on both.

They can only agree if the server counts the prompts the predictor assumes: the lab's prompts
built without a tokenizer have the twin's count exactly, and a chat request is its message inside
the chat template, on both sides.
"""

from pathlib import Path

import numpy as np
import pytest

from tests.support.processes import private_inventory
from vllm_lab import scenarios, serving
from vllm_lab.backends import LiveBackend, PredictBackend
from vllm_lab.prediction import chat_template_tokens, predicted_requests
from vllm_lab.traffic.workloads import PromptBuilder
from vllm_lab.twin.tokenizer import load_tokenizer


def test_prompts_built_without_a_tokenizer_have_the_twins_count_and_chat_adds_its_template():
    tok = load_tokenizer("meta-llama/Meta-Llama-3-8B-Instruct")  # no folder: the approximation
    rng = np.random.default_rng(0)
    for n in (1, 7, 64, 700):
        text = PromptBuilder(None).build(n, rng)
        assert len(tok.encode(text, add_special_tokens=False)) == n
        # Llama-3's layout: <|begin_of_text|>, the two role headers, <|eot_id|>: one token each.
        assert len(tok.encode_chat([{"role": "user", "content": text}])) == n + 10
    chat = scenarios.resolve("realtime-chat", "cpu-demo", ["workload.shared_prefix_ratio=0"])
    plain = scenarios.resolve("realtime-chat", "cpu-demo", ["workload.shared_prefix_ratio=0",
                                                            "workload.api=completions"])
    assert chat_template_tokens(chat) == 10
    served = [r.prompt_tokens for r in predicted_requests(chat, 20)]
    assert served == [r.prompt_tokens + 10 for r in predicted_requests(plain, 20)]


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    """One private local host, provisioned once; its twin is stopped at the end."""
    inv = private_inventory(tmp_path_factory.mktemp("agree"))
    serving.provision(inv, timeout=300)
    yield inv
    serving.stop(inv)


@pytest.mark.integration
def test_the_live_twin_and_the_predictor_agree_on_realtime_chat(host, tmp_path):
    """The realtime-chat scenario (a shared system prompt, short replies) at 14 req/s on
    cpu-demo, where the chat template's tokens once made the live twin 40% slower on TTFT than
    the predictor. Percentiles of one 10-s run: p50 within 8%, throughput within 6%."""
    s = scenarios.resolve("realtime-chat", "cpu-demo", [
        "load.mode=open", "load.shape.level=14", "load.stop.duration_s=10",
        "workload.source=alpaca-like", "run.warmup_requests=2"])
    m = LiveBackend("twin", host).measure(s, None, tmp_path / "live")
    assert m.status == "ok", m.error
    live = m.summary
    predicted = PredictBackend().measure(s, None, Path(".")).summary
    for metric, within in (("output_throughput", 0.06), ("ttft_p50", 0.08), ("tpot_p50", 0.08)):
        assert live[metric] == pytest.approx(predicted[metric], rel=within), metric

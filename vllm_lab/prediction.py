"""A scenario as the twin's predictor takes it, and the predictor's run as the lab's: the
workload's requests (their lengths and the prefixes they share, a trace's included) and the load's
arrivals in, per-request samples and the modelled energy out. ``backends.PredictBackend`` runs it.
"""

from __future__ import annotations

import threading
from dataclasses import replace
from typing import Any

import numpy as np
import pandas as pd

from vllm_lab import audit
from vllm_lab.energy import ENERGY_COUNTER
from vllm_lab.scenarios import Scenario
from vllm_lab.traffic.workloads import priority_of, shared_prefix_length
from vllm_lab.twin.prompts import shared_prefix_prompts, template_tokens


def predicted_arrivals(scenario: Scenario):
    """The predictor's arrivals for the scenario's load: its users, or its live schedule."""
    from vllm_lab.traffic.arrivals import planned_arrivals
    from vllm_lab.twin.predictor import Closed, Open

    load = scenario.load
    if load.mode == "closed":
        return Closed(users=int(load.shape.level), think_time_s=load.think_time_s)
    times = np.fromiter(planned_arrivals(load, scenario.run.seed, scenario.workload), dtype=float)
    return Open(rate=load.shape.level, burstiness=load.burstiness,
                max_in_flight=load.max_in_flight, times=times)


MODELLED = "the twin's power model"


def energy_series(p) -> pd.DataFrame | None:
    """The predicted run's modelled energy counter as the GPU series a measured run scrapes (NVML's,
    in mJ), so that ``summarize`` reads its steady window's energy as it reads a measured run's."""
    if p.energy_counter is None or len(p.energy_counter) < 2:
        return None
    ts, joules = p.energy_counter.T
    return pd.DataFrame({"ts": ts, "name": ENERGY_COUNTER, "labels": "gpu=0", "value": joules * 1000.0})


def modelled_energy(p, summary: dict[str, Any]) -> dict[str, Any]:
    """The predicted run's energy figures, named as a model: the steady window's where ``summary``
    (read with ``energy_series``) has them, else the whole run's."""
    if "energy_j" in summary:
        return {"energy_source": MODELLED}
    if not p.duration_s or p.energy_j <= 0:
        return {}
    out_tokens = float(p.requests["output_tokens"].sum())
    out: dict[str, Any] = {"energy_j": p.energy_j, "power_mean_w": p.energy_j / p.duration_s,
                           "energy_source": MODELLED}
    if out_tokens:
        out.update(joules_per_output_token=p.energy_j / out_tokens,
                   output_tokens_per_joule=out_tokens / p.energy_j)
    return out


def engine_steps(p) -> dict[str, float]:
    """The predicted engine's steps as a measured run's are read (``audit.ServerView``): the run's
    span, first send to last reply, over the steps run, and the tokens a step carried."""
    if p.step_tokens is None or not len(p.step_tokens) or p.requests is None or p.requests.empty:
        return {}
    tokens, steps = p.step_tokens[:, 0], p.step_tokens[:, 1]
    span = float(p.requests["finish_s"].max() - p.requests["send_s"].min())
    return audit.step_figures(span, float(steps.sum()), float((tokens * steps).sum()))


def chat_template_tokens(scenario: Scenario) -> int:
    """The tokens the served model's chat template puts around one user message, and around the
    system message the live workload sends its shared prefix in (``twin.prompts.template_tokens``)."""
    serve = scenario.serve
    return template_tokens(str(serve.get("tokenizer") or serve["model"]), serve.get("chat-template"),
                           scenario.workload.shared_prefix_ratio > 0)


def replayed_prompts(scenario: Scenario, lengths: list[int]) -> tuple[list, bool]:
    """A run's recorded prompt lengths as the predictor replays them: with the prefixes the
    scenario's requests shared (as token ids, what the prefix cache meets) and the chat template
    around each message; and whether the run was chat."""
    w = scenario.workload
    lin = w.lengths()[0]
    chat = w.api == "chat"
    template = chat_template_tokens(scenario) if chat else 0
    shared = shared_prefix_length(w.shared_prefix_ratio, lin.mean) if lin is not None else 0
    return shared_prefix_prompts(lengths, shared, w.prefix_groups, template), chat


def predicted_requests(scenario: Scenario, count: int):
    """The scenario's workload as predictor requests: the live run's own lengths (request i's
    drawn from request i's stream, ``traffic.workloads.request_rng``) and prefix sharing, no text."""
    requests = _unprioritized(scenario, count)
    if not scenario.workload.priorities:
        return requests
    # Each request's priority, as the live load draws it (traffic.workloads.priority_of).
    return [replace(r, priority=priority_of(scenario.workload.priorities, scenario.run.seed, i))
            for i, r in enumerate(requests)]


def _unprioritized(scenario: Scenario, count: int):
    if scenario.workload.source == "trace":
        return trace_predict_requests(scenario, count)
    lin, lout = scenario.workload.lengths()
    if lin is None or lout is None:
        raise ValueError(f"workload source {scenario.workload.source!r} has no length "
                         f"distribution the predictor can use; give input: and output: lengths")
    shared = shared_prefix_length(scenario.workload.shared_prefix_ratio, lin.mean)
    chat = scenario.workload.api == "chat"
    template = chat_template_tokens(scenario) if chat else 0
    key = (lin.model_dump_json(), lout.model_dump_json(), scenario.run.seed, count, shared,
           scenario.workload.prefix_groups, chat, template)
    with _DRAWN_LOCK:
        built = _BUILT.get(key)
    if built is None:
        built = _requests(_drawn(lin, lout, scenario.run.seed, count), shared,
                          scenario.workload.prefix_groups, chat, template)
        with _DRAWN_LOCK:
            if len(_BUILT) >= 64:
                _BUILT.clear()
            _BUILT[key] = built
    return list(built)


def _requests(drawn: list[tuple[int, int]], shared: int, groups: int, chat: bool, template: int) -> list:
    """Predictor requests of the drawn lengths: prompts at least a token past a shared prefix, in
    the chat template where the API is chat, opening with their prefix group's token ids."""
    from vllm_lab.twin.predictor import PredictRequest

    prompts = np.array([n_in for n_in, _ in drawn], dtype=int)
    if shared:  # the user's text is one token at least, however short the drawn length
        prompts = np.maximum(prompts, shared + 1)
    tokens = shared_prefix_prompts(prompts, shared, groups, template)  # in its chat template
    return [PredictRequest(p, int(n_out), chat) for p, (_n_in, n_out) in zip(tokens, drawn)]


# Request i's lengths depend on the distributions, the seed and i alone: an autotune or a staircase
# predicts the same workload hundreds of times, and a generator per request costs more than the
# rest of its drawing. Kept per workload and seed, extended as a longer run asks for more.
_DRAWN: dict[tuple[str, str, int], list[tuple[int, int]]] = {}
_DRAWN_LOCK = threading.Lock()
# The requests built from them (a shared prefix's token ids cost as much again), kept whole: the
# predictor reads them and never changes them, and each caller gets its own list.
_BUILT: dict[tuple, list] = {}


def _drawn(lin, lout, seed: int, count: int) -> list[tuple[int, int]]:
    """The first ``count`` requests' (prompt, output) lengths, each drawn from its own stream."""
    from vllm_lab.traffic.workloads import drawn_lengths, request_rng

    key = (lin.model_dump_json(), lout.model_dump_json(), seed)
    with _DRAWN_LOCK:  # a spread plan predicts on several threads
        drawn = _DRAWN.get(key)
        if drawn is None:
            if len(_DRAWN) >= 64:
                _DRAWN.clear()
            drawn = _DRAWN[key] = []
        drawn.extend(drawn_lengths(lin, lout, request_rng(seed, i)) for i in range(len(drawn), count))
        return drawn[:count]


def trace_predict_requests(scenario: Scenario, count: int):
    """A trace's requests as the predictor's, in order (cycled for a longer run): their lengths,
    and token ids that share what the trace says they share (Mooncake blocks, a prefix id), so the
    prefix cache meets what production did."""
    from vllm_lab.traffic.traces import MOONCAKE_BLOCK_TOKENS as B
    from vllm_lab.traffic.traces import trace_requests
    from vllm_lab.twin.predictor import PredictRequest

    rows = trace_requests(scenario.workload, scenario.load)
    chat = scenario.workload.api == "chat"
    ids: dict = {}

    def shared(key, n: int) -> list[int]:
        base = ids.setdefault(key, 2_000_000_000 + len(ids) * 1_000_000)
        return list(range(base, base + n))

    out = []
    for i in range(count):
        r = rows[i % len(rows)]
        if r.blocks:
            tokens = [t for h in r.blocks for t in shared(("block", h), B)][:r.prompt_tokens]
        elif r.prefix is not None and r.prefix_tokens:
            first = 10_000_000 + i * 100_000
            unique = range(first, first + r.prompt_tokens - r.prefix_tokens)
            tokens = shared(("prefix", r.prefix), r.prefix_tokens) + list(unique)
        else:
            out.append(PredictRequest(r.prompt_tokens, r.output_tokens, chat))
            continue
        out.append(PredictRequest(tokens, r.output_tokens, chat))
    return out


def prediction_samples(df: pd.DataFrame) -> pd.DataFrame:
    """The predictor's per-request frame in the traffic layer's sample columns."""
    done = df["finish_s"].notna()
    return pd.DataFrame({
        "request_id": [f"p-{i}" for i in range(len(df))],
        "start_ts": df["send_s"], "scheduled_ts": df["scheduled_s"],
        "ttft_s": df["ttft_s"], "tpot_s": df["tpot_s"],
        "e2e_s": df["e2e_s"], "itl_s": [[] for _ in range(len(df))],
        "prompt_tokens": df["prompt_tokens"], "output_tokens": df["output_tokens"],
        "status": ["ok" if d else "error" for d in done],
        "error": ["" if d else "not finished" for d in done],
        "priority": df.get("priority", 0),
    })

"""The tuning guide's claims, each measured by an experiment built from the lab's own plans.

A claim names *arms*: serve flags changed from vLLM's defaults, on a traffic. The plan is the union
of the selected claims' arms as ``Point``s; arms that coincide (vLLM's defaults on the same traffic)
are measured once and shared between claims. A verdict compares an arm's mean against its
reference arm: a change under the threshold (the reference's run-to-run spread, and never under
``claim_evidence.MATERIAL``, 3%, even on the deterministic predictor) is no change, and a claim that
states a size is held to it (``claim_evidence.sized``).

Verdicts: "holds", "holds partly", "does not hold", "not testable here" (with why).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm_lab import flags as flagcat
from vllm_lab import lint as lint_mod
from vllm_lab import stats
from vllm_lab.claim_evidence import (
    HOLDS,
    NO,
    PARTLY,
    UNTESTABLE,
    Evidence,
    Part,
    absent,
    compare,
    overall,
    pct,
    sized,
    tok,
)
from vllm_lab.inputs import shown
from vllm_lab.plans import Point
from vllm_lab.scenarios import Scenario, deep_merge, read_yaml, scenario_path

TEMPLATES = ("realtime-chat", "offline-batch", "high-concurrency-api")


# -- the traffics the claims are measured on -------------------------------------------------------

# The shortest run of a traffic whose replies are long. A run's steady window must outlast its
# fill (half the time its load is sent, at least), and the fill is about one reply: on an H200,
# 1024-token generations take 7-15 s and offline-batch's replies 20 s or more, so 10-s runs of
# them were all fill and judged unsteady.
LONG_REPLY_RUN_S = {"long-generation": 30, "template:offline-batch": 60}


def traffic_scenario(base: Scenario, traffic: str) -> Scenario:
    """``base`` with the traffic of one claim experiment (serve flags untouched).

    base: the scenario's own traffic; saturating: 256 closed-loop users; light: 16 users, a batch
    below every max-num-seqs tried; near-capacity: 64 users (on an H200-class GPU and an 8B
    model, about three quarters of the most it serves); long-generation: 128 prompt / 1024 output
    tokens, 64 users;
    template:<name>: the workload, load and SLO of scenarios/<name>.yaml. The base scenario's
    duration holds for all, so DURATION sets the whole plan's length, but never below
    ``LONG_REPLY_RUN_S`` for a traffic of long replies.
    """
    record = base.to_record()
    level = {"saturating": 256, "light": 16, "near-capacity": 64, "long-generation": 64}
    if traffic in level:
        record["load"] = {**record["load"], "mode": "closed",
                          "shape": {**record["load"]["shape"], "kind": "constant", "level": level[traffic]}}
    if traffic == "long-generation":
        record["workload"] = {**record["workload"], "source": "synthetic",
                              "input": {"dist": "fixed", "mean": 128},
                              "output": {"dist": "fixed", "mean": 1024}}
    if traffic.startswith("template:"):
        template = read_yaml(scenario_path(traffic.split(":", 1)[1]))
        duration = record["load"]["stop"]["duration_s"]
        record["workload"] = template["workload"]
        record["load"] = deep_merge(template["load"], {"stop": {"duration_s": duration}})
        record["slo"] = template.get("slo", {})
    if traffic in LONG_REPLY_RUN_S:
        stop = record["load"]["stop"]
        record["load"]["stop"] = {**stop, "duration_s": max(stop["duration_s"], LONG_REPLY_RUN_S[traffic])}
    return Scenario.model_validate(record)


def traffic_words(scenario: Scenario) -> str:
    """A scenario's traffic in a few words, as a verdict names the traffic its arm ran: the API,
    the prompt source and the load ("completions API, sharegpt-like prompts, 32 closed-loop users")."""
    w, load = scenario.workload, scenario.load
    level = f"{load.shape.level:g}"
    how = {"closed": f"{level} closed-loop users", "open": f"{load.arrival} arrivals at {level} req/s",
           "replay": "the trace's own times"}[load.mode]
    return f"{w.api} API, {w.source} prompts, {how}"


def template_flags(name: str) -> dict[str, Any]:
    """A shipped template's serve flags, its model left out (the plan serves the base's model)."""
    return {k: v for k, v in read_yaml(scenario_path(name))["serve"].items() if k != "model"}


# -- claims, arms and the evidence ----------------------------------------------------------------

@dataclass(frozen=True)
class Arm:
    """One configuration of a claim's experiment: flags over vLLM's defaults, on a traffic."""

    name: str
    traffic: str
    serve: Mapping[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        """The arm's identity in the store (the run's point): traffic and changed flags."""
        flags = ", ".join(f"{k}={v}" for k, v in sorted(self.serve.items())) or "defaults"
        return f"{self.traffic} · {flags}"


@dataclass(frozen=True)
class Claim:
    """A statement of the guide, the experiment that tests it and how its verdict is reached."""

    number: int
    statement: str
    method: str
    arms: tuple[Arm, ...]
    judge: Callable[[Evidence], list[Part]]


# -- the nine claims ---------------------------------------------------------------------------------

def _judge_memory(ev: Evidence) -> list[Part]:
    parts = []
    arms = ["util-0.7", "defaults", "util-0.85", "util-0.98"]
    ran = [a for a in arms if ev.ok(a)]
    stable = {a: (ev.mean(a, "errors") or 0) + (ev.mean(a, "preemptions") or 0) for a in ran}
    failed = [a for a in arms if ev.measured(a) and not ev.ok(a)]
    kv = ", ".join(f"{a}: {ev.mean(a, 'kv_cache_tokens') or 0:,.0f} KV tokens, "
                   f"{ev.mean(a, 'preemptions') or 0:.0f} preemptions, "
                   f"{ev.mean(a, 'errors') or 0:.0f} errors" for a in ran)
    if "util-0.7" not in ran:
        parts.append(Part("0.7 is the most stable", UNTESTABLE, f"util-0.7: {ev.status('util-0.7')}"))
    else:
        # Stability: a start that fails is the worst; then errors and preemptions during the run.
        steadier = [a for a in ran if stable[a] < stable["util-0.7"]]
        worse = [a for a in ran if stable[a] > stable["util-0.7"]] + failed
        if steadier:
            verdict, why = NO, f"{', '.join(steadier)} ran with fewer errors and preemptions than 0.7"
        elif worse:
            verdict, why = HOLDS, f"none steadier than 0.7; less stable: {', '.join(worse)}"
        else:
            verdict, why = NO, "every setting ran equally clean: 0.7 buys no stability, only a smaller KV cache"
        parts.append(Part("0.7 is the most stable", verdict, f"{why}; {kv}"
                          + (f"; {', '.join(failed)}: {ev.status(failed[0])}" if failed else "")))
    if missing := absent(ev, "util-0.85", "util-0.7"):
        parts.append(Part("0.85-0.9 is the best balance", UNTESTABLE, missing))
    else:
        best = max(ran, key=lambda a: ev.mean(a, "output_throughput") or 0)
        rel_best, floor = ev.change("util-0.85", best, "output_throughput")
        rel_low, _ = ev.change("util-0.85", "util-0.7", "output_throughput")
        thr = ", ".join(f"{a} {tok(ev.mean(a, 'output_throughput'))}" for a in ran)
        spread = [ev.mean(a, "output_throughput") or 0 for a in ran]
        if max(spread) <= min(spread) * (1 + floor):
            verdict = NO  # no setting differs: there is no balance to strike at this load
        elif rel_low is not None and rel_low > floor and rel_best is not None and rel_best > -floor:
            verdict = HOLDS
        elif rel_best is not None and rel_best > -floor:
            verdict = PARTLY  # as good as the best, but not better than the safe 0.7 either
        else:
            verdict = NO
        parts.append(Part("0.85-0.9 is the best balance", verdict,
                          f"output throughput {thr}; 0.85 vs 0.7 {pct(rel_low, floor, ev.deterministic)}, "
                          f"vs best ({best}) {pct(rel_best, floor, ev.deterministic)}"))
    if not ev.measured("util-0.98"):
        parts.append(Part("above 0.95 out-of-memory becomes likely", UNTESTABLE, "util-0.98 not measured"))
    else:
        oom = "oom" in ev.status("util-0.98")
        parts.append(Part("above 0.95 out-of-memory becomes likely", HOLDS if oom else NO,
                          f"0.98: {ev.status('util-0.98')}"
                          + ("" if oom else f", {tok(ev.mean('util-0.98', 'output_throughput'))}")))
    return parts


def _judge_budget(ev: Evidence) -> list[Part]:
    parts = []
    util = {a: ev.mean(a, "gpu_util_mean") for a in ("small", "defaults", "4096", "large")}
    if (missing := absent(ev, "small")) or util["small"] is None:
        parts.append(Part("too small a budget leaves the GPU under 50% utilized", UNTESTABLE,
                          missing or "no GPU utilization was scraped"))
    else:
        parts.append(Part("too small a budget leaves the GPU under 50% utilized",
                          HOLDS if util["small"] < 50 else NO,
                          f"GPU utilization {util['small']:.0f}% at the smallest budget vLLM accepts "
                          f"(defaults {util['defaults'] or 0:.0f}%); output {compare(ev, 'small', 'defaults', 'output_throughput', tok)}"))
    if missing := absent(ev, "large", "defaults"):
        parts.append(Part("a large budget lifts utilization above 90% and raises per-request latency",
                          UNTESTABLE, missing))
    else:
        rel, floor = ev.change("large", "defaults", "e2e_p50")
        high = util["large"] is not None and util["large"] > 90
        slower = rel is not None and rel > floor
        parts.append(Part("a large budget lifts utilization above 90% and raises per-request latency",
                          HOLDS if high and slower else PARTLY if high or slower else NO,
                          f"GPU utilization {util['large'] or 0:.0f}%; E2E p50 "
                          f"{compare(ev, 'large', 'defaults', 'e2e_p50')}; TTFT p50 "
                          f"{compare(ev, 'large', 'defaults', 'ttft_p50')}", measured=rel))
    if missing := absent(ev, "4096", "defaults"):
        parts.append(Part("4096 shortens per-request processing", UNTESTABLE, missing))
    else:
        rel, floor = ev.change("4096", "defaults", "e2e_p50")
        ttft, ttft_floor = ev.change("4096", "defaults", "ttft_p50")
        shorter = rel is not None and rel < -floor
        # A shorter E2E bought with a materially longer wait for the first token is half the claim.
        longer_first = ttft is not None and ttft > ttft_floor
        parts.append(Part("4096 shortens per-request processing",
                          NO if not shorter else PARTLY if longer_first else HOLDS,
                          f"E2E p50 {compare(ev, '4096', 'defaults', 'e2e_p50')}; TTFT p50 "
                          f"{compare(ev, '4096', 'defaults', 'ttft_p50')}", measured=rel))
    return parts


# The load regimes a claim whose truth depends on the load is judged in, each its own traffic.
REGIMES = (("light", "light load, 16 users"), ("near-capacity", "near capacity, 64 users"),
           ("saturating", "saturated, 256 users"))


def _interval(ev: Evidence, arm: str, ref: str, metric: str) -> str:
    """The effect's 95% interval over the repeats, or why there is none."""
    e = stats.effect(ev.values(arm, metric), ev.values(ref, metric))
    if math.isnan(e.relative) or math.isinf(e.low):
        return "one run per arm: no interval (REPEATS=3 gives one)"
    return f"95% interval {e.low:+.0%} to {e.high:+.0%}"


def _judge_eager(ev: Evidence) -> list[Part]:
    # Its effect changes sign with the load (CUDA graphs shorten every step; without them a
    # saturated server runs fewer, longer steps), so it is judged in each regime.
    parts = []
    for regime, words in REGIMES:
        statement = f"--enforce-eager cuts time to first token by about 30% ({words})"
        eager, dflt = f"eager-{regime}", f"defaults-{regime}"
        if missing := absent(ev, eager, dflt):
            parts.append(Part(statement, UNTESTABLE, missing, claimed=-0.3))
            continue
        rel, floor = ev.change(eager, dflt, "ttft_p50")
        parts.append(Part(statement, sized(rel, floor, -0.3),
                          f"TTFT p50 {compare(ev, eager, dflt, 'ttft_p50')}, "
                          f"{_interval(ev, eager, dflt, 'ttft_p50')}; TPOT p50 "
                          f"{compare(ev, eager, dflt, 'tpot_p50')}; output "
                          f"{compare(ev, eager, dflt, 'output_throughput', tok)}",
                          claimed=-0.3, measured=rel))
    return parts


def _judge_seqs(ev: Evidence) -> list[Part]:
    statement = "max-num-seqs below 64 markedly lowers scheduling overhead"
    if missing := absent(ev, "seqs-32", "defaults"):
        return [Part(statement, UNTESTABLE, missing)]
    # 16 users keep the batch under both caps: any change in step time is the cap's own overhead.
    rel, floor = ev.change("seqs-32", "defaults", "tpot_p50")
    cost = ""
    if ev.ok("seqs-32-base") and ev.ok("defaults-base"):
        cost = (f"; at the scenario's own load the cap changes output "
                f"{compare(ev, 'seqs-32-base', 'defaults-base', 'output_throughput', tok)} and TTFT p50 "
                f"{compare(ev, 'seqs-32-base', 'defaults-base', 'ttft_p50')}")
    return [Part(statement, sized(rel, floor, -0.1), f"per-token step time (TPOT p50) at 16 users, "
                 f"same batch under both caps: {compare(ev, 'seqs-32', 'defaults', 'tpot_p50')}{cost}",
                 claimed=-0.1, measured=rel)]


def _judge_blocks(ev: Evidence, small_refused: str | None, traffic: str, chat: bool) -> list[Part]:
    """``traffic``: the scenario's own traffic in words, the one the block-16 arms ran; ``chat``:
    whether that is chat traffic, which the claim is about."""
    parts = []
    if missing := absent(ev, "block-32-base", "defaults-base"):
        parts.append(Part("block 16 suits chat (less fragmentation)", UNTESTABLE, missing))
    else:
        rel, floor = ev.change("defaults-base", "block-32-base", "output_throughput")
        tpot, tpot_floor = ev.change("defaults-base", "block-32-base", "tpot_p50")
        kv, kv_floor = ev.change("defaults-base", "block-32-base", "kv_usage_mean")
        kv16, kv32 = ev.mean("defaults-base", "kv_usage_mean"), ev.mean("block-32-base", "kv_usage_mean")
        faster = (rel is not None and rel > floor) or (tpot is not None and tpot < -tpot_floor)
        # Less fragmentation alone (a smaller share of the cache in use) is the claim's reason
        # without its gain; nothing beyond the threshold is no part of it.
        leaner = kv is not None and kv < -kv_floor and (rel is None or rel > -floor)
        verdict = HOLDS if faster else PARTLY if leaner else NO
        exact = ev.deterministic
        parts.append(Part("block 16 suits chat (less fragmentation)", verdict,
                          f"block 32 → 16 on {traffic}: output {pct(rel, floor, exact)}, TPOT p50 "
                          f"{pct(tpot, tpot_floor, exact)}; KV usage mean {kv32 or 0:.1%} → {kv16 or 0:.1%}"
                          + (f"; block 8: {small_refused}" if small_refused else "")
                          + ("" if chat else "; not chat traffic: SCENARIO=realtime-chat runs these "
                             "arms on chat")))
    if missing := absent(ev, "block-32-long", "defaults-long"):
        parts.append(Part("block 32+ suits long generation (less scheduling overhead)", UNTESTABLE, missing))
    else:
        rel, floor = ev.change("block-32-long", "defaults-long", "tpot_p50")
        parts.append(Part("block 32+ suits long generation (less scheduling overhead)",
                          HOLDS if rel < -floor else NO,
                          f"1024-token outputs, block 16 → 32: TPOT p50 "
                          f"{compare(ev, 'block-32-long', 'defaults-long', 'tpot_p50')}; output "
                          f"{compare(ev, 'block-32-long', 'defaults-long', 'output_throughput', tok)}",
                          measured=rel))
    return parts


def _judge_dtype(ev: Evidence) -> list[Part]:
    parts = []
    if not ev.measured("float32"):
        parts.append(Part("float32 doubles memory", UNTESTABLE, "float32 not measured"))
    elif not ev.ok("float32"):
        oom = "oom" in ev.status("float32")
        parts.append(Part("float32 doubles memory", HOLDS if oom else UNTESTABLE,
                          f"float32: {ev.status('float32')}"))
    else:
        t16, t32 = ev.mean("defaults", "kv_cache_tokens"), ev.mean("float32", "kv_cache_tokens")
        thr = compare(ev, "float32", "defaults", "output_throughput", tok)
        if not t16 or not t32:
            parts.append(Part("float32 doubles memory", UNTESTABLE, f"no KV cache size was scraped; output {thr}"))
        else:
            # Same memory budget: per-token bytes doubled (and weights doubled) leave at most half the tokens.
            ratio = t32 / t16
            parts.append(Part("float32 doubles memory", HOLDS if ratio <= 0.55 else NO,
                              f"KV cache in the same memory budget: {t16:,.0f} → {t32:,.0f} tokens "
                              f"(×{ratio:.2f}); output {thr}", claimed=-0.5, measured=ratio - 1))
    parts.append(Part("float32's quality gain over float16 is negligible", UNTESTABLE,
                      "quality needs real weights and an evaluation set; the lab serves dummy "
                      "weights and measures speed and memory"))
    if missing := absent(ev, "float16", "defaults"):
        parts.append(Part("bfloat16 is more efficient than float16 on A100/H100-class GPUs", UNTESTABLE, missing))
    else:
        rel, floor = ev.change("defaults", "float16", "output_throughput")
        parts.append(Part("bfloat16 is more efficient than float16 on A100/H100-class GPUs",
                          HOLDS if rel > floor else NO,
                          f"float16 → bfloat16: output {pct(rel, floor, ev.deterministic)}, TPOT p50 "
                          f"{compare(ev, 'defaults', 'float16', 'tpot_p50')}", measured=rel))
    return parts


def _judge_templates(ev: Evidence) -> list[Part]:
    parts = []
    s = "the low-latency template cuts TTFT by 40% or more at about 15% throughput cost"
    if missing := absent(ev, "realtime-chat", "defaults-realtime-chat"):
        parts.append(Part(s, UNTESTABLE, missing, claimed=-0.4))
    else:
        ttft, floor = ev.change("realtime-chat", "defaults-realtime-chat", "ttft_p50")
        cost, _ = ev.change("realtime-chat", "defaults-realtime-chat", "output_throughput")
        cut = sized(ttft, floor, -0.4, holds_at=-0.35)
        priced = cost is not None and -0.25 <= cost <= -0.05
        verdict = cut if cut in (NO, UNTESTABLE) else HOLDS if cut == HOLDS and priced else PARTLY
        parts.append(Part(s, verdict,
                          f"on its own traffic: TTFT p50 "
                          f"{compare(ev, 'realtime-chat', 'defaults-realtime-chat', 'ttft_p50')}; output "
                          f"{compare(ev, 'realtime-chat', 'defaults-realtime-chat', 'output_throughput', tok)}",
                          claimed=-0.4, measured=ttft))
    s = "the offline-batch template raises throughput 3-5x"
    if missing := absent(ev, "offline-batch", "defaults-offline-batch"):
        parts.append(Part(s, UNTESTABLE, missing, claimed=2.0))
    else:
        rel, floor = ev.change("offline-batch", "defaults-offline-batch", "output_throughput")
        ratio = 1 + rel
        # 3-5x: about 3x (x2.8) holds, at least 2x holds partly, anything less does not hold.
        parts.append(Part(s, sized(rel, floor, 2.0),
                          f"on its own traffic (512 users): output "
                          f"{compare(ev, 'offline-batch', 'defaults-offline-batch', 'output_throughput', tok)}"
                          f" = ×{ratio:.2f} the defaults (claimed ×3-5)", claimed=2.0, measured=rel))
    s = "the high-concurrency template holds GPU utilization near 85%"
    util = ev.mean("high-concurrency-api", "gpu_util_mean")
    if (missing := absent(ev, "high-concurrency-api")) or util is None:
        parts.append(Part(s, UNTESTABLE, missing or "no GPU utilization scraped"))
    else:
        parts.append(Part(s, HOLDS if abs(util - 85) <= 7 else NO,
                          f"GPU utilization {util:.0f}% on its own traffic (defaults: "
                          f"{ev.mean('defaults-high-concurrency-api', 'gpu_util_mean') or 0:.0f}%)"))
    return parts


def _judge_parallel(ev: Evidence, sizes: Sequence[int]) -> list[Part]:
    s = "tensor parallelism over 8 GPUs gives about 6.5x the throughput of one"
    measured = [n for n in sizes if ev.ok(f"tp-{n}")]
    if 1 not in measured or len(measured) < 2:
        why = ("the hardware has one GPU" if len(sizes) < 2 else
               "; ".join(f"tp-{n}: {ev.status(f'tp-{n}')}" for n in sizes))
        return [Part(s, UNTESTABLE, why, claimed=5.5)]
    one = ev.mean("tp-1", "output_throughput")
    scale = ", ".join(f"TP {n}: ×{ev.mean(f'tp-{n}', 'output_throughput') / one:.2f} "
                      f"({ev.mean(f'tp-{n}', 'output_throughput') / one / n:.0%} efficiency)"
                      for n in measured if n > 1)
    if 8 not in measured:
        return [Part(s, UNTESTABLE, f"measured up to {max(measured)} GPUs (the most the hardware has): {scale}",
                     claimed=5.5)]
    ratio = ev.mean("tp-8", "output_throughput") / one
    verdict = HOLDS if abs(ratio - 6.5) <= 0.15 * 6.5 else PARTLY if ratio > 4 else NO
    return [Part(s, verdict, f"at 256 users, {scale}", claimed=5.5, measured=ratio - 1)]


def catalog(base: Scenario) -> list[Claim]:
    """The nine claims, their arms fitted to the base scenario's hardware and vLLM version."""
    hw = base.hardware
    defaults = flagcat.engine_defaults(hw.memory_gib, hw.name)
    sat, chat = "saturating", "base"
    blocks8 = [f.message for f in lint_mod.lint(base.with_serve(**{"block-size": 8})) if f.key == "block-size"]
    swap = flagcat.changes_for(base.vllm_version).get("swap-space")
    sizes = [n for n in (1, 2, 4, 8) if n <= hw.gpu_count]
    templates = [Arm(t, f"template:{t}", template_flags(t)) for t in TEMPLATES]
    templates += [Arm(f"defaults-{t}", f"template:{t}") for t in TEMPLATES]
    return [
        Claim(1, "gpu-memory-utilization 0.7 is the most stable, 0.85-0.9 the best balance, above 0.95 "
              "out-of-memory becomes likely",
              "256 closed-loop users at 0.7, 0.85, vLLM's 0.92 and 0.98: failed starts, errors, "
              "preemptions, KV cache size and throughput",
              (Arm("defaults", sat), Arm("util-0.7", sat, {"gpu-memory-utilization": 0.7}),
               Arm("util-0.85", sat, {"gpu-memory-utilization": 0.85}),
               Arm("util-0.98", sat, {"gpu-memory-utilization": 0.98})), _judge_memory),
        Claim(2, "A too-small max-num-batched-tokens leaves the GPU under 50% utilized; a large one "
              "lifts utilization above 90% and raises per-request latency; 4096 shortens per-request "
              "processing",
              f"256 closed-loop users at {defaults['max-num-seqs']} (the smallest vLLM accepts with "
              f"its max-num-seqs), 4096, vLLM's {defaults['max-num-batched-tokens']} and 32768: GPU "
              "utilization, E2E and TTFT",
              (Arm("defaults", sat), Arm("small", sat, {"max-num-batched-tokens": defaults["max-num-seqs"]}),
               Arm("4096", sat, {"max-num-batched-tokens": 4096}),
               Arm("large", sat, {"max-num-batched-tokens": 32768})), _judge_budget),
        Claim(3, "--enforce-eager cuts time to first token by about 30%",
              "with and without --enforce-eager at each load regime (16, 64 and 256 closed-loop "
              "users): TTFT with its interval, TPOT, throughput",
              tuple(arm for regime, _ in REGIMES
                    for arm in (Arm(f"defaults-{regime}", regime),
                                Arm(f"eager-{regime}", regime, {"enforce-eager": True}))),
              _judge_eager),
        Claim(4, "max-num-seqs below 64 markedly lowers scheduling overhead",
              f"max-num-seqs 32 against vLLM's {defaults['max-num-seqs']} at 16 users (the batch is "
              "the same under both caps, so a change in step time is the cap's overhead), and at the "
              "scenario's load for its cost",
              (Arm("defaults", "light"), Arm("seqs-32", "light", {"max-num-seqs": 32}),
               Arm("defaults-base", chat), Arm("seqs-32-base", chat, {"max-num-seqs": 32})), _judge_seqs),
        Claim(5, "Block sizes 8-16 suit chat (less fragmentation), 32+ long generation (less "
              "scheduling overhead)",
              f"block 16 (vLLM's default) and 32 on the scenario's own traffic ({traffic_words(base)}) "
              "and on 1024-token generations; block 8 where the attention backend allows it",
              (Arm("defaults-base", chat), Arm("block-32-base", chat, {"block-size": 32}),
               Arm("defaults-long", "long-generation"),
               Arm("block-32-long", "long-generation", {"block-size": 32})),
              lambda ev: _judge_blocks(ev, blocks8[0] if blocks8 else None, traffic_words(base),
                                       base.workload.api == "chat")),
        Claim(6, "float32 doubles memory for a negligible quality gain over float16; bfloat16 is more "
              "efficient than float16 on A100/H100-class GPUs",
              "the scenario's traffic in the model's bfloat16, float16 and float32: KV cache size in "
              "the same memory budget, throughput, TPOT",
              (Arm("defaults", chat), Arm("float16", chat, {"dtype": "float16"}),
               Arm("float32", chat, {"dtype": "float32"})), _judge_dtype),
        Claim(7, "Swap space of 4-8 GB absorbs bursts; swap : GPU memory of 1 : 4",
              "a spike against swap-space 4 and 8", (),
              lambda ev: [Part("swap space absorbs bursts", UNTESTABLE,
                               f"swap-space was {swap.kind} in vLLM {swap.since}: {swap.advice}" if swap
                               else "the lab has no swap experiment for this vLLM version")]),
        Claim(8, "The low-latency template cuts TTFT by 40% or more at about 15% throughput cost; the "
              "offline-batch template raises throughput 3-5x; the high-concurrency template holds GPU "
              "utilization near 85%",
              "each template's flags (scenarios/<template>.yaml, corrected for vLLM 0.26) against vLLM's "
              "defaults, on the template's own traffic",
              tuple(templates), _judge_templates),
        Claim(9, "Tensor parallelism over 8 GPUs gives about 6.5x the throughput of one",
              "256 closed-loop users at tensor-parallel-size " + ", ".join(map(str, sizes or [1])) +
              " (as many GPUs as the hardware has)",
              tuple(Arm(f"tp-{n}", sat, {"tensor-parallel-size": n} if n > 1 else {}) for n in sizes),
              lambda ev: _judge_parallel(ev, sizes)),
    ]


def parse_selection(text: str | None) -> list[int]:
    """CLAIMS="1,3,5-8" as claim numbers (all nine when empty)."""
    if not text:
        return list(range(1, 10))
    out: set[int] = set()
    for part in (p.strip() for p in text.split(",") if p.strip()):
        lo, dash, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi if dash else lo)  # "1-" is no range: int("") refuses it
        except ValueError:
            raise ValueError(f"CLAIMS: {shown(part)} is not a claim number or range (1-9), "
                             f"e.g. CLAIMS=1,3,5-8") from None
        # Checked before the range is expanded: CLAIMS=1-100000000 is one sentence, not 4 GB.
        bad = next((n for n in (first, last) if not 1 <= n <= 9), None)
        if bad is not None:
            raise ValueError(f"CLAIMS: {bad} is not a claim; the guide's claims are numbered 1-9")
        if first > last:
            raise ValueError(f"CLAIMS: {shown(part)} is an empty range; write it from the lower "
                             f"number up, e.g. CLAIMS={last}-{first}")
        out.update(range(first, last + 1))
    return sorted(out)


def arm_keys(base: Scenario) -> dict[str, str]:
    """Every arm's label and the identity of the scenario it runs: arms of the same identity are
    one measurement under several names."""
    return {arm.label: Point(traffic_scenario(base, arm.traffic).with_serve(**arm.serve), {}).key
            for claim in catalog(base) for arm in claim.arms}


def points(base: Scenario, selected: Sequence[int], repeats: int = 1,
           deterministic: bool = False) -> list[Point]:
    """The runs the selected claims need, each arm once; vLLM's defaults repeated at least twice
    (on a deterministic backend once: its repeat reads the same figures).

    The reference arms are the noise floor of every verdict, so they always get a second run.
    """
    seen: dict[str, Point] = {}
    for claim in catalog(base):
        if claim.number not in selected:
            continue
        for arm in claim.arms:
            scenario = traffic_scenario(base, arm.traffic).with_serve(**arm.serve)
            for r in range(max(repeats, 2) if not arm.serve and not deterministic else repeats):
                p = Point(scenario, {"arm": arm.label}, r)
                seen.setdefault(p.key, p)
    # vLLM's defaults first (one start serves every claim's reference), then the claims in order:
    # a plan cut short (Ctrl-C, a job's time limit) has measured the first claims whole.
    return sorted(seen.values(), key=lambda p: p.serve_key != _serve_key(base))


def _serve_key(s: Scenario) -> str:
    return Point(s, {}).serve_key


@dataclass(frozen=True)
class Verdict:
    """One claim's outcome."""

    claim: Claim
    verdict: str
    parts: list[Part]


def judge(base: Scenario, runs_by_label: Mapping[str, Sequence[dict]],
          selected: Sequence[int] = range(1, 10)) -> list[Verdict]:
    """Each selected claim's verdict from the runs (label → run dicts with status, summary, error)."""
    out, same = [], arm_keys(base)
    for claim in catalog(base):
        if claim.number in selected:
            parts = claim.judge(Evidence(runs_by_label, claim.arms, same))
            out.append(Verdict(claim, overall(parts), parts))
    return out

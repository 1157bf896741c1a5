"""A run's summary from raw samples: throughput over the steady window, not the fill or the drain."""

import numpy as np
import pandas as pd
import pytest

from vllm_lab.scenarios import Slo
from vllm_lab.summary import summarize, unsteady_reason
from vllm_lab.traffic import Load


def closed_loop(last_e2e: list[float], last_tokens: list[int]) -> pd.DataFrame:
    """4 users sending back to back (2 s, 100 tokens each) at 0, 2, 4, 6 and a last request at 8."""
    rows = []
    for user in range(4):
        for k in range(4):
            rows.append((f"{user}-{k}", 2.0 * k, 2.0, 100))
        rows.append((f"{user}-last", 8.0, last_e2e[user], last_tokens[user]))
    df = pd.DataFrame(rows, columns=["request_id", "start_ts", "e2e_s", "output_tokens"])
    return df.assign(ttft_s=0.2, tpot_s=(df["e2e_s"] - 0.2) / (df["output_tokens"] - 1),
                     prompt_tokens=50, status="ok", error="", itl_s=[[] for _ in range(len(df))])


def test_throughput_counts_the_steady_window_not_the_drain():
    # One user's last request runs 10 s at the end: over first send -> last reply that tail would
    # count as a fifth of the run at a quarter of the concurrency.
    s = summarize(closed_loop([2, 2, 2, 10], [100, 100, 100, 500]), Slo())
    assert s["duration_s"] == 6.0 and s["drain_s"] == 10.0 and s["warmup_s"] == 2.0
    assert s["output_throughput"] == pytest.approx(200.0)  # 4 users x 100 tokens / 2 s
    assert s["request_throughput"] == pytest.approx(2.0)
    whole = (16 * 100 + 3 * 100 + 500) / 18.0
    assert whole == pytest.approx(133.3, abs=0.1)  # what the whole span would have said


def test_a_given_duration_is_used_as_is():
    s = summarize(closed_loop([2, 2, 2, 2], [100] * 4), Slo(), duration_s=10.0)
    assert s["duration_s"] == 10.0 and s["output_throughput"] == pytest.approx(200.0)
    assert "drain_s" not in s


def test_the_fill_before_the_first_reply_is_not_averaged_in():
    # A saturated closed loop: the first wave waits 3 s for its prefills (no token comes out),
    # then every request takes 2 s. First send -> last send would count those 3 silent seconds.
    rows = [(f"{u}-0", 0.0, 5.0, 100, 3.0) for u in range(4)]
    rows += [(f"{u}-{k}", 5.0 + 2.0 * (k - 1), 2.0, 100, 0.2) for u in range(4) for k in range(1, 6)]
    df = pd.DataFrame(rows, columns=["request_id", "start_ts", "e2e_s", "output_tokens", "ttft_s"])
    df = df.assign(tpot_s=(df["e2e_s"] - df["ttft_s"]) / 99, prompt_tokens=50, status="ok",
                   error="", itl_s=[[] for _ in range(len(df))])
    s = summarize(df, Slo())
    assert s["warmup_s"] == 5.0 and s["duration_s"] == 8.0  # first reply at 5 s, last send at 13 s
    assert s["output_throughput"] == pytest.approx(200.0)  # 4 users x 100 tokens every 2 s
    # First send -> last send would say 2000 tokens in 13 s: 154 tok/s, 23% low.


def test_a_slow_start_after_the_first_reply_is_cut_as_warm_up():
    # 8 users, 2 s requests of 100 tokens; the server runs at half speed for its first 10 s (a
    # fresh start: graphs captured lazily), so those requests take 4 s.
    rows, t = [], {u: 0.0 for u in range(8)}
    for u in range(8):
        while t[u] < 60:
            e2e = 4.0 if t[u] < 10 else 2.0
            rows.append((f"{u}-{t[u]}", t[u] + u * 0.01, e2e, 100, 0.2))
            t[u] += e2e
    df = pd.DataFrame(rows, columns=["request_id", "start_ts", "e2e_s", "output_tokens", "ttft_s"])
    df = df.assign(tpot_s=(df["e2e_s"] - df["ttft_s"]) / 99, prompt_tokens=50, status="ok",
                   error="", itl_s=[[] for _ in range(len(df))])
    s = summarize(df, Slo())
    assert 8.0 <= s["warmup_s"] <= 14.0
    assert s["output_throughput"] == pytest.approx(400.0, rel=0.03)  # 8 x 100 tokens / 2 s
    assert s["output_throughput_rel_ci"] < 0.05
    assert "MSER" in s["window_reason"]
    plain = summarize(closed_loop([2, 2, 2, 10], [100, 100, 100, 500]), Slo())
    assert plain["window_reason"].startswith("from the first reply (2.0 s")


def test_a_closed_loops_turnaround_is_each_users_wait_before_its_next_send():
    # Two users on two workers, the same user id on each: user 0 comes back 10 ms after each
    # reply, user 1 after 30 ms. Matched per (worker, user), never across them.
    rows = []
    for worker, wait in (("a", 0.010), ("b", 0.030)):
        t = 0.0
        for k in range(5):
            rows.append((f"{worker}-{k}", worker, 7, t, 1.0))
            t += 1.0 + wait
    df = pd.DataFrame(rows, columns=["request_id", "worker", "user", "start_ts", "e2e_s"])
    df = df.assign(ttft_s=0.1, tpot_s=0.01, output_tokens=91, prompt_tokens=50, status="ok",
                   error="", itl_s=[[] for _ in range(len(df))])
    s = summarize(df, Slo())
    assert s["turnaround_mean"] == pytest.approx(0.020)
    assert s["turnaround_p50"] == pytest.approx(0.020)
    assert "turnaround_mean" not in summarize(closed_loop([2] * 4, [100] * 4), Slo())  # no user ids


def _quota_loop() -> pd.DataFrame:
    """4 users with 5 requests each, as a per-user quota dealt them: users 0-2's take 1 s, user
    3's 4 s; the first three are done at 5 s while user 3 sends until 16 s, alone."""
    rows = []
    for user, e2e in enumerate((1.0, 1.0, 1.0, 4.0)):
        for k in range(5):
            rows.append((f"{user}-{k}", "w", user, e2e * k, e2e, 100))
    df = pd.DataFrame(rows, columns=["request_id", "worker", "user", "start_ts", "e2e_s",
                                     "output_tokens"])
    return df.assign(ttft_s=0.1, tpot_s=(df["e2e_s"] - 0.1) / 99, prompt_tokens=50, status="ok",
                     error="", itl_s=[[] for _ in range(len(df))])


def test_a_closed_loop_window_ends_when_fewer_than_its_users_are_in_flight():
    load = Load(shape={"level": 4}, stop={"max_requests": 20})
    s = summarize(_quota_loop(), Slo(), load=load)
    # From the first reply (1 s) to the first user's last reply (5 s), not to the last send (16 s).
    assert s["warmup_s"] == 1.0 and s["duration_s"] == 4.0
    assert s["window_reason"].endswith("the first user's last reply (fewer in flight than users)")
    assert s["output_throughput"] == pytest.approx((3 * 400 + 100) / 4, rel=0.02)
    # Without the load the window runs to the last send, as before.
    assert summarize(_quota_loop(), Slo())["window_reason"].endswith("to the last send")


def test_a_send_stamped_just_after_a_users_last_reply_is_not_a_drain():
    # One pool, 4 users, 1 s each: the last ticket is taken at 4.0 s but stamped at 4.002 s, after
    # user 0's last reply at 4.0 s; no user sends twice after it, so the load held to the last send.
    rows = [(f"{u}-{k}", "w", u, float(k) + (0.002 if (u, k) == (3, 4) else 0.0), 1.0, 100)
            for u in range(4) for k in range(4 if u < 3 else 5)]
    df = pd.DataFrame(rows, columns=["request_id", "worker", "user", "start_ts", "e2e_s",
                                     "output_tokens"])
    df = df.assign(ttft_s=0.1, tpot_s=0.009, prompt_tokens=50, status="ok", error="",
                   itl_s=[[] for _ in range(len(df))])
    load = Load(shape={"level": 4}, stop={"max_requests": len(df)})
    assert summarize(df, Slo(), load=load)["window_reason"].endswith("to the last send")


def test_a_window_too_short_for_its_run_says_so():
    load = Load(shape={"level": 4}, stop={"max_requests": 20})
    s = summarize(_quota_loop(), Slo(), load=load)
    assert s["window_share"] == pytest.approx(4.0 / 20.0)
    assert s["send_span_s"] == 16.0  # user 3 went on sending, alone, after the window
    assert "the load held for only 25% of the time it was sent" in s["window_note"]
    assert "only 13 requests finished inside it" in s["window_note"]
    steady = summarize(closed_loop([2, 2, 2, 2], [100] * 4), Slo())
    assert steady["window_share"] == pytest.approx(6 / 10)
    assert "window_note" not in steady or "held for only" not in steady["window_note"]


def test_an_open_loop_window_ends_at_its_last_scheduled_arrival():
    # 50 arrivals at 10 req/s; the client sent the last five 2 s late (it fell behind).
    n = 50
    planned = np.arange(n) / 10.0
    sent = planned + np.where(np.arange(n) >= n - 5, 2.0, 0.0)
    df = pd.DataFrame({"request_id": [str(i) for i in range(n)], "scheduled_ts": planned,
                       "start_ts": sent, "e2e_s": 0.5, "ttft_s": 0.05, "output_tokens": 50,
                       "prompt_tokens": 10, "status": "ok", "error": ""})
    df = df.assign(tpot_s=0.45 / 49, itl_s=[[] for _ in range(n)])
    s = summarize(df, Slo(), load=Load(mode="open", shape={"level": 10}))
    assert s["window_reason"].endswith("to the last scheduled arrival")
    assert s["duration_s"] == pytest.approx(4.9 - 0.5)


def test_served_requests_count_what_the_window_served_not_what_ended_in_it():
    # 10 req/s for 30 s, every other request 0.5 s and 4 s long: a server that keeps up. Counting
    # the completions inside the window misses the long ones still in flight at its end (6% here).
    n = 300
    e2e = np.where(np.arange(n) % 2 == 0, 0.5, 4.0)
    planned = np.arange(n) / 10.0
    df = pd.DataFrame({"request_id": [str(i) for i in range(n)], "scheduled_ts": planned,
                       "start_ts": planned, "e2e_s": e2e, "ttft_s": 0.05, "output_tokens": 50,
                       "prompt_tokens": 10, "status": "ok", "error": ""})
    df = df.assign(tpot_s=(df["e2e_s"] - 0.05) / 49, itl_s=[[] for _ in range(n)])
    s = summarize(df, Slo(), load=Load(mode="open", shape={"level": 10}))
    assert s["request_throughput"] == pytest.approx(10.0, rel=0.01)
    ends = df["start_ts"] + df["e2e_s"]
    t0, t1 = 0.5, 29.9
    completions = float(((ends > t0) & (ends <= t1)).sum()) / (t1 - t0)
    assert completions == pytest.approx(9.4, abs=0.1)  # what counting completions said


def test_a_run_that_did_not_hold_its_load_says_why():
    closed, open_loop = Load(shape={"level": 4}), Load(mode="open", shape={"level": 10})
    short = {"window_share": 0.2, "drain_s": 1.0, "e2e_p99": 2.0}
    assert "steady window covered 20% of the time its load was sent" in unsteady_reason(short, closed)
    # An open loop's arrivals keep their schedule: an overloaded server drains long, as evidence.
    assert unsteady_reason(short, open_loop) == ""
    drained = {"window_share": 0.6, "drain_s": 40.0, "e2e_p99": 3.0}
    assert "drained 40.0 s after its window, 13x its E2E p99" in unsteady_reason(drained, closed)
    assert unsteady_reason({"window_share": 0.7, "drain_s": 5.0, "e2e_p99": 3.0}, closed) == ""
    assert unsteady_reason({}, closed) == ""  # a tiny run has no steady window to judge
    # 64 users of long-tailed replies for 15 s (an H200 run): the window held 14.2 of the 15 s
    # sent; the 16-s drain after it is the longest replies finishing, not a load that failed.
    tail = {"warmup_s": 0.8, "duration_s": 14.2, "send_span_s": 15.0, "window_share": 0.47,
            "drain_s": 16.0, "e2e_p99": 14.0}
    assert unsteady_reason(tail, closed) == ""
    filled = {**tail, "warmup_s": 9.0, "duration_s": 6.0}  # the fill took most of the sending
    assert "covered 40% of the time its load was sent" in unsteady_reason(filled, closed)


def test_the_server_view_keeps_the_most_requests_vllm_ran_at_once():
    """vLLM's running gauge, summed over a server's engines at each scrape: a batch at max-num-seqs
    tells the findings that waiting requests waited for a slot."""
    running, waiting = "vllm:num_requests_running", "vllm:num_requests_waiting"
    metrics = pd.DataFrame({"ts": [1.0, 1.0, 2.0, 2.0, 1.0, 2.0],
                            "name": [running] * 4 + [waiting] * 2, "labels": "",
                            "value": [20.0, 20.0, 40.0, 24.0, 30.0, 5.0]})  # two engines, then one view
    s = summarize(closed_loop([2.0] * 4, [100] * 4), Slo(), server_metrics=metrics)
    assert s["running_max"] == 64.0 and s["queue_len_max"] == 30.0

"""Locust's fixed waits, shortened (vllm_lab/traffic/locust_waits.py). Locust itself is not
imported here: it monkey-patches the whole process with gevent. Every Locust run of the suite
loads the patches for real."""

import time

from vllm_lab.traffic import locust_waits


def test_the_wait_for_workers_polls_and_other_sleeps_are_kept(monkeypatch):
    slept = []
    monkeypatch.setattr(time, "sleep", slept.append)
    polled = locust_waits._PolledTime()
    polled.sleep(1)  # locust.main's wait for its workers: one poll
    polled.sleep(0.1)
    polled.sleep(0)  # --autoquit 0
    assert slept == [locust_waits.WORKER_POLL_S, 0.1, 0]
    assert polled.monotonic is time.monotonic  # the rest is the time module's own


def test_the_master_quits_once():
    class Runner:
        def __init__(self):
            self.quits = 0

        def quit(self):
            self.quits += 1

    Runner.quit = locust_waits._once(Runner.quit)
    runner = Runner()
    for _ in range(3):  # the shape's end, the run's end, the shutdown
        runner.quit()
    assert runner.quits == 1 and Runner.quit.lab_once

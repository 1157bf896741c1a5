"""How many Locust processes a run gets: from its planned peak, capped by the host's cores."""

from vllm_lab.traffic import Load, Workload, plan_processes
from vllm_lab.traffic.spec import Lengths

WORKLOAD = Workload(source="synthetic", input=Lengths(mean=512), output=Lengths(mean=128))


def closed(users: int) -> Load:
    return Load(shape={"level": users})


def test_a_closed_loop_gets_a_process_per_64_streams_and_6000_tokens_per_s():
    sizes = {u: plan_processes(closed(u), WORKLOAD, cores=16) for u in (1, 16, 64, 256, 512, 1024)}
    # 200 tok/s per stream at most: 64 users -> 12,800 tok/s -> 3 processes.
    assert sizes == {1: 1, 16: 1, 64: 3, 256: 9, 512: 14, 1024: 14}  # 16 cores - 2 for the server


def test_an_open_loop_is_sized_by_its_token_rate_and_in_flight_cap():
    load = Load(mode="open", shape={"level": 100}, max_in_flight=64)
    assert plan_processes(load, WORKLOAD, cores=64) == 3  # 100 req/s x 128 tokens = 12,800 tok/s


def test_the_processes_spread_over_the_load_generator_hosts():
    assert plan_processes(closed(1024), WORKLOAD, hosts=4, cores=64) == 9  # 35 over 4 hosts


def test_a_small_machine_keeps_one_process():
    assert plan_processes(closed(512), WORKLOAD, cores=2) == 1

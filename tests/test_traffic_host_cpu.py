"""traffic.host_cpu: the cores a host gives the load generator and the time its CPU quota stalled
it, read from cgroup files as the kernel writes them (v2 and v1), in a folder that stands for
/sys/fs/cgroup."""

import os

import pytest

from vllm_lab.traffic import host_cpu


def test_a_v2_quota_and_its_throttled_time(tmp_path):
    (tmp_path / "cpu.max").write_text("400000 100000\n")
    (tmp_path / "cpu.stat").write_text("usage_usec 9000000\nnr_periods 120\nnr_throttled 7\n"
                                       "throttled_usec 1250000\nnr_bursts 0\n")
    assert host_cpu.cpus(tmp_path) == min(4.0, len(os.sched_getaffinity(0)))
    assert host_cpu.throttled_s(tmp_path) == pytest.approx(1.25)


def test_a_v1_quota_and_its_throttled_time(tmp_path):
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("50000\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    (tmp_path / "cpu" / "cpu.stat").write_text("nr_periods 10\nnr_throttled 2\nthrottled_time 3000000000\n")
    assert host_cpu.cpus(tmp_path) == 0.5
    assert host_cpu.throttled_s(tmp_path) == pytest.approx(3.0)


@pytest.mark.parametrize("files", [{"cpu.max": "max 100000\n"}, {}, {"cpu.max": "garbage"}])
def test_no_quota_is_the_cores_this_process_may_run_on(tmp_path, files):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    assert host_cpu.cpus(tmp_path) == len(os.sched_getaffinity(0))
    assert host_cpu.throttled_s(tmp_path) is None


def test_a_run_the_quota_stalled_says_so_and_records_it(monkeypatch, caplog):
    from vllm_lab import backends

    monkeypatch.setattr(host_cpu, "throttled_s", lambda root=host_cpu.CGROUP: 5.0)
    monkeypatch.setattr(host_cpu, "cpus", lambda root=host_cpu.CGROUP: 4.0)
    assert backends._host_cpu(1.0, 60.0) == {"client_host_cpus": 4.0, "client_host_throttled_s": 4.0}
    assert "stalled this run for 4.0 s of its 60 s" in caplog.text
    caplog.clear()
    assert backends._host_cpu(4.5, 60.0)["client_host_throttled_s"] == 0.5 and not caplog.text
    assert backends._host_cpu(None, 60.0) == {"client_host_cpus": 4.0}

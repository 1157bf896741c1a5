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


def _topology(root, siblings: dict[int, str], name="core_cpus_list"):
    for cpu, text in siblings.items():
        (root / f"cpu{cpu}" / "topology").mkdir(parents=True)
        (root / f"cpu{cpu}" / "topology" / name).write_text(text + "\n")


def test_smt_siblings_count_as_one_physical_core(tmp_path, monkeypatch):
    """Four CPUs that are two cores' two hardware threads each are two physical cores; the older
    kernels' thread_siblings_list says the same; no topology says nothing."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 8, 9})
    _topology(tmp_path / "new", {0: "0,8", 8: "0,8", 1: "1,9", 9: "1,9"})
    assert host_cpu.physical_cores(tmp_path / "new") == 2
    _topology(tmp_path / "old", {0: "0", 8: "8", 1: "1", 9: "9"}, name="thread_siblings_list")
    assert host_cpu.physical_cores(tmp_path / "old") == 4
    assert host_cpu.physical_cores(tmp_path / "none") is None
    # This machine's own topology reads as some cores, never more than it may run on.
    monkeypatch.undo()
    assert 1 <= (host_cpu.physical_cores() or 1) <= len(os.sched_getaffinity(0))


def test_a_run_the_quota_stalled_says_so_and_records_it(monkeypatch, caplog):
    from vllm_lab import backends

    monkeypatch.setattr(host_cpu, "throttled_s", lambda root=host_cpu.CGROUP: 5.0)
    monkeypatch.setattr(host_cpu, "cpus", lambda root=host_cpu.CGROUP: 4.0)
    monkeypatch.setattr(host_cpu, "physical_cores", lambda sysfs=host_cpu.SYSFS_CPU: None)
    assert backends._host_cpu(1.0, 60.0) == {"client_host_cpus": 4.0, "client_host_throttled_s": 4.0}
    assert "stalled this run for 4.0 s of its 60 s" in caplog.text
    caplog.clear()
    assert backends._host_cpu(4.5, 60.0)["client_host_throttled_s"] == 0.5 and not caplog.text
    assert backends._host_cpu(None, 60.0) == {"client_host_cpus": 4.0}


def test_a_run_records_the_physical_cores_where_the_kernel_says(monkeypatch):
    from vllm_lab import backends

    monkeypatch.setattr(host_cpu, "throttled_s", lambda root=host_cpu.CGROUP: None)
    monkeypatch.setattr(host_cpu, "cpus", lambda root=host_cpu.CGROUP: 16.0)
    monkeypatch.setattr(host_cpu, "physical_cores", lambda sysfs=host_cpu.SYSFS_CPU: 8)
    assert backends._host_cpu(None, 60.0) == {"client_host_cpus": 16.0,
                                               "client_host_physical_cores": 8.0}


@pytest.mark.integration
@pytest.mark.untimed
def test_the_host_cpu_benchmark_reads_each_process_count_against_one_alone():
    """make bench NAME=host-cpu: the cores, physical cores and, per count of busy processes side by
    side, each one's rate against one alone (1 is always run first) and the quota's stalls."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "bench_host_cpu.py"
    out = subprocess.run([sys.executable, str(script), "0.2", "2"], capture_output=True, text=True,
                         timeout=60, check=True).stdout.splitlines()
    assert out[0].startswith(f"cores {host_cpu.cpus():g} (quota, else affinity); physical cores ")
    rows = [line.split() for line in out[2:]]
    assert [r[0] for r in rows] == ["1", "2"] and rows[0][1] == "100%"
    assert 0 < int(rows[1][1].rstrip("%")) <= 150

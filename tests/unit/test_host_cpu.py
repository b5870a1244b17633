"""Idle cores from two reads of a /proc/stat."""
from autoscaler.host_cpu import HostCpu


def stat(user: int, idle: int) -> str:
    # cpu: user nice system idle iowait irq softirq steal guest guest_nice; two cores
    return (f"cpu  {user} 0 0 {idle} 0 0 0 0 0 0\ncpu0 0 0 0 0 0 0 0 0 0 0\ncpu1 0 0 0 0 0 0 0 0 0 0\n"
            "intr 1 2 3\n")


def test_idle_cores_between_two_reads(tmp_path):
    path = tmp_path / "stat"
    path.write_text(stat(100, 100))
    cpu = HostCpu(path)
    path.write_text(stat(250, 150))     # 200 jiffies passed, 50 of them idle: a quarter of 2 cores
    assert cpu.idle_cores() == 0.5
    assert cpu.idle_cores() is None     # no time passed since


def test_no_proc_stat_means_not_measured(tmp_path):
    assert HostCpu(tmp_path / "missing").idle_cores() is None

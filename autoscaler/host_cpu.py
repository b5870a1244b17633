"""How much of this host's CPU was idle since the last look, from /proc/stat (Linux): the
embedded runtime's replicas all compute on the host the autoscaler runs on."""
from __future__ import annotations

from pathlib import Path

STAT = Path("/proc/stat")


class HostCpu:
    def __init__(self, stat: Path = STAT) -> None:
        self.stat = stat
        self._last = self._read()

    def _read(self) -> tuple[int, int, int] | None:
        """(total jiffies, idle jiffies, cores), or None where /proc/stat cannot be read."""
        try:
            lines = self.stat.read_text().splitlines()
        except OSError:
            return None
        fields = [int(x) for x in lines[0].split()[1:]]
        cores = sum(1 for line in lines if line.startswith("cpu") and line[3:4].isdigit())
        # user nice system idle iowait irq softirq steal (guest time is inside user)
        return sum(fields[:8]), fields[3] + fields[4], cores

    def idle_cores(self) -> float | None:
        """Cores' worth of idle time since the last call; None before two reads or without /proc."""
        now = self._read()
        last, self._last = self._last, now
        if now is None or last is None or now[0] <= last[0]:
            return None
        return (now[1] - last[1]) / (now[0] - last[0]) * now[2]

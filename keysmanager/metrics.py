"""What a KeysManager tells a Prometheus scrape: its cache (zygotes, bytes, host memory) and its
forks, and, for one scrape per node, the metrics of every replica it forked (a forked replica runs
inside the KeysManager's pod, where no Service or pod annotation finds it), each sample labelled
with the replica's function and process id.

    GET /metrics            the KeysManager's own
    GET /metrics/replicas   its forked replicas', gathered at the scrape"""
from __future__ import annotations

import urllib.request
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

SCRAPE_TIMEOUT_S = 2.0


class KeysManagerMetrics:
    def __init__(self, stats: Callable[[], dict]) -> None:
        """`stats()`: the manager's figures now (KeysManager.stats)."""
        self.registry = r = CollectorRegistry()
        self.events = Counter("quart_keysmanager_events_total", "cache events (cache, fork, evict, crash) by stage range",
                              ["event", "stage"], registry=r)
        self.evictions = Counter("quart_keysmanager_evictions_total", "zygotes evicted, by reason", ["reason"], registry=r)
        self.fork_seconds = Histogram("quart_keysmanager_fork_seconds", "a fork's time until the child runs",
                                      ["started_by"], registry=r, buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5))
        r.register(_Figures(stats))


class _Figures:
    """The gauges read from the manager at each scrape rather than kept in step with it."""

    def __init__(self, stats: Callable[[], dict]) -> None:
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self.stats()
        for name, help_, value in (("zygotes", "key stages cached here", s["zygotes"]),
                                   ("cached_bytes", "bytes of the stages cached here", s["cached_bytes"]),
                                   ("memory_used_ratio", "the host's memory in use", s["memory_used"]),
                                   ("memory_threshold_ratio", "memory use above which zygotes are evicted", s["memory_threshold"]),
                                   ("forked_replicas", "replicas forked here that still run", s["forked_replicas"])):
            yield GaugeMetricFamily(f"quart_keysmanager_{name}", help_, value=value)


def replica_families(replicas: Iterable[tuple[str, int, int]]) -> list[Metric]:
    """The metrics of each (function, pid, port) replica, labelled with its function and pid and
    merged by family; a replica that does not answer in time is left out of this scrape."""
    replicas = list(replicas)
    with ThreadPoolExecutor(max_workers=8) as pool:
        texts = list(pool.map(lambda r: _scrape(r[2]), replicas))
    merged: dict[str, Metric] = {}
    for (function, pid, _), text in zip(replicas, texts):
        for family in text_string_to_metric_families(text or ""):
            into = merged.setdefault(family.name, Metric(family.name, family.documentation, family.type))
            for sample in family.samples:
                into.add_sample(sample.name, {**sample.labels, "function": function, "pid": str(pid)}, sample.value,
                                sample.timestamp)
    return list(merged.values())


def _scrape(port: int) -> str | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=SCRAPE_TIMEOUT_S) as reply:
            return reply.read().decode()
    except OSError:
        return None


class Families:
    """A collector of families already made, for generate_latest."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families

"""What the autoscaler exports: its decisions as Prometheus families a scrape parses (replicas
observed and decided, CPUs, key stages, scalings with the step that set them), its ticks, and a
health answer that turns 503 when ticks stop; over real HTTP."""
from __future__ import annotations

import time
import urllib.error
import urllib.request

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from autoscaler.metrics import AutoscalerMetrics, serve
from autoscaler.policy.baselines import Static
from autoscaler.policy.controller import Controller
from autoscaler.policy.state import PipelineState, StageState
from contracts.stage import StageRef

A = (StageRef("a", 0, 1), StageRef("a", 1, 3))


def _state(replicas: int) -> PipelineState:
    return PipelineState("a", tuple(StageState(stage=i, arrival_rate=2.0, service_time_s=0.05, replicas=replicas, queue_length=0)
                                    for i in range(2)), slo_s=2.0, entry_rate=2.0)


def _samples(metrics: AutoscalerMetrics) -> dict[tuple, float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(generate_latest(metrics.registry).decode()) for s in family.samples}


def test_decisions_become_prometheus_samples():
    metrics = AutoscalerMetrics(tick_s=1.0)
    steps = Controller({"a": A}, {"a": Static(3)}).step(5.0, {"a": _state(1)})
    metrics.observe_tick(0.02, steps)
    got = _samples(metrics)
    for stage in ("0", "1-3"):
        assert got[("quart_autoscaler_replicas", (("kind", "observed"), ("model", "a"), ("stage", stage)))] == 1
        assert got[("quart_autoscaler_replicas", (("kind", "decided"), ("model", "a"), ("stage", stage)))] == 3
        up = (("direction", "up"), ("model", "a"), ("reason", "policy"), ("stage", stage))
        assert got[("quart_autoscaler_scalings_total", up)] == 1
    assert got[("quart_autoscaler_tick_seconds_count", ())] == 1
    assert got[("quart_autoscaler_last_tick_timestamp_seconds", ())] > 0
    # Held where decided: no further scaling counted.
    metrics.observe_tick(0.01, Controller({"a": A}, {"a": Static(3)}).step(6.0, {"a": _state(3)}))
    assert _samples(metrics)[("quart_autoscaler_scalings_total", (("direction", "up"), ("model", "a"), ("reason", "policy"),
                                                                  ("stage", "0")))] == 1


def _get(port: int, path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_health_follows_the_ticks_and_metrics_parse_over_http(tmp_path):
    metrics = AutoscalerMetrics(tick_s=1.0)
    server = serve(metrics, "127.0.0.1", 0, tmp_path / "run" / "autoscaler.port")
    try:
        port = int((tmp_path / "run" / "autoscaler.port").read_text())
        assert port == server.server_address[1]
        assert _get(port, "/healthz")[0] == 503          # no tick yet
        metrics.observe_tick(0.01, [])
        assert _get(port, "/healthz") == (200, b"OK")
        status, body = _get(port, "/metrics")
        names = {f.name for f in text_string_to_metric_families(body.decode())}
        assert status == 200 and {"quart_autoscaler_tick_seconds", "quart_autoscaler_replicas"} <= names
        assert _get(port, "/other")[0] == 404
        assert not metrics.healthy(now=time.time() + 10)   # three periods without a tick
    finally:
        server.shutdown()

"""What the autoscaler tells a Prometheus scrape and a Kubernetes probe: its decisions (replicas
and CPUs wanted per stage function, scale events with the step that set them, key stages, layout
changes, sleep), its ticks (duration, last time), over HTTP on QUART_AUTOSCALER_PORT:

    GET /metrics   Prometheus text
    GET /healthz   200 while ticks keep coming (the last within three periods), 503 before the first
                   and once they stop

Served by the standard library's threaded HTTP server in a daemon thread: two read-only paths
need no framework, and the control loop keeps its own thread."""
from __future__ import annotations

import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from autoscaler.policy.controller import Actions

log = logging.getLogger("quart.autoscaler")
STALE_TICKS = 3


class AutoscalerMetrics:
    def __init__(self, tick_s: float) -> None:
        self.tick_s = tick_s
        self.registry = r = CollectorRegistry()
        self.tick_seconds = Histogram("quart_autoscaler_tick_seconds", "one control step over every model", registry=r,
                                      buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5))
        self.last_tick = Gauge("quart_autoscaler_last_tick_timestamp_seconds", "when the last tick ended", registry=r)
        self.replicas = Gauge("quart_autoscaler_replicas", "replicas of a stage function, as observed and as decided",
                              ["model", "stage", "kind"], registry=r)
        self.cpus = Gauge("quart_autoscaler_cpus", "CPUs per replica decided", ["model", "stage"], registry=r)
        self.key = Gauge("quart_autoscaler_key_stage", "1 where the stage is a key stage", ["model", "stage"], registry=r)
        self.scalings = Counter("quart_autoscaler_scalings_total", "replica count changes decided, by the step that set them",
                                ["model", "stage", "direction", "reason"], registry=r)
        self.layouts = Counter("quart_autoscaler_layout_changes_total", "layout changes", ["model", "layout"], registry=r)
        self.asleep = Gauge("quart_autoscaler_asleep", "1 while the model's stage functions are at zero", ["model"], registry=r)
        self.last_tick_at = 0.0

    def observe_tick(self, seconds: float, steps: list[Actions]) -> None:
        self.tick_seconds.observe(seconds)
        self.last_tick_at = time.time()
        self.last_tick.set(self.last_tick_at)
        for actions in steps:
            self._record(actions)

    def _record(self, actions: Actions) -> None:
        model = actions.model
        if actions.layout is not None:
            self.layouts.labels(model, actions.layout.layout).inc()
        if actions.asleep is not None:
            self.asleep.labels(model).set(1 if actions.asleep else 0)
        if actions.decision is None:
            return
        keys = {ref.stages for ref in actions.key_stages}
        for ref, seen, decided in zip(actions.stages, actions.state.stages, actions.decision.stages):
            stage = ref.stages
            self.replicas.labels(model, stage, "observed").set(seen.replicas)
            self.replicas.labels(model, stage, "decided").set(decided.replicas)
            self.cpus.labels(model, stage).set(decided.cpus)
            self.key.labels(model, stage).set(1 if stage in keys else 0)
            if decided.replicas != seen.replicas:
                direction = "up" if decided.replicas > seen.replicas else "down"
                self.scalings.labels(model, stage, direction, _reason(decided.reason)).inc()

    def healthy(self, now: float | None = None) -> bool:
        now = time.time() if now is None else now
        return self.last_tick_at > 0 and now - self.last_tick_at <= STALE_TICKS * max(self.tick_s, 1.0)


def _reason(reason: dict) -> str:
    """The step that set a stage's count, from its reasons: the CPU guard held it, the smoother
    reclaimed it, or the policy (PID, M/M/c, a baseline) chose it. A label of few values."""
    if "held" in reason:
        return "held"
    if "smoothed" in reason and reason.get("smoothed") != reason.get("need"):
        return "smoothed"
    return "policy"


def serve(metrics: AutoscalerMetrics, host: str, port: int, port_file: Path | None = None) -> ThreadingHTTPServer:
    """Starts the server in a daemon thread; `port` 0 takes a free one, written to `port_file`."""
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path == "/metrics":
                self._answer(200, generate_latest(metrics.registry), CONTENT_TYPE_LATEST)
            elif self.path == "/healthz":
                ok = metrics.healthy()
                self._answer(200 if ok else 503, b"OK" if ok else b"no recent tick", "text/plain")
            else:
                self._answer(404, b"GET /metrics or /healthz", "text/plain")

        def _answer(self, status: int, body: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: object) -> None:   # a scrape every few seconds is not news
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="autoscaler-http", daemon=True).start()
    bound = server.server_address[1]
    if port_file is not None:
        port_file.parent.mkdir(parents=True, exist_ok=True)
        port_file.write_text(str(bound))
    log.info("metrics and health on %s:%d", host, bound)
    return server

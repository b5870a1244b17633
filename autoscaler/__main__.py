"""The stage-level autoscaler.

    python -m autoscaler run [--policy quart|quart-flow|static|infless|cocktail|inferline|openfaas-pro-rps|knative-kpa|ray-serve]
    python -m autoscaler status      a live table per stage, from the latest decisions

`make up` starts `run` with the QUART policy (QUART_POLICY, or `up --policy`, picks another;
`none` runs no autoscaler)."""
from __future__ import annotations

import argparse
import logging
import signal
import sys
import time
from pathlib import Path

from autoscaler.backends import Backend, GatewayBackend, LocalBackend
from autoscaler.loop import ControlLoop
from autoscaler.metrics import AutoscalerMetrics, serve
from contracts import logs as log_format
from contracts.config import Settings, add_arguments, exit_on_config_error, settings_from_args
from contracts.http_client import GatewayClient
from contracts.stack import Pipeline, pipelines, read_stack
from state.store import RedisStore


def run(settings: Settings) -> int:
    log_format.configure(settings.log_level, settings.log_format)
    store = RedisStore.from_url(settings.redis_url)
    models = pipelines(read_stack(Path(settings.stack_file)))
    metrics = AutoscalerMetrics(settings.autoscaler.tick_s)
    loop = exit_on_config_error(lambda: ControlLoop(settings, backend(settings, models, store), store, models, metrics=metrics))
    serve(metrics, settings.autoscaler.host, settings.autoscaler.port, Path(settings.home) / "run" / "autoscaler.port")
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    logging.getLogger("quart.autoscaler").info("policy %s, %s backend, every %.1f s over %s",
                                               settings.autoscaler.policy, settings.autoscaler.backend,
                                               settings.autoscaler.tick_s,
                                               {m: [s.stages for s in p.stages] for m, p in models.items()})
    loop.run(lambda: bool(stopping))
    return 0


def backend(settings: Settings, models: dict[str, Pipeline], store: RedisStore) -> Backend:
    """The configured mechanism (QUART_BACKEND): the embedded runtime's, any gateway's, or a
    Kubernetes cluster's (credentials in the pod, else ~/.kube/config)."""
    gateway = GatewayClient.for_settings(settings)
    if settings.autoscaler.backend == "local":
        return LocalBackend(gateway, models, store)
    if settings.autoscaler.backend == "gateway":
        return GatewayBackend(gateway, models)
    import kubernetes

    from autoscaler.kubernetes_backend import KubernetesBackend
    try:
        kubernetes.config.load_incluster_config()
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config()
    return KubernetesBackend(settings, gateway, kubernetes.client.CoreV1Api(), models, store)


def status(settings: Settings, watch: bool) -> int:
    store = RedisStore.from_url(settings.redis_url)
    models = pipelines(read_stack(Path(settings.stack_file)))
    while True:
        lines = []
        for model in models:
            last = store.decisions(model, count=1)
            if not last:
                lines.append(f"{model}: no decision yet")
                continue
            lines.append(f"{model} ({last[0].policy}, {time.time() - last[0].t:.1f} s ago)")
            lines.append(f"  {'stage':>5} {'λ/s':>7} {'μ/s':>7} {'queue':>6} {'repl':>5} {'→':>3} {'cpus':>5} "
                         f"{'delay s':>8} {'target s':>8} {'cv':>5} {'busy':>5} key")
            for s in last[0].stages:
                lines.append(f"  {s['stage']:>5} {s.get('lambda', 0):>7.2f} {s.get('mu', 0):>7.2f} {s['queue']:>6} "
                             f"{s.get('observed_replicas', ''):>5} {s['replicas']:>3} {s['cpus']:>5.1f} "
                             f"{str(s.get('predicted_delay_s', '')):>8.8} {s.get('target_s', 0):>8.3f} "
                             f"{_cv(s):>5} {s.get('busy', 0):>5.0%} {'*' if s['key'] else ''}")
        print("\n".join(lines), flush=True)
        if not watch:
            return 0
        time.sleep(settings.autoscaler.tick_s)
        print()


def _cv(stage: dict) -> str:
    cv = stage.get("predicted_cv")
    return "-" if cv is None else f"{cv:.2f}"  # key stages are not smoothed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=("run", "status"))
    parser.add_argument("--watch", action="store_true", help="with status: refresh every tick")
    add_arguments(parser, "policy", "tick_s", "slo_s", "window_s", "home", "redis_port", "gateway_port", "stack_file")
    args = parser.parse_args(argv)
    settings = exit_on_config_error(lambda: settings_from_args(args))
    return run(settings) if args.command == "run" else status(settings, args.watch)


if __name__ == "__main__":
    sys.exit(main())

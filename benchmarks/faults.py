"""Recovery from faults on the embedded runtime: each component killed with SIGKILL in turn while
three clients send requests one after another (emulated 8-stage LLaMA-7B, static policy).

    python -m benchmarks faults

Per fault, 5 times: the recovery time (from the kill until a request sent after it is answered
200, or for the KeysManager and the autoscaler, which requests do not pass through, until the
component answers again), and what became of the requests in flight: answered 200, answered with
an error (503/504, which the issue allows for the Redis outage only), or not answered at all
(lost: the connection dropped, which only a dying gateway process, the provider, does)."""
from __future__ import annotations

import os
import signal
import time

import numpy as np

from benchmarks.report import SERVING, conditions, scratch, table, write
from contracts.config import Settings, load_settings
from contracts.http_client import GatewayClient
from contracts.paths import REPO_ROOT
from loadgen.closed_loop import ClosedLoop
from runtime import __main__ as control
from runtime.ports import free_port
from state.store import RedisStore

MEASURES = SERVING + ("loadgen",)  # the code measured (benchmarks/freshness.py)

MODEL, REPEATS, GIVE_UP_S = "llama-7b", 5, 120.0
FAULTS = ("stage replica", "entry replica", "redis", "keysmanager", "autoscaler", "provider")


def main() -> dict:
    base = load_settings()
    with scratch("quart-faults-") as home:
        settings = base.replace(home=str(home), models=str(base.models_dir), stack_file=str(REPO_ROOT / "stack-emulated.yml"),
                                gateway_port=free_port(), redis_port=free_port(), keysmanager_port=free_port(),
                                policy="static", cache_stages="none", request_timeout_s=30.0, reclaim_idle_ms=2000)
        try:
            if control.up(settings, timeout=900) != 0:
                raise SystemExit(f"the runtime did not come up; see {home}/logs")
            rows = {fault: [] for fault in FAULTS}
            with ClosedLoop(settings.gateway.url, MODEL, {"tokens": 16}) as load:
                for i in range(REPEATS):
                    for fault in FAULTS:
                        print(f"  {fault}, {i + 1}/{REPEATS}", flush=True)
                        rows[fault].append(_one(settings, load, fault))
        finally:
            control.down(settings)
    return _report(rows)


def _one(settings: Settings, load: ClosedLoop, fault: str) -> dict:
    gateway = GatewayClient(settings.gateway.url)
    _wait(lambda: gateway.healthy() and load.ok_after(time.monotonic() - 1) is not None, "steady state")
    pid = _target(settings, fault)
    before = len(load.outcomes)
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    if fault in ("keysmanager", "autoscaler"):
        _wait(lambda: gateway.healthy() and _restarted(settings, fault, pid), f"{fault} back")
        recovered = time.monotonic()
    else:
        _wait(lambda: load.ok_after(killed) is not None, "an answer after the fault")
        recovered = load.ok_after(killed).answered
    time.sleep(settings.data.request_timeout_s / 10)
    # The requests in flight at the kill, and those sent until recovery.
    around = [o for o in load.outcomes[before:] if o.sent <= recovered] + \
             [o for o in load.outcomes[:before] if o.answered >= killed]
    for o in around:
        if o.status != 200:
            print(f"    {o.status}: {str(o.body.get('error', ''))[:120]}", flush=True)
    return {"recovery_s": recovered - killed, "ok": sum(o.status == 200 for o in around),
            "errors": sum(o.status not in (0, 200) for o in around), "lost": sum(o.status == 0 for o in around),
            "error_kinds": sorted({f"{o.status} {str(o.body.get('error', ''))[:80]}" for o in around if o.status != 200})}


def _target(settings: Settings, fault: str) -> int:
    if fault == "stage replica":
        return RedisStore.from_url(settings.redis_url).live_replicas(MODEL, 3)[0].pid
    fragment = {"entry replica": "functions/entry", "redis": "redis-server", "keysmanager": "-m keysmanager ",
                "autoscaler": "-m autoscaler run", "provider": "-m runtime.server"}[fault]
    (pid,) = [pid for pid, cmd in control.processes(settings).items() if fragment in cmd]
    return pid


def _restarted(settings: Settings, fault: str, old: int) -> bool:
    try:
        return _target(settings, fault) != old
    except ValueError:   # not there (yet)
        return False


def _wait(predicate, what: str) -> None:
    deadline = time.monotonic() + GIVE_UP_S
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit(f"gave up waiting for {what} after {GIVE_UP_S:g} s")
        time.sleep(0.05)


def _report(rows: dict[str, list[dict]]) -> dict:
    figures, lines = [], []
    for fault, runs in rows.items():
        recovery = [r["recovery_s"] for r in runs]
        lost, errors, ok = (sum(r[k] for r in runs) for k in ("lost", "errors", "ok"))
        lines.append([fault, float(np.median(recovery)), float(np.max(recovery)), ok, errors, lost])
        kinds = sorted({k for r in runs for k in r["error_kinds"]})
        figures += [{"name": f"{fault}: kinds of errors", "value": kinds, "unit": "status and message"},
                    {"name": f"{fault}: recovery median", "value": round(float(np.median(recovery)), 3), "unit": "s"},
                    {"name": f"{fault}: recovery max", "value": round(float(np.max(recovery)), 3), "unit": "s"},
                    {"name": f"{fault}: requests answered 200 around the faults", "value": ok, "unit": "requests"},
                    {"name": f"{fault}: requests answered with an error", "value": errors, "unit": "requests"},
                    {"name": f"{fault}: requests lost (no answer)", "value": lost, "unit": "requests"}]
    print(table(f"SIGKILL during closed-loop load (3 clients, emulated {MODEL}, 8 stages), {REPEATS} times each",
                ["fault", "recovery p50 s", "max s", "200s", "errors", "lost"], lines))
    write("faults", figures, conditions(model=MODEL, stages=8, emulated=True, repeats=REPEATS, clients=3,
                                        policy="static", request_timeout_s=30.0, reclaim_idle_ms=2000))
    return {"figures": figures}


if __name__ == "__main__":
    main()

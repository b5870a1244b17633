"""Trace-replay load generator.

    python -m loadgen replay  --model llama-7b --arrivals gamma --rate 20 --cv 4 --duration 60
        replays against a running runtime (`make up`) and writes a report
    python -m loadgen compare --stack stack-emulated.yml --model llama-7b --policies quart,static
        starts a fresh runtime per policy, replays the same schedule against each, one report
    python -m loadgen replay --openai http://127.0.0.1:8000 --model smollm2 --max-new-tokens 16
        replays a generative model's schedule against any OpenAI-compatible server (vLLM, this
        project's own `/v1`): streamed completions, TTFT and TPOT as the client sees them

Arrivals: --arrivals gamma (--rate, --cv), poisson (--rate), azure (--trace
invocations_per_function_md.anon.d01.csv, --functions N picked with the seed and mapped round
robin to the models, each minute spread with Gamma gaps of --cv, --minute-s to compress time,
--scale to scale counts, --start-minute/--minutes for a window), or burstgpt (--trace
BurstGPT_1.csv, --burstgpt-model ChatGPT, --time-scale to compress time; prompt and answer
lengths come from the trace). Reports go to --out (default <home>/reports/<time>)."""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from autoscaler.policy.controller import POLICIES
from contracts.config import Settings, add_arguments, exit_on_config_error, settings_from_args
from contracts.http_client import GatewayClient, HttpClient
from contracts.stack import pipelines, read_stack
from loadgen import arrivals as arr
from loadgen.client import FUNCTION_PATH, OPENAI_PATH
from loadgen.client import run as replay
from loadgen.metrics import summarize
from loadgen.report import write
from loadgen.requests import PromptPool, Request, as_openai, build, kind_of
from loadgen.timeline import Sampler, stage_arrivals, timeline
from state.store import RedisStore


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m loadgen", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", choices=("replay", "compare"))
    p.add_argument("--model", default="llama-7b", help="model(s) to call, comma-separated")
    add_arrival_arguments(p)
    p.add_argument("--max-new-tokens", type=int, default=1, help="answer length where no trace gives one")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--params", action="append", default=[], metavar="POLICY=JSON",
                   help='compare: one policy\'s QUART_POLICY_PARAMS, e.g. inferline=\'{"plan_rps": 20, "plan_cv": 4}\'')
    p.add_argument("--tail", type=float, default=10.0, help="seconds sampled after the last request")
    p.add_argument("--label", default=None, help="replay: the run's name in the report")
    p.add_argument("--openai", default=None, metavar="URL",
                   help="replay: against this OpenAI-compatible server's /v1/completions instead of the gateway")
    p.add_argument("--out", default=None)
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--tpot-slo-ms", type=float, default=None,
                   help="the model's TPOT SLO (default: 2x its warm TPOT, as HydraServe sets it)")
    add_arguments(p, "home", "models", "gateway_port", "redis_port", "stack_file", "slo_s", "window_s",
                  "tick_s", "virtual_servers")
    return p.parse_args(argv)


def add_arrival_arguments(p: argparse.ArgumentParser) -> None:
    """The arrival-process options (also the cluster simulator's)."""
    p.add_argument("--arrivals", default="gamma", choices=("gamma", "poisson", "azure", "burstgpt"))
    p.add_argument("--rate", type=float, default=10.0, help="requests per second (gamma, poisson)")
    p.add_argument("--cv", type=float, default=1.0, help="inter-arrival CV (gamma; within a minute for azure)")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of trace (gamma, poisson)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trace", help="the Azure or BurstGPT CSV file")
    p.add_argument("--functions", type=int, default=1, help="Azure functions to replay")
    p.add_argument("--minute-s", type=float, default=60.0, help="Azure: seconds one trace minute lasts")
    p.add_argument("--scale", type=float, default=1.0, help="Azure: multiply invocation counts")
    p.add_argument("--start-minute", type=int, default=0)
    p.add_argument("--minutes", type=int, default=None)
    p.add_argument("--burstgpt-model", default=None, help="BurstGPT: keep rows of this model")
    p.add_argument("--time-scale", type=float, default=1.0, help="BurstGPT: divide times by this")
    p.add_argument("--limit", type=int, default=None, help="BurstGPT: at most this many rows")


def arrival_times(a: argparse.Namespace, models: list[str]) -> tuple[dict, dict | None, dict | None]:
    """Per model: arrival times, and prompt and answer lengths where the trace has them."""
    if a.arrivals in ("gamma", "poisson"):
        cv = 1.0 if a.arrivals == "poisson" else a.cv
        return {m: arr.gamma_arrivals(a.rate / len(models), cv, a.duration, a.seed + i)
                for i, m in enumerate(models)}, None, None
    if not a.trace:
        raise SystemExit(f"--arrivals {a.arrivals} needs --trace PATH (see python -m loadgen --help)")
    if a.arrivals == "azure":
        picked = arr.pick_functions(arr.read_azure(a.trace), a.functions, a.seed)
        times: dict[str, list[np.ndarray]] = {m: [] for m in models}
        for i, fn in enumerate(picked):
            times[models[i % len(models)]].append(arr.azure_arrivals(
                fn.per_minute, a.cv, a.seed + i, a.minute_s, a.scale, a.start_minute, a.minutes))
        return {m: np.sort(np.concatenate(ts)) if ts else np.empty(0) for m, ts in times.items()}, None, None
    rows = arr.read_burstgpt(a.trace, a.burstgpt_model, limit=a.limit, time_scale=a.time_scale)
    split = {m: rows[i::len(models)] for i, m in enumerate(models)}
    return ({m: np.array([r.at for r in rs]) for m, rs in split.items()},
            {m: np.array([r.request_tokens for r in rs]) for m, rs in split.items()},
            {m: np.array([r.response_tokens for r in rs]) for m, rs in split.items()})


def make_requests(a: argparse.Namespace, settings: Settings) -> list[Request]:
    models = [m.strip() for m in a.model.split(",") if m.strip()]
    times, prompt_tokens, answer_tokens = arrival_times(a, models)
    pool = None if all(kind_of(m) == "emulated" for m in models) else PromptPool.sharegpt(seed=a.seed)
    requests = build(times, pool, a.seed, a.max_new_tokens, prompt_tokens, answer_tokens,
                     max_emulated_tokens=settings.limits.max_prompt_tokens)
    if not requests:
        raise SystemExit("the schedule is empty: no arrivals in the chosen window")
    return requests


@dataclass
class Profile:
    """A model unloaded: the medians of sequential requests after two warm-ups."""
    latency_s: float
    ttft_s: float | None    # generative models only
    tpot_s: float | None


def profile_latency(url: str, request: Request, path: str = FUNCTION_PATH, count: int = 8) -> Profile:
    """The model unloaded: `count` requests one at a time after two warm-ups, sent and timed as
    the replay sends and times them."""
    sent = [replay(url, [replace(request, at=0.0)], progress=False, path=path)[0][0] for _ in range(count + 2)]
    if failed := next((r for r in sent if not r.ok), None):
        raise SystemExit(f"profiling {request.model} failed: {failed.status} {failed.error}")
    kept = sent[2:]
    median = (lambda xs: float(np.median(xs)) if xs else None)
    return Profile(float(np.median([r.latency_s for r in kept])), median([r.ttft_s for r in kept if r.ttft_s >= 0]),
                   median([r.tpot_s for r in kept if r.tpot_s >= 0 and r.output_tokens > 1]))


def one_run(a: argparse.Namespace, settings: Settings, requests: list[Request]) -> dict:
    """Profile, replay with timelines sampled, and summarise, against the runtime `settings` names."""
    model = requests[0].model
    found = pipelines(read_stack(Path(settings.stack_file))).get(model)
    stages = found.num_stages if found else 0
    store = RedisStore.from_url(settings.redis_url)
    profiled = profile_latency(settings.gateway.url, requests[0])
    tpot_slo = _tpot_slo(a, profiled)
    sampler = Sampler(store, model, stages).start()
    try:
        records, start = replay(settings.gateway.url, requests, timeout_s=settings.data.request_timeout_s + 30,
                                progress=not a.no_progress)
        time.sleep(a.tail)
    finally:
        sampler.stop()
    duration = max(req.at for req in requests) or 1.0
    t = timeline(sampler, stage_arrivals(store, model, stages, start), start)
    return {"summary": summarize(records, profiled.latency_s, duration, sampler.replica_seconds(),
                                 warm_ttft_s=profiled.ttft_s, tpot_slo_s=tpot_slo),
            "timeline": t, "records": records}


def openai_run(a: argparse.Namespace, settings: Settings, requests: list[Request]) -> dict:
    """Profile and replay against the OpenAI-compatible server at --openai, and summarise (no
    timeline: its replicas and queues are not this project's to read)."""
    url = a.openai.rstrip("/")
    try:
        requests = [as_openai(r) for r in requests]
    except ValueError as exc:
        raise SystemExit(f"--openai: {exc}") from None
    if not HttpClient(url, timeout=10).healthy("/v1/models"):
        raise SystemExit(f"no OpenAI-compatible server answers GET {url}/v1/models")
    profiled = profile_latency(url, requests[0], OPENAI_PATH)
    records, _ = replay(url, requests, timeout_s=settings.data.request_timeout_s + 30, progress=not a.no_progress,
                        path=OPENAI_PATH)
    duration = max(req.at for req in requests) or 1.0
    return {"summary": summarize(records, profiled.latency_s, duration, warm_ttft_s=profiled.ttft_s,
                                 tpot_slo_s=_tpot_slo(a, profiled)),
            "timeline": {}, "records": records}


def _tpot_slo(a: argparse.Namespace, profiled: Profile) -> float | None:
    """--tpot-slo-ms, else twice the unloaded TPOT (HydraServe's rule)."""
    return a.tpot_slo_ms / 1000.0 if a.tpot_slo_ms else (2.0 * profiled.tpot_s if profiled.tpot_s else None)


def conditions(a: argparse.Namespace, settings: Settings, requests: list[Request]) -> dict:
    return {"model": a.model, "arrivals": a.arrivals, "requests": len(requests),
            **({"rate_rps": a.rate, "cv": a.cv if a.arrivals == "gamma" else 1.0, "duration_s": a.duration}
               if a.arrivals in ("gamma", "poisson") else {"trace": Path(a.trace).name}),
            "seed": a.seed, "slo_s": settings.autoscaler.slo_s, "tick_s": settings.autoscaler.tick_s, "window_s": settings.autoscaler.window_s,
            "emulated": all(kind_of(m) == "emulated" for m in a.model.split(",")),
            **({"openai_server": a.openai} if a.openai else {})}


def policy_params(items: list[str]) -> dict[str, dict]:
    """--params POLICY=JSON, each a JSON object; SystemExit naming a malformed one."""
    out = {}
    for item in items:
        policy, _, raw = item.partition("=")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise SystemExit(f"--params {item!r}: not JSON ({exc})") from None
        if not isinstance(value, dict):
            raise SystemExit(f"--params {item!r}: a JSON object, please")
        out[policy.strip()] = value
    return out


def compare(a: argparse.Namespace, base: Settings, requests: list[Request]) -> dict[str, dict]:
    from runtime import __main__ as control
    from runtime.ports import free_port
    runs = {}
    params = policy_params(a.params)
    for policy in [p.strip() for p in a.policies.split(",") if p.strip()]:
        home = tempfile.mkdtemp(prefix=f"quart-{policy}-")
        settings = base.replace(home=home, models=str(base.models_dir), gateway_port=free_port(),
                                redis_port=free_port(), keysmanager_port=free_port(), policy=policy,
                                policy_params=params.get(policy, base.autoscaler.policy_params))
        print(f"{policy}: starting a fresh runtime ...", flush=True)
        try:
            if control.up(settings, timeout=600) != 0:
                raise SystemExit(f"the runtime did not come up for {policy}; see {home}/logs")
            print(f"{policy}: replaying {len(requests)} requests", flush=True)
            runs[policy] = one_run(a, settings, requests)
        finally:
            control.down(settings)
            shutil.rmtree(home, ignore_errors=True)
    return runs


def main(argv: list[str] | None = None) -> int:
    a = parse(sys.argv[1:] if argv is None else argv)
    settings = exit_on_config_error(lambda: settings_from_args(a))
    settings = settings.replace(stack_file=str(Path(settings.stack_file).resolve()))
    requests = make_requests(a, settings)
    out = Path(a.out) if a.out else Path(settings.home) / "reports" / time.strftime("%Y%m%d-%H%M%S")
    if a.openai:
        if a.command != "replay":
            raise SystemExit("--openai goes with replay (compare starts this project's runtimes)")
        runs = {a.label or "openai": openai_run(a, settings, requests)}
    elif a.command == "compare":
        runs = compare(a, settings, requests)
    else:
        if not GatewayClient(settings.gateway.url).healthy():
            raise SystemExit(f"no gateway at {settings.gateway.url}: start one with `make up`")
        runs = {a.label or settings.autoscaler.policy: one_run(a, settings, requests)}
    path = write(out, f"Replay of {a.model}", conditions(a, settings, requests), runs, Path(settings.home))
    print(path.read_text().split("![")[0])
    print(f"report: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

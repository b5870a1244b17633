"""A soak: the embedded runtime with the default stack (SmolLM2 in 4 stages, MiniLM in 3, the QUART
policy) under steady closed-loop load for a long time, every process's resident memory sampled.

    python -m benchmarks soak [--minutes 30]

Load: two clients generating 16 tokens from ShareGPT-like prompts, one embedding four sentences,
each sending its next request when the last one is answered (the rate the runtime sustains).
RSS (VmRSS) of every process of the runtime every 30 s, by role: the guardian, the provider,
Redis, the KeysManager, the autoscaler, each entry and stage replica (by function and pid). The
goal is flat memory: each process's RSS at the end within 5 % of its RSS after warm-up (the first
sample after WARMUP_S, when caches, allocator pools and the first compilations are in place); and
over the second half, which tells a process that fills a bounded store (Redis's capped streams)
from one that leaks. Beside Redis's RSS, what it holds: INFO memory's used_memory, DBSIZE and each
stream's length, so that its growth is explained by the streams it fills (or not). Every sample is
in the JSON."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from benchmarks.report import RESULTS, SERVING, conditions, scratch, table, write
from contracts.config import Settings, load_settings
from contracts.paths import REPO_ROOT
from loadgen.closed_loop import ClosedLoop
from runtime import __main__ as control
from runtime.ports import free_port
from state.store import RedisStore

MEASURES = SERVING + ("loadgen",)  # the code measured (benchmarks/freshness.py)

SAMPLE_S, WARMUP_S, GOAL = 30.0, 120.0, 0.05
PROMPT = "Explain in a few sentences why the sky is blue and why sunsets are red."


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--minutes", type=float, default=30.0)
    args = parser.parse_args(argv or [])
    base = load_settings()
    with scratch("quart-soak-") as home:
        settings = base.replace(home=str(home), models=str(base.models_dir), stack_file=str(REPO_ROOT / "stack.yml"),
                                gateway_port=free_port(), redis_port=free_port(), keysmanager_port=free_port())
        samples: list[tuple[float, dict[str, int]]] = []
        held: list[tuple[float, dict]] = []
        try:
            if control.up(settings, timeout=900) != 0:
                raise SystemExit(f"the runtime did not come up; see {home}/logs")
            generate = {"prompt": PROMPT, "max_new_tokens": 16, "ignore_eos": True}
            embed = {"inputs": ["a cat sits on the mat", "pipelines", "serverless stages", "soak"]}
            started = time.monotonic()
            with ClosedLoop(settings.gateway.url, "smollm2", generate, clients=2) as gen, \
                    ClosedLoop(settings.gateway.url, "minilm", embed, clients=1) as emb:
                while (elapsed := time.monotonic() - started) < args.minutes * 60:
                    samples.append((elapsed, _rss_by_role(settings)))
                    held.append((elapsed, RedisStore.from_url(settings.redis_url).holdings()))
                    print(f"  {elapsed / 60:5.1f} min: {sum(o.status == 200 for o in gen.outcomes + emb.outcomes)} "
                          f"answered, {sum(samples[-1][1].values()) / 2 ** 20:.0f} MiB in all", flush=True)
                    time.sleep(SAMPLE_S)
                samples.append((time.monotonic() - started, _rss_by_role(settings)))
                held.append((samples[-1][0], RedisStore.from_url(settings.redis_url).holdings()))
            outcomes = gen.outcomes + emb.outcomes
        finally:
            control.down(settings)
    return _report(samples, held, outcomes, args.minutes)


def _rss_by_role(settings: Settings) -> dict[str, int]:
    """Resident bytes of each process of the runtime, named by what it is."""
    store = RedisStore.from_url(settings.redis_url)
    replicas = {}
    for model, stages in (("smollm2", 4), ("minilm", 3)):
        for stage in range(stages):
            for x in store.live_replicas(model, stage):
                replicas[x.pid] = f"{model}-s{stage} replica {x.pid}"
    out = {}
    for pid, cmd in control.processes(settings).items():
        role = replicas.get(pid) or _role(cmd, pid)
        rss = _rss(pid)
        if rss is not None:
            out[role] = rss
    return out


def _role(cmd: str, pid: int) -> str:
    for fragment, role in (("runtime.guardian", "guardian"), ("runtime.server", "provider"),
                           ("redis-server", "redis"), ("-m autoscaler", "autoscaler")):
        if fragment in cmd:
            return role
    if "functions/entry" in cmd:
        return f"{_environ(pid).get('QUART_MODEL', '?')} entry {pid}"
    return f"keysmanager or zygote {pid}"


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
    except OSError:
        return {}
    return dict(item.partition("=")[::2] for item in raw.split("\0") if "=" in item)


def _rss(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _report(samples: list[tuple[float, dict[str, int]]], held: list[tuple[float, dict]], outcomes: list,
            minutes: float) -> dict:
    start = next((s for t, s in samples if t >= WARMUP_S), samples[0][1])
    half = next((s for t, s in samples if t >= samples[-1][0] / 2), start)
    end = samples[-1][1]
    rows, figures, worst = [], [], 0.0
    for role in sorted(set(start) & set(end)):
        growth = end[role] / start[role] - 1
        worst = max(worst, growth)
        second_half = end[role] / half[role] - 1 if role in half else float("nan")
        rows.append([role, start[role] / 2 ** 20, end[role] / 2 ** 20, f"{growth * 100:+.1f} %",
                     f"{second_half * 100:+.1f} %"])
        figures.append({"name": f"{role}: RSS after warm-up / at half time / at the end",
                        "value": [round(x[role] / 2 ** 20, 1) if role in x else None for x in (start, half, end)],
                        "unit": "MiB"})
    figures.append({"name": "RSS of every process, every sample", "unit": "MiB by seconds since the start",
                    "value": [{"t": round(t, 1), **{k: round(v / 2 ** 20, 1) for k, v in s.items()}} for t, s in samples]})
    figures += _redis_figures(held, samples[-1][0])
    ok = sum(o.status == 200 for o in outcomes)
    errors = sorted({f"{o.status} {str(o.body.get('error', ''))[:80]}" for o in outcomes if o.status != 200})
    figures += [{"name": "largest RSS growth of a process", "value": round(worst * 100, 2), "unit": "%"},
                {"name": "requests answered 200", "value": ok, "unit": "requests"},
                {"name": "requests not answered 200", "value": len(outcomes) - ok, "unit": "requests"},
                {"name": "kinds of errors", "value": errors, "unit": "status and message"},
                {"name": "processes that ran from warm-up to the end", "value": len(rows), "unit": "processes"}]
    print(table(f"Soak: {minutes:g} min, closed loop (2 generating, 1 embedding), RSS after {WARMUP_S:g} s "
                f"and at the end", ["process", "MiB after warm-up", "MiB at end", "growth", "second half"], rows))
    print(f"largest growth {worst * 100:+.1f} % (goal: within {GOAL * 100:g} %); {ok} answered 200, "
          f"{len(outcomes) - ok} not")
    write("soak", figures, conditions(minutes=minutes, stack="stack.yml", policy="quart", clients=3,
                                      sample_s=SAMPLE_S, warmup_s=WARMUP_S))
    _plot(samples)
    return {"figures": figures}


def _redis_figures(held: list[tuple[float, dict]], last_s: float) -> list[dict]:
    """Redis's used memory, keys and stream entries after warm-up, at half time and at the end,
    the streams that grew most, and every sample."""
    points = [next((h for t, h in held if t >= WARMUP_S), held[0][1]),
              next((h for t, h in held if t >= last_s / 2), held[0][1]), held[-1][1]]
    growth = {k: n - points[0]["streams"].get(k, 0) for k, n in points[-1]["streams"].items()}
    grown = sorted(growth.items(), key=lambda kv: -kv[1])[:10]
    print(table("Redis after warm-up, at half time, at the end", ["what", "after warm-up", "half", "end"],
                [["used_memory (MiB)", *(p["used_memory"] / 2 ** 20 for p in points)],
                 ["keys", *(p["keys"] for p in points)],
                 ["stream entries", *(sum(p["streams"].values()) for p in points)]]))
    return [{"name": "Redis used_memory (INFO memory) after warm-up / at half time / at the end", "unit": "MiB",
             "value": [round(p["used_memory"] / 2 ** 20, 2) for p in points]},
            {"name": "Redis keys (DBSIZE) after warm-up / at half time / at the end", "unit": "keys",
             "value": [p["keys"] for p in points]},
            {"name": "Redis stream entries after warm-up / at half time / at the end", "unit": "entries",
             "value": [sum(p["streams"].values()) for p in points]},
            {"name": "streams that grew most after warm-up", "unit": "entries added",
             "value": [f"{k}: +{n}" for k, n in grown if n > 0]},
            {"name": "Redis every sample", "unit": "bytes, keys, entries by seconds since the start",
             "value": [{"t": round(t, 1), "used_memory": h["used_memory"], "keys": h["keys"],
                        "stream_entries": sum(h["streams"].values())} for t, h in held]}]


def _plot(samples: list[tuple[float, dict[str, int]]]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(10, 5))
    roles = sorted({role for _, s in samples for role in s})
    for role in roles:
        points = [(t / 60, s[role] / 2 ** 20) for t, s in samples if role in s]
        ax.plot(*zip(*points), lw=1, label=role if len(roles) <= 20 else None)
    ax.axvline(WARMUP_S / 60, color="grey", lw=0.8)
    ax.set(xlabel="minutes", ylabel="RSS (MiB)", title="resident memory per process during the soak")
    if len(roles) <= 20:
        ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(RESULTS / "soak.png", dpi=110)


if __name__ == "__main__":
    main(sys.argv[1:])

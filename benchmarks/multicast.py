"""λScale's multicast measured (§7.2): one stage of SmolLM2 split in two (about 325 MB) sent from
the k servers that hold it to the rest of N, each server a KeysManager process of its own on this
machine with its uplink paced to --bandwidth (keysmanager/pacing.py), so that the two cores are
not what bounds it (the JSON records the CPU a byte moved cost). Plans (scheduler/multicast.py),
all run by the same receivers (keysmanager/blocks.py, runtime/multicast.py):

  binomial     λScale's: the binomial pipeline, k sub-groups in Algorithm 1's block orders
  binary tree  FaaSNet's: each server's two children take every block from it in turn
  unicast      one holder sends the whole stage to each server in turn, which is also what N
               servers reading it from one store at this link speed take

Each time (until every target holds the stage, checked against the manifest's piece hashes) is
set beside its plan's rounds × M/(b·B), and λScale's (b + ⌈log₂N⌉ − 1)·M/(b·B). Goals: binomial
within 1.2× of that, and at least 1.5× faster than the binary tree at N = 8 (λScale measured up to
1.82× over FaaSNet).

    python -m benchmarks multicast [--bandwidth 2e7] [--reps 3] [--servers 8]

`--servers` runs only the configurations of those N (its result is multicast_n<N>.json), e.g. N = 8
at a link speed low enough for 8 servers' transfers on two cores.
"""
from __future__ import annotations

import argparse
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from benchmarks.report import RESULTS, conditions, mean_ci95, table, verdict, write
from contracts.config import Settings, child_environment, load_settings
from contracts.paths import REPO_ROOT
from keysmanager.client import KeysClient
from models.manifest import Manifest, StageInfo
from runtime import multicast
from runtime.ports import free_port
from runtime.redis_server import start_redis
from scheduler.multicast import MulticastPlan, binary_tree_plan, elbow_blocks, lower_bound_rounds, plan, unicast_plan

MEASURES = ("keysmanager/blocks.py", "keysmanager/api.py", "keysmanager/pacing.py", "runtime/multicast.py",
            "scheduler/multicast.py")  # the code measured (benchmarks/freshness.py)

MODEL, SOURCE, STAGES = "smollm2-2", "smollm2", 2
HOLDERS = ("vm-0", "vm-1")  # both hold the model on disk (k = 2 uses both)
TARGETS = tuple(f"vm-{i}" for i in range(2, 9))
BINOMIAL = [(n, 1, b) for n in (2, 4, 8) for b in (4, 8, 16, 32)] + [(4, 2, 16), (8, 2, 16)]
BASELINES = [(n, 16) for n in (4, 8)]
HEADLINE_N, HEADLINE_B = 8, 16


class Servers:
    """A redis-server and one KeysManager a server; the holders share one models folder, the
    targets have empty ones and read the manifest from vm-0 (their model store)."""

    def __init__(self, settings: Settings, work: Path, bandwidth: float) -> None:
        port = free_port()
        self.redis = start_redis("127.0.0.1", port, work / "redis", work / "redis.log")
        names = HOLDERS + TARGETS
        ports = {name: free_port() for name in names}
        self.clients, self.procs = {}, {}
        for name in names:
            home = work / name
            (home / "models").mkdir(parents=True)
            s = settings.replace(
                home=str(home), server=name, keysmanager_port=ports[name], redis_port=port, server_bandwidth=bandwidth,
                internal_token="multicast-benchmark", log_level="WARNING",
                warm_runtime=False,  # no runtime zygote importing torch beside the transfers
                models=str(settings.models_dir if name in HOLDERS else home / "models"),
                models_url="" if name in HOLDERS else f"http://127.0.0.1:{ports['vm-0']}")
            self.clients[name] = KeysClient.for_settings(s, timeout=60)
            self.procs[name] = subprocess.Popen([sys.executable, "-m", "keysmanager"], env=child_environment(s),
                                                cwd=REPO_ROOT, stdout=open(home / "keysmanager.log", "ab"),
                                                stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while not all(c.healthy() for c in self.clients.values()):
            if time.monotonic() > deadline:
                raise RuntimeError("the KeysManagers did not come up")
            time.sleep(0.2)

    def cpu_s(self) -> float:
        return sum(sum(psutil.Process(p.pid).cpu_times()[:2]) for p in self.procs.values())

    def run(self, p: MulticastPlan, info: StageInfo) -> dict:
        """One multicast from scratch: seconds until every target holds the stage, and the CPU
        seconds all servers spent."""
        targets = [t for g in p.groups for t in g[1:]]
        for target in targets:
            self.clients[target].cancel_receptions(MODEL)
        cpu, started = self.cpu_s(), time.time()
        multicast.start(self.clients, p, MODEL, info)
        views = multicast.wait(self.clients, targets, info.shard, 1800)
        if any(v.get("state") != "done" for v in views.values()):
            raise RuntimeError(f"a multicast did not complete: {views}")
        return {"seconds": max(v["finished"] for v in views.values()) - started, "cpu_s": self.cpu_s() - cpu,
                "refetched": sum(v["refetched"] for v in views.values()),
                "rerouted": sum(v["rerouted"] for v in views.values())}

    def stop(self) -> None:
        for proc in self.procs.values():
            proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            proc.wait(timeout=60)
        self.redis.terminate()
        self.redis.wait()


def plans(n: int, k: int, blocks: int) -> dict[str, MulticastPlan]:
    targets = list(TARGETS[:n - k])
    out = {"binomial": plan(list(HOLDERS[:k]), targets, blocks)}
    if k == 1 and (n, blocks) in BASELINES:
        out["binary tree"] = binary_tree_plan(HOLDERS[0], targets, blocks)
        out["unicast"] = unicast_plan(HOLDERS[0], targets, blocks)
    return out


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    for n in sorted({r["n"] for r in rows}):
        mine = sorted((r for r in rows if r["plan"] == "binomial" and r["n"] == n and r["k"] == 1), key=lambda r: r["b"])
        line, = left.plot([r["b"] for r in mine], [r["seconds"] for r in mine], marker="o", label=f"N={n} measured")
        left.plot([r["b"] for r in mine], [r["lambdascale_s"] for r in mine], ls="--", color=line.get_color(),
                  label=f"N={n} (b+log2N-1)M/(bB)")
    left.set_xscale("log", base=2)
    left.set_xlabel("blocks b")
    left.set_ylabel("seconds until all hold it")
    left.set_title("binomial pipeline, k = 1")
    left.legend(fontsize=7)
    at8 = [r for r in rows if r["n"] == HEADLINE_N and r["b"] == HEADLINE_B]
    labels = [f"{r['plan']} k={r['k']}" for r in at8]
    right.bar(labels, [r["seconds"] for r in at8], label="measured")
    right.scatter(labels, [r["predicted_s"] for r in at8], color="black", zorder=3, label="plan's prediction")
    right.set_title(f"N = {HEADLINE_N}, b = {HEADLINE_B}")
    right.legend(fontsize=7)
    for ax in (left, right):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bandwidth", type=float, default=2e7, help="bytes/s of each server's uplink")
    parser.add_argument("--reps", type=int, default=3, help="runs of the headline plans (N = 8, b = 16)")
    parser.add_argument("--servers", type=int, nargs="+", choices=(2, 4, 8), help="only these N")
    parser.add_argument("--no-unicast", action="store_true", help="leave out unicast (its time is (N-1) M/B)")
    args = parser.parse_args(argv)
    settings = load_settings()
    from models.partition import ensure_partitioned
    manifest: Manifest = ensure_partitioned(settings.models_dir, MODEL, STAGES, SOURCE)
    info = manifest.stages[0]
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="quart-multicast-") as work:
        servers = Servers(settings, Path(work), args.bandwidth)
        try:
            for n, k, blocks in [c for c in BINOMIAL if not args.servers or c[0] in args.servers]:
                for name, p in plans(n, k, blocks).items():
                    if name == "unicast" and args.no_unicast:
                        continue
                    reps = args.reps if (n, blocks) == (HEADLINE_N, HEADLINE_B) and k == 1 else 1
                    runs = [servers.run(p, info) for _ in range(reps)]
                    block_s = info.bytes / blocks / args.bandwidth
                    row = {"plan": name, "n": n, "k": k, "b": blocks, "rounds": len(p.rounds),
                           "seconds": statistics.median(r["seconds"] for r in runs), "runs": [r["seconds"] for r in runs],
                           "predicted_s": len(p.rounds) * block_s, "lambdascale_s": lower_bound_rounds(n, blocks) * block_s,
                           "cpu_ns_per_byte": statistics.median(r["cpu_s"] for r in runs) * 1e9 / (info.bytes * (n - k)),
                           "refetched": sum(r["refetched"] for r in runs), "rerouted": sum(r["rerouted"] for r in runs)}
                    rows.append(row)
                    print(f"{name:12s} N={n} k={k} b={blocks:2d}: {row['seconds']:.2f} s "
                          f"(plan {row['predicted_s']:.2f} s)", flush=True)
        finally:
            servers.stop()
    report(rows, info, args)


def report(rows: list[dict], info: StageInfo, args: argparse.Namespace) -> None:
    lines = [[r["plan"], r["n"], r["k"], r["b"], r["rounds"], r["seconds"], r["predicted_s"],
              f"{r['seconds'] / r['lambdascale_s']:.2f}x" if r["plan"] == "binomial" else "", round(r["cpu_ns_per_byte"], 2)]
             for r in rows]
    print(table(f"Seconds until every target holds a {info.bytes / 1e6:.0f} MB stage, links {args.bandwidth / 1e6:g} MB/s",
                ["plan", "N", "k", "b", "rounds", "measured s", "plan s", "vs λScale's", "CPU ns/byte"], lines))
    figures = [{"name": f"{r['plan']}, N={r['n']}, k={r['k']}, b={r['b']}", "value": round(r["seconds"], 3), "unit": "s",
                **{key: r[key] for key in ("rounds", "runs", "predicted_s", "lambdascale_s", "cpu_ns_per_byte",
                                           "refetched", "rerouted")}} for r in rows]
    binomial = [r for r in rows if r["plan"] == "binomial"]
    worst = max(r["seconds"] / r["lambdascale_s"] for r in binomial)
    figures.append({"name": "binomial over (b + ceil(log2 N) - 1) M/(b B), worst of all configurations", "value": round(worst, 3),
                    "unit": "ratio", "goal": "<= 1.2", "met": worst <= 1.2})
    for n in sorted({r["n"] for r in binomial}):
        measured = {r["b"]: r["seconds"] for r in binomial if r["n"] == n and r["k"] == 1}
        elbow = elbow_blocks(measured)
        figures.append({"name": f"elbow block count, N={n}", "value": elbow, "unit": "blocks",
                        "rule": "the fewest b past which doubling gains under 10 % (λScale §7.6)",
                        "measured_s": measured})
        print(f"N = {n}: the elbow is b = {elbow} (more blocks gain under 10 %)")
    head = {r["plan"]: r for r in rows if (r["n"], r["k"], r["b"]) == (HEADLINE_N, 1, HEADLINE_B)}
    print(f"binomial within {worst:.2f}x of λScale's model at worst (goal <= 1.2)")
    if "binary tree" in head:
        ratios = [t / b for t, b in zip(head["binary tree"]["runs"], head["binomial"]["runs"])]
        mean, half = mean_ci95(ratios)
        met = verdict(mean, half, 1.5, at_least=True)
        figures.append({"name": f"binary tree over binomial, N={HEADLINE_N}, b={HEADLINE_B}", "value": round(mean, 3),
                        "unit": "ratio", "ci95": round(half, 3), "runs": len(ratios), "goal": ">= 1.5", "verdict": met,
                        "paper": "up to 1.82x over FaaSNet (λScale §7.2)"})
        print(f"binary tree / binomial at N = {HEADLINE_N}: {mean:.2f}x ± {half:.2f} over {len(ratios)} runs "
              f"(goal >= 1.5: {met})")
    name = "multicast" if not args.servers else "multicast_n" + "-".join(map(str, args.servers))
    png = RESULTS / f"{name}.png"
    plot(rows, png)
    path = write(name, figures, conditions(
        stage_bytes=info.bytes, bandwidth_bytes_per_s=args.bandwidth, servers=len(HOLDERS + TARGETS),
        pieces=len(info.pieces), reps_headline=args.reps, plot=png.name, model=f"{SOURCE}, {STAGES} stages, stage 0",
        n_run=args.servers or [2, 4, 8], unicast=not args.no_unicast))
    print(f"wrote {path} and {png}")


if __name__ == "__main__":
    main(sys.argv[1:])

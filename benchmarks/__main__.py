"""`make bench`: every benchmark in turn; each prints its table and writes benchmarks/results/<name>.json.

    python -m benchmarks                            every benchmark
    python -m benchmarks hop generation             those named
    python -m benchmarks generation --model qwen2   one, with its own options (`--help` lists them)
    python -m benchmarks freshness                  which results are older than the code they measure
    python -m benchmarks stale                      every benchmark whose result is stale, in turn
    python -m benchmarks side_by_side --base REV    this working tree against commit REV, alternately
"""
from __future__ import annotations

import signal
import sys

from benchmarks import (
    autoscaler_tick,
    bursts,
    coldstart,
    compile_beside_serving,
    consolidation,
    containers,
    data_plane_cpu,
    execute_while_load,
    faults,
    freshness,
    generation,
    hop,
    idle_cores,
    kv_migration,
    live_dag,
    live_policies,
    loadgen,
    multicast,
    overload,
    peer_start,
    pipeline_overhead,
    placement,
    policies_burst,
    scale_to_zero,
    scaleup,
    side_by_side,
    simulator,
    simulator_coldstart,
    simulator_generation,
    simulator_multicast,
    simulator_out_of_sample,
    simulator_policies,
    simulator_scaleout,
    soak,
    token_anatomy,
)

BENCHMARKS = {"hop": hop.main, "pipeline_overhead": pipeline_overhead.main, "scaleup": scaleup.main,
              "autoscaler_tick": autoscaler_tick.main, "policies_burst": policies_burst.main,
              "placement": placement.main, "loadgen": loadgen.main, "simulator": simulator.main,
              "generation": lambda: generation.main([]), "kv_migration": kv_migration.main,
              "generation_llama1b": lambda: generation.main(["--model", "llama1b"]),
              "simulator_generation": simulator_generation.main, "faults": faults.main,
              "overload": overload.main, "soak": soak.main,
              "containers": lambda: containers.main([]), "coldstart": lambda: coldstart.main([]),
              "scale_to_zero": lambda: scale_to_zero.main([]), "consolidation": lambda: consolidation.main([]),
              "simulator_coldstart": lambda: simulator_coldstart.main([]),
              "simulator_multicast": lambda: simulator_multicast.main([]),
              "simulator_scaleout": lambda: simulator_scaleout.main([]),
              "multicast": lambda: multicast.main([]), "peer_start": lambda: peer_start.main([]),
              "simulator_policies": lambda: simulator_policies.main([]),
              "simulator_out_of_sample": lambda: simulator_out_of_sample.main([]),
              "live_policies": lambda: live_policies.main([]), "live_dag": lambda: live_dag.main([]),
              "data_plane_cpu": lambda: data_plane_cpu.main([]), "bursts": lambda: bursts.main([]),
              "execute_while_load": lambda: execute_while_load.main([]), "token_anatomy": token_anatomy.main,
              "idle_cores": lambda: idle_cores.main([]),
              "idle_cores_prefill": lambda: idle_cores.main(["--mode", "prefill"]),
              "compile_beside_serving": lambda: compile_beside_serving.main([]),
              **{f"generation_{m}": lambda m=m: generation.main(["--model", m]) for m in generation.FAMILY_SHAPES}}
# Those that take options of their own: `python -m benchmarks NAME --option ...`.
WITH_OPTIONS = {"generation": generation.main, "containers": containers.main, "coldstart": coldstart.main,
                "scale_to_zero": scale_to_zero.main, "consolidation": consolidation.main,
                "simulator_coldstart": simulator_coldstart.main, "simulator_policies": simulator_policies.main,
                "simulator_out_of_sample": simulator_out_of_sample.main,
                "live_policies": live_policies.main, "live_dag": live_dag.main, "data_plane_cpu": data_plane_cpu.main,
                "bursts": bursts.main, "soak": soak.main, "multicast": multicast.main, "peer_start": peer_start.main,
                "execute_while_load": execute_while_load.main, "idle_cores": idle_cores.main,
                "compile_beside_serving": compile_beside_serving.main,
                # Not in `make bench`: what it compares against is the caller's to name.
                "side_by_side": side_by_side.main}


def _exit_on_terminate(signum: int, _frame: object) -> None:
    # A benchmark's runtime runs in a session of its own (runtime.guardian), so it outlives a
    # benchmark killed outright and goes on taking cores and memory from the next one. SIGTERM
    # (`timeout`, kill) raises instead, and the benchmark's `finally` stops its runtime.
    raise SystemExit(128 + signum)


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGTERM, _exit_on_terminate)
    if argv[:1] == ["freshness"]:
        return freshness.main(argv[1:])
    if len(argv) > 1 and argv[1].startswith("-"):
        if argv[0] not in WITH_OPTIONS:
            print(f"{argv[0]!r} takes no options; these do: {sorted(WITH_OPTIONS)}", file=sys.stderr)
            return 2
        WITH_OPTIONS[argv[0]](argv[1:])
        return 0
    if argv in (["--help"], ["-h"]):
        print(__doc__ + "\nbenchmarks: " + ", ".join(BENCHMARKS))
        return 0
    if argv == ["stale"]:
        argv = freshness.stale(freshness.freshness(), BENCHMARKS)
        print(f"stale: {' '.join(argv) or 'none'}", flush=True)
        if not argv:
            return 0
    chosen = argv or list(BENCHMARKS)
    unknown = [name for name in chosen if name not in BENCHMARKS]
    if unknown:
        print(f"unknown benchmark(s) {unknown}; choose from {list(BENCHMARKS)}", file=sys.stderr)
        return 2
    for name in chosen:
        print(f"\n### {name}", flush=True)
        BENCHMARKS[name]()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

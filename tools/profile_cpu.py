"""Profile each stage's service time against its CPU count and payload (tokens), fit the CPU
compensator's linear regression per stage, and save the fits where the autoscaler finds them
(<out>/<model>.cpu_fits.json, with the measured samples in <model>.cpu_profile.json: QUART
Fig. 3b's latency against CPUs).

    python -m tools.profile_cpu --model smollm2 --cpus 1,2 --payloads 16,64,256
    python -m tools.profile_cpu --model llama-7b --cpus 1,2,4,8 --out autoscaler/artefacts

A real model runs its stages in this process, one stage at a time, with the CPUs pinned (affinity
and torch threads) for each measurement. An emulated model (models/profiles.py) runs its
emulated stages, whose sleep follows the profile's Amdahl law, at any CPU count."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from autoscaler.policy.compensator import CPUFit, fit_cpu_profile, save_fits
from contracts.artefacts import cpu_fits_name, cpu_profile_name
from contracts.config import Limits, add_arguments, exit_on_config_error, settings_from_args
from models.emulated import EmulatedRunner
from models.profiles import PROFILES, WIDTH


def stage_input(runner, tokens: int) -> dict[str, torch.Tensor]:
    if getattr(runner, "emulated", False):
        return {"hidden": torch.zeros(1, tokens, WIDTH)}
    config = runner.manifest.config
    if runner.modules[0].has_embed:
        return {"input_ids": torch.randint(0, config["vocab_size"], (1, tokens))}
    return {"hidden": torch.randn(1, tokens, config["hidden_size"])}


# The CPUs this process may use when it starts: pinning to c of them always picks from these (a
# pinned process's own affinity would shrink the choice for the next, larger count).
HOST_CPUS = sorted(os.sched_getaffinity(0))


def pin(cpus: int) -> None:
    os.sched_setaffinity(0, HOST_CPUS[:cpus])
    torch.set_num_threads(cpus)


def profile_stage(runner, cpus: list[int], payloads: list[int], repeats: int,
                  set_cpus: Callable[[int], None]) -> list[tuple[float, float, float]]:
    """(cpus, payload, median seconds) per measured point."""
    run = (lambda t: runner.checked_run(t, Limits())) if getattr(runner, "emulated", False) else runner.run
    samples = []
    for c in cpus:
        set_cpus(c)
        for tokens in payloads:
            tensors = stage_input(runner, tokens)
            run(tensors)  # warm-up
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                run(tensors)
                times.append(time.perf_counter() - t0)
            samples.append((float(c), float(tokens), float(np.median(times))))
    return samples


def runners(settings, model: str) -> tuple[list, Callable[[object, int], None]]:
    """The model's stage runners and how one is given c CPUs."""
    if model in PROFILES and not (settings.model_dir(model) / "manifest.json").exists():
        p = PROFILES[model]

        def emulated_cpus(runner: EmulatedRunner, c: int) -> None:
            runner.cpus = c
        return [EmulatedRunner(p, model, i, i + 1, seed=i) for i in range(p.num_stages)], emulated_cpus
    from models.manifest import Manifest
    from models.stage_runner import StageRunner
    manifest = Manifest.load(settings.model_dir(model))
    return [StageRunner(manifest, i, i + 1) for i in range(manifest.num_stages)], lambda _, c: pin(c)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--cpus", default="1,2", help="CPU counts to measure, comma-separated")
    parser.add_argument("--payloads", default="16,64,256", help="tokens per item, comma-separated")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None, help="folder for the fits and the profile (default: QUART_HOME)")
    add_arguments(parser, "home")
    args = parser.parse_args(argv)
    settings = exit_on_config_error(lambda: settings_from_args(args))
    cpus = [int(x) for x in args.cpus.split(",")]
    try:
        stages, set_cpus = runners(settings, args.model)
    except FileNotFoundError as exc:
        print(f"{args.model}: not partitioned here ({exc}); `make up` with it in the stack partitions it",
              file=sys.stderr)
        return 2
    emulated = isinstance(stages[0], EmulatedRunner)
    if not emulated and max(cpus) > len(os.sched_getaffinity(0)):
        print(f"only {len(os.sched_getaffinity(0))} CPUs here; asked for {max(cpus)}", file=sys.stderr)
        return 2
    payloads = [int(x) for x in args.payloads.split(",")]
    fits: dict[int, CPUFit] = {}
    profile: dict[str, list] = {}
    allowed, threads = os.sched_getaffinity(0), torch.get_num_threads()
    try:
        for stage, runner in enumerate(stages):
            samples = profile_stage(runner, cpus, payloads, args.repeats, lambda c, r=runner: set_cpus(r, c))
            fits[stage] = fit_cpu_profile(samples)
            profile[str(stage)] = [list(s) for s in samples]
            worst = max(abs(fits[stage].predict(c, p) - s) / s for c, p, s in samples)
            print(f"stage {stage}: {fits[stage]}  (worst relative error on the profile {worst:.1%})", flush=True)
    finally:
        os.sched_setaffinity(0, allowed)
        torch.set_num_threads(threads)
    out = Path(args.out or settings.home)
    out.mkdir(parents=True, exist_ok=True)
    save_fits(fits, out / cpu_fits_name(args.model))
    (out / cpu_profile_name(args.model)).write_text(json.dumps(
        {"model": args.model, "emulated": emulated, "host_cpus": len(allowed), "torch_threads": threads,
         "samples": "per stage: [cpus, payload tokens, median seconds]", "stages": profile}, indent=1))
    print(f"saved {out / cpu_fits_name(args.model)} and {cpu_profile_name(args.model)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

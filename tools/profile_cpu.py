"""Profile each stage's service time against its CPU count and payload (tokens), fit the CPU
compensator's linear regression per stage, and save the fits where the autoscaler finds them
(<home>/<model>.cpu_fits.json).

    python -m tools.profile_cpu --model smollm2 --cpus 1,2 --payloads 16,64,256

Runs the real stages in this process, one stage at a time, with the CPUs pinned (affinity and
torch threads) for each measurement."""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

from autoscaler.policy.compensator import CPUFit, fit_cpu_profile, save_fits
from autoscaler.policy.controller import CPU_FITS_FILE
from contracts.config import add_arguments, exit_on_config_error, settings_from_args
from pipeline.manifest import Manifest
from pipeline.stage_runner import StageRunner


def stage_input(runner: StageRunner, tokens: int) -> dict[str, torch.Tensor]:
    config = runner.manifest.config
    if runner.modules[0].has_embed:
        return {"input_ids": torch.randint(0, config["vocab_size"], (1, tokens))}
    return {"hidden": torch.randn(1, tokens, config["hidden_size"])}


def pin(cpus: int) -> None:
    allowed = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, allowed[:cpus])
    torch.set_num_threads(cpus)


def profile_stage(runner: StageRunner, cpus: list[int], payloads: list[int],
                  repeats: int) -> list[tuple[float, float, float]]:
    samples = []
    for c in cpus:
        pin(c)
        for tokens in payloads:
            tensors = stage_input(runner, tokens)
            runner.run(tensors)  # warm-up
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                runner.run(tensors)
                times.append(time.perf_counter() - t0)
            samples.append((float(c), float(tokens), float(np.median(times))))
    return samples


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--cpus", default="1,2", help="CPU counts to measure, comma-separated")
    parser.add_argument("--payloads", default="16,64,256", help="tokens per item, comma-separated")
    parser.add_argument("--repeats", type=int, default=5)
    add_arguments(parser, "home")
    args = parser.parse_args(argv)
    settings = exit_on_config_error(lambda: settings_from_args(args))
    cpus = [int(x) for x in args.cpus.split(",")]
    if max(cpus) > len(os.sched_getaffinity(0)):
        print(f"only {len(os.sched_getaffinity(0))} CPUs here; asked for {max(cpus)}", file=sys.stderr)
        return 2
    manifest = Manifest.load(settings.model_dir(args.model))
    fits: dict[int, CPUFit] = {}
    allowed, threads = os.sched_getaffinity(0), torch.get_num_threads()
    try:
        for stage in range(manifest.num_stages):
            runner = StageRunner(manifest, stage, stage + 1)
            samples = profile_stage(runner, cpus, [int(x) for x in args.payloads.split(",")], args.repeats)
            fits[stage] = fit_cpu_profile(samples)
            worst = max(abs(fits[stage].predict(c, p) - s) / s for c, p, s in samples)
            print(f"stage {stage}: {fits[stage]}  (worst relative error on the profile {worst:.1%})", flush=True)
    finally:
        os.sched_setaffinity(0, allowed)
        torch.set_num_threads(threads)
    out = Path(settings.home) / f"{args.model}.{CPU_FITS_FILE}"
    out.parent.mkdir(parents=True, exist_ok=True)
    save_fits(fits, out)
    print(f"saved {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Makes the artefacts QUART's policy runs from, for the models this repository bundles, into
autoscaler/artefacts (or --out): the CV-attention model trained on the cluster simulator's
windows (Table 1's chains and the fan-out/fan-in ensemble), with its held-out error, and each
bundled model's CPU profile and fits (QUART Fig. 3b), with a plot of the profiles.

    python -m tools.artefacts                  everything (about 10 minutes on 2 cores)
    python -m tools.artefacts --only cv        the CV-attention model
    python -m tools.artefacts --only fits      the CPU profiles and fits
    python -m tools.artefacts --only fits --models smollm2    one bundled model's

The emulated Table 1 models are profiled at 1-8 CPUs (their emulated compute follows the
profile's Amdahl law at any count); the real ones (SmolLM2, MiniLM, partitioned as stack.yml
splits them) at the CPUs this host has."""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from contracts import artefacts
from contracts.config import load_settings
from contracts.stack import pipelines, read_stack
from models.profiles import PROFILES
from tools import profile_cpu
from tools.cv_traces import simulated
from tools.train_smoother import evaluate, split, train

REAL = ("smollm2", "minilm")


def make_cv(out: Path, traces: int = 66, epochs: int = 60) -> dict:
    samples = simulated(traces)
    fit, held = split(samples, seed=0)
    print(f"CV attention: {len(fit)} windows to fit, {len(held)} held out (by trace) ...", flush=True)
    model = train(fit, epochs=epochs, seed=0)
    model.save(out / artefacts.CV_MODEL)
    dag = [s for s in held if len(s["edges"]) != len(s["stages"]) - 1]
    result = {"windows": len(samples), "fit": len(fit), "held_out": len(held), "theta": model.theta.item(),
              "all": evaluate(model, held), "dag": evaluate(model, dag) if dag else None}
    (out / "cv_attention.json").write_text(json.dumps(result, indent=1))
    print(f"  theta {result['theta']:.3f}; held-out MAE per stage {result['all']['model_mae']} "
          f"(naive {result['all']['naive_mae']})", flush=True)
    return result


def make_fits(out: Path, models: list[str]) -> None:
    settings = load_settings()
    for name in (m for m in models if m in PROFILES):
        assert profile_cpu.main(["--model", name, "--cpus", "1,2,4,8", "--payloads", "16,64", "--repeats", "15",
                                 "--out", str(out), "--home", settings.home]) == 0
    from models.partition import ensure_partitioned
    stack = pipelines(read_stack(Path(settings.stack_file)))
    cpus = ",".join(str(c) for c in range(1, len(os.sched_getaffinity(0)) + 1))
    for name in (m for m in models if m in REAL):
        ensure_partitioned(settings.models_dir, name, stack[name].num_stages, stack[name].source)
        assert profile_cpu.main(["--model", name, "--cpus", cpus, "--payloads", "16,64,256", "--repeats", "5",
                                 "--out", str(out), "--home", settings.home]) == 0
    plot(out)


def plot(out: Path) -> None:
    """QUART Fig. 3b: each stage's service time against its CPUs (payload 64 tokens)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = [n for n in (*REAL, "llama-7b", "wideresnet") if (out / artefacts.cpu_profile_name(n)).exists()]
    fig, axes = plt.subplots(1, len(names), figsize=(4 * len(names), 3.5), squeeze=False)
    for ax, name in zip(axes[0], names):
        data = json.loads((out / artefacts.cpu_profile_name(name)).read_text())
        for stage, samples in data["stages"].items():
            points = sorted((c, t * 1000) for c, p, t in samples if p == 64)
            ax.plot([c for c, _ in points], [t for _, t in points], marker="o", label=f"stage {stage}")
        ax.set(title=f"{name}{' (emulated)' if data['emulated'] else ''}", xlabel="CPUs", ylabel="ms per item (64 tokens)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("Service time against CPUs per stage (QUART Fig. 3b)")
    fig.tight_layout()
    fig.savefig(out / "cpu_profiles.png", dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=("cv", "fits"))
    parser.add_argument("--out", type=Path, default=artefacts.SHIPPED)
    parser.add_argument("--models", default=",".join((*PROFILES, *REAL)), help="with fits: which, comma-separated")
    args = parser.parse_args(argv)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = sorted(set(models) - set(PROFILES) - set(REAL))
    if unknown:
        parser.error(f"no bundled model {unknown}; profile your own with python -m tools.profile_cpu")
    args.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    if args.only in (None, "cv"):
        make_cv(args.out)
    if args.only in (None, "fits"):
        make_fits(args.out, models)
    print(f"artefacts in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

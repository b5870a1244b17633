"""Train the smoother's CV-attention model and report its held-out error per stage against the
naive baseline (every stage's CV = the entry CV).

    python -m tools.train_smoother --synthetic 600 --out .quart/cv_attention.pt
    python -m tools.train_smoother --data windows.jsonl --out .quart/cv_attention.pt
    python -m tools.train_smoother --record smollm2 --stages 4 --out ...   (from Redis records)
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

from autoscaler.policy.smoother import CVAttention, predecessors, stage_features
from autoscaler.policy.state import StageState
from contracts.config import add_arguments, exit_on_config_error, settings_from_args
from state.store import RedisStore
from tools.cv_traces import read_jsonl, recorded, synthetic, write_jsonl


def tensors(sample: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    stages = [StageState(stage=i, **s) for i, s in enumerate(sample["stages"])]
    x = torch.tensor([stage_features(s) for s in stages], dtype=torch.float32)
    mask = predecessors(len(stages), tuple(tuple(e) for e in sample["edges"]))
    return x, mask, x[:, 0].clone()


def train(samples: list[dict], epochs: int = 60, seed: int = 0, lr: float = 0.01) -> CVAttention:
    torch.manual_seed(seed)
    model = CVAttention()
    optimiser = torch.optim.Adam(model.parameters(), lr=lr)
    data = [tensors(s) for s in samples]
    order = np.random.default_rng(seed)
    for _ in range(epochs):
        for k in order.permutation(len(data)):
            x, mask, target = data[k]
            loss = torch.nn.functional.mse_loss(model(x, mask), target)
            optimiser.zero_grad()
            loss.backward()
            optimiser.step()
    return model.eval()


def evaluate(model: CVAttention, samples: list[dict]) -> dict[str, list[float]]:
    """Mean absolute error of the CV per stage: the model's and the naive baseline's."""
    model_err, naive_err = [], []
    with torch.no_grad():
        for sample in samples:
            x, mask, target = tensors(sample)
            model_err.append((model(x, mask) - target).abs().numpy())
            naive_err.append((target[0] - target).abs().numpy())
    return {"model_mae": np.mean(model_err, axis=0).round(4).tolist(),
            "naive_mae": np.mean(naive_err, axis=0).round(4).tolist()}


def split(samples: list[dict], seed: int, held_out: float = 0.2) -> tuple[list[dict], list[dict]]:
    """Held-out windows come from traces the model never saw (windows of one trace are alike)."""
    traces = sorted({s.get("trace", i) for i, s in enumerate(samples)})
    order = np.random.default_rng(seed).permutation(len(traces))
    held = {traces[k] for k in order[: max(1, int(len(traces) * held_out))]}
    fit = [s for i, s in enumerate(samples) if s.get("trace", i) not in held]
    return fit, [s for i, s in enumerate(samples) if s.get("trace", i) in held]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--synthetic", type=int, metavar="N", help="N windows from the tandem-queue model")
    source.add_argument("--data", type=Path, help="JSON lines of windows")
    source.add_argument("--record", metavar="MODEL", help="windows from MODEL's stage records in Redis")
    parser.add_argument("--stages", type=int, default=4, help="with --record: the model's stages")
    parser.add_argument("--replicas", default="", help="with --record: replicas per stage, comma-separated")
    parser.add_argument("--window-s", type=float, default=10.0, help="with --record: window length")
    parser.add_argument("--epochs", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--save-windows", type=Path, help="also write the windows as JSON lines (for --data)")
    add_arguments(parser, "redis_port")
    args = parser.parse_args(argv)
    if args.synthetic:
        samples = synthetic(args.synthetic, args.seed)
    elif args.data:
        samples = read_jsonl(args.data)
    else:
        settings = exit_on_config_error(lambda: settings_from_args(args))
        replicas = [int(x) for x in args.replicas.split(",")] if args.replicas else [1] * args.stages
        samples = recorded(RedisStore.from_url(settings.redis_url), args.record, args.stages,
                           args.window_s, replicas)
    if args.save_windows:
        write_jsonl(samples, args.save_windows)
    if len(samples) < 10:
        print(f"only {len(samples)} windows: too few to train and hold some out", file=sys.stderr)
        return 2
    fit, held = split(samples, args.seed)
    print(f"training on {len(fit)} windows, holding out {len(held)} ...", flush=True)
    model = train(fit, args.epochs, args.seed)
    result = evaluate(model, held)
    print(f"{'stage':>5} {'model MAE':>10} {'naive MAE':>10}")
    for i, (m, n) in enumerate(zip(result["model_mae"], result["naive_mae"])):
        print(f"{i:>5} {m:>10.4f} {n:>10.4f}")
    print(f"theta = {model.theta.item():.4f} (with one predecessor per stage, as in a chain, attention has one choice and theta has no effect)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    model.save(args.out)
    print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Writes a model's functions into an OpenFaaS stack file: its entry (the endpoint users call) and
one stage function per pipeline stage, each naming the model (QUART_MODEL) and its checkpoint
(QUART_MODEL_SOURCE); `make up` partitions it on its next start.

    python -m tools.stack add qwen ~/models/Qwen2.5-0.5B-Instruct --stages 4
    python -m tools.stack add mistral mistralai/Mistral-7B-Instruct-v0.3 --stages 8 --file my-stack.yml

The source is checked first (a folder or hub id of a supported family, in safetensors); the file
keeps its comments, the functions being appended as text and the result read back as a stack."""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from contracts.config import exit_on_config_error, load_settings
from contracts.paths import REPO_ROOT
from contracts.stack import NAME_RE, read_stack

# What every function of stack.yml carries (its header says why): of-watchdog's timeouts, the
# probes' paths, and where Prometheus scrapes each replica's pod.
WATCHDOG_ENV = {"read_timeout": "30s", "write_timeout": "130s", "exec_timeout": "130s"}
ANNOTATIONS = {"com.openfaas.health.http.path": "/_/live", "com.openfaas.ready.http.path": "/_/ready",
               "prometheus.io/scrape": "true", "prometheus.io/port": "8080", "prometheus.io/path": "/metrics"}


def function_entries(name: str, source: str, stages: int, stack_dir: Path = REPO_ROOT) -> str:
    """The YAML of a model's entry and stage functions, as stack.yml writes the bundled ones; the
    handlers relative to the stack file's folder, as faas-cli reads them."""
    def function(fn: str, handler: str, image: str, extra_env: str, skip_build: bool) -> str:
        path = os.path.relpath(REPO_ROOT / "functions" / handler, stack_dir)
        return (f"  {fn}:\n    lang: quart-python\n    handler: {'./' + path if not path.startswith('.') else path}\n"
                f"    image: ${{QUART_IMAGE_PREFIX:-quart}}/{image}:0.1.0\n"
                + ("    skip_build: true\n" if skip_build else "")
                + f"    secrets:\n      - quart-secrets\n    environment:\n      QUART_MODEL: {json.dumps(name)}\n"
                f"      QUART_MODEL_SOURCE: {json.dumps(source)}\n{extra_env}{_block(WATCHDOG_ENV, 6)}"
                f"    annotations:\n{_block(ANNOTATIONS, 6)}"
                f"    labels:\n      com.openfaas.scale.min: \"1\"\n")
    out = [function(name, "entry", "entry", "", True)]
    out += [function(f"{name}-s{i}", "stage", "stage", f"      QUART_STAGES: \"{i}\"\n", True) for i in range(stages)]
    return "".join(out)


def _block(values: dict[str, str], indent: int) -> str:
    return "".join(f"{' ' * indent}{k}: {json.dumps(v)}\n" for k, v in values.items())


def add(stack_file: Path, name: str, source: str, stages: int, cache: Path) -> None:
    """Appends the model's functions; ValueError (the file unchanged) for a bad name, a name in
    use, or a source that cannot be served."""
    from models.sources import resolve
    if not NAME_RE.fullmatch(name) or len(name) > 50:
        raise ValueError(f"{name!r} is not a valid model name (lower-case letters, digits and '-')")
    if stages < 1:
        raise ValueError("--stages must be at least 1")
    taken = {f.name for f in read_stack(stack_file)}
    clash = sorted(taken & {name, *(f"{name}-s{i}" for i in range(stages))})
    if clash:
        raise ValueError(f"{stack_file} already has functions {clash}")
    ckpt = resolve(source, cache)
    if stages > ckpt.num_layers + 2:
        raise ValueError(f"{source} has {ckpt.num_layers} blocks: at most {ckpt.num_layers + 2} stages")
    before = stack_file.read_text()
    stack_file.write_text(before.rstrip("\n") + "\n" + function_entries(name, source, stages, stack_file.resolve().parent))
    try:
        read_stack(stack_file)
    except (ValueError, KeyError):
        stack_file.write_text(before)
        raise
    print(f"added {name} ({ckpt.model_type}, {ckpt.dtype}, {ckpt.num_layers} blocks) in {stages} stages "
          f"to {stack_file}; `make up` partitions and serves it")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    a = sub.add_parser("add", help="add a model's entry and stage functions")
    a.add_argument("name", help="the name the model is served under (OpenAI's `model`)")
    a.add_argument("source", help="a folder in Hugging Face layout, a hub id, smollm2 or minilm")
    a.add_argument("--stages", type=int, required=True, help="pipeline stages to split it into")
    a.add_argument("--file", type=Path, default=None, help="the stack file (default: QUART_STACK_FILE, stack.yml)")
    args = parser.parse_args(argv)
    settings = exit_on_config_error(load_settings)
    try:
        add(args.file or Path(settings.stack_file), args.name, args.source, args.stages,
            settings.models_dir / "_sources")
    except ValueError as exc:
        print(f"stack add: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

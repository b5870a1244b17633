"""Reads an OpenFaaS stack file (version 1.0) into FunctionDeployment requests, the body that
faas-cli sends to a gateway's POST /system/functions."""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import yaml

NAME_RE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
STAGE_NAME_RE = re.compile(r"^(?P<model>[a-z0-9-]+)-s(?P<stage>\d+)$")


@dataclass
class StackFunction:
    name: str
    handler: Path
    deployment: dict


def _strings(value: object, what: str) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"{what} must be a mapping")
    return {str(k): str(v) for k, v in value.items()}


def read_stack(path: Path) -> list[StackFunction]:
    data = yaml.safe_load(path.read_text())
    if not isinstance(data, dict) or str(data.get("version")) != "1.0":
        raise ValueError(f"{path}: not an OpenFaaS stack file of version 1.0")
    provider = data.get("provider") or {}
    if provider.get("name") != "openfaas":
        raise ValueError(f"{path}: provider.name must be openfaas")
    functions = []
    for name, spec in (data.get("functions") or {}).items():
        if not NAME_RE.match(name):
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
        functions.append(StackFunction(name, (path.parent / spec["handler"]).resolve(), deployment))
    return functions


def stage_counts(functions: list[StackFunction]) -> dict[str, int]:
    """Number of stage functions `<model>-s<i>` per model in the stack."""
    counts: dict[str, int] = {}
    for f in functions:
        m = STAGE_NAME_RE.match(f.name)
        if m:
            counts[m["model"]] = max(counts.get(m["model"], 0), int(m["stage"]) + 1)
    return counts

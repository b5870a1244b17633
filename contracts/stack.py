"""Reads an OpenFaaS stack file (version 1.0) into FunctionDeployment requests, the body that
faas-cli sends to a gateway's POST /system/functions, and each function's identity, once: the
model it serves and, for a stage function, its StageRef (from QUART_MODEL and QUART_STAGES, the
environment the function's replicas see)."""
from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import yaml

from contracts.stage import StageRef

NAME_RE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(h|ms|m|s)")
_UNIT_S = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}
# A stage function labelled so serves the whole model: the form a pipelined model consolidates
# into (autoscaler/policy/layout.py); it overlaps the stage functions and stays out of the pipeline.
WHOLE_LABEL = "com.quart.whole"
# A stage function's time-to-first-token objective from zero (a Go duration): its cold starts'
# fetches must end in time for it (scheduler/coldstart.fetch_deadline_s).
TTFT_SLO_LABEL = "com.quart.ttft-slo"
SCALE_MAX_LABEL = "com.openfaas.scale.max"
# OpenFaaS's scale-to-zero labels: a function so labelled goes to zero replicas once its model has
# been idle for the duration (default 15 m, as OpenFaaS's), and back on the next request.
ZERO_LABEL = "com.openfaas.scale.zero"
ZERO_DURATION_LABEL = "com.openfaas.scale.zero-duration"
DEFAULT_ZERO_DURATION_S = 15 * 60.0
VARIABLE_RE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def parse_duration(text: str) -> float:
    """Seconds of a Go duration ("15m", "1h30m", "90s", "500ms"), as OpenFaaS's labels write them;
    ValueError for anything else."""
    text = text.strip()
    parts = _DURATION.findall(text)
    if not text or "".join(n + u for n, u in parts) != text:
        raise ValueError(f"{text!r} is not a duration like 30s, 15m or 1h30m")
    return sum(float(n) * _UNIT_S[u] for n, u in parts)


@dataclass(frozen=True)
class ZeroScaling:
    """A function's scale-to-zero labels."""
    enabled: bool = False
    idle_s: float = DEFAULT_ZERO_DURATION_S

    @classmethod
    def from_labels(cls, labels: Mapping[str, str]) -> ZeroScaling:
        """ValueError naming the label whose value is wrong."""
        raw = labels.get(ZERO_LABEL, "false").strip().lower()
        if raw not in ("true", "false"):
            raise ValueError(f"label {ZERO_LABEL}={labels[ZERO_LABEL]!r} must be true or false")
        duration = labels.get(ZERO_DURATION_LABEL)
        try:
            idle_s = parse_duration(duration) if duration is not None else DEFAULT_ZERO_DURATION_S
        except ValueError as exc:
            raise ValueError(f"label {ZERO_DURATION_LABEL}: {exc}") from None
        return cls(raw == "true", idle_s)


def ttft_slo_s(labels: Mapping[str, str]) -> float | None:
    """A stage function's TTFT objective (label com.quart.ttft-slo), None without one;
    ValueError naming the label when it is not a positive duration."""
    raw = labels.get(TTFT_SLO_LABEL)
    if raw is None:
        return None
    try:
        seconds = parse_duration(raw)
    except ValueError as exc:
        raise ValueError(f"label {TTFT_SLO_LABEL}: {exc}") from None
    if seconds <= 0:
        raise ValueError(f"label {TTFT_SLO_LABEL}={raw!r} must be a positive duration")
    return seconds


def least_ttft_slo_s(labels: Iterable[Mapping[str, str]]) -> float | None:
    """A model's TTFT objective: the least its stage functions' labels set, None without one."""
    return min((t for x in labels if (t := ttft_slo_s(x)) is not None), default=None)


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
            ttft_slo_s(deployment["labels"])
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
    emulated: str = ""                # the profile its stages draw compute times from (QUART_EMULATE), if emulated
    source: str = ""                  # where its checkpoint comes from (QUART_MODEL_SOURCE; default: its name)
    whole: str | None = None          # the function serving [0, num_stages) that it may consolidate into
    whole_max: int = 1                # replicas that function may have (its com.openfaas.scale.max)
    zero: tuple[ZeroScaling, ...] = ()  # each stage function's scale-to-zero labels (none: never)
    ttft_slo_s: float | None = None   # its TTFT objective: the least its stage functions' labels set

    @property
    def sleepers(self) -> tuple[StageRef, ...]:
        """The stage functions labelled to scale to zero."""
        return tuple(ref for ref, z in zip(self.stages, self.zero) if z.enabled)

    @property
    def idle_s(self) -> float:
        """How long the model must be idle before its sleepers go to zero: the shortest of theirs."""
        return min((z.idle_s for z in self.zero if z.enabled), default=DEFAULT_ZERO_DURATION_S)

    @property
    def num_stages(self) -> int:
        return self.stages[-1].last

    def function(self, stage: StageRef) -> str:
        return self.functions[self.stages.index(stage)]


def is_whole(f: StackFunction) -> bool:
    """Whether a function (a StackFunction, or anything with its `stage` and `deployment`) serves
    a model whole, for its pipeline to consolidate into."""
    return f.stage is not None and (f.deployment.get("labels") or {}).get(WHOLE_LABEL) == "true"


def pipelines(functions: list[StackFunction]) -> dict[str, Pipeline]:
    """Each model's pipeline of stage functions; ValueError where ranges overlap or leave a gap,
    or a function labelled com.quart.whole does not serve the whole model."""
    by_model: dict[str, list[StackFunction]] = {}
    wholes: dict[str, StackFunction] = {}
    for f in functions:
        if is_whole(f):
            if f.model in wholes:
                raise ValueError(f"{f.model}: functions {wholes[f.model].name} and {f.name} are both labelled {WHOLE_LABEL}")
            wholes[f.model] = f
        elif f.stage is not None:
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
                              emulated=next((e for f in fns if (e := f.deployment["envVars"].get("QUART_EMULATE"))), ""),
                              source=model_source(functions, model),
                              zero=tuple(ZeroScaling.from_labels(f.deployment.get("labels") or {}) for f in fns),
                              ttft_slo_s=least_ttft_slo_s(f.deployment.get("labels") or {} for f in fns),
                              **_whole(wholes.pop(model, None), end))
    if wholes:
        raise ValueError(f"{sorted(wholes)}: a function labelled {WHOLE_LABEL} but no stage functions")
    return out


SOURCE_VAR = "QUART_MODEL_SOURCE"


def model_source(functions: list[StackFunction], model: str) -> str:
    """The checkpoint a model's functions name in QUART_MODEL_SOURCE (a folder, a hub id, a
    bundled model; default: the model's name); ValueError where two of them name different ones."""
    named = {f.deployment["envVars"][SOURCE_VAR] for f in functions if f.model == model and SOURCE_VAR in f.deployment["envVars"]}
    if len(named) > 1:
        raise ValueError(f"{model}: its functions name different {SOURCE_VAR}s: {sorted(named)}")
    return named.pop() if named else model


def _whole(f: StackFunction | None, end: int) -> dict:
    if f is None:
        return {}
    if (f.stage.first, f.stage.last) != (0, end):
        raise ValueError(f"{f.model}: {f.name} is labelled {WHOLE_LABEL} but serves {f.stage.stages}, not 0-{end}")
    raw = f.deployment["labels"].get(SCALE_MAX_LABEL, "1")
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"{f.name}: label {SCALE_MAX_LABEL}={raw!r} is not a positive integer")
    return {"whole": f.name, "whole_max": int(raw)}


def _model_stack(source: Path, model: str) -> tuple[dict, dict[str, dict]]:
    """A stack file and one model's function specs from it, handlers made absolute (so the stack
    written from them may lie anywhere)."""
    stack = load_stack_file(source)
    return stack, {name: {**spec, "handler": str((source.parent / spec["handler"]).resolve())}
                   for name, spec in stack["functions"].items() if spec.get("environment", {}).get("QUART_MODEL") == model}


def _write_stack(stack: dict, functions: dict[str, dict], target: Path) -> Path:
    target.write_text(yaml.safe_dump({**stack, "functions": functions}, sort_keys=False))
    return target


def one_model_stack(source: Path, target: Path, model: str) -> Path:
    """A stack file of one model's functions from `source` (its entry and stage functions)."""
    return _write_stack(*_model_stack(source, model), target)


def consolidating_stack(source: Path, target: Path, model: str, labels: Mapping[str, str] | None = None,
                        environment: Mapping[str, str] | None = None) -> Path:
    """A stack file of one model's functions from `source` plus `<model>-whole`, the function
    serving the whole model that its pipeline may consolidate into (extra `labels` and
    `environment` on it)."""
    stack, functions = _model_stack(source, model)
    stages = [spec for spec in functions.values() if "QUART_STAGES" in spec.get("environment", {})]
    end = max(StageRef.parse(model, spec["environment"]["QUART_STAGES"]).last for spec in stages)
    functions[f"{model}-whole"] = {**stages[0], "skip_build": True,
                                   "environment": {**stages[0]["environment"], "QUART_STAGES": f"0-{end}",
                                                   **(environment or {})},
                                   "labels": {WHOLE_LABEL: "true", **(labels or {})}}
    return _write_stack(stack, functions, target)


def scale_to_zero_stack(source: Path, target: Path, model: str, idle: str) -> Path:
    """A stack file of one model's functions from `source`, its stage functions labelled to scale
    to zero after `idle` (a Go duration)."""
    stack, functions = _model_stack(source, model)
    for spec in functions.values():
        if "QUART_STAGES" in spec.get("environment", {}):
            spec["labels"] = {**spec.get("labels", {}), "com.openfaas.scale.zero": "true",
                              "com.openfaas.scale.zero-duration": idle}
    return _write_stack(stack, functions, target)

"""The records that cross a process through Redis, each a frozen value with one encoder and one
decoder. A writer calls `encode()`, a reader `decode(...)`; nothing else spells their fields.

Redis hands back bytes; every decoder accepts bytes or str keys and values (a pipeline client
created with `decode_responses` gives str), so a reader never decodes by hand."""
from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields

from contracts.stage import StageRef

Raw = Mapping[bytes, bytes] | Mapping[str, str]


def _text(raw: Raw) -> dict[str, str]:
    return {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
            for k, v in raw.items()}


def stream_ms(entry_id: bytes | str) -> int:
    """A stream ID's milliseconds: when the entry was added (Redis assigns IDs from its clock)."""
    return int((entry_id.decode() if isinstance(entry_id, bytes) else entry_id).split("-")[0])


@dataclass(frozen=True)
class ColdStart:
    """When each step of a replica's own start ended (time.time() values; 0 for a step it skipped):
    the process began, imports were done, the fetch began and ended, the weights were loaded."""
    process_at: float = 0.0
    imported_at: float = 0.0
    fetch_started_at: float = 0.0
    fetched_at: float = 0.0
    loaded_at: float = 0.0
    bytes: int = 0

    def encode(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def decode(cls, raw: bytes | str) -> ColdStart:
        data = json.loads(raw)
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    @property
    def load_after_fetch_s(self) -> float:
        return max(0.0, self.loaded_at - self.fetched_at)


@dataclass(frozen=True)
class ReplicaRecord:
    """One live replica as it registers itself (`state.keys.replica`), with what it reports while
    it runs: the CPUs it uses, whether it drains, the sequences and KV bytes it holds."""
    replica_id: str
    model: str
    stage_start: int
    stage_end: int                  # exclusive
    server: str
    pid: int
    device: str = "cpu"
    cpus: int = 1
    started_by: str = ""
    started_at: float = 0.0
    last_seen: float = 0.0
    draining: bool = False
    sequences: int = 0
    kv_bytes: int = 0
    first_work_at: float | None = None
    coldstart: ColdStart | None = None

    @property
    def stage(self) -> StageRef:
        return StageRef(self.model, self.stage_start, self.stage_end)

    def stages(self) -> range:
        return range(self.stage_start, self.stage_end)

    def serves(self, stage: StageRef) -> bool:
        """Whether it serves exactly this stage function's range (not a whole model over it)."""
        return (self.stage_start, self.stage_end) == (stage.first, stage.last)

    def encode(self) -> dict[str, str]:
        # Absent reads as the default.
        return {f.name: _field(v) for f in fields(self) if (v := getattr(self, f.name)) is not None and v is not False}

    @staticmethod
    def progress(changes: dict[str, object]) -> dict[str, str]:
        """What a running replica reports (the PROGRESS fields) as its hash holds them; ValueError
        for a field of its identity, which does not change while it runs."""
        unknown = set(changes) - PROGRESS
        if unknown:
            raise ValueError(f"a replica's record cannot change {sorted(unknown)} while it runs")
        return {name: _field(value) for name, value in changes.items()}

    @classmethod
    def decode(cls, raw: Raw) -> ReplicaRecord:
        data = _text(raw)
        return cls(
            replica_id=data["replica_id"], model=data["model"], stage_start=int(data["stage_start"]),
            stage_end=int(data["stage_end"]), server=data["server"], pid=int(data["pid"]),
            device=data.get("device", "cpu"), cpus=int(float(data.get("cpus", "1"))),
            started_by=data.get("started_by", ""), started_at=float(data.get("started_at", "0")),
            last_seen=float(data.get("last_seen", "0")), draining=data.get("draining", "0") == "1",
            sequences=int(data.get("sequences", "0")), kv_bytes=int(data.get("kv_bytes", "0")),
            first_work_at=float(data["first_work_at"]) if "first_work_at" in data else None,
            coldstart=ColdStart.decode(data["coldstart"]) if "coldstart" in data else None)


# The fields of a replica's record it may change while it runs (Store.update_replica).
PROGRESS = frozenset({"cpus", "draining", "sequences", "kv_bytes", "first_work_at", "coldstart", "last_seen"})


def _field(value: object) -> str:
    """A replica record's field as its hash holds it."""
    if isinstance(value, ColdStart):
        return value.encode()
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)


@dataclass(frozen=True)
class StageSample:
    """One work item a stage function's replica finished: when it arrived at the stage, how long
    it waited and was served, by which replica, of which kind (pass, prefill, decode, ...) and in
    a batch of how many. `at_ms` is its stream ID's time (when the record was written)."""
    request_id: str
    arrived_at: float               # time.time() seconds
    wait_ms: float
    service_ms: float
    replica_id: str
    kind: str
    batch: int = 1
    at_ms: int = 0
    compiled: bool = False          # the step ran compiled (models/compiled_decode.py)
    threads: int = 1                # the torch threads it ran on (engine/idle_cores.py)

    # The stream's field names are short: a stage writes one record per work item.
    def encode(self) -> dict[str, str]:
        return {"id": self.request_id, "t": f"{self.arrived_at:.6f}", "q": f"{self.wait_ms:.3f}",
                "s": f"{self.service_ms:.3f}", "r": self.replica_id, "k": self.kind, "b": str(self.batch),
                **({"c": "1"} if self.compiled else {}), **({"n": str(self.threads)} if self.threads != 1 else {})}

    @classmethod
    def decode(cls, entry_id: bytes | str, raw: Raw) -> StageSample:
        data = _text(raw)
        return cls(request_id=data.get("id", ""), arrived_at=float(data["t"]), wait_ms=float(data.get("q", "0")),
                   service_ms=float(data.get("s", "0")), replica_id=data.get("r", ""), kind=data.get("k", "pass"),
                   batch=int(data.get("b", "1")), at_ms=stream_ms(entry_id), compiled=data.get("c") == "1",
                   threads=int(data.get("n", "1")))

    @property
    def starts_request(self) -> bool:
        """A request entering the model (a single pass or a generation's prefill), not one of its steps."""
        return self.kind in ("prefill", "pass")


@dataclass(frozen=True)
class Activity:
    """A model's requests as the gateway sees them: when the latest came or was answered, and how
    many it is answering now (a generation's decode steps pass through no shared stream, so the
    streams alone would look idle)."""
    last_request_at: float
    in_flight: int = 0

    def encode(self) -> str:
        return json.dumps({"last": self.last_request_at, "in_flight": self.in_flight})

    @classmethod
    def decode(cls, raw: bytes | str) -> Activity:
        data = json.loads(raw)
        return cls(float(data["last"]), int(data.get("in_flight", 0)))


@dataclass(frozen=True)
class StartFailure:
    """Why a replica of a stage could not start (its shard failed its checksum, or is nowhere)."""
    reason: str
    at: float

    def encode(self) -> str:
        return json.dumps({"reason": self.reason, "at": self.at})

    @classmethod
    def decode(cls, raw: bytes | str) -> StartFailure:
        data = json.loads(raw)
        return cls(str(data.get("reason", "")), float(data.get("at", 0.0)))


@dataclass(frozen=True)
class Backlog:
    """A stage function's queue: items no replica has taken yet, and items a replica holds and
    has not acknowledged; `arrivals` the waiting items' arrival times (seconds), where read."""
    waiting: int = 0
    in_flight: int = 0
    arrivals: tuple[float, ...] = field(default=())


@dataclass(frozen=True)
class StageWindow:
    """What one stage function holds for the autoscaler's window, read in one batch with every
    other stage's: its records after the ones already read, the cursor to read on from, its queue
    (with the arrival times of its stream's items in the window), and its live replicas."""
    samples: tuple[StageSample, ...]
    cursor: str | None
    backlog: Backlog
    replicas: tuple[ReplicaRecord, ...]


def encode_key_stages(stages: tuple[StageRef, ...]) -> str:
    return json.dumps([s.stages for s in stages])


def decode_key_stages(model: str, raw: bytes | str) -> list[StageRef]:
    return [StageRef.parse(model, s) for s in json.loads(raw)]


@dataclass(frozen=True)
class Placement:
    """One thing the scheduler did: added a replica (`op` add: where, by which path), removed
    one (remove), or could not place one (unplaced), with its reason; how an added replica's
    start went (ready: when it first answered its health check, beside the prediction); and a
    replica that exited without being asked to (exit, with its code). Written by the embedded
    runtime's placer and by the Kubernetes backend alike (which records no exits: Kubernetes
    restarts a pod's container in place)."""
    op: str                         # add | remove | unplaced | ready | exit
    stage: str                      # the stage function's key, "model:stages"
    reason: str
    server: str = ""
    path: str = ""                  # add, ready: cold | fork | peer (Kubernetes: pod | fork); remove: what was removed
    replica: str = ""
    started_by: str = ""
    contention: str = ""            # the scheduler's reading of the round: light | heavy
    t: float = 0.0
    predicted_s: float = 0.0        # add, ready: the scheduler's prediction of the start (cold, peer)
    took_s: float = 0.0             # ready: from placed to ready

    def encode(self) -> dict[str, str]:
        return {k: (f"{v:.6f}" if isinstance(v, float) else str(v)) for k, v in asdict(self).items()
                if v not in ("", 0.0) or k == "t"}

    @classmethod
    def decode(cls, raw: Raw) -> Placement:
        data = _text(raw)
        known = {f.name: f for f in fields(cls)}
        return cls(**{k: float(v) if known[k].type == "float" else v for k, v in data.items() if k in known})


@dataclass(frozen=True)
class DecisionRecord:
    """One model's autoscaling decision as the live loop logs it: the replicas it observed and
    decided per stage function, its key stages, and per stage the reasons (the policy's own
    figures: λ, μ, predicted delay and CV, target, ...)."""
    t: float
    policy: str
    replicas: tuple[int, ...]
    decided: tuple[int, ...]
    key: tuple[str, ...]                     # the key stage functions' ranges
    stages: tuple[dict, ...]                 # per stage function: what it observed and why it decided

    def encode(self) -> dict[str, str]:
        return {"t": f"{self.t:.3f}", "policy": self.policy, "replicas": json.dumps(list(self.replicas)),
                "decided": json.dumps(list(self.decided)), "key": json.dumps(list(self.key)),
                "stages": json.dumps(list(self.stages))}

    @classmethod
    def decode(cls, raw: Raw) -> DecisionRecord:
        data = _text(raw)
        return cls(float(data["t"]), data["policy"], tuple(json.loads(data["replicas"])),
                   tuple(json.loads(data["decided"])), tuple(json.loads(data["key"])), tuple(json.loads(data["stages"])))


# A model's layouts (autoscaler/policy/layout.py moves it between them); pipelined until it changes.
PIPELINED, CONSOLIDATING, WHOLE, SPLITTING = "pipelined", "consolidating", "whole", "splitting"


@dataclass(frozen=True)
class LayoutChange:
    """A model with a whole-model function changed layout (pipelined, consolidating, whole, splitting)."""
    t: float
    layout: str
    reason: str

    def encode(self) -> dict[str, str]:
        return {"t": f"{self.t:.3f}", "layout": self.layout, "reason": self.reason}

    @classmethod
    def decode(cls, raw: Raw) -> LayoutChange:
        data = _text(raw)
        return cls(float(data["t"]), data["layout"], data.get("reason", ""))


@dataclass(frozen=True)
class CacheEvent:
    """What a server's KeysManager did with a zygote: cache, fork, evict, crash, re-cache; `detail`
    holds what the event adds (a fork's replica pid, an eviction's reason)."""
    event: str
    zygote: str                      # the stage's key, "model:stages"
    pid: int
    t: float
    detail: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        clash = {k for k, _ in self.detail} & {"event", "zygote", "pid", "t"}
        if clash:
            raise ValueError(f"a cache event's detail cannot name its own fields {sorted(clash)}")

    def encode(self) -> dict[str, str]:
        return {"event": self.event, "zygote": self.zygote, "pid": str(self.pid), "t": f"{self.t:.6f}", **dict(self.detail)}

    @classmethod
    def decode(cls, raw: Raw) -> CacheEvent:
        data = _text(raw)
        own = {"event", "zygote", "pid", "t"}
        return cls(data["event"], data["zygote"], int(data["pid"]), float(data["t"]),
                   tuple(sorted((k, v) for k, v in data.items() if k not in own)))


@dataclass(frozen=True)
class ZygoteRecord:
    """A stage range a server's KeysManager holds in memory, ready to fork."""
    server: str
    model: str
    stages: str
    pid: int
    bytes: int
    sha256: tuple[str, ...] = ()
    started_at: float = 0.0
    last_use: float = 0.0
    forks: int = 0

    @property
    def stage(self) -> StageRef:
        return StageRef.parse(self.model, self.stages)

    def encode(self) -> dict[str, str]:
        return {k: json.dumps(list(v)) if isinstance(v, tuple) else str(v) for k, v in asdict(self).items()}

    @classmethod
    def decode(cls, raw: Raw) -> ZygoteRecord:
        data = _text(raw)
        return cls(data["server"], data["model"], data["stages"], int(data["pid"]), int(data["bytes"]),
                   tuple(json.loads(data.get("sha256", "[]"))), float(data.get("started_at", "0")),
                   float(data.get("last_use", "0")), int(data.get("forks", "0")))

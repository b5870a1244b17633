"""Every Redis key the components share. Nothing else in the code base spells a key."""
from __future__ import annotations

from contracts.stage import StageRef

PREFIX = "quart"
# Consumer group that every replica of a stage joins: one shared queue per stage.
GROUP = "replicas"


def stage_stream(model: str, stage: int) -> str:
    """Work waiting for stage `stage` of `model` (stream IDs are arrival timestamps)."""
    return f"{PREFIX}:work:{model}:{stage}"


def replica_stream(replica_id: str) -> str:
    """Work for one replica alone: the decode steps and frees of the sequences whose cache it holds.
    It expires with the replica's registration, so a step sent to a dead replica is refused."""
    return f"{PREFIX}:replica-work:{replica_id}"


def reply_list(request_id: str) -> str:
    """Where the last stage pushes the answer for one request."""
    return f"{PREFIX}:reply:{request_id}"


def join_parts(model: str, stage: int, request_id: str) -> str:
    """Hash of the parts one request has brought to a join (a stage with several predecessors),
    field: the predecessor stage; the last part in queues the request at the join's stream."""
    return f"{PREFIX}:join:{model}:{stage}:{request_id}"


def records_stream(model: str, stage: int) -> str:
    """Per-request records of one stage (queue wait, service time, replica), capped in length."""
    return f"{PREFIX}:records:{model}:{stage}"


def replica(replica_id: str) -> str:
    """Hash describing one live replica; expires unless its heartbeat renews it."""
    return f"{PREFIX}:replica:{replica_id}"


def stage_replicas(model: str, stage: int) -> str:
    """Set of replica ids that have registered for a stage (dead ones are filtered by expiry)."""
    return f"{PREFIX}:replicas:{model}:{stage}"


def zygote(server: str, stage: StageRef) -> str:
    """Hash describing one KeysManager zygote (cached stage range) on a server."""
    return f"{PREFIX}:zygote:{server}:{stage.key}"


def zygotes(server: str) -> str:
    """Set of the zygote keys a server's KeysManager holds."""
    return f"{PREFIX}:zygotes:{server}"


def cache_events(server: str) -> str:
    """What a server's KeysManager did (cache, fork, evict, re-cache), capped in length."""
    return f"{PREFIX}:cache-events:{server}"


def key_stages() -> str:
    """Hash: model -> JSON list of its key stages' ranges (StageRef.stages: "2", "1-3"), the
    autoscaler's current key stages. One index, read whole: every KeysManager caches the key
    stages it does not hold yet, and the placer spreads them."""
    return f"{PREFIX}:key-stages"


def stage_cpus(stage: StageRef) -> str:
    """CPUs each replica of a stage function should use; replicas apply a change between work items."""
    return f"{PREFIX}:cpus:{stage.key}"


def cpu_sets(server: str) -> str:
    """Hash: the cores each pinned replica on a server holds (replica id -> "0,1"), so that the
    next one is pinned to others where enough are free (QUART Algorithm 1's CPU allocation)."""
    return f"{PREFIX}:cpusets:{server}"


def decisions(model: str) -> str:
    """The autoscaler's decisions for a model, each with its reason, capped in length."""
    return f"{PREFIX}:decisions:{model}"


def placements() -> str:
    """Where the scheduler put each new replica and which it removed, with the reason, capped."""
    return f"{PREFIX}:placements"


def asleep(model: str) -> str:
    """Set (to the time) while the gateway holds a model's stage functions at zero replicas for
    idleness: the autoscaler leaves such a model alone until a request wakes it."""
    return f"{PREFIX}:asleep:{model}"


def activity() -> str:
    """Hash: model -> JSON of what the gateway saw of its requests lately (the latest one's time,
    and how many are in flight), for the autoscaler's idle rule; the gateway writes it each second."""
    return f"{PREFIX}:activity"


def waking(model: str) -> str:
    """Set (to the time, expiring) while a model's stages start from zero: its entry admits
    requests to queue behind the first instead of refusing them for the queue they find."""
    return f"{PREFIX}:waking:{model}"


def start_failures(model: str) -> str:
    """Why a model's stages could not start lately: a hash of stage (its first index) -> JSON
    {"reason", "at"}, expiring; a request waiting on a stage with no replica gets 503 with it."""
    return f"{PREFIX}:start-failures:{model}"


def layout(model: str) -> str:
    """String: how a model with a whole-model function is laid out now (pipelined, consolidating,
    whole, splitting: autoscaler/policy/layout.py); absent means pipelined."""
    return f"{PREFIX}:layout:{model}"


def layout_decisions(model: str) -> str:
    """Stream: each change of a model's layout, with its reason."""
    return f"{PREFIX}:layout-decisions:{model}"


def coldstarts(model: str) -> str:
    """Hash: stage (its first index) -> JSON of the latest cold start of a replica of that stage
    (process_at, imported_at, fetch_started_at, fetched_at, loaded_at, bytes: time.time() values)."""
    return f"{PREFIX}:coldstarts:{model}"

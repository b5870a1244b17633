"""One configuration for every component: typed sections with defaults in code, a file named by
QUART_CONFIG, QUART_* environment variables, and command-line flags, in that order of precedence.

Every variable is declared once in `VARIABLES`, with a line of documentation; the table of
docs/configuration.md is generated from it (`python -m contracts.config --markdown`). A value that
does not parse or is out of range stops the component at start with a message naming the variable.
What a replica serves (its model and stage range) is not configuration: see `ReplicaIdentity`."""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from urllib.parse import quote

from contracts.secrets import read_or_create_secret


class ConfigError(ValueError):
    """A setting that does not parse or is out of range; the message names the variable."""


@dataclass(frozen=True)
class Bounds:
    """Replicas a stage function may have. Policies see them in their state; the controller
    applies them once to every decision."""
    r_min: int = 1
    r_max: int = 16

    def clamp(self, replicas: int) -> int:
        return max(self.r_min, min(self.r_max, replicas))


@dataclass(frozen=True)
class RedisConfig:
    host: str = "127.0.0.1"
    port: int = 6390
    db: int = 0
    password: str = ""


@dataclass(frozen=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    user: str = "admin"
    password: str = ""
    namespace: str = "openfaas-fn"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


@dataclass(frozen=True)
class DataPlaneConfig:
    request_timeout_s: float = 120.0
    reclaim_idle_ms: int = 5000
    heartbeat_s: float = 1.0
    replica_ttl_s: float = 5.0
    block_ms: int = 500
    records_maxlen: int = 10000
    drain_timeout_s: float = 30.0
    admit_wait_s: float = 2.0
    ttft_objective_s: float = 0.0
    tpot_objective_s: float = 0.0


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int = 8 * 1024 * 1024
    read_timeout_s: float = 30.0
    max_prompt_tokens: int = 2048
    max_new_tokens: int = 64
    max_inputs: int = 64
    max_pass_tokens: int = 16384

    @property
    def max_context(self) -> int:
        """The longest sequence a stage takes: a prompt with every token it may generate."""
        return self.max_prompt_tokens + self.max_new_tokens


@dataclass(frozen=True)
class Batching:
    """How a stage replica of a generative model runs its requests (continuous batching)."""
    max_batch: int = 16
    kv_bytes: int = 1 << 30
    kv_wait_s: float = 5.0
    drain: str = "migrate"
    chain_steps: bool = True


@dataclass(frozen=True)
class ComputeConfig:
    device: str = "cpu"
    dtype: str = "auto"
    threads: int = 1
    emulate: str = ""
    prepack: bool = True
    quantize: str = ""
    compile: bool = True
    compile_nice: int = 19
    compile_defer_s: float = 30.0
    compile_worker: bool = True
    idle_cores: str = "all"

    @property
    def idle_prefills(self) -> bool:
        """Whether a step that holds a prefill may take the host's idle cores (engine/idle_cores.py)."""
        return self.idle_cores != "off"

    @property
    def idle_decodes(self) -> bool:
        """Whether decode steps may take them too (those that run compiled: engine/replica.py)."""
        return self.idle_cores == "all"

    @property
    def compiles(self) -> bool:
        """Whether a replica's decode steps compile: asked for, on the CPU, without int8 weights."""
        return self.compile and self.device == "cpu" and not self.quantize


@dataclass(frozen=True)
class CacheConfig:
    host: str = "127.0.0.1"
    port: int = 8091
    stages: str = "all"
    memory_threshold: float = 0.85
    fork_cow: bool = True
    min_residency_s: float = 30.0
    zygote_start_s: float = 540.0   # under the KeysManager clients' 600 s: a caller sees why, not its own timeout


@dataclass(frozen=True)
class AutoscalerConfig:
    policy: str = "quart"
    backend: str = "local"
    tick_s: float = 1.0
    slo_s: float = 2.0
    window_s: float = 10.0
    cpu_max: int = 2
    cpu_total: int = 0               # R_total: CPUs all replicas together get (0: no bound)
    layout_window_s: float = 30.0
    layout_windows: int = 4
    policy_params: dict = field(default_factory=dict)
    bounds: Bounds = field(default_factory=Bounds)
    ablate: str = ""                 # QUART's mechanisms switched off, comma-separated (MECHANISMS)
    host: str = "127.0.0.1"          # where its /metrics and /healthz listen
    port: int = 0                    # 0: a free port, written to <home>/run/autoscaler.port

    def ablated(self, mechanism: str) -> bool:
        return mechanism in {m.strip() for m in self.ablate.split(",")}


@dataclass(frozen=True)
class ServersConfig:
    virtual: int = 1
    slots: int = 0
    cache_bytes: int = 0
    bandwidth: float = 1e9
    own_disks: bool = False
    store_bandwidth: float = 1e9
    cold_deadline_s: float = 60.0
    scheduler_params: dict = field(default_factory=dict)
    execute_while_load: bool = True


@dataclass(frozen=True)
class ColdStartConfig:
    stream: bool = True
    overlap: bool = True
    prefetch_dir: str = ""
    prefetch_ttl_s: float = 120.0
    stall_s: float = 30.0
    warm_runtime: bool = True


@dataclass(frozen=True)
class ContainersConfig:
    run: bool = False
    base: str = "localhost/debian-python:bookworm"
    oci_runtime: str = "runc"


def _default_home() -> str:
    return str(Path.cwd() / ".quart")


# Replica slots per core when QUART_SERVER_SLOTS is 0.
REPLICAS_PER_CORE = 8


@dataclass(frozen=True)
class Settings:
    home: str = field(default_factory=_default_home)
    models: str = ""
    models_url: str = ""
    stack_file: str = "stack.yml"
    server: str = field(default_factory=lambda: os.uname().nodename)
    log_level: str = "INFO"
    log_format: str = "text"
    log_max_bytes: int = 50 * 1024 * 1024
    log_keep: int = 3
    source_commit: str = ""
    internal_token: str = ""
    redis: RedisConfig = field(default_factory=RedisConfig)
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    data: DataPlaneConfig = field(default_factory=DataPlaneConfig)
    limits: Limits = field(default_factory=Limits)
    compute: ComputeConfig = field(default_factory=ComputeConfig)
    batching: Batching = field(default_factory=Batching)
    cache: CacheConfig = field(default_factory=CacheConfig)
    autoscaler: AutoscalerConfig = field(default_factory=AutoscalerConfig)
    servers: ServersConfig = field(default_factory=ServersConfig)
    containers: ContainersConfig = field(default_factory=ContainersConfig)
    coldstart: ColdStartConfig = field(default_factory=ColdStartConfig)

    @property
    def models_dir(self) -> Path:
        return Path(self.models) if self.models else Path(self.home) / "models"

    @property
    def password_file(self) -> Path:
        # OpenFaaS's own name for the admin password file.
        return Path(self.home) / "basic-auth-password"

    @property
    def redis_password_file(self) -> Path:
        return Path(self.home) / "redis-password"

    @property
    def internal_token_file(self) -> Path:
        return Path(self.home) / "internal-token"

    def internal_api_token(self) -> str:
        """The bearer token of the internal HTTP APIs (KeysManagers, stage replicas' direct
        invoke): QUART_INTERNAL_TOKEN, else the one kept in <home>/internal-token (made by the
        first process that needs it)."""
        return self.internal_token or read_or_create_secret(self.internal_token_file)

    @property
    def redis_url(self) -> str:
        """Where every component reaches Redis: QUART_REDIS_PASSWORD, else the password the
        embedded runtime keeps in <home>/redis-password (read when a client is made, so a
        process that started before the runtime made it still finds it)."""
        password = self.redis_password()
        auth = f":{quote(password, safe='')}@" if password else ""
        return f"redis://{auth}{self.redis.host}:{self.redis.port}/{self.redis.db}"

    def redis_password(self) -> str:
        """QUART_REDIS_PASSWORD, else the one the embedded runtime keeps in <home>/redis-password."""
        if not self.redis.password and self.redis_password_file.exists():
            return self.redis_password_file.read_text().strip()
        return self.redis.password

    def gateway_password(self) -> str | None:
        """QUART_GATEWAY_PASSWORD, else the embedded runtime's <home>/basic-auth-password; None
        when neither is there."""
        if not self.gateway.password and self.password_file.exists():
            return self.password_file.read_text().strip()
        return self.gateway.password or None

    def server_slots(self) -> int:
        """Replicas one server hosts: QUART_SERVER_SLOTS, else from the cores (a replica computes
        on QUART_THREADS of them while busy, and a pipeline's replicas are busy in turn)."""
        if self.servers.slots:
            return self.servers.slots
        return max(1, REPLICAS_PER_CORE * len(os.sched_getaffinity(0)) // self.compute.threads)

    def model_dir(self, model: str) -> Path:
        return self.models_dir / model

    def prefetch_dir(self, server: str) -> Path:
        """Where `server`'s prefetcher puts shards: QUART_PREFETCH_DIR, else shared memory
        (/dev/shm where it exists) in a folder named for this home, so two runtimes never share one."""
        if self.coldstart.prefetch_dir:
            return Path(self.coldstart.prefetch_dir) / server
        shm = Path("/dev/shm")
        root = shm if shm.is_dir() else Path(self.home)
        home = hashlib.sha1(str(Path(self.home).resolve()).encode()).hexdigest()[:10]
        return root / f"quart-{os.getuid()}-{home}" / "prefetch" / server

    @property
    def store_url(self) -> str:
        """Where the virtual servers read shards with QUART_VIRTUAL_DISKS: QUART_MODELS_URL where
        set, else the model store the embedded runtime serves QUART_MODELS from."""
        return self.models_url or f"http://127.0.0.1:{self.cache.port + self.servers.virtual}"

    def virtual_server(self, name: str) -> Settings:
        """The settings of one of virtual_server_names(): its own name and KeysManager port, and
        with QUART_VIRTUAL_DISKS its own models folder filled from store_url."""
        i = self.virtual_server_names().index(name)
        own = {"models": str(Path(self.home) / "servers" / name / "models"), "models_url": self.store_url} \
            if self.servers.own_disks else {}
        return self.replace(server=name, keysmanager_port=self.cache.port + i, **own)

    def virtual_server_names(self) -> list[str]:
        """One server keeps this server's name; several are <server>-0, <server>-1, ..."""
        if self.servers.virtual <= 1:
            return [self.server]
        return [f"{self.server}-{i}" for i in range(self.servers.virtual)]

    def flat(self) -> dict[str, object]:
        """Every setting under its variable's short name (QUART_REDIS_PORT: redis_port)."""
        return {v.name: _get(self, v.path) for v in VARIABLES if v.section == "settings"}

    def replace(self, **changes: object) -> Settings:
        """A copy with settings changed by short name, validated like the environment."""
        unknown = sorted(set(changes) - set(self.flat()))
        if unknown:
            raise ConfigError(f"unknown settings {unknown}")
        return _build({**self.flat(), **changes})


@dataclass(frozen=True)
class ReplicaIdentity:
    """What one function replica serves, set per function (the stack's environment) and per
    replica by the runtime: not configuration, and not part of Settings."""
    model: str = ""
    stages: str = ""
    started_by: str = "cold"
    source: str = ""


# -- the registry -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Var:
    env: str
    path: str              # "redis.port" into Settings, "identity.model" into ReplicaIdentity, "" for neither
    doc: str
    check: Callable[[object], str | None] | None = None
    default: object = None  # only for variables outside Settings and ReplicaIdentity

    @property
    def name(self) -> str:
        return self.env.removeprefix("QUART_").lower()

    @property
    def section(self) -> str:
        return "identity" if self.path.startswith("identity.") else "settings" if self.path else "other"


def _positive(v: object) -> str | None:
    return None if v > 0 else "must be greater than 0"


def _not_negative(v: object) -> str | None:
    return None if v >= 0 else "must be 0 or more"


def _port(v: object) -> str | None:
    return None if 0 < v < 65536 else "must be a port number, 1 to 65535"


def _fraction(v: object) -> str | None:
    return None if 0 < v <= 1 else "must be in (0, 1]"


def _one_of(*choices: str) -> Callable[[object], str | None]:
    return lambda v: None if v in choices else f"must be one of {', '.join(choices)}"


def _device(v: object) -> str | None:
    ok = v == "cpu" or v == "cuda" or (v.startswith("cuda:") and v[5:].isdigit())
    return None if ok else "must be cpu, cuda or cuda:N"


# QUART's mechanisms that QUART_ABLATE switches off one by one (the ablation study): the CV
# attention model, the CPU compensator, the KeysManagers' fork cache of key stages, and the
# scheduler's dispersion of key-stage replicas.
MECHANISMS = ("attention", "compensator", "fork-cache", "dispersion", "peer-start")


def _mechanisms(v: object) -> str | None:
    unknown = sorted({m.strip() for m in v.split(",") if m.strip()} - set(MECHANISMS))
    return f"unknown mechanism(s) {unknown}; known: {', '.join(MECHANISMS)}" if unknown else None


def _no_bounds(v: object) -> str | None:
    clash = sorted({"r_min", "r_max"} & set(v))
    return f"{clash} are set by QUART_R_MIN and QUART_R_MAX, for every policy" if clash else None


VARIABLES: tuple[Var, ...] = (
    Var("QUART_CONFIG", "", "a YAML file of settings by short name (`redis_port: 6391`); the environment overrides it",
        default=""),
    Var("QUART_SECRETS_DIR", "", "a folder of files named like these variables (`QUART_REDIS_PASSWORD`), each holding "
        "its value: a mounted Kubernetes Secret or OpenFaaS secret; the environment overrides it", default=""),
    Var("QUART_HOME", "home", "runtime state: partitioned models, logs, pid files, the admin password file"),
    Var("QUART_MODELS", "models", "partitioned models; empty means `<home>/models`"),
    Var("QUART_STACK_FILE", "stack_file", "the OpenFaaS stack file whose functions run"),
    Var("QUART_SERVER", "server", "this server's name (default: the host name); virtual servers are `<server>-<i>`"),
    Var("QUART_LOG_LEVEL", "log_level", "log level of every component", _one_of("DEBUG", "INFO", "WARNING", "ERROR")),
    Var("QUART_LOG_FORMAT", "log_format", "`text` (one line: time, pid, logger, level, message) or `json` (one object a "
        "line, with `request_id` where a line is about a request, from the entry through every stage)",
        _one_of("text", "json")),
    Var("QUART_LOG_MAX_BYTES", "log_max_bytes", "a runtime log over this size is rotated (copied to `.1`, then emptied)",
        _positive),
    Var("QUART_LOG_KEEP", "log_keep", "rotated copies kept of each log", _not_negative),
    Var("QUART_SOURCE_COMMIT", "source_commit", "the commit a copy of the repository without its `.git` (an image, "
        "another machine) was made from; benchmarks stamp it on their results where git cannot tell"),
    Var("QUART_INTERNAL_TOKEN", "internal_token",
        "bearer token of the KeysManager API and of stages' direct invoke; empty: `<home>/internal-token`"),
    Var("QUART_REDIS_HOST", "redis.host", "Redis host"),
    Var("QUART_REDIS_PORT", "redis.port", "Redis port (the embedded runtime starts its own redis-server there)", _port),
    Var("QUART_REDIS_DB", "redis.db", "Redis database number", _not_negative),
    Var("QUART_REDIS_PASSWORD", "redis.password",
        "Redis password; empty: the one the embedded runtime generates in `<home>/redis-password`"),
    Var("QUART_GATEWAY_HOST", "gateway.host", "the gateway's host (the embedded runtime listens there)"),
    Var("QUART_GATEWAY_PORT", "gateway.port", "the gateway's port", _port),
    Var("QUART_GATEWAY_USER", "gateway.user", "basic-auth user of `/system/*`"),
    Var("QUART_GATEWAY_PASSWORD", "gateway.password",
        "basic-auth password of `/system/*`; empty: the embedded runtime's `<home>/basic-auth-password`"),
    Var("QUART_NAMESPACE", "gateway.namespace", "the functions' namespace"),
    Var("QUART_REQUEST_TIMEOUT_S", "data.request_timeout_s", "a request not answered by then gets 504", _positive),
    Var("QUART_RECLAIM_IDLE_MS", "data.reclaim_idle_ms", "work held this long by a dead replica is claimed again", _positive),
    Var("QUART_HEARTBEAT_S", "data.heartbeat_s", "how often a replica renews its registration", _positive),
    Var("QUART_REPLICA_TTL_S", "data.replica_ttl_s", "a registration not renewed for this long expires", _positive),
    Var("QUART_BLOCK_MS", "data.block_ms", "how long a replica's read of its stream blocks", _positive),
    Var("QUART_RECORDS_MAXLEN", "data.records_maxlen", "length cap of every records and events stream", _positive),
    Var("QUART_DRAIN_TIMEOUT_S", "data.drain_timeout_s", "a replica being removed may finish its work for this long",
        _not_negative),
    Var("QUART_MAX_BODY_BYTES", "limits.max_body_bytes", "largest request body (413 above)", _positive),
    Var("QUART_READ_TIMEOUT_S", "limits.read_timeout_s",
        "a function replica waits this long for a request's whole body (408 after; OpenFaaS's read_timeout)",
        _positive),
    Var("QUART_ADMIT_WAIT_S", "data.admit_wait_s",
        "an entry refuses a request (429) that would queue longer than this before its first pass (embeddings "
        "and emulated models; generations are admitted by their deadline); 0: never",
        _not_negative),
    Var("QUART_TTFT_OBJECTIVE_S", "data.ttft_objective_s",
        "a generative model's time-to-first-token objective (set per entry function): a request's deadline is "
        "its arrival + this + its tokens at QUART_TPOT_OBJECTIVE_S, and one predicted to miss it gets 429; "
        "0: none (requests wait up to the request timeout)", _not_negative),
    Var("QUART_TPOT_OBJECTIVE_S", "data.tpot_objective_s",
        "a generative model's time-per-output-token objective: the entry lets in at most the sequences whose "
        "measured TPOT meets it and queues the rest, earliest deadline first; 0: no bound", _not_negative),
    Var("QUART_MAX_PROMPT_TOKENS", "limits.max_prompt_tokens", "longest prompt (413 above)", _positive),
    Var("QUART_MAX_NEW_TOKENS", "limits.max_new_tokens", "most tokens one request may generate", _positive),
    Var("QUART_MAX_INPUTS", "limits.max_inputs", "most inputs in one embedding request", _positive),
    Var("QUART_MAX_PASS_TOKENS", "limits.max_pass_tokens",
        "most tokens (inputs × length) in one stage pass; a direct stage invoke above gets 413", _positive),
    Var("QUART_MAX_BATCH", "batching.max_batch",
        "most work items (decode steps and prefills of different requests) a stage replica runs as one batch; at most 8 "
        "where its decode steps compile with packed weights (two steps of 8 cost less there than one of more)", _positive),
    Var("QUART_KV_BYTES", "batching.kv_bytes",
        "each stage replica's KV-cache budget; a request that does not fit waits, then gets 429", _positive),
    Var("QUART_KV_WAIT_S", "batching.kv_wait_s", "how long a prefill waits for KV room before its request gets 429",
        _not_negative),
    Var("QUART_DRAIN", "batching.drain",
        "what a replica being removed does with the KV caches it holds: `migrate` them to a peer, or `finish` their requests",
        _one_of("migrate", "finish")),
    Var("QUART_CHAIN_STEPS", "batching.chain_steps",
        "the last stage sends a generation's next decode step to the first stage itself while the entry streams "
        "the token (`python -m benchmarks token_anatomy` measures both), "
        "unless the token is the end of text; a stop sequence or a client gone costs one step more; false: the "
        "entry sends every step"),
    Var("QUART_DEVICE", "compute.device", "where stages compute", _device),
    Var("QUART_DTYPE", "compute.dtype",
        "stage weights' and KV caches' dtype; auto: a 16-bit checkpoint's own, else bfloat16 where the hardware "
        "computes it natively (AVX512-BF16 or AMX CPUs, GPUs from compute capability 8), float16 on older GPUs, "
        "float32 elsewhere",
        _one_of("auto", "float32", "bfloat16", "float16")),
    Var("QUART_THREADS", "compute.threads", "torch threads per replica", _positive),
    Var("QUART_PREPACK", "compute.prepack",
        "linear weights reordered once into oneDNN's layout on the CPU (what torch.compile's freezing does), for "
        "steps of several tokens; one-token steps read the plain weight, kept beside it (twice the weights' "
        "memory); false: plain `F.linear`"),
    Var("QUART_COMPILE", "compute.compile",
        "decode steps compiled with torch.compile (inductor; needs a C++ compiler, else eager) once per stage "
        "range: in a KeysManager zygote's successor, which takes its place once compiled (a later fork inherits "
        "the compiled step), else in the background after a replica starts, eager until then; CPU only, not "
        "with int8 weights; false: eager"),
    Var("QUART_COMPILE_NICE", "compute.compile_nice",
        "the nice value (0-19) of a replica's background compile and the compiler processes it starts: at 19 "
        "a busy host's cores go to serving first; 0: serving's own priority",
        lambda v: None if 0 <= v <= 19 else "must be in 0..19"),
    Var("QUART_COMPILE_DEFER_S", "compute.compile_defer_s",
        "the longest a replica's background compile waits for the replica to idle (no sequence held, no step "
        "for a second) before it starts anyway; 0: at once", _not_negative),
    Var("QUART_COMPILE_WORKER", "compute.compile_worker",
        "a replica's background compile runs first in a process of its own at the same nice value, which fills "
        "inductor's on-disk caches, and the replica then compiles from them (a fraction of the work, in the "
        "pauses between its serving turns); the process holds a second copy of the stage's weights while it "
        "runs; false: the whole compile in the replica"),
    Var("QUART_IDLE_CORES", "compute.idle_cores",
        "which CPU steps take the host's cores that no other replica of the host is computing on, while no two "
        "steps have overlapped for a second (else `QUART_THREADS`): `all` (the default) a step that holds a "
        "prefill, and a decode step that runs compiled (one request's TPOT 0.81x side by side on the 2-core EPYC, "
        "no difference at 4 and 16 concurrent; `python -m benchmarks idle_cores`; an eager decode step keeps its "
        "own: on two threads it was no faster); `prefill` only the prefills, so one request's prompt runs on every "
        "core at every stage; `off` none. A replica compiles its decode step for both counts (the second in the "
        "background after the first). The board sees only the replicas' steps, not other processes. Unless "
        "`off`, the processes the runtime starts spin OpenMP's idle threads for 20,000 rounds (`GOMP_SPINCOUNT`, "
        "unless set)",
        _one_of("off", "prefill", "all")),
    Var("QUART_QUANTIZE", "compute.quantize",
        "`int8`: weight-only int8 linears (a scale per output channel, torch's `_weight_int8pack_mm`; CPU only), "
        "half bfloat16's bytes; empty: none", lambda v: None if v in ("", "int8") else "must be int8 or empty"),
    Var("QUART_EMULATE", "compute.emulate", "an emulation profile (`models/profiles.py`) instead of real weights"),
    Var("QUART_KEYSMANAGER_HOST", "cache.host",
        "where the KeysManager listens (`0.0.0.0` in a pod, so the autoscaler and the replicas on its node reach it)"),
    Var("QUART_MODELS_URL", "models_url",
        "where a replica fetches a partitioned model it does not find in QUART_MODELS (a KeysManager: `http://host:8091`); "
        "empty: never"),
    Var("QUART_KEYSMANAGER_PORT", "cache.port", "the KeysManager's API port (virtual server i: port + i)", _port),
    Var("QUART_CACHE_STAGES", "cache.stages", "stage ranges cached at start: `all`, `none` or `smollm2:1,minilm:0`"),
    Var("QUART_CACHE_MEMORY_THRESHOLD", "cache.memory_threshold", "host memory use above which zygotes are evicted (LRU)",
        _fraction),
    Var("QUART_FORK_COW", "cache.fork_cow", "forked replicas share the zygote's pages copy-on-write; false clones them"),
    Var("QUART_CACHE_MIN_RESIDENCY_S", "cache.min_residency_s",
        "a zygote cached less than this long ago is not evicted to make room for another key stage (no churn "
        "while key stages flip)", _not_negative),
    Var("QUART_ZYGOTE_START_S", "cache.zygote_start_s",
        "how long a zygote may take to load its stage range before it is killed (its decode steps compile "
        "afterwards, in a successor that takes its place: keysmanager/manager.py)", _positive),
    Var("QUART_POLICY", "autoscaler.policy", "`quart`, a baseline's name, or `none` (no autoscaler)"),
    Var("QUART_BACKEND", "autoscaler.backend",
        "how the autoscaler's decisions take effect: `local` (the embedded runtime: replicas and live CPU changes), "
        "`gateway` (any OpenFaaS gateway: replicas only) or `kubernetes` (OpenFaaS on Kubernetes: forks, pods, "
        "in-place CPU resize)", _one_of("local", "gateway", "kubernetes")),
    Var("QUART_TICK_S", "autoscaler.tick_s", "the control loop's period", _positive),
    Var("QUART_AUTOSCALER_HOST", "autoscaler.host", "where the autoscaler serves /metrics and /healthz (`0.0.0.0` in a pod)"),
    Var("QUART_AUTOSCALER_PORT", "autoscaler.port",
        "the autoscaler's /metrics and /healthz port; 0: a free one, written to `<home>/run/autoscaler.port`",
        lambda v: None if 0 <= v < 65536 else "must be 0 or a port number"),
    Var("QUART_SLO_S", "autoscaler.slo_s", "end-to-end latency objective of one pipeline pass", _positive),
    Var("QUART_WINDOW_S", "autoscaler.window_s", "observation window of rates, CVs and service times", _positive),
    Var("QUART_LAYOUT_WINDOW_S", "autoscaler.layout_window_s",
        "window over which a model with a whole-model function counts its requests to decide whether to "
        "consolidate or split (HydraServe's sliding window)", _positive),
    Var("QUART_LAYOUT_WINDOWS", "autoscaler.layout_windows",
        "windows the request peak is taken over; a model must be this many windows warm to consolidate", _positive),
    Var("QUART_CPU_MAX", "autoscaler.cpu_max", "most CPUs the compensator gives one replica", _positive),
    Var("QUART_CPU_TOTAL", "autoscaler.cpu_total",
        "R_total of QUART's Algorithm 1: the CPUs all stage replicas of every model hold together (replicas × "
        "CPUs each); the compensator's raises are taken back, largest first, where they would pass it; 0: no bound",
        _not_negative),
    Var("QUART_POLICY_PARAMS", "autoscaler.policy_params",
        "the policy's own parameters as JSON, e.g. `{\"kp\": 0.5}` (QUART's PID), `{\"target_utilization\": 0.5}` "
        "(quart-flow's sizing, with the PID's) or `{\"target_concurrency\": 2}` (KPA)",
        _no_bounds),
    Var("QUART_ABLATE", "autoscaler.ablate",
        "QUART's mechanisms to switch off, comma-separated, for an ablation: `attention` (smooth on observed CVs), "
        "`compensator` (no CPU changes), `fork-cache` (key stages not cached: scale-ups cold-start), "
        "`dispersion` (key-stage replicas packed like the rest), `peer-start` (no multicast from servers that cache a "
        "stage: every start that cannot fork reads the store)", _mechanisms),
    Var("QUART_R_MIN", "autoscaler.bounds.r_min", "fewest replicas of a stage function the autoscaler keeps", _not_negative),
    Var("QUART_R_MAX", "autoscaler.bounds.r_max",
        "most replicas of a stage function (the autoscaler's bound and the embedded gateway's cap)", _positive),
    Var("QUART_VIRTUAL_SERVERS", "servers.virtual", "servers the embedded runtime emulates, each with its own KeysManager",
        _positive),
    Var("QUART_SERVER_SLOTS", "servers.slots",
        "replica slots per server; 0: 8 per core this host may use, divided by QUART_THREADS", _not_negative),
    Var("QUART_SERVER_CACHE_BYTES", "servers.cache_bytes", "host-memory budget for cached stages per server (0: none)",
        _not_negative),
    Var("QUART_SERVER_BANDWIDTH", "servers.bandwidth", "bytes/s of a server's link each way: what a cold start "
        "reads its shard at, and what a KeysManager sends its peers and reads from them and the model store at",
        _positive),
    Var("QUART_VIRTUAL_DISKS", "servers.own_disks",
        "each virtual server keeps its own models folder and reads shards from a model store the runtime serves "
        "from QUART_MODELS (on the KeysManager port + QUART_VIRTUAL_SERVERS), as a cluster's servers do: a "
        "cold start fetches its shards from the store, a peer start receives them from servers that cache the stage"),
    Var("QUART_STORE_BANDWIDTH", "servers.store_bandwidth",
        "bytes/s of the model store's link, shared by every server reading from it (QUART_VIRTUAL_DISKS)", _positive),
    Var("QUART_COLD_DEADLINE_S", "servers.cold_deadline_s", "a cold start must have read its shard by then (HydraServe)",
        _positive),
    Var("QUART_SCHEDULER_PARAMS", "servers.scheduler_params", "the scheduler's parameters as JSON (`SchedulerParams`)"),
    Var("QUART_EXECUTE_WHILE_LOAD", "servers.execute_while_load",
        "a whole-model replica receiving its shards from peers gets the model's stage functions on its server "
        "beside it, each serving once its shard is whole, until the whole replica is ready (λScale's "
        "execute-while-load and mode switch); false: the whole replica alone"),
    Var("QUART_STREAM_LOAD", "coldstart.stream",
        "a cold replica builds its tensors as its shard's bytes arrive (HydraServe §5.2); false waits for the whole shard"),
    Var("QUART_OVERLAP_IMPORTS", "coldstart.overlap",
        "a cold replica starts reading its shard before it imports torch (HydraServe §5); false reads after"),
    Var("QUART_PREFETCH_DIR", "coldstart.prefetch_dir",
        "where each server's prefetcher keeps the shards it pulls from QUART_MODELS_URL; empty: /dev/shm"),
    Var("QUART_PREFETCH_TTL_S", "coldstart.prefetch_ttl_s", "a finished prefetch is freed this long after it completed",
        _positive),
    Var("QUART_WARM_RUNTIME", "coldstart.warm_runtime",
        "each KeysManager keeps a runtime zygote (libraries imported, no parameters) and cold replicas are forked "
        "from it, skipping process start and imports; false starts them as new processes"),
    Var("QUART_FETCH_STALL_S", "coldstart.stall_s", "a shard read that makes no progress for this long fails", _positive),
    Var("QUART_CONTAINERS", "containers.run",
        "the embedded runtime runs Redis, the KeysManagers and the replicas as containers of the images "
        "(`make up-containers`)"),
    Var("QUART_IMAGE_BASE", "containers.base",
        "base image of `make images` (`python:3.11-slim` where a registry is reachable; the default is made here "
        "with debootstrap)"),
    Var("QUART_IMAGE_PREFIX", "", "stack files: where the functions' images are named "
        "(`${QUART_IMAGE_PREFIX:-quart}/stage:0.1.0`, substituted as faas-cli does)", default="quart"),
    Var("QUART_OCI_RUNTIME", "containers.oci_runtime", "the OCI runtime podman and buildah run containers with"),
    Var("QUART_MODEL", "identity.model", "set per function: the model it serves"),
    Var("QUART_MODEL_SOURCE", "identity.source", "set per function: the model's checkpoint, a folder in Hugging Face "
        "layout, a hub id, `smollm2` or `minilm` (default: QUART_MODEL); `make up` partitions it"),
    Var("QUART_STAGES", "identity.stages", "set per stage function: its stage range, `2` or `1-3` (end exclusive)"),
    Var("QUART_STARTED_BY", "identity.started_by", "set per replica by the runtime: `cold`, `fork-cow` or `fork-copy`"),
    Var("QUART_TEST_HOME", "", "tests: where partitioned test models are kept between runs", default=".quart/test"),
    Var("QUART_OPENFAAS_SPEC", "", "tests: the upstream OpenFaaS gateway spec `docs/openapi.yml` is checked against",
        default="tests/upstream/openfaas-gateway.openapi.yml"),
)
BY_NAME = {v.name: v for v in VARIABLES}


def _get(obj: object, path: str) -> object:
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def _field(root: type, path: str) -> dataclasses.Field:
    """The dataclass field a dotted path ends at."""
    cls = root
    *parents, leaf = path.split(".")
    for part in parents:
        cls = {f.name: f for f in fields(cls)}[part].default_factory
    return {f.name: f for f in fields(cls)}[leaf]


def kind_of(v: Var) -> type:
    if v.section == "other":
        return str
    root, path = (ReplicaIdentity, v.path.split(".", 1)[1]) if v.section == "identity" else (Settings, v.path)
    return {"int": int, "float": float, "str": str, "bool": bool, "dict": dict}[str(_field(root, path).type)]


def default_of(v: Var) -> object:
    if v.section == "other":
        return v.default
    root, path = (ReplicaIdentity(), v.path.split(".", 1)[1]) if v.section == "identity" else (Settings(), v.path)
    return _get(root, path)


def parse(v: Var, raw: object) -> object:
    """A raw value (a string from the environment, or a value from a file or a flag) as the
    variable's type, checked; ConfigError naming the variable otherwise."""
    kind = kind_of(v)
    try:
        if kind is bool:
            value = raw if isinstance(raw, bool) else _bool(str(raw))
        elif kind is dict:
            value = raw if isinstance(raw, dict) else (json.loads(raw) if str(raw).strip() else {})
            if not isinstance(value, dict):
                raise ValueError("not a JSON object")
        elif kind in (int, float) and isinstance(raw, bool):
            raise ValueError("not a number")
        else:
            value = kind(raw)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{v.env}={raw!r}: {exc}") from None
    problem = v.check(value) if v.check else None
    if problem:
        raise ConfigError(f"{v.env}={raw!r}: {problem}")
    return value


def _bool(raw: str) -> bool:
    low = raw.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError("not a boolean (true/false)")


def _nest(values: Mapping[str, object]) -> dict:
    tree: dict = {}
    for name, value in values.items():
        node = tree
        *parents, leaf = BY_NAME[name].path.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return tree


def _construct(cls: type, tree: dict) -> object:
    kwargs = {}
    for f in fields(cls):
        if f.name in tree:
            sub = tree[f.name]
            kwargs[f.name] = _construct(f.default_factory, sub) if isinstance(sub, dict) and \
                dataclasses.is_dataclass(f.default_factory) else sub
    return cls(**kwargs)


def _build(values: Mapping[str, object]) -> Settings:
    parsed = {name: parse(BY_NAME[name], raw) for name, raw in values.items()}
    settings = _construct(Settings, _nest(parsed))
    _check_together(settings)
    return settings


def _check_together(s: Settings) -> None:
    b = s.autoscaler.bounds
    if b.r_min > b.r_max:
        raise ConfigError(f"QUART_R_MIN={b.r_min} is above QUART_R_MAX={b.r_max}")
    if s.data.replica_ttl_s <= s.data.heartbeat_s:
        raise ConfigError(f"QUART_REPLICA_TTL_S={s.data.replica_ttl_s} must exceed QUART_HEARTBEAT_S="
                          f"{s.data.heartbeat_s}, or live replicas expire between heartbeats")


def _from_file(path: str) -> dict[str, object]:
    import yaml
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"QUART_CONFIG={path!r}: {exc}") from None
    names = {v.name for v in VARIABLES if v.section == "settings"}
    if not isinstance(data, dict) or not set(data) <= names:
        unknown = sorted(set(data) - names) if isinstance(data, dict) else data
        raise ConfigError(f"QUART_CONFIG={path!r}: not a mapping of settings by short name (unknown: {unknown})")
    return data


def _from_secrets(folder: Path) -> dict[str, str]:
    """Settings from files named by their variables, as Kubernetes and OpenFaaS mount secrets (a
    folder that is not there holds none: a container run without the secret)."""
    values = {}
    for v in VARIABLES:
        path = folder / v.env
        if v.section == "settings" and path.is_file():
            values[v.name] = path.read_text().strip()
    return values


def load_settings(environ: Mapping[str, str] | None = None, **overrides: object) -> Settings:
    """Settings from defaults, then the file named by QUART_CONFIG, then the files in
    QUART_SECRETS_DIR, then QUART_* variables, then explicit overrides by short name (flags).
    ConfigError names what is wrong."""
    environ = os.environ if environ is None else environ
    values: dict[str, object] = _from_file(environ["QUART_CONFIG"]) if environ.get("QUART_CONFIG") else {}
    if environ.get("QUART_SECRETS_DIR"):
        values.update(_from_secrets(Path(environ["QUART_SECRETS_DIR"])))
    for v in VARIABLES:
        if v.section == "settings" and environ.get(v.env, "") != "":
            values[v.name] = environ[v.env]
    unknown = sorted(set(overrides) - set(BY_NAME))
    if unknown:
        raise ConfigError(f"unknown settings {unknown}")
    values.update({k: val for k, val in overrides.items() if val is not None})
    return _build(values)


def replica_identity(environ: Mapping[str, str] | None = None) -> ReplicaIdentity:
    environ = os.environ if environ is None else environ
    return ReplicaIdentity(**{v.path.split(".", 1)[1]: parse(v, environ[v.env])
                              for v in VARIABLES if v.section == "identity" and environ.get(v.env)})


def add_arguments(parser: argparse.ArgumentParser, *names: str) -> None:
    """Adds --flag options for the named settings (short names); `settings_from_args` applies them."""
    for name in names:
        v = BY_NAME[name]
        parser.add_argument("--" + name.replace("_", "-"), dest=name, default=None,
                            help=f"{v.doc} (overrides {v.env})")


def settings_from_args(args: argparse.Namespace) -> Settings:
    return load_settings(**{k: v for k, v in vars(args).items() if k in BY_NAME and BY_NAME[k].section == "settings"})


def settings_environment(settings: Settings) -> dict[str, str]:
    """The QUART_* variables that reproduce these settings in a child process."""
    out = {}
    for v in VARIABLES:
        if v.section == "settings":
            value = _get(settings, v.path)
            out[v.env] = json.dumps(value) if isinstance(value, dict) else str(value)
    return out


# OpenMP's threads (torch's intra-op pool; libgomp in torch's Linux wheels) spin after each parallel
# region before they sleep, 300,000 rounds by default. With a stage's step on every core
# (QUART_IDLE_CORES), the spinning threads of the stage that had just stepped held the cores that
# the next stage's step needed: the 4-stage SmolLM2 took 46.3 ms a token, against 26.8 with 20,000
# rounds and 31.2 never spinning (OMP_WAIT_POLICY=PASSIVE: each region then wakes its threads; one
# run each, 2026-12-04, 2-core EPYC). A user's own setting is kept.
IDLE_CORES_OMP = {"GOMP_SPINCOUNT": "20000"}


def child_environment(settings: Settings, **extra: str) -> dict[str, str]:
    """The environment of a process this repository starts: ours, the settings, the repository
    first on PYTHONPATH (ahead of what the caller's PYTHONPATH holds, which the child keeps), and
    `extra` (identity variables) on top; with idle cores, OpenMP's spin (IDLE_CORES_OMP) unless
    ours sets it."""
    from contracts.paths import REPO_ROOT
    entries = [str(REPO_ROOT), *os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    path = os.pathsep.join(dict.fromkeys(e for e in entries if e))  # once each, in order: children of children
    omp = IDLE_CORES_OMP if settings.compute.idle_prefills else {}
    return {**omp, **os.environ, **settings_environment(settings), "PYTHONPATH": path, **extra}


def from_params(base: object, params: Mapping[str, object], variable: str) -> object:
    """`base` (a parameters dataclass, or an instance of one to start from) with the fields a
    JSON object sets (QUART_POLICY_PARAMS and the like); ConfigError naming the variable and the
    fields it takes when a name or a value is wrong."""
    cls = base if isinstance(base, type) else type(base)
    names = {f.name for f in fields(cls)} - {"name"}
    unknown = sorted(set(params) - names)
    if unknown:
        raise ConfigError(f"{variable}: {cls.__name__} has no {unknown}; it takes {sorted(names)}")
    try:
        return cls(**params) if isinstance(base, type) else dataclasses.replace(base, **params)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{variable}: {exc}") from None


def exit_on_config_error(load: Callable[[], Settings]) -> Settings:
    """For a command's start: a bad setting ends it with the message, not a traceback."""
    try:
        return load()
    except ConfigError as exc:
        raise SystemExit(f"configuration: {exc}") from None


def markdown_table() -> str:
    """The configuration table (docs/configuration.md), one row per variable."""
    rows = ["| variable | default | meaning |", "|---|---|---|"]
    for v in VARIABLES:
        default = default_of(v)
        if v.name == "home":
            default = "./.quart"
        elif v.name == "server":
            default = "(host name)"
        shown = json.dumps(default) if isinstance(default, dict) else str(default).lower() \
            if isinstance(default, bool) else str(default)
        rows.append(f"| `{v.env}` | {f'`{shown}`' if shown != '' else '(empty)'} | {v.doc} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    if sys.argv[1:] != ["--markdown"]:
        raise SystemExit("usage: python -m contracts.config --markdown")
    sys.stdout.write(markdown_table())

"""One configuration for every component: defaults in code, overridden by QUART_* environment
variables, and by command-line flags where a command offers them (see `add_arguments`)."""
from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field, fields
from pathlib import Path


def _default_home() -> str:
    return str(Path.cwd() / ".quart")


@dataclass(frozen=True)
class Settings:
    # Where runtime state lives: model shards, the password file, logs, pid files.
    home: str = field(default_factory=_default_home)
    # Partitioned models; empty means <home>/models.
    models: str = ""
    redis_host: str = "127.0.0.1"
    redis_port: int = 6390
    redis_db: int = 0
    gateway_host: str = "127.0.0.1"
    gateway_port: int = 8080
    gateway_user: str = "admin"
    # Namespace reported for functions; the embedded runtime has just this one.
    namespace: str = "openfaas-fn"
    stack_file: str = "stack.yml"
    # Name of this server (virtual servers on the embedded runtime get their own).
    server: str = field(default_factory=lambda: os.uname().nodename)
    # Data plane timing.
    request_timeout_s: float = 120.0
    reclaim_idle_ms: int = 5000
    heartbeat_s: float = 1.0
    replica_ttl_s: float = 5.0
    block_ms: int = 500
    records_maxlen: int = 10000
    # Bounds on user input.
    max_body_bytes: int = 8 * 1024 * 1024
    max_prompt_tokens: int = 2048
    max_new_tokens: int = 64
    max_batch: int = 64
    # What a function replica serves (set per function in stack.yml): the model, and for a
    # stage function its stage range "a" or "a-b" (b exclusive), and how the replica was started.
    model: str = ""
    stages: str = ""
    started_by: str = "cold"
    # Emulated compute: a profile name from pipeline/emulated.py, or empty for real weights.
    emulate: str = ""
    # Stage execution.
    device: str = "cpu"
    dtype: str = "float32"
    threads: int = 1
    # KeysManager: its port, which stages it caches at start ("all", "none", or
    # "model:stages,..."), and the host-memory use above which it evicts zygotes (LRU).
    keysmanager_port: int = 8091
    cache_stages: str = "all"
    cache_memory_threshold: float = 0.85
    # Replicas forked from a zygote share its pages copy-on-write; false clones them first.
    fork_cow: bool = True
    # Autoscaler: policy ("quart" or a baseline's name), tick, end-to-end SLO, observation window.
    policy: str = "quart"
    tick_s: float = 1.0
    slo_s: float = 2.0
    window_s: float = 10.0
    r_max: int = 16
    cpu_max: int = 2
    # The policy's own parameters as JSON, e.g. '{"kp": 0.5, "ki": 0.1}' for QUART's PID or
    # '{"target_concurrency": 2}' for Knative's KPA; names are the policy's dataclass fields.
    policy_params: str = ""
    # How long a replica being scaled down may take to finish its work.
    drain_timeout_s: float = 30.0
    # Embedded runtime: how many virtual servers, each with its own KeysManager (on
    # keysmanager_port + i), replica slots, host-memory budget for cached stages in bytes (0: only
    # cache_memory_threshold applies) and the bandwidth a cold start reads its shard at (bytes/s).
    virtual_servers: int = 1
    server_slots: int = 64
    server_cache_bytes: int = 0
    server_bandwidth: float = 1e9
    # A cold start must have read its shard this long after it began (HydraServe's deadline).
    cold_deadline_s: float = 60.0
    # The scheduler's parameters as JSON; names are scheduler.placement.SchedulerParams fields.
    scheduler_params: str = ""

    @property
    def redis_url(self) -> str:
        return f"redis://{self.redis_host}:{self.redis_port}/{self.redis_db}"

    @property
    def gateway_url(self) -> str:
        return f"http://{self.gateway_host}:{self.gateway_port}"

    @property
    def models_dir(self) -> Path:
        return Path(self.models) if self.models else Path(self.home) / "models"

    @property
    def password_file(self) -> Path:
        # OpenFaaS's own name for the admin password file.
        return Path(self.home) / "basic-auth-password"

    def model_dir(self, model: str | None = None) -> Path:
        return self.models_dir / (model or self.model)

    def stage_range(self) -> tuple[int, int]:
        """The stage range of a stage function: "2" is [2, 3), "2-4" is [2, 4)."""
        first, _, last = self.stages.partition("-")
        a = int(first)
        return a, int(last) if last else a + 1

    def virtual_server_names(self) -> list[str]:
        """One server keeps this server's name; several are <server>-0, <server>-1, ..."""
        if self.virtual_servers <= 1:
            return [self.server]
        return [f"{self.server}-{i}" for i in range(self.virtual_servers)]

    def replace(self, **changes: object) -> Settings:
        return dataclasses.replace(self, **changes)


def env_name(name: str) -> str:
    return "QUART_" + name.upper()


def _coerce(kind: type, raw: str) -> object:
    if kind is bool:
        return raw.lower() in ("1", "true", "yes", "on")
    return kind(raw)


def _field_type(f: dataclasses.Field) -> type:
    return {"int": int, "float": float, "str": str, "bool": bool}[str(f.type)]


def _from_file(path: str) -> dict[str, object]:
    """A YAML (or JSON) mapping of setting names to values."""
    import yaml
    data = yaml.safe_load(Path(path).read_text()) or {}
    names = {f.name for f in fields(Settings)}
    if not isinstance(data, dict) or not set(data) <= names:
        unknown = sorted(set(data) - names) if isinstance(data, dict) else data
        raise SystemExit(f"{path}: not a mapping of settings (unknown: {unknown})")
    return data


def load_settings(environ: dict[str, str] | None = None, **overrides: object) -> Settings:
    """Settings from defaults, then the file named by QUART_CONFIG, then QUART_* variables, then
    explicit overrides (flags)."""
    environ = os.environ if environ is None else environ
    values: dict[str, object] = _from_file(environ["QUART_CONFIG"]) if environ.get("QUART_CONFIG") else {}
    for f in fields(Settings):
        raw = environ.get(env_name(f.name))
        if raw is not None and raw != "":
            try:
                values[f.name] = _coerce(_field_type(f), raw)
            except ValueError as exc:
                raise SystemExit(f"{env_name(f.name)}={raw!r}: {exc}") from exc
    values.update({k: v for k, v in overrides.items() if v is not None})
    return Settings(**values)


def add_arguments(parser: argparse.ArgumentParser, *names: str) -> None:
    """Adds --flag options for the named settings; `settings_from_args` applies them."""
    for f in fields(Settings):
        if f.name in names:
            kind = _field_type(f)
            parser.add_argument("--" + f.name.replace("_", "-"), dest=f.name,
                                type=lambda raw, kind=kind: _coerce(kind, raw), default=None,
                                help=f"overrides {env_name(f.name)}")


def settings_from_args(args: argparse.Namespace) -> Settings:
    names = {f.name for f in fields(Settings)}
    return load_settings(**{k: v for k, v in vars(args).items() if k in names})


def settings_environment(settings: Settings) -> dict[str, str]:
    """The QUART_* variables that reproduce these settings in a child process."""
    return {env_name(f.name): str(getattr(settings, f.name)) for f in fields(Settings)}

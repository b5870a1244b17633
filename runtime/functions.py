"""The embedded runtime's process manager: each function replica is a local watchdog process on
one virtual server, forked from that server's KeysManager or started cold. Where replicas go and
which ones leave is the scheduler's decision (runtime/placer.py); this only starts, watches and
drains them. Scaling down lets a replica finish its work before it exits."""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from itertools import count
from pathlib import Path

from containers import runtime as in_containers
from containers.podman import ContainerError
from contracts.config import Settings, child_environment
from contracts.paths import REPO_ROOT
from contracts.stack import identity
from contracts.stage import StageRef
from keysmanager.client import KeysClient, KeysManagerError
from runtime.watched_process import WatchedProcess, start_time
from scheduler.state import Placement, ReplicaId

log = logging.getLogger("quart.functions")
# The wait before replacing a replica that exited before it was ready doubles from BACKOFF_S with
# each such exit in a row, up to BACKOFF_MAX_S.
BACKOFF_S, BACKOFF_MAX_S = 1.0, 60.0
_serial = count()


def start_watchdog(settings: Settings, handler: Path, env: dict[str, str], port_file: Path | None,
                   log_path: Path) -> subprocess.Popen:
    """A cold replica: a new process that imports everything and loads its stages itself."""
    cmd = [sys.executable, "-m", "engine.watchdog", "--handler", str(handler)]
    if port_file is not None:
        cmd += ["--port-file", str(port_file)]
    full_env = child_environment(settings, **env)
    with open(log_path, "ab") as out:
        return subprocess.Popen(cmd, env=full_env, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)


@dataclass
class ReplicaProcess:
    proc: subprocess.Popen | WatchedProcess
    port_file: Path
    server: str
    started_by: str = "cold"
    started: float = field(default_factory=time.time)
    port: int | None = None
    ready: bool = False
    draining_since: float | None = None
    probed_at: float = 0.0
    failed_probes: int = 0
    placement: Placement | None = None  # the scheduler's, until the replica is first ready
    # Execute-while-load: the whole-model replica on this server that this stage replica serves in
    # place of while that one's shards arrive (runtime/placer.py); None: one of its function's own.
    stands_in_for: ReplicaId | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def id(self) -> ReplicaId:
        return ReplicaId(self.server, self.pid)

    def snapshot(self) -> dict:
        return {"pid": self.pid, "start_ticks": start_time(self.pid), "port_file": str(self.port_file),
                "port": self.port, "server": self.server, "started_by": self.started_by,
                "since": self.started, "draining_since": self.draining_since,
                "stands_in_for": [self.stands_in_for.server, self.stands_in_for.pid] if self.stands_in_for else None}

    @classmethod
    def restore(cls, saved: dict) -> ReplicaProcess | None:
        """The replica a snapshot names, if it still runs; not ready until probed."""
        proc = WatchedProcess(saved["pid"], saved["start_ticks"])
        if proc.poll() is not None:
            return None
        stands_in_for = saved.get("stands_in_for")
        return cls(proc, Path(saved["port_file"]), saved["server"], saved["started_by"], saved["since"],
                   saved["port"], draining_since=saved["draining_since"],
                   stands_in_for=ReplicaId(*stands_in_for) if stands_in_for else None)


@dataclass
class FunctionState:
    deployment: dict
    handler: Path
    desired: int
    created_at: str = field(default_factory=lambda: datetime.now(UTC).isoformat())
    replicas: list[ReplicaProcess] = field(default_factory=list)
    invocations: int = 0
    _next: int = 0
    # Replicas in a row that exited before they were ever ready (a shard that fails its checksum,
    # a broken deployment), and when the next may start: Kubernetes' CrashLoopBackOff, shorter.
    failed_starts: int = 0
    retry_at: float = 0.0

    @property
    def name(self) -> str:
        return self.deployment["service"]

    @property
    def stage(self) -> StageRef | None:
        """The stage range of a stage function (the provider validated it), else None."""
        return identity(self.deployment)[1]

    @property
    def stage_key(self) -> str:
        """The scheduler's name of what this function runs: its StageRef's key (what a
        KeysManager caches) for a stage function, else the function's name."""
        return self.stage.key if self.stage is not None else self.name

    def snapshot(self) -> dict:
        return {"deployment": self.deployment, "desired": self.desired, "created_at": self.created_at,
                "replicas": [r.snapshot() for r in self.replicas]}

    @classmethod
    def restore(cls, saved: dict, handler: Path) -> FunctionState:
        replicas = [r for r in map(ReplicaProcess.restore, saved["replicas"]) if r is not None]
        return cls(saved["deployment"], handler, saved["desired"], saved["created_at"], replicas)

    def serving(self) -> list[ReplicaProcess]:
        return [r for r in self.replicas if r.draining_since is None]

    def own(self) -> list[ReplicaProcess]:
        """The serving replicas that count towards `desired`: not those standing in for a
        whole-model replica while it loads."""
        return [r for r in self.serving() if r.stands_in_for is None]

    def ready(self) -> list[ReplicaProcess]:
        return [r for r in self.serving() if r.ready]

    def pick(self) -> ReplicaProcess | None:
        """Round robin over ready replicas."""
        ready = self.ready()
        if not ready:
            return None
        self._next = (self._next + 1) % len(ready)
        return ready[self._next]


class ProcessManager:
    def __init__(self, settings: Settings, keys: dict[str, KeysClient | None]) -> None:
        """`keys`: each virtual server's KeysManager client (None where it has none)."""
        self.settings = settings
        self.keys = keys
        self.run_dir = Path(settings.home) / "run"
        self.log_dir = Path(settings.home) / "logs"
        (self.run_dir / "replicas").mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)

    def spawn(self, fn: FunctionState, server: str, path: str = "cold") -> ReplicaProcess:
        """A new replica on `server` by the scheduler's `path`: "fork" from its KeysManager's
        zygote (cold where it no longer holds the stage); "cold", its shards prefetched from the
        model store where there is one; "peer", cold on shards its KeysManager is receiving from
        its peers (runtime/multicast.py), which the replica follows as they arrive."""
        replica = (path == "fork" and self._fork(fn, server)) or self._cold(fn, server, prefetch=path != "peer")
        fn.replicas.append(replica)
        log.info("started %s replica pid %d on %s (%s)", fn.name, replica.pid, server, replica.started_by)
        return replica

    def _fork(self, fn: FunctionState, server: str) -> ReplicaProcess | None:
        env, keys = fn.deployment.get("envVars") or {}, self.keys.get(server)
        if keys is None or fn.stage is None:
            return None
        try:
            answer = keys.fork(fn.stage, fn.name, {k: v for k, v in env.items() if k.startswith("QUART_")},
                               cow=self.settings.cache.fork_cow)
        except (KeysManagerError, OSError) as exc:
            log.info("no fork for %s on %s (%s); cold start", fn.name, server, exc)
            return None
        return ReplicaProcess(WatchedProcess(answer["pid"]), Path(answer["port_file"]), server, answer["started_by"])

    def _cold(self, fn: FunctionState, server: str, prefetch: bool) -> ReplicaProcess:
        serial = f"{os.getpid()}.{next(_serial)}"
        port_file = self.run_dir / "replicas" / f"{fn.name}.{serial}.port"
        port_file.unlink(missing_ok=True)
        env = {**fn.deployment.get("envVars", {}), "QUART_SERVER": server}
        if prefetch:
            self._prefetch(fn, server)
        warm = self._from_runtime(fn, server, env)
        if warm is not None:
            return warm
        if self.settings.containers.run:
            with open(self.log_dir / f"{fn.name}.log", "ab") as out:
                proc = in_containers.replica(self.settings, f"quart-{fn.name}-{serial.replace('.', '-')}",
                                             fn.deployment["image"], env, port_file, out, self.settings.compute.threads)
        else:
            proc = start_watchdog(self.server_settings(fn, server), fn.handler, env, port_file,
                                  self.log_dir / f"{fn.name}.log")
        return ReplicaProcess(proc, port_file, server)

    def server_settings(self, fn: FunctionState, server: str) -> Settings:
        """What a stage replica on `server` runs with: that server's models folder and store
        (QUART_VIRTUAL_DISKS); the entry reads the host's."""
        if fn.stage is None or server not in self.settings.virtual_server_names():
            return self.settings
        return self.settings.virtual_server(server)

    def _prefetch(self, fn: FunctionState, server: str) -> None:
        """Where shards come from a model store (QUART_MODELS_URL, or the runtime's with
        QUART_VIRTUAL_DISKS), the server's prefetcher starts pulling this replica's before its
        process exists (HydraServe §5.1)."""
        keys = self.keys.get(server)
        if keys is None or fn.stage is None or not self.server_settings(fn, server).models_url:
            return
        try:
            keys.prefetch(fn.stage)
        except (KeysManagerError, OSError) as exc:
            log.info("no prefetch of %s on %s: %s", fn.stage, server, exc)

    def _from_runtime(self, fn: FunctionState, server: str, env: dict[str, str]) -> ReplicaProcess | None:
        """A cold replica forked from the server's runtime zygote (QUART_WARM_RUNTIME), or None
        where there is none (containers, no KeysManager, an entry function, a refusal)."""
        keys = self.keys.get(server)
        if not self.settings.coldstart.warm_runtime or self.settings.containers.run or keys is None or fn.stage is None:
            return None
        try:
            answer = keys.start_cold(fn.stage, fn.name, {k: v for k, v in env.items() if k.startswith("QUART_")})
        except (KeysManagerError, OSError) as exc:
            log.info("no warm runtime for %s on %s (%s); a new process", fn.name, server, exc)
            return None
        return ReplicaProcess(WatchedProcess(answer["pid"]), Path(answer["port_file"]), server, "cold")

    def set_cpus(self, fn: FunctionState, cpus: float) -> None:
        """The CPU quota of the function's replicas in containers of their own, changed in place."""
        for replica in fn.serving():
            if isinstance(replica.proc, in_containers.ContainerRun) and replica.proc.cpus != cpus:
                try:
                    replica.proc.set_cpus(cpus)
                except ContainerError as exc:  # it may have just exited
                    log.warning("no CPU change for %s: %s", replica.id, exc)

    def drain(self, replica: ReplicaProcess) -> None:
        """Asks a replica to finish its work and exit (SIGTERM)."""
        if replica.draining_since is None:
            replica.draining_since = time.time()
            _signal(replica, signal.SIGTERM)

    def refresh(self, fn: FunctionState) -> list[ReplicaProcess]:
        """Reaps exited replicas (a dead one is replaced by the next placement round), notices
        ready ones, and kills those that overran their drain time; the replicas reaped."""
        reaped = []
        for replica in list(fn.replicas):
            code = replica.proc.poll()
            if code is not None:
                fn.replicas.remove(replica)
                reaped.append(replica)
                replica.port_file.unlink(missing_ok=True)
                if replica.draining_since is None and not replica.ready:
                    fn.failed_starts += 1
                    wait = min(BACKOFF_MAX_S, BACKOFF_S * 2 ** (fn.failed_starts - 1))
                    fn.retry_at = time.time() + wait
                    # The exit itself is logged with its placement record (`Placer.exited`).
                    log.warning("%s: %d starts in a row failed; the next starts in %.0f s",
                                fn.name, fn.failed_starts, wait)
            elif replica.draining_since is not None:
                if time.time() - replica.draining_since > self.settings.data.drain_timeout_s:
                    _signal(replica, signal.SIGKILL)
            elif replica.port is None and replica.port_file.exists():
                replica.port = int(replica.port_file.read_text())
            elif replica.ready:
                fn.failed_starts = 0
        return reaped

    def stop_all(self, functions: list[FunctionState], timeout: float) -> None:
        for fn in functions:
            fn.desired = 0
            for replica in fn.replicas:
                self.drain(replica)
        deadline = time.time() + timeout
        for fn in functions:
            for replica in fn.replicas:
                try:
                    replica.proc.wait(timeout=max(0.1, deadline - time.time()))
                except subprocess.TimeoutExpired:
                    _signal(replica, signal.SIGKILL)
                    replica.proc.wait()
                replica.port_file.unlink(missing_ok=True)
            fn.replicas.clear()


def _signal(replica: ReplicaProcess, sig: int) -> None:
    try:
        replica.proc.send_signal(sig)
    except ProcessLookupError:
        pass

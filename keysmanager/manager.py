"""KeysManager: one per server. Keeps key stages' parameters in host memory, each stage range in
its own zygote process, and forks replicas from them; evicts the least recently used zygotes
when host memory use passes a threshold; drops a zygote whose shard changed on disk.

Where decode steps compile (QUART_COMPILE), a stage is cached as soon as its zygote has loaded,
and a second zygote, its successor, loads and compiles beside it at QUART_COMPILE_NICE; once the
successor answers it takes the first one's place and the first one ends (its forks serve on, and
compile their own steps as any replica not forked from a compiled zygote does). A compile of a
whole model can take longer than anyone should wait for a cache (minutes on a slow host), and
forks meanwhile serve eager steps rather than none. The cost, outside the cache's byte budget:
a second copy of the stage's parameters while the successor compiles, and after it for as long
as forks of the first zygote (which share its pages) live."""
from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from contracts.config import Settings, child_environment, settings_environment
from contracts.paths import REPO_ROOT, STAGE_HANDLER
from contracts.proc_stat import start_time
from contracts.stage import StageRef
from keysmanager.cache_policy import Held, OverBudget, evictions
from keysmanager.metrics import KeysManagerMetrics
from models.compile_worker import TIMEOUT_S as COMPILE_TIMEOUT_S
from models.fetch import ensure_manifest, ensure_model, partial_path
from models.manifest import Manifest
from models.profiles import PROFILES as EMULATION_PROFILES
from models.shard_reader import PART, Arrival
from state.records import CacheEvent, ZygoteRecord
from state.store import Store

log = logging.getLogger("quart.keysmanager")
ARRIVAL_POLL_S = 0.1  # how often a cache waiting for a shard still arriving here looks again


class NotCached(KeyError):
    pass


class StaleShard(RuntimeError):
    pass


class NotForkedHere(KeyError):
    pass


class ZygoteExited(RuntimeError):
    """A zygote that ended before it answered; the message names its log."""


@dataclass(frozen=True)
class Fork:
    """A replica this KeysManager forked: where it can be reached from outside (pid and its start
    time, so a reused pid is not mistaken for it) and what it serves."""
    pid: int
    start_ticks: int | None
    function: str
    stage: StageRef
    started_by: str
    since: float
    port_file: Path | None = None

    def alive(self) -> bool:
        return self.start_ticks is not None and start_time(self.pid) == self.start_ticks

    def port(self) -> int | None:
        """Where it listens, once it does."""
        try:
            return int(self.port_file.read_text()) if self.port_file is not None else None
        except (FileNotFoundError, ValueError):
            return None

    def describe(self) -> dict:
        return {"pid": self.pid, "function": self.function, "model": self.stage.model, "stages": self.stage.stages,
                "started_by": self.started_by, "since": self.since}


@dataclass
class Zygote:
    stage: StageRef | None          # None: the runtime zygote, which holds only the libraries
    proc: subprocess.Popen
    socket: Path
    sha256: list[str]
    bytes: int
    started_at: float = field(default_factory=time.time)
    last_use: float = field(default_factory=time.time)
    forks: int = 0
    forking: int = 0
    compile: str = "off"            # "compiling" (a successor compiles), "done", "failed" or "off"
    successor: subprocess.Popen | None = None

    @property
    def key(self) -> str:
        return self.stage.key

    def alive(self) -> bool:
        return self.proc.poll() is None

    def end(self) -> None:
        """Ends the process (its forks live on) and any successor still compiling."""
        for proc in (self.proc, self.successor):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        self.socket.unlink(missing_ok=True)

    def describe(self) -> dict:
        return {"model": self.stage.model, "stages": self.stage.stages, "pid": self.proc.pid, "sha256": self.sha256,
                "bytes": self.bytes, "started_at": self.started_at, "last_use": self.last_use,
                "forks": self.forks, "compile": self.compile}


def zygote_name(stage: StageRef | None) -> str:
    """How a zygote of `stage` (the runtime zygote for None) is named in its socket, log and messages."""
    return f"{stage.model}-{stage.stages}" if stage else "runtime"


def zygote_call(path: Path, request: dict, timeout: float = 30.0) -> dict:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(str(path))
        s.sendall(json.dumps(request).encode() + b"\n")
        answer = json.loads(s.makefile("rb").readline() or b"{}")
    if "error" in answer:
        raise RuntimeError(f"zygote: {answer['error']}")
    return answer


class KeysManager:
    def __init__(self, settings: Settings, store: Store) -> None:
        self.settings = settings
        self.store = store
        self.server = settings.server
        self.threshold = settings.cache.memory_threshold
        self.run_dir = Path(settings.home) / "run" / f"keysmanager-{self.server}"
        self.log_dir = Path(settings.home) / "logs"
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.zygotes: dict[StageRef, Zygote] = {}
        self.forked: dict[int, Fork] = {}
        self._lock = threading.RLock()
        self._starting: dict[StageRef, threading.Event] = {}
        self._runtime: Zygote | None = None
        self._runtime_lock = threading.Lock()
        self.metrics = KeysManagerMetrics(self.stats)

    # -- cache ---------------------------------------------------------------------------------

    def emulated(self, model: str) -> bool:
        """An emulated model (models/emulated.py) has no shards: its zygote holds only the
        imports, which is what makes a forked replica start fast."""
        return model in EMULATION_PROFILES and not (self.settings.model_dir(model) / "manifest.json").exists()

    def shards(self, stage: StageRef) -> tuple[list[str], int]:
        """The sha256 and total size of the shards a stage range needs, as the manifest says now."""
        emulated = self.emulated(stage.model)
        source = EMULATION_PROFILES[stage.model] if emulated else Manifest.load(self.settings.model_dir(stage.model))
        if stage.last > source.num_stages:
            raise ValueError(f"{stage.model} has stages 0..{source.num_stages - 1}; got {stage.stages!r}")
        if emulated:
            return [], source.stage_bytes(stage.first, stage.last)  # nominal: counts against the budget
        infos = source.stages[stage.first:stage.last]
        return [s.sha256 for s in infos], sum(s.bytes for s in infos)

    def cache(self, stage: StageRef) -> Zygote:
        """Starts a zygote for the stage range unless a live, current one exists; its shards
        fetched from the model store first where they are not on this server's disk (FetchError
        where that fails): they stay there, and this server serves them to its peers."""
        if not self.emulated(stage.model):
            self._keep_received(stage)
            ensure_model(self.settings, stage.model, range(stage.first, stage.last))
        shas, size = self.shards(stage)
        while True:
            with self._lock:
                z = self.zygotes.get(stage)
                if z is not None and z.alive() and z.sha256 == shas:
                    z.last_use = time.time()
                    return z
                if z is not None:
                    self._evict_locked(z, "stale shard" if z.alive() else "zygote died")
                waiting = self._starting.get(stage)
                if waiting is None:
                    self._make_room_locked(size)
                    self._starting[stage] = threading.Event()
                    break
            waiting.wait(self.settings.cache.zygote_start_s)
        try:
            z = self._start(stage, shas, size)
            with self._lock:
                self.zygotes[stage] = z
            self._publish(z)
            self._event("cache", z)
            if self._compiles(stage):
                z.compile = "compiling"
                threading.Thread(target=self._succeed, args=(z,), name=f"compile-{z.key}", daemon=True).start()
            return z
        finally:
            with self._lock:
                self._starting.pop(stage).set()

    def _compiles(self, stage: StageRef) -> bool:
        """Whether forks of `stage` serve compiled decode steps, so that its zygote has a successor."""
        return (self.settings.compute.compiles and not self.emulated(stage.model)
                and Manifest.load(self.settings.model_dir(stage.model)).generative)

    def _succeed(self, z: Zygote) -> None:
        """Starts a zygote of z's stage that compiles before it answers, and puts it in z's place
        once it does; z ends once no fork from it is in flight. Nothing changes where z has been
        evicted meanwhile (which ends the successor) or the compile fails."""
        try:
            proc, path = self._spawn(z.stage, ["--compile"])
            with self._lock:
                if self.zygotes.get(z.stage) is not z:
                    proc.kill()
                    return
                z.successor = proc
            self._await(proc, path, zygote_name(z.stage), COMPILE_TIMEOUT_S)
        except (ZygoteExited, TimeoutError, OSError) as exc:
            z.compile = "failed"
            if self.zygotes.get(z.stage) is not z:
                return  # evicted meanwhile, which ended the successor
            log.warning("the compiled successor of %s did not start (forks stay eager, and compile their own): %s",
                        z.key, exc)
            return
        successor = Zygote(z.stage, proc, path, z.sha256, z.bytes, z.started_at, z.last_use, z.forks, compile="done")
        with self._lock:
            current = self.zygotes.get(z.stage) is z and z.alive()
            if current:
                self.zygotes[z.stage] = successor
                z.successor = None
        if not current:
            successor.end()
            return
        self._publish(successor)
        self._event("compiled", successor, replaced=z.proc.pid)
        log.info("zygote %s compiled, pid %d in place of %d", z.key, proc.pid, z.proc.pid)
        while True:
            with self._lock:
                if z.forking == 0:
                    break
            time.sleep(0.05)
        z.end()

    def _keep_received(self, stage: StageRef) -> None:
        """Where this server fetches from a model store, shards it already holds whole in its
        prefetch folder (received from its peers, or prefetched; each checked before it was
        renamed there) are copied into its models folder instead of fetched again: a server that
        received a stage caches it from what it received, and serves it to its peers from there."""
        if not self.settings.models_url:
            return
        manifest = ensure_manifest(self.settings, stage.model, tokenizer=False)
        received = self.settings.prefetch_dir(self.settings.server) / stage.model
        for i in stage.indices():
            if i >= manifest.num_stages:
                return  # shards() names the bad range
            source, target = received / manifest.stages[i].shard, manifest.shard_path(i)
            if not target.is_file() and self._arrived(source):
                partial = partial_path(target)
                shutil.copyfile(source, partial)
                partial.rename(target)
                log.info("kept %s/%s as received", stage.model, target.name)

    def _arrived(self, path: Path) -> bool:
        """Whether `path` is whole in the prefetch folder, waiting while this server's prefetcher
        or receiver still writes it (its `.part` grows; the runtime's start prefetches a cold
        replica's shard while the same server caches its stage) for as long as the model's arrival
        makes progress within QUART_FETCH_STALL_S (`shard_reader.Arrival`)."""
        part, arrival = path.with_name(path.name + PART), Arrival(path.parent, self.settings.coldstart.stall_s)
        while not path.is_file():
            if not part.exists():  # renamed whole meanwhile, or given up
                return path.is_file()
            if arrival.stalled():
                return False
            time.sleep(ARRIVAL_POLL_S)
        return True

    def _start(self, stage: StageRef | None, shas: list[str], size: int) -> Zygote:
        """A zygote of `stage`, or the runtime zygote (None), once it answers."""
        proc, path = self._spawn(stage)
        self._await(proc, path, zygote_name(stage), self.settings.cache.zygote_start_s, "QUART_ZYGOTE_START_S")
        return Zygote(stage, proc, path, shas, size)

    def _spawn(self, stage: StageRef | None, extra: list[str] | None = None) -> tuple[subprocess.Popen, Path]:
        """Starts a zygote process of `stage` (the runtime zygote for None): the process and its socket."""
        name = zygote_name(stage)
        path = self.run_dir / f"{name}.{uuid.uuid4().hex[:8]}.sock"
        what = ["--runtime"] if stage is None else ["--model", stage.model, "--stages", stage.stages] + (
            ["--emulate", stage.model] if self.emulated(stage.model) else [])
        with open(self.log_dir / f"zygote-{name}.log", "ab") as out:
            proc = subprocess.Popen([sys.executable, "-m", "keysmanager.zygote", "--socket", str(path), *what,
                                     *(extra or [])],
                                    env=child_environment(self.settings), cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL)
        return proc, path

    @staticmethod
    def _await(proc: subprocess.Popen, path: Path, name: str, limit_s: float, setting: str = "") -> None:
        """Returns once the zygote answers; ZygoteExited if it ends first, TimeoutError (it killed)
        past `limit_s`."""
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise ZygoteExited(f"zygote {name} exited with {proc.returncode}; see zygote-{name}.log")
            if path.exists():
                try:
                    zygote_call(path, {"op": "ping"}, timeout=5)
                    log.info("zygote %s ready, pid %d", name, proc.pid)
                    return
                except OSError:
                    pass
            time.sleep(0.05)
        proc.kill()
        raise TimeoutError(f"zygote {name} not ready in {limit_s:g} s{f' ({setting})' if setting else ''}")

    def _make_room_locked(self, size: int) -> None:
        """Within a byte budget, evicts what `cache_policy.evictions` picks (idle zygotes that are
        not key stages, least recently used first); OverBudget when nothing can make room."""
        key_stages = {s.key for s in self.key_stages()} if self.settings.servers.cache_bytes > 0 else set()
        held = [Held(z.key, z.bytes, z.last_use, z.forking > 0, z.started_at) for z in self.zygotes.values()]
        for key in evictions(held, key_stages, self.settings.servers.cache_bytes, size, time.time(),
                             self.settings.cache.min_residency_s):
            self._evict_locked(self.zygotes[StageRef.from_key(key)], f"making room within the {self.settings.servers.cache_bytes} B budget")

    def cached_bytes(self) -> int:
        with self._lock:
            return sum(z.bytes for z in self.zygotes.values())

    # -- fork ----------------------------------------------------------------------------------

    def fork(self, stage: StageRef, function: str, env: dict[str, str], cow: bool = True) -> dict:
        """Forks a stage replica from the zygote; never from parameters older than the shard."""
        with self._lock:
            z = self.zygotes.get(stage)
            if z is None or not z.alive():
                raise NotCached(stage.key)
            if self.shards(stage)[0] != z.sha256:
                self._evict_locked(z, "stale shard")
                raise StaleShard(f"the shard of {stage} changed; its cache was dropped")
            z.forking += 1
        out = self._fork_from(z, stage, function, env, cow, "fork-cow" if cow else "fork-copy")
        self._publish(z)
        self._event("fork", z, child=out["pid"], cow=cow)
        return out

    def _fork_from(self, z: Zygote, stage: StageRef, function: str, env: dict[str, str], cow: bool,
                   started_by: str) -> dict:
        port_file = self.run_dir / f"{function}.{uuid.uuid4().hex[:8]}.port"
        request = {"op": "fork", "cow": cow, "handler": str(STAGE_HANDLER), "port_file": str(port_file),
                   "log_file": str(self.log_dir / f"{function}.log"),
                   "env": {**settings_environment(self.settings), **env,
                           "QUART_MODEL": stage.model, "QUART_STAGES": stage.stages}}
        started = time.perf_counter()
        try:
            pid = zygote_call(z.socket, request)["pid"]
        finally:
            with self._lock:
                z.forking -= 1
        self.metrics.fork_seconds.labels(started_by).observe(time.perf_counter() - started)
        z.last_use, z.forks = time.time(), z.forks + 1
        with self._lock:
            self.forked[pid] = Fork(pid, start_time(pid), function, stage, started_by, time.time(), port_file)
        return {"pid": pid, "port_file": str(port_file), "started_by": started_by}

    def runtime(self) -> Zygote:
        """The runtime zygote, started if it is not running."""
        with self._runtime_lock:
            if self._runtime is None or not self._runtime.alive():
                self._runtime = self._start(None, [], 0)
            return self._runtime

    def start_cold(self, stage: StageRef, function: str, env: dict[str, str]) -> dict:
        """A cold replica of `stage` forked from the runtime zygote: it skips process creation and
        imports, and reads its shard like any cold start."""
        z = self.runtime()
        with self._lock:
            z.forking += 1
        return self._fork_from(z, stage, function, env, True, "cold")

    def forks(self) -> list[dict]:
        """The replicas forked here that still run (on a cluster, the only way to count them)."""
        with self._lock:
            for pid in [pid for pid, f in self.forked.items() if not f.alive()]:
                del self.forked[pid]
            return [f.describe() for f in self.forked.values()]

    def replica_targets(self) -> list[tuple[str, int, int]]:
        """(function, pid, port) of every replica forked here that listens."""
        with self._lock:
            forks = [f for f in self.forked.values() if f.alive()]
        return [(f.function, f.pid, port) for f in forks if (port := f.port()) is not None]

    def stop(self, pid: int) -> None:
        """Drains and ends a replica forked here (SIGTERM: it finishes its work first)."""
        with self._lock:
            fork = self.forked.get(pid)
        if fork is None or not fork.alive():
            raise NotForkedHere(f"no running replica {pid} was forked here")
        os.kill(pid, signal.SIGTERM)

    # -- evict and watch -----------------------------------------------------------------------

    def evict(self, stage: StageRef, reason: str = "requested") -> None:
        with self._lock:
            z = self.zygotes.get(stage)
            if z is None:
                raise NotCached(stage.key)
            self._evict_locked(z, reason)

    def _evict_locked(self, z: Zygote, reason: str) -> None:
        self.zygotes.pop(z.stage, None)
        # Out of what the scheduler reads first, so that no new fork is sent to it while it ends.
        self.store.withdraw_zygote(self.server, z.stage)
        z.end()
        self._event("evict", z, reason=reason)
        log.info("evicted %s (%s)", z.key, reason)

    def memory_used(self) -> float:
        vm = psutil.virtual_memory()
        return 1.0 - vm.available / vm.total

    def key_stages(self) -> list[StageRef]:
        """Stage ranges the autoscaler marked as key stages, in every model."""
        return self.store.key_stages()

    def scheduled_here(self, stages: list[StageRef]) -> list[StageRef]:
        """Of `stages`, those with a replica on this server (QUART §6.1: a key stage is cached where
        it is scheduled; the next replicas there fork). Caching every key stage on every server
        instead read each shard onto every server at once, and those reads slowed the cold starts
        sharing the servers' bandwidth (the simulator's ablation showed the fork cache costing
        latency that way)."""
        live = self.store.live_among((s.model, s.first) for s in stages)
        return [s for s in stages if any(x.server == self.server and x.stage_end == s.last for x in live[(s.model, s.first)])]

    def watch_once(self) -> None:
        """Keeps the runtime zygote (QUART_WARM_RUNTIME), caches new key stages, re-caches crashed
        zygotes, and evicts least recently used ones over the memory threshold."""
        if self.settings.coldstart.warm_runtime:
            try:
                self.runtime()
            except (RuntimeError, TimeoutError) as exc:
                log.error("the runtime zygote did not start: %s", exc)
        with self._lock:
            held = set(self.zygotes) | set(self._starting)
        # QUART_ABLATE=fork-cache: key stages are not cached, so their scale-ups start cold.
        key_stages = [] if self.settings.autoscaler.ablated("fork-cache") else \
            self.scheduled_here([s for s in self.key_stages() if s not in held])
        for stage in key_stages:
            if not (self.settings.model_dir(stage.model) / "manifest.json").exists() and not self.emulated(stage.model) \
                    and not self.settings.models_url:
                continue  # not partitioned here, and no store to fetch it from
            if self.memory_used() < self.threshold:
                try:
                    self.cache(stage)
                except OverBudget as exc:
                    log.info("not caching key stage %s here: %s", stage, exc)
                except (RuntimeError, TimeoutError, FileNotFoundError, ValueError) as exc:  # FetchError too
                    log.error("caching key stage %s failed: %s", stage, exc)
        with self._lock:
            crashed = [z for z in self.zygotes.values() if not z.alive()]
        for z in crashed:
            log.warning("zygote %s (pid %d) died with %s; re-caching", z.key, z.proc.pid, z.proc.returncode)
            self._event("crash", z, code=z.proc.returncode)
            try:
                self.cache(z.stage)
            except (RuntimeError, TimeoutError, FileNotFoundError, ValueError) as exc:
                log.error("re-caching %s failed: %s", z.key, exc)
        while self.memory_used() > self.threshold:
            with self._lock:
                # Never the zygote a replica is being forked from right now.
                idle = sorted((z for z in self.zygotes.values() if z.forking == 0), key=lambda z: z.last_use)
                if not idle:
                    break
                self._evict_locked(idle[0], f"memory use {self.memory_used():.0%} over {self.threshold:.0%}")

    def shutdown(self) -> None:
        with self._lock:
            for z in list(self.zygotes.values()):
                self._evict_locked(z, "shutdown")
        with self._runtime_lock:
            if self._runtime is not None:
                self._runtime.end()

    def list(self) -> list[dict]:
        with self._lock:
            return [z.describe() for z in sorted(self.zygotes.values(), key=lambda z: z.stage)]

    def stats(self) -> dict:
        zs = self.list()
        return {"server": self.server, "memory_used": round(self.memory_used(), 4),
                "memory_threshold": self.threshold, "cache_budget_bytes": self.settings.servers.cache_bytes,
                "zygotes": len(zs),
                "cached_bytes": sum(z["bytes"] for z in zs), "forks": sum(z["forks"] for z in zs),
                "forked_replicas": len(self.forks()),
                "runtime_zygote": self._runtime.proc.pid if self._runtime is not None and self._runtime.alive() else None}

    # -- Redis ---------------------------------------------------------------------------------

    def _publish(self, z: Zygote) -> None:
        self.store.publish_zygote(ZygoteRecord(self.server, z.stage.model, z.stage.stages, z.proc.pid, z.bytes,
                                               tuple(z.sha256), z.started_at, z.last_use, z.forks))

    def _event(self, what: str, z: Zygote, **extra: object) -> None:
        self.metrics.events.labels(what, z.key).inc()
        if what == "evict":
            self.metrics.evictions.labels(str(extra.get("reason", ""))).inc()
        event = CacheEvent(what, z.key, z.proc.pid, time.time(), tuple((k, str(v)) for k, v in extra.items()))
        self.store.add_cache_event(self.server, event, self.settings.data.records_maxlen)

"""The embedded runtime in the foreground: a redis-server (with a password and an append-only
file), one KeysManager per virtual server (QUART_VIRTUAL_SERVERS), the local provider on the
gateway port with the scheduler placing every replica, every function of the stack file deployed,
and the autoscaler (QUART_POLICY; `none` runs none). Redis, the KeysManagers and the autoscaler
are supervised: one that dies is started again (runtime/supervisor.py). SIGTERM drains all
replicas and stops. `python -m runtime up` runs this in the background under runtime/guardian.py,
which starts it again with `--adopt` if it dies; use that."""
from __future__ import annotations

import argparse
import asyncio
import logging
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from aiohttp import web

from containers import runtime as in_containers
from contracts import logs as log_format
from contracts.config import Settings, child_environment, exit_on_config_error, load_settings
from contracts.loops import start_thread
from contracts.paths import REPO_ROOT
from contracts.secrets import read_or_create_secret
from contracts.stack import StackFunction, is_whole, read_stack
from contracts.stage import StageRef
from keysmanager.cache_policy import WARMING_AT_ONCE
from keysmanager.client import KeysClient, KeysManagerError
from runtime.log_rotation import rotate
from runtime.provider import LocalProvider
from runtime.redis_server import start_redis
from runtime.state_file import load as load_state
from runtime.state_file import state_path
from runtime.supervisor import Supervisor
from state.store import RedisStore

log = logging.getLogger("quart.server")
LOG_CHECK_S = 10.0


def _start(settings: Settings, module: str, *args: str, log_name: str = "", image: str = "") -> subprocess.Popen:
    """A component of the runtime as a child process (in the runtime's process group); a
    KeysManager in a container of `image` (the stage functions') with QUART_CONTAINERS."""
    with open(Path(settings.home) / "logs" / f"{log_name or module}.log", "ab") as out:
        if settings.containers.run and module == "keysmanager":
            return in_containers.keysmanager(settings, out, image)
        return subprocess.Popen([sys.executable, "-m", module, *args], env=child_environment(settings), cwd=REPO_ROOT,
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def start_keysmanagers(settings: Settings, supervisor: Supervisor, previous: dict,
                       image: str = "") -> dict[str, KeysClient]:
    """One KeysManager per virtual server, the i-th on keysmanager_port + i, supervised (adopted
    where `previous`, a dead provider's components, names one that still runs)."""
    clients = {}
    for name in settings.virtual_server_names():
        own = settings.virtual_server(name)
        log_name = "keysmanager" if settings.servers.virtual <= 1 else f"keysmanager-{name}"
        supervisor.add(log_name, lambda own=own, log_name=log_name: _start(own, "keysmanager", log_name=log_name,
                                                                           image=image),
                       previous.get(log_name))
        clients[name] = KeysClient.for_settings(own)
    deadline = time.monotonic() + 60
    for name, client in clients.items():
        while not client.healthy():
            if supervisor.down() or time.monotonic() > deadline:
                raise RuntimeError(f"the KeysManager of {name} did not start; see its log in logs/")
            time.sleep(0.1)
    return clients


def start_store(settings: Settings, supervisor: Supervisor, previous: dict | None) -> None:
    """With QUART_VIRTUAL_DISKS (and no QUART_MODELS_URL of the user's), the model store the
    virtual servers fetch their shards from: QUART_MODELS served at QUART_STORE_BANDWIDTH."""
    if not settings.servers.own_disks or settings.models_url:
        return
    port = settings.store_url.rsplit(":", 1)[1]
    supervisor.add("store", lambda: _start(settings, "runtime.model_store", "--models", str(settings.models_dir), "--port",
                                           port, "--bandwidth", str(settings.servers.store_bandwidth),
                                           "--auth", log_name="store"),
                   previous)


def start_redis_supervised(settings: Settings, supervisor: Supervisor, adopting: bool, previous: dict | None) -> None:
    """Redis with the runtime's password, persisting to an append-only file: a Redis that dies
    comes back with its streams, consumer groups and registrations. A new run starts empty; a
    provider started in place of one that died adopts its Redis (`previous`) or its file."""
    home = Path(settings.home)
    workdir = home / "redis"
    if not adopting:
        for old in ("appendonly.aof", "dump.rdb"):
            (workdir / old).unlink(missing_ok=True)
    password = read_or_create_secret(settings.redis_password_file) if not settings.redis.password \
        else settings.redis.password
    launch = (lambda conf, out: in_containers.redis(settings, workdir, conf, out)) if settings.containers.run else None
    supervisor.add("redis", lambda: start_redis(settings.redis.host, settings.redis.port, workdir,
                                                home / "logs" / "redis.log", password=password, persist=True,
                                                launch=launch),
                   previous)


def stages_to_cache(settings: Settings, stack: list[StackFunction]) -> list[StageRef]:
    """The stage ranges named by QUART_CACHE_STAGES: "all", "none", or "model:stages,..."."""
    stage_fns = [f.stage for f in stack if f.stage is not None and not is_whole(f)]  # not a second copy of them
    choice = settings.cache.stages.strip()
    if choice == "all":
        return stage_fns
    if choice in ("", "none"):
        return []
    try:
        wanted = {StageRef.from_key(item.strip()) for item in choice.split(",")}
    except ValueError as exc:
        raise SystemExit(f"configuration: QUART_CACHE_STAGES={choice!r}: {exc}") from None
    return [s for s in stage_fns if s in wanted]


def cache_in_background(clients: list[KeysClient], ranges: list[StageRef]) -> None:
    """Each stage range on one server, round robin, several at once: several virtual servers
    hold different stages at start, and key stages get cached further as the autoscaler names
    them. `runtime status` shows which are cached yet."""
    def one(i: int, stage: StageRef) -> None:
        try:
            clients[i % len(clients)].cache(stage)
        except (KeysManagerError, OSError) as exc:
            log.error("caching %s failed: %s", stage, exc)

    def work() -> None:
        with ThreadPoolExecutor(WARMING_AT_ONCE, thread_name_prefix="cache") as pool:
            for i, stage in enumerate(ranges):
                pool.submit(one, i, stage)
    threading.Thread(target=work, name="cache", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--adopt", action="store_true",
                        help="started in place of a provider that died: adopt what it left running")
    parser.add_argument("--gateway-fd", type=int, help="serve on this listening socket (the guardian's)")
    parser.add_argument("--restarts", type=int, default=0, help="how often the provider was started again")
    parser.add_argument("--last-exit", default="", help="how the provider before this one ended")
    args = parser.parse_args(argv)
    settings = exit_on_config_error(load_settings)
    home = Path(settings.home)
    (home / "logs").mkdir(parents=True, exist_ok=True)
    log_format.configure(settings.log_level, settings.log_format)
    previous = load_state(state_path(home)) if args.adopt else {}
    components = previous.get("components", {})
    supervisor = Supervisor()
    try:
        start_redis_supervised(settings, supervisor, args.adopt, components.get("redis"))
        stack = read_stack(Path(settings.stack_file))
        stage_images = [f.deployment["image"] for f in stack if f.stage is not None]
        start_store(settings, supervisor, components.get("store"))
        clients = start_keysmanagers(settings, supervisor, components, stage_images[0] if stage_images else "")
        provider = LocalProvider(settings, stack, read_or_create_secret(settings.password_file), clients,
                                 RedisStore.from_url(settings.redis_url), supervisor,
                                 {"restarts": args.restarts, "last_exit": args.last_exit})
        if args.adopt:
            provider.adopt(previous.get("functions", []))
        for fn in stack:
            if fn.name not in provider.functions:
                provider.deploy(fn.deployment)
        if not args.adopt:
            cache_in_background(list(clients.values()), stages_to_cache(settings, stack))
        app = provider.app()
        if settings.autoscaler.policy != "none":
            supervisor.add("autoscaler", lambda: _start(settings, "autoscaler", "run"), components.get("autoscaler"))

            async def stop_autoscaler(_: web.Application) -> None:
                # Before the provider drains: nothing may scale what is being stopped.
                await asyncio.to_thread(supervisor.terminate, "autoscaler")
            app.on_shutdown.insert(0, stop_autoscaler)
        supervisor.run()
        start_thread(LOG_CHECK_S, lambda: rotate(home / "logs", settings.log_max_bytes, settings.log_keep),
                     threading.Event(), log, "log rotation")
        where = {"sock": socket.socket(fileno=args.gateway_fd)} if args.gateway_fd is not None else \
            {"host": settings.gateway.host, "port": settings.gateway.port}
        web.run_app(app, **where, print=None, access_log=None, shutdown_timeout=5,
                    handler_cancellation=True)  # a client gone cancels its upstream call
    finally:
        supervisor.terminate()
    return 0


if __name__ == "__main__":
    sys.exit(main())

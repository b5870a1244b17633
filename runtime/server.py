"""The embedded runtime in the foreground: a redis-server, this server's KeysManager, the local
provider on the gateway port, every function of the stack file deployed, and the autoscaler
(QUART_POLICY; `none` runs none). SIGTERM drains all
replicas and stops. `python -m runtime up` runs this in the background; use that."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from aiohttp import web

from contracts.config import Settings, load_settings, settings_environment
from keysmanager.client import KeysClient, KeysManagerError
from runtime.functions import REPO_ROOT
from runtime.provider import LocalProvider, read_or_create_password
from runtime.redis_server import start_redis
from runtime.stack import StackFunction, read_stack

log = logging.getLogger("quart.server")


def _start(settings: Settings, module: str, *args: str) -> subprocess.Popen:
    """A component of the runtime as a child process (in the runtime's process group)."""
    env = {**os.environ, **settings_environment(settings), "PYTHONPATH": str(REPO_ROOT)}
    with open(Path(settings.home) / "logs" / f"{module}.log", "ab") as out:
        return subprocess.Popen([sys.executable, "-m", module, *args], env=env, cwd=REPO_ROOT,
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def start_keysmanager(settings: Settings) -> tuple[subprocess.Popen, KeysClient]:
    proc = _start(settings, "keysmanager")
    client = KeysClient(f"http://127.0.0.1:{settings.keysmanager_port}", timeout=600)
    deadline = time.monotonic() + 60
    while not client.healthy():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("the KeysManager did not start; see logs/keysmanager.log")
        time.sleep(0.1)
    return proc, client


def stages_to_cache(settings: Settings, stack: list[StackFunction]) -> list[tuple[str, str]]:
    """The stage ranges named by QUART_CACHE_STAGES: "all", "none", or "model:stages,..."."""
    stage_fns = [(f.deployment["envVars"]["QUART_MODEL"], f.deployment["envVars"]["QUART_STAGES"])
                 for f in stack if "QUART_STAGES" in f.deployment.get("envVars", {})]
    choice = settings.cache_stages.strip()
    if choice == "all":
        return stage_fns
    if choice in ("", "none"):
        return []
    wanted = {tuple(item.strip().split(":", 1)) for item in choice.split(",")}
    return [s for s in stage_fns if s in wanted]


def cache_in_background(client: KeysClient, ranges: list[tuple[str, str]]) -> None:
    def work() -> None:
        for model, stages in ranges:
            try:
                client.cache(model, stages)
            except (KeysManagerError, OSError) as exc:
                log.error("caching %s stages %s failed: %s", model, stages, exc)
    threading.Thread(target=work, name="cache", daemon=True).start()


def main() -> int:
    settings = load_settings()
    home = Path(settings.home)
    (home / "logs").mkdir(parents=True, exist_ok=True)
    logging.basicConfig(level=os.environ.get("QUART_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    redis_proc = start_redis(settings.redis_host, settings.redis_port, home / "redis", home / "logs" / "redis.log")
    keys_proc = autoscaler_proc = None
    try:
        stack = read_stack(Path(settings.stack_file))
        keys_proc, keys = start_keysmanager(settings)
        provider = LocalProvider(settings, stack, read_or_create_password(settings.password_file), keys)
        for fn in stack:
            provider.deploy(fn.deployment)
        cache_in_background(keys, stages_to_cache(settings, stack))
        app = provider.app()
        if settings.policy != "none":
            autoscaler_proc = _start(settings, "autoscaler", "run")

            async def stop_autoscaler(_: web.Application) -> None:
                # Before the provider drains: nothing may scale what is being stopped.
                autoscaler_proc.terminate()
                autoscaler_proc.wait(timeout=30)
            app.on_shutdown.insert(0, stop_autoscaler)
        web.run_app(app, host=settings.gateway_host, port=settings.gateway_port,
                    print=None, access_log=None, shutdown_timeout=5)
    finally:
        for proc in (autoscaler_proc, keys_proc, redis_proc):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Containers of the stack on one machine, each on the host's network: Redis, and function
replicas from the images `make images` builds (the watchdog on its `port`, the partitioned models
mounted read-only, the settings passed as QUART_* variables), started detached as the image tests
and a faasd-like setup start them; and what every container of the project shares (its
environment, the models' mount, the label it is found and removed by)."""
from __future__ import annotations

import time
import urllib.error
import urllib.request

from containers.images import REDIS_IMAGE
from containers.podman import ContainerError, podman
from contracts.config import Settings, settings_environment

MODELS_MOUNT = "/home/app/models"
# Paths of this machine that mean nothing inside an image (it has its own home and models).
HOST_ONLY = ("QUART_HOME", "QUART_MODELS", "QUART_STACK_FILE", "QUART_CONFIG")
LABEL = "io.quart.stack"


def container_environment(settings: Settings, **extra: str) -> dict[str, str]:
    """The QUART_* variables that give a container these settings, with Redis's password and
    the internal token, and `extra` (identity, port) on top."""
    env = {k: v for k, v in settings_environment(settings).items() if k not in HOST_ONLY}
    env["QUART_REDIS_PASSWORD"] = settings.redis_password()
    env["QUART_INTERNAL_TOKEN"] = settings.internal_api_token()
    return {**env, **extra}


def start_redis(settings: Settings, name: str, stack: str) -> str:
    """Redis on the configured port, with its password; the container's id."""
    return podman(settings, "run", "-d", "--name", name, "--network", "host", "--label", f"{LABEL}={stack}",
                  REDIS_IMAGE, "redis-server", "--port", str(settings.redis.port), "--bind", settings.redis.host,
                  "--requirepass", settings.redis.password, "--save", "", "--appendonly", "no").strip()


def run_args(settings: Settings, name: str, stack: str, env: dict[str, str]) -> list[str]:
    """What every `podman run` of the project says: the name, the host's network, the stack's
    label, the partitioned models read-only, the environment."""
    args = ["--name", name, "--network", "host", "--label", f"{LABEL}={stack}",
            "-v", f"{settings.models_dir.resolve()}:{MODELS_MOUNT}:ro"]
    for key, value in env.items():
        args += ["-e", f"{key}={value}"]
    return args


def start_function(settings: Settings, name: str, image: str, port: int, env: dict[str, str], stack: str) -> str:
    """A function replica from its image, listening on `port`; the container's id."""
    env = container_environment(settings, port=str(port), **env)
    return podman(settings, "run", "-d", *run_args(settings, name, stack, env), image).strip()


def wait_healthy(settings: Settings, name: str, port: int, timeout: float) -> None:
    """Until the replica's /_/health answers 200; ContainerError with its log if it exits or
    does not answer in time."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/_/health", timeout=2) as reply:
                if reply.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if podman(settings, "inspect", "--format", "{{.State.Running}}", name, check=False).strip() == "false":
            break
        time.sleep(0.5)
    raise ContainerError(f"{name} did not become healthy on port {port}: "
                         f"{logs(settings, name)[-3000:]}")


def logs(settings: Settings, name: str) -> str:
    return podman(settings, "logs", name, check=False)


def remove_stack(settings: Settings, stack: str, timeout_s: int = 10) -> None:
    """Stops (SIGTERM, then SIGKILL after `timeout_s`) and removes every container of `stack`."""
    ids = podman(settings, "ps", "-aq", "--filter", f"label={LABEL}={stack}", check=False).split()
    if ids:
        podman(settings, "rm", "-f", "-t", str(timeout_s), *ids, check=False)


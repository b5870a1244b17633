"""The embedded runtime with containers (QUART_CONTAINERS=true, `make up-containers`), like faasd:
Redis, each KeysManager and each cold replica run as containers from the images `make images`
builds, all on the host's network; the provider, the scheduler and the autoscaler stay processes.

Each container is started as `podman run` in the foreground, so that the runtime watches it like
any child process (its exit is the container's) and its output goes to the component's log.
Folders a container and the runtime both use (a replica's port file, a KeysManager's run and log
folders, Redis's files) are mounted at the same path, owned by the container's user. A
KeysManager's container shares the host's process ids, so that the replicas it forks are
processes the runtime can watch and signal like the ones it starts itself. A cold replica's CPU
quota is what the autoscaler's compensator asks for its stage, changed with `podman update --cpus`
while the replica runs; forked replicas share their KeysManager's container and apply it as
threads, as they do outside containers."""
from __future__ import annotations

import subprocess
from pathlib import Path
from typing import IO

from containers.images import REDIS_IMAGE
from containers.launch import container_environment, remove_stack, run_args
from containers.podman import environment, podman
from contracts.config import Settings

WATCHDOG = ["python", "-m", "engine.watchdog", "--handler", "/home/app/function", "--host", "127.0.0.1"]


class ContainerRun(subprocess.Popen):
    """`podman run` in the foreground. Signals go to the container's own process (`podman kill`):
    SIGKILL then ends the container, not only the podman command in front of it."""

    def __init__(self, settings: Settings, name: str, argv: list[str], out: IO, cpus: float | None = None) -> None:
        self.settings, self.name, self.cpus = settings, name, cpus
        super().__init__(argv, env=environment(settings), stdout=out, stderr=subprocess.STDOUT,
                         stdin=subprocess.DEVNULL)

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            podman(self.settings, "kill", "--signal", str(int(sig)), self.name, check=False, timeout=30)

    def set_cpus(self, cpus: float) -> None:
        """The container's CPU quota, changed in place (cgroup cpu.max; no restart)."""
        podman(self.settings, "update", "--cpus", f"{cpus:g}", self.name, timeout=30)
        self.cpus = cpus


def cpu_quota(settings: Settings, name: str) -> float | None:
    """The CPUs a running container may use, as its cgroup says (cgroup v2's cpu.max or v1's CFS
    quota and period); None when unlimited. `podman inspect` shows only what it was created with."""
    read = ("cat /sys/fs/cgroup/cpu.max 2>/dev/null || "
            "echo $(cat /sys/fs/cgroup/cpu/cpu.cfs_quota_us) $(cat /sys/fs/cgroup/cpu/cpu.cfs_period_us)")
    quota, period = podman(settings, "exec", name, "sh", "-c", read, timeout=30).split()[:2]
    return None if quota in ("max", "-1") else int(quota) / int(period)


def label(settings: Settings) -> str:
    """What the containers of this runtime are labelled with: its home, unique on the machine."""
    return str(Path(settings.home).resolve())


def _run(settings: Settings, name: str, image: str, command: list[str], env: dict[str, str], shared: list[Path],
         pid_host: bool = False, cpus: float | None = None) -> list[str]:
    argv = ["podman", "--runtime", settings.containers.oci_runtime, "run", "--rm",
            *run_args(settings, name, label(settings), env)]
    for folder in shared:
        folder.mkdir(parents=True, exist_ok=True)
        argv += ["-v", f"{folder}:{folder}:U"]
    if pid_host:
        argv += ["--pid", "host"]
    if cpus is not None:
        argv += ["--cpus", f"{cpus:g}"]
    return [*argv, image, *command]


def replica(settings: Settings, name: str, image: str, env: dict[str, str], port_file: Path, out: IO,
            cpus: float) -> ContainerRun:
    """A cold replica from its function's image; it writes its port to `port_file`."""
    argv = _run(settings, name, image, [*WATCHDOG, "--port-file", str(port_file)],
                container_environment(settings, **env), [port_file.parent], cpus=cpus)
    return ContainerRun(settings, name, argv, out, cpus)


def keysmanager(settings: Settings, out: IO, image: str) -> ContainerRun:
    """A server's KeysManager in its own container of the stage image; the replicas it forks
    live in that container. Its home is shared at the same path: the runtime finds the forks'
    port files and logs where the KeysManager says they are."""
    home = Path(settings.home).resolve() / "containers" / f"keysmanager-{settings.server}"
    env = container_environment(settings, QUART_HOME=str(home), QUART_KEYSMANAGER_HOST=settings.cache.host)
    name = f"quart-keysmanager-{settings.server}-{settings.cache.port}"
    podman(settings, "rm", "-f", name, check=False)
    return ContainerRun(settings, name, _run(settings, name, image, ["python", "-m", "keysmanager"], env,
                                             [home], pid_host=True), out)


def redis(settings: Settings, workdir: Path, conf: Path, out: IO) -> ContainerRun:
    """redis-server with the runtime's configuration file (its port, password and files)."""
    name = f"quart-redis-{settings.redis.port}"
    podman(settings, "rm", "-f", name, check=False)
    return ContainerRun(settings, name, _run(settings, name, REDIS_IMAGE, ["redis-server", str(conf)], {},
                                             [workdir]), out)


def remove_all(settings: Settings) -> None:
    """Every container this runtime started that is still there (a podman command killed
    before its container ended leaves one)."""
    remove_stack(settings, label(settings), timeout_s=5)

"""Embedded runtime control.

    python -m runtime up       partition the stack's models if needed, start in the background,
                               return once every function has its replicas ready
    python -m runtime down     drain and stop everything, leaving no process behind
    python -m runtime status   the functions and their replicas
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from contracts.config import (
    ConfigError,
    Settings,
    add_arguments,
    child_environment,
    exit_on_config_error,
    settings_from_args,
)
from contracts.http_client import GatewayClient
from contracts.paths import REPO_ROOT
from contracts.proc_stat import stat_fields
from contracts.stack import pipelines, read_stack

PID_FILE = "runtime.pid"


def ensure_partitioned(settings: Settings) -> None:
    """Partitions every model of the stack that is not partitioned yet, and profiles the CPU law
    of its stages where QUART's compensator needs it and no profile is there (a user's own model)."""
    from models.partition import ensure_partitioned as ensure
    for model, pipeline in pipelines(read_stack(Path(settings.stack_file))).items():
        if not pipeline.emulated:  # an emulated model has no weights to partition
            ensure(settings.models_dir, model, pipeline.num_stages, pipeline.source)
            _ensure_cpu_fits(settings, model)


def _ensure_cpu_fits(settings: Settings, model: str) -> None:
    from autoscaler.policy.controller import VARIANTS
    from contracts import artefacts
    policy = settings.autoscaler
    if policy.policy not in VARIANTS or policy.ablated("compensator") or \
            artefacts.find(settings.home, artefacts.cpu_fits_name(model)):
        return
    cpus = ",".join(str(c) for c in range(1, len(os.sched_getaffinity(0)) + 1))
    print(f"profiling {model}'s stages at {cpus} CPUs for the compensator (once) ...", flush=True)
    # The profiler is a tool (a layer above the runtime): run as the command a user would run.
    if subprocess.run([sys.executable, "-m", "tools.profile_cpu", "--model", model, "--cpus", cpus, "--payloads",
                       "16,64", "--repeats", "3"], cwd=REPO_ROOT, env=child_environment(settings)).returncode != 0:
        raise ValueError(f"profiling {model} failed: see above")


def check_policy(settings: Settings) -> None:
    """The autoscaler's policy builds for every model of the stack, its artefacts included:
    ConfigError here, rather than an autoscaler that exits at every restart."""
    if settings.autoscaler.policy != "none":
        from autoscaler.policy.controller import Controller
        Controller.from_settings(settings, {m: p.stages for m, p in pipelines(read_stack(Path(settings.stack_file))).items()})


def _pid(settings: Settings) -> int | None:
    """The running runtime's guardian process (runtime/guardian.py), if there is one."""
    pid = _recorded_pid(Path(settings.home) / PID_FILE)
    try:
        if pid is not None:
            os.kill(pid, 0)
        return pid
    except ProcessLookupError:
        return None


def up(settings: Settings, timeout: float) -> int:
    if _pid(settings) is not None:
        print(f"the runtime is already running (pid file {Path(settings.home) / PID_FILE})")
        return 0
    settings = settings.replace(stack_file=str(Path(settings.stack_file).resolve()))
    if not Path(settings.stack_file).is_file():
        print(f"up: no stack file at {settings.stack_file}: `quart init` writes one serving the bundled models "
              "(or name yours with --stack-file)", file=sys.stderr)
        return 2
    try:
        ensure_partitioned(settings)
        check_policy(settings)
    except (ConfigError, ValueError) as exc:  # a source missing, pickled or of an unsupported family
        print(f"up: {exc}", file=sys.stderr)
        return 2
    home = Path(settings.home)
    (home / "logs").mkdir(parents=True, exist_ok=True)
    env = child_environment(settings)
    with open(home / "logs" / "runtime.log", "ab") as log:
        # Its own session and process group: `down` can end every replica with it. The guardian
        # starts the provider, and starts it again if it dies.
        proc = subprocess.Popen([sys.executable, "-m", "runtime.guardian"], env=env, cwd=REPO_ROOT,
                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    (home / PID_FILE).write_text(str(proc.pid))
    try:
        wait_ready(settings, proc, timeout)
    except RuntimeError as exc:
        print(f"up: {exc}; see {home / 'logs'}", file=sys.stderr)
        down(settings)
        return 1
    print(f"ready: gateway {settings.gateway.url}, admin password in {settings.password_file}")
    print(cache_status(settings) + " (`make status` shows it again)")
    return 0


def wait_ready(settings: Settings, proc: subprocess.Popen, timeout: float) -> None:
    client = None
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the runtime exited with code {proc.returncode}")
        if client is None and settings.password_file.exists() and GatewayClient(settings.gateway.url).healthy():
            client = GatewayClient.for_settings(settings)
        if client is not None:
            functions = client.functions()
            waiting = [f"{f['name']} {f['availableReplicas']}/{f['replicas']}" for f in functions
                       if f["availableReplicas"] < f["replicas"]]
            line = f"{len(functions) - len(waiting)}/{len(functions)} functions ready"
            if line != last:
                print(line + (f" (waiting: {', '.join(waiting[:4])})" if waiting else ""), flush=True)
                last = line
            if functions and not waiting:
                return
        time.sleep(0.5)
    raise RuntimeError(f"not ready within {timeout:g} s")


def down(settings: Settings) -> int:
    pid = _pid(settings)
    pid_file = Path(settings.home) / PID_FILE
    if pid is None:
        left = _recorded_pid(pid_file)
        pid_file.unlink(missing_ok=True)
        _remove_containers(settings)
        if left is not None and _end_group(left):
            print("the runtime's guardian had died; stopped what was left of it (replicas, Redis, KeysManagers)")
        else:
            print("the runtime is not running")
        return 0
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + settings.data.drain_timeout_s + 15
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.2)
    # Whatever is left of the runtime's process group (replicas, redis) goes now.
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    pid_file.unlink(missing_ok=True)
    _remove_containers(settings)
    print("stopped")
    return 0


def _remove_containers(settings: Settings) -> None:
    """Containers of this runtime still there (QUART_CONTAINERS): one whose podman command was
    killed outlives it."""
    from containers.podman import missing
    if missing() is None:
        from containers.runtime import remove_all
        remove_all(settings)


def _recorded_pid(pid_file: Path) -> int | None:
    try:
        return int(pid_file.read_text().strip())
    except (FileNotFoundError, ValueError):
        return None


def processes(settings: Settings) -> dict[int, str]:
    """pid -> command line of every live process in the runtime's process group (the guardian, the provider,
    Redis, the KeysManagers and their zygotes, the autoscaler, the replicas)."""
    group = _recorded_pid(Path(settings.home) / PID_FILE)
    found = {}
    for p in filter(str.isdigit, os.listdir("/proc")):
        stat = stat_fields(int(p))
        if stat and stat[0] != "Z" and int(stat[2]) == group:
            try:
                found[int(p)] = Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except (FileNotFoundError, ProcessLookupError):
                pass
    return found


def _end_group(pgid: int) -> bool:
    """Ends the processes left in the runtime's process group (its leader, the guardian, is
    gone: the group id stays reserved while any of them lives): SIGTERM, then SIGKILL."""
    try:
        os.killpg(pgid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        return False
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return True


def _alive(pid: int) -> bool:
    try:
        # Reaps it if it is our child (as in tests); otherwise only checks that it exists.
        if os.waitpid(pid, os.WNOHANG) != (0, 0):
            return False
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def status(settings: Settings) -> int:
    client = GatewayClient.for_settings(settings)
    try:
        health = client.request("GET", "/healthz", auth=False)
    except OSError:
        print("the runtime is not running")
        return 1
    answer = health.json()
    if health.status != 200:
        print(f"degraded: {answer.get('error')}")
    components = answer.get("components", {})
    print(f"{'component':<16} {'running':>8} {'restarts':>9}  last exit")
    for name, c in components.items():
        print(f"{name:<16} {'yes' if c['running'] else 'no':>8} {c['restarts']:>9}  {c['last_exit'] or '-'}")
    print()
    print(f"{'function':<16} {'replicas':>8} {'ready':>6} {'invocations':>12}")
    for f in client.functions():
        print(f"{f['name']:<16} {f['replicas']:>8} {f['availableReplicas']:>6} {f['invocationCount']:>12}")
    print()
    print(cache_status(settings))
    return 0


def cache_status(settings: Settings) -> str:
    """Which of the stage ranges QUART_CACHE_STAGES names are cached yet, over every server: until
    they are, their scale-ups start cold."""
    from keysmanager.client import KeysClient, KeysManagerError
    from runtime.server import stages_to_cache
    wanted = stages_to_cache(settings, read_stack(Path(settings.stack_file)))
    cached, unreachable = set(), []
    for i, server in enumerate(settings.virtual_server_names()):
        try:
            client = KeysClient.for_settings(settings.replace(keysmanager_port=settings.cache.port + i), timeout=5)
            cached |= {f"{z['model']}:{z['stages']}" for z in client.zygotes()}
        except (KeysManagerError, OSError):
            unreachable.append(server)
    missing = [s.key for s in wanted if s.key not in cached]
    line = (f"cache: {len(wanted) - len(missing)} of {len(wanted)} configured stage ranges cached"
            + (f"; warming {', '.join(missing)} (their scale-ups start cold until then)" if missing else ""))
    return line + (f"; KeysManager unreachable on {', '.join(unreachable)}" if unreachable else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=("up", "down", "status"))
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds `up` waits for readiness")
    add_arguments(parser, "home", "gateway_port", "redis_port", "stack_file", "policy")
    args = parser.parse_args(argv)
    settings = exit_on_config_error(lambda: settings_from_args(args))
    if args.command == "up":
        return up(settings, args.timeout)
    if args.command == "down":
        return down(settings)
    return status(settings)


if __name__ == "__main__":
    sys.exit(main())

"""podman and buildah as this project runs them: with the configured OCI runtime, and with no
default ulimits (podman's defaults make runc refuse on hosts in cgroups' hybrid mode). Every
container command of the project goes through here."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from contracts.config import Settings

CONF = "[containers]\ndefault_ulimits = []\n"


class ContainerError(RuntimeError):
    """A podman or buildah command that failed; the message holds its error output."""


def missing() -> str | None:
    """Why containers cannot run here, or None when they can."""
    tools = [t for t in ("podman", "buildah") if shutil.which(t) is None]
    if tools:
        return f"{' and '.join(tools)} not installed (Debian: apt-get install podman buildah runc)"
    return None


def environment(settings: Settings) -> dict[str, str]:
    env = dict(os.environ)
    if "CONTAINERS_CONF" not in env:
        conf = Path(settings.home) / "containers.conf"
        if not conf.exists() or conf.read_text() != CONF:
            conf.parent.mkdir(parents=True, exist_ok=True)
            conf.write_text(CONF)
        env["CONTAINERS_CONF"] = str(conf)
    return env


def _run(settings: Settings, cmd: list[str], check: bool, timeout: float | None) -> str:
    done = subprocess.run(cmd, env=environment(settings), capture_output=True, text=True, timeout=timeout)
    if check and done.returncode != 0:
        raise ContainerError(f"{' '.join(cmd[:6])} ...: exit {done.returncode}: {done.stderr.strip()[-2000:]}")
    return done.stdout


def podman(settings: Settings, *args: str, check: bool = True, timeout: float | None = 600) -> str:
    """A podman command with the project's OCI runtime; its standard output."""
    return _run(settings, ["podman", "--runtime", settings.containers.oci_runtime, *args], check, timeout)


def build(settings: Settings, context: Path, tag: str, build_args: dict[str, str], timeout: float = 3600) -> str:
    """`buildah bud` of the Dockerfile in `context`, caching layers (images built from the same
    requirements share their dependency layers)."""
    args = [f"--build-arg={k}={v}" for k, v in build_args.items()]
    return _run(settings, ["buildah", "bud", "--runtime", settings.containers.oci_runtime, "--layers", "--network",
                           "host", *args, "-t", tag, str(context)], True, timeout)


def image_exists(settings: Settings, image: str) -> bool:
    return subprocess.run(["podman", "image", "exists", image], env=environment(settings)).returncode == 0

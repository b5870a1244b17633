"""`make images`: the functions' images, built the way `faas-cli build -f stack.yml` builds them.

For each image the stack file names: a build context laid out as faas-cli lays it out
(build/<function>/: the template of the function's `lang`, its handler in function/, the stack's
`configuration.copy` paths beside the handler), a wheelhouse of requirements-serve.txt in it (so
the build needs no package index and takes the CPU build of torch this machine has), and
`buildah bud` with BASE as a build argument. The default base is made here with debootstrap when
it is missing; a user with a registry passes `--image-base python:3.11-slim`.

    python -m containers.images [--stack-file stack.yml] [--image-base IMAGE] [--image quart/stage:0.1.0]
"""
from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from containers.podman import ContainerError, build, image_exists, missing, podman
from contracts.config import ContainersConfig, Settings, add_arguments, exit_on_config_error, settings_from_args
from contracts.paths import REPO_ROOT
from contracts.stack import load_stack_file

BUILD_DIR = REPO_ROOT / "build"
TEMPLATES = REPO_ROOT / "template"
REQUIREMENTS = "requirements-serve.txt"
REDIS_IMAGE = "localhost/quart/redis:7"
DEBIAN_MIRROR = "http://deb.debian.org/debian"
SKIPPED = {"__pycache__", ".pytest_cache"}
MAX_ROUNDS = 10
NOT_FOUND = re.compile(r"No matching distribution found for ([^;\s]+)")


@dataclass(frozen=True)
class ImageBuild:
    image: str
    function: str      # the first function naming the image: its handler and template build it
    lang: str
    handler: Path


def read_builds(stack: Path) -> tuple[list[ImageBuild], list[str]]:
    """The images a stack file's functions build (each once) and its `configuration.copy`."""
    data = load_stack_file(stack)
    builds: dict[str, ImageBuild] = {}
    for name, spec in (data.get("functions") or {}).items():
        if spec.get("skip_build") or spec["image"] in builds:
            continue
        if not (TEMPLATES / spec["lang"] / "template.yml").exists():
            raise ValueError(f"{stack}: function {name}: no template {spec['lang']!r} in {TEMPLATES}")
        builds[spec["image"]] = ImageBuild(spec["image"], name, spec["lang"], (stack.parent / spec["handler"]).resolve())
    copy = ((data.get("configuration") or {}).get("copy")) or []
    return list(builds.values()), [str(p) for p in copy]


def _copy(src: Path, dst: Path) -> None:
    if src.is_dir():
        shutil.copytree(src, dst, dirs_exist_ok=True, ignore=lambda _, names: [n for n in names if n in SKIPPED])
    else:
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst)


def build_context(b: ImageBuild, copy: list[str], root: Path, out: Path) -> Path:
    """build/<function>/ as faas-cli's CreateBuildContext makes it."""
    context = out / b.function
    shutil.rmtree(context, ignore_errors=True)
    _copy(TEMPLATES / b.lang, context)
    for item in b.handler.iterdir():
        if item.name not in ("build", "template", *SKIPPED):
            _copy(item, context / "function" / item.name)
    for path in copy:
        source = (root / path).resolve()
        if source == root or root not in source.parents:
            raise ValueError(f"configuration.copy: {path} is not inside {root}")
        _copy(source, context / "function" / path)
    return context


def wheelhouse(settings: Settings, out: Path) -> Path:
    """Wheels of everything requirements-serve.txt installs on the base image's Python: those of
    this host's Python (pip's cache makes a rebuild quick), then completed
    with what the base's own Python resolves to beyond that (a dependency may depend on the patch
    release: redis needs async-timeout below Python 3.11.3)."""
    house = out / "wheelhouse"
    house.mkdir(parents=True, exist_ok=True)
    pip = [sys.executable, "-m", "pip"]
    _pip([*pip, "wheel", "-q", "-w", str(house), "-r", str(REPO_ROOT / REQUIREMENTS)])
    for _ in range(MAX_ROUNDS):
        wanted = _unresolved_on_base(settings, house)
        if wanted is None:
            return house
        _pip([*pip, "download", "-q", "--no-deps", "--only-binary=:all:", "-d", str(house), wanted])
    raise ContainerError(f"the wheelhouse did not resolve on {settings.containers.base} in {MAX_ROUNDS} rounds")


def _pip(cmd: list[str]) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise ContainerError(f"{' '.join(cmd[2:5])} ...: {done.stderr.strip()[-2000:]}")


def _unresolved_on_base(settings: Settings, house: Path) -> str | None:
    """The first requirement the base image's pip cannot resolve from the wheelhouse, or None."""
    probe = ("python3 -m venv /tmp/v && /tmp/v/bin/pip install -q --dry-run --no-index --find-links /wheels "
             "-r /requirements.txt")
    out = podman(settings, "run", "--rm", "--network", "none", "-v", f"{house}:/wheels:ro", "-v",
                 f"{REPO_ROOT / REQUIREMENTS}:/requirements.txt:ro", settings.containers.base, "sh", "-c",
                 f"{probe} 2>&1 || true")
    found = NOT_FOUND.search(out)
    if found:
        return found.group(1).strip()
    if "ERROR" in out:
        raise ContainerError(f"resolving the wheelhouse on {settings.containers.base}: {out.strip()[-1000:]}")
    return None


def _fill(context: Path, house: Path) -> None:
    wheels = context / "wheels"
    for wheel in house.glob("*.whl"):
        target = wheels / wheel.name
        if not target.exists():
            target.hardlink_to(wheel)


def ensure_base(settings: Settings) -> None:
    """The base image; the default one (Debian 12 with Python 3.11) is made here if missing."""
    base = settings.containers.base
    if image_exists(settings, base):
        return
    if base != ContainersConfig.base:
        podman(settings, "pull", base)
        return
    print(f"making {base} with debootstrap (about a minute) ...", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(["debootstrap", "--variant=minbase", "--include=python3,python3-venv,ca-certificates",
                        "bookworm", tmp, DEBIAN_MIRROR], check=True, stdout=subprocess.DEVNULL)
        tar = subprocess.Popen(["tar", "-C", tmp, "-c", "."], stdout=subprocess.PIPE)
        subprocess.run(["podman", "import", "-", base], stdin=tar.stdout, check=True, stdout=subprocess.DEVNULL)
        tar.wait()


def image_size(settings: Settings, image: str) -> int:
    return int(podman(settings, "image", "inspect", "--format", "{{.Size}}", image).strip())


def build_images(settings: Settings, stack: Path, only: list[str] | None = None) -> list[dict]:
    """Builds the stack's images (or those in `only`) and Redis's; each with its build time and size."""
    ensure_base(settings)
    builds, copy = read_builds(stack)
    unknown = sorted(set(only or []) - {b.image for b in builds})
    if unknown:
        raise ValueError(f"{stack} builds no image {unknown}; it builds {[b.image for b in builds]}")
    house = wheelhouse(settings, BUILD_DIR)
    results = []
    for b in builds:
        if only and b.image not in only:
            continue
        context = build_context(b, copy, stack.parent.resolve(), BUILD_DIR)
        _fill(context, house)
        results.append(_timed(settings, context, b.image))
    results.append(_timed(settings, REPO_ROOT / "containers" / "redis", REDIS_IMAGE))
    return results


def _timed(settings: Settings, context: Path, image: str) -> dict:
    print(f"building {image} ...", flush=True)
    start = time.monotonic()
    build(settings, context, image, {"BASE": settings.containers.base})
    return {"image": image, "build_s": round(time.monotonic() - start, 1), "bytes": image_size(settings, image)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--image", action="append", help="build only this image of the stack (repeatable)")
    add_arguments(parser, "stack_file", "image_base", "home")
    args = parser.parse_args(argv)
    settings = exit_on_config_error(lambda: settings_from_args(args))
    reason = missing()
    if reason:
        print(f"cannot build images: {reason}", file=sys.stderr)
        return 1
    try:
        results = build_images(settings, Path(settings.stack_file), args.image)
    except (ContainerError, ValueError, subprocess.CalledProcessError) as exc:
        print(f"image build failed: {exc}", file=sys.stderr)
        return 1
    print(f"{'image':<32} {'build s':>8} {'MB':>8}")
    for r in results:
        print(f"{r['image']:<32} {r['build_s']:>8.1f} {r['bytes'] / 1e6:>8.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

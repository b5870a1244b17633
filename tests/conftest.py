"""Shared fixtures: real weights partitioned on disk, and one real embedded runtime (redis-server,
local provider, replica processes) for the HTTP tests."""
from __future__ import annotations

import contextlib
import getpass
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from contracts.config import Settings, load_settings
from models.manifest import Manifest
from models.partition import ensure_partitioned
from models.sources import Source, load_source
from runtime.ports import free_port

REPO = Path(__file__).resolve().parent.parent
# Kept between runs (ignored by git) so that a second local run skips conversion and partitioning.
TEST_HOME = Path(os.environ.get("QUART_TEST_HOME", REPO / ".quart" / "test"))


# Replicas compile their decode steps by default (QUART_COMPILE), which costs a 2-core host a
# minute or more a replica: the tests run eager steps, but for those that test compiling
# (tests/live/test_compiled_*.py turn it on). Set here too for what reads the process environment.
os.environ.setdefault("QUART_COMPILE", "false")
EAGER = {"QUART_COMPILE": "false"}

# The tests that compare with transformers' float32 model to 1e-4 serve float32; the default
# (bfloat16 where the CPU has it) is tested against the same dtype in tests/live/test_precision.py.
REFERENCE_DTYPE = "float32"


@pytest.fixture(scope="session")
def home_settings() -> Settings:
    return load_settings(environ={"QUART_DTYPE": REFERENCE_DTYPE, **EAGER}, home=str(TEST_HOME))


@pytest.fixture(scope="session")
def sources(home_settings: Settings) -> dict[str, Source]:
    cache = home_settings.models_dir / "_sources"
    return {name: load_source(name, cache) for name in ("smollm2", "minilm")}


@pytest.fixture(scope="session")
def partitioned(home_settings: Settings):
    """partitioned(model, stages) -> Manifest, partitioning once per session and layout."""
    def get(model: str, stages: int, method: str = "balanced") -> Manifest:
        default = (model, stages, method) in (("smollm2", 4, "balanced"), ("minilm", 3, "balanced"))
        name = model if default else f"{model}-{stages}-{method}"
        return ensure_partitioned(home_settings.models_dir, name, stages, model, method)
    return get


@pytest.fixture(scope="session")
def runtime(home_settings: Settings, partitioned):
    """The embedded runtime on free ports, started with `python -m runtime up`, as a user would."""
    from runtime import __main__ as control
    partitioned("smollm2", 4)
    partitioned("minilm", 3)
    settings = home_settings.replace(
        gateway_port=free_port(), redis_port=free_port(), keysmanager_port=free_port(),
        stack_file=str(REPO / "stack.yml"), policy="none",  # these tests scale by hand
        # 60 s: sixteen 48-token generations take 25-30 s alone on a 2-core AVX2 host in float32,
        # and a loaded CI host must still answer them all (30 s cut some off).
        request_timeout_s=60.0, reclaim_idle_ms=2000, drain_timeout_s=20.0, max_prompt_tokens=256,
        admit_wait_s=0.0,  # tests that load it assert every request is answered; test_overload covers admission
        log_format="json")  # what a log collector reads; /system/logs reads it back
    # `up` hands these settings to the runtime, which hands them to every replica.
    try:
        assert control.up(settings, timeout=600) == 0, "the embedded runtime did not come up"
        yield settings
    finally:
        control.down(settings)


# A module's folders under pytest's basetemp outlive it: to the session's end, and past it where a
# test failed (the last three runs' are kept). Their logs are worth keeping for that; the weights,
# prefetches and environments they hold (2.5 GB for test_execute_while_load's servers) are not.
BULKY_BYTES = 1 << 20


@pytest.fixture(scope="module", autouse=True)
def shed_module_folders(tmp_path_factory):
    """After a module (its other fixtures torn down first: this one was set up first), every file
    over BULKY_BYTES in the folders it made is removed, but for logs."""
    basetemp = tmp_path_factory.getbasetemp()
    before = set(basetemp.iterdir())
    yield
    for folder in set(basetemp.iterdir()) - before:
        for path, size in _files_under(folder):
            if size > BULKY_BYTES and path.suffix != ".log" and "logs" not in path.relative_to(basetemp).parts:
                with contextlib.suppress(OSError):  # gone meanwhile, or not ours to remove
                    path.unlink()


def _files_under(folder: Path) -> Iterator[tuple[Path, int]]:
    """Every file under `folder` with its size, but those removed while it walks."""
    for root, _, files in os.walk(folder):
        for name in files:
            path = Path(root, name)
            try:
                size = path.lstat().st_size
            except OSError:
                continue
            yield path, size


# What the suite writes that can fill a disk: CI once ran out of space part-way (every test after
# failed making its temporary folder); said at the start and the end, where the bytes went.
def _free() -> list[str]:
    lines = []
    for where in {os.stat(p).st_dev: p for p in (tempfile.gettempdir(), str(REPO))}.values():  # a file system once
        usage = shutil.disk_usage(where)
        lines.append(f"disk at {where}: {usage.free / 2**30:.1f} GiB free of {usage.total / 2**30:.1f} GiB")
    return lines


def _held(config) -> list[str]:
    held = {"pytest's basetemp": config._tmp_path_factory.getbasetemp(), "the test home": TEST_HOME,
            "the image build folder": REPO / "build", "podman's storage": Path("/var/lib/containers/storage"),
            "inductor's cache": Path(tempfile.gettempdir()) / f"torchinductor_{getpass.getuser()}"}
    return [f"  {what} ({path}): {sum(size for _, size in _files_under(path)) / 2**30:.2f} GiB"
            for what, path in held.items() if path.exists()]


def pytest_report_header(config) -> list[str]:
    return _free()


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    terminalreporter.section("disk")
    for line in _free() + _held(config):
        terminalreporter.write_line(line)

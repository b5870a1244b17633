"""The package as `pip install .` gives it: a wheel built from this checkout, installed into a fresh
virtual environment, its `quart` command run from another folder with nothing of the checkout on
the path. (Its dependencies come from this environment's site-packages through a .pth file: the
test installs the project, not torch again.)"""
from __future__ import annotations

import json
import os
import re
import shutil
import site
import subprocess
import sys
import urllib.request
import zipfile
from pathlib import Path

import pytest
import yaml

from contracts.paths import REPO_ROOT
from runtime.cli import COMMANDS
from runtime.ports import free_port


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """Built from a copy of the checkout: setuptools writes build/ and egg-info beside the sources."""
    out = tmp_path_factory.mktemp("wheel")
    source = out / "source"
    shutil.copytree(REPO_ROOT, source, ignore=shutil.ignore_patterns(".git", ".venv", ".quart", "build", "results", "__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-build-isolation", "--no-deps", "-w", str(out), str(source)],
                   check=True, cwd=out, capture_output=True)
    return next(out.glob("quart_serve-*.whl"))


@pytest.fixture(scope="module")
def quart(wheel, tmp_path_factory):
    venv = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    pip = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps", str(wheel)], capture_output=True, text=True)
    assert pip.returncode == 0, pip.stderr
    packages = next((venv / "lib").glob("python3.*/site-packages"))
    (packages / "zz-dependencies.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    cwd = tmp_path_factory.mktemp("elsewhere")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHONPATH", "QUART_"))}

    def run(*args: str, timeout: float = 300, **more_env: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(venv / "bin" / "quart"), *args], cwd=cwd, timeout=timeout, capture_output=True, text=True,
                              env={**env, "QUART_HOME": str(cwd / ".quart"), **more_env})
    run.python = venv / "bin" / "python"
    run.cwd, run.env = cwd, env
    return run


def _requirements(*names: str) -> list[str]:
    lines = [line.strip() for name in names for line in (REPO_ROOT / name).read_text().splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def test_the_wheel_holds_the_packages_licence_and_dependencies(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        metadata = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
        scripts = z.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert {"runtime", "autoscaler", "keysmanager", "scheduler", "loadgen", "models", "frontend", "engine"} <= tops
    assert "tests" not in tops
    assert "autoscaler/artefacts/smollm2.cpu_fits.json" in names and "contracts/stack.schema.json" in names
    assert {"functions/entry/handler.py", "functions/stage/handler.py"} <= set(names)
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert "quart = runtime.cli:main" in scripts
    required = re.findall(r"^Requires-Dist: ([^;\n]+)$", metadata, re.M)
    assert required == _requirements("requirements-serve.txt", "requirements-embedded.txt")


def test_quart_runs_from_the_installed_package_alone(quart):
    where = subprocess.run([str(quart.python), "-c", "import runtime; print(runtime.__file__)"], cwd=quart.cwd, env=quart.env,
                           capture_output=True, text=True)
    assert str(quart.python.parent.parent) in where.stdout, where
    listing = quart("--help")
    assert listing.returncode == 0 and all(name in listing.stdout for name in COMMANDS), listing
    for name in COMMANDS:
        helped = quart(name, "--help")
        assert helped.returncode == 0 and helped.stdout.strip(), (name, helped.stderr[-2000:])
    unknown = quart("serve-everything")
    assert unknown.returncode == 2 and "unknown command" in unknown.stderr


def test_quart_sim_writes_a_report(quart):
    """A real command doing real work from the installed package: the simulator on a short trace."""
    done = quart("sim", "--model", "llama-7b", "--policies", "quart", "--arrivals", "gamma", "--rate", "5", "--cv", "2",
                 "--duration", "20", "--out", "sim")
    assert done.returncode == 0, done.stderr[-2000:]
    assert re.search(r"quart: \d+/\d+ answered", done.stdout), done.stdout[-2000:]
    assert (quart.cwd / "sim" / "report.md").is_file()


def test_quart_init_and_up_answer_the_first_request_from_the_installed_package(quart, partitioned):
    """What a user of the wheel does: `quart init` writes a stack serving the bundled models with
    the installed handlers, `quart up` serves it, a chat completion is answered, `quart down`
    stops it. (The models come partitioned from the tests' folder, QUART_MODELS: the wheel's code
    serves them, not the checkout's.)"""
    models = partitioned("smollm2", 4).directory.parent
    partitioned("minilm", 3)
    assert quart("up").returncode == 2   # no stack file here yet: it says to run `quart init`
    init = quart("init")
    assert init.returncode == 0 and (quart.cwd / "stack.yml").is_file(), init.stderr
    handlers = {spec["handler"] for spec in yaml.safe_load((quart.cwd / "stack.yml").read_text())["functions"].values()}
    assert all(str(quart.python.parent.parent) in str((quart.cwd / h).resolve()) for h in handlers), handlers
    port = free_port()
    env = {"QUART_MODELS": str(models), "QUART_GATEWAY_PORT": str(port), "QUART_REDIS_PORT": str(free_port()),
           "QUART_KEYSMANAGER_PORT": str(free_port()), "QUART_POLICY": "none", "QUART_CACHE_STAGES": "none"}
    try:
        up = quart("up", timeout=600, **env)
        assert up.returncode == 0, (up.stdout[-2000:], up.stderr[-2000:])
        body = {"model": "smollm2", "messages": [{"role": "user", "content": "What is 2+2?"}], "max_tokens": 4}
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as reply:
            answer = json.loads(reply.read())
        assert answer["object"] == "chat.completion" and answer["usage"]["completion_tokens"] == 4, answer
        where = (quart.cwd / ".quart" / "logs" / "smollm2.log").read_text()
        assert "finished: " in where
    finally:
        assert quart("down", **env).returncode == 0

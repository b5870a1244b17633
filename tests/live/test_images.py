"""The images `make images` builds, run as containers the way a cluster runs them: a Redis
container, SmolLM2's stages in two stage containers (0-2 and 2-4) and its entry in an entry
container, on the host's network, the partitioned model mounted read-only. A real answer comes
back through the entry container's HTTP. Needs podman and buildah (Debian packages; .ci/run
installs them)."""
from __future__ import annotations

import json
import secrets
import urllib.request
from pathlib import Path

import pytest

from containers.images import build_images
from containers.launch import logs, remove_stack, start_function, start_redis, wait_healthy
from containers.podman import missing
from runtime.ports import free_port
from tests.live.runtime_helpers import reference_greedy

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(missing() is not None, reason=f"containers cannot run here: {missing()}")


@pytest.fixture(scope="module")
def images(home_settings):
    built = build_images(home_settings, REPO / "stack.yml")
    return {b["image"] for b in built}


@pytest.fixture
def stack(home_settings, partitioned):
    partitioned("smollm2", 4)
    name = f"test-{secrets.token_hex(4)}"
    settings = home_settings.replace(redis_port=free_port(), redis_password=secrets.token_hex(16),
                                     internal_token=secrets.token_hex(16), server=name)
    try:
        yield name, settings
    finally:
        remove_stack(settings, name, timeout_s=5)


def test_images_serve_smollm2_as_containers(images, stack, sources, tokenizer) -> None:
    name, settings = stack
    assert {"quart/entry:0.1.0", "quart/stage:0.1.0"} <= images
    start_redis(settings, f"{name}-redis", name)
    ports = {}
    for fn, image, env in ((f"{name}-s01", "quart/stage:0.1.0", {"QUART_STAGES": "0-2"}),
                           (f"{name}-s23", "quart/stage:0.1.0", {"QUART_STAGES": "2-4"}),
                           (f"{name}-entry", "quart/entry:0.1.0", {})):
        ports[fn] = free_port()
        start_function(settings, fn, image, ports[fn], {"QUART_MODEL": "smollm2", **env}, name)
    for fn, port in ports.items():
        wait_healthy(settings, fn, port, timeout=180)
    prompt = "The capital of France is"
    body = json.dumps({"prompt": prompt, "max_new_tokens": 8}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{ports[f'{name}-entry']}/", data=body,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as reply:
            answer = json.loads(reply.read())
    except Exception:
        print({fn: logs(settings, fn)[-2000:] for fn in ports})
        raise
    # Greedy: the same tokens as transformers' generate on the unsplit model.
    assert answer["token_ids"] == reference_greedy(sources, tokenizer(prompt)["input_ids"], 8), answer

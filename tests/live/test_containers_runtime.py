"""`make up-containers`: the embedded runtime with Redis, the KeysManager and every replica in
containers of the images, answering the demo's prompts through the gateway; the compensator's
CPU decision for a stage changes its running replica's CPU quota in place (`podman update`), and
the stage's service time with it, without a restart. Needs podman and buildah."""
from __future__ import annotations

import re
import statistics

import pytest
import redis

from containers.podman import podman
from containers.runtime import cpu_quota, label
from contracts.http_client import GatewayClient
from contracts.stage import StageRef
from loadgen.sharegpt import first_prompts
from runtime import __main__ as control
from runtime.ports import free_port
from state import keys
from tests.live.conftest import NEEDS_CONTAINERS
from tests.live.runtime_helpers import wait_until

pytestmark = NEEDS_CONTAINERS
REPO_STACK = "stack.yml"
STAGE = StageRef.parse("smollm2", "1")


@pytest.fixture(scope="module")
def runtime_in_containers(images, home_settings, partitioned, tmp_path_factory):
    partitioned("smollm2", 4)
    partitioned("minilm", 3)
    home = tmp_path_factory.mktemp("containers")
    settings = home_settings.replace(
        home=str(home), models=str(home_settings.models_dir), containers=True, gateway_port=free_port(),
        redis_port=free_port(), keysmanager_port=free_port(), stack_file=str(control.REPO_ROOT / REPO_STACK),
        policy="none", cache_stages="none", admit_wait_s=0.0, max_prompt_tokens=256)  # every replica a cold container
    try:
        assert control.up(settings, timeout=600) == 0, "the runtime in containers did not come up"
        yield settings
    finally:
        control.down(settings)
    assert not podman(settings, "ps", "-aq", "--filter", f"label=io.quart.stack={label(settings)}").split()


def containers_of(settings, function: str) -> list[str]:
    """The running containers of a function's replicas (named quart-<function>-<pid>-<n>)."""
    names = podman(settings, "ps", "--format", "{{.Names}}", "--filter", f"label=io.quart.stack={label(settings)}")
    return [n for n in names.split() if re.fullmatch(rf"quart-{function}-\d+-\d+", n)]


def stage_service_ms(client: GatewayClient, prompt: str) -> float:
    """Stage 1's compute time of one prefill: long enough (tens of ms) that a quota of a quarter
    CPU cannot hide it in one CFS period's budget."""
    reply = client.invoke("smollm2", {"prompt": prompt, "max_new_tokens": 1})
    assert reply.status == 200, reply.body
    return next(s for s in reply.json()["stages"] if s["stage"] == STAGE.first)["service_ms"]


def test_the_demo_prompts_are_answered_by_containers(runtime_in_containers) -> None:
    settings = runtime_in_containers
    client = GatewayClient.for_settings(settings)
    for fn in ("smollm2", "smollm2-s0", "smollm2-s1", "minilm-s2"):
        assert len(containers_of(settings, fn)) == 1, fn
    for prompt in first_prompts(3, 0):
        reply = client.invoke("smollm2", {"messages": [{"role": "user", "content": prompt}], "max_new_tokens": 8})
        assert reply.status == 200 and reply.json()["text"].strip(), reply.body
    reply = client.invoke("minilm", {"inputs": first_prompts(3, 0)})
    assert reply.status == 200 and len(reply.json()["embeddings"]) == 3


def test_a_cpu_decision_changes_the_running_replicas_quota_and_service_time(runtime_in_containers) -> None:
    settings = runtime_in_containers
    client = GatewayClient.for_settings(settings)
    r = redis.Redis.from_url(settings.redis_url)
    (name,) = containers_of(settings, "smollm2-s1")
    started = podman(settings, "inspect", "--format", "{{.Id}} {{.State.StartedAt}}", name)
    prompt = " ".join(first_prompts(8, 3))[:600]  # about 150 tokens
    before = statistics.median(stage_service_ms(client, prompt) for _ in range(3))
    # Read before the change: the provider applies a new quota within a second, which can fall
    # between setting the key and reading the quota.
    assert cpu_quota(settings, name) == 1.0  # QUART_THREADS, until the compensator says otherwise
    r.set(keys.stage_cpus(STAGE), "0.25")  # what the autoscaler's LocalBackend writes for the compensator
    wait_until(lambda: cpu_quota(settings, name) == 0.25, 30, "the quota to change")
    after = statistics.median(stage_service_ms(client, prompt) for _ in range(3))
    assert after > 1.5 * before, (before, after)
    assert podman(settings, "inspect", "--format", "{{.Id}} {{.State.StartedAt}}", name) == started  # no restart
    r.set(keys.stage_cpus(STAGE), "1")

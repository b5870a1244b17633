"""The images `make images` builds, run as containers the way a cluster runs them: a Redis
container, SmolLM2's stages in two stage containers (0-2 and 2-4) and its entry in an entry
container, on the host's network, the partitioned model mounted read-only; a real answer comes
back through the entry container's HTTP. And deploy/kubernetes/'s pod templates under podman's
kube play. Needs podman and buildah (Debian packages; .ci/run installs them)."""
from __future__ import annotations

import base64
import json
import re
import secrets
import urllib.request
from pathlib import Path

import pytest
import redis
import yaml

from containers.images import REDIS_IMAGE
from containers.launch import logs, remove_stack, start_function, start_redis, wait_healthy
from containers.podman import podman
from contracts.http_client import HttpClient
from contracts.secrets import bearer
from runtime.ports import free_port
from tests.kustomize import SECRETS, objects
from tests.live.conftest import NEEDS_CONTAINERS
from tests.live.runtime_helpers import reference_greedy, wait_until

REPO = Path(__file__).resolve().parents[2]
pytestmark = NEEDS_CONTAINERS


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


def for_podman(made: list[dict], settings, models: Path, secrets: Path) -> list[dict]:
    """deploy/kubernetes/'s Redis Deployment and KeysManager pod template as podman 4.3's kube play
    runs them on one machine: on the host's network (so no port mappings, and no probes naming
    them) at this test's ports; the images built here (Redis: ours, with its command); the
    DaemonSet's template as a Pod (kube play takes no DaemonSet, and knows no node name to put in
    QUART_SERVER); the model volume the test models
    and the secret volume the secret's files, both as host paths (kube play 4.3 crashes on secret
    volumes)."""
    secret = next(d for d in made if d["kind"] == "Secret")["stringData"]
    local = {"QUART_REDIS_HOST": "127.0.0.1", "QUART_REDIS_PORT": str(settings.redis.port),
             "QUART_KEYSMANAGER_PORT": str(settings.cache.port)}
    played = []
    for d in made:
        if d["kind"] == "ConfigMap":
            played.append({**d, "data": {**d["data"], **local}})
        elif d["kind"] == "Deployment" and d["metadata"]["name"] == "redis":
            c = d["spec"]["template"]["spec"]["containers"][0]
            # The kubelet expands $(VAR) in args from the container's env; kube play 4.3 does not.
            env = {e["name"]: secret[e["valueFrom"]["secretKeyRef"]["key"]] for e in c["env"]}
            args = [re.sub(r"\$\((\w+)\)", lambda m, env=env: env[m.group(1)], a) for a in c["args"]]
            c.update(image=REDIS_IMAGE, command=["redis-server"], args=[*args, "--port", str(settings.redis.port)])
            played.append(d)
        elif d["kind"] == "DaemonSet":
            played.append({"apiVersion": "v1", "kind": "Pod", "metadata": d["metadata"], "spec": d["spec"]["template"]["spec"]})
    for pod in [p["spec"]["template"]["spec"] if p["kind"] == "Deployment" else p["spec"] for p in played
                if p["kind"] != "ConfigMap"]:
        pod["hostNetwork"] = True
        for c in pod["containers"]:
            for key in ("ports", "readinessProbe", "livenessProbe"):
                c.pop(key, None)
            c["image"] = c["image"] if c["image"] == REDIS_IMAGE else f"localhost/{c['image']}"
            for e in c.get("env", []):
                if e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "spec.nodeName":
                    e.pop("valueFrom")
                    e["value"] = "podman"
        for v in pod.get("volumes", []):
            if "persistentVolumeClaim" in v and v["persistentVolumeClaim"]["claimName"] == "quart-models":
                v.pop("persistentVolumeClaim")
                v["hostPath"] = {"path": str(models), "type": "Directory"}
            if "secret" in v:
                v.pop("secret")
                v["hostPath"] = {"path": str(secrets), "type": "Directory"}
    return played


def test_manifests_run_under_podman_kube_play(images, home_settings, partitioned, tmp_path) -> None:
    """The Redis Deployment and the KeysManager pod of deploy/kubernetes/ run: Redis answers with
    the secret's password, the KeysManager reads its settings from the ConfigMap and the secret's
    files and serves the model volume with the secret's token."""
    partitioned("smollm2", 4)
    settings = home_settings.replace(redis_port=free_port(), keysmanager_port=free_port())
    made = objects()
    secret = next(d for d in made if d["kind"] == "Secret")["stringData"]
    secrets = tmp_path / "secrets"
    secrets.mkdir(mode=0o755)
    for key, value in secret.items():
        (secrets / key).write_text(value)
        (secrets / key).chmod(0o644)
    play = tmp_path / "play.yml"
    play.write_text(yaml.safe_dump_all(for_podman(made, settings, home_settings.models_dir.resolve(), secrets)))
    # The form kube play 4.3 reads a Secret in: a podman secret holding {key: base64(value)}.
    (tmp_path / "secret.json").write_text(json.dumps({k: base64.b64encode(v.encode()).decode()
                                                      for k, v in secret.items()}))
    podman(settings, "secret", "rm", "quart-secrets", check=False)
    podman(settings, "secret", "create", "quart-secrets", str(tmp_path / "secret.json"))
    try:
        podman(settings, "kube", "down", str(play), check=False)   # what an interrupted run left behind
        podman(settings, "kube", "play", str(play))
        km = HttpClient(f"http://127.0.0.1:{settings.cache.port}")
        wait_until(km.healthy, 120, "the KeysManager pod")
        token = bearer(SECRETS["QUART_INTERNAL_TOKEN"])
        assert km.request("GET", "/stats").status == 401
        files = km.request("GET", "/models/smollm2", headers=token).json()["files"]
        assert {"manifest.json", "stage-00.safetensors"} <= {f["path"] for f in files}
        assert km.request("GET", "/stats", headers=token).status == 200
        r = redis.Redis(host="127.0.0.1", port=settings.redis.port, password=SECRETS["QUART_REDIS_PASSWORD"])
        wait_until(lambda: _pings(r), 60, "Redis with the secret's password")
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(host="127.0.0.1", port=settings.redis.port, password="wrong").ping()
    finally:
        podman(settings, "kube", "down", str(play), check=False)
        podman(settings, "volume", "rm", "-f", "redis-data", check=False)
        podman(settings, "secret", "rm", "quart-secrets", check=False)


def _pings(r: redis.Redis) -> bool:
    try:
        return bool(r.ping())
    except redis.ConnectionError:
        return False

"""What `kubectl kustomize deploy/kubernetes` makes, without kustomize: the resources, and the
ConfigMap and Secret its generators make from settings.env and a secrets.env (one for tests)."""
from __future__ import annotations

from pathlib import Path

import yaml

KUSTOMIZE = Path(__file__).resolve().parents[1] / "deploy" / "kubernetes"
SECRETS = {"QUART_REDIS_PASSWORD": "p", "QUART_INTERNAL_TOKEN": "t", "QUART_GATEWAY_PASSWORD": "g"}


def env_file(path: Path) -> dict[str, str]:
    lines = [line for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")]
    return dict(line.split("=", 1) for line in lines)


def objects() -> list[dict]:
    """What `kubectl kustomize` makes of the folder (its namespace on every namespaced object)."""
    k = yaml.safe_load((KUSTOMIZE / "kustomization.yaml").read_text())
    docs = [d for r in k["resources"] for d in yaml.safe_load_all((KUSTOMIZE / r).read_text()) if d]
    for gen in k["configMapGenerator"]:
        data = {key: v for f in gen["envs"] for key, v in env_file(KUSTOMIZE / f).items()}
        docs.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": gen["name"]}, "data": data})
    for gen in k["secretGenerator"]:
        data = {key: v for f in gen["envs"] if f != "secrets.env" for key, v in env_file(KUSTOMIZE / f).items()}
        docs.append({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": gen["name"]}, "type": "Opaque",
                     "stringData": {**data, **SECRETS}})
    for d in docs:
        if d["kind"] not in ("ClusterRole", "ClusterRoleBinding"):
            d["metadata"]["namespace"] = k["namespace"]
    return docs

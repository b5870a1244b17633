"""deploy/kubernetes/ as the API server would take it: every object kustomize would make (the
resources, and the ConfigMap and Secret its generators make from settings.env and a secrets.env)
validates strictly against the Kubernetes 1.33 and 1.37 schemas (kubernetes-validate); every
setting is one the components know; every object a manifest refers to is one the kustomization
makes; every image one that `make images` builds (or the official Redis)."""
from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest

from containers.images import read_builds
from contracts.config import VARIABLES
from contracts.stack import load_stack_file
from tests.kustomize import KUSTOMIZE, SECRETS, env_file, objects

REPO = Path(__file__).resolve().parents[2]
VERSIONS = ["1.33.0", "1.37.0"]


@pytest.mark.parametrize("version", VERSIONS)
def test_every_object_validates_strictly(version: str) -> None:
    made = objects()
    assert {d["kind"] for d in made} >= {"Deployment", "DaemonSet", "Job", "Service", "PersistentVolumeClaim",
                                         "ServiceAccount", "ConfigMap", "Secret"}
    for d in made:
        kubernetes_validate.validate(d, version, strict=True)


def test_a_typo_fails_validation() -> None:
    deployment = next(d for d in objects() if d["kind"] == "Deployment")
    deployment["spec"]["template"]["spec"]["containers"][0]["envFrm"] = []
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, VERSIONS[0], strict=True)


def pod_specs() -> list[dict]:
    return [d["spec"]["template"]["spec"] for d in objects() if d["kind"] in ("Deployment", "DaemonSet", "Job")]


def test_settings_are_ones_the_components_know() -> None:
    known = {v.env for v in VARIABLES}
    assert set(env_file(KUSTOMIZE / "settings.env")) <= known
    assert set(SECRETS) <= known


def test_references_resolve_and_images_are_built_here() -> None:
    made = {(d["kind"], d["metadata"]["name"]) for d in objects()}
    built = {b.image for b in read_builds(REPO / "stack.yml")[0]}
    for spec in pod_specs():
        assert ("ServiceAccount", spec["serviceAccountName"]) in made
        for volume in spec.get("volumes", []):
            if "persistentVolumeClaim" in volume:
                assert ("PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"]) in made
            if "secret" in volume:
                assert ("Secret", volume["secret"]["secretName"]) in made
        for c in spec["containers"]:
            assert c["image"] in built or c["image"].startswith("docker.io/library/redis:")
            for source in c.get("envFrom", []):
                assert ("ConfigMap", source["configMapRef"]["name"]) in made
            for e in c.get("env", []):
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ("Secret", ref["name"]) in made and ref["key"] in SECRETS


def test_every_pod_runs_as_non_root_without_privilege() -> None:
    for spec in pod_specs():
        assert spec["securityContext"]["runAsNonRoot"] is True
        for c in spec["containers"]:
            assert c["securityContext"]["allowPrivilegeEscalation"] is False
            assert c["resources"]["requests"] and c["resources"]["limits"]["memory"]


def test_functions_get_the_secret_the_kustomization_makes() -> None:
    stack = load_stack_file(REPO / "stack.yml")
    names = {n for _, n in [(d["kind"], d["metadata"]["name"]) for d in objects() if d["kind"] == "Secret"]}
    for fn in stack["functions"].values():
        assert set(fn["secrets"]) <= names

"""Checks the gateway's answers against the project's own API description, docs/openapi.yml."""
from __future__ import annotations

import json
from functools import lru_cache

import yaml
from openapi_core import OpenAPI
from openapi_core.testing import MockRequest, MockResponse

from contracts.http_client import GatewayClient, Reply
from contracts.paths import REPO_ROOT

SPEC = REPO_ROOT / "docs" / "openapi.yml"
# The spec's own server: requests are matched against its paths, whatever port the test uses.
SPEC_HOST = "http://localhost:8080"


@lru_cache(maxsize=1)
def spec() -> OpenAPI:
    return OpenAPI.from_file_path(str(SPEC))


@lru_cache(maxsize=1)
def _raw_spec() -> dict:
    return yaml.safe_load(SPEC.read_text())


def _listed_statuses(method: str, pattern: str) -> set[int]:
    operation = _raw_spec()["paths"][pattern][method.lower()]
    return {int(code) for code in operation["responses"]}


def _wildcard_schema(method: str, pattern: str, status: int) -> dict | None:
    """The schema of a response the spec declares as `*/*`, which openapi-core does not parse."""
    content = _raw_spec()["paths"][pattern][method.lower()]["responses"][str(status)].get("content") or {}
    media = content.get("*/*")
    return media.get("schema") if media and len(content) == 1 else None


def _validate_json(body: bytes, schema: dict) -> None:
    from openapi_schema_validator import OAS30Validator
    document = {**schema, "components": _raw_spec()["components"]}
    OAS30Validator(document).validate(json.loads(body))


def checked(client: GatewayClient, method: str, path: str, pattern: str, body: bytes | dict | list | None = None,
            auth: bool = True, content_type: str = "application/json") -> Reply:
    """Sends a request, and asserts that it and its answer are what the spec says."""
    raw = json.dumps(body).encode() if isinstance(body, (dict, list)) else body
    reply = client.request(method, path, raw, headers={"Content-Type": content_type} if raw is not None else None,
                           auth=auth)
    assert reply.status in _listed_statuses(method, pattern), \
        f"{method} {path} answered {reply.status}, which the spec does not list for {pattern}"
    wildcard = _wildcard_schema(method, pattern, reply.status)
    if wildcard is not None:
        _validate_json(reply.body, wildcard)
        return reply
    request = MockRequest(SPEC_HOST, method, path, path_pattern=pattern, data=raw,
                          content_type=content_type)
    response = MockResponse(reply.body, reply.status,
                            content_type=reply.headers.get("Content-Type", "application/json").split(";")[0])
    spec().validate_response(request, response)
    return reply

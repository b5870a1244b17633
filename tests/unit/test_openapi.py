"""The project's own API description (docs/openapi.yml) is a valid OpenAPI document, and everything
it says about the OpenFaaS paths agrees with the upstream gateway spec (a copy in tests/upstream/;
QUART_OPENFAAS_SPEC names another): the same paths and methods, and every schema property upstream
too, with the same type."""
from __future__ import annotations

import os
from pathlib import Path

import yaml
from openapi_core import OpenAPI

from contracts.config import BY_NAME
from contracts.paths import REPO_ROOT
from tools.openapi_v1 import schemas, with_v1

OURS = REPO_ROOT / "docs" / "openapi.yml"
UPSTREAM = Path(os.environ.get("QUART_OPENFAAS_SPEC") or REPO_ROOT / BY_NAME["openfaas_spec"].default)
# Schemas of this project's own entry functions: OpenFaaS leaves function bodies to functions.
OWN_SCHEMAS = {"Error", "GenerateRequest", "GenerateResponse", "EmbedRequest", "EmbedResponse", "EmulatedRequest", "Health",
               *schemas()}


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def test_our_description_is_valid_openapi():
    OpenAPI.from_file_path(str(OURS))  # raises on an invalid document


def _type(schema: dict) -> str | None:
    return schema.get("type")


def test_every_openfaas_path_method_and_property_agrees_with_upstream():
    ours, upstream = load(OURS), load(UPSTREAM)
    for path, methods in ours["paths"].items():
        if path.startswith("/v1/"):  # OpenAI's, not OpenFaaS's
            continue
        assert path in upstream["paths"], f"{path} is not an OpenFaaS path"
        for method in methods:
            assert method in upstream["paths"][path], f"{method} {path} is not in the OpenFaaS spec"
    theirs = upstream["components"]["schemas"]
    for name, schema in ours["components"]["schemas"].items():
        if name in OWN_SCHEMAS:
            continue
        assert name in theirs, f"schema {name} is not OpenFaaS's"
        assert set(schema.get("required", [])) <= set(theirs[name].get("required", [])) | set(schema.get("properties", {}))
        for prop, spec in schema.get("properties", {}).items():
            assert prop in theirs[name].get("properties", {}), f"{name}.{prop} is not in OpenFaaS's {name}"
            if _type(spec) and _type(theirs[name]["properties"][prop]):
                assert _type(spec) == _type(theirs[name]["properties"][prop]), f"{name}.{prop} has another type"


def test_the_v1_section_is_generated_from_the_request_models():
    """What `make docs` writes from frontend/openai_protocol.py is what the file says; and the
    schemas describe what the models accept and refuse."""
    text = OURS.read_text()
    assert with_v1(text) == text, "docs/openapi.yml's /v1 section is out of date: run `make docs`"
    chat = load(OURS)["components"]["schemas"]["ChatCompletionRequest"]
    assert {"messages", "model"} <= set(chat["required"]) and chat["properties"]["top_logprobs"]["maximum"] == 20
    assert load(OURS)["components"]["schemas"]["ChatMessage"]["properties"]["role"]["enum"] == \
        ["system", "developer", "user", "assistant", "tool"]

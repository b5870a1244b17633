"""The stack files as faas-cli reads them: every field one faas-cli knows (contracts/
stack.schema.json, from its stack.Function), every `lang` a template in template/, every image
one that `make images` builds, every `configuration.copy` path present."""
from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import yaml

from containers.images import TEMPLATES, build_context, read_builds
from contracts.config import Settings
from contracts.stack import load_stack_file, read_stack, substitute

REPO = Path(__file__).resolve().parents[2]
SCHEMA = json.loads((REPO / "contracts" / "stack.schema.json").read_text())
STACKS = ["stack.yml", "stack-emulated.yml", "stack-ensemble.yml"]


@pytest.mark.parametrize("name", STACKS)
def test_stack_file_has_only_faas_cli_fields(name: str) -> None:
    jsonschema.validate(load_stack_file(REPO / name), SCHEMA)


def test_schema_refuses_what_faas_cli_does_not_know() -> None:
    data = load_stack_file(REPO / "stack.yml")
    data["functions"]["smollm2"]["enviroment"] = {"A": "1"}  # a typo
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(data, SCHEMA)


@pytest.mark.parametrize("name", STACKS)
def test_every_image_is_one_make_images_builds(name: str) -> None:
    stack = REPO / name
    data = load_stack_file(stack)
    builds, copy = read_builds(stack)
    assert {f["image"] for f in data["functions"].values()} == {b.image for b in builds}
    assert {b.image for b in builds} == {"quart/entry:0.1.0", "quart/stage:0.1.0"}
    for spec in data["functions"].values():
        template = yaml.safe_load((TEMPLATES / spec["lang"] / "template.yml").read_text())
        assert template["language"] == spec["lang"]
        assert (REPO / spec["handler"] / "handler.py").exists()
    assert copy and all((REPO / path).exists() for path in copy)
    assert len(read_stack(stack)) == len(data["functions"])  # and the embedded runtime reads it


def test_build_context_is_laid_out_as_faas_cli_lays_it_out(tmp_path: Path) -> None:
    builds, copy = read_builds(REPO / "stack.yml")
    stage = next(b for b in builds if b.image == "quart/stage:0.1.0")
    context = build_context(stage, copy, REPO, tmp_path)
    assert context == tmp_path / stage.function
    assert (context / "Dockerfile").exists() and (context / "template.yml").exists()
    assert (context / "function" / "handler.py").read_text() == (REPO / "functions/stage/handler.py").read_text()
    for path in copy:
        assert (context / "function" / path).exists()
    assert not list(context.rglob("__pycache__"))


def test_copy_outside_the_project_is_refused(tmp_path: Path) -> None:
    builds, _ = read_builds(REPO / "stack.yml")
    with pytest.raises(ValueError, match="not inside"):
        build_context(builds[0], ["../outside"], REPO, tmp_path)


def test_images_follow_the_registry_prefix_as_faas_cli_substitutes_it(monkeypatch) -> None:
    assert substitute("${A:-x}/${B}/${C:-y}", {"A": "reg.io/team", "C": ""}) == "reg.io/team//y"
    monkeypatch.setenv("QUART_IMAGE_PREFIX", "registry.example.com/ml")
    builds, _ = read_builds(REPO / "stack.yml")
    assert {b.image for b in builds} == {"registry.example.com/ml/entry:0.1.0", "registry.example.com/ml/stage:0.1.0"}
    assert {f.deployment["image"] for f in read_stack(REPO / "stack.yml")} == {b.image for b in builds}


def test_every_function_carries_consistent_watchdog_timeouts_and_probe_paths() -> None:
    """stack.yml's functions, and those `python -m tools.stack add` writes: of-watchdog's timeouts
    past the entry's own deadline (QUART_REQUEST_TIMEOUT_S) and the body's within the runtime's
    read timeout, and probe paths the watchdog answers."""
    from engine.watchdog import LIVE_PATH, READY_PATH, duration_s
    from tools.stack import ANNOTATIONS, WATCHDOG_ENV, function_entries
    settings = Settings()
    written = yaml.safe_load(function_entries("mine", "/models/mine", 2))
    functions = {**load_stack_file(REPO / "stack.yml")["functions"], **written}
    for name, spec in functions.items():
        env, annotations = spec["environment"], spec.get("annotations", {})
        assert {k: env.get(k) for k in WATCHDOG_ENV} == WATCHDOG_ENV, name
        assert duration_s(env["exec_timeout"]) > settings.data.request_timeout_s, name
        assert duration_s(env["write_timeout"]) >= duration_s(env["exec_timeout"]), name
        assert duration_s(env["read_timeout"]) == settings.limits.read_timeout_s, name
        assert annotations == ANNOTATIONS, name
    assert (ANNOTATIONS["com.openfaas.health.http.path"], ANNOTATIONS["com.openfaas.ready.http.path"]) == (LIVE_PATH, READY_PATH)


def test_the_charts_values_let_the_functions_answer() -> None:
    """deploy/openfaas-values.yml: the gateway waits for a function past its watchdog's timeouts,
    and its own read and write timeouts past that (what OpenFaaS's chart requires)."""
    from engine.watchdog import duration_s
    values = yaml.safe_load((REPO / "deploy" / "openfaas-values.yml").read_text())
    gateway, provider = values["gateway"], values["faasnetes"]
    longest = max(duration_s(spec["environment"][k]) for spec in load_stack_file(REPO / "stack.yml")["functions"].values()
                  for k in ("exec_timeout", "write_timeout"))
    upstream = duration_s(gateway["upstreamTimeout"])
    assert upstream > longest
    assert min(duration_s(gateway["readTimeout"]), duration_s(gateway["writeTimeout"])) > upstream
    assert min(duration_s(provider["readTimeout"]), duration_s(provider["writeTimeout"])) > upstream


def test_resources_are_written_into_each_functions_block_and_nothing_else_changes() -> None:
    """`python -m tools.stack resources` edits the file as text: each named function gets its
    requests and limits (replacing any it had), comments and every other field stay, and a second
    run changes nothing."""
    from tools.stack import with_resources
    text = (REPO / "stack.yml").read_text()
    first = {"requests": {"memory": "100Mi", "cpu": "1"}, "limits": {"memory": "200Mi", "cpu": "2"}}
    once = with_resources(text, {"smollm2-s1": first, "minilm": first})
    second = {"requests": {"memory": "300Mi", "cpu": "1"}, "limits": {"memory": "400Mi", "cpu": "2"}}
    twice = with_resources(once, {"smollm2-s1": second})
    assert with_resources(twice, {"smollm2-s1": second}) == twice
    before, after = yaml.safe_load(text)["functions"], yaml.safe_load(twice)["functions"]
    assert after["smollm2-s1"]["requests"] == second["requests"] and after["smollm2-s1"]["limits"] == second["limits"]
    assert {k: after["minilm"][k] for k in ("requests", "limits")} == first
    strip = ("requests", "limits")
    assert {n: {k: v for k, v in f.items() if k not in strip} for n, f in after.items()} == \
        {n: {k: v for k, v in f.items() if k not in strip} for n, f in before.items()}
    assert [x for x in twice.splitlines() if x.lstrip().startswith("#")] == \
        [x for x in text.splitlines() if x.lstrip().startswith("#")]


def test_a_stage_asks_for_its_shard_and_the_runtime_and_may_reach_its_kv_budget_and_a_pass() -> None:
    from models.sizes import RUNTIME_BYTES, StageFootprint, mebibytes, pass_bytes
    need = StageFootprint(weights_bytes=300 << 20, kv_bytes=1 << 30, pass_bytes=pass_bytes({"intermediate_size": 1536}, 16384))
    assert need.request_bytes == (300 << 20) + RUNTIME_BYTES
    assert need.limit_bytes == need.request_bytes + (1 << 30) + 16384 * 1536 * 12
    assert pass_bytes({"hidden_size": 384}, 10) == 10 * 4 * 384 * 12   # an encoder without intermediate_size
    assert (mebibytes(1 << 20), mebibytes((1 << 20) + 1)) == ("1Mi", "2Mi")


def test_packed_weights_count_twice_where_two_layouts_hold_them() -> None:
    """A float32 or bfloat16 stage on the CPU keeps its linears packed for oneDNN and plain
    (models/packed_linear.py); a stage in float16, quantized, unpacked or on a GPU holds its shard
    once."""
    from contracts.config import ComputeConfig
    from models.sizes import resident_weight_bytes
    shard = 100 << 20
    assert resident_weight_bytes(shard, "float32", ComputeConfig()) == 2 * shard
    assert resident_weight_bytes(shard, "bfloat16", ComputeConfig(dtype="float32")) == 4 * shard   # widened, then twice
    assert resident_weight_bytes(shard, "bfloat16", ComputeConfig()) == 2 * shard    # auto keeps a 16-bit checkpoint's dtype
    assert resident_weight_bytes(shard, "float16", ComputeConfig()) == shard
    assert resident_weight_bytes(shard, "bfloat16", ComputeConfig(prepack=False)) == shard
    assert resident_weight_bytes(shard, "float32", ComputeConfig(prepack=False)) == shard
    assert resident_weight_bytes(shard, "float32", ComputeConfig(quantize="int8")) == shard
    assert resident_weight_bytes(shard, "float32", ComputeConfig(device="cuda")) == shard

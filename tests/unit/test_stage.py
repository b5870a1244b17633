"""One stage identity, parsed once: StageRef's spellings, and the stack file's pipelines."""
from __future__ import annotations

from pathlib import Path

import pytest

from contracts.paths import REPO_ROOT
from contracts.stack import consolidating_stack, pipelines, read_stack
from contracts.stage import StageRef


@pytest.mark.parametrize("stages,first,last,spelled", [("2", 2, 3, "2"), ("1-3", 1, 3, "1-3"), (" 0-1 ", 0, 1, "0")])
def test_parse_and_spell(stages, first, last, spelled):
    ref = StageRef.parse("m", stages)
    assert (ref.first, ref.last, ref.stages, ref.key) == (first, last, spelled, f"m:{spelled}")
    assert StageRef.from_key(ref.key) == ref and list(ref.indices()) == list(range(first, last))


@pytest.mark.parametrize("model,stages", [("m", "3-3"), ("m", "a"), ("m", "-1"), ("", "1"), ("a:b", "1"), ("m", "4-2")])
def test_malformed_ranges_are_refused(model, stages):
    with pytest.raises(ValueError):
        StageRef.parse(model, stages)


def test_the_bundled_stacks_have_one_identity_per_function():
    smollm2 = pipelines(read_stack(REPO_ROOT / "stack.yml"))["smollm2"]
    assert smollm2.num_stages == 4 and smollm2.function(StageRef("smollm2", 2, 3)) == "smollm2-s2"
    assert pipelines(read_stack(REPO_ROOT / "stack-emulated.yml"))["llama-7b"].num_stages == 8
    for f in read_stack(REPO_ROOT / "stack.yml"):
        assert not any(k.startswith("quart.") for k in f.deployment["labels"])  # said once, in the env


def _stack(tmp_path: Path, ranges: list[str]) -> Path:
    functions = "".join(
        f"  m-s{i}:\n    lang: quart-python\n    handler: ./functions/stage\n    image: quart/stage:0.1.0\n"
        f"    environment:\n      QUART_MODEL: m\n      QUART_STAGES: \"{r}\"\n" for i, r in enumerate(ranges))
    path = tmp_path / "stack.yml"
    path.write_text(f"version: 1.0\nprovider:\n  name: openfaas\nfunctions:\n{functions}")
    return path


def test_range_functions_make_a_pipeline(tmp_path):
    p = pipelines(read_stack(_stack(tmp_path, ["0", "1-3", "3"])))["m"]
    assert [s.stages for s in p.stages] == ["0", "1-3", "3"] and p.num_stages == 4


@pytest.mark.parametrize("ranges", [["0", "2"], ["0-2", "1-3"], ["1", "2"]])
def test_gaps_and_overlaps_are_refused(tmp_path, ranges):
    with pytest.raises(ValueError, match="gaps or overlaps"):
        read_stack(_stack(tmp_path, ranges))


def test_a_whole_model_function_stays_out_of_the_pipeline(tmp_path):
    consolidating = consolidating_stack(REPO_ROOT / "stack.yml", tmp_path / "whole.yml", "smollm2",
                                        {"com.openfaas.scale.max": "2"})
    p = pipelines(read_stack(consolidating))["smollm2"]
    assert (p.whole, p.whole_max, p.num_stages) == ("smollm2-whole", 2, 4)
    assert p.functions == ("smollm2-s0", "smollm2-s1", "smollm2-s2", "smollm2-s3")
    assert pipelines(read_stack(REPO_ROOT / "stack.yml"))["smollm2"].whole is None
    from contracts.config import load_settings
    from runtime.server import stages_to_cache
    cached = stages_to_cache(load_settings(environ={"QUART_CACHE_STAGES": "all"}), read_stack(consolidating))
    assert StageRef("smollm2", 0, 4) not in cached and len(cached) == 4  # no second copy of the model
    path = _stack(tmp_path, ["0", "1-3", "3", "1-4"])
    path.write_text(path.read_text() + "    labels:\n      com.quart.whole: \"true\"\n")
    with pytest.raises(ValueError, match="serves 1-4, not 0-4"):
        read_stack(path)

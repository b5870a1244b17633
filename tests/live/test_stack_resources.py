"""stack.yml's memory and CPU requests and limits are what `python -m tools.stack resources`
computes from the bundled models' partitioned shards: a change of the partitioning or the sizing
that the file does not follow fails here (`make stack` writes them again)."""
from __future__ import annotations

import re

from contracts.paths import REPO_ROOT
from contracts.stack import load_stack_file, read_stack
from tools.stack import function_resources


def test_stack_file_resources_follow_the_shards(partitioned) -> None:
    models_dir = partitioned("smollm2", 4).directory.parent
    partitioned("minilm", 3)
    written = load_stack_file(REPO_ROOT / "stack.yml")["functions"]
    for fn in read_stack(REPO_ROOT / "stack.yml"):
        expected = function_resources(fn, models_dir)
        assert {k: written[fn.name].get(k) for k in ("requests", "limits")} == expected, fn.name
        for kind in ("requests", "limits"):
            assert re.fullmatch(r"\d+Mi", expected[kind]["memory"]) and re.fullmatch(r"\d+m?", expected[kind]["cpu"])
        assert int(expected["limits"]["memory"][:-2]) > int(expected["requests"]["memory"][:-2]), fn.name

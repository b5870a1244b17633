"""Stage graphs: a chain and the ensemble DAG route as drawn, a stage function's range must be a
path nothing enters or leaves midway, and the emulated join averages its parts."""
from __future__ import annotations

import pytest
import torch

from contracts.stage_graph import chain, check_range, predecessors, successors
from contracts.wire import BadRequest
from models.emulated import EmulatedRunner
from models.profiles import ENSEMBLE, profile

DAG = ENSEMBLE.graph()


def test_chain_and_dag_route_as_drawn():
    assert successors(chain(4), 1) == [2] and predecessors(chain(4), 0) == [] and successors(chain(4), 3) == []
    assert successors(DAG, 0) == [1, 2, 3] and predecessors(DAG, 7) == [4, 5, 6]
    assert predecessors(DAG, 4) == [1] and successors(DAG, 7) == []
    assert profile("llama-7b").graph() == chain(8)


def test_a_range_must_be_a_path_without_branches_inside():
    check_range(chain(8), 2, 6)
    for i in range(8):
        check_range(DAG, i, i + 1)
    with pytest.raises(ValueError, match="not a path"):
        check_range(DAG, 0, 2)   # stage 0 also feeds 2 and 3
    with pytest.raises(ValueError, match="not a path"):
        check_range(DAG, 1, 3)   # 1 does not lead to 2


def test_the_emulated_join_averages_parts_of_one_shape():
    runner = EmulatedRunner(ENSEMBLE, ENSEMBLE.name, 7, 8)
    out = runner.join({4: {"hidden": torch.zeros(1, 3, 64)}, 5: {"hidden": torch.full((1, 3, 64), 3.0)}})
    assert out["hidden"].shape == (1, 3, 64) and out["hidden"][0, 0, 0].item() == 1.5
    with pytest.raises(BadRequest, match="differ"):
        runner.join({4: {"hidden": torch.zeros(1, 3, 64)}, 5: {"hidden": torch.zeros(1, 4, 64)}})
    with pytest.raises(BadRequest, match="differ"):
        runner.join({4: {"hidden": torch.zeros(1, 3, 64)}, 5: {}})

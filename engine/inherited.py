"""The parameters a forked replica inherited from its zygote.

A module of its own because the zygote runs as `python -m keysmanager.zygote` (its module is then
`__main__`), while the stage handler imports this name: both must see the same global."""
from __future__ import annotations

from contracts.stage import StageRef
from models.emulated import EmulatedRunner
from models.stage_runner import StageRunner

RUNNER: StageRunner | EmulatedRunner | None = None


def inherited_runner(stage: StageRef) -> StageRunner | EmulatedRunner | None:
    """The runner this process inherited from its zygote, if it holds exactly these stages."""
    r = RUNNER
    if r is not None and (r.manifest.model, r.first, r.last) == (stage.model, stage.first, stage.last):
        return r
    return None

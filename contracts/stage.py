"""One stage identity: the stage range [first, last) of a model that a stage function serves.
Parsed once (from the stack file, a replica's environment or a Redis member) and passed
everywhere; its two spellings are `stages` ("2", "1-3") and `key` ("smollm2:1-3")."""
from __future__ import annotations

import re
from dataclasses import dataclass

_STAGES = re.compile(r"^(\d+)(?:-(\d+))?$")


@dataclass(frozen=True, order=True)
class StageRef:
    model: str
    first: int
    last: int          # exclusive

    def __post_init__(self) -> None:
        if not self.model or ":" in self.model:
            raise ValueError(f"a stage's model must be a non-empty name without ':'; got {self.model!r}")
        if not 0 <= self.first < self.last:
            raise ValueError(f"a stage range must be 0 <= first < last; got [{self.first}, {self.last})")

    @classmethod
    def parse(cls, model: str, stages: str) -> StageRef:
        """`stages` as a stack file writes it: "2" is [2, 3), "1-3" is [1, 3)."""
        m = _STAGES.match(stages.strip())
        if not m:
            raise ValueError(f"stage range {stages!r} is not 'a' or 'a-b'")
        first = int(m[1])
        return cls(model, first, int(m[2]) if m[2] else first + 1)

    @classmethod
    def from_key(cls, key: str) -> StageRef:
        model, sep, stages = key.partition(":")
        if not sep:
            raise ValueError(f"stage key {key!r} is not 'model:stages'")
        return cls.parse(model, stages)

    @property
    def stages(self) -> str:
        return str(self.first) if self.last == self.first + 1 else f"{self.first}-{self.last}"

    @property
    def key(self) -> str:
        return f"{self.model}:{self.stages}"

    def indices(self) -> range:
        return range(self.first, self.last)

    def __str__(self) -> str:
        return self.key

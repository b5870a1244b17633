"""The manifest of a partitioned model: which units each stage holds and where its shard lies."""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PretrainedConfig

MANIFEST_NAME = "manifest.json"
# Raised when what the partitioner writes changes; a partition of another format is made again.
# 3: each shard's pieces' hashes (what a server receiving it from a peer checks each block by).
FORMAT = 3
# A shard is hashed in pieces of this size; a multicast's block is a run of whole pieces.
PIECE_BYTES = 1 << 20


@dataclass
class StageInfo:
    index: int
    units: tuple[int, int]          # [first, last) over the manifest's units
    layers: tuple[int, int]         # [first, last) over the transformer blocks
    has_embed: bool
    has_head: bool
    params: int
    shard: str                      # file name inside the model directory
    sha256: str
    bytes: int
    pieces: tuple[str, ...] = ()    # sha256 of each PIECE_BYTES piece of the shard, in order


@dataclass
class Manifest:
    model: str
    arch: str
    source: str
    method: str                     # "balanced" or "uniform"
    dtype: str
    config: dict
    tokenizer: str                  # directory name inside the model directory
    units: list[dict]               # [{"name", "bytes"}]
    stages: list[StageInfo]
    directory: Path = field(default=Path("."), compare=False)
    pooling: dict | None = None     # an encoder's sentence pooling: {"mode": "mean"|"cls", "normalize"}
    format: int = 1

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def config_object(self) -> PretrainedConfig:
        # Imported here: what only reads manifests (the provider's placer) starts without transformers.
        from models.architectures import config_from_dict
        return config_from_dict(self.arch, self.config)

    @property
    def generative(self) -> bool:
        from models.families import DECODER, family
        return family(self.arch) == DECODER

    @property
    def context_length(self) -> int:
        return int(self.config["max_position_embeddings"])

    def stage_of(self, shard: str) -> StageInfo | None:
        """The stage whose shard file is named `shard`, if any."""
        return next((s for s in self.stages if s.shard == shard), None)

    def shard_path(self, stage: int) -> Path:
        return self.directory / self.stages[stage].shard

    def tokenizer_path(self) -> Path:
        return self.directory / self.tokenizer

    def save(self) -> Path:
        data = asdict(self)
        data.pop("directory")
        path = self.directory / MANIFEST_NAME
        path.write_text(json.dumps(data, indent=1))
        return path

    @classmethod
    def load(cls, directory: str | Path) -> Manifest:
        directory = Path(directory)
        path = directory / MANIFEST_NAME
        if not path.is_file():
            raise FileNotFoundError(f"no {MANIFEST_NAME} in {directory}: partition the model first "
                                    f"(python -m models.partition --help)")
        data = json.loads(path.read_text())
        stages = [StageInfo(**{**s, "units": tuple(s["units"]), "layers": tuple(s["layers"]),
                                "pieces": tuple(s.get("pieces", ()))})
                  for s in data.pop("stages")]
        return cls(stages=stages, directory=directory, **data)


def sha256_file(path: Path) -> str:
    """The file's sha256 alone (a shard's check before it loads: no piece hashes to spend on)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def file_hashes(path: Path) -> tuple[str, tuple[str, ...]]:
    """The file's sha256 and each PIECE_BYTES piece's, in one read."""
    digest, pieces = hashlib.sha256(), []
    with open(path, "rb") as f:
        for piece in iter(lambda: f.read(PIECE_BYTES), b""):
            digest.update(piece)
            pieces.append(hashlib.sha256(piece).hexdigest())
    return digest.hexdigest(), tuple(pieces)

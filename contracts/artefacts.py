"""The artefacts QUART's policy runs from: the trained CV-attention model and each model's CPU
fits (and the profile they were fitted on). Each is looked for in QUART_HOME first (what a user
made for their own models and host), then among those this repository ships, which
`python -m tools.artefacts` makes for the bundled models."""
from __future__ import annotations

from pathlib import Path

from contracts.paths import REPO_ROOT

SHIPPED = REPO_ROOT / "autoscaler" / "artefacts"
CV_MODEL = "cv_attention.pt"
MAKE_ALL = "python -m tools.artefacts"


def cpu_fits_name(model: str) -> str:
    return f"{model}.cpu_fits.json"


def cpu_profile_name(model: str) -> str:
    return f"{model}.cpu_profile.json"


def find(home: str | Path, name: str) -> Path | None:
    """<home>/<name>, else the shipped one, else None."""
    for folder in (Path(home), SHIPPED):
        if (folder / name).is_file():
            return folder / name
    return None


def make_fits_command(model: str, home: str | Path) -> str:
    return f"python -m tools.profile_cpu --model {model} --out {home}"

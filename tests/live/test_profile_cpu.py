"""CPU profiling of a real partitioned model: a fit per stage, saved."""
from __future__ import annotations

from autoscaler.policy.compensator import load_fits


def test_profile_cpu_fits_and_saves_every_stage(partitioned, home_settings, tmp_path):
    from tools.profile_cpu import main
    partitioned("minilm", 3)
    home = tmp_path / "home"
    home.mkdir()
    (home / "models").symlink_to(home_settings.models_dir, target_is_directory=True)
    assert main(["--model", "minilm", "--cpus", "1", "--payloads", "4,16,32", "--repeats", "2",
                 "--home", str(home)]) == 0
    fits = load_fits(home / "minilm.cpu_fits.json")
    assert sorted(fits) == [0, 1, 2]
    assert all(f.predict(1, 16) > 0 for f in fits.values())

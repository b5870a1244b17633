"""Processes watched by pid and start time, and the state file a provider leaves: with real processes."""
import subprocess
import sys

from runtime.state_file import load, save
from runtime.watched_process import WatchedProcess, start_time


def test_a_process_is_told_from_a_later_one_with_its_pid():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        watched = WatchedProcess(proc.pid)
        assert watched.poll() is None and watched.start_ticks == start_time(proc.pid)
        # The same pid with another start time is another process: the one recorded is gone.
        assert WatchedProcess(proc.pid, watched.start_ticks + 1).poll() == -1
        watched.terminate()
        proc.wait(timeout=10)   # reaped by its parent, as the guardian reaps orphans
        assert watched.wait(timeout=5) == -1
        assert start_time(proc.pid) is None
    finally:
        proc.kill()


def test_a_state_file_is_written_whole(tmp_path):
    path = tmp_path / "run" / "state.json"
    assert load(path) == {}
    save(path, {"components": {"redis": {"pid": 1, "start_ticks": 2}}, "functions": []})
    assert load(path)["components"]["redis"] == {"pid": 1, "start_ticks": 2}
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    path.write_text("{cut off")
    assert load(path) == {}

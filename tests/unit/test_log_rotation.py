"""Log rotation with a writer that keeps its append descriptor, as every runtime process does."""
from __future__ import annotations

import os

from runtime.log_rotation import rotate


def test_a_log_over_the_limit_is_copied_and_truncated_and_its_writer_goes_on(tmp_path):
    log = tmp_path / "replica.log"
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    small = tmp_path / "quiet.log"
    small.write_bytes(b"few\n")
    try:
        for generation in range(4):
            os.write(fd, f"generation {generation}\n".encode() * 200)
            assert rotate(tmp_path, max_bytes=1000, keep=2) == [log]
            os.write(fd, b"after\n")
            assert log.read_bytes() == b"after\n"       # no hole of zeros before it: appends go to the end
        assert (tmp_path / "replica.log.1").read_bytes().startswith(b"after\ngeneration 3")
        assert (tmp_path / "replica.log.2").read_bytes().startswith(b"after\ngeneration 2")
        assert not (tmp_path / "replica.log.3").exists()
        assert small.read_bytes() == b"few\n"
    finally:
        os.close(fd)

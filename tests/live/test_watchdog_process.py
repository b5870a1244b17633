"""The watchdog as a replica runs it, a real process on a real port: it listens before its handler
has loaded, answering liveness at once and readiness only once loaded, and an invocation sent
during the load is answered after it (what lets Kubernetes probe a replica that takes long to load
without restarting it)."""
from __future__ import annotations

import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

from contracts.paths import REPO_ROOT
from tests.live.runtime_helpers import wait_until

HANDLER = '''
import time
time.sleep(LOAD_S)   # what importing torch and reading a shard takes a real stage


def handle(event, context):
    return {"statusCode": 200, "body": {"echo": event.body.decode()}}
'''


def _status(port: int, path: str, body: bytes | None = None) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=body), timeout=30) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_live_at_once_ready_once_loaded_and_invocations_wait_for_the_load(tmp_path):
    load_s = 4.0
    (tmp_path / "fn").mkdir()
    (tmp_path / "fn" / "handler.py").write_text(HANDLER.replace("LOAD_S", str(load_s)))
    port_file = tmp_path / "port"
    proc = subprocess.Popen([sys.executable, "-m", "engine.watchdog", "--handler", str(tmp_path / "fn"), "--port-file",
                             str(port_file)], cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    started = time.monotonic()
    try:
        wait_until(port_file.exists, 30, "the watchdog listening")
        port = int(port_file.read_text())
        listening_after = time.monotonic() - started
        assert _status(port, "/_/live")[0] == 200
        assert _status(port, "/_/health")[0] == 503 and _status(port, "/_/ready")[0] == 503
        answered: list = []
        sender = threading.Thread(target=lambda: answered.append(_status(port, "/", b"early")))
        sender.start()
        wait_until(lambda: _status(port, "/_/ready")[0] == 200, 60, "the handler loaded")
        loaded_after = time.monotonic() - started
        sender.join(timeout=30)
        assert answered == [(200, b'{"echo": "early"}')]
        assert _status(port, "/_/health")[0] == 200 and _status(port, "/_/live")[0] == 200
        # Listening came before the load's sleep was over; readiness after it.
        assert listening_after < loaded_after and loaded_after >= load_s, (listening_after, loaded_after)
    finally:
        proc.terminate()
        proc.wait(timeout=30)

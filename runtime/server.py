"""The embedded runtime in the foreground: a redis-server, the local provider on the gateway
port, and every function of the stack file deployed. SIGTERM drains all replicas and stops.
`python -m runtime up` runs this in the background; use that."""
from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from aiohttp import web

from contracts.config import load_settings
from runtime.provider import LocalProvider, read_or_create_password
from runtime.redis_server import start_redis
from runtime.stack import read_stack


def main() -> int:
    settings = load_settings()
    home = Path(settings.home)
    logging.basicConfig(level=os.environ.get("QUART_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    redis_proc = start_redis(settings.redis_host, settings.redis_port, home / "redis",
                             home / "logs" / "redis.log")
    try:
        stack = read_stack(Path(settings.stack_file))
        provider = LocalProvider(settings, stack, read_or_create_password(settings.password_file))
        for fn in stack:
            provider.deploy(fn.deployment)
        web.run_app(provider.app(), host=settings.gateway_host, port=settings.gateway_port,
                    print=None, access_log=None, shutdown_timeout=5)
    finally:
        redis_proc.terminate()
        redis_proc.wait(timeout=10)
    return 0


if __name__ == "__main__":
    sys.exit(main())

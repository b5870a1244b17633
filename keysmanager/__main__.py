"""Runs a server's KeysManager: python -m keysmanager [--keysmanager-port N] [--server NAME]."""
from __future__ import annotations

import argparse
import sys

from aiohttp import web

from contracts import logs as log_format
from contracts.config import add_arguments, exit_on_config_error, settings_from_args
from keysmanager.api import build_app
from keysmanager.manager import KeysManager
from state.store import RedisStore


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    add_arguments(parser, "home", "keysmanager_host", "keysmanager_port", "server", "redis_port", "cache_memory_threshold")
    args = parser.parse_args(argv)
    settings = exit_on_config_error(lambda: settings_from_args(args))
    log_format.configure(settings.log_level, settings.log_format)
    manager = KeysManager(settings, RedisStore.from_url(settings.redis_url))
    web.run_app(build_app(manager, settings.internal_api_token()), host=settings.cache.host, port=settings.cache.port,
                print=None, access_log=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())

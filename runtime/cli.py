"""The `quart` command (installed by `pip install .`): one name for the project's commands, each
the module a checkout runs with `python -m` and its own options (`quart COMMAND --help`).

    quart init                   a stack.yml serving the bundled models (python -m tools.stack init)
    quart up | down | status     the embedded runtime (python -m runtime)
    quart partition ...          split a checkpoint into stage shards (python -m models.partition)
    quart replay | compare ...   the trace-replay load generator (python -m loadgen)
    quart sim ...                the cluster simulator (python -m sim)
    quart bench [NAME ...]       the benchmarks (python -m benchmarks)
"""
from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Command:
    module: str        # the module whose main(argv) runs it
    summary: str
    prefix: tuple[str, ...] = ()   # words put before the user's arguments (a module's own subcommand)

    def run(self, argv: list[str]) -> int:
        # Imported when chosen: `quart status` need not load torch, the benchmarks or the simulator.
        main: Callable[[list[str]], int | None] = importlib.import_module(self.module).main
        return main([*self.prefix, *argv]) or 0


COMMANDS = {
    "init": Command("tools.stack", "write a stack.yml here serving the bundled models", ("init",)),
    "up": Command("runtime.__main__", "start the embedded runtime in the background, ready to answer", ("up",)),
    "down": Command("runtime.__main__", "drain and stop the embedded runtime", ("down",)),
    "status": Command("runtime.__main__", "the runtime's functions and their replicas", ("status",)),
    "partition": Command("models.partition", "split a checkpoint into stage shards with a manifest"),
    "replay": Command("loadgen.__main__", "replay a trace against a running runtime and write a report", ("replay",)),
    "compare": Command("loadgen.__main__", "replay one trace against a fresh runtime per policy", ("compare",)),
    "sim": Command("sim.__main__", "simulate policies on a cluster and write a report"),
    "bench": Command("benchmarks.__main__", "run benchmarks; each writes benchmarks/results/<name>.json"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {c.summary}" for name, c in COMMANDS.items()]
    return "usage: quart COMMAND [options]   (quart COMMAND --help for its options)\n\ncommands:\n" + "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    command = COMMANDS.get(argv[0])
    if command is None:
        print(f"quart: unknown command {argv[0]!r}\n\n{usage()}", file=sys.stderr)
        return 2
    return command.run(argv[1:])


if __name__ == "__main__":
    sys.exit(main())

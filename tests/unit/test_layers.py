"""The code's layers: contracts, then pure policies, then the data plane, then mechanisms, then
tools. A module may import from its own layer or one below, never from one above, and the units
of one layer do not import each other in a circle. A new package must be given its layer here."""
from __future__ import annotations

import ast
from pathlib import Path

from contracts.paths import REPO_ROOT

# Longest prefix wins: autoscaler.policy is a pure policy, the rest of autoscaler is its live loop.
LAYERS = {
    "contracts": 0,
    "state": 1, "autoscaler.policy": 1, "scheduler": 1, "keysmanager.cache_policy": 1,
    "models": 2, "engine": 2, "frontend": 2, "functions": 2,
    "keysmanager": 3, "autoscaler": 3, "runtime": 3, "containers": 3,
    "loadgen": 4, "sim": 4, "tools": 4, "benchmarks": 4,
}
NAMES = ("contracts", "state", "autoscaler", "scheduler", "keysmanager", "models", "engine", "frontend", "functions",
         "runtime", "containers", "loadgen", "sim", "tools", "benchmarks")


def unit(module: str) -> str | None:
    matches = [u for u in LAYERS if module == u or module.startswith(u + ".")]
    return max(matches, key=len) if matches else None


def modules() -> dict[str, Path]:
    found = {}
    for top in NAMES:
        for path in (REPO_ROOT / top).rglob("*.py"):
            parts = path.relative_to(REPO_ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(path: Path) -> set[str]:
    """Every module an import statement names, function-level imports included."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names |= {f"{node.module}.{a.name}" for a in node.names}
    return {n for n in names if n.split(".")[0] in NAMES}


def edges() -> set[tuple[str, str, str]]:
    out = set()
    for module, path in modules().items():
        for name in imports(path):
            out.add((module, unit(module), unit(name)))
    return out


def test_every_module_has_a_layer():
    assert [m for m in modules() if unit(m) is None] == []


def test_no_module_imports_from_a_layer_above_its_own():
    upward = sorted(f"{m} ({a}, layer {LAYERS[a]}) imports {b} (layer {LAYERS[b]})"
                    for m, a, b in edges() if LAYERS[b] > LAYERS[a])
    assert upward == []


def test_units_import_each_other_without_cycles():
    graph: dict[str, set[str]] = {}
    for _, a, b in edges():
        if a != b:
            graph.setdefault(a, set()).add(b)
    seen, stack, cycles = set(), [], []

    def visit(node: str) -> None:
        if node in stack:
            cycles.append(stack[stack.index(node):] + [node])
            return
        if node in seen:
            return
        seen.add(node)
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            visit(nxt)
        stack.pop()

    for node in sorted(graph):
        visit(node)
    assert cycles == []


# Redis is reached through the state layer's typed records (state/) and the data plane's
# transport (the streams a replica and an entry exchange work on). The benchmarks named after them
# play the transport's part themselves (they enqueue work on a stage's stream, time a hop or a KV
# move at the Redis level, write records at chosen times); that list only shrinks, and a module not
# on either that imports redis fails here.
TRANSPORT = {"engine.transport", "frontend.pipeline_client", "frontend.step_sender", "engine.join", "runtime.redis_server"}
STILL_ON_REDIS = {
    "benchmarks.autoscaler_tick", "benchmarks.coldstart", "benchmarks.containers", "benchmarks.hop",
    "benchmarks.kv_migration", "benchmarks.scaleup",
}


def _imports_redis(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "redis" for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "redis":
            return True
    return False


def test_only_the_state_layer_and_the_transport_import_redis():
    on_redis = {m for m, path in modules().items() if _imports_redis(path) and unit(m) != "state"}
    assert sorted(on_redis - TRANSPORT - STILL_ON_REDIS) == []
    assert sorted(STILL_ON_REDIS - on_redis) == [], "moved to the state layer: strike it from STILL_ON_REDIS"

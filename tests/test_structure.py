"""The package's shape: the config is a leaf (no framework imports), and no two grpo_jax modules
import each other, directly or through others, counting imports inside functions."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "grpo_jax"
FRAMEWORKS = ("jax", "flax", "optax", "orbax", "transformers", "tensorflow_datasets", "tensorflow", "chex", "numpy")


def test_importing_the_config_loads_no_framework():
    code = ("import sys, grpo_jax.config as c; c.load_config; "
            f"print(sorted(m for m in {FRAMEWORKS!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """module -> the grpo_jax modules it imports anywhere in its body (functions included). An
    import of `grpo_jax.a.b` from outside package `grpo_jax.a` also runs `grpo_jax.a`."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                         for a in node.names]
            else:
                continue
            for target in found:
                parts = target.split(".")
                for i in range(2, len(parts) + 1):  # the packages it passes through, then the module
                    prefix = ".".join(parts[:i])
                    if prefix in modules and prefix != name and not name.startswith(prefix + "."):
                        targets.add(prefix)
        graph[name] = targets
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if not state.get(nxt):
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if not state.get(node):
            found = visit(node)
            if found:
                return found
    return None


def test_no_import_cycle_among_grpo_jax_modules():
    graph = import_graph()
    assert "grpo_jax.trainer.loop" in graph and "grpo_jax.config" in graph["grpo_jax.trainer.loop"]
    assert graph["grpo_jax.config.schema"] == set()  # the leaf imports no grpo_jax module
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle)


def test_the_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None

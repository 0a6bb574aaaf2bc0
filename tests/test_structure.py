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


def test_the_command_line_parser_loads_no_framework():
    """`grpo-jax bench memory` sets JAX's device count before JAX starts: building the parser (every
    command's, `check`'s included) must not start it."""
    code = ("import sys; from grpo_jax.cli import build_parser; build_parser(); "
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
    assert graph["grpo_jax.config.checks"] == set()  # the leaf imports no grpo_jax module
    config_modules = [m for m in graph if m.startswith("grpo_jax.config.")]
    assert {t for m in config_modules for t in graph[m]} <= set(config_modules)  # nor does the rest of the config
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle)


def test_the_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def private_imports(package: Path = PACKAGE) -> list[str]:
    """`from grpo_jax.x import _name` anywhere in the package (functions included): a module using
    another's private name."""
    found = []
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("grpo_jax"):
                found += [f"{path.relative_to(package.parent)}: {node.module}.{a.name}" for a in node.names
                          if a.name.startswith("_") and not a.name.startswith("__")]
    return found


def long_functions(limit: int = 60, package: Path = PACKAGE) -> list[str]:
    """Functions (methods included) longer than `limit` lines. argparse tables are exempt: a
    function whose lines are mostly `add_argument` calls is one option a line."""
    found = []
    for path in package.rglob("*.py"):
        text = path.read_text()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                body = ast.get_source_segment(text, node) or ""
                if length > limit and body.count("add_argument") < length // 3:
                    found.append(f"{path.relative_to(package.parent)}:{node.lineno} {node.name} ({length} lines)")
    return found


def test_no_module_imports_another_modules_private_names():
    assert private_imports() == []


def test_no_function_over_60_lines_and_no_module_over_400():
    assert long_functions() == []
    long_modules = [f"{p.relative_to(PACKAGE.parent)} ({n} lines)" for p in PACKAGE.rglob("*.py")
                    if (n := len(p.read_text().splitlines())) > 400]
    assert long_modules == []


def test_the_measures_find_what_they_measure(tmp_path):
    package = tmp_path / "grpo_jax"
    package.mkdir()
    body = "".join(f"    x{i} = {i}\n" for i in range(61))
    (package / "a.py").write_text("from grpo_jax.b import _hidden, shown\n\n\ndef long():\n" + body)
    (package / "b.py").write_text("def short():\n    return 1\n\n\ndef parser(p):\n"
                                  + "    p.add_argument('--x')\n" * 70)
    assert private_imports(package) == ["grpo_jax/a.py: grpo_jax.b._hidden"]
    # 62 lines is too long; an argparse table of 71 lines is exempt; a short function is not listed.
    assert long_functions(package=package) == ["grpo_jax/a.py:4 long (62 lines)"]
    assert long_functions(limit=62, package=package) == []


def test_the_loop_file_reads_top_to_bottom_in_under_250_lines():
    loop = PACKAGE / "trainer" / "loop.py"
    assert len(loop.read_text().splitlines()) <= 250


# Capability probes allowed in trainer/ and learner/, by the probed expression, with the reason.
PROBE_ALLOWED = {"tokenizer": "a transformers tokenizer or the char tokenizer: third-party objects, not our protocols"}
ACTOR_SIDE = ("grpo_jax.engine", "grpo_jax.episodes", "grpo_jax.env", "grpo_jax.rollout")


def capability_probes(package: Path = PACKAGE, folders=("trainer", "learner")) -> list[str]:
    """`hasattr(obj, ...)`, and `getattr(obj, "name", default)` (a probe with a fallback), in the
    loop's and the learner's modules: a capability an object may or may not have is a declared
    method (grpo_jax.rollout.source.RolloutSource), never a probe."""
    found = []
    for folder in folders:
        for path in sorted((package / folder).rglob("*.py")):
            text = path.read_text()
            for node in ast.walk(ast.parse(text)):
                if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.args):
                    continue
                probe = node.func.id == "hasattr" or (node.func.id == "getattr" and len(node.args) == 3
                                                     and isinstance(node.args[1], ast.Constant))
                target = ast.get_source_segment(text, node.args[0])
                if probe and target not in PROBE_ALLOWED:
                    found.append(f"{path.relative_to(package.parent)}:{node.lineno} {ast.get_source_segment(text, node)}")
    return found


def test_the_loop_and_the_learner_probe_no_object_for_a_capability():
    assert capability_probes() == []


def test_rewards_import_nothing_of_the_actor_side_and_nothing_imports_jax_internals():
    graph = import_graph()
    reward_modules = [m for m in graph if m == "grpo_jax.rewards" or m.startswith("grpo_jax.rewards.")]
    assert len(reward_modules) > 5
    upward = sorted(f"{m} -> {t}" for m in reward_modules for t in graph[m] if t.startswith(ACTOR_SIDE))
    assert upward == []
    assert internal_jax_imports() == []


def internal_jax_imports(package: Path = PACKAGE) -> list[str]:
    """Imports of `jax._src` (JAX's private modules, which change without notice) anywhere in the package."""
    found = []
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [f"{path.relative_to(package.parent)}: {n}" for n in names if n.startswith("jax._src")]
    return found


def test_the_seam_measures_find_probes_and_internal_imports(tmp_path):
    package = tmp_path / "grpo_jax"
    (package / "trainer").mkdir(parents=True)
    (package / "trainer" / "a.py").write_text(
        "import jax._src.distributed\nfrom jax._src import config\n\n\ndef f(source, tokenizer, x):\n"
        "    if hasattr(source, 'ahead'):\n        pass\n    g = getattr(source, 'checkpoint', None)\n"
        "    t = getattr(tokenizer, 'chat_template', None)\n    return getattr(x, 'y')\n")
    (package / "learner").mkdir()
    assert capability_probes(package) == ["grpo_jax/trainer/a.py:6 hasattr(source, 'ahead')",
                                          "grpo_jax/trainer/a.py:8 getattr(source, 'checkpoint', None)"]
    assert internal_jax_imports(package) == ["grpo_jax/trainer/a.py: jax._src.distributed",
                                             "grpo_jax/trainer/a.py: jax._src"]


def test_every_subpackage_says_what_it_is_for_and_no_package_reaches_into_anothers_private_module():
    packages = sorted(p.parent for p in PACKAGE.glob("*/__init__.py"))
    assert len(packages) >= 14
    undocumented = [p.name for p in packages if not ast.get_docstring(ast.parse((p / "__init__.py").read_text()))]
    assert undocumented == []
    reaching = []
    for path in PACKAGE.rglob("*.py"):
        own = path.relative_to(PACKAGE).parts[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("grpo_jax."):
                parts = node.module.split(".")
                if parts[1] != own and any(part.startswith("_") for part in parts[2:]):
                    reaching.append(f"{path.relative_to(PACKAGE.parent)}: {node.module}")
    assert reaching == []


def mode_comparisons(package: Path = PACKAGE) -> dict[str, list[str]]:
    """{"engine": [...], "algorithm": [...]}: `file:line` of each comparison of an engine's or an
    algorithm's name with a string outside config/ (`x.engine == "paged"`, `algorithm in ("ppo",)`):
    a mode is an object chosen from a registry once, not a string tested where it is used."""
    found = {"engine": [], "algorithm": []}

    def named(n):
        return getattr(n, "attr", getattr(n, "id", None)) if isinstance(n, (ast.Attribute, ast.Name)) else None

    def text(n):
        if isinstance(n, (ast.Tuple, ast.List, ast.Set)):
            return all(text(e) for e in n.elts)
        return isinstance(n, ast.Constant) and isinstance(n.value, str)

    for path in sorted(package.rglob("*.py")):
        if "config" in path.relative_to(package).parts[:1]:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
                kinds = {named(s) for s in sides} & set(found)
                if kinds and any(text(s) for s in sides):
                    found[kinds.pop()].append(f"{path.relative_to(package.parent)}:{node.lineno}")
    return found


def test_modes_are_chosen_once_not_compared_where_they_are_used(tmp_path):
    found = mode_comparisons()
    # An algorithm picks its objective (learner.objectives.OBJECTIVES), an engine its object
    # (engine.engines.ENGINES, its traits in config.rollout.ENGINE_TRAITS): both asked, never named.
    assert found == {"engine": [], "algorithm": []}, found
    (tmp_path / "m.py").write_text('if cfg.algorithm == "ppo" or engine in ("paged", "static"):\n    pass\n')
    assert mode_comparisons(tmp_path) == {"engine": [f"{tmp_path.name}/m.py:1"], "algorithm": [f"{tmp_path.name}/m.py:1"]}


def test_the_update_step_is_state_and_batch_with_its_static_half_bound_once():
    import dataclasses
    import inspect

    from grpo_jax.learner import train_step as ts

    assert list(inspect.signature(ts.train_step).parameters) == ["state", "batch", "frozen", "spec"]
    assert inspect.signature(ts.train_step).parameters["spec"].kind is inspect.Parameter.KEYWORD_ONLY
    assert dataclasses.is_dataclass(ts.StepSpec) and ts.StepSpec.__dataclass_params__.frozen
    assert list(inspect.signature(ts.bind_train_step).parameters) == ["spec"]
    # No mode name is threaded through the objectives and the loss: the pmap mode lives in learner/pmap.py.
    for name in ("objectives.py", "train_step.py", "step_factory.py", "grpo.py", "ppo.py", "learner.py"):
        assert "axis_name" not in (PACKAGE / "learner" / name).read_text(), name


def test_the_runs_inputs_are_typed_with_no_any_field():
    """A run's inputs are a composition of the model's, the rollout's and evaluation's, every field
    typed (the rollout side declares what it reads: grpo_jax.rollout.inputs)."""
    import dataclasses

    from grpo_jax.rollout.inputs import EvalInputs, RolloutInputs
    from grpo_jax.trainer.prepare import ModelInputs, Prepared

    for cls in (Prepared, ModelInputs, RolloutInputs, EvalInputs):
        untyped = [f.name for f in dataclasses.fields(cls) if "Any" in str(f.type)]
        assert untyped == [], (cls.__name__, untyped)
    assert {f.name for f in dataclasses.fields(Prepared)} == {"config", "model", "rollout", "eval", "sft_stream",
                                                              "notes"}
    # Nothing on the actor side names the trainer's object (it reads its own inputs).
    for path in (PACKAGE / "rollout").glob("*.py"):
        assert "prepared" not in path.read_text().lower(), path.name


def called_names(path: Path) -> set[str]:
    """The names a module calls (`f(...)`, `x.f(...)`)."""
    calls = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            f = node.func
            calls.add(f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else "")
    return calls


def test_bench_memory_builds_the_run_through_the_runs_own_construction():
    """One construction of a run: `bench memory`'s abstract run calls `construct.build_learner` (what
    `setup.build` and the start's KV sizing call) and builds none of its pieces itself."""
    pieces = {"make_learner", "init_state", "new_state", "build_critic", "load_teacher", "run_optimizer", "init_critic"}
    bench, setup = called_names(PACKAGE / "tools/bench/abstract_run.py"), called_names(PACKAGE / "trainer/construct.py")
    assert "build_learner" in bench and bench & pieces == set(), bench & pieces
    assert {"build_learner", "make_learner", "build_critic", "load_teacher"} <= setup
    assert "build_learner" in called_names(PACKAGE / "trainer/setup.py")

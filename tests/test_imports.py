"""The package's imports only go down: each module imports its own layer and the layers below it, no modules import
each other in a circle, and none imports bench/ or tests/. Checked statically (``ast``), function-level (lazy) imports included, so a circle
hidden behind a lazy import, which Python tolerates until the wrong module is imported first, still fails here."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Low to high. A module belongs to the entry with the longest matching name (a package entry covers its submodules);
# it may import modules of its own layer and of the layers before it, never of a later one.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("foundation", ("grpo_fast.config", "grpo_fast.outputs", "grpo_fast.checks", "grpo_fast.dispatch",
                    "grpo_fast.testing", "grpo_fast.memory.models", "grpo_fast.dtypes", "grpo_fast.benchmarking",
                    "grpo_fast.helptext")),
    ("reference", ("grpo_fast.reference",)),
    # the chunked PyTorch algorithms and the Triton kernels with their launchers, and the contract of the log-prob pair
    ("implementations", ("grpo_fast.logprob_contract", "grpo_fast.logprobs_torch", "grpo_fast.loss_torch",
                         "grpo_fast.kernels")),
    # torch.library custom ops wrapping the implementations
    ("custom ops", ("grpo_fast.ops",)),
    # the public functions and the package that re-exports them; shared_prefix_forward (with the forward helpers it
    # needs) is public API too (grpo_fast re-exports it lazily)
    ("public API", ("grpo_fast", "grpo_fast.logprobs", "grpo_fast.loss", "grpo_fast.advantages", "grpo_fast.verl_losses",
                    "grpo_fast.train.forward", "grpo_fast.train.shared_prefix")),
    # subsystems the trainer builds on: the code sandbox (the code reward, the python tool) and tool-calling agents
    ("subsystems", ("grpo_fast.sandbox", "grpo_fast.agents")),
    ("applications", ("grpo_fast.train", "grpo_fast.integrations", "grpo_fast.ppo", "grpo_fast.memory",
                      "grpo_fast.doctor", "grpo_fast.bnb_layout")),
    ("command line", ("grpo_fast.cli", "grpo_fast.__main__")),
)


def _module_files() -> dict[str, Path]:
    """Module name -> file, for the package and its kernels (installed as ``grpo_fast.kernels``)."""
    files = {}
    for base, prefix in ((ROOT / "grpo_fast", ("grpo_fast",)), (ROOT / "kernels", ("grpo_fast", "kernels"))):
        for path in sorted(base.rglob("*.py")):
            parts = prefix + path.relative_to(base).with_suffix("").parts
            files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return files


def _imported_names(name: str, path: Path, modules: set[str]) -> set[str]:
    """Every module name ``name`` imports anywhere in its file (module level, in functions, under ``if``); for
    ``from X import Y`` that is ``X.Y`` where that is a module of the package, else ``X``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolved against this module's package
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:  # `from grpo_fast import checks` imports the module grpo_fast.checks
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    return found


def _imports(name: str, path: Path, modules: set[str]) -> set[str]:
    """The package modules ``name`` imports."""
    return {m for m in _imported_names(name, path, modules) if m in modules and m != name}


def _layer(name: str) -> int:
    best = None
    for rank, (_, entries) in enumerate(LAYERS):
        for entry in entries:
            # an entry covers its subpackages, except the root package: each of its modules must be listed
            covers = name == entry or (entry != "grpo_fast" and name.startswith(entry + "."))
            if covers and (best is None or len(entry) > len(best[1])):
                best = (rank, entry)
    if best is None:
        raise AssertionError(f"{name} is in no layer of tests/test_imports.py's LAYERS: add it there")
    return best[0]


def _graph() -> dict[str, set[str]]:
    files = _module_files()
    return {name: _imports(name, path, set(files)) for name, path in files.items()}


def test_every_module_has_a_layer():
    for name in _graph():
        _layer(name)


def test_the_package_never_imports_the_benchmarks_or_the_tests():
    # bench/ is not installed: the commands that need it load it from a source checkout (grpo_fast.memory.source_module)
    files = _module_files()
    found = [f"{name} imports {m}" for name, path in sorted(files.items())
             for m in sorted(_imported_names(name, path, set(files))) if m.split(".")[0] in ("bench", "tests")]
    assert not found, "\n".join(found)


def test_no_module_imports_a_layer_above_its_own():
    upward = [
        f"{name} ({LAYERS[_layer(name)][0]}) imports {dep} ({LAYERS[_layer(dep)][0]})"
        for name, deps in sorted(_graph().items()) for dep in sorted(deps) if _layer(dep) > _layer(name)
    ]
    assert not upward, "imports that go up a layer:\n" + "\n".join(upward)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    cycles = _cycles(_graph())
    assert not cycles, "modules that import each other in a circle: " + "; ".join(" <-> ".join(c) for c in cycles)


@pytest.mark.parametrize("source, circle", [
    ("a -> b, b -> a", ["a", "b"]),
    ("a -> b, b -> c, c -> a, c -> d", ["a", "b", "c"]),
])
def test_the_cycle_finder_finds_circles(source, circle):
    graph = {}
    for edge in source.split(", "):
        u, v = edge.split(" -> ")
        graph.setdefault(u, set()).add(v)
        graph.setdefault(v, set())
    assert _cycles(graph) == [circle]
    assert _cycles({k: set() for k in graph}) == []


def test_lazy_and_from_package_imports_are_seen(tmp_path):
    # a function-level import of a module above is what both removed circles looked like
    path = tmp_path / "mod.py"
    path.write_text("import os\nfrom grpo_fast import checks\n\ndef f():\n    from grpo_fast.cli import main\n"
                    "    import bench.harness\n")
    modules = {"grpo_fast", "grpo_fast.checks", "grpo_fast.cli"}
    assert _imports("grpo_fast.mod", path, modules) == {"grpo_fast.checks", "grpo_fast.cli"}
    assert "bench.harness" in _imported_names("grpo_fast.mod", path, modules)

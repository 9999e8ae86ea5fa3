"""The project's modules import each other without cycles, amp_core/hardware never import torch,
and the application rooms (demo, benchmarks, device_check) import only the library and
``workbench``, which imports no room.

Every import counts (module level, function level, ``TYPE_CHECKING`` blocks): a cycle hidden in
a function body is still a cycle a reader has to untangle. ``from package import name`` is an
edge to the submodule ``package.name`` when there is one, else to the package; edges to a
package's ``__init__`` from its own submodules are not counted (the ``__init__`` is the public
face that re-exports them).
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = (
    "amp_core",
    "torch_facade",
    "hardware",
    "workbench",
    "demo",
    "benchmarks",
    "device_check",
)

LIBRARY = ("amp_core", "torch_facade", "hardware")
ROOMS = ("demo", "benchmarks", "device_check")
ALLOWED_TOP_LEVEL_EDGES = {
    "demo": {*LIBRARY, "workbench"},
    "benchmarks": {*LIBRARY, "workbench"},
    "device_check": {*LIBRARY, "workbench"},
    "workbench": set(LIBRARY),
}
"""Which of the project's top-level packages each room (and ``workbench``) may import; an edge
inside one package is always allowed. The library's own layering is not checked here."""


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            found[module_name(path)] = path
    return found


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                targets.add(submodule if submodule in known else base)
    edges = set()
    for target in targets:
        while target and target not in known:
            target = target.rpartition(".")[0]
        if target and target != name and not name.startswith(target + "."):
            edges.add(target)
    return edges


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of ``graph`` as a list of nodes (first == last), or ``None``."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def forbidden_edges(graph: dict[str, set[str]], allowed: dict[str, set[str]]) -> list[str]:
    """``"a.x -> b.y"`` for every edge of ``graph`` from a top-level package named in ``allowed``
    to another top-level package that ``allowed`` does not list for it, sorted."""
    found = []
    for source, targets in graph.items():
        top = source.split(".")[0]
        if top not in allowed:
            continue
        for target in targets:
            target_top = target.split(".")[0]
            if target_top != top and target_top not in allowed[top]:
                found.append(f"{source} -> {target}")
    return sorted(found)


def test_forbidden_edges_finds_a_planted_room_to_room_import():
    graph = {
        "demo.cli": {"demo.rows", "workbench.tables", "amp_core"},
        "benchmarks.cbfloat16_bench": {"demo.jax_door", "workbench.byte_gpt_jax"},
        "device_check.report": {"benchmarks.report"},
        "workbench.tables": {"device_check.check", "torch_facade"},
        "amp_core.scaling": {"demo.rows"},  # not a room: not this test's business
    }
    assert forbidden_edges(graph, ALLOWED_TOP_LEVEL_EDGES) == [
        "benchmarks.cbfloat16_bench -> demo.jax_door",
        "device_check.report -> benchmarks.report",
        "workbench.tables -> device_check.check",
    ]
    clean = {"demo.cli": {"workbench.tables"}, "workbench.tables": {"hardware.formats"}}
    assert forbidden_edges(clean, ALLOWED_TOP_LEVEL_EDGES) == []


def test_rooms_import_only_the_library_and_workbench_which_imports_no_room():
    known = project_modules()
    assert "workbench.tables" in known and "device_check.report" in known
    graph = {name: imports_of(name, path, known) for name, path in known.items()}
    assert "workbench.tables" in graph["device_check.report"]  # the edges are seen
    assert set(ALLOWED_TOP_LEVEL_EDGES) == {*ROOMS, "workbench"}
    assert forbidden_edges(graph, ALLOWED_TOP_LEVEL_EDGES) == []


def test_only_workbench_internals_imports_private_library_names():
    """The rooms reach the library's underscore modules and names through one module."""
    known = project_modules()
    found = []
    for name, path in known.items():
        if name.split(".")[0] not in (*ROOMS, "workbench") or name == "workbench.internals":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            modules, names = [], []
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                modules, names = [node.module], [alias.name for alias in node.names]
            for module in modules:
                if module.split(".")[0] not in LIBRARY:
                    continue
                private = [p for p in module.split(".") + names if p.startswith("_")]
                if private:
                    found.append(f"{name}: {module} {private}")
    assert found == [], found


def test_find_cycle_finds_one_and_only_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_the_project_has_no_import_cycles():
    known = project_modules()
    assert "torch_facade.amp.grad_scaler" in known and "demo.rows" in known
    graph = {name: imports_of(name, path, known) for name, path in known.items()}
    assert "torch_facade.amp.diagnostics" in graph["torch_facade.amp.grad_scaler"]
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


def test_amp_core_and_hardware_never_import_torch():
    known = project_modules()
    for name, path in known.items():
        if name.split(".")[0] not in ("amp_core", "hardware"):
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            assert not any(n == "torch" or n.startswith("torch.") for n in names), name


ENGINE = "torch_facade.amp._engine"
# What the engine may import of the facade outside itself: private helpers that import no
# public module (the caller's frame, torch.compile's host side, folder checks, the half dtype).
ENGINE_MAY_IMPORT = {
    "torch_facade.amp._caller",
    "torch_facade.amp._half_state",
    "torch_facade.amp._host_side",
    "torch_facade.amp._trusted_folder",
}


def facade_layer_violations(graph: dict[str, set[str]]) -> list[str]:
    """Edges that break the facade's two floors: a public module (``torch_facade.amp.x``)
    reaching into an engine submodule instead of the engine's ``__init__``, and the engine
    importing anything of the facade but itself and :data:`ENGINE_MAY_IMPORT`."""
    found = []
    for name, targets in graph.items():
        in_engine = name == ENGINE or name.startswith(ENGINE + ".")
        for target in targets:
            target_in_engine = target.startswith(ENGINE + ".")
            if not in_engine and target_in_engine and name.startswith("torch_facade"):
                found.append(f"{name} -> {target} (use {ENGINE}'s re-exports)")
            if (
                in_engine
                and target.startswith("torch_facade")
                and target != ENGINE
                and not target_in_engine
                and target not in ENGINE_MAY_IMPORT
            ):
                found.append(f"{name} -> {target} (the engine never imports the public modules)")
    return sorted(found)


def test_the_facade_layer_check_finds_planted_violations():
    graph = {
        "torch_facade.amp.grad_scaler": {"torch_facade.amp._engine._decision"},
        "torch_facade.amp._engine._decision": {"torch_facade.amp.diagnostics"},
        "torch_facade.amp.diagnostics": {ENGINE, "torch_facade.amp._caller"},
        "torch_facade.amp._engine._cores": {"torch_facade.amp._caller", "amp_core"},
    }
    assert facade_layer_violations(graph) == [
        "torch_facade.amp._engine._decision -> torch_facade.amp.diagnostics (the engine never "
        "imports the public modules)",
        f"torch_facade.amp.grad_scaler -> torch_facade.amp._engine._decision (use {ENGINE}'s "
        "re-exports)",
    ]


def test_public_facade_modules_use_only_the_engines_lid():
    known = project_modules()
    graph = {name: imports_of(name, path, known) for name, path in known.items()}
    assert graph["torch_facade.amp.grad_scaler"] >= {ENGINE}
    assert facade_layer_violations(graph) == []

"""No import cycle among pipecomm's modules, found by parsing their sources."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pipecomm

PACKAGE_ROOT = Path(pipecomm.__file__).parent


def _module_names() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its ``__init__``), the native extension too."""
    modules = {}
    for path in [*PACKAGE_ROOT.rglob("*.py"), *PACKAGE_ROOT.rglob("*.so")]:
        relative = path.relative_to(PACKAGE_ROOT)
        parts = ("pipecomm", *relative.parent.parts, relative.name.split(".")[0])
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(nodes):
    """Every import statement among ``nodes`` and inside them, in functions too (a deferred import only hides a
    cycle), except those under ``if TYPE_CHECKING:``, which never run."""
    for node in nodes:
        if isinstance(node, ast.If) and _is_type_checking(node):
            yield from _imports(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        yield from _imports(ast.iter_child_nodes(node))


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool, modules) -> set[str]:
    """The package's modules that ``node`` (in ``module``) loads, by their dotted names."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names if alias.name in modules}
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    found = set()
    for alias in node.names:
        submodule = f"{source}.{alias.name}"
        if submodule in modules:
            found.add(submodule)  # ``from pipecomm import boundary`` loads boundary
        elif source in modules:
            found.add(source)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = _module_names()
    graph = {}
    for name, path in modules.items():
        if path.suffix != ".py":
            graph[name] = set()  # the extension imports nothing of the package
            continue
        is_package = path.name == "__init__.py"
        edges = set()
        # Only explicit imports: that a submodule's import runs its parents' __init__ first is every module's lot.
        for node in _imports(ast.parse(path.read_text(), str(path)).body):
            edges |= _targets(node, name, is_package, modules)
        graph[name] = edges - {name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as its modules in order, the first repeated at the end; None if there is none."""
    state: dict[str, str] = {}  # "open" while on the path, "done" once fully explored
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == "open":
                return path[path.index(target):] + [target]
            if target not in state:
                cycle = visit(target)
                if cycle:
                    return cycle
        path.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_the_graph_sees_the_package():
    graph = import_graph()
    assert "pipecomm.pipeline" in graph["pipecomm"]
    assert "pipecomm.schedules.schedule" in graph["pipecomm.schedules.planner"]


def test_find_cycle_reports_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle_in_pipecomm():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_importing_pipecomm_leaves_the_excepthook_and_exit_handlers_alone():
    # The fail-fast hooks are the first Pipeline's to install: importing the library changes nothing of the process.
    script = ("import atexit, sys, torch, torch.distributed; before = atexit._ncallbacks(); import pipecomm; "
              "assert sys.excepthook is sys.__excepthook__, sys.excepthook; "
              "assert atexit._ncallbacks() == before, atexit._ncallbacks()")
    completed = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert completed.returncode == 0, completed.stderr[-2000:]


def test_schedules_import_no_torch():
    # Schedules are data: planning and simulating one needs numpy (and numba, when installed), never torch.
    for path in sorted((PACKAGE_ROOT / "schedules").glob("*.py")):
        for node in _imports(ast.parse(path.read_text(), str(path)).body):
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            outside = [name for name in names if name.split(".")[0] == "torch"
                       or (name.startswith("pipecomm") and not name.startswith("pipecomm.schedules"))]
            assert not outside, f"{path.relative_to(PACKAGE_ROOT)} imports {outside}"


def test_every_module_says_what_it_is_for():
    for path in sorted(PACKAGE_ROOT.rglob("*.py")):
        docstring = ast.get_docstring(ast.parse(path.read_text(), str(path)))
        assert docstring and docstring.strip(), f"{path.relative_to(PACKAGE_ROOT)} has no docstring"

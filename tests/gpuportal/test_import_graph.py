"""The shape of the code. No import cycle anywhere in the project: every module's
imports, at the top or inside functions, form a graph without a cycle. The control plane's
services are layered (queueing below replicas, below failover, below deployments, below sleep and
preemption, below requests, and the reports on top), and the data plane's modules likewise.
Imports under `if TYPE_CHECKING:` never run and are not counted. And every row lock goes through
scheduling/locks.py, which holds the one lock order."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("gpuportal", "scheduling", "inference")


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            if "migrations" in path.parts:
                continue
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def _type_checking_only(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imported_names(tree: ast.AST) -> list[str]:
    """Dotted names a module imports when it runs (a `from a import b` names a.b and a)."""
    names: list[str] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _type_checking_only(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.extend([node.module, *(f"{node.module}.{alias.name}" for alias in node.names)])
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return names


def import_graph() -> dict[str, set[str]]:
    known = modules()

    def owner(name: str) -> str | None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in known.items():
        targets = {owner(imported) for imported in imported_names(ast.parse(path.read_text()))}
        # A package's own __init__ is imported with any of its modules: not an edge of the module's.
        graph[name] = {t for t in targets if t and t != name and not name.startswith(f"{t}.")}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in sorted(graph.get(node, ())):
            if successor not in index:
                connect(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return found


def test_the_project_has_no_import_cycle():
    graph = import_graph()
    found = cycles(graph)
    described = [
        " ⇄ ".join(component)
        + ": "
        + "; ".join(f"{a} → {b}" for a in component for b in sorted(graph[a] & set(component)))
        for component in found
    ]
    assert found == [], "\n".join(described)


def test_the_cycle_check_finds_a_cycle_through_an_import_inside_a_function():
    tree = ast.parse("import x.top\n\ndef later():\n    from y.inner import thing\n\nif TYPE_CHECKING:\n    import z\n")
    assert imported_names(tree) == ["x.top", "y.inner", "y.inner.thing"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_every_row_lock_is_taken_through_the_lock_module():
    # The one lock order is scheduling/locks.py's; a select_for_update elsewhere would
    # be a lock the order does not know of (the ledger's commit function takes GPU rows in SQL).
    offenders = [
        f"{path.relative_to(ROOT)}:{number}"
        for name, path in modules().items()
        if name != "scheduling.locks"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if "select_for_update" in line
    ]
    assert offenders == []


def test_the_planes_import_only_the_wire_never_each_other():
    # The control plane (scheduling) and the data plane (inference) share only
    # gpuportal.wire: the agent's calls, the commands and a deploy's question about a model's files
    # go as tasks on queues (scheduling.services.dispatch one way, inference.gateway the other).
    graph = import_graph()
    crossings = {
        (module, target)
        for module, targets in graph.items()
        for target in targets
        for a, b in (("scheduling", "inference"), ("inference", "scheduling"))
        if module.split(".")[0] == a and target.split(".")[0] == b
    }
    assert crossings == set()
    wire = {module: targets for module, targets in graph.items() if module.startswith("gpuportal.wire")}
    assert all(target.startswith("gpuportal.wire") for targets in wire.values() for target in targets), wire

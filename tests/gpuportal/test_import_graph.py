"""The shape of the code. No import cycle anywhere in the project: every module's
imports, at the top, inside functions or under `if TYPE_CHECKING:` (a cycle a type checker walks is
still a knot for the reader), form a graph without a cycle. The control plane's services are
layered (queueing below replicas, below failover, below deployments, below sleep and preemption,
below requests, and the reports on top), and the data plane's modules likewise. The two planes
share only the contract, which imports neither and no Django; the project package imports a plane
only where it wires URLs and commands; the pure decisions import no Django. And every row lock goes
through scheduling/locks.py, which holds the one lock order."""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("gpuportal", "scheduling", "inference", "bench")
PLANES = ("scheduling", "inference")
DJANGO = ("django", "rest_framework", "drf_spectacular", "django_celery_beat", "celery")


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            if "migrations" in path.parts:
                continue
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def imported_names(tree: ast.AST) -> list[str]:
    """Dotted names a module imports, wherever it does (a `from a import b` names a.b and a)."""
    names: list[str] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.extend([node.module, *(f"{node.module}.{alias.name}" for alias in node.names)])
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return names


def import_graph() -> dict[str, set[str]]:
    """Each module's edges, a copy of its own for the caller."""
    return {name: set(targets) for name, targets in _parsed_graph().items()}


@functools.cache
def _parsed_graph() -> dict[str, set[str]]:
    # Parsing every module is most of these tests' time: once per test process.
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
    assert imported_names(tree) == ["x.top", "y.inner", "y.inner.thing", "z"]
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


def test_the_contract_imports_no_plane_and_no_django():
    # gpuportal.wire is what a replica process imports with no Django configured: the state
    # machine, the commands, the queue protocol.
    for name, path in modules().items():
        if name.startswith("gpuportal.wire"):
            imported = {n.split(".")[0] for n in imported_names(ast.parse(path.read_text()))}
            assert not imported & {*PLANES, *DJANGO}, f"{name} imports {sorted(imported & {*PLANES, *DJANGO})}"


# Where the project package may name a plane: the URLs it routes to the planes' views, the
# commands that start a plane's processes, and the test suite's plugin (it declares virtual GPUs).
WIRING = ("gpuportal.urls", "gpuportal.management.commands.", "gpuportal.testing.")


def test_the_project_package_imports_a_plane_only_where_it_wires_them():
    graph = import_graph()
    back_edges = sorted(
        (module, target)
        for module, targets in graph.items()
        if module.startswith("gpuportal") and not module.startswith(WIRING)
        for target in targets
        if target.split(".")[0] in PLANES
    )
    assert back_edges == []


# The decisions: pure functions over dataclasses, which hypothesis tests and the simulator runs.
PURE = ("scheduling.core", "scheduling.simulation")


def test_the_pure_decisions_reach_no_django_through_any_import():
    graph, known = import_graph(), modules()
    reached: dict[str, list[str]] = {}
    for start in (m for m in known if m.startswith(PURE)):
        seen, todo = {start}, [start]
        while todo:
            module = todo.pop()
            direct = {n.split(".")[0] for n in imported_names(ast.parse(known[module].read_text()))}
            if direct & set(DJANGO):
                reached.setdefault(start, []).append(module)
            todo.extend(t for t in graph.get(module, ()) if t not in seen and not seen.add(t))
    assert reached == {}


# SQL as a statement's text: DML, a row lock, or a function call read back.
SQL = re.compile(
    r"\b(SELECT\s.+\bFROM\b|SELECT\s+\w+\(|SELECT\s+1\b|INSERT\s+INTO\b|UPDATE\s+\w+\s.*\bSET\b|DELETE\s+FROM\b"
    r"|FOR\s+UPDATE\b|CREATE\s+DATABASE\b|ALTER\s+ROLE\b)",
    re.S,
)
# Where SQL may be written in Python: the lock order, the ledger and the statement runner (whose
# hand-written statements are .sql files under scheduling/sql/), and the embedded server's set-up
# and probe.
SQL_HOMES = (
    "scheduling.locks",
    "scheduling.ledger",
    "scheduling.hot_sql",
    "gpuportal.stack",
    "gpuportal.health",
)


def sql_strings_in(source: str) -> list[int]:
    return [
        node.lineno
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and SQL.search(node.value)
    ]


def test_no_sql_is_written_outside_the_locks_the_ledger_and_sql_files():
    offenders = [
        f"{name}:{line}"
        for name, path in modules().items()
        if not name.startswith(("bench", *SQL_HOMES))
        for line in sql_strings_in(path.read_text())
    ]
    assert offenders == []


def test_the_sql_check_finds_statements_and_leaves_prose_alone():
    assert sql_strings_in('q = "UPDATE scheduling_replica SET state = %s WHERE id = %s"')
    assert sql_strings_in('q = "SELECT id FROM scheduling_gpu ORDER BY id FOR UPDATE"')
    assert not sql_strings_in('reason = "select a victim from the GPU, then update its books"')


# What the planes borrow from the project package besides the contract: the Celery app, the API's
# authentication and sign-in throttle, the look-ups the request path remembers, the process
# helpers (and how an orphaned replica ended, which `up` records for its adopter), and the
# database backend of an agent that has none. Nothing that starts servers.
BORROWED = (
    "gpuportal",
    "gpuportal.celery",
    "gpuportal.auth",
    "gpuportal.throttle",
    "gpuportal.remembered",
    "gpuportal.processes",
    "gpuportal.orphans",
    "gpuportal.no_database.base",
)


def test_the_planes_borrow_from_the_project_package_only_its_shared_helpers():
    borrowed = {
        (module, target)
        for module, targets in import_graph().items()
        if module.split(".")[0] in PLANES
        for target in targets
        if target.split(".")[0] == "gpuportal" and not target.startswith("gpuportal.wire") and target not in BORROWED
    }
    assert borrowed == set()

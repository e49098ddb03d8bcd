"""One state machine: a replica's states, their groups and transitions live in gpuportal.wire.states
alone. Every other module imports them (no state name written as a string where a state is
meant), a change the table does not allow is refused with nothing written, an API call that asks
for one gets a 409 naming both states, and the diagram in the docs is the table's."""

from __future__ import annotations

import ast
import itertools
import re
from pathlib import Path

import pytest

from gpuportal.wire import states
from gpuportal.wire.states import ReplicaState

ROOT = Path(__file__).resolve().parents[2]
CODE = ("gpuportal", "scheduling", "inference", "bench")
STATE_MODULE = ROOT / "gpuportal" / "wire" / "states.py"
NAMES = {s.value for s in ReplicaState}


def _mentions_state(node: ast.AST) -> bool:
    """An expression that reads a state: `x.state`, `state`, `r["state"]`, `r.get("state")`."""
    if isinstance(node, ast.Name):
        return "state" in node.id.lower()
    if isinstance(node, ast.Attribute):
        return "state" in node.attr.lower()
    if isinstance(node, ast.Subscript):
        key = node.slice
        return isinstance(key, ast.Constant) and isinstance(key.value, str) and "state" in key.value
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
        first = node.args[0] if node.args else None
        return isinstance(first, ast.Constant) and isinstance(first.value, str) and "state" in first.value
    return False


def _state_literals(node: ast.AST | None) -> list[ast.Constant]:
    """String constants naming a replica state, in `node` itself or one collection deep."""
    if isinstance(node, ast.Constant) and node.value in NAMES:
        return [node]
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in {"frozenset", "set", "tuple"}:
        return [c for arg in node.args for c in _state_literals(arg)]
    if isinstance(node, ast.Set | ast.Tuple | ast.List):
        return [e for e in node.elts if isinstance(e, ast.Constant) and e.value in NAMES]
    return []


def _is_grouping(node: ast.AST) -> bool:
    """A hand-kept group of states: a collection of two or more constants, each a state name."""
    if isinstance(node, ast.Dict):
        elts: list = node.keys
    else:
        elts = node.elts if isinstance(node, ast.Set | ast.Tuple | ast.List) else []
    return len(elts) >= 2 and all(isinstance(e, ast.Constant) and e.value in NAMES for e in elts)


def state_literals_in(source: str) -> list[tuple[int, str]]:
    """(line, name) of every place `source` writes a replica state as a string where a state is
    meant: compared with a state, passed or stored as one, or kept in a group of states."""
    found: list[ast.Constant] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if any(_mentions_state(o) for o in operands):
                found.extend(c for o in operands for c in _state_literals(o))
        elif isinstance(node, ast.keyword) and node.arg and "state" in node.arg:
            found.extend(_state_literals(node.value))
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(_mentions_state(t) for t in targets):
                found.extend(_state_literals(node.value))
        elif isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values, strict=True):
                if isinstance(key, ast.Constant) and isinstance(key.value, str) and "state" in key.value:
                    found.extend(_state_literals(value))
            if _is_grouping(node):
                found.extend(node.keys)  # type: ignore[arg-type]
        elif isinstance(node, ast.Set | ast.Tuple | ast.List) and _is_grouping(node):
            found.extend(node.elts)  # type: ignore[arg-type]
    return sorted({(c.lineno, c.value) for c in found})


def code_files() -> list[Path]:
    return [
        path
        for package in CODE
        for path in sorted((ROOT / package).rglob("*.py"))
        if "migrations" not in path.parts and path != STATE_MODULE
    ]


def test_no_module_but_the_state_module_writes_a_replica_state_as_a_literal():
    offenders = [
        f"{path.relative_to(ROOT)}:{line}: {name!r}"
        for path in code_files()
        for line, name in state_literals_in(path.read_text())
    ]
    assert not offenders, "import the state from gpuportal.wire.states:\n" + "\n".join(offenders)


@pytest.mark.parametrize(
    "source",
    [
        'if replica.state == "serving": pass',
        'ok = r.get("state") in ("pending", "loading")',
        'Replica.objects.filter(state="sleeping")',
        'self.state = "draining"',
        'AWAKE = frozenset({"pending", "waking"})',
        'COLOURS = {"serving": "green", "failed": "red"}',
        'event = {"state": "stopped"}',
    ],
)
def test_the_literal_check_catches_each_way_a_state_is_written(source):
    assert state_literals_in(source), source


@pytest.mark.parametrize(
    "source",
    [
        'emit("serving", pid=1)',  # an event's name on the wire, not a state
        'if event["event"] == "failed": pass',
        'if request.status == "failed": pass',
        'phase = "loading weights"',
    ],
)
def test_the_literal_check_leaves_other_strings_alone(source):
    assert not state_literals_in(source), source


def test_every_state_has_its_transitions_and_the_ended_ones_lead_nowhere_but_stopped():
    assert set(states.TRANSITIONS) == set(ReplicaState)
    for before, afters in states.TRANSITIONS.items():
        assert before not in afters, "staying put needs no entry"
    assert states.TRANSITIONS[ReplicaState.STOPPED] == frozenset()
    assert states.TRANSITIONS[ReplicaState.FAILED] <= {ReplicaState.STOPPING, ReplicaState.STOPPED}
    for state in ReplicaState:
        assert states.allowed(state, state), "a report said again changes nothing"
        if state not in states.ENDED:
            assert states.allowed(state, ReplicaState.STOPPED), f"{state}: a process may always exit"


def test_a_transition_outside_the_table_raises_naming_both_states():
    with pytest.raises(states.IllegalTransition, match="from stopped to serving"):
        states.check(ReplicaState.STOPPED, ReplicaState.SERVING)
    with pytest.raises(states.IllegalTransition, match="from sleeping to serving"):
        states.check(ReplicaState.SLEEPING, ReplicaState.SERVING)
    states.check(ReplicaState.SERVING, ReplicaState.DRAINING)


def test_the_groups_are_made_of_states_and_nest_as_named():
    assert states.STARTING < states.AWAKE < states.ACTIVE < states.COUNTED
    assert states.ENDED < states.GONE
    assert not states.AWAKE & states.GONE
    assert set(states.DISPLAY_ORDER) == set(ReplicaState)
    assert set(states.AWAKE_NEAREST_FIRST) == states.AWAKE


def test_the_state_diagram_in_the_docs_is_drawn_from_the_table():
    text = (ROOT / "docs" / "architecture.md").read_text()
    drawn = re.search(r"<!-- state-diagram:begin -->\n```mermaid\n(.*?)```\n<!-- state-diagram:end -->", text, re.S)
    assert drawn, "docs/architecture.md holds the diagram between its state-diagram markers"
    assert drawn.group(1) == states.mermaid(), "run `python -m gpuportal.wire.states --write-docs`"
    for before, afters in states.TRANSITIONS.items():
        for after in afters:
            assert f"    {before} --> {after}\n" in drawn.group(1)


@pytest.mark.django_db
def test_a_refused_change_writes_nothing_and_records_no_event():
    from scheduling.models import Event, Replica
    from scheduling.services import replicas
    from scheduling.services.errors import TransitionRefused
    from tests.support import factories

    ended = factories.replica(factories.deployment(), on=factories.node(), state=ReplicaState.STOPPED)
    with pytest.raises(TransitionRefused, match="is stopped: it cannot become serving"):
        replicas.set_state(ended, ReplicaState.SERVING, "a report from a process the books wrote off")
    assert Replica.objects.get(pk=ended.pk).state == ReplicaState.STOPPED
    assert not Event.objects.filter(replica=ended.id).exists()


@pytest.mark.django_db
def test_a_batch_with_one_refused_change_changes_none_of_its_replicas():
    from scheduling.models import Replica
    from scheduling.services import replicas
    from scheduling.services.errors import TransitionRefused
    from tests.support import factories

    deployment, node = factories.deployment(), factories.node()
    serving = factories.replica(deployment, on=node, state=ReplicaState.SERVING)
    stopped = factories.replica(deployment, on=node, state=ReplicaState.STOPPED)
    batch = [
        replicas.KnownReplica(r.id, r.state, node.name, deployment, "test") for r in sorted([serving, stopped], key=str)
    ]
    with pytest.raises(TransitionRefused, match="is stopped: it cannot become stopping"):
        replicas.set_states_of(batch, ReplicaState.STOPPING)
    assert dict(Replica.objects.values_list("id", "state")) == {
        serving.id: ReplicaState.SERVING,
        stopped.id: ReplicaState.STOPPED,
    }


def test_an_api_call_asking_for_a_change_the_table_refuses_gets_a_409_naming_both_states(cluster, api, tiny_model_dir):
    from scheduling.models import Replica
    from tests.support.deployments import body, serve

    assert api("post", "/api/deployments/", body("tiny-a", tiny_model_dir)).status_code == 201
    replica = Replica.objects.get()

    response = api("post", f"/api/replicas/{replica.id}/sleep/")
    assert response.status_code == 409
    assert response.json()["state"] == "pending" and response.json()["wanted"] == "draining"
    assert "is pending: it cannot become draining" in response.json()["detail"]
    serve(replica.id)
    response = api("post", f"/api/replicas/{replica.id}/wake/")
    assert response.status_code == 409
    assert (response.json()["state"], response.json()["wanted"]) == ("serving", "waking")
    assert Replica.objects.get(pk=replica.pk).state == ReplicaState.SERVING


def test_every_state_is_shown_by_the_cli_and_every_one_holding_memory_by_the_dashboard():
    # A new state gets its colour and its place here, or this fails: nothing falls back silently.
    from gpuportal.cli.render import STATE_STYLES
    from scheduling.web.dashboard import SEGMENT_OF_STATE

    assert set(STATE_STYLES) == set(ReplicaState)
    # A deep sleeper holds host memory alone: no GPU bar shows it.
    holding_memory = (states.ACTIVE | states.IN_HOST_CACHE | {ReplicaState.STOPPING}) - {ReplicaState.DEEP_SLEEPING}
    assert set(SEGMENT_OF_STATE) == holding_memory


@pytest.mark.django_db(transaction=True)
def test_a_report_the_table_refuses_changes_nothing_and_raises_nothing():
    # A process is behind its books (its sleep crossed the stop the control plane sent): what it
    # says is dropped whole, the ledger's part with it, rather than failing the agent's call.
    from scheduling.models import Event, Occupant, Replica
    from scheduling.services import reports
    from tests.support import factories

    node = factories.node()
    gpu = factories.gpu(node)
    stopping = factories.replica(factories.deployment(), on=node, state=ReplicaState.STOPPING)
    factories.occupy(stopping, gpu, 100)
    reports.report(stopping.id, {"event": "sleeping", "residual_bytes_by_id": {"0": 7}})
    assert Replica.objects.get(pk=stopping.pk).state == ReplicaState.STOPPING
    assert list(Occupant.objects.values_list("reserved_bytes", flat=True)) == [100]
    assert not Event.objects.filter(replica=stopping.id).exists()


def test_a_failover_member_goes_through_its_takeover_in_order_and_never_comes_back_from_dead():
    from gpuportal.wire.states import FAILOVER_TRANSITIONS, FailoverState, failover_allowed

    assert set(FAILOVER_TRANSITIONS) == set(FailoverState)
    takeover = ["", "init", "standby", "waking", "active", "dead"]
    assert all(failover_allowed(a, b) for a, b in itertools.pairwise(takeover))
    assert not failover_allowed("dead", "active")
    assert not failover_allowed("active", "standby")
    assert all(failover_allowed(s, "dead") for s in FailoverState)


@pytest.mark.django_db
def test_a_refused_failover_state_is_not_written():
    from scheduling.models import Event, Replica
    from scheduling.services import failover
    from scheduling.services.errors import TransitionRefused
    from tests.support import factories

    member = factories.replica(factories.deployment(), on=factories.node(), failover_state="dead")
    with pytest.raises(TransitionRefused, match="failover dead: it cannot become failover active"):
        failover.set_failover_state(member, "active", "a report from a member whose lock passed on")
    assert Replica.objects.get(pk=member.pk).failover_state == "dead"
    assert not Event.objects.filter(replica=member.id).exists()

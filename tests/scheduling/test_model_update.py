"""A deployment's model changed in place: a PATCH of `model.source` (or `model.dtype`) reads the new
model as a deploy does, and rolls every replica onto it one at a time (a rolling restart), its
sleepers parked at once so that no wake serves the old model; the deployment keeps its name, so
its clients and its `/v1` model id are unchanged. The services run against the test's PostgreSQL on
virtual GPUs with no processes: each replica's reports are made by hand."""

from __future__ import annotations

import pytest

from inference.management.commands.make_tiny_model import write_tiny_model
from scheduling.core.rollout import Action
from scheduling.models import Deployment, DeploymentObserved, Event, Replica
from scheduling.services import reports, rollouts, sleep
from tests.support.deployments import START, body, invariant_holds, serve
from tests.support.pairs import serves_at, stands_by

pytestmark = pytest.mark.django_db


@pytest.fixture(scope="module")
def second_model(tmp_path_factory):
    """Another model than `tiny_model_dir`'s: other weights, another size."""
    return write_tiny_model(tmp_path_factory.mktemp("v2") / "tiny-v2", size_mb=1, seed=9).path


def live(name: str) -> dict[str, str]:
    rows = Replica.objects.filter(deployment__name=name).exclude(state__in=["stopped", "failed"])
    return dict(rows.order_by("created_at").values_list("id", "state"))


@pytest.fixture
def started(dispatched, monkeypatch) -> dict[str, str]:
    """The model each start command sent to a node agent names, by replica, as the agent reads
    the command: what the replica's process loads."""
    from gpuportal.celery import app
    from gpuportal.wire import commands

    seen: dict[str, str] = {}
    send = app.send_task

    def record(name, args=None, queue=None, **kw):
        if name in commands.TASKS.values():
            command = commands.decode(args[0])
            if isinstance(command, commands.StartReplica):
                seen[command.replica_id] = command.spec.source
        return send(name, args=args, queue=queue, **kw)

    monkeypatch.setattr(app, "send_task", record)
    return seen


def test_a_new_model_source_is_rolled_onto_every_replica_one_at_a_time(
    cluster, api, dispatched, started, tiny_model_dir, second_model, django_capture_on_commit_callbacks
):
    assert api("post", "/api/deployments/", body("m", tiny_model_dir, replicas=2)).status_code == 201
    first, second = live("m")
    serve(first), serve(second)
    weights_before = DeploymentObserved.objects.get(deployment__name="m").weight_bytes
    dispatched.clear()

    answer = api("patch", "/api/deployments/m/", {"model": {"source": str(second_model)}})

    assert answer.status_code == 200, answer.json()
    shown = answer.json()
    assert shown["name"] == "m" and shown["model"]["source"] == str(second_model)
    assert shown["rollout"]["left"] == 2, "both replicas run the old model"
    observed = DeploymentObserved.objects.get(deployment__name="m")
    assert observed.weight_bytes != weights_before, "the new model was read, as at a deploy"
    reasons = list(Event.objects.filter(deployment="m").values_list("reason", flat=True))
    assert any(
        r.startswith(
            f"settings changed by ops: model.source '{tiny_model_dir}' → '{second_model}' (every replica rolled"
        )
        for r in reasons
    ), reasons
    assert "rolling restart for the new model.source: 2 replica(s) to replace, one at a time" in reasons
    # Its first step is taken at once, as a restart's: a surge beside the two, which serve on.
    (surge,) = [r for r in live("m") if r not in (first, second)]
    assert live("m") == {first: "serving", second: "serving", surge: "pending"}
    assert [(t, a[0]) for _, t, a in dispatched if t == START] == [(START, surge)]

    # The next steps, as the beat or a replacement's report takes them: each runs the new model.
    assert rollouts.advance("m").action == Action.WAIT
    assert started[surge] == str(second_model)
    serve(surge)
    with django_capture_on_commit_callbacks(execute=True):  # its commands sent, as after a commit
        assert rollouts.advance("m").action == Action.WAIT  # the first stopped, the next surge placed
    assert live("m")[first] == "stopping"
    (surge2,) = [r for r in live("m") if r not in (first, second, surge)]
    assert started[surge2] == str(second_model)
    serve(surge2)
    assert rollouts.advance("m").action == Action.DONE

    assert live("m") == {first: "stopping", second: "stopping", surge: "serving", surge2: "serving"}
    assert api("get", "/api/deployments/m/").json()["rollout"] is None
    assert invariant_holds()


def test_a_model_change_parks_the_sleepers_at_once_so_no_wake_serves_the_old_model(
    cluster, api, tiny_model_dir, second_model
):
    assert api("post", "/api/deployments/", body("s", tiny_model_dir, replicas=2)).status_code == 201
    awake, sleeper = live("s")
    serve(awake), serve(sleeper)
    sleep.sleep_replica(sleeper, reason="idle")
    reports.report(sleeper, {"event": "sleeping", "residual_bytes_by_id": {"0": 0}})

    assert api("patch", "/api/deployments/s/", {"model": {"dtype": "bfloat16"}}).status_code == 200

    parked = Replica.objects.get(pk=sleeper)
    assert parked.state == "parked" and parked.node is None
    assert Event.objects.filter(
        replica=sleeper, reason__contains="parked by a rolling restart for the new model.dtype"
    ).exists()
    assert live("s")[awake] == "serving", "the awake one serves on until its replacement serves"
    assert Deployment.objects.get(name="s").dtype == "bfloat16"
    assert Event.objects.filter(
        deployment="s",
        reason__startswith="settings changed by ops: model.dtype 'float32' → 'bfloat16' (every replica rolled",
    ).exists()


def test_a_deployment_with_nothing_running_takes_the_new_model_with_no_restart(
    cluster, api, dispatched, started, tiny_model_dir, second_model
):
    assert api("post", "/api/deployments/", body("idle", tiny_model_dir, replicas=0)).status_code == 201
    dispatched.clear()

    answer = api("patch", "/api/deployments/idle/", {"model": {"source": str(second_model)}})

    assert answer.status_code == 200 and answer.json()["rollout"] is None
    assert [t for _, t, _ in dispatched] == []
    assert api("patch", "/api/deployments/idle/", {"replicas": 1}).status_code == 200
    (placed,) = live("idle")
    assert started == {placed: str(second_model)}


def test_a_model_no_node_can_read_is_a_400_naming_it_and_nothing_changes(cluster, api, tiny_model_dir, tmp_path):
    assert api("post", "/api/deployments/", body("m", tiny_model_dir)).status_code == 201
    (replica,) = live("m")
    serve(replica)
    events = Event.objects.count()

    nowhere = {"model": {"source": str(tmp_path / "nowhere")}, "fairness": {"popular": True}}
    missing = api("patch", "/api/deployments/m/", nowhere)

    assert missing.status_code == 400 and "model.source" in str(missing.json()), missing.json()
    deployment = Deployment.objects.get(name="m")
    assert (deployment.model_source, deployment.popular) == (str(tiny_model_dir), False)
    assert DeploymentObserved.objects.get(deployment__name="m").restart_since is None
    assert Event.objects.count() == events
    assert live("m") == {replica: "serving"}

    loader = api("patch", "/api/deployments/m/", {"model": {"loader": "transformers-embedding"}})
    assert loader.status_code == 400
    assert loader.json() == {"model": {"loader": ["cannot be changed on an existing deployment"]}}

    # The same model again is no change: nothing read, nothing restarted.
    same = api("patch", "/api/deployments/m/", {"model": {"source": str(tiny_model_dir), "dtype": "float32"}})
    assert same.status_code == 200 and same.json()["rollout"] is None
    assert Event.objects.count() == events


def test_a_torch_module_source_must_be_one_an_operator_allowed(cluster, api, settings):
    settings.GPUPORTAL_TORCH_MODULES = ("tests.support.models",)
    mlp = "tests.support.models:tiny_mlp"
    torch_module = {"name": "t", "model": {"source": mlp, "loader": "torch-module"}, "replicas": 0}
    created = api("post", "/api/deployments/", {**torch_module, "memory": {"override_bytes": 64 * 1024**2}})
    assert created.status_code == 201, created.json()

    refused = api("patch", "/api/deployments/t/", {"model": {"source": "os:getcwd"}})
    bigger = api("patch", "/api/deployments/t/", {"model": {"source": "tests.support.models:big_mlp"}})

    assert refused.status_code == 400
    assert "only modules an operator lists in GPUPORTAL_TORCH_MODULES" in str(refused.json())
    assert bigger.status_code == 200 and bigger.json()["model"]["source"] == "tests.support.models:big_mlp"


def test_failover_pairs_roll_onto_a_new_model_a_pair_at_a_time(
    cluster, api, report, started, tiny_model_dir, second_model
):
    paired = body("pair", tiny_model_dir, failover={"standby": True})
    assert api("post", "/api/deployments/", paired).status_code == 201
    active = Replica.objects.get(deployment__name="pair", role="primary")
    standby = Replica.objects.get(deployment__name="pair", role="standby")
    stands_by(report, standby)
    serves_at(report, active)

    answer = api("patch", "/api/deployments/pair/", {"model": {"source": str(second_model)}})

    assert answer.status_code == 200 and answer.json()["rollout"] is not None, answer.json()
    # The pair fits its reservation (its override): restarted in place, its new standby first,
    # which loads the new model and fails before it stands by if that would not fit.
    assert rollouts.advance("pair").action == Action.WAIT, "the new standby loads"
    assert Replica.objects.get(pk=standby.id).state == "stopping"
    renewed = Replica.objects.get(deployment__name="pair", role="standby", state="pending")
    assert started[renewed.id] == str(second_model)
    assert live("pair")[active.id] == "serving"


def test_a_new_model_is_the_answer_to_a_failed_one_and_what_is_placed_loads_it(
    cluster, api, started, tiny_model_dir, second_model
):
    crashy = body("c", tiny_model_dir, restart={"max_load_failures": 1})
    assert api("post", "/api/deployments/", crashy).status_code == 201
    (broken,) = live("c")
    reports.report(broken, {"event": "failed", "kind": "load", "reason": "a broken checkpoint"})
    assert api("get", "/api/deployments/c/").json()["status"] == "failed"

    answer = api("patch", "/api/deployments/c/", {"model": {"source": str(second_model)}})

    assert answer.status_code == 200, answer.json()
    assert answer.json()["status"] != "failed" and answer.json()["rollout"] is None, "nothing ran the old model"
    (placed,) = live("c")
    assert placed != broken and started[placed] == str(second_model)

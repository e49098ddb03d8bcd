"""No input and no race gets a 500: a name taken by a racing create is a 409, a change
that raced a delete is a 404, and every number, filter and source is checked, the 400 naming it.
Nothing is half-applied."""

from __future__ import annotations

import threading

import pytest
from django.contrib.auth.models import User
from django.db import connection
from rest_framework.test import APIClient

from inference.devices import virtual_gpus
from scheduling.api import views
from scheduling.models import Deployment, Event, Replica
from scheduling.services import deployments, reports
from scheduling.services.nodes import register_node
from tests.support.deployments import body
from tests.support.factories import NO_OVERHEAD
from tests.support.processes import wait_until

MiB = 1024**2


@pytest.mark.django_db(transaction=True)
def test_eight_creates_of_one_name_at_once_make_one_deployment_and_seven_409s(cluster, tiny_model_dir):
    User.objects.create_user("ops", is_staff=True)
    start = threading.Barrier(8)
    codes: list[int] = []

    def create() -> None:
        client = APIClient()
        client.force_authenticate(User.objects.get(username="ops"))
        try:
            start.wait()
            codes.append(client.post("/api/deployments/", body("twin", tiny_model_dir), format="json").status_code)
        finally:
            connection.close()  # this thread's own connection

    threads = [threading.Thread(target=create) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert sorted(codes) == [201] + [409] * 7
    assert Deployment.objects.filter(name="twin").count() == 1
    assert Event.objects.filter(deployment="twin", reason__startswith="created").count() == 1


@pytest.mark.django_db(transaction=True)
def test_a_scale_whose_deployment_is_deleted_before_it_answers_is_a_404(cluster, staff, monkeypatch, tiny_model_dir):
    assert staff.post("/api/deployments/", body("brief", tiny_model_dir), format="json").status_code == 201
    scale = deployments.scale

    def scale_then_deleted(name: str, replicas: int, **kwargs):
        done = scale(name, replicas, **kwargs)
        deployments.delete(name, reason="deleted by a racing call")  # what a DELETE between the two does
        return done

    monkeypatch.setattr(views.deployment_services, "scale", scale_then_deleted)
    response = staff.post("/api/deployments/brief/scale/", {"replicas": 2}, format="json")

    assert response.status_code == 404
    assert response.json() == {"detail": "deployment 'brief' was deleted meanwhile"}


@pytest.mark.parametrize(
    ("change", "field", "says"),
    [
        ({"replicas": 33}, "replicas", "at most 32 replicas per deployment (GPUPORTAL_MAX_REPLICAS)"),
        ({"memory": {"override_bytes": 10**40}}, "memory", "less than or equal to 1125899906842624"),
        ({"memory": {"override_bytes": 0}}, "memory", "greater than or equal to 1"),
        ({"model": {"source": "x" * 1001}}, "model", "no more than 1000 characters"),
    ],
)
def test_an_out_of_bounds_deploy_is_a_400_naming_the_field(cluster, api, tiny_model_dir, change, field, says):
    response = api("post", "/api/deployments/", {**body("bounded", tiny_model_dir), **change})

    assert response.status_code == 400, response.json()
    assert says in str(response.json()[field])
    assert not Deployment.objects.exists()


def test_a_scale_past_the_limit_is_a_400_and_the_limit_is_the_operators(cluster, api, settings, tiny_model_dir):
    assert api("post", "/api/deployments/", body("capped", tiny_model_dir)).status_code == 201
    settings.GPUPORTAL_MAX_REPLICAS = 2

    response = api("post", "/api/deployments/capped/scale/", {"replicas": 3})

    assert response.status_code == 400
    assert response.json() == {"replicas": ["at most 2 replicas per deployment (GPUPORTAL_MAX_REPLICAS)"]}
    assert Deployment.objects.get(name="capped").replicas_wanted == 1


def test_a_torch_module_source_no_operator_listed_is_refused_before_any_node_runs_it(cluster, api, settings):
    settings.GPUPORTAL_TORCH_MODULES = ("acme.models",)
    spec = {"name": "code", "model": {"source": "os:abort", "loader": "torch-module"}}

    response = api("post", "/api/deployments/", spec)

    assert response.status_code == 400
    assert response.json()["model.source"] == [
        "'os:abort' is code the nodes would run: only modules an operator lists in GPUPORTAL_TORCH_MODULES "
        "may be deployed (listed: acme.models)"
    ]
    assert deployments.torch_module_allowed("acme.models.mlp:build")
    assert not deployments.torch_module_allowed("acme.modelsx:build")


@pytest.mark.parametrize("gpu", ["abc", "node1/", "/0", "node1/x"])
def test_an_events_filter_that_names_no_gpu_is_a_400_naming_the_parameter(staff, gpu):
    response = staff.get("/api/events/", {"gpu": gpu})

    assert response.status_code == 400
    assert response.json() == {"gpu": ['expected NODE/INDEX as events record a GPU, e.g. "node1/0"']}
    assert staff.get("/api/events/", {"gpu": "node1/0"}).status_code == 200


def test_an_events_filter_names_the_gpu_of_a_node_whose_name_holds_dots(staff, dispatched):
    name = "ip-10-0-1-2.ec2.internal"  # as EKS names a node
    register_node(name, virtual_gpus(name, "2x1GiB", NO_OVERHEAD), virtual=True)

    response = staff.get("/api/events/", {"gpu": f"{name}/1"})
    assert response.status_code == 200, response.json()
    assert [(e["kind"], e["gpu"]) for e in response.json()["results"]] == [("gpu.registered", f"{name}/1")]


@pytest.mark.django_db(transaction=True)
def test_a_command_postgresql_aborts_for_a_deadlock_runs_again_and_both_sides_finish():
    from django.db import transaction

    from scheduling.locks import retry_deadlocks
    from tests.support import factories

    node = factories.node("n")
    rows = [factories.gpu(node, 0).pk, factories.gpu(node, 1).pk]
    both_hold_one = threading.Barrier(2)
    runs: list[str] = []
    errors: list[BaseException] = []

    @retry_deadlocks
    def take_both(first: int, second: int, side: str) -> None:
        from scheduling.models import GPU

        runs.append(side)
        with transaction.atomic():
            GPU.objects.select_for_update().get(pk=first)
            if runs.count(side) == 1:
                both_hold_one.wait()  # each holds one row and asks for the other's: a circle
            GPU.objects.select_for_update().get(pk=second)

    def side(first: int, second: int, name: str) -> None:
        try:
            take_both(first, second, name)
        except BaseException as err:  # reported by the assertion below
            errors.append(err)
        finally:
            connection.close()

    threads = [
        threading.Thread(target=side, args=(rows[0], rows[1], "a")),
        threading.Thread(target=side, args=(rows[1], rows[0], "b")),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert errors == []
    assert sorted(runs) in (["a", "a", "b"], ["a", "b", "b"]), "PostgreSQL aborted one side, which ran again"


@pytest.mark.django_db(transaction=True)
def test_a_report_that_arrives_as_its_deployment_is_deleted_is_ignored(cluster, staff, dispatched, tiny_model_dir):
    from django.db import transaction

    assert staff.post("/api/deployments/", body("brief", tiny_model_dir), format="json").status_code == 201
    replica_id = Replica.objects.get().id
    backend: list[int] = []
    errors: list[BaseException] = []

    def agent_reports_serving() -> None:
        try:
            connection.ensure_connection()
            backend.append(connection.connection.info.backend_pid)
            reports.report(replica_id, {"event": "serving", "pid": 4242, "weights_bytes": 10 * MiB})
        except BaseException as err:  # reported by the assertion below
            errors.append(err)
        finally:
            connection.close()

    def waits_for_a_lock() -> bool:
        with connection.cursor() as cursor:
            cursor.execute("SELECT cardinality(pg_blocking_pids(%s)) > 0", [backend[0]])
            return cursor.fetchone()[0]

    agent = threading.Thread(target=agent_reports_serving)
    with transaction.atomic():
        deployments.delete("brief")  # deleted, with its replica, but not committed yet
        agent.start()
        # The report still sees the replica, and waits for the rows this delete holds.
        wait_until(lambda: errors or (backend and waits_for_a_lock()), 30, "the report to wait for the delete")
    agent.join()

    assert errors == []
    assert not Replica.objects.filter(pk=replica_id).exists()


DEEP = "[" * 5000 + "]" * 5000
BODIES = [
    ("post", "/api/deployments/"),
    ("patch", "/api/deployments/tiny-a/"),
    ("post", "/api/deployments/tiny-a/scale/"),
    ("post", "/api/deployments/tiny-a/infer/"),
    ("post", "/api/requests/"),
    ("post", "/api/plan/"),
    ("post", "/v1/completions"),
    ("post", "/v1/chat/completions"),
    ("post", "/v1/embeddings"),
    ("post", "/v1/responses"),
    ("post", "/v1/messages"),
    ("post", "/api/chat"),
    ("post", "/api/generate"),
    ("post", "/api/embed"),
]


@pytest.mark.parametrize(("method", "path"), BODIES)
def test_json_nested_past_the_limit_is_a_400_naming_the_limit(staff, method, path):
    from scheduling.api.bodies import MAX_DEPTH

    response = getattr(staff, method)(path, data=DEEP, content_type="application/json")
    assert response.status_code == 400, response.content[:300]
    assert f"nested deeper than {MAX_DEPTH} levels" in response.content.decode()


@pytest.mark.parametrize(
    ("path", "sent", "field"),
    [
        ("/api/deployments/", {"name": "a\x00b", "model": {"source": "/srv/m"}}, "name"),
        ("/api/deployments/", {"name": "ok", "model": {"source": "/srv/\x00m"}}, "model.source"),
        ("/api/requests/", {"deployment": "tiny-a", "input": "hi\x00"}, "input"),
        ("/v1/completions", {"model": "tiny\x00b", "prompt": "hi"}, "model"),
        (
            "/v1/chat/completions",
            {"model": "m", "messages": [{"role": "user", "content": "\x00"}]},
            "messages.0.content",
        ),
        ("/v1/responses", {"model": "m", "input": [{"role": "user", "content": "\x00"}]}, "input.0.content"),
        (
            "/v1/messages",
            {
                "model": "m",
                "max_tokens": 5,
                "messages": [{"role": "user", "content": [{"type": "text", "text": "\x00"}]}],
            },
            "messages.0.content.0.text",
        ),
        ("/api/chat", {"model": "m", "messages": [{"role": "user", "content": "\x00"}]}, "messages.0.content"),
    ],
)
def test_a_nul_character_in_a_body_is_a_400_naming_the_field_and_nothing_is_stored(staff, path, sent, field):
    response = staff.post(path, sent, format="json")
    assert response.status_code == 400, response.content[:300]
    if path == "/v1/messages":  # in Anthropic's error shape
        assert response.json()["error"]["message"].startswith(f"{field}: holds a NUL character"), response.json()
    elif path == "/api/chat":  # in Ollama's
        assert response.json()["error"].startswith(f"{field}: holds a NUL character"), response.json()
    else:
        assert field in response.json(), response.json()
    assert not Deployment.objects.exists()


@pytest.mark.parametrize(
    ("path", "sent", "field"),
    [
        ("/v1/completions", '{"model": "m", "prompt": "hi \\ud800"}', "prompt"),
        (
            "/v1/chat/completions",
            '{"model": "m", "messages": [{"role": "user", "content": "\\udfff"}]}',
            "messages.0.content",
        ),
        ("/v1/embeddings", '{"model": "m", "input": ["ok", "\\ud83d"]}', "input.1"),
        ("/v1/responses", '{"model": "m", "input": [{"role": "user", "content": "\\udfff"}]}', "input.0.content"),
    ],
)
def test_a_lone_surrogate_in_a_v1_text_is_a_400_that_says_so(staff, path, sent, field):
    response = staff.post(path, data=sent, content_type="application/json")

    assert response.status_code == 400, response.content[:300]
    error = response.json()["error"]
    assert error["param"] == field and "lone surrogate" in error["message"] and "UTF-8" in error["message"], error


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("get", "/api/deployments/a%00b/"),
        ("post", "/api/deployments/a%00b/infer/"),
        ("get", "/api/replicas/a%00b/"),
        ("get", "/api/nodes/a%00b/"),
        ("get", "/api/requests/a%00b/"),
    ],
)
def test_a_nul_character_in_a_path_is_a_400_before_any_query(staff, method, path):
    response = getattr(staff, method)(path)
    assert response.status_code == 400
    assert "NUL" in response.json()["detail"]


def test_nan_and_infinity_are_refused_as_strict_json_does(staff):
    response = staff.post(
        "/api/requests/", data='{"deployment": "tiny-a", "input": NaN}', content_type="application/json"
    )
    assert response.status_code == 400
    assert "not JSON compliant" in response.json()["detail"]

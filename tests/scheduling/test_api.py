"""The read side of the REST API (docs/api.md): auth, shapes, filters, query counts, schema."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib.auth.models import User
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from gpuportal.auth import forget_tokens
from scheduling.models import Event, PreemptionIntent, Replica
from tests.support import factories as f

pytestmark = pytest.mark.django_db
MiB = 1024**2

LIST_ENDPOINTS = ["/api/nodes/", "/api/gpus/", "/api/deployments/", "/api/replicas/", "/api/events/"]


@pytest.fixture
def user() -> User:
    return User.objects.create_user("alice", password="correct horse battery")


@pytest.fixture
def api(user: User) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.create(user=user).key}")
    return client


def results(response) -> list[dict]:
    assert response.status_code == 200, response.content
    return response.json()["results"]


# --- auth ---------------------------------------------------------------------------------


@pytest.mark.parametrize("url", [*LIST_ENDPOINTS, "/api/", "/api/schema/", "/api/docs/"])
def test_it_answers_401_without_a_token(url: str) -> None:
    response = APIClient().get(url)
    assert response.status_code == 401
    assert response["WWW-Authenticate"] == "Token"


def test_it_answers_401_for_an_unknown_token() -> None:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION="Token not-a-real-key")
    assert client.get("/api/gpus/").status_code == 401


def test_a_token_from_the_token_endpoint_opens_every_list(user: User) -> None:
    anonymous = APIClient()
    response = anonymous.post(
        "/api/auth/token/", {"username": "alice", "password": "correct horse battery"}, format="json"
    )
    assert response.status_code == 200
    key = response.json()["token"]
    assert key == Token.objects.get(user=user).key

    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {key}")
    for url in LIST_ENDPOINTS:
        response = client.get(url)
        assert response.status_code == 200, url
        assert set(response.json()) == {"count", "next", "previous", "results"}


def test_the_token_endpoint_answers_400_for_a_wrong_password(user: User) -> None:
    response = APIClient().post("/api/auth/token/", {"username": "alice", "password": "wrong"}, format="json")
    assert response.status_code == 400
    assert "non_field_errors" in response.json()
    assert not Token.objects.filter(user=user).exists()


def test_a_logged_in_session_can_read_the_api(user: User) -> None:
    client = APIClient()
    client.force_login(user)
    assert client.get("/api/gpus/").status_code == 200


# --- GPUs ---------------------------------------------------------------------------------


def test_gpu_list_shows_occupants_intents_and_the_wake_lock(api: APIClient) -> None:
    node = f.node("node1")
    gpu = f.gpu(node, index=0, total_bytes=24 * f.GIB)
    tiny = f.deployment("tiny-a")
    big = f.deployment("big-b")
    serving = f.replica(tiny, node, state=Replica.State.SERVING)
    occupant = f.occupy(serving, gpu, 700 * 1024**2)
    waiting = f.replica(big, node, state=Replica.State.WAKING)
    deadline = timezone.now() + timedelta(seconds=5)
    pending = f.intent(waiting, gpu, 30 * f.GIB, deadline=deadline)
    chosen = f.intent(waiting, gpu, 2 * f.GIB, status=PreemptionIntent.Status.VICTIM_CHOSEN, victim=serving)
    expires = timezone.now() + timedelta(seconds=60)
    gpu.wake_lock_holder = waiting
    gpu.wake_lock_expires_at = expires
    gpu.save(update_fields=["wake_lock_holder", "wake_lock_expires_at"])

    [body] = results(api.get("/api/gpus/"))

    assert body["id"] == gpu.pk
    assert body["node"] == "node1"
    assert body["index"] == 0
    assert body["uuid"] == gpu.uuid
    assert body["product"] == "Virtual GPU"
    assert body["virtual"] is True
    assert body["total_bytes"] == 24 * f.GIB
    assert body["available_bytes"] == 24 * f.GIB - 700 * 1024**2
    assert body["version"] == 1
    assert body["health"] == "ok"
    assert body["occupants"] == [
        {
            "replica": serving.id,
            "deployment": "tiny-a",
            "state": "serving",
            "reserved_bytes": 700 * 1024**2,
            "since": occupant.since.isoformat().replace("+00:00", "Z"),
        }
    ]
    assert [i["needed_bytes"] for i in body["intents"]] == [30 * f.GIB, 2 * f.GIB]
    first, second = body["intents"]
    assert first["replica"] == waiting.id
    assert first["deployment"] == "big-b"
    assert first["status"] == "waiting"
    assert first["victim"] is None
    assert first["deadline"] == pending.deadline.isoformat().replace("+00:00", "Z")
    assert first["created_at"]
    assert second["status"] == "victim_chosen"
    assert second["victim"] == serving.id
    assert chosen.pk != pending.pk
    assert body["wake_lock"] == {
        "holder": waiting.id,
        "deployment": "big-b",
        "expires_at": expires.isoformat().replace("+00:00", "Z"),
    }


def test_gpu_intents_leave_out_finished_ones(api: APIClient) -> None:
    node = f.node()
    gpu = f.gpu(node)
    waiting = f.replica(f.deployment(), node)
    for status in [PreemptionIntent.Status.SATISFIED, PreemptionIntent.Status.FAILED, "cancelled"]:
        f.intent(waiting, gpu, f.GIB, status=status)

    [body] = results(api.get("/api/gpus/"))

    assert body["intents"] == []
    assert body["wake_lock"] is None
    assert body["occupants"] == []


def test_gpus_filter_by_node(api: APIClient) -> None:
    a, b = f.node("a"), f.node("b")
    f.gpu(a, 0)
    f.gpu(a, 1)
    f.gpu(b, 0)

    assert [(g["node"], g["index"]) for g in results(api.get("/api/gpus/?node=a"))] == [("a", 0), ("a", 1)]
    assert [(g["node"], g["index"]) for g in results(api.get("/api/gpus/?node=b"))] == [("b", 0)]
    assert results(api.get("/api/gpus/?node=nope")) == []
    assert len(results(api.get("/api/gpus/"))) == 3


def test_gpu_detail_by_id(api: APIClient) -> None:
    gpu = f.gpu(f.node("n1"), 3)
    body = api.get(f"/api/gpus/{gpu.pk}/").json()
    assert (body["node"], body["index"]) == ("n1", 3)
    assert api.get("/api/gpus/999999/").status_code == 404


def _crowd(count: int) -> None:
    """GPUs each with occupants, an active intent and a wake lock: every related row the list reads."""
    node = f.node()
    dep = f.deployment(memory_override_bytes=f.GIB)  # a need, which counts the GPUs' contexts
    for _ in range(count):
        gpu = f.gpu(node, index=node.gpus.count())
        first, second = f.replica(dep, node), f.replica(dep, node)
        f.occupy(first, gpu, f.GIB)
        f.occupy(second, gpu, f.GIB)
        f.intent(f.replica(dep, node), gpu, 30 * f.GIB, victim=first)
        gpu.wake_lock_holder = second
        gpu.save(update_fields=["wake_lock_holder"])


# token lookup + page count + page, then one per prefetched relation
@pytest.mark.parametrize(
    ("url", "queries"),
    # /api/nodes/: one more for every node's host cache use, once per page; /api/deployments/: one
    # for the GPUs' CUDA contexts, which each deployment's need_bytes counts.
    [("/api/nodes/", 4), ("/api/gpus/", 5), ("/api/deployments/", 6), ("/api/replicas/", 4), ("/api/events/", 3)],
)
def test_list_endpoints_run_a_constant_number_of_queries(api: APIClient, url: str, queries: int) -> None:
    _crowd(2)
    f.event()
    forget_tokens()  # both calls look their token up (gpuportal.auth remembers it otherwise)
    with CaptureQueriesContext(connection) as few:
        before = len(results(api.get(url)))
    _crowd(10)
    for _ in range(10):
        f.event()
    forget_tokens()
    with CaptureQueriesContext(connection) as many:
        assert len(results(api.get(url))) > before > 0
    assert len(few) == len(many) == queries, [q["sql"] for q in many.captured_queries]


def test_a_deployments_need_is_what_placement_reserves_for_one_replica_contexts_included(api: APIClient) -> None:
    node = f.node("n1")
    f.gpu(node, 0, context_bytes=500 * MiB, standby_context_bytes=300 * MiB)
    f.gpu(node, 1, context_bytes=700 * MiB, standby_context_bytes=200 * MiB)  # placement counts the largest
    f.deployment("estimated", memory_estimate_bytes=f.GIB)
    f.deployment("paired", memory_estimate_bytes=f.GIB, failover_standby=True)
    # Measured serving with a 600 MiB context: the GPUs' contexts grew to 700 MiB since.
    f.deployment("measured", memory_measured_bytes=2 * f.GIB, memory_measured_context_bytes=600 * MiB)
    f.deployment("new")  # nothing to size it by yet
    f.deployment("unsized", memory_policy="ndif", memory_estimate_bytes=f.GIB)  # ndif sizes by weights alone

    needs = {d["name"]: d["memory"]["need_bytes"] for d in results(api.get("/api/deployments/"))}

    assert needs == {
        "estimated": f.GIB + 700 * MiB,
        "paired": f.GIB + 700 * MiB + 300 * MiB,
        "measured": 2 * f.GIB + 100 * MiB,
        "new": None,
        "unsized": None,
    }
    assert api.get("/api/deployments/paired/").json()["memory"]["need_bytes"] == needs["paired"]


def test_a_valid_token_is_looked_up_once_within_the_cache_ttl(api: APIClient) -> None:
    forget_tokens()
    with CaptureQueriesContext(connection) as first:
        api.get("/api/events/")
    with CaptureQueriesContext(connection) as again:
        api.get("/api/events/")
    assert len(again) == len(first) - 1
    assert not any("authtoken_token" in q["sql"] for q in again.captured_queries)


def test_with_the_token_cache_off_a_revoked_token_is_refused_at_once(api: APIClient, settings) -> None:
    settings.GPUPORTAL_TOKEN_CACHE_S = 0
    assert api.get("/api/events/").status_code == 200
    Token.objects.all().delete()
    assert api.get("/api/events/").status_code == 401


# --- nodes, deployments, replicas ------------------------------------------------------------


def test_nodes_list_counts_gpus_and_heartbeat_age(api: APIClient) -> None:
    node = f.node("node1", hostname="host1", cpu_cache_bytes=64 * f.GIB, virtual=True)
    node.last_heartbeat = timezone.now() - timedelta(seconds=30)
    node.save(update_fields=["last_heartbeat"])
    f.gpu(node, 0)
    f.gpu(node, 1)
    f.node("node2", last_heartbeat=None)

    first, second = results(api.get("/api/nodes/"))

    assert first["name"] == "node1"
    assert first["queue"] == "node.node1"
    assert first["hostname"] == "host1"
    assert first["status"] == "online"
    assert first["virtual"] is True
    assert first["cpu_cache_bytes"] == 64 * f.GIB
    assert first["gpu_count"] == 2
    assert 30 <= first["heartbeat_age_s"] < 60
    assert second["gpu_count"] == 0
    assert second["heartbeat_age_s"] is None
    assert second["last_heartbeat"] is None


def test_node_detail_by_name(api: APIClient) -> None:
    f.node("node1")
    assert api.get("/api/nodes/node1/").json()["name"] == "node1"
    assert api.get("/api/nodes/missing/").status_code == 404


def test_deployment_detail_by_name_has_the_grouped_shape(api: APIClient) -> None:
    node = f.node("node1")
    gpu0, gpu1 = f.gpu(node, 0), f.gpu(node, 1)
    dep = f.deployment(
        "tiny-a",
        model_source="/srv/models/tiny-a",
        dtype="bfloat16",
        replicas_wanted=2,
        memory_override_bytes=3 * f.GIB,
        memory_estimate_bytes=2 * f.GIB,
        popular=True,
        idle_timeout_s=60,
        failover_standby=True,
    )
    rep = f.replica(dep, node, state=Replica.State.SERVING, pid=4242, gpu_mem_bytes_by_id={"1": 5, "0": 7})
    f.occupy(rep, gpu1, 5)
    f.occupy(rep, gpu0, 7)

    body = api.get("/api/deployments/tiny-a/").json()

    assert body["name"] == "tiny-a"
    model = {"source": "/srv/models/tiny-a", "loader": "transformers", "dtype": "bfloat16", "adapters": ""}
    assert body["model"] == model
    assert body["replicas_wanted"] == 2
    assert body["dedicated"] is False
    assert body["memory"] == {
        "override_bytes": 3 * f.GIB,
        "max_tokens": 2048,
        "prefix_cache": "user",
        "estimate_bytes": 2 * f.GIB,
        "measured_bytes": None,
        "need_bytes": 3 * f.GIB,
    }
    assert body["fairness"] == {"min_runtime_s": 10.0, "max_wait_s": 5.0, "popular": True}
    assert body["sleep"] == {"idle_timeout_s": 60.0, "deep_after_s": 0.0, "drain_timeout_s": 30.0}
    assert body["failover"] == {"standby": True}
    assert body["created_at"] and body["updated_at"]
    [replica] = body["replicas"]
    assert replica["id"] == rep.id
    assert replica["gpus"] == replica["gpu_indexes"] == [0, 1]
    # Both numberings, named so: the index on its node, and the id /api/gpus/ lists it by.
    assert replica["gpu_ids"] == sorted([gpu0.id, gpu1.id])
    assert {g["id"] for g in api.get("/api/gpus/").json()["results"]} >= set(replica["gpu_ids"])
    assert replica["pid"] == 4242
    assert api.get("/api/deployments/nope/").status_code == 404


def test_replica_detail_has_the_replica_shape(api: APIClient) -> None:
    dep = f.deployment("tiny-a")
    rep = f.replica(dep, None, state=Replica.State.PENDING)

    body = api.get(f"/api/replicas/{rep.id}/").json()

    assert body == {
        "id": rep.id,
        "deployment": "tiny-a",
        "node": None,
        "role": "primary",
        "state": "pending",
        "gpus": [],
        "gpu_indexes": [],
        "gpu_ids": [],
        "gpu_mem_bytes_by_id": {},
        "gpu_memory_fraction": None,
        "pid": None,
        "serving_since": None,
        "last_accessed": None,
        "epoch": 0,
        "failover_state": None,
        "kv": None,
        "failure_reason": "",
        "progress": None,
        "arena_kept_bytes": 0,
        "host_bytes": 0,
        "host_copy_bytes": 0,
    }


def test_a_replica_is_found_by_an_unambiguous_start_of_its_id_as_ls_shows_one(api: APIClient) -> None:
    dep = f.deployment("tiny-a")
    one = f.replica(dep, None, id="abcd1234" + "0" * 24)
    f.replica(dep, None, id="abce9999" + "0" * 24)
    f.replica(dep, None, id="abce8888" + "0" * 24)

    assert api.get("/api/replicas/abcd1234/").json()["id"] == one.id
    assert api.get(f"/api/replicas/{one.id}/").json()["id"] == one.id
    ambiguous = api.get("/api/replicas/abce/")
    assert ambiguous.status_code == 400 and ambiguous.json()["detail"].startswith("'abce' starts more than one")
    assert api.get("/api/replicas/abc/").status_code == 404, "too short to be taken for a start"
    missing = api.get("/api/replicas/ffff0000/")
    assert missing.status_code == 404 and missing.json()["detail"] == "no replica 'ffff0000'"


def test_replicas_filter_by_deployment_state_and_node(api: APIClient) -> None:
    n1, n2 = f.node("n1"), f.node("n2")
    a, b = f.deployment("a"), f.deployment("b")
    a1 = f.replica(a, n1, state=Replica.State.SERVING)
    a2 = f.replica(a, n2, state=Replica.State.SLEEPING)
    b1 = f.replica(b, n1, state=Replica.State.SERVING)

    def ids(query: str) -> set[str]:
        return {r["id"] for r in results(api.get(f"/api/replicas/{query}"))}

    assert ids("") == {a1.id, a2.id, b1.id}
    assert ids("?deployment=a") == {a1.id, a2.id}
    assert ids("?state=serving") == {a1.id, b1.id}
    assert ids("?node=n1") == {a1.id, b1.id}
    assert ids("?deployment=a&state=serving&node=n1") == {a1.id}
    assert ids("?deployment=nope") == set()
    gone = f.replica(b, n2, state=Replica.State.STOPPED)
    assert ids("?state=stopped") == {gone.id}
    assert ids("?exclude_state=stopped") == {a1.id, a2.id, b1.id}
    assert ids("?exclude_state=sleeping&node=n2") == {gone.id}


def test_replicas_reject_an_unknown_state_naming_the_field(api: APIClient) -> None:
    response = api.get("/api/replicas/?state=asleep")
    assert response.status_code == 400
    assert "state" in response.json()
    response = api.get("/api/replicas/?exclude_state=gone")
    assert response.status_code == 400
    assert "exclude_state" in response.json()


# --- events -------------------------------------------------------------------------------


def test_events_come_newest_first_and_filter(api: APIClient) -> None:
    old = f.event(Event.Kind.NODE_ONLINE, node="n1")
    mid = f.event(Event.Kind.GPU_RESERVED, node="n1", gpu="n1/0", deployment="a", replica="r1")
    new = f.event(Event.Kind.REPLICA_STATE, node="n2", deployment="b", replica="r2")
    now = timezone.now()
    for ev, age in [(old, 300), (mid, 120), (new, 10)]:
        Event.objects.filter(pk=ev.pk).update(time=now - timedelta(seconds=age))

    def ids(query: str) -> list[int]:
        return [e["id"] for e in results(api.get(f"/api/events/{query}"))]

    assert ids("") == [new.pk, mid.pk, old.pk]
    assert ids("?kind=gpu.reserved") == [mid.pk]
    assert ids("?node=n1") == [mid.pk, old.pk]
    assert ids("?gpu=n1/0") == [mid.pk]
    assert ids("?deployment=b") == [new.pk]
    assert ids("?replica=r1") == [mid.pk]
    since = (now - timedelta(seconds=200)).isoformat()
    assert ids(f"?since={since.replace('+', '%2B')}") == [new.pk, mid.pk]
    assert ids("?since=2000-01-01T00:00:00Z&node=n2") == [new.pk]
    # A family: each of its kinds, and no other family whose name begins the same.
    also = f.event(Event.Kind.GPU_RELEASED, node="n1", gpu="n1/0")
    assert ids("?kind=gpu") == [also.pk, mid.pk]
    assert ids("?kind=node&node=n1") == [old.pk]


def test_a_replicas_events_are_found_by_the_start_of_its_id_as_ls_shows_it(api: APIClient) -> None:
    mine = f.event(Event.Kind.REPLICA_STATE, replica="3f2a1b2c" + "0" * 24)
    other = f.event(Event.Kind.REPLICA_STATE, replica="3f2a9999" + "0" * 24)

    def ids(query: str) -> list[int]:
        return [e["id"] for e in results(api.get(f"/api/events/{query}"))]

    assert ids("?replica=3f2a1b2c") == [mine.pk]
    assert ids("?replica=3f2a1b2c" + "0" * 24) == [mine.pk]
    assert ids("?replica=3f2a") == [other.pk, mine.pk], "a start names each replica it starts"
    assert ids("?replica=3f2") == [], "too short to be taken for one"


def test_an_event_kind_that_is_none_is_a_400_naming_the_kinds_not_an_empty_trail(api: APIClient) -> None:
    f.event(Event.Kind.REPLICA_STATE)

    response = api.get("/api/events/?kind=replica.sate")

    assert response.status_code == 400
    (said,) = response.json()["kind"]
    assert said.startswith("no event kind 'replica.sate': one of node.registered, ") and "replica.state" in said
    assert said.endswith("or a family of them: control, deployment, failover, gpu, node, preemption, replica, stack")


@pytest.mark.parametrize("url", LIST_ENDPOINTS)
@pytest.mark.parametrize(
    ("query", "parameter", "message"),
    [
        ("page_size=abc", "page_size", "A valid integer is required."),
        ("page_size=0", "page_size", "Ensure this value is greater than or equal to 1."),
        ("page_size=5000", "page_size", "Ensure this value is less than or equal to 1000."),
        ("page=abc", "page", "A valid integer is required."),
        ("page=0", "page", "Ensure this value is greater than or equal to 1."),
    ],
)
def test_a_page_or_page_size_out_of_bounds_is_a_400_naming_it_not_a_silent_default(
    api: APIClient, url: str, query: str, parameter: str, message: str
) -> None:
    response = api.get(f"{url}?{query}")
    assert (response.status_code, response.json()) == (400, {parameter: [message]})


def test_a_page_in_bounds_is_that_page_and_one_past_the_last_is_a_404(api: APIClient) -> None:
    for kind in (Event.Kind.NODE_ONLINE, Event.Kind.GPU_RESERVED, Event.Kind.REPLICA_STATE):
        f.event(kind)

    second = api.get("/api/events/?page_size=2&page=2").json()
    assert second["count"] == 3 and len(second["results"]) == 1 and second["next"] is None
    assert api.get("/api/events/?page_size=2&page=last").json()["results"] == second["results"]
    assert api.get("/api/events/?page_size=1000").status_code == 200
    assert api.get("/api/events/?page_size=2&page=3").status_code == 404


def test_events_reject_a_bad_since_naming_the_field(api: APIClient) -> None:
    response = api.get("/api/events/?since=yesterday")
    assert response.status_code == 400
    assert list(response.json()) == ["since"]


def test_event_shape(api: APIClient) -> None:
    ev = f.event(Event.Kind.REPLICA_STATE, subject="replica tiny-a/abc", reason="idle", before="serving")
    body = api.get(f"/api/events/{ev.pk}/").json()
    assert body["kind"] == "replica.state"
    assert body["subject"] == "replica tiny-a/abc"
    assert body["reason"] == "idle"
    assert body["before"] == "serving"
    assert body["after"] is None


# --- schema and docs ----------------------------------------------------------------------


def test_the_schema_describes_every_endpoint(api: APIClient) -> None:
    response = api.get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json")
    assert response.status_code == 200
    paths = response.json()["paths"]
    for url in [*LIST_ENDPOINTS, "/api/auth/token/", "/api/deployments/{name}/", "/api/replicas/{id}/"]:
        assert url in paths
    assert paths["/api/auth/token/"]["post"]


def test_the_docs_page_renders_for_a_logged_in_user(client, user: User) -> None:
    client.force_login(user)
    response = client.get("/api/docs/")
    assert response.status_code == 200
    assert b"swagger-ui" in response.content


def test_a_browser_lands_on_the_dashboard_or_its_login_not_a_401(client, user: User) -> None:
    home = client.get("/")
    assert home.status_code == 302 and home["Location"] == "/admin/dashboard/"
    dashboard = client.get(home["Location"])
    assert dashboard.status_code == 302 and dashboard["Location"].startswith("/admin/login/")


@pytest.mark.parametrize("url", ["/api/docs/", "/api/schema/"])
def test_the_docs_send_a_browser_without_a_session_to_the_login_and_back(client, url: str) -> None:
    response = client.get(url, HTTP_ACCEPT="text/html,application/xhtml+xml")
    assert response.status_code == 302
    assert response["Location"] == f"/admin/login/?next={url}"
    assert client.get(url).status_code == 401, "an API client is still refused, not redirected"

"""Deploy, scale, evict, restore and delete through the REST API, on virtual GPUs (no processes:
what the agents are sent is recorded, and what replica processes report is fed in)."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from django.contrib.auth.models import User
from django.db import connection
from django.utils import timezone
from rest_framework.test import APIClient

from inference.devices import virtual_gpus
from scheduling.models import GPU, Deployment, DeploymentObserved, Event, Occupant, Replica
from scheduling.services import reports
from scheduling.services.nodes import register_node
from tests.support.deployments import FROM_CACHE, START, STOP, TO_CACHE, body, invariant_holds, reserved, serve
from tests.support.factories import NO_OVERHEAD

MiB = 1024**2
GiB = 1024**3


def test_a_deploy_places_each_replica_on_a_fraction_of_a_gpu(cluster, api, dispatched, tiny_model_dir):
    response = api("post", "/api/deployments/", body("tiny-a", tiny_model_dir, replicas=2))

    assert response.status_code == 201, response.json()
    data = response.json()
    assert data["name"] == "tiny-a" and data["replicas_wanted"] == 2
    assert len(data["replicas"]) == 2
    for replica in data["replicas"]:
        assert replica["state"] == "pending" and replica["node"] in {"node1", "node2"}
        assert list(replica["gpu_mem_bytes_by_id"].values()) == [300 * MiB]
        assert replica["gpu_memory_fraction"] == pytest.approx(300 / 1024, abs=1e-9)
        assert len(replica["id"]) == 32
    assert sorted(task for _, task, _ in dispatched) == [START, START]
    assert {queue for queue, _, _ in dispatched} <= {"node.node1", "node.node2"}
    assert sum(reserved(r["id"]) for r in data["replicas"]) == 600 * MiB
    assert invariant_holds()
    placed = Event.objects.filter(kind=Event.Kind.REPLICA_STATE, deployment="tiny-a")
    assert placed.count() == 2 and all(e.reason.startswith("placed: ") for e in placed)


@pytest.mark.django_db
def test_a_patch_whose_deployment_another_client_deletes_before_it_answers_is_a_404_not_a_500(
    api, tiny_model_dir, monkeypatch
):
    # Found by the storm (tests/scheduling/test_storm.py): the PATCH's change committed, another
    # client's delete committed, then the PATCH read the deployment back for its answer.
    from scheduling.services import deployments as deployment_services

    register_node("solo", virtual_gpus("solo", "1x1GiB", NO_OVERHEAD), virtual=True)
    assert api("post", "/api/deployments/", body("gone", tiny_model_dir)).status_code == 201
    reread = deployment_services._reread

    def deleted_meanwhile(deployment: Deployment) -> None:
        deployment_services.delete(deployment.name)
        reread(deployment)

    monkeypatch.setattr(deployment_services, "_reread", deleted_meanwhile)
    response = api("patch", "/api/deployments/gone/", {"sleep": {"idle_timeout_s": 60}})

    assert response.status_code == 404, response.content
    assert "gone" in str(response.json())


@pytest.mark.django_db
def test_replicas_pack_onto_one_gpu_unless_the_deployment_asks_to_spread(api, tiny_model_dir):
    register_node("solo", virtual_gpus("solo", "2x1GiB", NO_OVERHEAD), virtual=True)

    packed = api("post", "/api/deployments/", body("packed", tiny_model_dir, replicas=3))
    assert packed.status_code == 201, packed.json()
    assert packed.json()["placement"] == {"spread": False, "node_selector": "", "tolerations": ""}
    assert len({tuple(r["gpu_ids"]) for r in packed.json()["replicas"]}) == 1, "best fit: the fullest GPU"
    api("delete", "/api/deployments/packed/")

    spread = api("post", "/api/deployments/", body("spread", tiny_model_dir, replicas=2, placement={"spread": True}))
    assert spread.status_code == 201, spread.json()
    assert spread.json()["placement"] == {"spread": True, "node_selector": "", "tolerations": ""}
    assert len({tuple(r["gpu_ids"]) for r in spread.json()["replicas"]}) == 2, "one replica per GPU"
    changed = api("patch", "/api/deployments/spread/", {"placement": {"spread": False}})
    assert changed.status_code == 200
    assert changed.json()["placement"] == {"spread": False, "node_selector": "", "tolerations": ""}
    assert Event.objects.filter(deployment="spread", reason__contains="spread True → False").exists()


def test_the_estimate_is_read_from_the_model_without_loading_it(cluster, api, tiny_model_dir):
    response = api("post", "/api/deployments/", body("tiny-est", tiny_model_dir, memory={"max_tokens": 512}))

    assert response.status_code == 201, response.json()
    deployment = Deployment.objects.get(name="tiny-est")
    observed = deployment.observed
    assert observed.weight_bytes > 0 and observed.memory_estimate_bytes > observed.weight_bytes
    replica = deployment.replicas.get()
    assert reserved(replica.id) == observed.memory_estimate_bytes, "virtual GPUs add no CUDA context"


def test_what_cannot_be_placed_is_a_409_with_reasons_per_node_and_changes_nothing(cluster, api, tiny_model_dir):
    versions = list(GPU.objects.order_by("pk").values_list("version", flat=True))

    response = api(
        "post", "/api/deployments/", body("huge", tiny_model_dir, replicas=5, memory={"override_bytes": GiB})
    )

    assert response.status_code == 409
    assert set(response.json()["reasons"]) == {"node1", "node2"}
    assert "cannot place huge" in response.json()["detail"]
    assert not Deployment.objects.filter(name="huge").exists()
    assert not Replica.objects.exists() and not Occupant.objects.exists()
    assert list(GPU.objects.order_by("pk").values_list("version", flat=True)) == versions


@pytest.mark.parametrize(
    ("change", "field_path"),
    [
        ({"name": "Not A Slug!"}, ["name"]),
        ({"model": {"loader": "transformers"}}, ["model", "source"]),
        ({"model": {"source": "/definitely/not/here"}}, ["model.source"]),
        ({"model": {"source": "MODEL", "loader": "onnx"}}, ["model", "loader"]),
        ({"model": {"source": "MODEL", "dtype": "int3"}}, ["model", "dtype"]),
        ({"replicas": -1}, ["replicas"]),
        ({"memory": {"override_bytes": -5}}, ["memory", "override_bytes"]),
        ({"memory": {"max_tokens": 0}}, ["memory", "max_tokens"]),
        ({"memory": {"policy": "greedy"}}, ["memory", "policy"]),
        ({"fairness": {"min_runtime_s": "nan"}}, ["fairness", "min_runtime_s"]),
        ({"fairness": {"max_wait_s": -1}}, ["fairness", "max_wait_s"]),
        ({"sleep": {"idle_timeout_s": "soon"}}, ["sleep", "idle_timeout_s"]),
        ({"failover": {"standby": "perhaps"}}, ["failover", "standby"]),
        ({"replicass": 2}, ["replicass"]),
    ],
)
def test_bad_input_is_a_400_naming_the_field_and_creates_nothing(cluster, api, tiny_model_dir, change, field_path):
    data = body("bad", tiny_model_dir)
    for key, value in change.items():
        if isinstance(value, dict) and key == "model" and value.get("source") == "MODEL":
            value = {**value, "source": str(tiny_model_dir)}
        data[key] = value

    response = api("post", "/api/deployments/", data)

    assert response.status_code == 400, response.json()
    node = response.json()
    for part in field_path:
        assert part in node, (field_path, response.json())
        node = node[part]
    assert not Deployment.objects.filter(name="bad").exists()


@pytest.mark.parametrize(
    ("change", "field_path", "says"),
    [
        ({"replica": 2}, ["replica"], "unknown field; did you mean 'replicas'?"),
        ({"memory": {"max_token": 64}}, ["memory", "max_token"], "unknown field; did you mean 'max_tokens'?"),
        (
            {"memory": {"zzz": 1}},
            ["memory", "zzz"],
            "unknown field (known here: max_tokens, override_bytes, policy, prefix_cache)",
        ),
        (
            {"model": {"source": "MODEL", "loader": "onnx"}},
            ["model", "loader"],
            '"onnx" is not a valid choice; expected one of: transformers, torch-module, transformers-embedding.',
        ),
    ],
)
def test_a_typo_is_told_the_field_or_choice_it_is_nearest(cluster, api, tiny_model_dir, change, field_path, says):
    data = body("typo", tiny_model_dir)
    for key, value in change.items():
        data[key] = {**value, "source": str(tiny_model_dir)} if key == "model" else value

    response = api("post", "/api/deployments/", data)

    node = response.json()
    for part in field_path:
        node = node[part]
    assert response.status_code == 400 and node == [says]


def test_a_name_that_names_no_deployment_is_told_the_nearest_and_what_is_deployed(cluster, api, tiny_model_dir):
    nothing = api("get", "/api/deployments/tiny-b/")
    assert nothing.status_code == 404
    assert nothing.json()["detail"] == (
        "no deployment named 'tiny-b': nothing is deployed (POST /api/deployments/ deploys a model)"
    )
    for name in ("tiny-a", "big"):
        assert api("post", "/api/deployments/", body(name, tiny_model_dir)).status_code == 201

    for method, path in (("get", "/api/deployments/tiny-b/"), ("delete", "/api/deployments/tiny-b/")):
        response = api(method, path)
        assert response.status_code == 404
        assert (
            response.json()["detail"] == "no deployment named 'tiny-b'; did you mean 'tiny-a'? (deployed: big, tiny-a)"
        )
    far = api("post", "/api/deployments/zzz/infer/", {"input": "hi"})
    assert far.status_code == 404 and far.json()["detail"] == "no deployment named 'zzz' (deployed: big, tiny-a)"


def test_a_source_that_is_not_a_model_directory_says_why(cluster, api, tmp_path):
    (tmp_path / "empty").mkdir()
    response = api("post", "/api/deployments/", body("nomodel", tmp_path / "empty"))

    assert response.status_code == 400
    assert "config.json" in response.json()["model.source"][0]


def test_a_duplicate_name_is_a_409_naming_it(cluster, api, tiny_model_dir):
    assert api("post", "/api/deployments/", body("twice", tiny_model_dir)).status_code == 201
    response = api("post", "/api/deployments/", body("twice", tiny_model_dir))
    assert response.status_code == 409 and "already exists" in response.json()["name"][0]


def test_controls_need_staff_and_unknown_names_are_404(cluster, api, tiny_model_dir):
    assert api("post", "/api/deployments/", body("tiny-a", tiny_model_dir)).status_code == 201
    replica = Replica.objects.get()
    user = APIClient()
    user.force_authenticate(User.objects.create_user("viewer"))
    anonymous = APIClient()
    controls = [
        ("post", "/api/deployments/", body("x", tiny_model_dir)),
        ("patch", "/api/deployments/tiny-a/", {"dedicated": True}),
        ("delete", "/api/deployments/tiny-a/", None),
        ("post", "/api/deployments/tiny-a/scale/", {"replicas": 2}),
        ("post", "/api/deployments/tiny-a/evict/", None),
        ("post", f"/api/replicas/{replica.id}/evict/", None),
    ]
    for method, path, data in controls:
        assert getattr(user, method)(path, data, format="json").status_code == 403, path
        assert getattr(anonymous, method)(path, data, format="json").status_code == 401, path
    assert user.get("/api/deployments/tiny-a/").status_code == 200
    assert api("post", "/api/deployments/nope/scale/", {"replicas": 1}).status_code == 404
    assert api("post", "/api/replicas/0123456789abcdef/evict/").status_code == 404
    assert api("delete", "/api/deployments/nope/").status_code == 404
    assert Deployment.objects.get(name="tiny-a").replicas.count() == 1


def test_scaling_adds_and_stops_replicas_and_releases_their_memory(cluster, api, dispatched, tiny_model_dir):
    api("post", "/api/deployments/", body("tiny-a", tiny_model_dir))
    dispatched.clear()

    response = api("post", "/api/deployments/tiny-a/scale/", {"replicas": 3})
    assert response.status_code == 200 and len(response.json()["replicas"]) == 3
    assert [task for _, task, _ in dispatched] == [START, START]
    assert Occupant.objects.count() == 3

    dispatched.clear()
    response = api("post", "/api/deployments/tiny-a/scale/", {"replicas": 1})
    assert response.status_code == 200
    states = sorted(r["state"] for r in response.json()["replicas"])
    assert states == ["pending", "stopping", "stopping"]
    assert [task for _, task, _ in dispatched] == [STOP, STOP]
    assert Occupant.objects.count() == 1 and invariant_holds()
    assert api("post", "/api/deployments/tiny-a/scale/", {"replicas": -2}).status_code == 400


def test_the_commands_a_scale_sends_are_the_ones_the_committed_books_give(cluster, api, monkeypatch, tiny_model_dir):
    # A scale builds its START from the row it wrote and its STOP from the locked deployment
    # (no read after the commit); an agent must get what reading back would give.
    from gpuportal.celery import app
    from gpuportal.wire import commands
    from scheduling.services import replica_specs

    api("post", "/api/deployments/", body("tiny-a", tiny_model_dir))
    Deployment.objects.filter(name="tiny-a").update(drain_timeout_s=7.5)
    sent: list = []
    monkeypatch.setattr(app, "send_task", lambda name, args=None, **kw: sent.append(commands.decode(args[0])))

    api("post", "/api/deployments/tiny-a/scale/", {"replicas": 3})
    starts = [c for c in sent if isinstance(c, commands.StartReplica)]
    assert len(starts) == 2
    for start in starts:
        assert start == replica_specs.start(start.spec.replica_id, [])

    sent.clear()
    api("post", "/api/deployments/tiny-a/scale/", {"replicas": 1})
    stops = [c for c in sent if isinstance(c, commands.StopReplica)]
    assert len(stops) == 2
    for stop in stops:
        assert stop == replica_specs.stop(stop.replica_id) and stop.drain_timeout_s == 7.5


def test_an_evicted_replica_sleeps_and_is_promoted_on_the_next_scale_up(cluster, api, dispatched, tiny_model_dir):
    api("post", "/api/deployments/", body("tiny-a", tiny_model_dir, replicas=3))
    ids = list(Replica.objects.values_list("id", flat=True))
    for replica_id in ids:
        serve(replica_id)
    victim = ids[0]
    dispatched.clear()

    response = api("post", f"/api/replicas/{victim}/evict/")
    assert response.status_code == 200 and response.json()["state"] == "draining"
    assert dispatched == [(f"node.{Replica.objects.get(pk=victim).node.name}", TO_CACHE, [victim])]
    assert reserved(victim) == 300 * MiB, "kept until the process says what it still holds"

    reports.report(victim, {"event": "sleeping", "residual_bytes_by_id": {"0": 0}})
    assert Replica.objects.get(pk=victim).state == "sleeping"
    assert reserved(victim) == 0 and Deployment.objects.get().replicas_wanted == 2
    dispatched.clear()

    response = api("post", "/api/deployments/tiny-a/scale/", {"replicas": 3})
    assert response.status_code == 200
    assert Replica.objects.count() == 3, "promoted, not created"
    promoted = Replica.objects.get(pk=victim)
    assert promoted.state == "waking" and reserved(victim) == 300 * MiB
    assert dispatched == [(promoted.node.queue, FROM_CACHE, [victim, []])]
    reports.report(victim, {"event": "woken", "gpu_mem_bytes_by_id": promoted.gpu_mem_bytes_by_id})
    assert Replica.objects.get(pk=victim).state == "serving"
    assert Event.objects.filter(replica=victim, reason__startswith="promoted from the CPU cache").exists()


def test_only_a_serving_replica_can_be_evicted(cluster, api, tiny_model_dir):
    api("post", "/api/deployments/", body("tiny-a", tiny_model_dir))
    replica = Replica.objects.get()
    response = api("post", f"/api/replicas/{replica.id}/evict/")
    assert response.status_code == 409 and "pending" in response.json()["detail"]


def test_evicting_a_deployment_sleeps_every_serving_replica(cluster, api, dispatched, tiny_model_dir):
    api("post", "/api/deployments/", body("tiny-a", tiny_model_dir, replicas=2))
    for replica_id in Replica.objects.values_list("id", flat=True):
        serve(replica_id)
    dispatched.clear()

    response = api("post", "/api/deployments/tiny-a/evict/")

    assert response.status_code == 200
    assert {r["state"] for r in response.json()["replicas"]} == {"draining"}
    assert [task for _, task, _ in dispatched] == [TO_CACHE, TO_CACHE]
    assert response.json()["replicas_wanted"] == 0


def test_deleting_a_deployment_releases_everything_and_stops_its_processes(cluster, api, dispatched, tiny_model_dir):
    api("post", "/api/deployments/", body("tiny-a", tiny_model_dir, replicas=2))
    dispatched.clear()

    assert api("delete", "/api/deployments/tiny-a/").status_code == 204

    assert not Deployment.objects.exists() and not Replica.objects.exists() and not Occupant.objects.exists()
    assert not DeploymentObserved.objects.exists(), "what was measured of it went with it"
    assert [task for _, task, _ in dispatched] == [STOP, STOP]
    assert all(g.available_bytes == g.total_bytes for g in GPU.objects.all())
    assert Event.objects.filter(kind=Event.Kind.DEPLOYMENT_CHANGED, reason__contains="deleted").exists()


def test_deleting_a_deployment_whose_wake_holds_a_gpus_lock_says_the_lock_went_with_it(
    cluster, api, dispatched, tiny_model_dir
):
    api("post", "/api/deployments/", body("tiny-a", tiny_model_dir))
    waker, gpu = Replica.objects.get(), GPU.objects.order_by("pk").first()
    expires = timezone.now() + timedelta(minutes=1)
    GPU.objects.filter(pk=gpu.pk).update(wake_lock_holder=waker, wake_lock_expires_at=expires)

    assert api("delete", "/api/deployments/tiny-a/").status_code == 204

    event = Event.objects.get(kind=Event.Kind.GPU_WAKE_LOCK)
    assert (event.gpu, event.replica, event.deployment) == (f"{gpu.node.name}/{gpu.index}", waker.id, "tiny-a")
    assert event.reason == f"wake lock released by tiny-a ({waker.id[:8]}): its deployment was deleted by ops"
    assert GPU.objects.get(pk=gpu.pk).wake_lock_holder is None


def test_a_larger_deploy_evicts_the_fewest_idle_replicas_of_others(cluster, api, dispatched, tiny_model_dir):
    # Fill all four GPUs with 600 MiB replicas that have served past their min_runtime.
    api("post", "/api/deployments/", body("small", tiny_model_dir, replicas=4, memory={"override_bytes": 600 * MiB}))
    long_ago = timezone.now() - timedelta(minutes=5)
    for replica_id in Replica.objects.values_list("id", flat=True):
        serve(replica_id)
    Replica.objects.update(serving_since=long_ago)
    dispatched.clear()

    response = api("post", "/api/deployments/", body("big", tiny_model_dir, memory={"override_bytes": 900 * MiB}))

    assert response.status_code == 201, response.json()
    victims = list(Replica.objects.filter(deployment__name="small", state="draining"))
    assert len(victims) == 1
    big = Replica.objects.get(deployment__name="big")
    assert big.node == victims[0].node and reserved(big.id) == 900 * MiB
    tasks = sorted((task, args[0]) for _, task, args in dispatched)
    assert tasks == sorted([(TO_CACHE, victims[0].id), (START, big.id)])
    start_args = next(args for _, task, args in dispatched if task == START)
    assert start_args == [big.id, [victims[0].id]], "the new replica waits for its victim to let go"
    assert Event.objects.filter(replica=victims[0].id, reason__startswith="evicted to the CPU cache").exists()
    assert invariant_holds()


def test_a_deploy_refused_for_replicas_inside_their_min_runtime_says_when_to_ask_again(
    cluster, api, dispatched, tiny_model_dir
):
    # All four GPUs hold a replica of small serving for 100 s of its 120 s min_runtime.
    fairness = {"min_runtime_s": 120}
    small = body("small", tiny_model_dir, replicas=4, memory={"override_bytes": 600 * MiB}, fairness=fairness)
    api("post", "/api/deployments/", small)
    for replica_id in Replica.objects.values_list("id", flat=True):
        serve(replica_id)
    Replica.objects.update(serving_since=timezone.now() - timedelta(seconds=100))

    response = api("post", "/api/deployments/", body("big", tiny_model_dir, memory={"override_bytes": 900 * MiB}))

    assert response.status_code == 409 and "fairness.min_runtime_s (120 s): 20 s more" in response.json()["detail"]
    assert 18 <= int(response.headers["Retry-After"]) <= 20, response.headers["Retry-After"]
    assert not Deployment.objects.filter(name="big").exists(), "nothing half-applied"
    # A dedicated one is never evicted: no wait helps, and no Retry-After says otherwise.
    Deployment.objects.filter(name="small").update(dedicated=True)
    response = api("post", "/api/deployments/", body("big", tiny_model_dir, memory={"override_bytes": 900 * MiB}))
    assert response.status_code == 409 and "Retry-After" not in response.headers


def test_a_dedicated_replica_is_never_evicted(cluster, api, tiny_model_dir):
    api(
        "post",
        "/api/deployments/",
        body("pinned", tiny_model_dir, replicas=4, dedicated=True, memory={"override_bytes": 600 * MiB}),
    )
    for replica_id in Replica.objects.values_list("id", flat=True):
        serve(replica_id)
    Replica.objects.update(serving_since=timezone.now() - timedelta(minutes=5))

    response = api("post", "/api/deployments/", body("big", tiny_model_dir, memory={"override_bytes": 900 * MiB}))

    assert response.status_code == 409
    assert not Replica.objects.filter(state="draining").exists()


def test_what_the_replica_reports_moves_its_state_and_measures_the_deployment(cluster, api, tiny_model_dir):
    api("post", "/api/deployments/", body("tiny-a", tiny_model_dir))
    replica = Replica.objects.get()
    deployment = Deployment.objects.get()

    reports.report(replica.id, {"event": "progress", "state": "loading", "percent": 40})
    replica.refresh_from_db()
    assert (replica.state, replica.progress) == ("loading", 40)

    before = deployment.updated_at
    serve(replica.id, weights_bytes=12 * MiB)
    replica.refresh_from_db()
    deployment.refresh_from_db()
    assert replica.state == "serving" and replica.pid == 4242 and replica.serving_since is not None
    reserves = deployment.observed.memory_estimate_bytes - deployment.observed.weight_bytes
    assert deployment.observed.memory_measured_bytes == 12 * MiB + reserves
    assert deployment.updated_at > before, "the answer's updated_at moves with its measured need"
    assert Event.objects.filter(kind=Event.Kind.DEPLOYMENT_CHANGED, reason__startswith="measured").exists()


def test_a_measured_need_is_told_beside_what_it_is_comparable_to():
    from scheduling.services.replica_reports import measured_reason

    with_context = measured_reason(819 * MiB, 97 * MiB, 722 * MiB)
    assert with_context.startswith("measured 819 MiB per replica after loading, its CUDA context included")
    assert "(the estimate 97 MiB and the CUDA context 722 MiB, 819 MiB)" in with_context
    alone = measured_reason(120 * MiB, 97 * MiB, None)
    assert alone.startswith("measured 120 MiB per replica after loading (the estimate was 97 MiB)")


def test_a_failed_replica_releases_its_reservation_and_says_why(cluster, api, tiny_model_dir):
    api("post", "/api/deployments/", body("tiny-a", tiny_model_dir))
    replica = Replica.objects.get()

    reports.report(replica.id, {"event": "failed", "kind": "oom", "reason": "out of memory: weights need 312 MiB"})

    replica.refresh_from_db()
    assert replica.state == "failed" and replica.failure_reason == "out of memory: weights need 312 MiB"
    assert reserved(replica.id) == 0 and invariant_holds()
    assert Event.objects.filter(replica=replica.id, reason="out of memory: weights need 312 MiB").exists()


def test_a_cuda_assert_restarts_the_replica_a_bounded_number_of_times(
    cluster, api, dispatched, tiny_model_dir, settings
):
    settings.GPUPORTAL_MAX_RESTARTS_PER_HOUR = 2
    api("post", "/api/deployments/", body("tiny-a", tiny_model_dir))
    replica = Replica.objects.get()
    assert_event = {"event": "failed", "kind": "cuda_assert", "reason": "device-side assert triggered"}

    for _ in range(2):
        dispatched.clear()
        with _on_commit_executed():
            reports.report(replica.id, assert_event)
        replica.refresh_from_db()
        assert replica.state == "pending" and reserved(replica.id) == 300 * MiB
        assert dispatched == [(replica.node.queue, START, [replica.id, []])]

    reports.report(replica.id, assert_event)
    replica.refresh_from_db()
    assert replica.state == "failed" and reserved(replica.id) == 0
    assert Event.objects.filter(replica=replica.id, kind=Event.Kind.REPLICA_RESTARTED).count() == 2


def test_patch_changes_settings_scales_and_refuses_a_new_loader(cluster, api, dispatched, tiny_model_dir):
    api("post", "/api/deployments/", body("tiny-a", tiny_model_dir))

    response = api("patch", "/api/deployments/tiny-a/", {"fairness": {"popular": True}, "replicas": 2})
    assert response.status_code == 200
    assert response.json()["fairness"]["popular"] is True and len(response.json()["replicas"]) == 2
    assert Event.objects.filter(reason__startswith="settings changed by ops: fairness.popular False → True").exists()

    # A new model is rolled out (tests/scheduling/test_model_update.py); another loader is another deployment.
    response = api("patch", "/api/deployments/tiny-a/", {"model": {"loader": "torch-module"}})
    assert response.status_code == 400 and "cannot be changed" in response.json()["model"]["loader"][0]
    assert api("patch", "/api/deployments/tiny-a/", {"sleep": {"drain_timeout_s": -1}}).status_code == 400
    assert api("put", "/api/deployments/tiny-a/", body("tiny-a", tiny_model_dir)).status_code == 405


def test_a_patch_of_max_tokens_estimates_the_need_anew_and_drops_the_old_sizes_measurement(
    cluster, api, dispatched, tiny_model_dir
):
    api("post", "/api/deployments/", body("tiny-a", tiny_model_dir, memory={"max_tokens": 256}))
    observed = DeploymentObserved.objects.get()
    first = observed.memory_estimate_bytes
    DeploymentObserved.objects.update(memory_measured_bytes=first + 5 * MiB, memory_measured_context_bytes=MiB)

    response = api("patch", "/api/deployments/tiny-a/", {"memory": {"max_tokens": 8192}})

    assert response.status_code == 200, response.json()
    observed.refresh_from_db()
    assert observed.memory_estimate_bytes > first, "a KV pool for 8192 tokens, not 256"
    assert (observed.memory_measured_bytes, observed.memory_measured_context_bytes) == (None, None)
    event = Event.objects.get(reason__startswith="estimated need", reason__contains="at max_tokens 8192")
    assert "the need measured before" in event.reason
    # The next replica reserves the new estimate (and the GPU's context), not the old measurement.
    assert api("patch", "/api/deployments/tiny-a/", {"replicas": 2}).status_code == 200
    (added,) = Replica.objects.order_by("-created_at")[:1]
    assert reserved(added.id) >= observed.memory_estimate_bytes
    # The same figure again reads nothing and changes nothing.
    assert api("patch", "/api/deployments/tiny-a/", {"memory": {"max_tokens": 8192}}).status_code == 200
    assert Event.objects.filter(reason__startswith="estimated need", reason__contains="at max_tokens").count() == 1


def test_a_patch_of_one_setting_leaves_the_rest_of_its_group_as_it_was(cluster, api, dispatched, tiny_model_dir):
    fairness = {"min_runtime_s": 3.0, "max_wait_s": 7.0, "popular": True}
    sleep = {"idle_timeout_s": 60.0, "deep_after_s": 600.0, "drain_timeout_s": 9.0}
    api("post", "/api/deployments/", body("tiny-a", tiny_model_dir, fairness=fairness, sleep=sleep))

    response = api(
        "patch",
        "/api/deployments/tiny-a/",
        {"memory": {"max_tokens": 128}, "fairness": {"max_wait_s": 1}, "sleep": {"idle_timeout_s": 0}},
    )

    assert response.status_code == 200, response.json()
    data = response.json()
    assert data["memory"]["max_tokens"] == 128 and data["memory"]["override_bytes"] == 300 * MiB
    assert data["fairness"] == {**fairness, "max_wait_s": 1.0}
    assert data["sleep"] == {**sleep, "idle_timeout_s": 0.0}
    changed = Event.objects.get(reason__startswith="settings changed")
    assert set(changed.after) == {"max_tokens", "max_wait_s", "idle_timeout_s"}


@pytest.mark.django_db(transaction=True)
def test_sixteen_concurrent_deploys_never_over_commit_a_gpu(dispatched, tiny_model_dir):
    from scheduling.services import deployments
    from scheduling.services.deployments import DeploymentSpec, ModelFacts
    from scheduling.services.errors import CannotPlace

    register_node("node1", virtual_gpus("node1", "2x1GiB", NO_OVERHEAD), virtual=True)
    register_node("node2", virtual_gpus("node2", "2x1GiB", NO_OVERHEAD), virtual=True)
    facts = ModelFacts(weight_bytes=10 * MiB, estimate_bytes=300 * MiB)
    barrier = threading.Barrier(16)
    outcomes: list[str] = []
    lock = threading.Lock()

    def deploy(n: int) -> None:
        try:
            barrier.wait()
            spec = DeploymentSpec(name=f"d{n}", source=str(tiny_model_dir), override_bytes=300 * MiB)
            try:
                deployments.create(spec, facts=facts)
                result = "placed"
            except CannotPlace:
                result = "refused"
            with lock:
                outcomes.append(result)
        finally:
            connection.close()

    threads = [threading.Thread(target=deploy, args=(n,)) for n in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert len(outcomes) == 16
    # Four 1 GiB GPUs hold three 300 MiB replicas each: exactly 12 fit.
    assert outcomes.count("placed") == 12 and outcomes.count("refused") == 4
    assert Deployment.objects.count() == 12 and Replica.objects.count() == 12
    assert invariant_holds()


class _on_commit_executed:
    """Run on_commit callbacks of service calls made outside a request (like an agent's report)."""

    def __enter__(self):
        from django.test import TestCase

        self._ctx = TestCase.captureOnCommitCallbacks(execute=True)
        return self._ctx.__enter__()

    def __exit__(self, *exc):
        return self._ctx.__exit__(*exc)


def test_admin_actions_scale_and_evict_through_the_services(cluster, api, admin_client, tiny_model_dir, dispatched):
    from django.contrib.messages import get_messages

    api("post", "/api/deployments/", body("tiny-a", tiny_model_dir))
    deployment = Deployment.objects.get()
    changelist = "/admin/scheduling/deployment/"
    selected = {"_selected_action": [deployment.pk]}

    form = admin_client.post(changelist, {**selected, "action": "scale_deployments"})
    assert form.status_code == 200 and "Replicas wanted" in form.content.decode()
    done = admin_client.post(changelist, {**selected, "action": "scale_deployments", "apply": "1", "replicas": 2})
    assert done.status_code == 302
    assert deployment.replicas.count() == 2 and Deployment.objects.get().replicas_wanted == 2
    assert Event.objects.filter(reason__startswith="scaled by admin (admin)").exists()

    replica_ids = list(deployment.replicas.values_list("id", flat=True))
    serve(replica_ids[0])
    response = admin_client.post(
        "/admin/scheduling/replica/", {"_selected_action": replica_ids, "action": "evict_replicas"}, follow=True
    )
    texts = [str(m) for m in get_messages(response.wsgi_request)]
    assert any("going to sleep" in t for t in texts)
    assert any("only a serving replica can be evicted" in t for t in texts), "the pending one is refused, saying why"
    assert Replica.objects.get(pk=replica_ids[0]).state == "draining"

    serve(replica_ids[1])
    admin_client.post(changelist, {**selected, "action": "evict_deployments"})
    assert Replica.objects.get(pk=replica_ids[1]).state == "draining"


def test_the_api_warns_when_popular_deployments_leave_a_gpu_no_room(cluster, api, tiny_model_dir):
    quiet = api("post", "/api/deployments/", body("small", tiny_model_dir, memory={"override_bytes": 100 * MiB}))
    assert quiet.status_code == 201 and quiet.json()["warnings"] == []

    crowded = api(
        "post",
        "/api/deployments/",
        body("hog", tiny_model_dir, fairness={"popular": True}, memory={"override_bytes": 1000 * MiB}),
    )

    assert crowded.status_code == 201
    [warning] = crowded.json()["warnings"]
    assert "popular deployments hold" in warning and "smallest other deployment needs" in warning
    assert api("patch", "/api/deployments/hog/", {"fairness": {"popular": False}}).json()["warnings"] == []


def test_admin_edits_fairness_and_sleep_settings_through_the_service(cluster, api, admin_client, tiny_model_dir):
    api("post", "/api/deployments/", body("tiny-a", tiny_model_dir))
    deployment = Deployment.objects.get()
    changelist = "/admin/scheduling/deployment/"
    selected = {"_selected_action": [deployment.pk], "action": "edit_settings"}

    form = admin_client.post(changelist, selected)
    assert form.status_code == 200 and "Max wait (s)" in form.content.decode()
    refused = admin_client.post(changelist, {**selected, "apply": "1", "max_wait_s": -1})
    assert refused.status_code == 200 and Deployment.objects.get().max_wait_s == 5.0, "invalid: nothing saved"

    done = admin_client.post(changelist, {**selected, "apply": "1", "max_wait_s": 12, "popular": "true"})

    assert done.status_code == 302
    deployment.refresh_from_db()
    assert (deployment.max_wait_s, deployment.popular, deployment.min_runtime_s) == (12.0, True, 10.0)
    assert Event.objects.filter(reason__startswith="settings changed by admin:", deployment="tiny-a").exists()

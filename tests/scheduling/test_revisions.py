"""A deployment's revisions and a rollback to one (`GET .../revisions/`, `POST .../rollback/`): each
deploy, change and rollback of its settings is a revision saying what it changed and who made it;
a rollback returns the settings to one as a change like any other, and leaves the scale alone.
The services run against the test's PostgreSQL on virtual GPUs with no processes."""

from __future__ import annotations

import re
import threading

import pytest

from scheduling.models import Deployment, DeploymentRevision, Event, Replica
from scheduling.services import deployments, revisions
from tests.support.deployments import body, serve

pytestmark = pytest.mark.django_db


def history(staff, name: str) -> list[dict]:
    answer = staff.get(f"/api/deployments/{name}/revisions/")
    assert answer.status_code == 200, answer.json()
    return answer.json()


def test_a_deploy_and_each_change_is_a_revision_saying_what_changed_and_who_made_it(
    cluster, api, staff, tiny_model_dir
):
    assert api("post", "/api/deployments/", body("m", tiny_model_dir)).status_code == 201
    assert api("patch", "/api/deployments/m/", {"sleep": {"idle_timeout_s": 60}}).status_code == 200
    assert api("patch", "/api/deployments/m/", {"fairness": {"popular": True}, "dedicated": True}).status_code == 200

    shown = history(staff, "m")

    assert [(r["revision"], r["current"], r["cause"], r["by"]) for r in shown] == [
        (3, True, "settings changed", "ops"),
        (2, False, "settings changed", "ops"),
        (1, False, "deployed", "ops"),
    ]
    assert shown[0]["changes"] == {
        "dedicated": {"before": False, "after": True},
        "fairness.popular": {"before": False, "after": True},
    }
    assert shown[1]["changes"] == {"sleep.idle_timeout_s": {"before": 300.0, "after": 60.0}}
    assert shown[2]["changes"] is None, "the first has nothing before it"
    assert shown[2]["settings"]["model.source"] == str(tiny_model_dir)
    assert shown[2]["settings"]["sleep.idle_timeout_s"] == 300.0
    assert "replicas" not in shown[0]["settings"], "the scale is no setting of a revision"


def test_a_change_that_changes_nothing_and_a_scale_make_no_revision(cluster, api, staff, tiny_model_dir):
    api("post", "/api/deployments/", body("m", tiny_model_dir))

    assert api("patch", "/api/deployments/m/", {"sleep": {"idle_timeout_s": 300}}).status_code == 200
    assert api("post", "/api/deployments/m/scale/", {"replicas": 2}).status_code == 200
    assert api("patch", "/api/deployments/m/", {"replicas": 3}).status_code == 200

    assert [r["revision"] for r in history(staff, "m")] == [1]


def test_a_rollback_returns_the_settings_of_the_revision_before_and_leaves_the_scale(
    cluster, api, staff, tiny_model_dir
):
    api("post", "/api/deployments/", body("m", tiny_model_dir))
    api("patch", "/api/deployments/m/", {"sleep": {"idle_timeout_s": 60}, "fairness": {"max_wait_s": 2}})
    api("post", "/api/deployments/m/scale/", {"replicas": 2})

    answer = api("post", "/api/deployments/m/rollback/", {})

    assert answer.status_code == 200, answer.json()
    shown = answer.json()
    assert shown["rollback"] == {
        "to": 1,
        "revision": 3,
        "changes": {
            "fairness.max_wait_s": {"before": 2.0, "after": 5.0},
            "sleep.idle_timeout_s": {"before": 60.0, "after": 300.0},
        },
    }
    assert shown["sleep"]["idle_timeout_s"] == 300.0 and shown["replicas_wanted"] == 2
    deployment = Deployment.objects.get(name="m")
    assert (deployment.idle_timeout_s, deployment.max_wait_s, deployment.replicas_wanted) == (300.0, 5.0, 2)
    newest = history(staff, "m")[0]
    assert (newest["revision"], newest["cause"], newest["current"]) == (3, "rolled back to revision 1", True)
    assert Event.objects.filter(
        deployment="m",
        reason__startswith="rolled back to revision 1 by ops: fairness.max_wait_s 2.0 → 5.0, "
        "sleep.idle_timeout_s 60.0 → 300.0",
    ).exists()

    # Rolled back again, to the revision before the rollback: the history only grows.
    assert api("post", "/api/deployments/m/rollback/", {"revision": 2}).json()["rollback"]["revision"] == 4
    assert Deployment.objects.get(name="m").idle_timeout_s == 60.0


def test_a_rollback_to_another_model_rolls_every_replica_back_onto_it(
    cluster, api, dispatched, tiny_model_dir, second_model
):
    api("post", "/api/deployments/", body("m", tiny_model_dir))
    (first,) = Replica.objects.filter(deployment__name="m").values_list("id", flat=True)
    serve(first)
    api("patch", "/api/deployments/m/", {"model": {"source": str(second_model)}})

    answer = api("post", "/api/deployments/m/rollback/", {"revision": 1})

    assert answer.status_code == 200, answer.json()
    shown = answer.json()
    assert shown["model"]["source"] == str(tiny_model_dir)
    assert shown["rollback"]["changes"] == {"model.source": {"before": str(second_model), "after": str(tiny_model_dir)}}
    assert shown["rollout"] is not None, "a rolling restart puts every replica back onto the old model"


@pytest.fixture(scope="module")
def second_model(tmp_path_factory):
    from inference.management.commands.make_tiny_model import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("v2") / "tiny-v2", size_mb=1, seed=9).path


@pytest.mark.parametrize(
    ("asked", "said"),
    [
        ({"revision": 7}, "deployment 'm' has no revision 7 (kept: 1, 2)"),
        ({"revision": 0}, "Ensure this value is greater than or equal to 1."),
        ({"revision": "two"}, "A valid integer is required."),
        ({"to": 1}, "unknown field"),
    ],
)
def test_a_rollback_to_what_is_no_revision_is_a_400_naming_it_and_changes_nothing(
    cluster, api, staff, tiny_model_dir, asked, said
):
    api("post", "/api/deployments/", body("m", tiny_model_dir))
    api("patch", "/api/deployments/m/", {"sleep": {"idle_timeout_s": 60}})

    answer = api("post", "/api/deployments/m/rollback/", asked)

    assert answer.status_code == 400
    assert said in str(answer.json())
    assert Deployment.objects.get(name="m").idle_timeout_s == 60.0
    assert [r["revision"] for r in history(staff, "m")] == [2, 1]


def test_a_deployment_with_one_revision_has_nothing_to_roll_back_to(cluster, api, tiny_model_dir):
    api("post", "/api/deployments/", body("m", tiny_model_dir))

    answer = api("post", "/api/deployments/m/rollback/")

    assert answer.status_code == 400
    assert answer.json()["revision"] == ["deployment 'm' has no earlier revision to roll back to (it has 1)"]
    assert api("post", "/api/deployments/gone/rollback/").status_code == 404


def test_a_rollback_to_the_settings_it_has_changes_nothing_and_makes_no_revision(cluster, api, staff, tiny_model_dir):
    api("post", "/api/deployments/", body("m", tiny_model_dir))
    api("patch", "/api/deployments/m/", {"sleep": {"idle_timeout_s": 60}})

    answer = api("post", "/api/deployments/m/rollback/", {"revision": 2})

    assert answer.status_code == 200
    assert answer.json()["rollback"] == {"to": 2, "revision": None, "changes": {}}
    assert [r["revision"] for r in history(staff, "m")] == [2, 1]


def test_a_change_committed_while_a_rollback_reads_its_target_is_the_one_it_rolls_back(
    cluster, api, staff, monkeypatch, tiny_model_dir
):
    api("post", "/api/deployments/", body("m", tiny_model_dir))
    api("patch", "/api/deployments/m/", {"sleep": {"idle_timeout_s": 60}})
    read = revisions.target
    reads: list[int] = []

    # Another caller's change commits after the rollback read "the one before the current" (1)
    # and before it locks the deployment: the rollback reads again and returns to 2, undoing only
    # the newest change, as a rollback begun after that change would.
    def read_then_changed(deployment, number):
        found = read(deployment, number)
        reads.append(found.revision.number)
        if len(reads) == 1:
            deployments.update("m", {"idle_timeout_s": 90.0}, by="other")
        return found

    monkeypatch.setattr(revisions, "target", read_then_changed)

    answer = api("post", "/api/deployments/m/rollback/", {})

    assert answer.status_code == 200, answer.json()
    assert reads == [1, 2]
    assert answer.json()["rollback"] == {
        "to": 2,
        "revision": 4,
        "changes": {"sleep.idle_timeout_s": {"before": 90.0, "after": 60.0}},
    }
    assert Deployment.objects.get(name="m").idle_timeout_s == 60.0
    assert [(r["revision"], r["cause"]) for r in history(staff, "m")][:2] == [
        (4, "rolled back to revision 2"),
        (3, "settings changed"),
    ]


def test_a_rollback_outpaced_by_changes_is_a_409_and_rolls_nothing_back(
    cluster, api, staff, monkeypatch, tiny_model_dir
):
    api("post", "/api/deployments/", body("m", tiny_model_dir))
    api("patch", "/api/deployments/m/", {"sleep": {"idle_timeout_s": 60}})
    read = revisions.target
    seconds = iter(range(100, 1000, 100))

    def read_then_changed(deployment, number):
        found = read(deployment, number)
        deployments.update("m", {"idle_timeout_s": float(next(seconds))}, by="other")
        return found

    monkeypatch.setattr(revisions, "target", read_then_changed)

    answer = api("post", "/api/deployments/m/rollback/", {})

    assert answer.status_code == 409
    assert answer.json()["detail"] == "deployment 'm' changed 3 times while rolling back; try again"
    assert Deployment.objects.get(name="m").idle_timeout_s == 300.0, "the last change stands"
    assert {r["cause"] for r in history(staff, "m")} == {"deployed", "settings changed"}


def test_only_the_newest_revisions_are_kept(cluster, api, staff, tiny_model_dir, settings):
    settings.GPUPORTAL_REVISIONS_KEPT = 3
    api("post", "/api/deployments/", body("m", tiny_model_dir))
    for seconds in (10, 20, 30, 40):
        api("patch", "/api/deployments/m/", {"sleep": {"idle_timeout_s": seconds}})

    shown = history(staff, "m")

    assert [r["revision"] for r in shown] == [5, 4, 3]
    assert shown[-1]["changes"] is None, "what the oldest kept changed is forgotten with the one before it"
    assert api("post", "/api/deployments/m/rollback/", {"revision": 1}).json() == {
        "revision": ["deployment 'm' has no revision 1 (kept: 3, 4, 5)"]
    }


def test_a_setting_a_revision_did_not_keep_is_left_as_it_is_by_a_rollback(cluster, api, tiny_model_dir):
    # A revision written before the spec had autoscale: a rollback to it leaves autoscale alone.
    api("post", "/api/deployments/", body("m", tiny_model_dir))
    first = DeploymentRevision.objects.get(deployment__name="m", number=1)
    first.settings = {k: v for k, v in first.settings.items() if not k.startswith("autoscale_")}
    first.save()
    api("patch", "/api/deployments/m/", {"sleep": {"idle_timeout_s": 60}, "autoscale": {"max_replicas": 4}})

    answer = api("post", "/api/deployments/m/rollback/", {"revision": 1})

    assert answer.json()["rollback"]["changes"] == {"sleep.idle_timeout_s": {"before": 60.0, "after": 300.0}}
    assert Deployment.objects.get(name="m").autoscale_max_replicas == 4


def test_a_deployment_made_without_a_revision_keeps_its_settings_before_its_first_change(cluster, api, staff):
    from tests.support import factories as f

    f.deployment("old", idle_timeout_s=120)  # a row written as a tool or an older portal wrote it

    api("patch", "/api/deployments/old/", {"sleep": {"idle_timeout_s": 60}})

    assert [(r["revision"], r["cause"]) for r in history(staff, "old")] == [
        (2, "settings changed"),
        (1, revisions.UNRECORDED),
    ]
    api("post", "/api/deployments/old/rollback/")
    assert Deployment.objects.get(name="old").idle_timeout_s == 120


def test_anyone_may_read_the_history_but_only_staff_roll_back(cluster, api, tiny_model_dir, client):
    from django.contrib.auth.models import User

    api("post", "/api/deployments/", body("m", tiny_model_dir))
    api("patch", "/api/deployments/m/", {"sleep": {"idle_timeout_s": 60}})
    client.force_login(User.objects.create_user("reader"))

    assert client.get("/api/deployments/m/revisions/").status_code == 200
    assert client.post("/api/deployments/m/rollback/", {}, content_type="application/json").status_code == 403
    assert Deployment.objects.get(name="m").idle_timeout_s == 60.0


@pytest.mark.django_db(transaction=True)
def test_changes_made_at_once_each_get_a_revision_of_their_own(cluster, tiny_model_dir):
    from scheduling.services.deployments import DeploymentSpec, ModelFacts

    deployments.create(
        DeploymentSpec(name="m", source=str(tiny_model_dir), override_bytes=300 * 1024**2),
        facts=ModelFacts(weight_bytes=2**20, estimate_bytes=300 * 1024**2),
    )
    # Both read the newest number before either writes: the deployment's row lock makes one wait
    # for the other's commit, so neither takes the other's number (a unique constraint holds it).
    together = threading.Barrier(4)
    failures: list[BaseException] = []

    def change(seconds: float) -> None:
        from django.db import connection

        try:
            together.wait()
            deployments.update("m", {"idle_timeout_s": seconds}, by=f"user{seconds:g}")
        except BaseException as err:  # reported by the assertion below
            failures.append(err)
        finally:
            connection.close()

    threads = [threading.Thread(target=change, args=(float(n),)) for n in range(10, 50, 10)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert failures == []
    kept = list(DeploymentRevision.objects.filter(deployment__name="m").order_by("number"))
    assert [r.number for r in kept] == [1, 2, 3, 4, 5]
    assert sorted(r.by for r in kept[1:]) == ["user10", "user20", "user30", "user40"]
    # Each revision holds what its change left: the newest is the deployment as it stands.
    assert kept[-1].settings["idle_timeout_s"] == Deployment.objects.get(name="m").idle_timeout_s


@pytest.mark.django_db(transaction=True)
def test_history_and_rollback_on_the_command_line(cluster, live_server, capsys, dispatched, tiny_model_dir):
    import json

    from tests.support.cli import staff_cli

    run = staff_cli(live_server, capsys)
    assert run("deploy", "m", str(tiny_model_dir), "--no-wait")[0] == 0
    assert run("set", "m", "sleep.idle_timeout_s=60", "placement.node_selector=gpu=h100")[0] == 0

    code, out, _ = run("history", "m")
    assert code == 0
    # The table wraps its last column to the terminal's width: read as words.
    # Each revision's age ("3 s ago") is left out: it is the clock's.
    words = re.sub(r"\d+ s ago ", "", " ".join(out.split()))
    assert words.startswith("REVISION WHEN BY CAUSE CHANGES 1 ops deployed - 2 (current) ops")
    assert words.endswith('settings changed sleep.idle_timeout_s 300 → 60; placement.node_selector "" → gpu=h100')
    code, out, _ = run("history", "m", "--revision", "1")
    assert code == 0 and "sleep.idle_timeout_s=300" in out.splitlines()
    assert [r["revision"] for r in json.loads(run("history", "m", "-o", "json")[1])] == [2, 1]
    assert run("history", "m", "--revision", "9") == (1, "", "error: history: m has no revision 9 (kept: 1, 2)")

    assert run("rollback", "m") == (
        0,
        "m: rolled back to revision 1 (now revision 3): sleep.idle_timeout_s 60 → 300 (applies at once); "
        'placement.node_selector gpu=h100 → "" (applies to replicas placed from now on)',
        "",
    )
    assert Deployment.objects.get(name="m").placement_node_selector == ""
    assert run("rollback", "m", "--to", "3") == (0, "m: its settings are revision 3's already; nothing changed", "")
    with pytest.raises(SystemExit) as refused:
        run("rollback", "m", "--to", "0")
    assert refused.value.code == 2 and "argument --to: must be 1 or more, not 0" in capsys.readouterr().err


def test_the_admin_shows_the_history_and_rolls_back_to_the_revision_before(
    cluster, api, admin_client, django_capture_on_commit_callbacks, tiny_model_dir
):
    from django.contrib.messages import get_messages

    api("post", "/api/deployments/", body("m", tiny_model_dir))
    api("post", "/api/deployments/", body("only", tiny_model_dir))
    api("patch", "/api/deployments/m/", {"sleep": {"idle_timeout_s": 60}})
    page = admin_client.get(f"/admin/scheduling/deployment/{Deployment.objects.get(name='m').pk}/change/")
    assert page.status_code == 200
    assert "sleep.idle_timeout_s 300.0 → 60.0" in page.content.decode()

    selected = list(Deployment.objects.order_by("name").values_list("pk", flat=True))
    with django_capture_on_commit_callbacks(execute=True):
        done = admin_client.post(
            "/admin/scheduling/deployment/", {"_selected_action": selected, "action": "roll_back_deployments"}
        )

    assert done.status_code == 302
    said = [str(m) for m in get_messages(done.wsgi_request)]
    assert "m: rolled back to revision 1 (now revision 3): sleep.idle_timeout_s 60.0 → 300.0" in said, said
    assert any(m.startswith("only: revision: deployment 'only' has no earlier revision") for m in said), said
    assert Deployment.objects.get(name="m").idle_timeout_s == 300.0
    assert DeploymentRevision.objects.get(deployment__name="m", number=3).by == "admin (admin)"


def test_the_admin_reads_the_history_in_the_same_queries_however_long_it_is(cluster, api, admin_client, tiny_model_dir):
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    api("post", "/api/deployments/", body("m", tiny_model_dir))
    page = f"/admin/scheduling/deployment/{Deployment.objects.get(name='m').pk}/change/"

    def queries_for_page() -> tuple[int, str]:
        with CaptureQueriesContext(connection) as read:
            shown = admin_client.get(page)
        assert shown.status_code == 200
        return len(read), shown.content.decode()

    api("patch", "/api/deployments/m/", {"sleep": {"idle_timeout_s": 60}})
    queries_for_page()  # the content types, which the first page of a process reads and caches
    short, _ = queries_for_page()
    for seconds in range(70, 130, 10):
        api("patch", "/api/deployments/m/", {"sleep": {"idle_timeout_s": seconds}})
    long, shown = queries_for_page()

    assert long == short
    assert "sleep.idle_timeout_s 110.0 → 120.0" in shown and "sleep.idle_timeout_s 300.0 → 60.0" in shown

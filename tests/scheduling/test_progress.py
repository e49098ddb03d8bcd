"""A waiting caller sees what its request waits for: the request's `progress` (phase,
percent of a load or a wake, place in the queue, an estimate from the deployment's last load or
wake), and a streamed /v1 call's SSE comments until its first token."""

from __future__ import annotations

import json
import urllib.request

import pytest
from django.contrib.auth.models import User
from hypothesis import given
from hypothesis import strategies as st
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from inference.devices import virtual_gpus
from scheduling.core.progress import ReplicaFacts, describe
from scheduling.models import Replica
from scheduling.services import requests as request_services
from scheduling.services.nodes import register_node
from tests.support import factories
from tests.support.factories import NO_OVERHEAD
from tests.support.processes import StandIn

MiB = 1024**2
STATES = ("pending", "loading", "waking", "serving")


def facts(*pairs: tuple[str, int | None]) -> tuple[ReplicaFacts, ...]:
    return tuple(ReplicaFacts(state, percent) for state, percent in pairs)


# -- the description, pure -----------------------------------------------------------------------


def test_a_request_behind_a_loading_replica_says_how_far_the_load_is_and_how_long_is_left():
    progress = describe("waking", facts(("loading", 40)), queue_position=2, load_s=10.0, wake_s=1.0)

    assert progress.record() == {"phase": "loading", "percent": 40, "queue_position": 2, "estimate_s": 6.0}
    assert progress.line("tiny") == "loading tiny 40 %, #2 in line, about 6 s"


def test_the_replica_nearest_to_serving_is_the_one_described():
    replicas = facts(("pending", None), ("loading", 80), ("waking", 10))

    assert describe("waking", replicas, queue_position=1, load_s=None, wake_s=4.0).phase == "waking"
    assert describe(
        "queued", (*replicas, *facts(("serving", 100))), queue_position=3, load_s=None, wake_s=None
    ).record() == {
        "phase": "queued",
        "percent": None,
        "queue_position": 3,
        "estimate_s": None,
    }


def test_a_wake_not_yet_placed_is_placing_with_the_last_load_as_its_estimate():
    assert describe("waking", (), queue_position=1, load_s=12.5, wake_s=None).record() == {
        "phase": "placing",
        "percent": None,
        "queue_position": 1,
        "estimate_s": 12.5,
    }
    assert describe("waking", facts(("pending", None)), queue_position=1, load_s=None, wake_s=None).estimate_s is None


@pytest.mark.parametrize("status", ["done", "failed", "cancelled"])
def test_an_ended_request_says_how_it_ended_and_nothing_more(status):
    assert describe(status, facts(("loading", 50)), queue_position=None, load_s=9, wake_s=9).record() == {
        "phase": status,
        "percent": None,
        "queue_position": None,
        "estimate_s": None,
    }


@given(
    status=st.sampled_from(["queued", "waking", "dispatched", "running"]),
    replicas=st.lists(st.tuples(st.sampled_from(STATES), st.none() | st.integers(-5, 120)), max_size=4),
    measured=st.none() | st.floats(0, 1e4),
)
def test_percent_stays_within_0_and_100_and_the_estimate_within_the_measured_time(status, replicas, measured):
    progress = describe(status, facts(*replicas), queue_position=1, load_s=measured, wake_s=measured)

    assert progress.percent is None or 0 <= progress.percent <= 100
    assert progress.estimate_s is None or (measured is not None and 0 <= progress.estimate_s <= measured + 0.05)
    assert (progress.phase == "running") == (status in ("dispatched", "running"))


# -- through the API ---------------------------------------------------------------------------------


@pytest.fixture
def loading(transactional_db, tiny_model_dir) -> Replica:
    """A deployment whose one replica is 40 % through its load, and whose last load took 10 s."""
    register_node("node1", virtual_gpus("node1", "1x1GiB", NO_OVERHEAD), virtual=True)
    deployment = factories.deployment(
        name="tiny", model_source=str(tiny_model_dir), memory_override_bytes=MiB, measured_load_s=10.0
    )
    request_services.queue.cache_clear()
    request_services.queue().fail_queued("tiny", reason="left over from another test")
    return Replica.objects.create(deployment=deployment, state=Replica.State.LOADING, progress=40)


def test_a_polled_request_shows_the_load_it_waits_for_then_its_turn_then_its_end(loading):
    alice = APIClient()
    alice.force_authenticate(User.objects.create_user("alice"))
    first = alice.post("/api/requests/", {"deployment": "tiny", "input": "one"}, format="json").json()
    second = alice.post("/api/requests/", {"deployment": "tiny", "input": "two"}, format="json").json()

    assert first["progress"] == {"phase": "loading", "percent": 40, "queue_position": 1, "estimate_s": 6.0}
    assert alice.get(f"/api/requests/{second['id']}/").json()["progress"]["queue_position"] == 2
    Replica.objects.filter(pk=loading.pk).update(state=Replica.State.SERVING, progress=100)
    assert alice.get(f"/api/requests/{second['id']}/").json()["progress"] == {
        "phase": "queued",
        "percent": None,
        "queue_position": 2,
        "estimate_s": None,
    }
    StandIn(loading.id, 2).run()
    listed = alice.get("/api/requests/").json()["results"]
    assert [r["progress"]["phase"] for r in listed] == ["done", "done"]


def test_a_streamed_call_says_what_it_waits_for_in_sse_comments_before_its_first_token(live_server, loading):
    key = Token.objects.create(user=User.objects.create_user("alice")).key
    call = urllib.request.Request(
        f"{live_server.url}/v1/completions",
        data=json.dumps({"model": "tiny", "prompt": "abc", "stream": True}).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"},
    )
    with urllib.request.urlopen(call, timeout=30) as stream:
        # Before any token: a comment line, which OpenAI's clients skip.
        assert stream.readline() == b": loading tiny 40 %, #1 in line, about 6 s\n"
        assert stream.readline() == b"\n"
        Replica.objects.filter(pk=loading.pk).update(state=Replica.State.SERVING, progress=100)
        StandIn(loading.id, 1).start()
        rest = stream.read().decode()

    events = [line for line in rest.splitlines() if line]
    data = [json.loads(line.removeprefix("data: ")) for line in events if line.startswith("data: {")]
    assert "".join(d["choices"][0]["text"] for d in data) == "ABC"
    assert events[-1] == "data: [DONE]"
    # Comments only before the first token, each saying something new.
    first_token = next(i for i, line in enumerate(events) if line.startswith("data: "))
    comments = [line for line in events if line.startswith(":")]
    assert all(events.index(c) < first_token for c in comments) and len(set(comments)) == len(comments)

"""Per-user limits on inference requests: requests in flight at once and per minute,
from the settings or a user's row in the admin, answered with 429 and Retry-After, counted in
/metrics. Nothing serves the queue here, so an accepted request stays in flight until a test
ends it (a stand-in replica thread) or cancels it."""

from __future__ import annotations

import threading

import openai
import pytest
import redis
from django.conf import settings
from django.contrib.auth.models import User
from django.db import connection
from django.test import Client
from django.urls import reverse
from prometheus_client.parser import text_string_to_metric_families
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from gpuportal.wire.ownerlimits import ADMITTED_GRACE_S, OwnerLimits, in_flight_key, minute_key
from gpuportal.wire.requestqueue import request_key
from scheduling.models import Replica, UserLimits
from scheduling.services import requests as request_services
from scheduling.services import user_limits
from scheduling.services.errors import TooManyRequests
from tests.support import factories as f
from tests.support.processes import StandIn


@pytest.fixture(autouse=True)
def _no_counts_or_cached_limits() -> None:
    """Each test starts with no request, no count and no remembered user limits."""
    client = redis.Redis.from_url(settings.REDIS_URL)
    for key in client.scan_iter("gp:*"):  # only the portal's keys: REDIS_URL may be a developer's
        client.delete(key)
    user_limits.forget()
    request_services.queue.cache_clear()


@pytest.fixture
def replica(db) -> Replica:
    """A deployment `tiny` whose replica the database says is serving, with no process behind it."""
    return f.replica(f.deployment("tiny"), f.node("node1"), state=Replica.State.SERVING)


@pytest.fixture
def alice(db) -> User:
    return User.objects.create_user("alice")


def token_client(user: User) -> APIClient:
    """With a token header, /infer/ and /v1 take their fast paths (no DRF)."""
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.create(user=user).key}")
    return client


def signed_in(user: User) -> APIClient:
    """Authenticated without a header: every view goes the DRF way."""
    client = APIClient()
    client.force_authenticate(user)
    return client


def submit(client: APIClient, text: str = "hi") -> object:
    return client.post("/api/requests/", {"deployment": "tiny", "input": text}, format="json")


def depth() -> int:
    return request_services.queue_depth("tiny")


def limited_counts() -> dict[str, float]:
    """gpuportal_requests_limited_total by reason, as /metrics shows it."""
    text = Client().get("/metrics").content.decode()
    return {
        sample.labels["reason"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "gpuportal_requests_limited_total"
    }


# -- requests in flight -------------------------------------------------------------------------


@pytest.mark.parametrize("way", ["submit", "infer by token", "infer signed in"])
def test_a_user_past_their_concurrent_limit_gets_a_429_with_retry_after_and_nothing_is_queued(
    replica, alice, settings, way
):
    settings.GPUPORTAL_USER_MAX_CONCURRENT = 2
    client = token_client(alice)
    assert submit(client).status_code == submit(client).status_code == 202

    if way == "submit":
        response = submit(client)
    else:
        caller = client if way == "infer by token" else signed_in(alice)
        response = caller.post("/api/deployments/tiny/infer/", {"input": "x", "timeout_s": 5}, format="json")

    assert response.status_code == 429, response.content
    assert response["Retry-After"] == "1"
    body = response.json()
    assert body["limit"] == "concurrent" and body["retry_after_s"] == 1
    assert "at most 2 at once" in body["detail"]
    assert depth() == 2, "the refused request was not queued"


def test_a_place_in_flight_frees_once_a_request_ends_or_is_cancelled(replica, alice, settings):
    settings.GPUPORTAL_USER_MAX_CONCURRENT = 1
    client = token_client(alice)
    first = submit(client, "one").json()["id"]
    assert submit(client, "two").status_code == 429

    assert client.delete(f"/api/requests/{first}/").json()["status"] == "cancelled"
    second = submit(client, "two")
    assert second.status_code == 202
    assert submit(client, "three").status_code == 429

    StandIn(replica.id, 1).run()  # takes the second and answers it, here in this thread
    assert client.get(f"/api/requests/{second.json()['id']}/").json()["status"] == "done"
    assert submit(client, "three").status_code == 202


def test_a_request_refused_for_another_reason_holds_no_place(replica, alice, settings):
    settings.GPUPORTAL_USER_MAX_CONCURRENT = 1
    client = token_client(alice)

    missing = client.post("/api/requests/", {"deployment": "nope", "input": "x"}, format="json")

    assert missing.status_code == 404
    assert submit(client).status_code == 202, "the 404's place was given back at once"


def test_a_place_taken_by_a_web_process_that_died_before_queueing_frees_after_the_grace():
    limits = OwnerLimits(redis.Redis.from_url(settings.REDIS_URL))
    owner = "7"
    # Admitted ids with no request behind them: one a moment ago (its request is on its way), one
    # from a web process that died between the admission and the queueing, long before the grace.
    assert limits.admit(owner, "on-its-way", max_in_flight=2, max_per_minute=0) is None
    limits.redis.zadd(in_flight_key(owner), {"orphan": 1.0 - ADMITTED_GRACE_S})

    assert limits.admit(owner, "next", max_in_flight=2, max_per_minute=0) is None, "the orphan counts no more"
    refused = limits.admit(owner, "one-too-many", max_in_flight=2, max_per_minute=0)

    assert refused is not None and refused.limit == "concurrent"
    assert {m.decode() for m in limits.redis.zrange(in_flight_key(owner), 0, -1)} == {"on-its-way", "next"}


# -- requests per minute ------------------------------------------------------------------------


def test_a_user_past_their_per_minute_limit_waits_for_the_end_of_the_minute(replica, alice, settings):
    settings.GPUPORTAL_USER_MAX_PER_MINUTE = 2
    client = token_client(alice)
    assert submit(client).status_code == submit(client).status_code == 202

    response = submit(client)

    assert response.status_code == 429
    assert response.json()["limit"] == "per_minute" and "at most 2 a minute" in response.json()["detail"]
    retry_after = int(response["Retry-After"])
    assert 1 <= retry_after <= 60
    # Retry-After is what is left of the minute the first request started (it only shrinks).
    assert 0 < redis.Redis.from_url(settings.REDIS_URL).pttl(minute_key(str(alice.pk))) <= retry_after * 1000
    assert depth() == 2

    redis.Redis.from_url(settings.REDIS_URL).delete(minute_key(str(alice.pk)))  # the minute is over
    assert submit(client).status_code == 202


def test_a_refused_request_counts_against_neither_limit(replica, alice, settings):
    settings.GPUPORTAL_USER_MAX_CONCURRENT = 1
    settings.GPUPORTAL_USER_MAX_PER_MINUTE = 2
    client = token_client(alice)
    first = submit(client).json()["id"]
    for _ in range(3):
        assert submit(client).json()["limit"] == "concurrent"

    client.delete(f"/api/requests/{first}/")

    second = submit(client)
    assert second.status_code == 202, "three refusals used none of the minute's two requests"
    client.delete(f"/api/requests/{second.json()['id']}/")
    assert submit(client).json()["limit"] == "per_minute"


def test_without_limits_a_request_is_counted_nowhere(replica, alice):
    client = token_client(alice)

    assert all(submit(client).status_code == 202 for _ in range(5))

    assert not list(redis.Redis.from_url(settings.REDIS_URL).scan_iter("gp:user:*"))


# -- a user's own limits, in the admin -----------------------------------------------------------


def test_a_users_own_limits_beat_the_settings_and_zero_is_no_limit(replica, alice, settings):
    settings.GPUPORTAL_USER_MAX_CONCURRENT = 1
    bob, carol = User.objects.create_user("bob"), User.objects.create_user("carol")
    UserLimits.objects.create(user=alice, max_concurrent=3)
    UserLimits.objects.create(user=carol, max_concurrent=0, max_per_minute=None)

    alices, bobs, carols = token_client(alice), token_client(bob), token_client(carol)

    assert [submit(alices).status_code for _ in range(4)] == [202, 202, 202, 429]
    assert [submit(bobs).status_code for _ in range(2)] == [202, 429], "no row: the setting"
    assert all(submit(carols).status_code == 202 for _ in range(5)), "0: no limit"


def test_staff_set_a_users_limits_in_the_admin_and_they_hold_at_once(replica, alice, settings):
    ops = User.objects.create_user("ops", is_staff=True)  # staff, with no permission granted
    admin = Client()
    admin.force_login(ops)
    owner = str(alice.pk)
    assert user_limits.limits_of(owner) == user_limits.Limits(0, 0)  # read, and remembered

    added = admin.post(reverse("admin:scheduling_userlimits_add"), {"user": alice.pk, "max_concurrent": 1})

    assert added.status_code == 302, added.content.decode()[-2000:]
    assert user_limits.limits_of(owner) == user_limits.Limits(1, 0)
    client = token_client(alice)
    assert [submit(client).status_code for _ in range(2)] == [202, 429]

    row = UserLimits.objects.get(user=alice)
    changed = admin.post(
        reverse("admin:scheduling_userlimits_change", args=[row.pk]),
        {"user": alice.pk, "max_concurrent": 2, "max_per_minute": ""},
    )
    assert changed.status_code == 302
    assert [submit(client).status_code for _ in range(2)] == [202, 429]

    listed = admin.get(reverse("admin:scheduling_userlimits_changelist")).content.decode()
    assert "alice" in listed and "no limit (the default)" in listed

    stranger = Client()
    stranger.force_login(User.objects.create_user("mallory"))
    assert stranger.get(reverse("admin:scheduling_userlimits_changelist")).status_code == 302, "to the login"


# -- /v1 ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["answer", "stream"])
@pytest.mark.parametrize("way", ["bearer token", "session"])
def test_v1_answers_a_limited_call_in_openais_rate_limit_shape_with_retry_after(replica, alice, settings, way, stream):
    settings.GPUPORTAL_USER_MAX_CONCURRENT = 1
    request_services.submit(
        "tiny", kind="chat", input=[{"role": "user", "content": "x"}], params={}, owner=str(alice.pk)
    )
    client = Client()
    headers = {}
    if way == "session":
        client.force_login(alice)  # through DRF
    else:
        headers["HTTP_AUTHORIZATION"] = f"Bearer {Token.objects.create(user=alice).key}"  # without DRF
    body = {"model": "tiny", "messages": [{"role": "user", "content": "y"}], "stream": stream}

    response = client.post("/v1/chat/completions", body, content_type="application/json", **headers)

    assert response.status_code == 429
    assert response["Retry-After"] == "1"
    error = response.json()["error"]
    assert (error["type"], error["code"], error["param"]) == ("requests", "rate_limit_exceeded", None)
    assert "too many requests in flight" in error["message"]
    assert depth() == 1


@pytest.mark.parametrize("stream", [False, True], ids=["answer", "stream"])
def test_a_call_of_several_choices_past_the_limit_is_refused_whole_leaving_nothing_queued(
    replica, alice, settings, stream
):
    settings.GPUPORTAL_USER_MAX_CONCURRENT = 2
    headers = {"HTTP_AUTHORIZATION": f"Bearer {Token.objects.create(user=alice).key}"}
    body = {"model": "tiny", "messages": [{"role": "user", "content": "y"}], "n": 3, "stream": stream}

    response = Client().post("/v1/chat/completions", body, content_type="application/json", **headers)

    assert response.status_code == 429 and "too many requests in flight" in response.json()["error"]["message"]
    assert depth() == 0, "the two choices queued before the third was refused are cancelled"


def test_openais_client_raises_its_rate_limit_error_and_reads_retry_after(live_server, replica, alice, settings):
    settings.GPUPORTAL_USER_MAX_PER_MINUTE = 1
    key = Token.objects.create(user=alice).key
    with openai.OpenAI(base_url=f"{live_server.url}/v1", api_key=key, max_retries=0, timeout=30) as client:
        StandIn(replica.id, 1).start()
        assert client.completions.create(model="tiny", prompt="first", max_tokens=5).choices[0].text == "FIRST"

        with pytest.raises(openai.RateLimitError) as caught:
            client.completions.create(model="tiny", prompt="second", max_tokens=5)

    assert 1 <= int(caught.value.response.headers["Retry-After"]) <= 60
    assert caught.value.code == "rate_limit_exceeded"


# -- /metrics ------------------------------------------------------------------------------------


def test_each_refusal_is_counted_in_metrics_by_the_limit_it_passed_never_by_user(replica, alice, settings):
    before = limited_counts()
    settings.GPUPORTAL_USER_MAX_CONCURRENT = 1
    settings.GPUPORTAL_USER_MAX_PER_MINUTE = 2
    client = token_client(alice)
    first = submit(client).json()["id"]
    assert submit(client).status_code == submit(client).status_code == 429  # in flight
    client.delete(f"/api/requests/{first}/")
    assert submit(client).status_code == 202
    assert submit(client).status_code == 429  # the minute's two are used

    after = limited_counts()

    assert set(after) == {"concurrent", "per_minute"}
    assert after["concurrent"] - before.get("concurrent", 0) == 2
    assert after["per_minute"] - before.get("per_minute", 0) == 1


# -- at once ---------------------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("limit", ["concurrent", "per_minute"])
def test_simultaneous_submits_of_one_user_admit_exactly_their_limit(replica, alice, settings, limit):
    allowed, callers = 3, 12
    if limit == "concurrent":
        settings.GPUPORTAL_USER_MAX_CONCURRENT = allowed
    else:
        settings.GPUPORTAL_USER_MAX_PER_MINUTE = allowed
    owner = str(alice.pk)
    barrier = threading.Barrier(callers)
    accepted: list[str] = []
    refused: list[TooManyRequests] = []
    failed: list[BaseException] = []

    def caller(n: int) -> None:
        try:
            barrier.wait(timeout=30)
            try:
                request = request_services.submit("tiny", kind="generate", input=f"n{n}", params={}, owner=owner)
            except TooManyRequests as exc:
                refused.append(exc)
            else:
                accepted.append(request.id)
        except BaseException as exc:  # reported by the test, not lost in the thread
            failed.append(exc)
        finally:
            connection.close()  # this thread's own database connection

    threads = [threading.Thread(target=caller, args=(n,)) for n in range(callers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)

    assert not failed, failed
    assert len(accepted) == allowed and len(refused) == callers - allowed
    assert {exc.limit for exc in refused} == {limit}
    assert depth() == allowed
    queue = request_services.queue()
    assert all(queue.redis.hget(request_key(request_id), "owner").decode() == owner for request_id in accepted)
    if limit == "per_minute":
        assert int(queue.redis.get(minute_key(owner))) == allowed
        assert all(1 <= exc.retry_after_s <= 60 for exc in refused)
    else:
        assert {m.decode() for m in queue.redis.zrange(in_flight_key(owner), 0, -1)} == set(accepted)

"""A failover standby gives back what its dead partner had taken at the lock grant, not
when the control plane hears of the death: the request that waited longest is first in line when
the standby wakes. On the real Redis; the grant is the lease's (inference.failover.Grant)."""

from __future__ import annotations

import pytest
import redis
from django.conf import settings

from gpuportal.wire.requestqueue import RequestQueue, WrittenOff
from inference.failover import Grant
from inference.pairing import give_back_from


@pytest.fixture
def rq() -> RequestQueue:
    client = redis.Redis.from_url(settings.REDIS_URL)
    for key in client.scan_iter("gp:*"):  # only the queue's own keys: REDIS_URL may be a developer's
        client.delete(key)
    return RequestQueue.from_url(settings.REDIS_URL)


def grant(previous: str | None) -> Grant:
    return Grant(epoch=2, previous_holder=previous, previous_epoch=1, granted_monotonic=0.0)


def test_at_the_grant_the_dead_actives_request_goes_back_first_in_line_and_it_may_take_no_more(rq):
    waited = rq.submit("pair", kind="generate", input="first", params={}, owner="1").id
    later = rq.submit("pair", kind="generate", input="second", params={}, owner="1").id
    assert rq.take("pair", "dead-active", timeout=1).id == waited

    given = give_back_from(rq, "pair", grant("dead-active"), "standby")

    assert given == {waited: "requeued"}
    assert rq.get(waited).status == "queued"
    assert [rq.take("pair", "standby", timeout=1).id for _ in range(2)] == [waited, later]
    with pytest.raises(WrittenOff):
        rq.take("pair", "dead-active", timeout=0.1)


def test_a_first_grant_or_a_fresh_process_of_the_holder_gives_back_nothing(rq):
    rq.submit("pair", kind="generate", input="x", params={}, owner="1")
    taken = rq.take("pair", "holder", timeout=1).id

    assert give_back_from(rq, "pair", grant("holder"), "holder") == {}
    assert give_back_from(rq, "pair", grant(None), "standby") == {}
    assert rq.get(taken).status == "dispatched"

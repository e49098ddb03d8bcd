"""Answers between the planes (gpuportal.wire.replies) on a real Redis: a wait outlasts the
client's socket timeout, as a deploy's wait for a slow first inspection must."""

from __future__ import annotations

import threading

import pytest
import redis
from django.conf import settings

from gpuportal.wire import replies


class CountingRedis(redis.Redis):
    """Counts its BLPOPs, so the test answers only once the waiter has blocked past its socket timeout."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.blocks = 0
        self.blocked_long = threading.Event()

    def blpop(self, keys, timeout=0):
        self.blocks += 1
        if self.blocks == 4:
            self.blocked_long.set()
        return super().blpop(keys, timeout)


def test_a_wait_longer_than_the_clients_socket_timeout_gets_its_answer():
    # redis-py 8 gives a client a 5 s socket timeout by default; a tighter one here makes the
    # same failure quick: one BLPOP blocking past it raised "Timeout reading from socket".
    waiter = CountingRedis.from_url(settings.REDIS_URL, socket_timeout=0.6)
    answerer = redis.Redis.from_url(settings.REDIS_URL)
    reply_to = replies.new_list("test")

    def answer_late() -> None:
        # Four blocks of at most half the socket timeout: the waiter has waited past it.
        if waiter.blocked_long.wait(timeout=30):
            replies.answer(answerer, reply_to, result={"read": "late"})

    thread = threading.Thread(target=answer_late)
    thread.start()
    try:
        assert replies.wait(waiter, reply_to, 30, "a late answer") == {"read": "late"}
    finally:
        waiter.blocked_long.set()
        thread.join()
    assert waiter.blocks >= 4


def test_a_wait_nobody_answers_ends_at_its_timeout_naming_what_it_waited_for():
    waiter = redis.Redis.from_url(settings.REDIS_URL, socket_timeout=0.6)
    with pytest.raises(replies.TimedOut, match=r"no answer to reading the model.s files within 0\.5 s"):
        replies.wait(waiter, replies.new_list("test"), 0.5, "reading the model's files")


def test_a_refusal_comes_back_as_no_answer_with_the_other_sides_message():
    client = redis.Redis.from_url(settings.REDIS_URL)
    reply_to = replies.new_list("test")
    replies.answer(client, reply_to, error="no such file: /models/missing")
    with pytest.raises(replies.NoAnswer, match="reading the model's files: no such file: /models/missing") as raised:
        replies.wait(client, reply_to, 5, "reading the model's files")
    assert not isinstance(raised.value, replies.TimedOut), "an answer, not a wait to give up on"

"""The serving loop's batching, in-process over real Redis: requests queued together start in the
same step rather than one a step, and a step's streamed pieces go to the queue in one write,
before the answers that step ended. (tests/inference/test_serving.py runs the loop end to end in
replica processes.)"""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
import redis
from django.conf import settings
from transformers import AutoModelForCausalLM, AutoTokenizer

from gpuportal.wire.requestqueue import RECORDS_KEY, RequestQueue
from inference.batching import Batcher
from inference.management.commands.make_tiny_model import write_tiny_model
from inference.serving import Server
from tests.support.serving import gate_views, host_for


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Any, Any]:
    path = write_tiny_model(tmp_path_factory.mktemp("tiny-batched"), size_mb=2, seed=3, log=lambda _: None).path
    return AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


@pytest.fixture
def rq():
    client = redis.Redis.from_url(settings.REDIS_URL)
    yield RequestQueue(client)
    client.close()


def test_requests_queued_together_start_in_the_same_step_and_streams_get_every_piece_before_the_end(
    tiny, rq, monkeypatch
):
    model, tokenizer = tiny
    deployment = f"d-{uuid.uuid4().hex[:8]}"
    ids = [
        rq.submit(deployment, kind="generate", input=text, params={"max_tokens": 6, "stream": stream}, owner="u").id
        for text, stream in (("Hello", True), ("Once upon", False), ("GPU", True), ("Pack my box", False))
    ]
    admitted: list[int] = []  # how many sequences each step ran
    every_step = Batcher.step

    def counting(self: Batcher) -> list:
        ended = every_step(self)
        admitted.append(len(self.running) + len(ended))
        return ended

    monkeypatch.setattr(Batcher, "step", counting)
    single = []
    monkeypatch.setattr(rq, "chunk", lambda *args, **kwargs: single.append(args))
    server = Server(host_for(model, tokenizer), rq, deployment, poll_s=0.05)
    server.start()
    try:
        answers = [rq.wait(request_id, 60) for request_id in ids]
    finally:
        server.stopped.set()
        server.join(10)

    assert all(a is not None and a.status == "done" for a in answers), answers
    # All four were queued before the loop took its first: all four ran in its first step.
    assert admitted[0] == 4, admitted
    for request_id, answer in zip(ids[::2], answers[::2], strict=True):
        pieces, ended = rq.read_stream(request_id, 0, 0)
        assert ended and "".join(pieces) == answer.output["text"]
    assert single == [], "a batched stream's pieces go in the step's one write"


def test_a_request_held_to_a_format_whose_parser_is_being_prepared_holds_up_no_other_request(tiny, rq, monkeypatch):
    model, tokenizer = tiny
    tokenizer = AutoTokenizer.from_pretrained(tokenizer.name_or_path)  # no parser's view of it yet
    building, gate = gate_views(monkeypatch)
    deployment = f"d-{uuid.uuid4().hex[:8]}"
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    held = rq.submit(
        deployment, kind="generate", input="JSON:", params={"max_tokens": 40, "json_schema": schema}, owner="u"
    )
    server = Server(host_for(model, tokenizer), rq, deployment, poll_s=0.05)
    server.start()
    try:
        assert building.wait(30), "the held request was taken and its parser's view begun"
        # Taken after it, while its view is still being built, and streamed to its end.
        free = rq.submit(
            deployment, kind="generate", input="Hello", params={"max_tokens": 6, "stream": True}, owner="u"
        )
        answer = rq.wait(free.id, 60)
        still = rq.get(held.id)
        gate.set()
        held_answer = rq.wait(held.id, 60)
    finally:
        gate.set()
        server.stopped.set()
        server.join(10)

    assert answer is not None and answer.status == "done", answer
    pieces, ended = rq.read_stream(free.id, 0, 0)
    assert ended and "".join(pieces) == answer.output["text"]
    assert still is not None and still.status not in ("done", "failed"), still
    assert held_answer is not None and held_answer.status == "done", held_answer
    assert set(json.loads(held_answer.output["text"])) == {"ok"}


def test_a_batched_generation_records_when_its_first_token_came_between_its_start_and_its_end(tiny, rq):
    model, tokenizer = tiny
    deployment = f"d-{uuid.uuid4().hex[:8]}"
    request_id = rq.submit(deployment, kind="generate", input="Hello", params={"max_tokens": 8}, owner="u").id
    server = Server(host_for(model, tokenizer), rq, deployment, poll_s=0.05)
    server.start()
    try:
        answer = rq.wait(request_id, 60)
    finally:
        server.stopped.set()
        server.join(10)

    assert answer is not None and answer.status == "done", answer
    assert answer.created_at <= answer.started_at <= answer.first_token_at <= answer.finished_at, answer
    # The record the control plane drains into its recorded traffic carries it too.
    newest = [json.loads(raw) for raw in rq.redis.lrange(RECORDS_KEY, -100, -1)]
    (record,) = [r for r in newest if r["id"] == request_id]
    assert float(record["first_token_at"]) == pytest.approx(answer.first_token_at)

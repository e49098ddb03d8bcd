"""The OpenAI-compatible endpoints, called with the official `openai` client over HTTP (a live
server in the test process; a stand-in replica thread serves the queue)."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
from django.contrib.auth.models import User
from rest_framework.authtoken.models import Token

from inference.devices import virtual_gpus
from scheduling.models import Deployment, Replica
from scheduling.services import requests as request_services
from scheduling.services.nodes import register_node
from tests.processes import StandIn

MiB = 1024**2


@pytest.fixture
def replica(transactional_db, tiny_model_dir) -> Replica:
    register_node("node1", virtual_gpus("node1", "1x1GiB"), virtual=True)
    deployment = Deployment.objects.create(name="tiny", model_source=str(tiny_model_dir), memory_override_bytes=MiB)
    request_services.queue.cache_clear()
    request_services.queue().fail_queued("tiny", reason="left over from another test")
    return Replica.objects.create(deployment=deployment, state=Replica.State.SERVING)


@pytest.fixture
def client(live_server, replica) -> Iterator[openai.OpenAI]:
    key = Token.objects.create(user=User.objects.create_user("alice")).key
    # Closed at the end: a kept-alive connection keeps a server thread, and its database
    # connection, alive past the test.
    with openai.OpenAI(base_url=f"{live_server.url}/v1", api_key=key, max_retries=0, timeout=30) as client:
        yield client


def test_models_lists_causal_lm_deployments(client):
    assert [m.id for m in client.models.list()] == ["tiny"]


def test_a_completion_comes_back_in_the_openai_shape(client, replica):
    StandIn(replica.id, 1).start()

    completion = client.completions.create(model="tiny", prompt="hello there", max_tokens=5)

    assert completion.object == "text_completion" and completion.model == "tiny"
    assert completion.choices[0].text == "HELLO THERE" and completion.choices[0].finish_reason == "stop"
    assert completion.usage.completion_tokens == 11


def test_a_chat_completion_answers_the_last_message(client, replica):
    StandIn(replica.id, 1).start()

    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "system", "content": "be loud"}, {"role": "user", "content": "hi"}]
    )

    assert chat.object == "chat.completion"
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].message.content == "HI"


def test_a_streamed_chat_arrives_in_pieces_then_ends(client, replica):
    StandIn(replica.id, 1).start()

    stream = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "stream me"}], stream=True
    )
    chunks = list(stream)

    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert "".join(pieces) == "STREAM ME" and len(pieces) >= 3
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_a_streamed_completion_arrives_in_pieces(client, replica):
    StandIn(replica.id, 1).start()

    pieces = [c.choices[0].text for c in client.completions.create(model="tiny", prompt="abcdef", stream=True)]

    assert "".join(pieces) == "ABCDEF"


def test_bad_requests_fail_the_openai_way_naming_the_parameter(client, replica):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="nope", prompt="x")
    with pytest.raises(openai.BadRequestError, match="only n=1"):
        client.completions.create(model="tiny", prompt="x", n=2)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], temperature=5)
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model="tiny", messages=[])
    with pytest.raises(openai.BadRequestError, match="role"):
        client.chat.completions.create(model="tiny", messages=[{"role": "wizard", "content": "x"}])
    assert request_services.queue_depth("tiny") == 0, "nothing invalid was queued"


def test_input_too_long_for_the_model_is_a_400(client, replica):
    StandIn(replica.id, 1).start()
    with pytest.raises(openai.BadRequestError, match="input too long"):
        client.completions.create(model="tiny", prompt="too long")


def test_a_wrong_key_is_refused(live_server, replica):
    with (
        openai.OpenAI(base_url=f"{live_server.url}/v1", api_key="not-a-key", max_retries=0) as stranger,
        pytest.raises(openai.AuthenticationError),
    ):
        stranger.models.list()

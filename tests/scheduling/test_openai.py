"""The OpenAI-compatible endpoints, called with the official `openai` client over HTTP (a live
server in the test process; a stand-in replica thread serves the queue)."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from django.contrib.auth.models import User
from hypothesis import example, given
from hypothesis import strategies as st
from rest_framework.authtoken.models import Token
from transformers import AutoModelForCausalLM, AutoTokenizer

from inference.devices import virtual_gpus
from inference.serving import Server
from scheduling.api import completion_input
from scheduling.api.responses import ResponsesView
from scheduling.models import Deployment, Replica
from scheduling.services import requests as request_services
from scheduling.services.nodes import register_node
from tests.support import factories
from tests.support.factories import NO_OVERHEAD
from tests.support.processes import StandIn, wait_until
from tests.support.serving import host_for, tiny_llama_config

MiB = 1024**2


@pytest.fixture
def replica(transactional_db, tiny_model_dir) -> Replica:
    register_node("node1", virtual_gpus("node1", "1x1GiB", NO_OVERHEAD), virtual=True)
    request_services.queue.cache_clear()
    return factories.serving("tiny", model_source=str(tiny_model_dir), memory_override_bytes=MiB)


@pytest.fixture
def client(live_server, replica) -> Iterator[openai.OpenAI]:
    key = Token.objects.create(user=User.objects.create_user("alice")).key
    # Closed at the end: a kept-alive connection keeps a server thread, and its database
    # connection, alive past the test.
    with openai.OpenAI(base_url=f"{live_server.url}/v1", api_key=key, max_retries=0, timeout=30) as client:
        yield client


def test_models_lists_causal_lm_deployments(client):
    assert [m.id for m in client.models.list()] == ["tiny"]


def test_a_model_is_retrieved_by_its_name_and_a_wrong_one_is_openais_not_found(client):
    tiny = client.models.retrieve("tiny")
    assert (tiny.id, tiny.object, tiny.owned_by) == ("tiny", "model", "gpuportal")
    # vLLM's: the longest prompt and answer together its replicas serve (memory.max_tokens).
    assert tiny.max_model_len == Deployment.objects.get(name="tiny").max_tokens
    assert client.models.list().data[0].max_model_len == tiny.max_model_len

    for wrong in ("tinny", "org/tiny"):
        with pytest.raises(openai.NotFoundError) as missing:
            client.models.retrieve(wrong)
        error = missing.value.body
        assert error["type"] == "model_not_found" and error["param"] == "model", error
    assert "did you mean `tiny`?" in str(missing.value)


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


def test_a_message_in_openais_content_parts_is_read_as_its_text_parts_a_line_apart(client, replica):
    StandIn(replica.id, 1).start()
    parts = [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]

    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": parts}])

    assert chat.choices[0].message.content == "HI\nTHERE"
    with pytest.raises(openai.BadRequestError) as refused:
        image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": [parts[0], image]}])
    assert refused.value.body["param"] == "messages.0.content.1"
    assert "a part of type 'image_url' is not supported" in refused.value.body["message"]


def test_n_choices_are_a_request_each_in_the_order_asked_and_the_prompt_is_counted_once(client, replica):
    StandIn(replica.id, 3).start()

    completion = client.completions.create(model="tiny", prompt="hello", n=3, max_tokens=5)

    assert [(c.index, c.text) for c in completion.choices] == [(0, "HELLO"), (1, "HELLO"), (2, "HELLO")]
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (5, 15)


def test_a_list_of_prompts_is_answered_a_choice_each_n_apiece_in_openais_order(client, replica):
    StandIn(replica.id, 4).start()

    completion = client.completions.create(model="tiny", prompt=["a", "bb"], n=2, max_tokens=5)

    assert [c.text for c in completion.choices] == ["A", "A", "BB", "BB"]
    assert [c.index for c in completion.choices] == [0, 1, 2, 3]
    assert (completion.usage.prompt_tokens, completion.usage.total_tokens) == (3, 9)


def test_a_chat_of_n_choices_answers_each(client, replica):
    StandIn(replica.id, 2).start()

    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], n=2)

    assert [(c.index, c.message.content) for c in chat.choices] == [(0, "HI"), (1, "HI")]


def test_a_choice_that_fails_fails_the_call_and_what_has_not_started_is_cancelled(client, replica):
    StandIn(replica.id, 1).start()  # takes the first choice only, which fails as too long

    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="tiny", prompt=["too long", "b", "c"], max_tokens=5)

    assert refused.value.body["code"] == "context_length_exceeded"
    assert request_services.queue_depth("tiny") == 0, "nothing is left to run for a call that has failed"


def test_several_choices_stream_together_each_chunk_naming_its_index(client, replica):
    StandIn(replica.id, 2).start()

    stream = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "stream me"}], n=2, stream=True
    )
    chunks = list(stream)

    texts = {0: "", 1: ""}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == {0: "STREAM ME", 1: "STREAM ME"}
    finished = [(c.index, c.finish_reason) for chunk in chunks for c in chunk.choices if c.finish_reason]
    assert sorted(finished) == [(0, "stop"), (1, "stop")]
    roles = [c.index for chunk in chunks for c in chunk.choices if c.delta.role == "assistant"]
    assert sorted(roles) == [0, 1], "each choice's first chunk says its role"
    # The last chunk's usage: the prompt once, both answers.
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (9, 18)


def test_a_list_of_prompts_streams_with_its_usage_in_a_chunk_of_its_own(client, replica):
    StandIn(replica.id, 2).start()

    stream = client.completions.create(
        model="tiny", prompt=["ab", "cde"], stream=True, max_tokens=5, stream_options={"include_usage": True}
    )
    chunks = list(stream)

    texts = {0: "", 1: ""}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == {0: "AB", 1: "CDE"}
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == 10
    assert all(chunk.usage is None for chunk in chunks[:-1])


def test_a_streamed_choice_that_fails_ends_the_stream_with_its_error_and_cancels_the_rest(client, replica):
    StandIn(replica.id, 1).start()  # takes the first choice only, which fails as too long

    with pytest.raises(openai.APIError, match="input too long"):
        list(client.completions.create(model="tiny", prompt=["too long", "b", "c"], stream=True, max_tokens=5))

    assert request_services.queue_depth("tiny") == 0, "nothing is left to run for a call that has failed"


def test_too_many_choices_are_refused_naming_why(client, replica):
    for asked, param, said in (
        ({"prompt": "x", "n": 17}, "n", "n: must be a whole number from 1 to 16"),
        ({"prompt": ["x"] * 9, "n": 2}, "n", "n: 9 prompts of 2 choices each: at most 16 choices in one call"),
        ({"prompt": []}, "prompt", "prompt: required: a string, token ids, or a non-empty list of either"),
        ({"prompt": [[]]}, "prompt.0", "prompt.0: no token ids: a prompt has at least one"),
        ({"prompt": [[1, -2]]}, "prompt.0.1", "prompt.0.1: a token id is a whole number from 0 to 2147483647"),
        ({"prompt": [1, "x"]}, "prompt.0", "prompt.0: must be a string or a list of token ids"),
        ({"prompt": ["x", None], "stream": True}, "prompt.1", "prompt.1: must be a string"),
    ):
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(model="tiny", max_tokens=5, **asked)
        assert refused.value.body["param"] == param and refused.value.body["message"].startswith(said), asked
    assert request_services.queue_depth("tiny") == 0


def test_what_openais_client_asks_that_the_portal_does_not_do_is_a_400_naming_it_and_nothing_runs(client, replica):
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 5}
    for call, asked, param in (
        (client.completions.create, {"prompt": "x", "max_tokens": 5, "suffix": "}"}, "suffix"),
        (client.chat.completions.create, {**chat, "functions": [TOOL["function"]]}, "functions"),
        (client.chat.completions.create, {**chat, "stream": True, "function_call": {"name": "f"}}, "function_call"),
    ):
        with pytest.raises(openai.BadRequestError) as refused:
            call(**{"model": "tiny", **asked})
        assert refused.value.body["param"] == param, asked
        assert refused.value.body["message"].startswith(f"{param}: not supported"), refused.value.body
    assert request_services.queue_depth("tiny") == 0


def test_a_chat_that_asks_for_no_length_leaves_it_to_its_replica_and_a_completion_gets_16_tokens():
    assert read({"model": "t", "messages": [{"role": "user", "content": "hi"}]}, "chat").params["max_tokens"] is None
    assert (
        read({"model": "t", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 9}, "chat").params[
            "max_tokens"
        ]
        == 9
    )
    assert read({"model": "t", "prompt": "hi"}, "generate").params["max_tokens"] == 16


def test_n_samples_of_one_seed_differ_from_each_other_and_each_is_reproducible():
    call = read({"model": "tiny", "prompt": ["a", "b"], "n": 2, "seed": 7, "temperature": 1}, "generate")

    assert [(given, params["seed"]) for given, params in call.each()] == [("a", 7), ("a", 8), ("b", 7), ("b", 8)]
    assert all("seed" not in params for _, params in read({"model": "t", "prompt": "a", "n": 2}, "generate").each())


def test_a_completions_log_probabilities_come_in_openais_parallel_lists(client, replica):
    StandIn(replica.id, 1).start()

    completion = client.completions.create(model="tiny", prompt="hey", max_tokens=5, logprobs=1)

    logprobs = completion.choices[0].logprobs
    assert logprobs.tokens == ["H", "E", "Y"] and logprobs.token_logprobs == [-0.5] * 3
    assert logprobs.top_logprobs == [{"?": -1.0}] * 3 and logprobs.text_offset == [0, 1, 2]


def test_a_chats_log_probabilities_come_per_token_with_its_bytes_and_alternatives(client, replica):
    StandIn(replica.id, 2).start()

    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "ok"}], logprobs=True, top_logprobs=2
    )
    plain = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "ok"}])

    (first, second) = chat.choices[0].logprobs.content
    assert (first.token, first.logprob, first.bytes) == ("O", -0.5, [79]) and second.token == "K"
    assert [(t.token, t.logprob) for t in first.top_logprobs] == [("?", -1.0), ("!", -2.0)]
    assert plain.choices[0].logprobs is None, "none asked for, none given"


@pytest.mark.parametrize(
    ("kind", "asked", "said"),
    [
        ("chat", {"logprobs": 2}, "logprobs: must be true or false"),
        ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs: must be a whole number from 0 to 20"),
        ("chat", {"top_logprobs": 3}, "top_logprobs: only with logprobs: true"),
        ("generate", {"logprobs": True}, "logprobs: must be a whole number from 0 to 20"),
        ("generate", {"logprobs": 21}, "logprobs: must be a whole number from 0 to 20"),
    ],
)
def test_log_probabilities_asked_wrongly_are_refused_naming_why(kind, asked, said):
    body = {
        "model": "tiny",
        **({"messages": [{"role": "user", "content": "x"}]} if kind == "chat" else {"prompt": "x"}),
    }
    with pytest.raises(completion_input.Refused) as refused:
        read({**body, **asked}, kind)
    assert str(refused.value).startswith(said)
    assert read({**body, "logprobs": True if kind == "chat" else 0}, kind).params["logprobs"] == 0
    assert "logprobs" not in read(body, kind).params


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


@pytest.mark.parametrize("kind", ["chat", "generate"])
def test_a_stream_asked_to_include_usage_ends_with_a_chunk_of_no_choices_that_carries_it(client, replica, kind):
    StandIn(replica.id, 2).start()
    asked = {"model": "tiny", "stream": True, "stream_options": {"include_usage": True}}
    if kind == "chat":
        chunks = list(client.chat.completions.create(messages=[{"role": "user", "content": "count me"}], **asked))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        chunks = list(client.completions.create(prompt="count me", **asked))
        text = "".join(c.choices[0].text for c in chunks if c.choices)

    *pieces, last = chunks
    assert text == "COUNT ME"
    assert last.choices == [] and last.usage is not None and last.usage.completion_tokens == len("COUNT ME")
    assert all(c.choices and c.usage is None for c in pieces), "every other chunk says usage: null"
    assert pieces[-1].choices[0].finish_reason == "stop"

    # Not asked: the last choice's chunk carries the usage, as it always has.
    plain = list(client.completions.create(model="tiny", prompt="count me", stream=True))
    assert all(c.choices for c in plain) and plain[-1].usage.completion_tokens == len("COUNT ME")


def test_the_command_lines_run_and_chat_stream_the_real_v1s_answers(live_server, replica, capsys, monkeypatch):
    import io

    from gpuportal.cli import app

    StandIn(replica.id, 2).start()
    env = {
        "GPUPORTAL_URL": live_server.url,
        "GPUPORTAL_TOKEN": Token.objects.create(user=User.objects.create_user("bo")).key,
    }

    assert app.main(["run", "tiny", "abcdef"], env=env) == 0
    monkeypatch.setattr("sys.stdin", io.StringIO("say hi\n/exit\n"))
    assert app.main(["chat", "tiny"], env=env) == 0

    assert capsys.readouterr().out == "ABCDEF\nSAY HI\n"


def test_bad_requests_fail_the_openai_way_naming_the_parameter(client, replica):
    with pytest.raises(openai.NotFoundError, match=r"^.*The model `nope` does not exist\. Deployed: `tiny`\."):
        client.completions.create(model="nope", prompt="x")
    with pytest.raises(openai.NotFoundError, match=r"The model `tinny` does not exist; did you mean `tiny`\?"):
        client.completions.create(model="tinny", prompt="x")
    with pytest.raises(openai.BadRequestError, match="n: must be a whole number from 1 to 16"):
        client.completions.create(model="tiny", prompt="x", n=0)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], temperature=5)
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model="tiny", messages=[])
    with pytest.raises(openai.BadRequestError, match="role"):
        client.chat.completions.create(model="tiny", messages=[{"role": "wizard", "content": "x"}])
    assert request_services.queue_depth("tiny") == 0, "nothing invalid was queued"


def test_input_too_long_for_the_model_is_a_400_with_openais_context_length_code(client, replica):
    StandIn(replica.id, 2).start()
    with pytest.raises(openai.BadRequestError, match="input too long") as refused:
        client.completions.create(model="tiny", prompt="too long")
    assert refused.value.code == "context_length_exceeded"

    # Streamed, the refusal comes as the stream's error event, in the same words and code.
    stream = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "too long"}], stream=True
    )
    with pytest.raises(openai.APIError, match="input too long") as ended:
        list(stream)
    assert ended.value.code == "context_length_exceeded" and ended.value.type == "invalid_request_error"


def test_a_wrong_key_is_refused(live_server, replica):
    with (
        openai.OpenAI(base_url=f"{live_server.url}/v1", api_key="not-a-key", max_retries=0) as stranger,
        pytest.raises(openai.AuthenticationError),
    ):
        stranger.models.list()


def test_a_call_nothing_answers_ends_at_its_timeout_and_its_unstarted_request_is_cancelled(client, replica, settings):
    # A /v1 call never hangs. Nothing serves the queue here: the request never starts.
    with pytest.raises(openai.APIStatusError, match=r"did not start within 0\.3 s and was cancelled") as caught:
        client.completions.create(model="tiny", prompt="anyone?", extra_body={"timeout": 0.3})
    assert caught.value.status_code == 504
    request_id = caught.value.body["message"].split()[1]
    assert request_services.queue().get(request_id).status == "cancelled"
    assert request_services.queue_depth("tiny") == 0, "nothing is left to run for a caller who has gone"

    settings.GPUPORTAL_INFER_TIMEOUT_S = 0.2  # the default, for a call that names none
    with pytest.raises(openai.APIStatusError, match=r"within 0\.2 s") as caught:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}])
    assert caught.value.status_code == 504

    with pytest.raises(openai.APIError, match=r"did not start within 0\.3 s"):
        list(client.completions.create(model="tiny", prompt="x", stream=True, extra_body={"timeout": 0.3}))
    assert request_services.queue_depth("tiny") == 0


def _fail_once_queued(retry_after_s: int) -> threading.Thread:
    """Ends the call's request once it waits, as a wake refused for young replicas would."""

    def fail() -> None:
        wait_until(lambda: request_services.queue_depth("tiny") > 0, 30, "the call's request to wait")
        request_services.fail_waiting("tiny", "cannot wake tiny: young; room in 42 s", retry_after_s=retry_after_s)

    thread = threading.Thread(target=fail, daemon=True)
    thread.start()
    return thread


def test_a_call_whose_wake_failed_for_young_replicas_says_when_to_ask_again(client, replica, live_server):
    _fail_once_queued(42)
    with pytest.raises(openai.InternalServerError, match="room in 42 s") as caught:
        client.completions.create(model="tiny", prompt="anyone?")
    assert caught.value.status_code == 503 and caught.value.response.headers["Retry-After"] == "42"

    # The portal's own /infer/ answers the same way (a 409: what cannot be placed now).
    key = Token.objects.get(user__username="alice").key
    _fail_once_queued(7)
    call = urllib.request.Request(
        f"{live_server.url}/api/deployments/tiny/infer/",
        data=json.dumps({"input": "anyone?"}).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Token {key}"},
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(call, timeout=30)
    assert refused.value.code == 409 and refused.value.headers["Retry-After"] == "7"
    answer = json.loads(refused.value.read())
    assert answer["status"] == "failed" and "room in 42 s" in answer["error"]


def test_a_call_whose_request_runs_past_its_timeout_gets_a_504_and_the_answer_stays_pollable(client, replica):
    taken, release = threading.Event(), threading.Event()

    def slow_replica() -> None:
        queue = request_services.queue()
        request = queue.take("tiny", replica.id, timeout=10)
        taken.set()
        release.wait(10)
        queue.finish(request.id, replica.id, {"text": "late but kept"})

    server = threading.Thread(target=slow_replica, daemon=True)
    server.start()
    with pytest.raises(openai.APIStatusError, match="did not finish within 2 s; poll /api/requests/") as caught:
        client.completions.create(model="tiny", prompt="slow", extra_body={"timeout": 2})
    assert taken.is_set() and caught.value.status_code == 504
    release.set()
    server.join(10)
    request_id = caught.value.body["message"].split()[1]
    assert request_services.queue().get(request_id).output == {"text": "late but kept"}


def test_a_timeout_out_of_bounds_is_a_400_naming_it(client, replica, settings):
    with pytest.raises(openai.BadRequestError, match="timeout: at most 300 s"):
        client.completions.create(model="tiny", prompt="x", extra_body={"timeout": 1e9})
    with pytest.raises(openai.BadRequestError, match="timeout"):
        client.completions.create(model="tiny", prompt="x", extra_body={"timeout": 0})
    assert request_services.queue_depth("tiny") == 0


def test_a_model_that_is_not_a_causal_lm_is_refused_naming_the_model(client, replica):
    factories.deployment(name="mlp", model_source="tests.support.factories:mlp", loader=Deployment.Loader.TORCH_MODULE)

    with pytest.raises(openai.BadRequestError, match="not a causal language model"):
        client.chat.completions.create(model="mlp", messages=[{"role": "user", "content": "x"}])
    assert request_services.queue_depth("mlp") == 0


# -- one parser reads every body ---------------------------------------------------------------

_json = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 5000) | st.floats() | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
)
_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "developer", "wizard"]) | _json},
    optional={"content": st.text(max_size=4) | _json, "name": _json},
)
_common = {
    "max_tokens": st.integers(-1, 5000) | _json,
    "max_completion_tokens": st.integers(-1, 5000) | _json,
    "temperature": st.floats(-1, 3) | _json,
    "top_p": st.floats(-0.5, 1.5) | _json,
    "stop": st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=5) | _json,
    "n": st.integers(0, 20) | _json,
    "stream": st.booleans() | _json,
    "user": _json,
    "timeout": st.floats(-1, 400) | st.integers(-1, 400) | _json,
}
_chats = st.fixed_dictionaries(
    {"model": st.sampled_from(["tiny", " tiny", ""]) | _json},
    optional={"messages": st.lists(_message, max_size=3) | _json, **_common},
)
_prompts = st.fixed_dictionaries(
    {"model": st.sampled_from(["tiny", "tiny "]) | _json},
    optional={"prompt": st.text(max_size=5) | st.lists(st.text(max_size=3), max_size=20) | _json, **_common},
)


def read(body, kind):
    return completion_input.parse(body, kind, default_timeout_s=30, max_timeout_s=300)


@pytest.mark.parametrize(("kind", "bodies"), [("chat", _chats), ("generate", _prompts)])
def test_the_parser_runs_only_what_is_within_bounds_and_names_the_field_it_refuses(kind, bodies):
    @given(bodies)
    @example({"model": "tiny", "prompt": [0]})  # found by a full run: token ids alone, one prompt
    def check(body):
        try:
            call = read(body, kind)
        except completion_input.Refused as refused:
            assert refused.param is not None and refused.param.split(".")[0] in {*body, "model", "prompt", "messages"}
            return
        assert call.model == body["model"].strip() != ""
        params = call.params
        unbounded = kind == "chat" and not (body.get("max_tokens") or body.get("max_completion_tokens"))
        assert params["max_tokens"] is None if unbounded else 1 <= params["max_tokens"] <= 4096
        assert 0 <= params["temperature"] <= 2 and 0 < params["top_p"] <= 1
        assert len(params["stop"]) <= 4 and all(isinstance(s, str) and s for s in params["stop"])
        assert params["stream"] is bool(body.get("stream")) and 0.001 <= call.timeout_s <= 300
        assert 1 <= call.choices <= completion_input.MAX_CHOICES and call.n == (
            1 if body.get("n") is None else body["n"]
        )  # null is the default, as OpenAI reads it
        if kind == "chat":
            assert [set(m) for m in call.input] == [{"role", "content"}] * len(body["messages"])
        else:
            # A list of prompts, or token ids alone ([0]): one prompt, as OpenAI reads it.
            asked = body["prompt"]
            alone = not isinstance(asked, list) or all(type(token) is int for token in asked)
            prompts = [asked] if alone else asked
            assert [given for given, _ in call.each()[:: call.n]] == prompts

    check()


def test_the_parser_reads_the_shapes_openai_clients_send():
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hi", "name": "x"}], "max_tokens": 1}
    assert read(chat, "chat") == completion_input.Completion(
        model="tiny",
        input=[{"role": "user", "content": "Hi"}],
        params={"max_tokens": 1, "temperature": 0.0, "top_p": 1.0, "stop": [], "stream": False},
        timeout_s=30,
    )
    prompt = {"model": "tiny", "prompt": "Hi", "max_completion_tokens": 5, "temperature": 0.2, "stop": "\n", "n": 1}
    call = read({**prompt, "stream": True, "timeout": 60, "user": "ignored"}, "generate")
    assert call.params == {"max_tokens": 5, "temperature": 0.2, "top_p": 1.0, "stop": ["\n"], "stream": True}
    assert call.timeout_s == 60 and not call.include_usage
    # vLLM's and OpenAI's sampling parameters reach the request queue; those left out do not.
    sampled = {"seed": 3, "top_k": 20, "min_p": 0.1, "presence_penalty": -0.5, "repetition_penalty": 1.2}
    assert read({**prompt, **sampled, "frequency_penalty": None}, "generate").params == {
        "max_tokens": 5,
        "temperature": 0.2,
        "top_p": 1.0,
        "stop": ["\n"],
        "stream": False,
        **sampled,
    }
    # vLLM's continuous_usage_stats beside OpenAI's include_usage: ignored; a null is none.
    options = {"include_usage": True, "continuous_usage_stats": True}
    assert read({**prompt, "stream": True, "stream_options": options}, "generate").include_usage
    assert not read({**prompt, "stream_options": None}, "generate").include_usage


@pytest.mark.parametrize(
    ("body", "refusal"),
    [
        ([], "the body must be a JSON object"),
        ({"prompt": "x"}, "model: required: the deployment's name"),
        ({"model": "ti\x00ny", "prompt": "x"}, "model: must not contain a NUL character"),
        ({"model": "tiny"}, "prompt: required: a string, token ids, or a list of either"),
        ({"model": "tiny", "prompt": "x", "max_tokens": 0}, "max_tokens: must be a whole number from 1 to 4096"),
        ({"model": "tiny", "prompt": "x", "top_p": 0}, "top_p: must be above 0 and at most 1"),
        ({"model": "tiny", "prompt": "x", "temperature": "hot"}, "temperature: must be a number"),
        (
            {"model": "tiny", "prompt": "x", "stop": ["a"] * 5},
            "stop: must be a string or a list of at most 4 non-empty strings",
        ),
        ({"model": "tiny", "prompt": "x", "stream": "yes"}, "stream: must be true or false"),
        ({"model": "tiny", "prompt": "x", "top_k": 1.5}, "top_k: must be a whole number"),
        ({"model": "tiny", "prompt": "x", "frequency_penalty": 3}, "frequency_penalty: must be from -2 to 2"),
        ({"model": "tiny", "prompt": "x", "seed": "7"}, "seed: must be a whole number"),
        (
            {"model": "tiny", "prompt": "x", "stream_options": {"include_usage": True}},
            "stream_options: only allowed when stream is true",
        ),
        (
            {"model": "tiny", "prompt": "x", "stream": True, "stream_options": True},
            'stream_options: must be an object, such as {"include_usage": true}',
        ),
        (
            {"model": "tiny", "prompt": "x", "stream": True, "stream_options": {"include_usage": "yes"}},
            "stream_options.include_usage: must be true or false",
        ),
        ({"model": "tiny", "prompt": "x", "timeout": 301}, "timeout: at most 300 s (GPUPORTAL_INFER_MAX_TIMEOUT_S)"),
        ({"model": "tiny", "prompt": "x", "max_tokns": 5}, "max_tokns: unknown field; did you mean 'max_tokens'?"),
        ({"model": "tiny", "prompt": "x", "temprature": 0.5}, "temprature: unknown field; did you mean 'temperature'?"),
        ({"model": "tiny", "promt": "x"}, "promt: unknown field; did you mean 'prompt'?"),
    ],
)
def test_the_parser_refuses_saying_which_field_and_why(body, refusal):
    with pytest.raises(completion_input.Refused) as refused:
        read(body, "generate")
    assert str(refused.value) == refusal


def test_fields_that_change_no_answer_are_ignored_even_when_near_one_the_portal_reads():
    body = {"model": "tiny", "prompt": "x", "top_k": 5, "min_p": 0.1, "user": "u", "seed": 3, "logprobs": None}

    assert read(body, "generate").input == "x"
    assert read({**body, "store": True, "metadata": {"team": "a"}, "service_tier": "auto"}, "generate").input == "x"
    assert read({**body, "something_else_entirely": 1}, "generate").input == "x", "far from any: ignored"


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.mark.parametrize(
    ("field", "asking", "nothing"),
    [
        ("suffix", "}", ""),
        ("functions", [TOOL["function"]], []),
        ("function_call", {"name": "f"}, "auto"),
        ("skip_special_tokens", False, True),
        ("modalities", ["text", "audio"], ["text"]),
        ("audio", {"voice": "alloy", "format": "wav"}, None),
        ("web_search_options", {}, None),
        ("best_of", 3, 1),
    ],
)
def test_a_field_the_portal_does_not_do_is_refused_where_it_asks_for_something_and_taken_where_it_asks_nothing(
    field, asking, nothing
):
    body = {"model": "tiny", "prompt": "x"}

    with pytest.raises(completion_input.Refused) as refused:
        read({**body, field: asking}, "generate")

    assert refused.value.param == field and refused.value.message.startswith("not supported"), refused.value
    assert read({**body, field: nothing}, "generate").input == "x"


def test_a_logit_bias_is_sent_on_with_its_biases_as_numbers_and_a_bad_one_is_refused_naming_it():
    body = {"model": "tiny", "prompt": "x"}

    assert read({**body, "logit_bias": {"50256": -100}}, "generate").params["logit_bias"] == {"50256": -100.0}
    assert "logit_bias" not in read({**body, "logit_bias": {}}, "generate").params
    with pytest.raises(completion_input.Refused) as refused:
        read({**body, "logit_bias": {"a": 1}}, "generate")
    assert str(refused.value) == "logit_bias: 'a' is no token id (a whole number, as text)"


def test_stop_token_ids_are_sent_on_once_each_and_a_bad_one_is_refused_naming_it():
    body = {"model": "tiny", "prompt": "x"}

    assert read({**body, "stop_token_ids": [128009, 2, 2]}, "generate").params["stop_token_ids"] == [2, 128009]
    assert "stop_token_ids" not in read({**body, "stop_token_ids": []}, "generate").params
    with pytest.raises(completion_input.Refused) as refused:
        read({**body, "stop_token_ids": [2, "eot"]}, "generate")
    assert str(refused.value) == "stop_token_ids: 'eot' is no token id (a whole number from 0 to 999999999)"


def test_echo_is_a_completions_and_not_streamed():
    body = {"model": "tiny", "prompt": "x"}

    assert read({**body, "echo": True}, "generate").params["echo"] is True
    assert "echo" not in read({**body, "echo": False}, "generate").params
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "x"}]}
    for asked, kind, refusal in (
        ({**body, "echo": 1}, "generate", "echo: must be true or false"),
        ({**body, "echo": True, "stream": True}, "generate", "echo: not streamed: ask without stream"),
        ({**chat, "echo": True}, "chat", "echo: not supported on chats: an answer never repeats its messages"),
    ):
        with pytest.raises(completion_input.Refused) as refused:
            read(asked, kind)
        assert str(refused.value) == refusal


def test_an_echoed_completion_begins_with_its_prompt_and_scores_its_tokens_as_an_eval_harness_reads_them(
    client, replica
):
    StandIn(replica.id, 2).start()

    # As lm-evaluation-harness asks for a loglikelihood: the prompt echoed with its log probabilities.
    scored = client.completions.create(model="tiny", prompt="ab", max_tokens=1, logprobs=1, echo=True)
    plain = client.completions.create(model="tiny", prompt="ab", max_tokens=1, echo=True)

    (choice,) = scored.choices
    assert choice.text == "abAB" and plain.choices[0].text == "abAB" and plain.choices[0].logprobs is None
    logprobs = choice.logprobs
    assert logprobs.tokens == ["a", "b", "A", "B"]
    assert logprobs.token_logprobs == [None, -0.25, -0.5, -0.5], "the prompt's first token has nothing before it"
    assert logprobs.top_logprobs == [None, {"?": -1.0}, {"?": -1.0}, {"?": -1.0}]
    assert logprobs.text_offset == [0, 1, 2, 3]


@pytest.fixture
def served(replica, tiny_model_dir) -> Iterator[Any]:
    """The replica's serving loop, here, over the tiny Llama with a KV pool (no stand-in): its tokenizer."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    yield from _serving(replica, model, AutoTokenizer.from_pretrained(tiny_model_dir))


@pytest.fixture
def served_longer(replica) -> Iterator[Any]:
    """`served`, over a tiny Llama of a 1,024-token context: a chat's functions, as JSON, are a few
    hundred of this tokenizer's tokens."""
    import torch
    from transformers import LlamaForCausalLM

    from inference.management.commands.make_tiny_model import build_tokenizer

    torch.manual_seed(7)  # the same random model, so the same answers, whatever ran before
    yield from _serving(replica, LlamaForCausalLM(tiny_llama_config(1024)).eval(), build_tokenizer())


def _serving(replica: Replica, model: Any, tokenizer: Any) -> Iterator[Any]:
    host = host_for(model, tokenizer)
    host.replica_id = replica.id
    server = Server(host, request_services.queue(), "tiny", poll_s=0.05)
    server.start()
    try:
        yield tokenizer
    finally:
        server.stopped.set()
        server.join(10)


def test_a_prompt_of_token_ids_is_the_models_own_tokens_as_lm_evaluation_harness_sends_them(client, served):
    tokenizer = served
    ids = tokenizer("Once upon a time").input_ids
    # As local-completions asks for a loglikelihood by default (tokenized_requests): a batch of
    # token lists, each echoed with its log probabilities and one token more.
    by_ids = client.completions.create(model="tiny", prompt=[ids], max_tokens=1, logprobs=1, echo=True)
    by_text = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=1, logprobs=1, echo=True)
    two = client.completions.create(model="tiny", prompt=[ids, ids[:2]], max_tokens=3)
    with pytest.raises(openai.BadRequestError) as beyond:
        client.completions.create(model="tiny", prompt=[5, 100_000], max_tokens=1)

    (choice,) = by_ids.choices
    answer = by_text.choices[0].text.removeprefix("Once upon a time")
    assert choice.text == tokenizer.decode(ids) + answer, "the prompt as its ids decode, then the same answer"
    scored = choice.logprobs.token_logprobs
    assert len(scored) == len(ids) + 1 and scored[0] is None, "one a prompt token, the first with none, then one"
    assert scored == pytest.approx(by_text.choices[0].logprobs.token_logprobs, abs=1e-5)
    assert [c.index for c in two.choices] == [0, 1] and two.usage.prompt_tokens == len(ids) + 2
    assert beyond.value.body["message"] == "prompt: token 100000 is not in the model's vocabulary of 512 tokens"


def test_a_choice_says_the_stop_string_it_ended_on_as_vllms_stop_reason(client, served):
    asked = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 12}
    free = client.completions.create(**asked).choices[0]
    stop = free.text[4:7]
    cut = client.completions.create(**asked, stop=["no such words", stop]).choices[0]
    streamed = [c.choices[0] for c in client.completions.create(**asked, stop=[stop], stream=True) if c.choices]

    assert free.stop_reason is None, "it ran to its length (or its end of text): no stop of the caller's"
    assert (cut.finish_reason, cut.stop_reason) == ("stop", stop) and cut.text == free.text[: free.text.find(stop)]
    assert streamed[-1].stop_reason == stop and streamed[-1].finish_reason == "stop", "in the choice's last chunk"


def test_streamed_log_probabilities_come_with_the_tokens_each_chunk_brings_and_add_up_to_the_answers(client, served):
    asked = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 12, "logprobs": 2}
    whole = client.completions.create(**asked).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(**asked, stream=True) if c.choices]
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 12, "logprobs": True}
    said = client.chat.completions.create(**chat).choices[0]
    chat_chunks = [c.choices[0] for c in client.chat.completions.create(**chat, stream=True) if c.choices]

    carried = [c.logprobs for c in chunks if c.logprobs and c.logprobs.tokens]
    assert len(carried) > 1, "token by token as the text comes, not all at the end"
    streamed = {
        key: [value for c in chunks if c.logprobs for value in getattr(c.logprobs, key)]
        for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    }
    assert streamed["tokens"] == whole.logprobs.tokens
    assert streamed["token_logprobs"] == pytest.approx(whole.logprobs.token_logprobs, abs=1e-5)
    assert streamed["text_offset"] == whole.logprobs.text_offset, "where each token begins in the whole text"
    assert [list(top) for top in streamed["top_logprobs"]] == [list(top) for top in whole.logprobs.top_logprobs]
    tokens = [t for c in chat_chunks if c.logprobs for t in c.logprobs.content]
    assert [(t.token, t.bytes) for t in tokens] == [(t.token, t.bytes) for t in said.logprobs.content]


def test_log_probabilities_a_stream_did_not_carry_come_with_each_choices_last_chunk(client, replica):
    StandIn(replica.id, 1).start()  # streams its text alone, as the generate() path does

    chunks = [c.choices[0] for c in client.completions.create(model="tiny", prompt="hey", logprobs=1, stream=True)]

    assert [c.logprobs.tokens for c in chunks] == [[]] * (len(chunks) - 1) + [["H", "E", "Y"]]
    assert chunks[-1].logprobs.text_offset == [0, 1, 2] and chunks[-1].finish_reason == "stop"


def test_a_response_format_is_the_json_schema_the_answer_is_held_to_and_a_bad_one_is_refused_naming_it():
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}]}
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}}
    given = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}

    assert read({**body, "response_format": {"type": "json_object"}}, "chat").params["json_schema"] == {
        "type": "object"
    }
    assert read({**body, "response_format": given}, "chat").params["json_schema"] == schema
    assert "json_schema" not in read({**body, "response_format": {"type": "text"}}, "chat").params
    for asked, refusal in (
        ("json", 'response_format: must be an object such as {"type": "json_object"}'),
        ({"type": "yaml"}, "response_format.type: must be text, json_object or json_schema"),
        (
            {"type": "json_schema", "json_schema": {"name": "x"}},
            "response_format.json_schema: must be an object whose `schema` is a JSON Schema object",
        ),
    ):
        with pytest.raises(completion_input.Refused) as refused:
            read({**body, "response_format": asked}, "chat")
        assert str(refused.value) == refusal


def test_vllms_guided_formats_are_read_one_at_a_time_and_a_bad_one_is_refused_naming_it():
    body = {"model": "tiny", "prompt": "x"}
    schema = {"type": "object"}

    assert read({**body, "guided_json": json.dumps(schema)}, "generate").params["json_schema"] == schema
    assert read({**body, "guided_choice": ["yes", "no"]}, "generate").params["guided_choice"] == ["yes", "no"]
    assert read({**body, "guided_regex": "[0-9]+"}, "generate").params["guided_regex"] == "[0-9]+"
    for asked, refusal in (
        ({"guided_json": "{not json"}, "guided_json: must be a JSON Schema: an object, or its JSON text"),
        ({"guided_choice": []}, "guided_choice: must be a non-empty list of non-empty strings"),
        ({"guided_choice": ["yes", ""]}, "guided_choice: must be a non-empty list of non-empty strings"),
        ({"guided_regex": ""}, "guided_regex: must be a regular expression of 1 to 4096 characters"),
        (
            {"guided_regex": "[0-9]+", "response_format": {"type": "json_object"}},
            "response_format: one format at a time: guided_regex and response_format were both given",
        ),
    ):
        with pytest.raises(completion_input.Refused) as refused:
            read({**body, **asked}, "generate")
        assert str(refused.value) == refusal


# Parameters a random model can fill within a few dozen tokens: no free string, no unbounded number.
UNIT = {
    "type": "function",
    "function": {
        "name": "convert",
        "parameters": {
            "type": "object",
            "properties": {"unit": {"enum": ["celsius", "kelvin"]}, "exact": {"type": "boolean"}},
            "required": ["unit", "exact"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {"type": "function", "function": {"name": "clock", "parameters": {"type": "object", "properties": {}}}}


def test_a_function_named_or_required_is_called_with_arguments_its_parameters_allow_streamed_or_not(
    client, served_longer
):
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Convert it"}], "max_tokens": 600}
    named = {"type": "function", "function": {"name": "convert"}}

    called = client.chat.completions.create(**chat, tools=[UNIT, CLOCK], tool_choice=named)
    streamed = list(client.chat.completions.create(**chat, tools=[UNIT, CLOCK], tool_choice=named, stream=True))
    either = client.chat.completions.create(**chat, tools=[UNIT, CLOCK], tool_choice="required")
    one = client.chat.completions.create(**chat, tools=[UNIT, CLOCK], tool_choice="required", parallel_tool_calls=False)

    (choice,) = called.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (made,) = choice.message.tool_calls
    assert made.type == "function" and made.id.startswith("call_") and made.function.name == "convert"
    arguments = json.loads(made.function.arguments)
    assert arguments["unit"] in ("celsius", "kelvin") and isinstance(arguments["exact"], bool)
    # The stream: its text held back, the call in one chunk at its end.
    (last,) = [chunk for chunk in streamed if chunk.choices and chunk.choices[0].finish_reason]
    assert last.choices[0].finish_reason == "tool_calls"
    (delta_call,) = last.choices[0].delta.tool_calls
    assert delta_call.index == 0 and delta_call.function.name == "convert"
    assert json.loads(delta_call.function.arguments) == arguments, "greedy: the same call"
    assert not any(chunk.choices and chunk.choices[0].delta.content for chunk in streamed)
    # Required: a list of calls, each of a function given (one where not parallel).
    assert either.choices[0].finish_reason == "tool_calls"
    assert {made.function.name for made in either.choices[0].message.tool_calls} <= {"convert", "clock"}
    assert len(one.choices[0].message.tool_calls) == 1 and one.choices[0].finish_reason == "tool_calls"


def test_with_tools_left_to_it_a_model_that_writes_no_call_answers_in_text_and_a_past_call_is_read(
    client, served_longer
):
    said = [
        {"role": "user", "content": "Convert it"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "clock", "arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
    ]

    answer = client.chat.completions.create(model="tiny", messages=said, tools=[UNIT, CLOCK], max_tokens=8)
    streamed = list(
        client.chat.completions.create(model="tiny", messages=said, tools=[UNIT, CLOCK], max_tokens=8, stream=True)
    )

    # A random model writes no call: its text is the answer (tool_choice auto, the default).
    (choice,) = answer.choices
    assert choice.message.tool_calls is None and choice.message.content and choice.finish_reason == "length"
    # Streamed as it comes, as a chat without tools is, and whole by its end.
    texts = [chunk.choices[0].delta.content for chunk in streamed if chunk.choices and chunk.choices[0].delta.content]
    assert "".join(texts) == choice.message.content and len(texts) > 1
    assert [chunk.choices[0].delta.role for chunk in streamed if chunk.choices and chunk.choices[0].delta.role] == [
        "assistant"
    ]


def _refused_as_not_kept(client: openai.OpenAI, response_id: str) -> tuple[Any, Any]:
    """A response not kept: neither read (a 404), nor its input items, nor gone on from (a 400):
    the refusals of the read and of the going on."""
    with pytest.raises(openai.NotFoundError) as not_read:
        client.responses.retrieve(response_id)
    with pytest.raises(openai.NotFoundError):
        list(client.responses.input_items.list(response_id))
    with pytest.raises(openai.BadRequestError) as not_gone_on:
        client.responses.create(model="tiny", input="And then?", previous_response_id=response_id)
    return not_read.value, not_gone_on.value


def test_a_response_asked_with_store_false_is_answered_and_not_kept_to_read_or_go_on_from(client, served):
    unkept = client.responses.create(model="tiny", input="Once upon a time", max_output_tokens=4, store=False)
    not_read, not_gone_on = _refused_as_not_kept(client, unkept.id)
    kept = client.responses.create(model="tiny", input="Once upon a time", max_output_tokens=4)

    assert unkept.output_text and unkept.store is False, "answered all the same"
    assert "store: false" in not_read.body["message"]
    assert not_gone_on.body["param"] == "previous_response_id"
    assert "store: false" in not_gone_on.body["message"]
    assert kept.store is True and client.responses.retrieve(kept.id).id == kept.id


def test_a_deleted_response_is_gone_with_what_it_was_asked_and_answered_and_another_user_deletes_nothing(
    client, served
):
    answer = client.responses.create(model="tiny", input="Once upon a time", max_output_tokens=4)
    request_id = answer.id.removeprefix("resp_")
    queue = request_services.queue()
    bob = Token.objects.create(user=User.objects.create_user("bob")).key
    with (
        openai.OpenAI(base_url=client.base_url, api_key=bob, max_retries=0) as others,
        pytest.raises(openai.NotFoundError),
    ):
        others.responses.delete(answer.id)
    assert queue.get(request_id) is not None, "another's delete deleted nothing"

    deleted = client.responses.with_raw_response.delete(answer.id)
    not_read, not_gone_on = _refused_as_not_kept(client, answer.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(answer.id)
    # One not ended yet (waiting for a deployment no replica serves) is not deleted under its replica.
    alice = User.objects.get(username="alice")
    waiting = queue.submit(
        "nobody", kind="chat", input=[{"role": "user", "content": "Hi"}], params={}, owner=str(alice.pk)
    )
    with pytest.raises(openai.ConflictError) as not_ended:
        client.responses.delete(f"resp_{waiting.id}")

    assert deleted.http_response.status_code == 200
    assert deleted.http_response.json() == {"id": answer.id, "object": "response.deleted", "deleted": True}
    assert "deleted" in not_read.body["message"]
    assert not_gone_on.body["param"] == "previous_response_id"
    # What it was asked and answered is gone from Redis, not only hidden; it is in no list of requests.
    assert queue.get(request_id) is None
    assert request_id not in [r.id for r in queue.recent(None, offset=0, limit=100)[0]]
    assert not_ended.value.body["param"] == "response_id" and queue.get(waiting.id).status == "queued"


def test_a_background_response_is_answered_queued_runs_on_and_is_read_back_or_followed_again(client, served):
    asked = {"model": "tiny", "input": "Once upon a time", "max_output_tokens": 8}
    queued = client.responses.create(**asked, background=True)
    ended = request_services.queue().wait(queued.id.removeprefix("resp_"), 30)
    polled = client.responses.retrieve(queued.id)
    waited = client.responses.create(**asked)
    followed = list(client.responses.retrieve(queued.id, stream=True))
    streamed = list(client.responses.create(**asked, stream=True, background=True))
    again = list(client.responses.retrieve(streamed[0].response.id, stream=True, starting_after=3))
    whole_again = list(client.responses.retrieve(streamed[0].response.id, stream=True))
    with pytest.raises(openai.BadRequestError) as not_streamed:
        client.responses.retrieve(queued.id, starting_after=3)
    with pytest.raises(openai.BadRequestError) as not_a_number:
        client.responses.retrieve(queued.id, stream=True, starting_after="third")

    assert queued.status == "queued" and queued.background is True and queued.output == []
    assert ended is not None and ended.status == "done", "it ran with nobody waiting"
    assert polled.status == "incomplete" and polled.output_text == waited.output_text, "greedy: the same answer"
    assert polled.background is True and waited.background is False
    # Followed again from its start: its events as a stream of it would have sent them.
    assert [e.type for e in followed][:2] == ["response.created", "response.in_progress"]
    assert followed[-1].type == "response.incomplete" and followed[-1].response.output_text == waited.output_text
    # A stream followed again past an event: the same events, numbered as the first time.
    assert [(e.type, e.sequence_number, getattr(e, "delta", None)) for e in again] == [
        (e.type, e.sequence_number, getattr(e, "delta", None)) for e in streamed[4:]
    ]
    assert [e.model_dump() for e in whole_again] == [e.model_dump() for e in streamed], "made again as they were"
    assert not_streamed.value.body["param"] == "starting_after" and "stream=true" in not_streamed.value.body["message"]
    assert not_a_number.value.body["param"] == "starting_after"


def test_a_response_is_cancelled_where_it_waits_and_a_cancel_sent_again_changes_nothing(client, replica):
    # Nothing serves the replica here: the request waits in its queue.
    queued = client.responses.create(model="tiny", input="Hi", background=True)
    bob = Token.objects.create(user=User.objects.create_user("bob")).key
    with (
        openai.OpenAI(base_url=client.base_url, api_key=bob, max_retries=0) as others,
        pytest.raises(openai.NotFoundError),
    ):
        others.responses.cancel(queued.id)
    still = request_services.queue().get(queued.id.removeprefix("resp_")).status
    cancelled = client.responses.cancel(queued.id)
    again = client.responses.cancel(queued.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.cancel("resp_no-such-request")

    assert still == "queued", "another's cancel cancelled nothing"
    assert cancelled.status == "cancelled" and "cancelled by its owner" in cancelled.error.message
    assert again.status == "cancelled" and client.responses.retrieve(queued.id).status == "cancelled"
    assert request_services.queue().get(queued.id.removeprefix("resp_")).status == "cancelled"


def test_a_background_stream_its_client_leaves_runs_on_and_a_foreground_one_is_stopped(replica):
    owner = str(User.objects.create_user("carol").pk)
    view = ResponsesView()
    left = {}
    for way in ("background", "foreground", "followed again"):
        body = {"model": "tiny", "input": "Hi", "stream": True, "background": way == "background"}
        call = view.parse(body, owner)
        request = request_services.submit("tiny", kind="chat", input=call.input, params=call.params, owner=owner)
        # GET /v1/responses/{id}?stream=true follows a response its asker still streams.
        again = way == "followed again"
        events = view.followed_again(request, call, after=-1) if again else view.events([request], call)
        begun = [next(events) for _ in range(3)]  # created, in_progress, then what it waits for
        events.close()  # what the server does once the client has gone
        left[way] = (begun, request_services.queue().get(request.id).status)

    assert left["background"][0][2].startswith(b": ") and left["background"][1] == "queued", "it runs on, to be read"
    assert left["foreground"][1] == "cancelled", "nobody would read its answer"
    assert left["followed again"][1] == "queued", "one who follows a response again is not the one who asked it"


def test_the_responses_api_answers_streams_and_goes_on_from_a_previous_response(client, served):
    asked = {"model": "tiny", "instructions": "Be brief.", "input": "Once upon a time", "max_output_tokens": 8}

    answer = client.responses.create(**asked)
    events = list(client.responses.create(**asked, stream=True))
    after = client.responses.create(
        model="tiny", input="And then?", previous_response_id=answer.id, max_output_tokens=4
    )
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model="tiny", input="x", previous_response_id="resp_no-such-request")
    too_long = list(client.responses.create(model="tiny", input="word " * 2000, stream=True))
    kept = client.responses.retrieve(answer.id)
    given = list(client.responses.input_items.list(answer.id))
    given_after = list(client.responses.input_items.list(after.id, order="asc"))
    failed = client.responses.retrieve(too_long[0].response.id)
    bob = Token.objects.create(user=User.objects.create_user("bob")).key
    with (
        openai.OpenAI(base_url=client.base_url, api_key=bob, max_retries=0) as others,
        pytest.raises(openai.NotFoundError),
    ):
        others.responses.retrieve(answer.id)
    with pytest.raises(openai.BadRequestError) as no_image:
        client.responses.create(model="tiny", input=[{"role": "user", "content": [{"type": "input_image"}]}])

    assert answer.object == "response" and answer.id.startswith("resp_") and answer.output_text
    assert answer.status == "incomplete" and answer.incomplete_details.reason == "max_output_tokens", "cut at 8"
    assert answer.usage.output_tokens == 8 and answer.instructions == "Be brief."
    # Typed events: created, the text as it comes, then the response, numbered in order.
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.incomplete"
    deltas = [event.delta for event in events if event.type == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == answer.output_text, "greedy: the same text, token by token"
    assert [event.sequence_number for event in events] == list(range(len(events)))
    # Going on: the earlier messages (not its instructions), its answer, then the new input.
    (previous,) = [r for r in request_services.queue().recent(None, deployment="tiny", status=None, offset=0,
                                                                limit=50)[0] if f"resp_{r.id}" == after.id]  # fmt: skip
    assert previous.input == [
        {"role": "user", "content": "Once upon a time"},
        {"role": "assistant", "content": answer.output_text},
        {"role": "user", "content": "And then?"},
    ]
    assert after.previous_response_id == answer.id and after.instructions is None
    # Its own input, as items: not its instructions, nor what the previous response carried over.
    assert [(i.type, i.role, i.content[0].text) for i in given] == [("message", "user", "Once upon a time")]
    assert [(i.role, i.content[0].text) for i in given_after] == [("user", "And then?")]
    assert refused.value.body["param"] == "previous_response_id"
    assert no_image.value.body["param"] == "input.0.content.0"
    # Retrieved as it stands, for as long as its request is kept: the same answer; yours alone.
    assert kept.output_text == answer.output_text and kept.status == "incomplete" and kept.id == answer.id
    assert failed.status == "failed" and failed.error.code == "context_length_exceeded"
    # A request the replica fails ends its stream with response.failed, saying why.
    assert [e.type for e in too_long][-1] == "response.failed"
    assert too_long[-1].response.error.code == "context_length_exceeded" and too_long[-1].response.status == "failed"


def test_the_responses_api_calls_functions_as_items_and_takes_their_outputs(client, served_longer):
    unit = {"type": "function", **UNIT["function"]}
    asked = {"model": "tiny", "input": "Convert it", "tools": [unit], "max_output_tokens": 600}

    called = client.responses.create(**asked, tool_choice="required", parallel_tool_calls=False)
    with client.responses.stream(**asked, tool_choice={"type": "function", "name": "convert"}) as helped:
        events = list(helped)  # OpenAI's stream helper, which builds the response from the events
    built = helped.get_final_response()
    (call,) = called.output
    answered = client.responses.create(
        model="tiny",
        input=[*asked_input(asked), call.model_dump(), {"type": "function_call_output", "call_id": call.call_id,
                                                       "output": "273 K"}],
        tools=[unit],
        tool_choice="none",
        max_output_tokens=4,
    )  # fmt: skip

    assert call.type == "function_call" and call.name == "convert" and call.call_id.startswith("call_")
    assert json.loads(call.arguments)["unit"] in ("celsius", "kelvin") and called.status == "completed"
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert [item.type for item in added] == ["function_call"], "a call asked for: no text, the call whole"
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert json.loads(done.arguments) == json.loads(call.arguments), "greedy: the same call"
    assert events[-1].type == "response.completed" and built.output[0].name == "convert"
    assert built.output[0].arguments == done.arguments
    assert answered.output_text and answered.output[0].type == "message", "the call's output read, a text answer"
    # Left to the model (auto): a random one writes text, streamed as it comes.
    free = {"model": "tiny", "input": "Hi", "tools": [unit], "max_output_tokens": 6}
    said = client.responses.create(**free)
    streamed = [e.delta for e in client.responses.create(**free, stream=True) if e.type == "response.output_text.delta"]
    assert said.output_text and "".join(streamed) == said.output_text and said.output[0].type == "message"


def asked_input(asked: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": asked["input"]}]


@pytest.fixture
def served_thinking(replica, tiny_model_dir) -> Iterator[Any]:
    """`served`, its tokenizer's chat template opening the thinking (as DeepSeek-R1's does)."""
    from tests.scheduling.test_reasoning import THINKING

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.chat_template = THINKING
    yield from _serving(replica, model, tokenizer)


def test_a_reasoning_models_thinking_comes_apart_from_its_answer_whole_streamed_and_as_a_response(
    client, served_thinking
):
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}

    said = client.chat.completions.create(**chat).choices[0].message
    chunks = [c.choices[0].delta for c in client.chat.completions.create(**chat, stream=True) if c.choices]
    plain = client.chat.completions.create(**chat, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    answered = client.responses.create(model="tiny", input="Hi", max_output_tokens=8)
    # Given back as OpenAI's client returns a message (a random model's own may hold a NUL).
    given_back = {**said.model_dump(), "reasoning": "Greet back.", "reasoning_content": "Greet back."}
    again = client.chat.completions.create(
        model="tiny", max_tokens=2, messages=[*chat["messages"], given_back, {"role": "user", "content": "So?"}]
    )
    with pytest.raises(openai.BadRequestError) as taken:
        client.chat.completions.create(**chat, extra_body={"chat_template_kwargs": {"tokenize": True}})

    # Cut by max_tokens before it closed its thinking: all of it is reasoning, in both fields.
    assert said.reasoning and said.reasoning_content == said.reasoning and said.content == ""
    streamed = "".join(getattr(delta, "reasoning", None) or "" for delta in chunks)
    assert streamed == said.reasoning and not any(delta.content for delta in chunks), "as it came, in its own field"
    assert plain.choices[0].message.content and getattr(plain.choices[0].message, "reasoning", None) is None
    (item,) = answered.output
    assert item.type == "reasoning" and item.content[0].text == said.reasoning
    assert again.choices[0].finish_reason == "length", "its reasoning given back is read"
    assert taken.value.body["param"] == "chat_template_kwargs.tokenize"


def test_an_answer_held_to_json_through_v1_is_that_json_and_a_schema_it_cannot_hold_to_is_a_400(
    client, served, live_server
):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Is it?"}], "max_tokens": 60}

    held = client.chat.completions.create(
        **chat, response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    )
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(**chat, response_format={"type": "json_schema", "json_schema": {
            "name": "answer", "schema": {"type": "colour"}}})  # fmt: skip
    with pytest.raises(openai.BadRequestError) as guided:
        client.chat.completions.create(**chat, extra_body={"guided_json": {"type": "colour"}})
    # /infer/'s caller sent it as `format`, and is told so.
    call = urllib.request.Request(
        f"{live_server.url}/api/deployments/tiny/infer/",
        data=json.dumps({"input": "Is it?", "params": {"format": {"type": "colour"}}}).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Token {client.api_key}"},
    )
    with pytest.raises(urllib.error.HTTPError) as inferred:
        urllib.request.urlopen(call, timeout=30)

    assert isinstance(json.loads(held.choices[0].message.content)["ok"], bool)
    assert refused.value.body["message"].startswith("response_format: this JSON Schema cannot be held to")
    assert refused.value.body["param"] == "response_format", "named by the replica's refusal, not the messages"
    assert guided.value.body["message"].startswith("guided_json: this JSON Schema cannot be held to")
    assert guided.value.body["param"] == "guided_json"
    assert inferred.value.code == 400
    assert json.loads(inferred.value.read())["error"].startswith("format: this JSON Schema cannot be held to")


def test_ignore_eos_runs_an_answer_to_its_max_tokens_as_min_tokens_of_them_all():
    body = {"model": "tiny", "prompt": "x", "max_tokens": 32}

    assert read({**body, "ignore_eos": True}, "generate").params["min_tokens"] == 32
    assert "min_tokens" not in read({**body, "ignore_eos": False}, "generate").params
    assert read({**body, "min_tokens": 4}, "generate").params["min_tokens"] == 4
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "ignore_eos": True}
    # A chat that leaves its length to the replica: held to the length the replica fits.
    assert read(chat, "chat").params["min_tokens"] == completion_input.MAX_TOKENS
    for asked, refusal in (
        ({"ignore_eos": "yes"}, "ignore_eos: must be true or false"),
        ({"min_tokens": 33}, "min_tokens: must be at most max_tokens (32)"),
        ({"min_tokens": -1}, "min_tokens: must be from 0 to 4096"),
    ):
        with pytest.raises(completion_input.Refused) as refused:
            read({**body, **asked}, "generate")
        assert str(refused.value) == refusal


def test_best_of_equal_to_n_keeps_every_choice_and_any_other_is_refused_naming_n():
    body = {"model": "tiny", "prompt": "x", "n": 3}

    assert read({**body, "best_of": 3}, "generate").n == 3
    with pytest.raises(completion_input.Refused, match=r"^best_of: not supported beyond n: .* here 3\)$"):
        read({**body, "best_of": 5}, "generate")


def test_a_chat_refusal_names_the_message_and_its_field():
    with pytest.raises(completion_input.Refused, match=r"^messages\.1\.role: must be one of system, user"):
        read({"model": "tiny", "messages": [{"role": "user", "content": "a"}, {"role": "wizard"}]}, "chat")
    for content, said in (
        ([], r"^messages\.0\.content: required: a string or a non-empty list of text parts"),
        (["hi"], r"^messages\.0\.content\.0: a part that is no \{type, text\} object is not supported"),
        ([{"type": "text"}], r"^messages\.0\.content\.0\.text: required: a string"),
        (7, r"^messages\.0\.content: required: a string or a list of text parts"),
    ):
        with pytest.raises(completion_input.Refused, match=said):
            read({"model": "tiny", "messages": [{"role": "user", "content": content}]}, "chat")


def test_a_session_and_a_token_get_the_same_refusal(replica):
    from django.test import Client

    user = User.objects.create_user("bob")
    key = Token.objects.create(user=user).key
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "temperature": 5}
    by_token = Client().post(  # answered without DRF
        "/v1/chat/completions", body, content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {key}"
    )
    signed_in = Client()
    signed_in.force_login(user)
    by_session = signed_in.post("/v1/chat/completions", body, content_type="application/json")  # through DRF

    assert by_token.status_code == by_session.status_code == 400
    refusal = {"message": "temperature: must be from 0 to 2", "type": "invalid_request_error", "param": "temperature"}
    assert by_token.json() == by_session.json() == {"error": {**refusal, "code": None}}
    assert request_services.queue_depth("tiny") == 0

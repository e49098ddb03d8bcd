"""Ollama's own API (`/api/chat`, `/api/generate`, `/api/embed`, `/api/tags`, `/api/ps`,
`/api/show`, `/api/version`) as the portal reads and answers it: a body into a chat's, each
refusal naming Ollama's field, and served, through Ollama's own Python client."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import ollama
import pytest

from gpuportal.wire import reasoning, sampling, tools
from scheduling.api.completion_input import Refused
from scheduling.api.ollama import OllamaChatView, OllamaGenerateView
from scheduling.api.ollama_load import keep_alive_s
from scheduling.models import Deployment, Replica
from tests.scheduling.test_embeddings import EmbeddingStandIn, vector_of
from tests.scheduling.test_openai import client, replica, served  # noqa: F401
from tests.support import factories

MiB = 1024**2
CHAT = [{"role": "user", "content": "Once upon a time"}]


def read(view: Any = None, **body: Any) -> Any:
    return (view or OllamaChatView()).parse({"model": "tiny", "messages": CHAT, **body}, owner="1")


def test_options_format_and_think_become_a_chats_and_num_predict_a_bound():
    call = read(options={"temperature": 0.5, "top_k": 3, "repeat_penalty": 1.1, "stop": ["\n"], "num_predict": 9,
                         "num_ctx": 4096, "num_gpu": 1}, format="json", think=False)  # fmt: skip
    unbounded = read(options={"num_predict": -1})

    assert (call.params["temperature"], call.params["top_k"], call.params["repetition_penalty"]) == (0.5, 3, 1.1)
    assert call.params["stop"] == ["\n"] and call.params["stream"] is True, "Ollama streams unless told not to"
    assert call.params["max_tokens"] is None and call.params[sampling.MAX_TOKENS_BOUND] == 9
    assert unbounded.params[sampling.MAX_TOKENS_BOUND] == sampling.MOST_TOKENS, "no bound: as far as the room goes"
    assert call.params[sampling.JSON_SCHEMA] == {"type": "object"} and call.params[sampling.SCHEMA_FIELD] == "format"
    assert call.params[reasoning.TEMPLATE_KWARGS] == {"enable_thinking": False}
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}}
    assert read(format=schema).params[sampling.JSON_SCHEMA] == schema


def test_a_conversation_with_calls_thinking_and_a_tools_answer_is_a_chats():
    weather = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}
    call = read(
        tools=[weather],
        messages=[
            *CHAT,
            {"role": "assistant", "content": "", "thinking": "Ask.",
             "tool_calls": [{"function": {"name": "weather", "arguments": {"city": "Oslo"}}}]},
            {"role": "tool", "content": "Sunny", "tool_name": "weather"},
        ],
    )  # fmt: skip

    assert call.params[tools.TOOL_CHOICE] == tools.AUTO and call.params[tools.TOOLS][0]["function"]["name"] == "weather"
    assistant, tool = call.input[1:]
    assert assistant["tool_calls"][0]["function"] == {"name": "weather", "arguments": {"city": "Oslo"}}
    assert assistant[reasoning.TEMPLATE_FIELD] == "Ask." and tool == {"role": "tool", "content": "Sunny"}


def test_generate_is_a_users_message_after_the_system_or_with_raw_the_prompt_as_it_is():
    templated = OllamaGenerateView()
    said = templated.parse({"model": "tiny", "prompt": "Hi", "system": "Be brief."}, owner="1")
    raw = OllamaGenerateView()
    given = raw.parse({"model": "tiny", "prompt": "Hi", "raw": True, "think": False, "options": {"num_predict": 4}},
                      owner="1")  # fmt: skip

    assert templated.kind == "chat" and said.input == [{"role": "system", "content": "Be brief."},
                                                       {"role": "user", "content": "Hi"}]  # fmt: skip
    assert raw.kind == "generate" and given.input == "Hi" and given.params[sampling.MAX_TOKENS_BOUND] == 4


@pytest.mark.parametrize(
    ("view", "body", "refusal"),
    [
        (OllamaChatView, {"messages": []}, "messages: required"),
        (OllamaChatView, {"messages": [{"role": "user", "content": "x", "images": ["aGk="]}]}, "messages.0.images"),
        (OllamaChatView, {"messages": [{"role": "bot", "content": "x"}]}, "messages.0.role"),
        (OllamaChatView, {"options": {"temperature": "hot"}}, "options.temperature"),
        (OllamaChatView, {"options": {"num_predict": 0}}, "options.num_predict"),
        (OllamaChatView, {"options": {"stop": ["a"] * 5}}, "options.stop"),
        (OllamaChatView, {"options": [1]}, "options: must be an object"),
        (OllamaChatView, {"format": "yaml"}, "format"),
        (OllamaChatView, {"think": "very"}, "think"),
        (OllamaChatView, {"stream": "yes"}, "stream"),
        (OllamaGenerateView, {"prompt": ""}, "prompt: required"),
        (OllamaGenerateView, {"prompt": "x", "suffix": "y"}, "suffix: not supported"),
        (OllamaGenerateView, {"prompt": "x", "images": ["aGk="]}, "images: not supported"),
        (OllamaGenerateView, {"prompt": "x", "template": "{{ .Prompt }}"}, "template: not supported"),
    ],
)
def test_bad_input_is_refused_naming_ollamas_field(view, body, refusal):
    given = {"model": "tiny", **({"messages": CHAT} if view is OllamaChatView else {}), **body}
    with pytest.raises(Refused) as refused:
        view().parse(given, owner="1")
    assert str(refused.value).startswith(refusal)


@pytest.fixture
def local(client, live_server) -> Iterator[ollama.Client]:  # noqa: F811
    signed = ollama.Client(host=live_server.url, headers={"Authorization": f"Bearer {client.api_key}"}, timeout=30)
    yield signed
    # A kept-alive connection keeps a server thread, and its database connection, past the test.
    signed.close()


def test_ollamas_client_chats_generates_and_streams_with_the_models_answers(local, client, served):  # noqa: F811
    said = local.chat(model="tiny", messages=CHAT, options={"num_predict": 8})
    pieces = list(local.chat(model="tiny", messages=CHAT, options={"num_predict": 8}, stream=True))
    generated = local.generate(model="tiny", prompt="Once upon a time", options={"num_predict": 8})
    raw = local.generate(model="tiny", prompt="Once upon a time", raw=True, options={"num_predict": 8})
    streamed_raw = list(local.generate(model="tiny", prompt="Once upon a time", raw=True, options={"num_predict": 8},
                                       stream=True))  # fmt: skip
    completion = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=8).choices[0].text
    too_long = [{"role": "user", "content": "word " * 2000}]
    with pytest.raises(ollama.ResponseError) as failed_stream:
        list(local.chat(model="tiny", messages=too_long, stream=True))
    with pytest.raises(ollama.ResponseError) as failed:
        local.chat(model="tiny", messages=too_long)
    # What `ollama run` sends first: a load, answered at once (the model serves already).
    loaded, chat_loaded = local.generate(model="tiny"), local.chat(model="tiny", messages=[])
    tagged = local.chat(model="tiny:latest", messages=CHAT, options={"num_predict": 8})  # Ollama's default tag

    assert said.message.role == "assistant" and said.done and said.done_reason == "length"
    assert (loaded.done_reason, loaded.response, chat_loaded.done_reason) == ("load", "", "load")
    assert said.eval_count == 8 and said.prompt_eval_count > 0 and said.total_duration > 0
    assert "".join(p.message.content for p in pieces) == said.message.content and len(pieces) > 2
    assert pieces[-1].done and pieces[-1].eval_count == 8 and not any(p.done for p in pieces[:-1])
    assert generated.response == said.message.content, "a prompt is the user's message, through the template"
    assert "too long" in failed_stream.value.error, "the stream's last line: the error, which the client raises"
    assert failed.value.status_code == 400 and "too long" in failed.value.error
    assert raw.response == completion and "".join(p.response for p in streamed_raw) == completion, "raw: as it is"
    assert tagged.message.content == said.message.content, "`tiny:latest` is `tiny`"


def test_ollamas_client_is_refused_in_its_own_errors_and_lists_the_models(local, served, replica, live_server):  # noqa: F811
    encoder = factories.deployment(name="minilm", model_source="/models/x", loader=Deployment.Loader.EMBEDDING,
                                   memory_override_bytes=MiB)  # fmt: skip
    Replica.objects.create(deployment=encoder, state=Replica.State.SERVING)
    stand_in = EmbeddingStandIn(Replica.objects.get(deployment=encoder).id)
    stand_in.start()

    embedded = local.embed(model="minilm", input=["ab", "cde"])
    stand_in.join(10)
    stand_in = EmbeddingStandIn(Replica.objects.get(deployment=encoder).id)
    stand_in.start()
    embedded_first_way = local.embeddings(model="minilm", prompt="four")
    stand_in.join(10)
    with pytest.raises(ollama.ResponseError) as no_prompt:
        local.embeddings(model="minilm")
    with pytest.raises(ollama.ResponseError) as not_an_encoder:
        local.embeddings(model="tiny", prompt="four")
    with pytest.raises(ollama.ResponseError) as missing:
        local.chat(model="tinny", messages=CHAT)
    with pytest.raises(ollama.ResponseError) as bad:
        local.chat(model="tiny", messages=CHAT, options={"num_predict": 0})
    stranger = ollama.Client(host=live_server.url, timeout=30)
    with pytest.raises(ollama.ResponseError) as unsigned:
        stranger.chat(model="tiny", messages=CHAT)
    stranger.close()
    Deployment.objects.filter(name="tiny").update(model_adapters="sql=/adapters/sql")
    listed = local.list()
    running = local.ps()
    shown = local.show("tiny")
    adapter = local.show("tiny:sql")
    with pytest.raises(ollama.ResponseError) as no_adapter:
        local.show("tiny:nope")
    version = local._client.get("/api/version").json()

    assert embedded.embeddings == [vector_of("ab"), vector_of("cde")] and embedded.model == "minilm"
    assert embedded_first_way.embedding == vector_of("four"), "/api/embeddings: one prompt, one vector"
    assert no_prompt.value.status_code == 400 and no_prompt.value.error.startswith("prompt: required")
    assert not_an_encoder.value.status_code == 400 and "not an embedding model" in not_an_encoder.value.error
    assert missing.value.status_code == 404 and "did you mean `tiny`?" in missing.value.error
    assert bad.value.status_code == 400 and bad.value.error.startswith("options.num_predict")
    assert unsigned.value.status_code == 401
    assert [m.model for m in listed.models] == ["minilm", "tiny", "tiny:sql"], "an adapter after its model"
    assert [m.details.parent_model for m in listed.models] == ["", "", "tiny"]
    assert [m.model for m in running.models] == ["minilm", "tiny", "tiny:sql"], "each has a replica serving"
    assert shown.modelinfo["gpuportal.context_length"] == Deployment.objects.get(name="tiny").max_tokens
    assert adapter.details.parent_model == "tiny" and local.show("tiny:latest").details.parent_model == ""
    assert no_adapter.value.status_code == 404 and "tiny:nope" in no_adapter.value.error
    assert "completion" in shown.capabilities and version["version"]


# -- loading and unloading: Ollama's calls with nothing to answer ------------------------------------


@pytest.mark.parametrize(
    ("given", "seconds"),
    [(0, 0.0), ("0", 0.0), ("0s", 0.0), ("5m", 300.0), ("1h30m", 5400.0), ("-1", -1.0), (2.5, 2.5), ("300", 300.0)],
)
def test_keep_alive_is_read_as_ollama_reads_it(given, seconds):
    assert keep_alive_s(given) == seconds


@pytest.mark.parametrize("given", ["soon", "5 m", "", True, [1], {"m": 5}])
def test_a_keep_alive_that_is_no_duration_is_refused_naming_it(given):
    with pytest.raises(Refused) as refused:
        keep_alive_s(given)
    assert refused.value.param == "keep_alive"
    with pytest.raises(Refused) as in_a_chat:
        read(keep_alive=given)
    assert in_a_chat.value.param == "keep_alive", "read on every call, not only a load's"


def test_ollamas_unload_puts_the_model_to_sleep_for_staff_alone_and_its_load_wakes_it_for_anyone(
    cluster, api, dispatched, tiny_model_dir, django_capture_on_commit_callbacks
):
    from django.contrib.auth.models import User
    from rest_framework.test import APIClient

    from scheduling.models import Event
    from tests.support.deployments import asleep, body, serve

    api("post", "/api/deployments/", body("tiny-a", tiny_model_dir))
    replica_id = Replica.objects.get().id
    serve(replica_id)
    bob = APIClient()
    bob.force_authenticate(User.objects.create_user("bob"))

    def as_bob(path: str, call: dict) -> Any:
        with django_capture_on_commit_callbacks(execute=True):
            return bob.post(path, call, format="json")

    refused = as_bob("/api/generate", {"model": "tiny-a", "keep_alive": 0})
    assert refused.status_code == 403 and "only staff" in refused.json()["error"]
    assert Replica.objects.get(pk=replica_id).state == "serving", "nothing done"

    unloaded = api("post", "/api/generate", {"model": "tiny-a", "keep_alive": "0s"})
    assert unloaded.status_code == 200, unloaded.json()
    assert unloaded.json() | {"created_at": ""} == {
        "model": "tiny-a", "created_at": "", "response": "", "done": True, "done_reason": "unload"
    }  # fmt: skip
    assert Replica.objects.get(pk=replica_id).state == "draining"
    assert Event.objects.filter(replica=replica_id, reason__contains="(Ollama's keep_alive 0)").exists()
    asleep(replica_id)

    loaded = as_bob("/api/chat", {"model": "tiny-a", "messages": []})
    assert loaded.status_code == 200, loaded.json()
    assert loaded.json()["message"] == {"role": "assistant", "content": ""} and loaded.json()["done_reason"] == "load"
    assert Replica.objects.get(pk=replica_id).state == "waking"
    assert Event.objects.filter(replica=replica_id, reason__contains="woken for bob's load (Ollama's)").exists()

    missing = as_bob("/api/generate", {"model": "nope"})
    assert (missing.status_code, missing.json()) == (404, {"error": "model 'nope' not found"})
    unnamed = as_bob("/api/chat", {"messages": []})
    assert unnamed.status_code == 400 and unnamed.json()["error"].startswith("model:")

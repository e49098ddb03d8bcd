"""Counting a model's tokens with its own tokenizer, on a replica: vLLM's `/tokenize` and
`/detokenize`, Anthropic's `/v1/messages/count_tokens`. A count generates nothing and counts
what an answer's usage would."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from datetime import timedelta
from typing import Any

import anthropic
import pytest

from gpuportal.wire import sampling
from gpuportal.wire.requestqueue import Request
from inference.management.commands.make_tiny_model import build_tokenizer
from inference.serving import Executor
from scheduling.models import Deployment
from tests.scheduling.test_openai import client, replica, served  # noqa: F401
from tests.support.serving import tiny_llama_config

CHAT = [{"role": "user", "content": "Once upon a time"}]


def test_a_count_is_the_prompts_tokens_and_nothing_generated():
    from transformers import LlamaForCausalLM

    tokenizer = build_tokenizer()
    executor = Executor(LlamaForCausalLM(tiny_llama_config()).eval(), tokenizer)

    def count(kind: str, given: Any) -> dict[str, Any]:
        return executor.run(Request(id="r", deployment="t", kind=kind, input=given, params={sampling.COUNT_ONLY: True}),
                            None)  # fmt: skip

    text = count("generate", "Once upon a time")
    chat = count("chat", CHAT)
    ids = count("generate", text[sampling.PROMPT_TOKEN_IDS])
    long = count("generate", "word " * 100_000)

    assert text[sampling.PROMPT_TOKEN_IDS] == tokenizer("Once upon a time").input_ids
    assert text["usage"] == {"prompt_tokens": len(text[sampling.PROMPT_TOKEN_IDS]), "completion_tokens": 0,
                             "total_tokens": len(text[sampling.PROMPT_TOKEN_IDS])}  # fmt: skip
    assert text["text"] == "", "nothing generated"
    assert chat[sampling.PROMPT_TOKEN_IDS] == tokenizer(executor.chat_prompt(CHAT)).input_ids, "through the template"
    assert ids["prompt_text"] == tokenizer.decode(text[sampling.PROMPT_TOKEN_IDS]), "ids given: decoded"
    assert long["usage"]["prompt_tokens"] > 100_000, "counted, not refused for a size no context holds"


def post(
    live_server: Any, path: str, body: dict[str, Any], key: str, *, as_anthropic: bool = False
) -> tuple[int, dict[str, Any]]:
    given = {"x-api-key": key} if as_anthropic else {"Authorization": f"Bearer {key}"}
    call = urllib.request.Request(
        f"{live_server.url}{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **given},
    )
    try:
        with urllib.request.urlopen(call, timeout=30) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as refused:
        return refused.code, json.loads(refused.read())


def test_vllms_tokenize_and_detokenize_count_with_the_models_tokenizer(client, served, live_server):  # noqa: F811
    tokenizer, key = served, client.api_key
    rendered = Executor(None, tokenizer).chat_prompt(CHAT)

    _, text = post(live_server, "/tokenize", {"model": "tiny", "prompt": "Once upon a time"}, key)
    _, chat = post(live_server, "/tokenize", {"model": "tiny", "messages": CHAT}, key)
    _, back = post(live_server, "/detokenize", {"model": "tiny", "tokens": text["tokens"]}, key, as_anthropic=True)
    refused = {
        "both": post(live_server, "/tokenize", {"model": "tiny", "prompt": "x", "messages": CHAT}, key),
        "neither": post(live_server, "/tokenize", {"model": "tiny"}, key),
        "no list": post(live_server, "/detokenize", {"model": "tiny", "tokens": "1 2"}, key),
        "beyond": post(live_server, "/detokenize", {"model": "tiny", "tokens": [1, 100_000]}, key),
        "no model": post(live_server, "/tokenize", {"model": "tinny", "prompt": "x"}, key),
    }
    answered = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2)

    assert text["tokens"] == tokenizer("Once upon a time").input_ids and text["count"] == len(text["tokens"])
    assert text["max_model_len"] == Deployment.objects.get(name="tiny").max_tokens
    assert chat["tokens"] == tokenizer(rendered).input_ids, "a chat through its template, as the replica renders it"
    assert chat["count"] == answered.usage.prompt_tokens, "what an answer's usage counts"
    assert back == {"prompt": tokenizer.decode(text["tokens"])}
    assert refused["both"][0] == refused["neither"][0] == 400 and refused["both"][1]["error"]["param"] == "prompt"
    assert refused["no list"][0] == 400 and refused["no list"][1]["error"]["param"] == "tokens"
    assert refused["beyond"] == (400, refused["beyond"][1]) and refused["beyond"][1]["error"]["param"] == "tokens"
    assert refused["beyond"][1]["error"]["message"].startswith("tokens: token 100000 is not in the model's vocabulary")
    assert refused["no model"][0] == 404 and "did you mean `tiny`?" in refused["no model"][1]["error"]["message"]


def test_anthropics_count_tokens_is_what_a_messages_usage_counts(client, served, live_server):  # noqa: F811
    asked = {"model": "tiny", "system": "Be brief.", "messages": CHAT}

    with anthropic.Anthropic(base_url=live_server.url, api_key=client.api_key, max_retries=0, timeout=30) as claude:
        counted = claude.messages.count_tokens(**asked)
        said = claude.messages.create(**asked, max_tokens=2)
        with pytest.raises(anthropic.BadRequestError) as refused:
            claude.messages.count_tokens(model="tiny", messages=[{"role": "user", "content": [{"type": "image"}]}])

    assert counted.input_tokens == said.usage.input_tokens > 0
    assert refused.value.body["error"]["message"].startswith("messages.0.content.0.type")


def test_a_count_is_recorded_as_a_kind_of_its_own_and_is_no_answers_latency(client, served, live_server):  # noqa: F811
    from django.utils import timezone

    from scheduling.models import RequestRecord
    from scheduling.services import traffic, traffic_stats

    traffic.drain()  # what earlier tests left in the shared list
    RequestRecord.objects.all().delete()

    client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2)
    code, _ = post(live_server, "/tokenize", {"model": "tiny", "messages": CHAT}, client.api_key)

    assert code == 200 and traffic.drain() == 2
    assert sorted(RequestRecord.objects.values_list("kind", "status", "output_tokens")) == [
        ("chat", "done", 2),
        ("count", "done", 0),
    ]
    (tiny,) = traffic_stats.stats(3600, deployment="tiny")
    assert (tiny.done, tiny.output_tokens) == (1, 2), "the answer alone: a count's milliseconds are no answer's"
    # A trace of the traffic (export_trace) holds the answer, and says of no request that it
    # ended without one.
    since = timezone.now() - timedelta(hours=1)
    assert [row.output_tokens for row in traffic.trace_rows(since)] == [2] and traffic.skipped_count(since) == 0

"""`POST /v1/embeddings` above the replica: the OpenAI shape, as floats and as base64,
through the official `openai` client over HTTP (a live server in the test process, a stand-in
replica thread serving the queue); what each kind of deployment refuses; and `hf:org/name`
sources read from the nodes' Hugging Face cache, or refused saying how to download them.
tests/inference/test_embeddings.py runs a real model in real replica processes."""

from __future__ import annotations

import base64
import struct
from collections.abc import Iterator

import openai
import pytest
from django.contrib.auth.models import User
from rest_framework.authtoken.models import Token

from inference.devices import virtual_gpus
from scheduling.api import completion_input
from scheduling.models import Deployment, Replica
from scheduling.services import requests as request_services
from scheduling.services.nodes import register_node
from tests.support import factories
from tests.support.deployments import body
from tests.support.embedding import StandInEncoder
from tests.support.factories import NO_OVERHEAD
from tests.support.hub import cache_model, use_cache

MiB = 1024**2
# What the stand-in answers for each text: numbers a float32 holds exactly, as a replica's are.
TAIL = [0.5, -0.25, 0.125]


def vector_of(text: str) -> list[float]:
    return [float(len(text)), *TAIL]


class EmbeddingStandIn(StandInEncoder):
    def __init__(self, replica_id: str):
        super().__init__(replica_id, "minilm", vector_of)


@pytest.fixture
def served(transactional_db) -> dict[str, Replica]:
    """A serving replica of an embedding deployment, one of a causal LM, and a plain module."""
    register_node("node1", virtual_gpus("node1", "1x1GiB", NO_OVERHEAD), virtual=True)
    request_services.queue.cache_clear()
    replicas = {}
    for name, loader in [
        ("minilm", Deployment.Loader.EMBEDDING),
        ("tiny", Deployment.Loader.TRANSFORMERS),
        ("mlp", Deployment.Loader.TORCH_MODULE),
    ]:
        replicas[name] = factories.serving(name, model_source="/models/x", loader=loader, memory_override_bytes=MiB)
    return replicas


@pytest.fixture
def client(live_server, served) -> Iterator[openai.OpenAI]:
    key = Token.objects.create(user=User.objects.create_user("alice")).key
    with openai.OpenAI(base_url=f"{live_server.url}/v1", api_key=key, max_retries=0, timeout=30) as client:
        yield client


def test_models_lists_embedding_models_beside_causal_lms_but_not_plain_modules(client):
    assert sorted(m.id for m in client.models.list()) == ["minilm", "tiny"]


def test_embeddings_come_back_in_the_openai_shape_one_per_input_in_order(client, served):
    replica = EmbeddingStandIn(served["minilm"].id)
    replica.start()

    # Without encoding_format, OpenAI's client asks for base64 and decodes it itself.
    result = client.embeddings.create(model="minilm", input=["ab", "cde"])

    replica.join(10)
    assert replica.kinds == ["embed"], "the inputs of one call are one request"
    assert result.object == "list" and result.model == "minilm"
    assert [(d.object, d.index) for d in result.data] == [("embedding", 0), ("embedding", 1)]
    assert [d.embedding for d in result.data] == [vector_of("ab"), vector_of("cde")]
    assert (result.usage.prompt_tokens, result.usage.total_tokens) == (5, 5)


def test_base64_carries_the_float32_values_little_endian_and_float_the_numbers(client, served):
    for encoding in ("base64", "float"):
        replica = EmbeddingStandIn(served["minilm"].id)
        replica.start()
        raw = client.embeddings.with_raw_response.create(model="minilm", input="four", encoding_format=encoding)
        replica.join(10)
        (item,) = raw.http_response.json()["data"]
        if encoding == "float":
            assert item["embedding"] == vector_of("four")
        else:
            packed = base64.b64decode(item["embedding"])
            assert list(struct.unpack("<4f", packed)) == vector_of("four")


def test_a_causal_lm_refuses_embeddings_and_an_encoder_refuses_completions_the_openai_way(client):
    with pytest.raises(openai.BadRequestError, match=r"`tiny` is not an embedding model \(tiny is a causal LM") as e:
        client.embeddings.create(model="tiny", input="x")
    assert e.value.body["param"] == "model" and e.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError, match="`mlp` is not an embedding model"):
        client.embeddings.create(model="mlp", input="x")
    with pytest.raises(openai.BadRequestError, match="`minilm` is not a causal language model") as e:
        client.completions.create(model="minilm", prompt="x")
    assert "POST /v1/embeddings" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError, match="`minilm` is not a causal language model"):
        client.chat.completions.create(model="minilm", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.embeddings.create(model="nope", input="x")
    assert all(request_services.queue_depth(name) == 0 for name in ("tiny", "mlp", "minilm"))


def test_infer_on_an_embedding_model_points_to_v1_embeddings(served, staff):
    response = staff.post("/api/deployments/minilm/infer/", {"input": "hello"}, format="json")

    assert response.status_code == 400
    assert response.json()["input"] == ["minilm is an embedding model: send its text to POST /v1/embeddings"]


def test_a_bad_embeddings_body_is_a_400_naming_the_field(client):
    with pytest.raises(openai.BadRequestError, match="input: must not be an empty string"):
        client.embeddings.create(model="minilm", input="")
    with pytest.raises(openai.BadRequestError, match=r"input\.0: token arrays are not supported"):
        client.embeddings.create(model="minilm", input=[[101, 2023]])
    with pytest.raises(openai.BadRequestError, match="dimensions: not supported"):
        client.embeddings.create(model="minilm", input="x", dimensions=8)
    assert request_services.queue_depth("minilm") == 0


def read(body):
    return completion_input.parse_embeddings(body, default_timeout_s=30, max_timeout_s=300)


def test_the_embeddings_parser_reads_a_string_or_a_list_of_strings():
    assert read({"model": " minilm ", "input": "hi", "user": "ignored"}) == completion_input.Embeddings(
        model="minilm", input=["hi"], encoding_format="float", timeout_s=30
    )
    call = read({"model": "minilm", "input": ["a", "b"], "encoding_format": "base64", "timeout": 5})
    assert (call.input, call.encoding_format, call.timeout_s) == (["a", "b"], "base64", 5)


@pytest.mark.parametrize(
    ("fields", "refusal"),
    [
        ({"input": "x"}, "model: required: the deployment's name"),
        ({"model": "m"}, "input: required: a string or a non-empty list of strings"),
        ({"model": "m", "input": []}, "input: required: a string or a non-empty list of strings"),
        ({"model": "m", "input": ["a", ""]}, "input.1: must not be an empty string"),
        ({"model": "m", "input": ["a", 3.5]}, "input.1: must be a string"),
        ({"model": "m", "input": [1, 2, 3]}, "input.0: token arrays are not supported: send text"),
        ({"model": "m", "input": ["a"] * 2049}, "input: at most 2048 inputs in one call"),
        ({"model": "m", "input": "a", "encoding_format": "int8"}, "encoding_format: must be one of float, base64"),
        ({"model": "m", "input": "a", "timeout": 301}, "timeout: at most 300 s (GPUPORTAL_INFER_MAX_TIMEOUT_S)"),
    ],
)
def test_the_embeddings_parser_refuses_saying_which_field_and_why(fields, refusal):
    with pytest.raises(completion_input.Refused) as refused:
        read(fields)
    assert str(refused.value) == refusal


# -- hf:org/name sources ---------------------------------------------------------------------


@pytest.mark.django_db
def test_a_model_in_the_nodes_hugging_face_cache_deploys_by_its_name(
    cluster, api, tiny_model_dir, tmp_path, monkeypatch
):
    use_cache(monkeypatch, tmp_path / "hub")
    cache_model(tmp_path / "hub", "acme/tiny-llama", tiny_model_dir)

    response = api("post", "/api/deployments/", body("from-hub", "hf:acme/tiny-llama"))
    by_path = api("post", "/api/deployments/", body("from-dir", tiny_model_dir))

    assert response.status_code == by_path.status_code == 201, response.json()
    from_hub, from_dir = (Deployment.objects.get(name=n) for n in ("from-hub", "from-dir"))
    assert from_hub.model_source == "hf:acme/tiny-llama"
    weights = from_hub.observed.weight_bytes
    assert weights == from_dir.observed.weight_bytes > 0, "read from the snapshot the name points at"


@pytest.mark.django_db
def test_a_model_not_in_the_cache_is_a_400_naming_model_source_that_says_how_to_download_it(
    cluster, api, tmp_path, monkeypatch
):
    use_cache(monkeypatch, tmp_path / "empty-hub")

    response = api("post", "/api/deployments/", body("missing", "hf:acme/not-downloaded"))

    assert response.status_code == 400, response.json()
    (says,) = response.json()["model.source"]
    cache = tmp_path / "empty-hub"
    assert says.startswith(f"hf:acme/not-downloaded is not in this node's Hugging Face cache ({cache})")
    assert "`gpuportal pull acme/not-downloaded`" in says and "`hf download acme/not-downloaded`" in says
    bad_name = api("post", "/api/deployments/", body("bad", "hf:not a name"))
    assert bad_name.status_code == 400 and "is not a Hugging Face model name" in str(bad_name.json())
    assert not Deployment.objects.exists()

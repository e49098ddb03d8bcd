"""`POST /v1/rerank` (`/rerank`, `/v2/rerank`): documents ranked by the cosine of their vectors
with the query's, from one embedding request; `POST /v1/score` (`/score`), pairs scored so.
Above the replica (a stand-in serves the queue with vectors set here);
tests/inference/test_embeddings.py ranks with a real model against its own reference."""

from __future__ import annotations

import math

import pytest
from django.contrib.auth.models import User
from django.test import Client
from hypothesis import given
from hypothesis import strategies as st
from rest_framework.authtoken.models import Token

from inference.devices import virtual_gpus
from scheduling.api.completion_input import Refused
from scheduling.api.rerank import MAX_DOCUMENTS, parse_rerank, parse_score, ranked
from scheduling.models import Deployment, Replica
from scheduling.services import requests as request_services
from scheduling.services.nodes import register_node
from tests.support import factories
from tests.support.embedding import StandInEncoder
from tests.support.factories import NO_OVERHEAD

MiB = 1024**2
QUERY = "Where do cats sleep?"
# Each text's vector: the query's points along the first axis; each document's cosine with it is
# the first number over its length.
VECTORS = {
    QUERY: [2.0, 0.0, 0.0],
    "Stocks fell today.": [0.0, 3.0, 0.0],
    "Cats sleep in the sun.": [0.8, 0.6, 0.0],  # 0.8
    "A cat naps on the mat.": [0.6, 0.0, 0.8],  # 0.6
    "Dogs bark at night.": [-0.5, 0.0, 0.0],  # -1
}
DOCUMENTS = ["Stocks fell today.", "Cats sleep in the sun.", "A cat naps on the mat.", "Dogs bark at night."]


def read(**body: object):
    return parse_rerank(
        {"model": "minilm", "query": QUERY, "documents": DOCUMENTS, **body}, default_timeout_s=60, max_timeout_s=600
    )


def refusal(**body: object) -> str:
    with pytest.raises(Refused) as refused:
        read(**body)
    return str(refused.value)


def test_documents_are_ranked_by_their_cosine_with_the_query_the_most_relevant_first():
    query, *documents = (VECTORS[text] for text in [QUERY, *DOCUMENTS])

    scores = ranked(query, documents)

    assert [i for i, _ in scores] == [1, 2, 0, 3]
    assert [round(score, 12) for _, score in scores] == [0.8, 0.6, 0.0, -1.0]
    assert ranked([1.0, 0.0], [[0.0, 0.0], [2.0, 0.0], [3.0, 0.0]]) == [(1, 1.0), (2, 1.0), (0, 0.0)], (
        "alike in the order given; no length scores 0"
    )


# Numbers an embedding holds: none so small that the oracle's products underflow.
numbers = st.one_of(st.just(0.0), st.floats(1e-6, 1e3), st.floats(-1e3, -1e-6))
vectors = st.lists(numbers, min_size=3, max_size=3)


@given(vectors, st.lists(vectors, min_size=1, max_size=8))
def test_every_document_is_ranked_once_with_a_score_within_minus_one_and_one(query, documents):
    scores = ranked(query, documents)

    assert sorted(i for i, _ in scores) == list(range(len(documents)))
    assert all(-1 <= score <= 1 for _, score in scores)
    assert [score for _, score in scores] == sorted((score for _, score in scores), reverse=True)
    for i, score in scores:  # the cosine, as numbers a float holds it
        dot = sum(x * y for x, y in zip(query, documents[i], strict=True))
        norms = math.hypot(*query) * math.hypot(*documents[i])
        assert score == pytest.approx(dot / norms if norms else 0.0, abs=1e-9)


def test_documents_are_strings_or_objects_with_their_text_and_bad_input_is_refused_naming_its_field():
    assert read(documents=[{"text": "a"}, "b"]).documents == ["a", "b"]
    assert read().return_documents is True and read().top_n is None
    assert refusal(query="") == "query: required: a non-empty string"
    assert refusal(query=5).startswith("query: ")
    assert refusal(documents=[]).startswith("documents: required")
    assert refusal(documents="one").startswith("documents: required")
    assert refusal(documents=["a", ""]) == "documents.1: must not be an empty string"
    assert refusal(documents=["a", {"txt": "b"}]).startswith("documents.1.text: must be a string")
    assert refusal(documents=["a"] * (MAX_DOCUMENTS + 1)) == f"documents: at most {MAX_DOCUMENTS} documents in one call"
    assert refusal(top_n=0) == "top_n: must be a whole number of at least 1"
    assert refusal(top_n=True).startswith("top_n: ")
    assert refusal(return_documents="no") == "return_documents: must be true or false"
    assert refusal(top_k=2) == "top_k: unknown field; did you mean 'top_n'?"
    assert refusal(model="") == "model: required: the deployment's name"


def pairs(**body: object) -> tuple[list[str], list[tuple[int, int]]]:
    scoring = parse_score({"model": "minilm", **body}, default_timeout_s=60, max_timeout_s=600)
    return scoring.texts, scoring.pairs


def score_refusal(**body: object) -> str:
    with pytest.raises(Refused) as refused:
        parse_score({"model": "minilm", **body}, default_timeout_s=60, max_timeout_s=600)
    return str(refused.value)


def test_a_score_pairs_one_text_with_one_with_each_of_a_list_or_a_list_with_a_list_pair_by_pair():
    assert pairs(text_1="q", text_2="d") == (["q", "d"], [(0, 1)])
    assert pairs(text_1="q", text_2=["a", "b"]) == (["q", "a", "b"], [(0, 1), (0, 2)])
    assert pairs(text_1=["q"], text_2=["a", "b"]) == (["q", "a", "b"], [(0, 1), (0, 2)])
    assert pairs(text_1=["p", "q"], text_2=["a", "b"]) == (["p", "q", "a", "b"], [(0, 2), (1, 3)])
    assert score_refusal(text_1=["p", "q"], text_2=["a", "b", "c"]).startswith("text_2: must be as many texts")
    assert score_refusal(text_1="q", text_2=[]) == "text_2: required: a string or a non-empty list of strings"
    assert score_refusal(text_1="q", text_2=["a", 3]).startswith("text_2.1: ")
    assert score_refusal(text_2="d").startswith("text_1: ")
    assert score_refusal(text1="q", text_2="d") == "text1: unknown field; did you mean 'text_1'?"


@pytest.fixture
def served(transactional_db) -> dict[str, Replica]:
    register_node("node1", virtual_gpus("node1", "1x1GiB", NO_OVERHEAD), virtual=True)
    request_services.queue.cache_clear()
    replicas = {}
    for name, loader in [("minilm", Deployment.Loader.EMBEDDING), ("tiny", Deployment.Loader.TRANSFORMERS)]:
        replicas[name] = factories.serving(name, model_source="/models/x", loader=loader, memory_override_bytes=MiB)
    return replicas


@pytest.fixture
def caller(served) -> Client:
    key = Token.objects.create(user=User.objects.create_user("alice")).key
    return Client(headers={"Authorization": f"Bearer {key}"})


def ranking(caller: Client, served: dict[str, Replica], path: str, **body: object) -> tuple[dict, StandInEncoder]:
    replica = StandInEncoder(served["minilm"].id, "minilm", VECTORS.__getitem__)
    replica.start()
    answer = caller.post(
        path, {"model": "minilm", "query": QUERY, "documents": DOCUMENTS, **body}, content_type="application/json"
    )
    replica.join(10)
    assert answer.status_code == 200, answer.content
    return answer.json(), replica


def test_a_rerank_is_one_embedding_request_and_answers_the_best_first_with_their_documents(caller, served):
    answer, replica = ranking(caller, served, "/v1/rerank")

    assert replica.kinds == ["embed"] and replica.inputs == [[QUERY, *DOCUMENTS]], "the query and documents at once"
    assert answer["id"].startswith("rerank-") and answer["model"] == "minilm"
    assert [(r["index"], r["document"]["text"]) for r in answer["results"]] == [
        (1, "Cats sleep in the sun."),
        (2, "A cat naps on the mat."),
        (0, "Stocks fell today."),
        (3, "Dogs bark at night."),
    ]
    assert [round(r["relevance_score"], 9) for r in answer["results"]] == [0.8, 0.6, 0.0, -1.0]
    assert answer["usage"]["total_tokens"] == sum(len(t) for t in [QUERY, *DOCUMENTS])


def test_top_n_answers_the_best_n_and_cohere_and_jina_paths_answer_alike(caller, served):
    cohere, _ = ranking(caller, served, "/v2/rerank", top_n=2, return_documents=False)
    jina, _ = ranking(caller, served, "/rerank", top_n=9, documents=[{"text": t} for t in DOCUMENTS])

    assert [(r["index"], set(r)) for r in cohere["results"]] == [
        (1, {"index", "relevance_score"}),
        (2, {"index", "relevance_score"}),
    ]
    assert [r["index"] for r in jina["results"]] == [1, 2, 0, 3], "a top_n past the documents is all of them"


def test_a_replica_that_answers_too_few_vectors_is_a_server_error_that_says_so(caller, served):
    answers = []
    for path, body in [
        ("/v1/rerank", {"model": "minilm", "query": QUERY, "documents": DOCUMENTS}),
        ("/v1/embeddings", {"model": "minilm", "input": DOCUMENTS}),
    ]:
        replica = StandInEncoder(served["minilm"].id, "minilm", VECTORS.__getitem__, short_by=1)
        replica.start()
        answers.append(caller.post(path, body, "application/json"))
        replica.join(10)
    reranked, embedded = answers

    assert reranked.status_code == 502
    assert reranked.json()["error"]["message"] == "the replica gave 4 vectors for 5 texts"
    assert embedded.status_code == 502 and "3 vectors for 4 texts" in embedded.json()["error"]["message"]


def test_a_rerank_of_a_model_that_is_no_embedding_model_is_refused_and_queues_nothing(caller, served):
    not_an_encoder = caller.post(
        "/v1/rerank", {"model": "tiny", "query": "q", "documents": ["d"]}, content_type="application/json"
    )
    missing = caller.post("/v1/rerank", {"model": "nope", "query": "q", "documents": ["d"]}, "application/json")
    bad = caller.post("/v1/rerank", {"model": "minilm", "query": "q", "documents": [3]}, "application/json")

    assert not_an_encoder.status_code == 400 and not_an_encoder.json()["error"]["param"] == "model"
    assert "`tiny` is not an embedding model" in not_an_encoder.json()["error"]["message"]
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "model_not_found"
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "documents.0"
    assert all(request_services.queue_depth(name) == 0 for name in ("tiny", "minilm"))


def test_a_score_is_the_cosine_of_each_pairs_vectors_from_one_embedding_request(caller, served):
    answers = []
    for text_1 in (QUERY, [QUERY, "Stocks fell today."]):
        replica = StandInEncoder(served["minilm"].id, "minilm", VECTORS.__getitem__)
        replica.start()
        body = {"model": "minilm", "text_1": text_1, "text_2": DOCUMENTS[1:3]}
        answers.append(caller.post("/v1/score", body, "application/json"))
        replica.join(10)
    unpaired = caller.post("/score", {"model": "minilm", "text_1": ["a", "b"], "text_2": ["c"]}, "application/json")

    one, each = (answer.json() for answer in answers)
    assert one["object"] == "list" and one["id"].startswith("score-") and one["model"] == "minilm"
    scores = [(d["index"], d["object"], round(d["score"], 9)) for d in one["data"]]
    assert scores == [(0, "score", 0.8), (1, "score", 0.6)]
    # Pair by pair: the query with the first, the stocks with the second (orthogonal: 0).
    assert [round(d["score"], 9) for d in each["data"]] == [0.8, 0.0]
    assert unpaired.status_code == 400 and unpaired.json()["error"]["param"] == "text_2"

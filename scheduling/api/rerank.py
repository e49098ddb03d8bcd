"""`POST /v1/rerank` (and `/rerank`, `/v2/rerank`): documents ranked by their relevance to a
query, as the rerank APIs of Jina, Cohere and vLLM answer (what RAG tools call for their last
step: LangChain's and LlamaIndex's rerankers, Open WebUI's external one), by an embedding
deployment. The query and the documents are embedded in one request, one pass on its replica,
and each document is scored by the cosine of its vector with the query's: a bi-encoder's
relevance, as vLLM scores with an embedding model (a cross-encoder, which reads the query and a
document together, is not a loader the portal has). `POST /v1/score` (and `/score`), vLLM's, scores
pairs of texts the same way."""

from __future__ import annotations

import difflib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from django.http.response import HttpResponseBase
from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.request import Request as HttpRequest

from gpuportal.wire import sampling
from gpuportal.wire.requestqueue import Request
from scheduling.api import idempotency
from scheduling.api.completion_input import MAX_EMBEDDING_INPUTS, Refused, model_named, not_text, wait_of
from scheduling.api.openai_compat import EmbeddedAnswer

READ_FIELDS = ("model", "query", "documents", "top_n", "return_documents", "timeout")
TYPO_CUTOFF = 0.8
# The query is embedded with the documents, in the same request.
MAX_DOCUMENTS = MAX_EMBEDDING_INPUTS - 1


@dataclass(frozen=True)
class Rerank:
    model: str
    query: str
    documents: list[str]
    # How many of the best to answer with (all where None).
    top_n: int | None
    return_documents: bool
    timeout_s: float

    @property
    def texts(self) -> list[str]:
        """What is embedded, in one request: the query, then the documents."""
        return [self.query, *self.documents]


def parse_rerank(body: Any, *, default_timeout_s: float, max_timeout_s: float) -> Rerank:
    """The ranking a body asks for, or Refused naming the first field that is wrong."""
    _read_only(body, READ_FIELDS)
    model = model_named(body)
    query = body.get("query")
    if not sampling.is_text(query) or not query:
        raise Refused("query", not_text(query, "required: a non-empty string"))
    documents = _documents(body.get("documents"))
    top_n = body.get("top_n")
    if top_n is not None and (isinstance(top_n, bool) or not isinstance(top_n, int) or top_n < 1):
        raise Refused("top_n", "must be a whole number of at least 1")
    keep = body.get("return_documents", True)
    if not isinstance(keep, bool):
        raise Refused("return_documents", "must be true or false")
    timeout = wait_of(body.get("timeout"), default_timeout_s, max_timeout_s)
    return Rerank(model.strip(), query, documents, top_n, keep, timeout)


def _read_only(body: Any, fields: tuple[str, ...]) -> None:
    """Refused for a body that is no object, or for its first field that reads as a misspelling
    of one of `fields` (others, another API's, are left alone)."""
    if not isinstance(body, dict):
        raise Refused(None, "the body must be a JSON object")
    for key in body:
        if isinstance(key, str) and key not in fields:
            near = difflib.get_close_matches(key, fields, n=1, cutoff=TYPO_CUTOFF)
            if near:
                raise Refused(key, f"unknown field; did you mean {near[0]!r}?")


def _documents(value: Any) -> list[str]:
    """The documents' texts: each a string, or an object with its `text` (Jina's and Cohere's
    first API's form)."""
    if not isinstance(value, list) or not value:
        raise Refused("documents", "required: a non-empty list of strings")
    if len(value) > MAX_DOCUMENTS:
        raise Refused("documents", f"at most {MAX_DOCUMENTS} documents in one call")
    texts = []
    for i, document in enumerate(value):
        at = f"documents.{i}"
        if isinstance(document, dict):
            document, at = document.get("text"), f"{at}.text"
        if not sampling.is_text(document):
            raise Refused(at, not_text(document, 'must be a string (or {"text": a string})'))
        if not document:
            raise Refused(at, "must not be an empty string")
        texts.append(document)
    return texts


def ranked(query: Sequence[float], documents: Sequence[Sequence[float]]) -> list[tuple[int, float]]:
    """(each document's index, the cosine of its vector with the query's), the most relevant
    first; documents scored alike in the order given. A vector of no length scores 0."""
    scores = [(i, _cosine(query, vector)) for i, vector in enumerate(documents)]
    return sorted(scores, key=lambda scored: -scored[1])


def _cosine(a: Sequence[float], b: Sequence[float]) -> float:
    # Each vector scaled to unit length first (hypot does not underflow): the products of tiny
    # numbers would.
    length_a, length_b = math.hypot(*a), math.hypot(*b)
    if length_a == 0 or length_b == 0:
        return 0.0
    cosine = math.fsum((x / length_a) * (y / length_b) for x, y in zip(a, b, strict=True))
    return max(-1.0, min(1.0, cosine))  # rounding may take a vector's cosine with itself past 1


@dataclass(frozen=True)
class Scoring:
    model: str
    # The texts to embed, in order, and the pairs to score: (index of one, index of the other).
    texts: list[str]
    pairs: list[tuple[int, int]]
    timeout_s: float


SCORE_FIELDS = ("model", "text_1", "text_2", "timeout")


def parse_score(body: Any, *, default_timeout_s: float, max_timeout_s: float) -> Scoring:
    """The pairs a vLLM score call asks for: `text_1` and `text_2` each a string or a list; one
    against one, one against each of a list, or a list against a list of its length, pair by
    pair. Refused naming the first field that is wrong."""
    _read_only(body, SCORE_FIELDS)
    model = model_named(body)
    firsts, seconds = _side(body.get("text_1"), "text_1"), _side(body.get("text_2"), "text_2")
    if len(firsts) != 1 and len(firsts) != len(seconds):
        raise Refused(
            "text_2", f"must be as many texts as text_1 ({len(firsts)}), or text_1 one text to score against each"
        )
    if len(firsts) + len(seconds) > MAX_EMBEDDING_INPUTS:
        raise Refused("text_2", f"at most {MAX_EMBEDDING_INPUTS} texts in one call, text_1 and text_2 together")
    pairs = [(0 if len(firsts) == 1 else i, len(firsts) + i) for i in range(len(seconds))]
    timeout = wait_of(body.get("timeout"), default_timeout_s, max_timeout_s)
    return Scoring(model.strip(), [*firsts, *seconds], pairs, timeout)


def _side(value: Any, field: str) -> list[str]:
    texts = value if isinstance(value, list) else [value]
    if not texts:
        raise Refused(field, "required: a string or a non-empty list of strings")
    for i, text in enumerate(texts):
        at = f"{field}.{i}" if isinstance(value, list) else field
        if not sampling.is_text(text) or not text:
            raise Refused(at, not_text(text, "required: a non-empty string"))
    return texts


def scored(vectors: Sequence[Sequence[float]], pairs: list[tuple[int, int]]) -> list[float]:
    """The cosine of each pair's vectors, in the pairs' order."""
    return [_cosine(vectors[a], vectors[b]) for a, b in pairs]


class RerankInput(serializers.Serializer):
    """What a rerank call sends, for the OpenAPI schema only: `parse_rerank` reads every body."""

    model = serializers.CharField(help_text="An embedding deployment's name.")
    query = serializers.CharField(help_text="What the documents are ranked by their relevance to.")
    documents = serializers.JSONField(help_text='The documents: strings, or objects {"text": a string}.')
    top_n = serializers.IntegerField(min_value=1, required=False, allow_null=True, help_text="Only the best n.")
    return_documents = serializers.BooleanField(
        required=False, default=True, help_text="Each result with its document's text (default true)."
    )


class RerankView(EmbeddedAnswer):
    """`POST /v1/rerank`: documents ranked by relevance to a query, by an embedding deployment."""

    param = "documents"
    read = staticmethod(parse_rerank)

    @extend_schema(
        parameters=[idempotency.PARAMETER],
        summary="Rank documents by their relevance to a query, as the rerank APIs of Jina, Cohere and vLLM do.",
        description="With an embedding deployment: the query and the documents embedded in one pass, each "
        "document's `relevance_score` the cosine of its vector with the query's (-1 to 1), the most relevant "
        "first, `top_n` of them. A deployment that is not an embedding model is a 400 naming `model`.",
        request=RerankInput,
        responses={200: dict},
    )  # its example: scheduling.api.examples
    def post(self, request: HttpRequest) -> HttpResponseBase:
        return super().post(request)

    def shaped(
        self, call: Rerank, result: Request, vectors: list[list[float]], usage: dict[str, Any]
    ) -> dict[str, Any]:
        best = ranked(vectors[0], vectors[1:])[: call.top_n]
        return {
            "id": f"rerank-{result.id}",
            "model": call.model,
            "results": [
                {
                    "index": i,
                    "relevance_score": score,
                    **({"document": {"text": call.documents[i]}} if call.return_documents else {}),
                }
                for i, score in best
            ],
            "usage": usage,
        }


class ScoreInput(serializers.Serializer):
    """What a score call sends, for the OpenAPI schema only: `parse_score` reads every body."""

    model = serializers.CharField(help_text="An embedding deployment's name.")
    text_1 = serializers.JSONField(help_text="A string, or a list of strings.")
    text_2 = serializers.JSONField(help_text="A string, or a list of strings (as many as text_1's, unless it is one).")


class ScoreView(EmbeddedAnswer):
    """`POST /v1/score`: pairs of texts scored by an embedding deployment, as vLLM's score API."""

    param = "text_2"
    read = staticmethod(parse_score)

    @extend_schema(
        parameters=[idempotency.PARAMETER],
        summary="Score pairs of texts by their similarity, as vLLM's score API does.",
        description="With an embedding deployment: every text embedded in one pass, each pair's `score` the cosine "
        "of its vectors (-1 to 1): text_1 against each of text_2, or pair by pair where both are lists.",
        request=ScoreInput,
        responses={200: dict},
    )  # its example: scheduling.api.examples
    def post(self, request: HttpRequest) -> HttpResponseBase:
        return super().post(request)

    def shaped(
        self, call: Scoring, result: Request, vectors: list[list[float]], usage: dict[str, Any]
    ) -> dict[str, Any]:
        return {
            "id": f"score-{result.id}",
            "object": "list",
            "created": int(result.created_at or 0),
            "model": call.model,
            "data": [
                {"index": i, "object": "score", "score": score} for i, score in enumerate(scored(vectors, call.pairs))
            ],
            "usage": usage,
        }

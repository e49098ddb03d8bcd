"""Ollama's model list, running models, model details, version and embeddings over the portal's
deployments (scheduling.api.ollama has its chat and generate): `GET /api/tags` (every
deployment `/v1` serves), `GET /api/ps` (those with a replica serving, what they hold on GPUs),
`POST /api/show`, `GET /api/version`, `POST /api/embed` (and its first form, `/api/embeddings`).
Pulling, creating, copying and deleting models are the portal's own API's (`/api/models/pull/`,
`/api/deployments/`), not Ollama's."""

from __future__ import annotations

from importlib import metadata
from typing import Any

from django.db.models import Q, Sum
from django.http.response import HttpResponseBase
from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.request import Request as HttpRequest
from rest_framework.response import Response

from gpuportal.wire import adapters
from scheduling.api.error_shapes import ReshapedErrors
from scheduling.api.ollama import error
from scheduling.api.ollama_load import named
from scheduling.api.openai_compat import OPENAI_LOADERS, EmbeddingsView, OpenAIView
from scheduling.models import Deployment, Occupant, Replica


def _details(deployment: Deployment, adapter: str | None = None) -> dict[str, Any]:
    """A model's details; a LoRA adapter's name its deployment as its `parent_model`, as Ollama
    names the model an adapter's Modelfile is built FROM."""
    return {
        "format": "safetensors",
        "family": deployment.loader,
        "families": [deployment.loader],
        "parameter_size": "",
        "quantization_level": deployment.dtype,
        "parent_model": deployment.name if adapter is not None else "",
    }


def _with_adapters(deployment: Deployment) -> list[tuple[str, str | None]]:
    """(the model id, its adapter or None) of the deployment and of each of its LoRA adapters."""
    served = adapters.parse(deployment.model_adapters)
    return [(deployment.name, None), *((adapters.model_id(deployment.name, name), name) for name in served)]


def _held(states: tuple[str, ...]) -> dict[int, int]:
    """Bytes each deployment's replicas in `states` hold on GPUs, by the deployment's id."""
    rows = (
        Occupant.objects.filter(replica__state__in=states)
        .values("replica__deployment_id")
        .annotate(held=Sum("reserved_bytes"))
    )
    return {row["replica__deployment_id"]: int(row["held"] or 0) for row in rows}


def _served() -> Any:
    return Deployment.objects.filter(loader__in=OPENAI_LOADERS).order_by("name")


class OllamaView(ReshapedErrors, OpenAIView):
    @staticmethod
    def shape(status: int, message: str) -> dict[str, Any]:
        return error(message)


class TagsView(OllamaView):
    """`GET /api/tags`: the models, as Ollama lists those it has."""

    @extend_schema(summary="The models, as Ollama's /api/tags lists them.", responses={200: dict})
    def get(self, request: HttpRequest) -> Response:
        held = _held(tuple(Replica.State.values))
        # Each adapter after its deployment, as /v1/models lists them; what they hold is the
        # deployment's (an adapter's stacks live in its replicas' reservations).
        return Response(
            {
                "models": [
                    {
                        "name": name,
                        "model": name,
                        "modified_at": d.updated_at.isoformat(),
                        "size": held.get(d.pk, 0) if adapter is None else 0,
                        "digest": "",
                        "details": _details(d, adapter),
                    }
                    for d in _served()
                    for name, adapter in _with_adapters(d)
                ]
            }
        )


class RunningView(OllamaView):
    """`GET /api/ps`: the models with a replica serving, and what their replicas hold on GPUs."""

    @extend_schema(summary="The models with a replica serving, as Ollama's /api/ps.", responses={200: dict})
    def get(self, request: HttpRequest) -> Response:
        serving = (Replica.State.SERVING,)
        held = _held(serving)
        running = _served().filter(Q(replicas__state__in=serving)).distinct()
        return Response(
            {
                "models": [
                    {
                        "name": name,
                        "model": name,
                        "size": held.get(d.pk, 0) if adapter is None else 0,
                        "size_vram": held.get(d.pk, 0) if adapter is None else 0,
                        "digest": "",
                        "details": _details(d, adapter),
                        "context_length": d.max_tokens,
                    }
                    for d in running
                    for name, adapter in _with_adapters(d)  # an adapter serves where its model does
                ]
            }
        )


class ShowInput(serializers.Serializer):
    model = serializers.CharField(help_text="The deployment's name.")


class ShowView(OllamaView):
    """`POST /api/show`: a model's details, as Ollama's: its context length (its replicas'
    `memory.max_tokens`) where clients read it, and what it can do."""

    @extend_schema(summary="A model's details, as Ollama's /api/show.", request=ShowInput, responses={200: dict})
    def post(self, request: HttpRequest) -> Response:
        name = named(request.data.get("model")) if isinstance(request.data, dict) else None
        if not isinstance(name, str) or not name:
            return Response(error("model: required"), status=400)
        deployment, adapter = adapters.split_model(name)
        found = _served().filter(name=deployment).first()
        if found is None or (adapter is not None and adapter not in adapters.parse(found.model_adapters)):
            return Response(error(f"model '{name}' not found"), status=404)
        text = found.loader == Deployment.Loader.TRANSFORMERS
        return Response(
            {
                "modelfile": "",
                "parameters": "",
                "template": "",
                "details": _details(found, adapter),
                "model_info": {"general.architecture": "gpuportal", "gpuportal.context_length": found.max_tokens},
                "capabilities": ["completion", "tools", "thinking"] if text else ["embedding"],
                "modified_at": found.updated_at.isoformat(),
            }
        )


class VersionView(OllamaView):
    """`GET /api/version`: the portal's version (what Ollama's clients check a server with)."""

    @extend_schema(summary="The portal's version, as Ollama's /api/version.", responses={200: dict})
    def get(self, request: HttpRequest) -> Response:
        return Response({"version": metadata.version("gpuportal")})


class EmbedInput(serializers.Serializer):
    model = serializers.CharField(help_text="The deployment's name (a transformers-embedding deployment).")
    input = serializers.JSONField(help_text="A string or a list of strings.")


class EmbedView(ReshapedErrors, EmbeddingsView):
    """`POST /api/embed`: vectors as Ollama's embed gives them, as /v1/embeddings makes them."""

    @staticmethod
    def shape(status: int, message: str) -> dict[str, Any]:
        return error(message)

    @extend_schema(summary="Embed texts as Ollama's /api/embed does.", request=EmbedInput, responses={200: dict})
    def post(self, request: HttpRequest) -> HttpResponseBase:
        return super().post(request)

    def answer(self, body: Any, owner: str, key: str | None = None) -> tuple[int, dict[str, Any] | HttpResponseBase]:
        if isinstance(body, dict) and body.get("dimensions") is not None:
            return 400, error("dimensions: not supported: a vector has its model's own")
        asked = (
            {name: body[name] for name in ("model", "input", "timeout") if name in body}
            if isinstance(body, dict)
            else body
        )
        if isinstance(asked, dict) and "model" in asked:
            asked["model"] = named(asked["model"])
        code, answer = super().answer(asked, owner, key)
        if code != 200 or not isinstance(answer, dict):
            return code, answer
        return 200, {
            "model": answer["model"],
            "embeddings": [item["embedding"] for item in answer["data"]],
            "prompt_eval_count": answer["usage"].get("prompt_tokens", 0),
        }


class LegacyEmbeddingsInput(serializers.Serializer):
    model = serializers.CharField(help_text="The deployment's name (a transformers-embedding deployment).")
    prompt = serializers.CharField(help_text="The one text to embed.")


class LegacyEmbeddingsView(EmbedView):
    """`POST /api/embeddings`: Ollama's first embeddings API, which its older clients and the first
    LangChain and LlamaIndex integrations call: one `prompt`, one `embedding`."""

    @extend_schema(
        summary="Embed one text as Ollama's first API, /api/embeddings, does.",
        request=LegacyEmbeddingsInput,
        responses={200: dict},
    )
    def post(self, request: HttpRequest) -> HttpResponseBase:
        return super().post(request)

    def answer(self, body: Any, owner: str, key: str | None = None) -> tuple[int, dict[str, Any] | HttpResponseBase]:
        prompt = body.get("prompt") if isinstance(body, dict) else None
        if not isinstance(prompt, str) or not prompt:
            return 400, error("prompt: required: the text to embed, a non-empty string")
        asked = {name: body[name] for name in ("model", "timeout") if name in body}
        code, answer = super().answer({**asked, "input": prompt}, owner, key)
        if code != 200 or not isinstance(answer, dict):
            return code, answer
        return 200, {"embedding": answer["embeddings"][0]}

"""vLLM's runtime LoRA endpoints, `POST /v1/load_lora_adapter` and `POST /v1/unload_lora_adapter`,
over a deployment's `model.adapters`: what LoRA managers and scripts written for vLLM call to add
or drop a fine-tune without a deploy of their own.

An adapter is named by its model id, `deployment:adapter` (one server of vLLM's serves one base
model; the portal serves many). A load or unload is a change of the deployment's adapters as
`PATCH /api/deployments/{name}/` makes it (checked, estimated, recorded as a revision, an Event
naming who asked), so its replicas roll onto the new set, one at a time with no request lost:
the answer comes as the change is made, the adapter served (or gone) once the rollout ends. For
staff alone, as any change of a shared deployment."""

from __future__ import annotations

from typing import Any

from django.http import HttpResponse
from django.http.response import HttpResponseBase
from drf_spectacular.utils import extend_schema
from rest_framework import exceptions, permissions, serializers
from rest_framework.request import Request as HttpRequest
from rest_framework.response import Response

from scheduling.api.openai_compat import OpenAIView, openai_error
from scheduling.services import deployments as deployment_services
from scheduling.services.errors import InvalidInput


class LoadInput(serializers.Serializer):
    lora_name = serializers.CharField(help_text="The adapter's model id: deployment:adapter.")
    lora_path = serializers.CharField(help_text="A PEFT adapter directory on the nodes, or hf:org/name.")


class UnloadInput(serializers.Serializer):
    lora_name = serializers.CharField(help_text="The adapter's model id: deployment:adapter.")


def _text(body: Any, field: str) -> str:
    value = body.get(field) if isinstance(body, dict) else None
    if not isinstance(value, str) or not value.strip():
        raise InvalidInput(field, "required: a non-empty string")
    return value.strip()


def _success(said: str) -> HttpResponse:
    """vLLM's answer to a load or an unload: plain text."""
    return HttpResponse(f"Success: {said}", content_type="text/plain")


class _AdapterView(OpenAIView):
    permission_classes = [permissions.IsAdminUser]

    def handle_exception(self, exc: Exception) -> Response:
        if isinstance(exc, exceptions.PermissionDenied):
            said = "only staff may change a deployment's adapters: they are shared"
            return openai_error(403, said, kind="permission_error")
        if isinstance(exc, InvalidInput):
            return openai_error(exc.status, str(exc), param=exc.field)
        return super().handle_exception(exc)


class LoadLoraAdapterView(_AdapterView):
    @extend_schema(
        summary="Serve one more LoRA adapter beside its deployment's model (vLLM's load_lora_adapter).",
        request=LoadInput,
        responses={200: str},
    )
    def post(self, request: HttpRequest) -> HttpResponseBase:
        name, path = _text(request.data, "lora_name"), _text(request.data, "lora_path")
        deployment = deployment_services.load_adapter(name, path, by=request.user.get_username())
        return _success(f"LoRA adapter '{name}' added; deployment {deployment.name}'s replicas roll onto it.")


class UnloadLoraAdapterView(_AdapterView):
    @extend_schema(
        summary="Stop serving a LoRA adapter (vLLM's unload_lora_adapter).",
        request=UnloadInput,
        responses={200: str},
    )
    def post(self, request: HttpRequest) -> HttpResponseBase:
        name = _text(request.data, "lora_name")
        deployment = deployment_services.unload_adapter(name, by=request.user.get_username())
        return _success(f"LoRA adapter '{name}' removed; deployment {deployment.name}'s replicas roll off it.")

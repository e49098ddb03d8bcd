"""Read-only REST views. They only read, through `scheduling.selectors`; changes will go
through `scheduling.services` when the write side lands."""

from __future__ import annotations

from typing import Any

from django.db.models import QuerySet
from drf_spectacular.utils import extend_schema, extend_schema_view
from rest_framework import serializers, viewsets
from rest_framework.authtoken.views import ObtainAuthToken

from scheduling import selectors
from scheduling.api import serializers as s


def query_filters(request: Any, serializer_class: type[serializers.Serializer]) -> dict[str, Any]:
    """The validated query-string filters; bad ones raise a 400 that names the parameter."""
    params = serializer_class(data=request.query_params)
    params.is_valid(raise_exception=True)
    return params.validated_data


class NodeViewSet(viewsets.ReadOnlyModelViewSet):
    serializer_class = s.NodeSerializer
    lookup_field = "name"

    def get_queryset(self) -> QuerySet:
        return selectors.nodes()


@extend_schema_view(list=extend_schema(parameters=[s.GPUFilterSerializer]))
class GPUViewSet(viewsets.ReadOnlyModelViewSet):
    serializer_class = s.GPUSerializer

    def get_queryset(self) -> QuerySet:
        if self.action == "list":
            return selectors.gpus(**query_filters(self.request, s.GPUFilterSerializer))
        return selectors.gpus()


class DeploymentViewSet(viewsets.ReadOnlyModelViewSet):
    serializer_class = s.DeploymentSerializer
    lookup_field = "name"

    def get_queryset(self) -> QuerySet:
        return selectors.deployments()


@extend_schema_view(list=extend_schema(parameters=[s.ReplicaFilterSerializer]))
class ReplicaViewSet(viewsets.ReadOnlyModelViewSet):
    serializer_class = s.ReplicaSerializer

    def get_queryset(self) -> QuerySet:
        if self.action == "list":
            return selectors.replicas(**query_filters(self.request, s.ReplicaFilterSerializer))
        return selectors.replicas()


@extend_schema_view(list=extend_schema(parameters=[s.EventFilterSerializer]))
class EventViewSet(viewsets.ReadOnlyModelViewSet):
    """The audit trail, newest first."""

    serializer_class = s.EventSerializer

    def get_queryset(self) -> QuerySet:
        if self.action == "list":
            return selectors.events(**query_filters(self.request, s.EventFilterSerializer))
        return selectors.events()


@extend_schema(auth=[], summary="Exchange a username and password for an API token.")
class ObtainTokenView(ObtainAuthToken):
    """POST {"username", "password"} -> {"token": key}; send it as `Authorization: Token <key>`."""

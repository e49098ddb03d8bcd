"""Read-only REST views. They only read, through `scheduling.selectors`; changes will go
through `scheduling.services` when the write side lands."""

from __future__ import annotations

from typing import Any

from django.db.models import QuerySet
from drf_spectacular.utils import OpenApiResponse, extend_schema, extend_schema_view
from rest_framework import permissions, serializers, status, viewsets
from rest_framework.authtoken.views import ObtainAuthToken
from rest_framework.decorators import action
from rest_framework.exceptions import Throttled
from rest_framework.request import Request
from rest_framework.response import Response

from gpuportal import throttle
from scheduling import selectors
from scheduling.api import inputs
from scheduling.api import serializers as s
from scheduling.models import Deployment, Replica
from scheduling.services import deep_sleep as deep_sleep_services
from scheduling.services import deployments as deployment_services
from scheduling.services import failover as failover_services
from scheduling.services import node_credentials, node_marks, not_found, rollouts
from scheduling.services import nodes as node_services
from scheduling.services import replicas as replica_services
from scheduling.services import revisions as revision_services
from scheduling.services import sleep as sleep_services
from scheduling.services.errors import NotFound, ServiceError

READ_ACTIONS = {"list", "retrieve", "revisions"}


class StaffControls:
    """Anyone signed in may look; only staff may change anything (403 for others)."""

    def get_permissions(self) -> list[permissions.BasePermission]:
        if self.action in READ_ACTIONS:
            return [permissions.IsAuthenticated()]
        return [permissions.IsAdminUser()]


def query_filters(request: Any, serializer_class: type[serializers.Serializer]) -> dict[str, Any]:
    """The validated query-string filters; bad ones raise a 400 that names the parameter."""
    params = serializer_class(data=request.query_params)
    params.is_valid(raise_exception=True)
    return params.validated_data


class NodeViewSet(StaffControls, viewsets.ReadOnlyModelViewSet):
    serializer_class = s.NodeSerializer
    lookup_field = "name"
    # A node's name may hold dots (a host's name); the router's default lookup stops at the first.
    lookup_value_regex = "[^/]+"

    def get_queryset(self) -> QuerySet:
        return selectors.nodes()

    @extend_schema(
        summary="Remove an offline node (a retired host): its GPUs leave the books; its ended replicas keep their "
        "history",
        responses={
            204: OpenApiResponse(description="Removed."),
            404: OpenApiResponse(description="No such node."),
            409: OpenApiResponse(
                description="The node is online or draining, or the books still place a replica or a reservation "
                "on it. Nothing removed."
            ),
        },
    )
    def destroy(self, request: Request, name: str) -> Response:
        node_services.remove(name, by=request.user.get_username())
        return Response(status=status.HTTP_204_NO_CONTENT)

    @extend_schema(
        summary="Set or remove a node's labels and taints (null removes one), over what its agent says, as "
        "kubectl label and kubectl taint do",
        request=inputs.NodePatch,
        responses={
            200: s.NodeSerializer,
            400: OpenApiResponse(
                description="A bad key or value, one its agent says (its --labels, --taints or its GPUs'), or one "
                "it does not have, named as labels.KEY. Nothing changed."
            ),
            404: OpenApiResponse(description="No such node."),
        },
    )
    def partial_update(self, request: Request, name: str) -> Response:
        data = inputs.NodePatch(data=request.data)
        data.is_valid(raise_exception=True)
        node_marks.change(name, **data.validated_data, by=request.user.get_username())
        return Response(s.NodeSerializer(selectors.nodes().get(name=name)).data)

    @extend_schema(
        summary="Move off the node the replicas whose deployments' placement refuses it now (after a taint or a "
        "label changed), each replaced where its placement allows before it stops: Kubernetes' NoExecute, gracefully",
        request=None,
        responses={200: s.MovedSerializer, 404: OpenApiResponse(description="No such node.")},
    )
    @action(detail=True, methods=["post"], url_path="move-misplaced")
    def move_misplaced(self, request: Request, name: str) -> Response:
        moving, staying = node_marks.move_misplaced(name, by=request.user.get_username())
        return Response(s.MovedSerializer({"moving": moving, "staying": staying}).data)

    @extend_schema(
        request=inputs.DrainInput,
        responses={
            200: s.NodeSerializer,
            400: OpenApiResponse(description="A bad body."),
            404: OpenApiResponse(description="No such node."),
            409: OpenApiResponse(description="The node is offline."),
        },
    )
    @action(detail=True, methods=["post"])
    def drain(self, request: Request, name: str) -> Response:
        data = inputs.DrainInput(data=request.data)
        data.is_valid(raise_exception=True)
        node_services.drain(name, reason=f"drained by {request.user}", move=data.validated_data["move"])
        return Response(s.NodeSerializer(selectors.nodes().get(name=name)).data)

    @extend_schema(
        request=None,
        responses={
            200: s.NodeSerializer,
            404: OpenApiResponse(description="No such node."),
            409: OpenApiResponse(description="The node is not draining."),
        },
    )
    @action(detail=True, methods=["post"])
    def undrain(self, request: Request, name: str) -> Response:
        node_services.undrain(name, reason=f"returned to service by {request.user}")
        return Response(s.NodeSerializer(selectors.nodes().get(name=name)).data)

    @extend_schema(
        methods=["post"],
        summary="Issue the node's credential (its token is shown once; a previous one is refused from now on)",
        request=None,
        responses={
            201: s.NodeCredentialIssuedSerializer,
            400: OpenApiResponse(description="Not a valid node name."),
        },
    )
    @extend_schema(
        methods=["delete"],
        summary="Revoke the node's credential: its calls are refused and it is written off with its replicas",
        parameters=[s.RevokeFilterSerializer],
        request=None,
        responses={
            200: s.NodeCredentialSerializer,
            400: OpenApiResponse(description="Not a valid node name."),
            404: OpenApiResponse(description="The node has no credential."),
            409: OpenApiResponse(description="Its credential is revoked already."),
        },
    )
    # Any name, not only a node's that registered: a credential is issued before its agent starts.
    @action(detail=True, methods=["post", "delete"])
    def credential(self, request: Request, name: str) -> Response:
        by = request.user.get_username()
        if request.method == "POST":
            token = node_credentials.issue(name, by)
            body = s.NodeCredentialIssuedSerializer({"node": name, "token": token}).data
            return Response(body, status=status.HTTP_201_CREATED)
        reason = query_filters(request, s.RevokeFilterSerializer)["reason"]
        return Response(s.NodeCredentialSerializer(node_credentials.revoke(name, by, reason)).data)


@extend_schema_view(list=extend_schema(parameters=[s.GPUFilterSerializer]))
class GPUViewSet(viewsets.ReadOnlyModelViewSet):
    serializer_class = s.GPUSerializer

    def get_queryset(self) -> QuerySet:
        if self.action == "list":
            return selectors.gpus(**query_filters(self.request, s.GPUFilterSerializer))
        return selectors.gpus()


PLACEMENT_ERRORS = {
    400: OpenApiResponse(description="A field is invalid; the body names it."),
    404: OpenApiResponse(description="No such deployment."),
    409: OpenApiResponse(description="Cannot be placed; the body gives the reason per node. Nothing applied."),
}


class DeploymentViewSet(StaffControls, viewsets.ReadOnlyModelViewSet):
    serializer_class = s.DeploymentSerializer
    lookup_field = "name"
    http_method_names = ["get", "post", "patch", "delete", "head", "options"]

    def get_queryset(self) -> QuerySet:
        return selectors.deployments()

    def get_object(self) -> Deployment:
        # A name that names none is told the nearest and what is deployed, not DRF's "No
        # Deployment matches the given query."
        name = self.kwargs[self.lookup_field]
        deployment = self.get_queryset().filter(name=name).first()
        if deployment is None:
            raise not_found.deployment(name)
        self.check_object_permissions(self.request, deployment)
        return deployment

    def shown(self, name: str, code: int = status.HTTP_200_OK, *, warn: bool = False) -> Response:
        try:
            deployment = selectors.deployments().get(name=name)
        except Deployment.DoesNotExist:
            # Deleted by another call between this one's change and its answer.
            raise NotFound(f"deployment {name!r} was deleted meanwhile") from None
        data = s.DeploymentSerializer(deployment).data
        if warn:
            # Only where a change can crowd GPUs with never-preempted replicas: create and PATCH.
            data["warnings"] = deployment_services.popular_warnings()
        return Response(data, status=code)

    @extend_schema(request=inputs.DeploymentInput, responses={201: s.DeploymentChangedSerializer, **PLACEMENT_ERRORS})
    def create(self, request: Request) -> Response:
        data = inputs.DeploymentInput(data=request.data)
        data.is_valid(raise_exception=True)
        deployment = deployment_services.create(data.to_spec(), by=request.user.get_username())
        return self.shown(deployment.name, status.HTTP_201_CREATED, warn=True)

    @extend_schema(request=inputs.DeploymentPatch, responses={200: s.DeploymentChangedSerializer, **PLACEMENT_ERRORS})
    def partial_update(self, request: Request, name: str) -> Response:
        data = inputs.DeploymentPatch(data=request.data)
        data.is_valid(raise_exception=True)
        deployment_services.update(name, data.to_changes(), by=request.user.get_username())
        return self.shown(name, warn=True)

    @extend_schema(responses={204: None, 404: PLACEMENT_ERRORS[404]})
    def destroy(self, request: Request, name: str) -> Response:
        deployment_services.delete(name, reason=f"deleted by {request.user}")
        return Response(status=status.HTTP_204_NO_CONTENT)

    @extend_schema(request=inputs.ScaleInput, responses={200: s.DeploymentSerializer, **PLACEMENT_ERRORS})
    @action(detail=True, methods=["post"])
    def scale(self, request: Request, name: str) -> Response:
        data = inputs.ScaleInput(data=request.data)
        data.is_valid(raise_exception=True)
        deployment_services.scale(name, data.validated_data["replicas"], reason=f"scaled by {request.user}")
        return self.shown(name)

    @extend_schema(
        request=None,
        summary="Clear a deployment's failed loads (crash-loop backoff) and start what it lacks now.",
        responses={200: s.DeploymentSerializer, **PLACEMENT_ERRORS},
    )
    @action(detail=True, methods=["post"])
    def retry(self, request: Request, name: str) -> Response:
        deployment_services.retry(name, reason=f"retried by {request.user}")
        return self.shown(name)

    @extend_schema(
        request=inputs.RollingRestartInput,
        summary="Replace every replica, one at a time, with no request lost: an awake one once its replacement "
        "serves beside it (or, with no room for that, first), a sleeping one parked (its next wake loads anew), "
        "a failover pair through a new standby and a switchover to it.",
        responses={
            202: s.DeploymentSerializer,
            404: PLACEMENT_ERRORS[404],
            409: OpenApiResponse(
                description="A restart is under way, the deployment failed, or nothing holds a process to restart "
                "(with misplaced: no replica is on a node its placement refuses)."
            ),
        },
    )
    @action(detail=True, methods=["post"])
    def restart(self, request: Request, name: str) -> Response:
        data = inputs.RollingRestartInput(data=request.data)
        data.is_valid(raise_exception=True)
        rollouts.restart(name, by=request.user.get_username(), misplaced=data.validated_data["misplaced"])
        return self.shown(name, status.HTTP_202_ACCEPTED)

    @extend_schema(
        summary="The deployment's kept revisions, newest first: its settings as each deploy, change or rollback "
        "left them, and what each changed.",
        responses={200: s.RevisionSerializer(many=True), 404: PLACEMENT_ERRORS[404]},
    )
    @action(detail=True, methods=["get"])
    def revisions(self, request: Request, name: str) -> Response:
        entries = revision_services.history(self.get_object())
        return Response(s.RevisionSerializer(entries, many=True).data)

    @extend_schema(
        request=inputs.RollbackInput,
        summary="Return the settings to a revision (the one before the current by default) as a change: a new "
        "revision, a rolling restart where the model goes back; the replica count stays.",
        responses={200: s.RollbackAnswerSerializer, **PLACEMENT_ERRORS},
    )
    @action(detail=True, methods=["post"])
    def rollback(self, request: Request, name: str) -> Response:
        data = inputs.RollbackInput(data=request.data)
        data.is_valid(raise_exception=True)
        done = deployment_services.rollback(name, data.validated_data["revision"], by=request.user.get_username())
        answer = self.shown(name, warn=True)
        answer.data["rollback"] = {
            "to": done.to.number,
            "revision": done.revision.number if done.revision else None,
            "changes": s.changes_shown(done.changes),
        }
        return answer

    @extend_schema(request=None, responses={200: s.DeploymentSerializer, 404: PLACEMENT_ERRORS[404]})
    @action(detail=True, methods=["post"])
    def evict(self, request: Request, name: str) -> Response:
        deployment_services.evict(name, reason=f"evicted by {request.user}")
        return self.shown(name)

    @extend_schema(
        request=None,
        summary="Put every serving replica to sleep (weights to CPU RAM); replicas wanted stays.",
        responses={200: s.DeploymentSerializer, 404: PLACEMENT_ERRORS[404]},
    )
    @action(detail=True, methods=["post"])
    def sleep(self, request: Request, name: str) -> Response:
        sleep_services.sleep_deployment(name, reason=f"put to sleep by {request.user}")
        return self.shown(name)

    @extend_schema(
        request=None,
        summary="Every replica asleep in its process sleeps deeply: its weights to its node's shared memory, "
        "its process gone, no GPU memory held (sleep first; they are deep_sleeping once their processes say so).",
        responses={200: s.DeploymentSerializer, 404: PLACEMENT_ERRORS[404]},
    )
    @action(detail=True, methods=["post"], url_path="deep-sleep")
    def deep_sleep(self, request: Request, name: str) -> Response:
        deep_sleep_services.deepen_deployment(name, reason=f"put to sleep deeply by {request.user.get_username()}")
        return self.shown(name)

    @extend_schema(
        request=None,
        summary="Wake replicas until max(1, replicas wanted) are awake: cached ones first, else new ones.",
        responses={
            200: s.DeploymentSerializer,
            404: PLACEMENT_ERRORS[404],
            409: OpenApiResponse(description="Not even one replica fits; the body gives the reason per node."),
        },
    )
    @action(detail=True, methods=["post"])
    def wake(self, request: Request, name: str) -> Response:
        sleep_services.wake_deployment(name, reason=f"woken by {request.user}")
        return self.shown(name)

    @extend_schema(
        request=None,
        summary="Planned switchover: each active pair member drains and exits; its standby takes over.",
        responses={
            200: s.DeploymentSerializer,
            404: PLACEMENT_ERRORS[404],
            409: OpenApiResponse(description="No failover standby, nothing serving, or a standby not ready yet."),
        },
    )
    @action(detail=True, methods=["post"])
    def failover(self, request: Request, name: str) -> Response:
        failover_services.switchover(name, reason=f"planned switchover by {request.user.get_username()}")
        return self.shown(name)


# How many replicas an ambiguous short id names in its 400.
SHORT_ID_SHOWN = 5


@extend_schema_view(list=extend_schema(parameters=[s.ReplicaFilterSerializer]))
class ReplicaViewSet(StaffControls, viewsets.ReadOnlyModelViewSet):
    serializer_class = s.ReplicaSerializer

    def get_queryset(self) -> QuerySet:
        if self.action == "list":
            return selectors.replicas(**query_filters(self.request, s.ReplicaFilterSerializer))
        return selectors.replicas()

    def get_object(self) -> Replica:
        # Its id, or an unambiguous start of it as `gpuportal ls` shows one (like git's and
        # docker's short ids): the command line asks for the start directly, rather than asking
        # for it as an id first and reading a 404 (a warning in the server's log each time).
        given = self.kwargs[self.lookup_url_kwarg or self.lookup_field]
        queryset = self.get_queryset()
        replica = queryset.filter(pk=given).first()
        if replica is None and len(given) >= selectors.SHORT_ID_MIN:
            starting = list(queryset.filter(pk__startswith=given)[:SHORT_ID_SHOWN])
            if len(starting) > 1:
                named = ", ".join(r.id for r in starting)
                raise ServiceError(f"{given!r} starts more than one replica's id ({named}): give more of it")
            replica = starting[0] if starting else None
        if replica is None:
            raise NotFound(f"no replica {given!r}")
        self.check_object_permissions(self.request, replica)
        return replica

    @extend_schema(
        request=None,
        responses={
            200: s.ReplicaSerializer,
            404: OpenApiResponse(description="No such replica."),
            409: OpenApiResponse(description="Only a serving replica can be evicted."),
        },
    )
    @action(detail=True, methods=["post"])
    def evict(self, request: Request, pk: str) -> Response:
        replica_services.evict(pk, reason=f"evicted by {request.user}")
        return Response(s.ReplicaSerializer(selectors.replicas().get(pk=pk)).data)

    @extend_schema(
        request=None,
        summary="Put a serving replica to sleep (weights to CPU RAM); replicas wanted stays.",
        responses={
            200: s.ReplicaSerializer,
            404: OpenApiResponse(description="No such replica."),
            409: OpenApiResponse(description="Only a serving replica can be put to sleep."),
        },
    )
    @action(detail=True, methods=["post"])
    def sleep(self, request: Request, pk: str) -> Response:
        sleep_services.sleep_replica(pk, reason=f"put to sleep by {request.user}")
        return self.shown(pk)

    @extend_schema(
        request=None,
        summary="A replica asleep in its process sleeps deeply: its weights to its node's shared memory, "
        "its process gone, no GPU memory held; deep_sleeping once its process says so.",
        responses={
            200: s.ReplicaSerializer,
            404: OpenApiResponse(description="No such replica."),
            409: OpenApiResponse(description="Only a replica asleep in its process can sleep deeply."),
        },
    )
    @action(detail=True, methods=["post"], url_path="deep-sleep")
    def deep_sleep(self, request: Request, pk: str) -> Response:
        deep_sleep_services.deepen_now(pk, reason=f"put to sleep deeply by {request.user.get_username()}")
        return self.shown(pk)

    @extend_schema(
        request=None,
        summary="Promote a sleeping replica back onto a GPU of its node.",
        responses={
            200: s.ReplicaSerializer,
            404: OpenApiResponse(description="No such replica."),
            409: OpenApiResponse(description="Not sleeping, or no room on its node (the body says why)."),
        },
    )
    @action(detail=True, methods=["post"])
    def wake(self, request: Request, pk: str) -> Response:
        sleep_services.wake_replica(pk, reason=f"woken by {request.user}")
        return self.shown(pk)

    @extend_schema(
        parameters=[s.ReplicaLogQuery],
        summary="The last lines of a replica process's own log, or those after `since`, read on its node (staff only).",
        responses={
            200: s.ReplicaLogSerializer,
            404: OpenApiResponse(description="No such replica."),
            409: OpenApiResponse(description="It is on no node (pending placement, or parked): no log."),
            503: OpenApiResponse(description="Its node's agent did not answer."),
        },
    )
    @action(detail=True, methods=["get"])
    def logs(self, request: Request, pk: str) -> Response:
        # Staff only (not a read action): a replica's log may hold what callers sent it.
        query = query_filters(request, s.ReplicaLogQuery)
        return Response(replica_services.log_of(pk, query["tail"], query.get("since")))

    def shown(self, pk: str) -> Response:
        return Response(s.ReplicaSerializer(selectors.replicas().get(pk=pk)).data)


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

    def post(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        username = request.data.get("username") if hasattr(request.data, "get") else None
        names = throttle.keys(throttle.address_of(request), str(username) if username else None)
        wait = throttle.wait_s(names)
        if wait is not None:
            raise Throttled(wait=wait, detail=throttle.too_many(wait))
        # A wrong password is counted where Django reports it (user_login_failed, gpuportal.apps).
        return super().post(request, *args, **kwargs)

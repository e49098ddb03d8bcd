"""`POST /api/models/pull/` and `GET /api/models/pulls/{id}/` (staff): a Hugging Face model
fetched into the nodes' caches ahead of a deploy (scheduling.services.pulls), answered at once with
its id (202), then polled for each node's progress."""

from __future__ import annotations

from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework import permissions, serializers, status
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from gpuportal.wire.pulls import STATES
from scheduling.api.inputs import StrictSerializer
from scheduling.services import pulls


class PullInput(StrictSerializer):
    model = serializers.CharField(
        max_length=300,
        help_text="A Hugging Face model name, org/name[@revision] or a name alone (gpt2); hf: before it too.",
    )
    node = serializers.CharField(
        required=False, max_length=100, help_text="Only this node; by default every node whose agent runs."
    )


class NodePullSerializer(serializers.Serializer):
    state = serializers.ChoiceField(choices=STATES)
    percent = serializers.IntegerField()
    done_bytes = serializers.IntegerField()
    total_bytes = serializers.IntegerField(help_text="0 until the hub has said.")
    files = serializers.IntegerField(help_text="Files in the snapshot, once done.")
    path = serializers.CharField(help_text="The snapshot in the node's cache, once done.")
    error = serializers.CharField(help_text="Why it failed, and what to do.")


class PullSerializer(serializers.Serializer):
    id = serializers.CharField()
    model = serializers.CharField()
    revision = serializers.CharField(allow_null=True)
    state = serializers.ChoiceField(choices=STATES)
    nodes = serializers.DictField(child=NodePullSerializer())
    url = serializers.CharField()


def _body(found: pulls.PullState) -> dict:
    return {
        "id": found.pull.id,
        "model": found.pull.repo,
        "revision": found.pull.revision,
        "state": found.state,
        "nodes": {name: progress.record() for name, progress in found.nodes.items()},
        "url": f"/api/models/pulls/{found.pull.id}/",
    }


class PullView(APIView):
    permission_classes = [permissions.IsAdminUser]

    @extend_schema(
        summary="Fetch a Hugging Face model into the nodes' caches; poll its id for progress",
        request=PullInput,
        responses={
            202: PullSerializer,
            400: OpenApiResponse(description="Not a model name"),
            404: OpenApiResponse(description="No such node"),
            409: OpenApiResponse(description="No node's agent runs to pull"),
        },
    )
    def post(self, request: Request) -> Response:
        given = PullInput(data=request.data)
        given.is_valid(raise_exception=True)
        found = pulls.start(
            given.validated_data["model"], node=given.validated_data.get("node"), by=request.user.get_username()
        )
        return Response(_body(found), status=status.HTTP_202_ACCEPTED)


class PullDetailView(APIView):
    permission_classes = [permissions.IsAdminUser]

    @extend_schema(summary="A pull's progress on each node", responses={200: PullSerializer, 404: None})
    def get(self, request: Request, pk: str) -> Response:
        return Response(_body(pulls.read(pk)))

"""`POST /api/plan/` and `GET /api/plan/{id}/` (staff): a capacity plan on the control worker
(scheduling.services.capacity), answered at once with its id (202), then polled for its progress
and, once done, its table, its result and its plot."""

from __future__ import annotations

from typing import Any

from django.utils import timezone
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework import permissions, serializers, status
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from gpuportal.wire.states import PlanState
from scheduling.api.inputs import FiniteFloatField, StrictSerializer
from scheduling.services import capacity
from scheduling.simulation.traces import TraceFileError, parse_since


class PlanInput(StrictSerializer):
    trace = serializers.CharField(
        required=False,
        allow_blank=False,
        trim_whitespace=False,
        help_text="A trace file's text (CSV or JSON lines, see docs/operating.md). Without it: the recorded traffic.",
    )
    format = serializers.ChoiceField(choices=["csv", "jsonl"], required=False, help_text="Guessed when left out.")
    since = serializers.CharField(
        required=False, default="7d", help_text="Without a trace: the traffic recorded since (7d, 12h, or a time)."
    )
    catalogue = serializers.JSONField(
        required=False, help_text="The deployments, as a catalogue file holds them; the portal's own by default."
    )
    target = FiniteFloatField(required=False, min_value=0.5, max_value=1.0, help_text="Share within the SLO (0.99).")
    slo_ttft_s = FiniteFloatField(required=False, min_value=0.01, max_value=3600, help_text="Seconds to first token.")
    gpu_memory_gib = FiniteFloatField(required=False, min_value=1, max_value=4096, help_text="The GPU kind.")
    current_gpus = serializers.IntegerField(required=False, min_value=1, max_value=4096)
    warm_spares = serializers.BooleanField(
        required=False,
        help_text="Plan with a warm spare on every GPU (GPUPORTAL_WARM_SPARES). By default: as the portal's GPUs run.",
    )
    skip_bad = serializers.BooleanField(required=False, default=False, help_text="Skip rows that are not requests.")


class PlanSerializer(serializers.Serializer):
    id = serializers.IntegerField()
    state = serializers.ChoiceField(choices=[s.value for s in PlanState])
    percent = serializers.IntegerField()
    error = serializers.CharField()
    skipped_rows = serializers.ListField(child=serializers.CharField())
    result = serializers.JSONField(allow_null=True)
    table = serializers.CharField(help_text="The plan as a Markdown table, once done.")
    plot_png = serializers.CharField(allow_null=True, help_text="Attainment against GPU count, a base64 PNG.")
    elapsed_s = serializers.FloatField(allow_null=True)
    created_at = serializers.DateTimeField()
    finished_at = serializers.DateTimeField(allow_null=True)


class PlanView(APIView):
    permission_classes = [permissions.IsAdminUser]

    @extend_schema(
        summary="Plan capacity for a trace (or the recorded traffic) on the control worker; poll its id",
        request=PlanInput,
        responses={202: PlanSerializer, 400: OpenApiResponse(description="A trace or catalogue it cannot use")},
    )
    def post(self, request: Request) -> Response:
        given = PlanInput(data=request.data)
        given.is_valid(raise_exception=True)
        data: dict[str, Any] = dict(given.validated_data)
        trace = data.pop("trace", None)
        fmt = data.pop("format", None)
        since_text = data.pop("since")
        since = None
        if trace is None:
            try:
                since = parse_since(since_text, timezone.now())
            except ValueError as err:
                return Response({"since": [str(err)]}, status=status.HTTP_400_BAD_REQUEST)
        try:
            plan = capacity.submit(request.user, trace_text=trace, fmt=fmt, since=since, options=data)
        except TraceFileError as err:
            field = "catalogue" if err.what == "the catalogue" else "trace"
            return Response({field: [str(e) for e in err.errors[:100]], "detail": str(err)}, status=400)
        return Response(
            PlanSerializer(capacity.shown(plan)).data,
            status=status.HTTP_202_ACCEPTED,
            headers={"Location": f"/api/plan/{plan.pk}/"},
        )


class PlanDetailView(APIView):
    permission_classes = [permissions.IsAdminUser]

    @extend_schema(summary="A capacity plan: its state and percent while it runs, then its result, table and plot",
                   responses={200: PlanSerializer})  # fmt: skip
    def get(self, request: Request, pk: int) -> Response:
        return Response(PlanSerializer(capacity.shown(capacity.get(pk))).data)

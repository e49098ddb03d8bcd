"""`GET /api/traffic/` (any user): how each deployment's requests fared over a recent window,
from the recorded traffic (scheduling.services.traffic_stats)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from django.conf import settings
from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from scheduling.api.inputs import FiniteFloatField, StrictSerializer
from scheduling.services import traffic_stats

DEFAULT_WINDOW_S = 300.0
# Shorter than the drain's minute, a window would mostly miss the requests it asks about.
MIN_WINDOW_S = 60.0


class TrafficQuery(StrictSerializer):
    window_s = FiniteFloatField(
        required=False,
        default=DEFAULT_WINDOW_S,
        min_value=MIN_WINDOW_S,
        help_text="The requests accepted in the last this many seconds (default 300; at most "
        "GPUPORTAL_REQUEST_RECORD_RETENTION_S, how long records are kept).",
    )
    deployment = serializers.CharField(required=False, allow_blank=True, help_text="Only this deployment.")

    def validate_window_s(self, value: float) -> float:
        kept = settings.GPUPORTAL_REQUEST_RECORD_RETENTION_S
        if value > kept:
            raise serializers.ValidationError(
                f"at most {kept:g} s: records are kept that long (GPUPORTAL_REQUEST_RECORD_RETENTION_S)"
            )
        return value


class QuantilesSerializer(serializers.Serializer):
    p50 = serializers.FloatField()
    p95 = serializers.FloatField()
    p99 = serializers.FloatField()


class TrafficSerializer(serializers.Serializer):
    deployment = serializers.CharField()
    window_s = serializers.FloatField()
    ended = serializers.IntegerField(help_text="Requests accepted in the window that have ended and been recorded.")
    done = serializers.IntegerField()
    failed = serializers.IntegerField()
    cancelled = serializers.IntegerField()
    latency_s = QuantilesSerializer(allow_null=True, help_text="From acceptance to the answer, of those done.")
    ttft_s = QuantilesSerializer(
        allow_null=True, help_text="From acceptance to the first token, of the generations a batching replica did."
    )
    queue_s = QuantilesSerializer(
        allow_null=True, help_text="From acceptance to a replica taking it (a wake or a load included)."
    )
    per_output_token_s = QuantilesSerializer(
        allow_null=True, help_text="A done request's time on its replica over the tokens it generated."
    )
    output_tokens = serializers.IntegerField()
    output_tokens_per_s = serializers.FloatField()


class TrafficListSerializer(serializers.Serializer):
    results = TrafficSerializer(many=True)


def shown(stats: traffic_stats.TrafficStats) -> dict[str, Any]:
    return {**asdict(stats), "ended": stats.ended, "output_tokens_per_s": stats.output_tokens_per_s}


class TrafficView(APIView):
    @extend_schema(
        summary="How each deployment's requests fared over a recent window: counts, latency, queueing, tokens",
        parameters=[TrafficQuery],
        responses={200: TrafficListSerializer},
    )
    def get(self, request: Request) -> Response:
        query = TrafficQuery(data=request.query_params)
        query.is_valid(raise_exception=True)
        found = traffic_stats.stats(query.validated_data["window_s"], deployment=query.validated_data.get("deployment"))
        return Response({"results": [shown(s) for s in found]})

"""What clients may send, validated field by field: a 400 names the field (nested as in the
request, e.g. {"memory": {"max_tokens": [...]}}) and nothing is applied."""

from __future__ import annotations

import math
from typing import Any

from django.conf import settings
from rest_framework import serializers

from scheduling.models import Deployment
from scheduling.services.deployments import DeploymentSpec


class StrictSerializer(serializers.Serializer):
    """Rejects keys it does not know: a misspelt field silently ignored is a setting not applied."""

    def to_internal_value(self, data: Any) -> Any:
        if isinstance(data, dict):
            unknown = sorted(set(data) - set(self.fields))
            if unknown:
                raise serializers.ValidationError({key: ["unknown field"] for key in unknown})
        return super().to_internal_value(data)


class FiniteFloatField(serializers.FloatField):
    def to_internal_value(self, data: Any) -> float:
        value = super().to_internal_value(data)
        if not math.isfinite(value):
            raise serializers.ValidationError("must be a finite number")
        return value


class ReplicaCountField(serializers.IntegerField):
    """A replica count, at most GPUPORTAL_MAX_REPLICAS (read per request: an operator's setting)."""

    def __init__(self, **kwargs: Any):
        super().__init__(min_value=0, **kwargs)

    def to_internal_value(self, data: Any) -> int:
        value = super().to_internal_value(data)
        if value > settings.GPUPORTAL_MAX_REPLICAS:
            raise serializers.ValidationError(
                f"at most {settings.GPUPORTAL_MAX_REPLICAS} replicas per deployment (GPUPORTAL_MAX_REPLICAS)"
            )
        return value


# What PostgreSQL's bigint holds is far above any GPU; 1 PiB is a typo's bound, not a GPU's.
MAX_BYTES = 2**50


class ModelInput(StrictSerializer):
    source = serializers.CharField(
        max_length=1000,
        help_text="A model directory on the nodes, hf:org/name (from the nodes' Hugging Face cache, never "
        "downloaded), or package.module:factory (torch-module).",
    )
    loader = serializers.ChoiceField(
        choices=Deployment.Loader.values,
        default=Deployment.Loader.TRANSFORMERS,
        help_text="transformers: a causal LM (text, chat, /v1 completions); transformers-embedding: an encoder "
        "(/v1/embeddings); torch-module: a PyTorch module (JSON tensors).",
    )
    dtype = serializers.ChoiceField(choices=Deployment.DType.values, default=Deployment.DType.FLOAT32)


class MemoryInput(StrictSerializer):
    override_bytes = serializers.IntegerField(
        min_value=1, max_value=MAX_BYTES, allow_null=True, required=False, default=None
    )
    max_tokens = serializers.IntegerField(min_value=1, max_value=1_048_576, required=False, default=2048)
    policy = serializers.ChoiceField(choices=["gpuportal", "ndif"], required=False, default="gpuportal")


class FairnessInput(StrictSerializer):
    min_runtime_s = FiniteFloatField(min_value=0, max_value=86_400, required=False, default=10.0)
    max_wait_s = FiniteFloatField(min_value=0, max_value=3_600, required=False, default=5.0)
    popular = serializers.BooleanField(required=False, default=False)


class SleepInput(StrictSerializer):
    idle_timeout_s = FiniteFloatField(min_value=0, max_value=30 * 86_400, required=False, default=300.0)
    drain_timeout_s = FiniteFloatField(min_value=0, max_value=3_600, required=False, default=30.0)


class RestartInput(StrictSerializer):
    """Crash-loop backoff: a failed load is replaced after backoff_s, doubling up to backoff_max_s;
    after max_load_failures in a row the deployment is failed until retried or changed."""

    max_load_failures = serializers.IntegerField(min_value=1, max_value=100, required=False, default=3)
    backoff_s = FiniteFloatField(min_value=0, max_value=3_600, required=False, default=5.0)
    backoff_max_s = FiniteFloatField(min_value=0, max_value=86_400, required=False, default=300.0)


class FailoverInput(StrictSerializer):
    standby = serializers.BooleanField(required=False, default=False)


class PlacementInput(StrictSerializer):
    spread = serializers.BooleanField(
        required=False,
        default=False,
        help_text=(
            "false (default): pack replicas onto the fullest GPU that fits, keeping whole GPUs free for "
            "large replicas. true: prefer the GPUs and nodes with the fewest of this deployment's "
            "replicas, then the emptiest GPU."
        ),
    )


class DeploymentInput(StrictSerializer):
    name = serializers.SlugField(max_length=100)
    model = ModelInput()
    replicas = ReplicaCountField(required=False, default=1)
    dedicated = serializers.BooleanField(required=False, default=False)
    memory = MemoryInput(required=False)
    fairness = FairnessInput(required=False)
    sleep = SleepInput(required=False)
    restart = RestartInput(required=False)
    failover = FailoverInput(required=False)
    placement = PlacementInput(required=False)

    def to_spec(self) -> DeploymentSpec:
        data = self.validated_data

        def group(name: str, serializer: serializers.Serializer) -> dict[str, Any]:
            # An omitted group gets every default, exactly as if it had been sent empty.
            return data.get(name) or serializer.run_validation({})

        memory = group("memory", MemoryInput())
        fairness = group("fairness", FairnessInput())
        sleep = group("sleep", SleepInput())
        failover = group("failover", FailoverInput())
        restart = group("restart", RestartInput())
        placement = group("placement", PlacementInput())
        return DeploymentSpec(
            name=data["name"],
            source=data["model"]["source"],
            loader=data["model"]["loader"],
            dtype=data["model"]["dtype"],
            replicas=data["replicas"],
            dedicated=data["dedicated"],
            override_bytes=memory["override_bytes"],
            max_tokens=memory["max_tokens"],
            memory_policy=memory["policy"],
            min_runtime_s=fairness["min_runtime_s"],
            max_wait_s=fairness["max_wait_s"],
            popular=fairness["popular"],
            idle_timeout_s=sleep["idle_timeout_s"],
            drain_timeout_s=sleep["drain_timeout_s"],
            standby=failover["standby"],
            max_load_failures=restart["max_load_failures"],
            backoff_s=restart["backoff_s"],
            backoff_max_s=restart["backoff_max_s"],
            spread=placement["spread"],
        )


def _partial(serializer_class: type[StrictSerializer]) -> StrictSerializer:
    """The group as a PATCH takes it: a PATCH changes what it names and nothing else, so no field
    is required and none gets its default filled in.

    Said in a subclass's get_fields, not by changing an instance's fields: DRF builds every
    request's serializer from deep copies of the declared ones, and a field's copy is made anew
    from its constructor arguments, so changed fields came back required and with defaults. A
    PATCH of {"fairness": {"max_wait_s": 1}} then reset min_runtime_s and popular, and any PATCH
    of the memory group was refused for changing its policy (found by tests/scheduling/test_storm.py)."""

    class Partial(serializer_class):
        def get_fields(self) -> dict[str, serializers.Field]:
            fields = super().get_fields()
            for field in fields.values():
                field.required, field.default = False, serializers.empty
            return fields

    Partial.__name__ = Partial.__qualname__ = f"Patched{serializer_class.__name__}"
    return Partial(required=False)


class DeploymentPatch(StrictSerializer):
    """PATCH: settings groups, each partial. The model and the name cannot change."""

    name = serializers.CharField(required=False)
    model = serializers.JSONField(required=False)
    replicas = ReplicaCountField(required=False)
    dedicated = serializers.BooleanField(required=False)
    memory = _partial(MemoryInput)
    fairness = _partial(FairnessInput)
    sleep = _partial(SleepInput)
    restart = _partial(RestartInput)
    failover = _partial(FailoverInput)
    placement = _partial(PlacementInput)

    def validate_name(self, value: str) -> str:
        raise serializers.ValidationError("cannot be changed; create a new deployment instead")

    def validate_model(self, value: Any) -> Any:
        raise serializers.ValidationError("cannot be changed; create a new deployment instead")

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        if "policy" in attrs.get("memory", {}):
            raise serializers.ValidationError({"memory": {"policy": ["cannot be changed on an existing deployment"]}})
        return attrs

    def to_changes(self) -> dict[str, Any]:
        data = self.validated_data
        changes: dict[str, Any] = {k: data[k] for k in ("replicas", "dedicated") if k in data}
        for group in ("memory", "fairness", "sleep", "restart", "placement"):
            changes.update(data.get(group, {}))
        if "standby" in data.get("failover", {}):
            changes["standby"] = data["failover"]["standby"]
        return changes


class ScaleInput(StrictSerializer):
    replicas = ReplicaCountField()

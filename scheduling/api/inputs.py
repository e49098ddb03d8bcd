"""What clients may send, validated field by field: a 400 names the field (nested as in the
request, e.g. {"memory": {"max_tokens": [...]}}) and nothing is applied."""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable, Iterable
from typing import Any

from django.conf import settings
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from gpuportal.wire import deployment_spec, node_labels, sampling
from gpuportal.wire.deployment_spec import Setting, Update
from scheduling.services.deployments import DeploymentSpec


class StrictSerializer(serializers.Serializer):
    """Rejects keys it does not know: a misspelt field silently ignored is a setting not applied."""

    def to_internal_value(self, data: Any) -> Any:
        if isinstance(data, dict):
            unknown = sorted(set(data) - set(self.fields))
            if unknown:
                raise serializers.ValidationError({key: [unknown_field(key, self.fields)] for key in unknown})
        return super().to_internal_value(data)


def unknown_field(key: str, known: Iterable[str]) -> str:
    """Why `key` is refused: the known field it is nearest, else every known one."""
    names = sorted(known)
    near = difflib.get_close_matches(str(key), names, n=1, cutoff=0.6)
    if near:
        return f"unknown field; did you mean {near[0]!r}?"
    return f"unknown field (known here: {', '.join(names)})"


class ChoiceField(serializers.ChoiceField):
    """A choice whose refusal lists the choices."""

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        listed = ", ".join(str(choice) for choice in self.choices)
        self.error_messages["invalid_choice"] = f'"{{input}}" is not a valid choice; expected one of: {listed}.'


class FiniteFloatField(serializers.FloatField):
    def to_internal_value(self, data: Any) -> float:
        value = super().to_internal_value(data)
        if not math.isfinite(value):
            raise serializers.ValidationError("must be a finite number")
        return value


class _SamplingField(serializers.Field):
    """A sampling parameter (gpuportal.wire.sampling), held to its bounds there, with its help."""

    def __init__(self, param: sampling.Param, **kwargs: Any):
        self.param = param
        default = "none" if param.default is None else f"{param.default:g}"
        kwargs.setdefault("help_text", f"{param.help} {param.bounds().capitalize()}; default {default}.")
        super().__init__(required=False, allow_null=True, **kwargs)

    def to_internal_value(self, data: Any) -> float | int:
        if (why := self.param.problem(data)) is not None:
            raise serializers.ValidationError(why)
        return int(data) if self.param.whole else float(data)

    def to_representation(self, value: Any) -> Any:
        return value


@extend_schema_field(OpenApiTypes.NUMBER)
class _SamplingNumber(_SamplingField):
    pass


@extend_schema_field(OpenApiTypes.INT)
class _SamplingWhole(_SamplingField):
    pass


class _ListedField(serializers.JSONField):
    """A sampling parameter of token ids (gpuportal.wire.sampling.LISTED): refused as the wire
    refuses it, kept as the request queue keeps it (None: nothing asked)."""

    def __init__(self, listed: sampling.Listed):
        self.listed = listed
        super().__init__(required=False, allow_null=True, help_text=listed.help)

    def to_internal_value(self, data: Any) -> Any:
        if (why := self.listed.problem(data)) is not None:
            raise serializers.ValidationError(why)
        return self.listed.kept(data) or None


def listed_field(name: str) -> serializers.Field:
    return _ListedField(sampling.LISTED_BY_NAME[name])


def sampling_field(name: str, **kwargs: Any) -> serializers.Field:
    """The field of the sampling parameter `name`: its bounds, default and help declared once."""
    param = sampling.BY_NAME[name]
    return (_SamplingWhole if param.whole else _SamplingNumber)(param, **kwargs)


class SamplingInput(serializers.Serializer):
    """The sampling parameters of a text request, for the serializers that take them to inherit:
    `/infer/`'s params and, for the OpenAPI schema, `/v1`'s bodies."""

    temperature = sampling_field("temperature")
    top_p = sampling_field("top_p")
    top_k = sampling_field("top_k")
    min_p = sampling_field("min_p")
    presence_penalty = sampling_field("presence_penalty")
    frequency_penalty = sampling_field("frequency_penalty")
    repetition_penalty = sampling_field("repetition_penalty")
    min_tokens = sampling_field("min_tokens")
    seed = sampling_field("seed")
    logit_bias = listed_field(sampling.LOGIT_BIAS)
    stop_token_ids = listed_field(sampling.STOP_TOKEN_IDS)


REPLICAS = deployment_spec.BY_NAME["replicas"]


class ReplicaCountField(serializers.IntegerField):
    """A replica count (`replicas`, the autoscaler's bounds), at most what the operator's Django
    setting says (read per request)."""

    def __init__(self, setting: Setting = REPLICAS, **kwargs: Any):
        self.max_setting = setting.max_setting
        super().__init__(min_value=setting.min, **kwargs)

    def to_internal_value(self, data: Any) -> int:
        value = super().to_internal_value(data)
        cap = getattr(settings, self.max_setting)
        if value > cap:
            raise serializers.ValidationError(f"at most {cap} replicas per deployment ({self.max_setting})")
        return value


class CheckedCharField(serializers.CharField):
    """Text with a syntax of its own (the spec's `check`, a node selector's): stored as `check`
    writes it, refused with what it says is wrong."""

    def __init__(self, check: Callable[[str], str], **kwargs: Any):
        self.check = check
        super().__init__(**kwargs)

    def to_internal_value(self, data: Any) -> str:
        try:
            return self.check(super().to_internal_value(data))
        except ValueError as err:
            raise serializers.ValidationError(str(err)) from None


class RefusedField(serializers.JSONField):
    """What a PATCH cannot change, whatever it sends (the model: a different one is a different
    deployment)."""

    def to_internal_value(self, data: Any) -> Any:
        raise serializers.ValidationError("cannot be changed; create a new deployment instead")


def _field(setting: Setting, *, patch: bool = False) -> serializers.Field:
    """The setting's field, with the spec's bounds, choices and help. A deploy fills in its
    default when it is omitted; a PATCH changes what it names and nothing else, so no field of it
    is required and none gets its default filled in."""
    kwargs: dict[str, Any] = {"help_text": setting.help}
    if patch or not setting.required:
        kwargs["required"] = False
    if not patch and not setting.required:
        kwargs["default"] = setting.default
    if setting.nullable:
        kwargs["allow_null"] = True
    if setting.max_setting:
        if setting.type is not int or setting.max_setting != REPLICAS.max_setting:
            raise TypeError(f"{setting.name}: only replica counts have a maximum an operator sets")
        return ReplicaCountField(setting, **kwargs)
    if setting.choices:
        # Plain strings, not the spec's enum members: a value goes into Events' text and JSON as written.
        return ChoiceField(choices=[str(choice) for choice in setting.choices], **kwargs)
    if setting.type is bool:
        return serializers.BooleanField(**kwargs)
    if setting.type is int:
        return serializers.IntegerField(min_value=setting.min, max_value=setting.max, **kwargs)
    if setting.type is float:
        return FiniteFloatField(min_value=setting.min, max_value=setting.max, **kwargs)
    if setting.type is str and setting.check is not None:
        return CheckedCharField(setting.check, max_length=setting.max_length, allow_blank=True, **kwargs)
    if setting.type is str:
        return serializers.CharField(max_length=setting.max_length, **kwargs)
    raise TypeError(f"{setting.name}: no input field for {setting.type}")


def _group_input(group: str, *, patch: bool = False) -> type[StrictSerializer]:
    """A group of the body (memory, fairness...) as a serializer: ModelInput, MemoryInput...,
    and PatchedMemoryInput... as a PATCH takes it (the OpenAPI schema's names)."""
    name = f"{'Patched' if patch else ''}{group.title()}Input"
    fields = {s.key: _field(s, patch=patch) for s in deployment_spec.in_group(group)}
    namespace = {**fields, "__doc__": deployment_spec.GROUPS[group], "__module__": __name__, "__qualname__": name}
    return type(StrictSerializer)(name, (StrictSerializer,), namespace)


GROUP_INPUTS = {group: _group_input(group) for group in deployment_spec.GROUPS}
GROUP_PATCHES = {group: _group_input(group, patch=True) for group in deployment_spec.GROUPS}


def _refused_whole(group: str) -> bool:
    return all(s.update == Update.REFUSED for s in deployment_spec.in_group(group))


class DeploymentInput(StrictSerializer):
    """A deploy: the name, then the spec's settings in the body's order, each group optional
    unless it holds a required setting (the model's source)."""

    name = serializers.SlugField(max_length=100)

    def get_fields(self) -> dict[str, serializers.Field]:
        fields = super().get_fields()
        for setting in deployment_spec.SETTINGS:
            if not setting.group:
                fields[setting.key] = _field(setting)
            elif setting.group not in fields:
                required = any(s.required for s in deployment_spec.in_group(setting.group))
                fields[setting.group] = GROUP_INPUTS[setting.group](required=required)
        return fields

    def to_spec(self) -> DeploymentSpec:
        data = self.validated_data

        def given(group: str) -> dict[str, Any]:
            if not group:
                return data
            # An omitted group gets every default, exactly as if it had been sent empty.
            return data.get(group) or GROUP_INPUTS[group]().run_validation({})

        values = {s.name: given(s.group)[s.key] for s in deployment_spec.SETTINGS}
        return DeploymentSpec(name=data["name"], **values)


class DeploymentPatch(StrictSerializer):
    """PATCH: settings groups, each partial. The name cannot change, nor a setting the spec says
    is refused: a group of nothing else (the model) whatever it holds, another by name."""

    name = serializers.CharField(required=False)

    def get_fields(self) -> dict[str, serializers.Field]:
        fields = super().get_fields()
        for setting in deployment_spec.SETTINGS:
            if not setting.group:
                refused = setting.update == Update.REFUSED
                fields[setting.key] = RefusedField(required=False) if refused else _field(setting, patch=True)
            elif setting.group not in fields:
                group = setting.group
                fields[group] = (
                    RefusedField(required=False) if _refused_whole(group) else GROUP_PATCHES[group](required=False)
                )
        return fields

    def validate_name(self, value: str) -> str:
        raise serializers.ValidationError("cannot be changed; create a new deployment instead")

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        refused: dict[str, dict[str, list[str]]] = {}
        for setting in deployment_spec.SETTINGS:
            if setting.update == Update.REFUSED and setting.key in attrs.get(setting.group, {}):
                refused.setdefault(setting.group, {})[setting.key] = ["cannot be changed on an existing deployment"]
        if refused:
            raise serializers.ValidationError(refused)
        return attrs

    def to_changes(self) -> dict[str, Any]:
        """What the PATCH names, by spec name (a setting refused only if changed goes to the
        service, which knows the current value)."""
        data = self.validated_data
        changes = {}
        for setting in deployment_spec.SETTINGS:
            given = data.get(setting.group, {}) if setting.group else data
            if setting.key in given:
                changes[setting.name] = given[setting.key]
        return changes


class MarkChanges(serializers.JSONField):
    """A node's labels or taints to change, as a JSON merge patch: a value sets its key, null
    removes it (gpuportal.wire.node_labels.changed checks each key and value)."""

    def to_internal_value(self, data: Any) -> dict[str, str | None]:
        data = super().to_internal_value(data)
        if not isinstance(data, dict):
            raise serializers.ValidationError('must map keys to values (null removes one): {"zone": "b", "gpu": null}')
        if len(data) > node_labels.MAX_PAIRS:
            raise serializers.ValidationError(f"at most {node_labels.MAX_PAIRS} changes at once, got {len(data)}")
        for key, value in data.items():
            if value is not None and not isinstance(value, str):
                raise serializers.ValidationError({key: ["must be a string, or null to remove it"]})
        return data


class NodePatch(StrictSerializer):
    labels = MarkChanges(required=False, help_text='Labels to set, null to remove one: {"gpu": "h100", "zone": null}.')
    taints = MarkChanges(
        required=False,
        help_text='Taints to set, null to remove one: {"team": "research"} keeps new replicas off (NoSchedule); '
        '{"team": "research:NoExecute"} also moves off what runs there and does not tolerate it; '
        '{"team": "research:PreferNoSchedule"} keeps nothing off, but the node is placement\'s last choice.',
    )


class DrainInput(StrictSerializer):
    move = serializers.BooleanField(
        required=False,
        default=False,
        help_text="Move what serves there to other nodes, each replaced before it stops (as Kubernetes' drain), "
        "rather than put it to sleep there.",
    )


class RollingRestartInput(StrictSerializer):
    misplaced = serializers.BooleanField(
        required=False,
        default=False,
        help_text="Only the replicas on nodes its placement.node_selector or placement.tolerations refuse now, each "
        "replaced where they allow it before it stops.",
    )


class RollbackInput(StrictSerializer):
    revision = serializers.IntegerField(
        min_value=1,
        required=False,
        allow_null=True,
        default=None,
        help_text="The revision to return to (GET .../revisions/ lists them); absent or null: the one before the "
        "current.",
    )


class ScaleInput(StrictSerializer):
    replicas = ReplicaCountField()

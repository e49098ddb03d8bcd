"""REST shapes of docs/api.md. Field names here are a contract with clients: add, never rename.

The serializers expect querysets from `scheduling.selectors` (related rows already loaded)."""

from __future__ import annotations

import time
from typing import Any

from django.utils import timezone
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema_field, extend_schema_serializer
from rest_framework import serializers

from gpuportal.wire import deployment_spec, node_auth
from gpuportal.wire.deployment_spec import Setting
from gpuportal.wire.states import DeploymentStatus
from scheduling import selectors
from scheduling.models import (
    GPU,
    Deployment,
    DeploymentObserved,
    Event,
    Node,
    NodeCredential,
    Occupant,
    PreemptionIntent,
    Replica,
)
from scheduling.services import autoscaling, host_cache, revisions, rollouts
from scheduling.services.placing import need_with
from scheduling.services.replica_specs import contexts_of


class NodeCredentialSerializer(serializers.ModelSerializer):
    """A node's credential as the books keep it: never its token."""

    class Meta:
        model = NodeCredential
        fields = ["node", "created_at", "created_by", "revoked_at", "last_used_at"]


class NodeCredentialIssuedSerializer(serializers.Serializer):
    node = serializers.CharField()
    token = serializers.CharField(
        help_text="The node's token, shown this once: its agent reads it from GPUPORTAL_NODE_TOKEN_FILE "
        "(or GPUPORTAL_NODE_TOKEN)."
    )


class RevokeFilterSerializer(serializers.Serializer):
    reason = serializers.CharField(required=False, default="", max_length=500, help_text="Why, for the Event.")


class MovedSerializer(serializers.Serializer):
    moving = serializers.DictField(
        child=serializers.IntegerField(), help_text="By deployment, its replicas there that move (a move each)."
    )
    staying = serializers.DictField(
        child=serializers.IntegerField(),
        help_text="By deployment, its replicas there that stay for now: it is restarting already.",
    )


class NodeSerializer(serializers.ModelSerializer):
    heartbeat_age_s = serializers.SerializerMethodField(help_text="Seconds since the last heartbeat.")
    gpu_count = serializers.IntegerField(read_only=True)
    host_cache_budget_bytes = serializers.IntegerField(
        source="cpu_cache_bytes", read_only=True, help_text="Host RAM given to sleeping replicas' weights."
    )
    host_cache_used_bytes = serializers.SerializerMethodField(
        help_text="What sleeping, draining and standby replicas' weights, and the arenas awake replicas keep "
        "for their next sleep, use of it."
    )

    host_cache_kept_bytes = serializers.SerializerMethodField(
        help_text="Of host_cache_used_bytes, the arenas serving replicas keep for their next sleep."
    )
    labels = serializers.DictField(
        child=serializers.CharField(),
        read_only=True,
        help_text="What its agent declares of the host (--labels, GPUPORTAL_NODE_LABELS), its GPUs say "
        "(nvidia.com/gpu.*) and operators set (operator_labels, over the others): a deployment's "
        "placement.node_selector places its replicas only on nodes whose labels hold every pair it names.",
    )
    taints = serializers.DictField(
        child=serializers.CharField(),
        read_only=True,
        help_text="What its agent (--taints, GPUPORTAL_NODE_TAINTS) and operators (operator_taints) keep "
        "off it: only deployments whose placement.tolerations name each of them are placed here.",
    )
    operator_labels = serializers.DictField(
        child=serializers.CharField(),
        read_only=True,
        help_text="Of its labels, those operators set (PATCH, `gpuportal node label`): kept across its "
        "agent's restarts.",
    )
    operator_taints = serializers.DictField(
        child=serializers.CharField(),
        read_only=True,
        help_text="Of its taints, those operators set (PATCH, `gpuportal node taint`): kept across its "
        "agent's restarts.",
    )

    class Meta:
        model = Node
        fields = [
            "name",
            "queue",
            "hostname",
            "status",
            "last_heartbeat",
            "heartbeat_age_s",
            "cpu_cache_bytes",
            "host_ram_bytes",
            "host_cache_budget_bytes",
            "host_cache_used_bytes",
            "host_cache_kept_bytes",
            "virtual",
            "labels",
            "taints",
            "operator_labels",
            "operator_taints",
            "gpu_count",
            "registered_at",
        ]
        read_only_fields = fields

    def get_host_cache_used_bytes(self, obj: Node) -> int:
        return self._host_cache(obj)[0]

    def get_host_cache_kept_bytes(self, obj: Node) -> int:
        return self._host_cache(obj)[1]

    def _host_cache(self, obj: Node) -> tuple[int, int]:
        # One query for a whole page of nodes, not one per node.
        listed = self.parent.instance if isinstance(self.parent, serializers.ListSerializer) else None
        known: dict[int, tuple[int, int]] = self.context.setdefault("_host_cache", {})
        if obj.pk not in known:
            known.update(host_cache.usage([n.pk for n in (listed if listed is not None else [obj])]))
        return known.get(obj.pk, (0, 0))

    def get_heartbeat_age_s(self, obj: Node) -> float | None:
        if obj.last_heartbeat is None:
            return None
        return round((timezone.now() - obj.last_heartbeat).total_seconds(), 3)


# `gpus` was the first name of `gpu_indexes`: kept for the clients that read it, marked deprecated
# in the schema, and gone in a later release.
@extend_schema_serializer(deprecate_fields=["gpus"])
class ReplicaSerializer(serializers.ModelSerializer):
    deployment = serializers.SlugRelatedField(slug_field="name", read_only=True)
    node = serializers.SlugRelatedField(slug_field="name", read_only=True, allow_null=True)
    # Two numberings, named so: a GPU's index on its node (what NVML and
    # CUDA_VISIBLE_DEVICES say there) and its id in /api/gpus/ (the portal's, unique across nodes).
    gpu_indexes = serializers.SerializerMethodField(
        help_text="Indexes, on its node, of the GPUs it occupies (nvidia-smi's numbering there)."
    )
    gpu_ids = serializers.SerializerMethodField(help_text="Ids, in /api/gpus/, of the GPUs it occupies.")
    gpus = serializers.SerializerMethodField(
        help_text="Deprecated: the same as gpu_indexes, kept for the clients that read it; read gpu_indexes."
    )
    gpu_mem_bytes_by_id = serializers.DictField(
        child=serializers.IntegerField(), read_only=True, help_text='{"<gpu index>": bytes} on its node.'
    )
    # kv is filled in by the KV-cache issue; null until then so clients can rely on the key.
    failover_state = serializers.SerializerMethodField()
    kv = serializers.SerializerMethodField()
    progress = serializers.IntegerField(
        read_only=True,
        allow_null=True,
        help_text="How far its load is, in percent, as the replica reports it while loading; 100 once served.",
    )

    class Meta:
        model = Replica
        fields = [
            "id",
            "deployment",
            "node",
            "role",
            "state",
            "gpus",
            "gpu_indexes",
            "gpu_ids",
            "gpu_mem_bytes_by_id",
            "gpu_memory_fraction",
            "pid",
            "serving_since",
            "last_accessed",
            "epoch",
            "failover_state",
            "kv",
            "failure_reason",
            "progress",
            "arena_kept_bytes",
            "host_bytes",
            "host_copy_bytes",
        ]
        read_only_fields = fields
        extra_kwargs = {
            "arena_kept_bytes": {
                "help_text": "Host memory this awake replica keeps for its next sleep, counted in its node's "
                "host cache; 0: none."
            },
            "host_bytes": {
                "help_text": "Host RAM its process holds beside what the host cache counts of it, as its node's "
                "agent last measured it (placement counts it against the node's host RAM); 0: not measured yet."
            },
            "host_copy_bytes": {
                "help_text": "Deep asleep: the copy of its weights its node's host memory holds, which its next "
                "wake reads; 0: none."
            },
        }

    def get_gpu_indexes(self, obj: Replica) -> list[int]:
        return sorted(occupancy.gpu.index for occupancy in obj.occupancies.all())

    def get_gpu_ids(self, obj: Replica) -> list[int]:
        return sorted(occupancy.gpu_id for occupancy in obj.occupancies.all())

    def get_gpus(self, obj: Replica) -> list[int]:
        return self.get_gpu_indexes(obj)

    @extend_schema_field(serializers.DictField(allow_null=True))
    def get_failover_state(self, obj: Replica) -> dict[str, Any] | None:
        """A failover pair member's liveness state (init, standby, waking, active, dead), its pair,
        and whether it holds the pair's lock at the lease's current epoch; null for other replicas."""
        lease = obj.lease
        if lease is None:
            return None
        return {
            "state": obj.failover_state or None,
            "pair": lease.slot,
            "lease_epoch": lease.epoch,
            "holder": lease.holder_id == obj.id,
        }

    @extend_schema_field(serializers.DictField(allow_null=True))
    def get_kv(self, obj: Replica) -> dict[str, Any] | None:
        """The KV block pool of a serving causal-LM replica as it last published it:
        block_tokens, blocks_total, blocks_used, blocks_peak, allocations, frees, utilisation, and
        its prefix cache's blocks_cached (kept, held by no sequence), prefix_queried and prefix_hits
        (prompt tokens looked up since its wake, and found); null when it has none (asleep, a
        plain module, or not published in the last seconds)."""
        # One Redis round trip per list of replicas (a page, a deployment's replicas), not per replica.
        listed = self.parent.instance if isinstance(self.parent, serializers.ListSerializer) else None
        batch = [obj] if listed is None else list(listed)
        known: dict[str, dict[str, Any] | None] = self.context.setdefault("_kv", {})
        if obj.id not in known:
            found = selectors.kv_figures(batch)
            known.update({r.id: found.get(r.id) for r in batch})
        return known.get(obj.id)


# Deployment settings are grouped as in the POST body of docs/api.md; each group reads from the
# deployment's own flat columns (source="*"). Its fields are the spec's settings
# (gpuportal.wire.deployment_spec), then what the portal measured or decided about them, which is
# the deployment's observed record (DeploymentObserved) and shown where the answers always had it.

# A setting the answers have never shown: adding it is a change of the contract of its own.
NOT_SHOWN = {"memory_policy"}


class AutoscaleLoadSerializer(serializers.Serializer):
    in_flight = serializers.IntegerField(help_text="Its requests waiting in its queue or taken and not ended.")
    wanted = serializers.IntegerField(help_text="The replicas they want, within min_replicas and max_replicas.")
    age_s = serializers.FloatField(help_text="Seconds since the autoscaler measured it.")


@extend_schema_field(AutoscaleLoadSerializer(allow_null=True))
class AutoscaleLoadField(serializers.Field):
    """An autoscaled deployment's load as the autoscaler's last sweep measured it (null: not
    autoscaled, or not measured yet). The sweep's figures for every deployment are read once per
    answer, however many deployments it shows."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(source="*", read_only=True, **kwargs)

    def to_representation(self, deployment: Deployment) -> dict[str, int | float] | None:
        if not deployment.autoscale_max_replicas:
            return None
        if (loads := self.context.get("_autoscale_loads")) is None:
            loads = self.context["_autoscale_loads"] = autoscaling.last_loads()
        if (load := loads.get(deployment.name)) is None:
            return None
        age_s = max(0.0, round(time.time() - load.at, 1))
        return {"in_flight": load.in_flight, "wanted": load.wanted, "age_s": age_s}


@extend_schema_field(OpenApiTypes.INT)
class NeedBytesField(serializers.Field):
    """What placement reserves for one more replica of the deployment (placing.need_with): its
    need under its memory policy with the GPUs' CUDA context, the largest among them as placement
    counts it, and a pair's standby context beside it. The GPUs' contexts are read once per
    answer, however many deployments it shows."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(source="*", read_only=True, **kwargs)

    def to_representation(self, deployment: Deployment) -> int | None:
        if deployment.memory_need_bytes is None:
            return None  # nothing to size it by yet
        if (contexts := self.context.get("_gpu_contexts")) is None:
            contexts = self.context["_gpu_contexts"] = contexts_of(GPU.objects.all())
        try:
            return need_with(deployment, contexts).bytes
        except ValueError:
            return None  # its policy cannot size it (ndif without the weights' size): placement cannot either


def _shown_beside(group: str) -> dict[str, serializers.Field]:
    """What a group shows after its settings. Made when called: DRF orders declared fields by
    when each was made."""
    if group == "autoscale":
        return {
            "load": AutoscaleLoadField(
                allow_null=True,
                help_text="Its load as the autoscaler last measured it; null when not autoscaled or not measured yet.",
            )
        }
    if group != "memory":
        return {}
    return {
        "estimate_bytes": serializers.IntegerField(
            source="observed.memory_estimate_bytes", allow_null=True, read_only=True
        ),
        "measured_bytes": serializers.IntegerField(
            source="observed.memory_measured_bytes", allow_null=True, read_only=True
        ),
        "need_bytes": NeedBytesField(
            allow_null=True,
            help_text="What placement reserves for one replica: override, else measured, else estimate, with the "
            "GPUs' CUDA context (and, in a failover pair, its standby's beside it).",
        ),
    }


def _shown(setting: Setting) -> serializers.Field:
    kwargs: dict[str, Any] = {"help_text": setting.help}
    if setting.column != setting.key:
        kwargs["source"] = setting.column
    if setting.nullable:
        kwargs["allow_null"] = True
    if setting.choices:
        # With the model's labels, as the answers' schema has always named them.
        return serializers.ChoiceField(choices=Deployment._meta.get_field(setting.column).choices, **kwargs)
    kinds = {bool: serializers.BooleanField, int: serializers.IntegerField, float: serializers.FloatField}
    return kinds.get(setting.type, serializers.CharField)(**kwargs)


def _group_shown(group: str) -> type[serializers.Serializer]:
    name = f"Deployment{group.title()}Serializer"
    fields = {s.key: _shown(s) for s in deployment_spec.in_group(group) if s.name not in NOT_SHOWN}
    namespace = {**fields, **_shown_beside(group), "__module__": __name__, "__qualname__": name}
    return type(serializers.Serializer)(name, (serializers.Serializer,), namespace)


GROUPS_SHOWN = {group: _group_shown(group) for group in deployment_spec.GROUPS}


def _observed_help(name: str) -> str:
    """The help of a field of the observed record: the model's, as the answer's schema has always had it."""
    return str(DeploymentObserved._meta.get_field(name).help_text)


class RolloutSerializer(serializers.Serializer):
    since = serializers.DateTimeField(help_text="Replicas started before this are replaced.")
    replaced = serializers.IntegerField(help_text="Replicas started since the restart was asked for.")
    left = serializers.IntegerField(
        help_text="Replicas started before it that still hold a process, a host copy or GPU memory (of a move, "
        "those it moves)."
    )
    move = serializers.BooleanField(
        help_text="A move: only some replicas are replaced (a drain's with move, a restart of the misplaced)."
    )


class DeploymentSerializer(serializers.ModelSerializer):
    model = GROUPS_SHOWN["model"](source="*", read_only=True)
    replicas = ReplicaSerializer(many=True, read_only=True)
    memory = GROUPS_SHOWN["memory"](source="*", read_only=True)
    fairness = GROUPS_SHOWN["fairness"](source="*", read_only=True)
    sleep = GROUPS_SHOWN["sleep"](source="*", read_only=True)
    restart = GROUPS_SHOWN["restart"](source="*", read_only=True)
    failover = GROUPS_SHOWN["failover"](source="*", read_only=True)
    placement = GROUPS_SHOWN["placement"](source="*", read_only=True)
    autoscale = GROUPS_SHOWN["autoscale"](source="*", read_only=True)
    status = serializers.ChoiceField(
        choices=[s.value for s in DeploymentStatus],
        read_only=True,
        help_text="retrying: a failed load is replaced after its backoff; failed: it gave up (failed_reason).",
    )
    failed_reason = serializers.CharField(
        source="observed.failed_reason", read_only=True, help_text=_observed_help("failed_reason")
    )
    load_failures = serializers.IntegerField(
        source="observed.load_failures", read_only=True, help_text=_observed_help("load_failures")
    )
    retry_at = serializers.DateTimeField(
        source="observed.retry_at", read_only=True, allow_null=True, help_text=_observed_help("retry_at")
    )
    rollout = serializers.SerializerMethodField(
        help_text="A rolling restart under way (POST .../restart/): when it was asked for and how far it is; "
        "null when none is."
    )

    class Meta:
        model = Deployment
        fields = [
            "name",
            "status",
            "failed_reason",
            "load_failures",
            "retry_at",
            "rollout",
            "model",
            "replicas",
            "replicas_wanted",
            "dedicated",
            "memory",
            "fairness",
            "sleep",
            "restart",
            "failover",
            "placement",
            "autoscale",
            "created_at",
            "updated_at",
        ]
        read_only_fields = fields

    @extend_schema_field(RolloutSerializer(allow_null=True))
    def get_rollout(self, deployment: Deployment) -> dict[str, Any] | None:
        done = rollouts.progress_of(deployment)
        if done is None:
            return None
        observed = deployment.observed
        moving = bool(observed.restart_only)
        return {"since": observed.restart_since, "replaced": done.replaced, "left": done.left, "move": moving}


class OccupantSerializer(serializers.ModelSerializer):
    replica = serializers.CharField(source="replica_id", read_only=True)
    deployment = serializers.CharField(source="replica.deployment.name", read_only=True)
    state = serializers.ChoiceField(source="replica.state", choices=Replica.State.choices, read_only=True)

    class Meta:
        model = Occupant
        fields = ["replica", "deployment", "state", "reserved_bytes", "since"]
        read_only_fields = fields


class IntentSerializer(serializers.ModelSerializer):
    replica = serializers.CharField(source="waiting_replica_id", read_only=True)
    deployment = serializers.CharField(source="waiting_replica.deployment.name", read_only=True)
    victim = serializers.CharField(source="victim_id", read_only=True, allow_null=True)

    class Meta:
        model = PreemptionIntent
        fields = ["replica", "deployment", "needed_bytes", "created_at", "deadline", "status", "victim"]
        read_only_fields = fields


class WakeLockSerializer(serializers.Serializer):
    """Read from the GPU row: who may wake a replica on it now, and until when."""

    holder = serializers.CharField(source="wake_lock_holder_id", help_text="Replica id.")
    deployment = serializers.CharField(source="wake_lock_holder.deployment.name")
    expires_at = serializers.DateTimeField(source="wake_lock_expires_at", allow_null=True)


class GPUSerializer(serializers.ModelSerializer):
    node = serializers.SlugRelatedField(slug_field="name", read_only=True)
    reserved_bytes = serializers.IntegerField(read_only=True)
    occupants = OccupantSerializer(many=True, read_only=True)
    intents = IntentSerializer(
        source="active_intents",
        many=True,
        read_only=True,
        help_text="Preemption intents still waiting or with a victim chosen.",
    )
    wake_lock = serializers.SerializerMethodField()

    class Meta:
        model = GPU
        fields = [
            "id",
            "node",
            "index",
            "uuid",
            "product",
            "virtual",
            "total_bytes",
            "available_bytes",
            "foreign_bytes",
            "spare_bytes",
            "reserved_bytes",
            "nvml_total_bytes",
            "context_bytes",
            "standby_context_bytes",
            "nvml_free_bytes",
            "overcommit_bytes",
            "version",
            "health",
            "occupants",
            "intents",
            "wake_lock",
            "updated_at",
        ]
        read_only_fields = fields

    @extend_schema_field(WakeLockSerializer(allow_null=True))
    def get_wake_lock(self, obj: GPU) -> dict[str, Any] | None:
        if obj.wake_lock_holder is None:
            return None
        return WakeLockSerializer(obj).data


class EventSerializer(serializers.ModelSerializer):
    class Meta:
        model = Event
        fields = [
            "id",
            "time",
            "kind",
            "subject",
            "reason",
            "before",
            "after",
            "node",
            "gpu",
            "deployment",
            "replica",
        ]
        read_only_fields = fields


# Query-string filters, validated like bodies so bad input gets a 400 naming the parameter.


class GPUFilterSerializer(serializers.Serializer):
    node = serializers.CharField(required=False, allow_blank=True, help_text="Node name.")


class ReplicaFilterSerializer(serializers.Serializer):
    deployment = serializers.CharField(required=False, allow_blank=True, help_text="Deployment name.")
    state = serializers.ChoiceField(choices=Replica.State.choices, required=False, allow_blank=True)
    exclude_state = serializers.ChoiceField(
        choices=Replica.State.choices,
        required=False,
        allow_blank=True,
        help_text="All but this state: `stopped` leaves out the history kept for an hour after a replica stops.",
    )
    node = serializers.CharField(required=False, allow_blank=True, help_text="Node name.")


class EventFilterSerializer(serializers.Serializer):
    kind = serializers.CharField(
        required=False,
        allow_blank=True,
        help_text='Event kind, e.g. "replica.state", or a family of them, e.g. "replica" (every replica.* kind).',
    )
    deployment = serializers.CharField(required=False, allow_blank=True)
    gpu = serializers.RegexField(
        # Any node's name, dots included (a host's: `ip-10-0-1-2.ec2.internal/0`).
        rf"^{node_auth.NODE_NAME.pattern}/[0-9]{{1,4}}$",
        required=False,
        help_text='GPU as recorded, NODE/INDEX, e.g. "node1/0".',
        error_messages={"invalid": 'expected NODE/INDEX as events record a GPU, e.g. "node1/0"'},
    )
    node = serializers.CharField(required=False, allow_blank=True)
    replica = serializers.CharField(
        required=False, allow_blank=True, help_text="Replica id, or its start as `gpuportal ls` shows it (3f2a1b2c)."
    )
    since = serializers.DateTimeField(required=False, help_text="ISO 8601; only events at or after it.")

    def validate_kind(self, value: str) -> str:
        # A misspelt kind matched nothing, and an empty trail read as "nothing happened".
        if value and value not in selectors.EVENT_KINDS and value not in selectors.EVENT_FAMILIES:
            raise serializers.ValidationError(
                f"no event kind {value!r}: one of {', '.join(selectors.EVENT_KINDS)}, "
                f"or a family of them: {', '.join(selectors.EVENT_FAMILIES)}"
            )
        return value


class DeploymentChangedSerializer(DeploymentSerializer):
    """A deployment as create and PATCH return it: with warnings about what the change implies."""

    warnings = serializers.ListField(
        child=serializers.CharField(),
        read_only=True,
        help_text="E.g. GPUs where popular (never preempted) replicas leave no room for anything else.",
    )

    class Meta(DeploymentSerializer.Meta):
        fields = [*DeploymentSerializer.Meta.fields, "warnings"]
        read_only_fields = fields


class SettingChangeSerializer(serializers.Serializer):
    before = serializers.JSONField(read_only=True)
    after = serializers.JSONField(read_only=True)


class RevisionSerializer(serializers.Serializer):
    """A revision of a deployment's settings (scheduling.services.revisions), as its history shows it."""

    revision = serializers.IntegerField(source="revision.number", read_only=True)
    current = serializers.BooleanField(read_only=True, help_text="The settings the deployment has now.")
    at = serializers.DateTimeField(source="revision.at", read_only=True)
    by = serializers.CharField(
        source="revision.by", read_only=True, help_text="Who made it; empty for the portal itself."
    )
    cause = serializers.CharField(
        source="revision.cause", read_only=True, help_text="deployed, settings changed, or rolled back to revision N."
    )
    changes = serializers.SerializerMethodField(
        help_text="What differs from the revision kept before it, by the setting's place in the REST body; null "
        "for the oldest kept."
    )
    settings = serializers.SerializerMethodField(
        help_text="Every setting it kept, by its place in the REST body (the replica count is no setting here: a "
        "rollback leaves the scale as it is)."
    )

    @extend_schema_field(serializers.DictField(child=SettingChangeSerializer(), allow_null=True))
    def get_changes(self, entry: revisions.Entry) -> dict[str, dict[str, Any]] | None:
        return None if entry.changes is None else changes_shown(entry.changes)

    @extend_schema_field(serializers.DictField(child=serializers.JSONField()))
    def get_settings(self, entry: revisions.Entry) -> dict[str, Any]:
        kept = entry.revision.settings
        return {setting.path: kept[setting.name] for setting in revisions.STORED if setting.name in kept}


def changes_shown(changes: dict[str, tuple[Any, Any]]) -> dict[str, dict[str, Any]]:
    return {path: {"before": before, "after": after} for path, (before, after) in changes.items()}


class RolledBackSerializer(serializers.Serializer):
    to = serializers.IntegerField(read_only=True, help_text="The revision returned to.")
    revision = serializers.IntegerField(
        read_only=True, allow_null=True, help_text="The revision the rollback made; null when nothing differed."
    )
    changes = serializers.DictField(child=SettingChangeSerializer(), read_only=True)


class RollbackAnswerSerializer(DeploymentChangedSerializer):
    """A deployment as a rollback leaves it, and what the rollback changed."""

    rollback = RolledBackSerializer(read_only=True)

    class Meta(DeploymentChangedSerializer.Meta):
        fields = [*DeploymentChangedSerializer.Meta.fields, "rollback"]
        read_only_fields = fields


class ReplicaLogQuery(serializers.Serializer):
    tail = serializers.IntegerField(min_value=1, max_value=10_000, required=False, default=200)
    since = serializers.IntegerField(
        min_value=0,
        required=False,
        help_text="A byte offset an earlier answer's `end` gave: the whole lines written since, not the tail.",
    )


class ReplicaLogSerializer(serializers.Serializer):
    replica = serializers.CharField()
    node = serializers.CharField()
    state = serializers.ChoiceField(
        choices=Replica.State.choices,
        help_text="The replica's state, read before its log: once it has ended, the lines read are its last.",
    )
    path = serializers.CharField(help_text="Where the log is on the node.")
    lines = serializers.ListField(child=serializers.CharField(allow_blank=True))
    missing = serializers.BooleanField(help_text="The node has no log file for it (never started there).")
    end = serializers.IntegerField(
        required=False, help_text="The byte offset this read ended at: pass it as `since` for what comes after."
    )
    skipped = serializers.IntegerField(
        required=False, help_text="Bytes after `since` not shown: more than one answer holds (256 KiB) came since."
    )

"""The portal's state (docs/architecture.md). PostgreSQL is the source of truth; only `ledger` and
`services` write these rows."""

from __future__ import annotations

import uuid
from enum import StrEnum

from django.conf import settings
from django.core.validators import RegexValidator
from django.db import models
from django.db.models import F, Func, Q, Value
from django.db.models.functions import Cast
from django.utils import timezone

from gpuportal.wire import deployment_spec as spec
from gpuportal.wire import memory, node_auth, states
from scheduling.core import autoscale

# A node's name as its agent's --node takes it (gpuportal.wire.node_auth): a host's name, dots and all.
node_name_validator = RegexValidator(rf"\A{node_auth.NODE_NAME.pattern}\Z", node_auth.NODE_NAME_RULE)


def new_replica_id() -> str:
    # Opaque on purpose (seed 002): clients must not parse meaning out of replica ids.
    return uuid.uuid4().hex


REPLICA_ID_LENGTH = len(new_replica_id())


def _choices_of(enum: type[StrEnum], labels: dict[StrEnum, str] | None = None) -> type[models.TextChoices]:
    """A model field's choices from an enum of the contract: the names are written there once
    (the labels, the admin's, here; without them, Django's from each name)."""
    labels = labels or {}
    return models.TextChoices(
        enum.__name__,
        [(m.name, (m.value, labels[m]) if m in labels else m.value) for m in enum],
    )


class Hearing(models.Model):
    """The heartbeat sweep's own record, one row: when it last ran, and since when the control
    plane has been able to hear its nodes (None: since the books began). A gap between sweeps
    is a stall of the control plane, not silence of the nodes (scheduling.core.liveness)."""

    last_sweep = models.DateTimeField(null=True, blank=True)
    heard_since = models.DateTimeField(null=True, blank=True)

    def __str__(self) -> str:
        return f"last sweep {self.last_sweep}, heard since {self.heard_since or 'the start'}"


class Node(models.Model):
    Status = _choices_of(states.NodeStatus)

    name = models.CharField(max_length=100, unique=True, validators=[node_name_validator])
    queue = models.CharField(max_length=150, unique=True, help_text="Celery queue the node agent consumes.")
    hostname = models.CharField(max_length=255, blank=True)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.ONLINE, db_index=True)
    last_heartbeat = models.DateTimeField(null=True, blank=True)
    cpu_cache_bytes = models.BigIntegerField(default=0, help_text="Host RAM available for sleeping weights.")
    host_ram_bytes = models.BigIntegerField(default=0, db_default=0, help_text="The host's RAM, as its agent reads it.")
    virtual = models.BooleanField(default=False, help_text="GPUs are simulated on the CPU (no NVIDIA GPU).")
    # Its labels and taints in two layers: what its agent said at its last registration, and what
    # operators set through the API (gpuportal.wire.node_labels.merged: theirs win, and outlive the
    # agent's restarts). `labels` and `taints` are the two merged, as placement reads them.
    labels = models.JSONField(
        default=dict,
        db_default={},
        blank=True,
        help_text="What its agent declares of the host (--labels), its GPUs say and operators set: a "
        "deployment's node_selector matches them.",
    )
    taints = models.JSONField(
        default=dict,
        db_default={},
        blank=True,
        help_text="What its agent (--taints) and operators keep off it: only deployments whose tolerations "
        "name each are placed here.",
    )
    agent_labels = models.JSONField(default=dict, db_default={}, blank=True, editable=False)
    agent_taints = models.JSONField(default=dict, db_default={}, blank=True, editable=False)
    operator_labels = models.JSONField(default=dict, db_default={}, blank=True, editable=False)
    operator_taints = models.JSONField(default=dict, db_default={}, blank=True, editable=False)
    registered_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]
        constraints = [models.CheckConstraint(condition=Q(cpu_cache_bytes__gte=0), name="node_cpu_cache_nonneg")]

    def __str__(self) -> str:
        return self.name


class NodeCredential(models.Model):
    """What a node's agent shows with every call (scheduling.services.node_credentials). By name,
    not a foreign key: a credential is issued before its node first registers. Only the token's
    hash is kept; the token is shown once, when it is issued."""

    node = models.CharField(
        max_length=100,
        unique=True,
        validators=[node_name_validator],
        help_text="The node's name, as its agent's --node.",
    )
    token_hash = models.CharField(
        max_length=64, db_index=True, help_text="sha256 of the token, hex: the token itself is not kept."
    )
    created_at = models.DateTimeField(help_text="When this token was issued (a re-issue replaces it).")
    created_by = models.CharField(max_length=150, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True, db_index=True)
    last_used_at = models.DateTimeField(null=True, blank=True, help_text="A call carried it (to the minute).")

    class Meta:
        ordering = ["node"]

    def __str__(self) -> str:
        return f"{self.node} ({'revoked' if self.revoked_at else 'valid'})"


class GPU(models.Model):
    class Health(models.TextChoices):
        OK = "ok"
        DEGRADED = "degraded"
        LOST = "lost"

    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="gpus")
    index = models.PositiveIntegerField()
    uuid = models.CharField(max_length=100, unique=True)
    product = models.CharField(max_length=200)
    virtual = models.BooleanField(default=False)
    total_bytes = models.BigIntegerField()
    # Derived (total − foreign − Σ occupants' reserved_bytes, never below 0) but stored, so a
    # plan's fit check and the API read one row; the ledger recomputes it under the row lock on
    # every commit and every change of foreign_bytes.
    available_bytes = models.BigIntegerField()
    # Memory other tenants hold: what NVML shows used by processes that are not this portal's
    # replicas, beyond the driver's reserve (or what a virtual GPU declares). Like an occupant the
    # portal does not own: nothing is placed into it. Written by the ledger alone.
    foreign_bytes = models.BigIntegerField(default=0, db_default=0)
    # Of foreign_bytes, what the node's own warm spares hold or are held to (inference.spare_pool):
    # the portal's processes, but no replica's. Shown apart from other tenants; placement keeps
    # out of it as out of the rest of foreign_bytes.
    spare_bytes = models.BigIntegerField(default=0, db_default=0)
    # Compare-and-swap version: bumped by every commit that touches this GPU.
    version = models.BigIntegerField(default=0)
    # The transaction id of the last writer, set by the database on every write (the trigger in
    # scheduling/sql/ledger_stamp_v1.sql, which stamps node, replica and deployment rows too, in a
    # column no model declares). A reader that remembers its previous snapshot can fetch exactly
    # the GPUs changed since (ledger.Mirror): any transaction that commits later has an id at or
    # above that snapshot's xmin.
    changed_txid = models.BigIntegerField(default=0, db_index=True)
    wake_lock_holder = models.ForeignKey(
        "Replica", null=True, blank=True, on_delete=models.SET_NULL, related_name="wake_locks"
    )
    wake_lock_expires_at = models.DateTimeField(null=True, blank=True)
    health = models.CharField(max_length=16, choices=Health.choices, default=Health.OK)
    # total_bytes is what CUDA can allocate; NVML's total also counts the driver's own reserve.
    nvml_total_bytes = models.BigIntegerField(null=True, blank=True)
    # The CUDA context of one replica process on this node's GPUs of this model: serving (after
    # its first forward passes) and as a standby that never ran one. Measured by the replicas
    # themselves; until then the H100's figures. Needs and pools count them on every GPU.
    context_bytes = models.BigIntegerField(default=memory.H100_CONTEXT_BYTES, db_default=memory.H100_CONTEXT_BYTES)
    standby_context_bytes = models.BigIntegerField(
        default=memory.H100_STANDBY_CONTEXT_BYTES, db_default=memory.H100_STANDBY_CONTEXT_BYTES
    )
    context_measured = models.BooleanField(default=False, db_default=False)
    # The books against NVML, from the agent's last heartbeat: what NVML showed free, and by how
    # much its replicas' processes exceeded their reservations in all, with other tenants' use
    # that reached into reserved memory.
    nvml_free_bytes = models.BigIntegerField(null=True, blank=True)
    overcommit_bytes = models.BigIntegerField(default=0, db_default=0)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["node__name", "index"]
        verbose_name = "GPU"
        constraints = [
            models.UniqueConstraint(fields=["node", "index"], name="gpu_unique_node_index"),
            models.CheckConstraint(condition=Q(total_bytes__gt=0), name="gpu_total_positive"),
            # Invariant 1 of docs/architecture.md (no over-commit) as a last line of defence under the ledger.
            models.CheckConstraint(
                condition=Q(available_bytes__gte=0) & Q(available_bytes__lte=F("total_bytes")),
                name="gpu_available_within_total",
            ),
            models.CheckConstraint(condition=Q(foreign_bytes__gte=0), name="gpu_foreign_not_negative"),
        ]

    def __str__(self) -> str:
        return f"{self.node.name}/{self.index}"

    @property
    def reserved_bytes(self) -> int:
        """What the portal's occupants reserve, or at least what is out of placement's reach
        beside other tenants' use when that use has grown into reserved memory."""
        return max(0, self.total_bytes - self.foreign_bytes - self.available_bytes)


def _default(name: str) -> object:
    """The spec's default of a deployment setting."""
    return spec.BY_NAME[name].default


class Deployment(models.Model):
    # The operator's settings and their defaults are gpuportal.wire.deployment_spec's: a default
    # below reads the spec, and a test holds the fields here to the spec's columns and the
    # deployment's identity (tests/scheduling/test_deployment_spec.py). What the portal measures
    # or decides about it is its DeploymentObserved record (`observed`).
    Loader = _choices_of(
        spec.Loader,
        labels={
            spec.Loader.TRANSFORMERS: "Hugging Face transformers causal LM",
            spec.Loader.TORCH_MODULE: "PyTorch module from a factory path",
            # An encoder (BERT, MiniLM, MPNet...) served as sentence embeddings on /v1/embeddings.
            spec.Loader.EMBEDDING: "Hugging Face transformers encoder, as sentence embeddings",
        },
    )
    DType = _choices_of(spec.DType)

    name = models.SlugField(max_length=100, unique=True)
    model_source = models.CharField(
        max_length=1000,
        help_text="Local model directory, hf:org/name (in the nodes' Hugging Face cache), or factory path.",
    )
    loader = models.CharField(max_length=32, choices=Loader.choices, default=_default("loader"))
    dtype = models.CharField(max_length=16, choices=DType.choices, default=_default("dtype"))
    # `name=source,...` (gpuportal.wire.adapters): LoRA adapters served beside the model; "" none.
    model_adapters = models.CharField(
        max_length=spec.BY_NAME["adapters"].max_length,
        blank=True,
        default=_default("adapters"),
        db_default=_default("adapters"),
    )
    replicas_wanted = models.PositiveIntegerField(default=_default("replicas"))
    dedicated = models.BooleanField(default=_default("dedicated"), help_text="Never evicted to make room for others.")
    # Fairness (seed 001).
    min_runtime_s = models.FloatField(default=_default("min_runtime_s"))
    max_wait_s = models.FloatField(default=_default("max_wait_s"))
    popular = models.BooleanField(default=_default("popular"), help_text="Never preempted and never idle-slept.")
    # Sleep.
    idle_timeout_s = models.FloatField(default=_default("idle_timeout_s"), help_text="0 means never sleep when idle.")
    drain_timeout_s = models.FloatField(default=_default("drain_timeout_s"))
    deep_sleep_after_s = models.FloatField(
        default=_default("deep_after_s"), db_default=_default("deep_after_s"), help_text="0 means never sleep deeply."
    )
    # Memory, in order of trust: the override here, then the observed record's measured need (per
    # GPU), then its estimate.
    memory_override_bytes = models.BigIntegerField(null=True, blank=True)
    memory_policy = models.CharField(max_length=32, default=_default("memory_policy"))
    max_tokens = models.PositiveIntegerField(default=_default("max_tokens"))
    # Whose requests share a replica's prefix cache (gpuportal.wire.prefix_cache).
    prefix_cache = models.CharField(
        max_length=16,
        choices=[(mode, mode) for mode in spec.BY_NAME["prefix_cache"].choices],
        default=_default("prefix_cache"),
        db_default=_default("prefix_cache"),
    )
    failover_standby = models.BooleanField(default=_default("standby"))
    # Placement: False packs replicas onto the fullest GPU that fits (best fit, which
    # keeps whole GPUs free for large replicas); True prefers GPUs and nodes with the fewest of
    # its own replicas, then the emptiest GPU.
    placement_spread = models.BooleanField(default=_default("spread"), db_default=_default("spread"))
    # `key=value,...` (gpuportal.wire.node_labels): the node labels its replicas are placed by; "" any node.
    placement_node_selector = models.CharField(
        max_length=spec.BY_NAME["node_selector"].max_length,
        blank=True,
        default=_default("node_selector"),
        db_default=_default("node_selector"),
    )
    # `key=value,...`: the node taints its replicas may go past; "" only untainted nodes.
    placement_tolerations = models.CharField(
        max_length=spec.BY_NAME["tolerations"].max_length,
        blank=True,
        default=_default("tolerations"),
        db_default=_default("tolerations"),
    )
    # Crash-loop backoff: a replica that fails to load is replaced after load_backoff_s,
    # doubling per consecutive failure up to load_backoff_max_s; after max_load_failures in a row
    # the deployment is failed (DeploymentObserved.failed_reason) and starts nothing until retried
    # or changed. Defaults in the database too: rows written by plain SQL (tests, tools) need not
    # name them.
    max_load_failures = models.PositiveIntegerField(
        default=_default("max_load_failures"), db_default=_default("max_load_failures")
    )
    load_backoff_s = models.FloatField(default=_default("backoff_s"), db_default=_default("backoff_s"))
    load_backoff_max_s = models.FloatField(default=_default("backoff_max_s"), db_default=_default("backoff_max_s"))
    # Replicas by load (scheduling.services.autoscaling): off while autoscale_max_replicas is 0.
    autoscale_max_replicas = models.PositiveIntegerField(
        default=_default("autoscale_max_replicas"), db_default=_default("autoscale_max_replicas")
    )
    autoscale_min_replicas = models.PositiveIntegerField(
        default=_default("autoscale_min_replicas"), db_default=_default("autoscale_min_replicas")
    )
    autoscale_target_in_flight = models.FloatField(
        default=_default("autoscale_target_in_flight"), db_default=_default("autoscale_target_in_flight")
    )
    autoscale_down_after_s = models.FloatField(
        default=_default("autoscale_down_after_s"), db_default=_default("autoscale_down_after_s")
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]
        constraints = [
            models.CheckConstraint(condition=Q(min_runtime_s__gte=0), name="deployment_min_runtime_nonneg"),
            models.CheckConstraint(condition=Q(max_wait_s__gte=0), name="deployment_max_wait_nonneg"),
            models.CheckConstraint(condition=Q(idle_timeout_s__gte=0), name="deployment_idle_timeout_nonneg"),
            models.CheckConstraint(condition=Q(drain_timeout_s__gte=0), name="deployment_drain_timeout_nonneg"),
            models.CheckConstraint(condition=Q(deep_sleep_after_s__gte=0), name="deployment_deep_sleep_after_nonneg"),
            models.CheckConstraint(
                condition=Q(memory_override_bytes__isnull=True) | Q(memory_override_bytes__gt=0),
                name="deployment_override_positive",
            ),
        ]

    def __str__(self) -> str:
        return self.name

    # The three below read the observed record too: a query of their own unless it was read with
    # the deployment (select_related("observed"), or the locks of scheduling.locks).

    @property
    def status(self) -> str:
        """ok; retrying (a failed load is replaced after its backoff); failed (it gave up)."""
        observed = self.observed
        if observed.failed_reason:
            return states.DeploymentStatus.FAILED
        return states.DeploymentStatus.RETRYING if observed.retry_at is not None else states.DeploymentStatus.OK

    @property
    def status_text(self) -> str:
        observed = self.observed
        if observed.failed_reason:
            return f"failed: {observed.failed_reason}"
        if observed.retry_at is not None:
            return f"retrying ({observed.load_failures} of {self.max_load_failures} loads failed)"
        return "ok"

    @property
    def memory_need_bytes(self) -> int | None:
        observed = self.observed
        return self.memory_override_bytes or observed.memory_measured_bytes or observed.memory_estimate_bytes

    @property
    def autoscale_policy(self) -> autoscale.Policy | None:
        """Its autoscale settings as the autoscaler (and the capacity planner) read them; None
        while autoscale.max_replicas is 0 (off)."""
        if not self.autoscale_max_replicas:
            return None
        return autoscale.Policy(
            min_replicas=self.autoscale_min_replicas,
            max_replicas=self.autoscale_max_replicas,
            target_in_flight=self.autoscale_target_in_flight,
            down_after_s=self.autoscale_down_after_s,
        )


class DeploymentObserved(models.Model):
    """What the portal measured or decided about a deployment: never set by an operator, so apart
    from the operator's settings on the Deployment row (gpuportal.wire.deployment_spec's). Every
    deployment has one from its creation and it goes with it. Written under its deployment's row
    lock (scheduling.locks), which covers it: it takes no lock of its own."""

    deployment = models.OneToOneField(Deployment, primary_key=True, on_delete=models.CASCADE, related_name="observed")
    # The need one replica measured serving (per GPU): placement trusts it over the estimate,
    # below the operator's override.
    memory_measured_bytes = models.BigIntegerField(null=True, blank=True)
    # The CUDA context the measured need counted: a context grows as forward passes load kernels,
    # so a GPU whose context has since been measured larger adds the difference (placing.need_bytes).
    memory_measured_context_bytes = models.BigIntegerField(null=True, blank=True)
    memory_estimate_bytes = models.BigIntegerField(null=True, blank=True)
    # Weight bytes read from the model without loading it: the `ndif` policy's size × 3 needs it.
    weight_bytes = models.BigIntegerField(null=True, blank=True)
    # How long its last replicas took to serve: placed → serving for a load, waking →
    # serving for a wake. A waiting caller's estimate, and the dashboard's, come from these.
    measured_load_s = models.FloatField(null=True, blank=True)
    measured_wake_s = models.FloatField(null=True, blank=True)
    # Where the crash-loop backoff stands (Deployment.max_load_failures and the backoff settings
    # say how it goes). Defaults in the database too: rows written by plain SQL (tests, tools)
    # need not name them.
    load_failures = models.PositiveIntegerField(default=0, db_default=0, help_text="Consecutive failed loads.")
    failed_reason = models.TextField(
        blank=True, default="", db_default="", help_text="Set once it gave up: the last load error."
    )
    retry_at = models.DateTimeField(null=True, blank=True, help_text="When a replacement for a failed load starts.")
    # A rolling restart under way (scheduling.core.rollout): the replicas started before it are
    # replaced one at a time; None once none is left. The surge: the replica placed ahead of the
    # one it replaces, stopped for it once the surge serves ("" while none is).
    restart_since = models.DateTimeField(
        null=True, blank=True, help_text="A rolling restart replaces the replicas started before this."
    )
    restart_surge = models.CharField(max_length=32, blank=True, default="", db_default="")
    # A move (a drain that moves what serves on its node elsewhere): the restart replaces these
    # replicas alone (their ids, a space between two), never stopping one before its replacement
    # serves; "" for a whole restart. Text, not JSON: hot_sql builds this record from a raw row.
    restart_only = models.TextField(blank=True, default="", db_default="")

    class Meta:
        verbose_name = verbose_name_plural = "measured and decided"

    def __str__(self) -> str:
        return f"deployment {self.deployment_id}: measured and decided"


class DeploymentRevision(models.Model):
    """A deployment's settings as a deploy, a change or a rollback left them: its history, and what
    a rollback returns to (scheduling.services.revisions), as a Kubernetes Deployment's rollout
    history. The replica count is not a setting here: a rollback leaves the scale alone."""

    deployment = models.ForeignKey(Deployment, on_delete=models.CASCADE, related_name="revisions")
    number = models.PositiveIntegerField()
    # Every stored setting (deployment_spec.Setting.stored) by its spec name: a setting added later
    # is missing from an older revision, and a rollback to it leaves that setting as it is.
    settings = models.JSONField()
    # What made it: "deployed", "settings changed", "rolled back to revision N".
    cause = models.CharField(max_length=200)
    by = models.CharField(max_length=150, blank=True, default="")
    at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["deployment", "-number"]
        constraints = [
            models.UniqueConstraint(fields=["deployment", "number"], name="deployment_revision_unique"),
        ]

    def __str__(self) -> str:
        return f"deployment {self.deployment_id} revision {self.number}"


# Liveness by state (seed 004): what a failover pair member is doing, as it reports it.
FailoverState = _choices_of(states.FailoverState)


class Replica(models.Model):
    # Their names, groups and allowed transitions: gpuportal.wire.states.
    Role = _choices_of(states.Role)
    State = _choices_of(states.ReplicaState)

    id = models.CharField(primary_key=True, max_length=32, default=new_replica_id, editable=False)
    deployment = models.ForeignKey(Deployment, on_delete=models.CASCADE, related_name="replicas")
    node = models.ForeignKey(Node, null=True, blank=True, on_delete=models.SET_NULL, related_name="replicas")
    role = models.CharField(max_length=16, choices=Role.choices, default=Role.PRIMARY)
    state = models.CharField(max_length=16, choices=State.choices, default=State.PENDING, db_index=True)
    # {"<gpu index>": bytes} on its node, as in the REST shape of docs/api.md.
    gpu_mem_bytes_by_id = models.JSONField(default=dict, blank=True)
    gpu_memory_fraction = models.FloatField(null=True, blank=True)
    pid = models.IntegerField(null=True, blank=True)
    serving_since = models.DateTimeField(null=True, blank=True)
    last_accessed = models.DateTimeField(null=True, blank=True)
    epoch = models.BigIntegerField(default=0)
    # Failover (seed 004): the pair this replica belongs to, and its liveness state as it reports it.
    lease = models.ForeignKey("FailoverLease", null=True, blank=True, on_delete=models.SET_NULL, related_name="members")
    failover_state = models.CharField(max_length=16, choices=FailoverState.choices, blank=True)
    failure_reason = models.TextField(blank=True)
    # Loading or waking progress reported by the replica process, 0-100.
    progress = models.PositiveSmallIntegerField(null=True, blank=True)
    # Host memory an awake replica may keep for its next sleep: an arena of its weights,
    # pinned in advance, so the sleep is a copy rather than an allocation and a page-locking first.
    # Granted within its node's host cache budget and counted there while it is awake (a sleeping
    # replica's weights are in that arena, counted once); 0: none granted.
    arena_kept_bytes = models.BigIntegerField(default=0, db_default=0)
    # Host RAM its process holds outside its host arena (proportional set size), as its agent
    # last measured it; 0 until measured (scheduling.core.host_memory).
    host_bytes = models.BigIntegerField(default=0, db_default=0)
    # Draining to sleep, it is what a request that found nothing awake waits for: its
    # sleeping report wakes the deployment again whatever the queue holds when it comes, since the
    # request is queued only after its wake was decided. Cleared as it leaves draining.
    wake_when_asleep = models.BooleanField(default=False, db_default=False)
    # When it last fell asleep (its sleeping report): its deployment's deep_sleep_after_s counts
    # from here. Cleared as it comes awake.
    asleep_since = models.DateTimeField(null=True, blank=True)
    # Deep asleep: the size of the copy of its weights its node's host memory holds
    # (inference.host_copy); its wake starts a process that reads it. 0: none.
    host_copy_bytes = models.BigIntegerField(default=0, db_default=0)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["deployment__name", "created_at"]
        constraints = [
            models.CheckConstraint(
                condition=Q(gpu_memory_fraction__isnull=True)
                | (Q(gpu_memory_fraction__gte=0.01) & Q(gpu_memory_fraction__lte=0.99)),
                name="replica_fraction_in_range",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.deployment.name}/{self.id[:8]}"


class Occupant(models.Model):
    """A replica's reservation on one GPU; a multi-GPU replica has one per GPU."""

    gpu = models.ForeignKey(GPU, on_delete=models.CASCADE, related_name="occupants")
    # PROTECT: releasing a reservation must go through the ledger (which keeps available_bytes
    # and the version in step); a cascade from deleting a replica would silently skip it.
    replica = models.ForeignKey(Replica, on_delete=models.PROTECT, related_name="occupancies")
    reserved_bytes = models.BigIntegerField()
    since = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["gpu_id", "since"]
        constraints = [
            models.UniqueConstraint(fields=["gpu", "replica"], name="occupant_unique_gpu_replica"),
            models.CheckConstraint(condition=Q(reserved_bytes__gte=0), name="occupant_reserved_nonneg"),
        ]

    def __str__(self) -> str:
        return f"{self.replica_id[:8]} on gpu {self.gpu_id}: {self.reserved_bytes} B"


class PreemptionIntent(models.Model):
    class Status(models.TextChoices):
        WAITING = "waiting"
        VICTIM_CHOSEN = "victim_chosen"
        SATISFIED = "satisfied"
        FAILED = "failed"
        CANCELLED = "cancelled"

    gpu = models.ForeignKey(GPU, on_delete=models.CASCADE, related_name="intents")
    waiting_replica = models.ForeignKey(Replica, on_delete=models.CASCADE, related_name="intents")
    needed_bytes = models.BigIntegerField()
    created_at = models.DateTimeField(auto_now_add=True)
    deadline = models.DateTimeField(help_text="created_at + the waiting deployment's max_wait.")
    victim = models.ForeignKey(Replica, null=True, blank=True, on_delete=models.SET_NULL, related_name="preempted_by")
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.WAITING, db_index=True)

    class Meta:
        ordering = ["created_at"]
        constraints = [
            models.CheckConstraint(condition=Q(needed_bytes__gt=0), name="intent_needed_positive"),
        ]

    def __str__(self) -> str:
        return f"{self.waiting_replica_id[:8]} needs {self.needed_bytes} B on gpu {self.gpu_id}"


# Intents still in play; satisfied, failed and cancelled ones are history (see Events).
ACTIVE_INTENT_STATUSES = (PreemptionIntent.Status.WAITING, PreemptionIntent.Status.VICTIM_CHOSEN)


class FailoverLease(models.Model):
    """A failover pair (seed 004), and who holds its lock at which epoch as its members report it.
    The lock itself is the node's: a file lock held by the replica process (inference.failover)."""

    deployment = models.ForeignKey(Deployment, on_delete=models.CASCADE, related_name="failover_leases")
    slot = models.PositiveIntegerField(default=0, help_text="Which pair of the deployment.")
    # Names the pair's result fence in Redis (gpuportal.wire.requestqueue) and its lock's files on
    # the node: ids restart with a new database, Redis and the node's files may outlive it, and a
    # fence left by another pair must never apply to this one.
    fence = models.CharField(
        max_length=32,
        default=new_replica_id,
        db_default=Func(
            Cast(Func(function="gen_random_uuid"), models.TextField()), Value("-"), Value(""), function="replace"
        ),
        editable=False,
    )
    # The lock's holder and epoch as the members' grants reported them (never moved back by a
    # report of an older epoch, which is refused: scheduling.services.pair_reports).
    holder = models.ForeignKey(Replica, null=True, blank=True, on_delete=models.SET_NULL, related_name="leases")
    epoch = models.BigIntegerField(default=0)
    granted_at = models.DateTimeField(null=True, blank=True)
    # Set when a scale down stops the pair whole; its stops close the lock on the node too, so the
    # standby, stopped in the same breath, never takes over as the active member exits.
    closed_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["deployment__name", "slot"]
        constraints = [
            models.UniqueConstraint(fields=["deployment", "slot"], name="lease_unique_deployment_slot"),
        ]

    def __str__(self) -> str:
        return f"{self.deployment.name}#{self.slot} epoch {self.epoch}"


class Event(models.Model):
    """The audit trail: why each thing happened (invariant 6 of docs/architecture.md)."""

    class Kind(models.TextChoices):
        NODE_REGISTERED = "node.registered"
        NODE_ONLINE = "node.online"
        NODE_OFFLINE = "node.offline"
        NODE_STOPPED = "node.stopped"
        NODE_DRAINING = "node.draining"
        # An offline node forgotten by an operator (a retired host), with its GPUs.
        NODE_REMOVED = "node.removed"
        # Its labels or taints set by an operator (the API's PATCH, `gpuportal node label`/`taint`).
        NODE_CHANGED = "node.changed"
        # A node's credential (scheduling.services.node_credentials): issued or replaced, revoked,
        # and a call refused from a node the books still count replicas on.
        NODE_CREDENTIAL = "node.credential"
        NODE_REVOKED = "node.revoked"
        NODE_REFUSED = "node.refused"
        GPU_REGISTERED = "gpu.registered"
        GPU_CHANGED = "gpu.changed"
        GPU_RESERVED = "gpu.reserved"
        GPU_RELEASED = "gpu.released"
        # A replica's process seen by NVML (or the virtual GPU's model of it) above its reservation.
        GPU_OVERCOMMIT = "gpu.overcommit"
        # Other tenants' use of a GPU (GPU.foreign_bytes) changed, by more than the books' tolerance.
        GPU_FOREIGN = "gpu.foreign"
        REPLICA_STATE = "replica.state"
        REPLICA_RESTARTED = "replica.restarted"
        REPLICA_ADOPTED = "replica.adopted"
        DEPLOYMENT_CHANGED = "deployment.changed"
        # The fair wake path (seed 001): lock takes/releases/takeovers, intents, victims, outcomes.
        GPU_WAKE_LOCK = "gpu.wake_lock"
        PREEMPTION_INTENT = "preemption.intent"
        PREEMPTION_VICTIM = "preemption.victim"
        PREEMPTION_OUTCOME = "preemption.outcome"
        # Failover pairs (seed 004): lock grants and losses with their epochs, takeovers, rejections.
        FAILOVER_STATE = "failover.state"
        FAILOVER_GRANT = "failover.grant"
        FAILOVER_LOSS = "failover.loss"
        FAILOVER_TAKEOVER = "failover.takeover"
        FAILOVER_STALE = "failover.stale"
        FAILOVER_SWITCHOVER = "failover.switchover"
        # `up` started one of its processes again after it died.
        STACK_RESTARTED = "stack.restarted"
        # The control plane heard no node for a while (its database, broker or worker stalled):
        # node silence from before counts for nothing.
        CONTROL_STALLED = "control.stalled"
        # A node's host cache: a sleeper parked out of it, or what is over its budget.
        HOST_CACHE = "host_cache"

    time = models.DateTimeField(auto_now_add=True, db_index=True)
    # Named in Kind, but not constrained to it: kinds grow with the product, and a choices list
    # would make every new one a migration.
    kind = models.CharField(max_length=64, db_index=True)
    subject = models.CharField(max_length=255, help_text='What it happened to, e.g. "gpu node1/0".')
    reason = models.TextField()
    before = models.JSONField(null=True, blank=True)
    after = models.JSONField(null=True, blank=True)
    # Plain names rather than foreign keys: the trail outlives what it describes.
    node = models.CharField(max_length=100, blank=True, db_index=True)
    gpu = models.CharField(max_length=120, blank=True, db_index=True)
    deployment = models.CharField(max_length=100, blank=True, db_index=True)
    replica = models.CharField(max_length=32, blank=True, db_index=True)

    class Meta:
        ordering = ["-time", "-id"]

    def __str__(self) -> str:
        return f"{self.time:%Y-%m-%d %H:%M:%S} {self.kind} {self.subject}"


class UserLimits(models.Model):
    """One user's own limits on inference requests, in place of the GPUPORTAL_USER_MAX_* defaults
    (scheduling.services.user_limits). Edited in the admin: nothing else depends on these rows."""

    user = models.OneToOneField(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="request_limits")
    max_concurrent = models.PositiveIntegerField(
        null=True,
        blank=True,
        help_text="Requests accepted and not yet ended at once. Empty: GPUPORTAL_USER_MAX_CONCURRENT; 0: no limit.",
    )
    max_per_minute = models.PositiveIntegerField(
        null=True,
        blank=True,
        help_text="Requests accepted per minute. Empty: GPUPORTAL_USER_MAX_PER_MINUTE; 0: no limit.",
    )

    class Meta:
        verbose_name = "user limits"
        verbose_name_plural = "user limits"

    def __str__(self) -> str:
        return f"limits of {self.user}"


class RequestRecord(models.Model):
    """An ended inference request, as the capacity planner reads recorded traffic:
    drained from Redis's gp:records (every request's end pushes one) by a beat task, kept for
    GPUPORTAL_REQUEST_RECORD_RETENTION_S. Written only by scheduling.services.traffic."""

    request_id = models.CharField(max_length=64, unique=True)
    # A plain name: the record outlives a deleted deployment, as Events do.
    deployment = models.CharField(max_length=100, db_index=True)
    kind = models.CharField(max_length=16, blank=True, default="")
    status = models.CharField(max_length=16)
    created_at = models.DateTimeField(db_index=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    # When its first token was sampled: a generation done by a batching replica only.
    first_token_at = models.DateTimeField(null=True, blank=True)
    # From the answer's usage; None for a request that ended without one (failed, cancelled).
    prompt_tokens = models.PositiveIntegerField(null=True, blank=True)
    output_tokens = models.PositiveIntegerField(null=True, blank=True)

    class Meta:
        ordering = ["created_at", "id"]

    def __str__(self) -> str:
        return f"{self.deployment} {self.request_id[:8]} {self.status}"


class CapacityPlan(models.Model):
    """A capacity plan asked for by `POST /api/plan/` and computed on the control worker: its
    progress while it runs, then the answer (scheduling.simulation.planner) and its plot."""

    State = _choices_of(states.PlanState)

    requested_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL)
    state = models.CharField(max_length=16, choices=State.choices, default=State.QUEUED)
    percent = models.PositiveSmallIntegerField(default=0)
    # What was asked: the trace's text (or none: the recorded traffic since `since`), the catalogue
    # (none: the portal's deployments), target, SLO, and whether bad rows are skipped.
    trace = models.TextField(blank=True, default="")
    since = models.DateTimeField(null=True, blank=True)
    options = models.JSONField(default=dict, blank=True)
    error = models.TextField(blank=True, default="")
    skipped_rows = models.JSONField(default=list, blank=True)
    result = models.JSONField(null=True, blank=True)
    table = models.TextField(blank=True, default="")
    plot_png = models.BinaryField(null=True, blank=True)
    elapsed_s = models.FloatField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return f"capacity plan {self.pk} ({self.state})"

"""Admin registrations.

The admin looks at everything but must never be a second writer beside the ledger: GPU bytes,
versions and wake locks, occupants, intents, leases, replica state and the audit trail change
only through `scheduling.ledger` / `scheduling.services`, which keep the invariants of docs/architecture.md
and write an Event for each change. So those are read-only here, and deletes that would
cascade into occupants are refused (Django checks delete permission on every cascaded row).
Controls (drain, sleep, wake, evict) belong in admin actions that call services."""

from __future__ import annotations

import base64

from django.conf import settings
from django.contrib import admin
from django.db.models import Count, OuterRef, Q, QuerySet, Subquery
from django.http import HttpRequest
from django.utils import timezone
from django.utils.html import format_html

from gpuportal.wire import node_labels, states
from scheduling import selectors
from scheduling.models import (
    GPU,
    CapacityPlan,
    Deployment,
    DeploymentObserved,
    DeploymentRevision,
    Event,
    FailoverLease,
    Node,
    NodeCredential,
    Occupant,
    PreemptionIntent,
    Replica,
    RequestRecord,
    UserLimits,
)
from scheduling.services import revisions
from scheduling.services.placing import need_with
from scheduling.services.replica_specs import largest_contexts
from scheduling.web import admin_actions

GIB = 1024**3


def gib(n_bytes: int | None) -> str:
    return "-" if n_bytes is None else f"{n_bytes / GIB:.2f} GiB"


def short_id(replica_id: str | None) -> str:
    return (replica_id or "")[:8] or "-"


class ViewOnly:
    """Viewable, never added, changed or deleted from the admin."""

    def has_add_permission(self, request: HttpRequest, obj: object = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: object = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: object = None) -> bool:
        return False


class ReadOnlyAdmin(ViewOnly, admin.ModelAdmin):
    pass


class ReadOnlyInline(ViewOnly, admin.TabularInline):
    extra = 0
    can_delete = False
    show_change_link = True


@admin.register(Node)
class NodeAdmin(ReadOnlyAdmin):
    list_display = [
        "name", "status", "hostname", "queue", "virtual", "gpu_count", "cpu_cache", "labels_shown", "taints_shown",
        "last_heartbeat",
    ]  # fmt: skip
    list_filter = ["status", "virtual"]
    search_fields = ["name", "hostname", "queue"]
    # Node agents register nodes and report these; status moves through services (heartbeats, drain),
    # and an offline node leaves through one (nodes.remove), never the admin's own delete.
    actions = [admin_actions.remove_nodes]

    def get_queryset(self, request: HttpRequest) -> QuerySet[Node]:
        return super().get_queryset(request).annotate(gpu_count=Count("gpus"))

    @admin.display(description="GPUs", ordering="gpu_count")
    def gpu_count(self, obj: Node) -> int:
        return obj.gpu_count

    @admin.display(description="CPU cache", ordering="cpu_cache_bytes")
    def cpu_cache(self, obj: Node) -> str:
        return gib(obj.cpu_cache_bytes)

    @admin.display(description="Labels")
    def labels_shown(self, obj: Node) -> str:
        return node_labels.text(obj.labels or {}) or "-"

    @admin.display(description="Taints")
    def taints_shown(self, obj: Node) -> str:
        return node_labels.text(obj.taints or {}) or "-"


@admin.register(NodeCredential)
class NodeCredentialAdmin(admin.ModelAdmin):
    """Issued (added) and revoked here through scheduling.services.node_credentials, never edited:
    the token is shown once, in a message, and only its hash is kept."""

    list_display = ["node", "valid", "created_at", "created_by", "revoked_at", "last_used_at"]
    list_filter = [("revoked_at", admin.EmptyFieldListFilter)]
    search_fields = ["node"]
    fields = ["node"]
    readonly_fields = ["token_hash", "created_at", "created_by", "revoked_at", "last_used_at"]
    actions = [admin_actions.issue_node_credentials, admin_actions.revoke_node_credentials]

    def get_fields(self, request: HttpRequest, obj: NodeCredential | None = None) -> list[str]:
        return ["node"] if obj is None else ["node", *self.readonly_fields]

    def get_readonly_fields(self, request: HttpRequest, obj: NodeCredential | None = None) -> list[str]:
        return [] if obj is None else ["node", *self.readonly_fields]

    def has_change_permission(self, request: HttpRequest, obj: object = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: object = None) -> bool:
        return False

    @admin.display(boolean=True, description="valid")
    def valid(self, obj: NodeCredential) -> bool:
        return obj.revoked_at is None

    def save_model(self, request: HttpRequest, obj: NodeCredential, form: object, change: bool) -> None:
        # Issued by the service, not saved from the form: the token is made, its hash kept, and
        # an Event written there. The form's own check refuses a node that has one already.
        obj.pk = admin_actions.issue_and_show(self, request, obj.node).pk


class OccupantInline(ReadOnlyInline):
    model = Occupant
    fields = ["replica", "deployment", "state", "reserved", "since"]
    readonly_fields = fields

    def get_queryset(self, request: HttpRequest) -> QuerySet[Occupant]:
        return super().get_queryset(request).select_related("replica__deployment")

    @admin.display(description="deployment")
    def deployment(self, obj: Occupant) -> str:
        return obj.replica.deployment.name

    @admin.display(description="state")
    def state(self, obj: Occupant) -> str:
        return obj.replica.state

    @admin.display(description="reserved")
    def reserved(self, obj: Occupant) -> str:
        return gib(obj.reserved_bytes)


class IntentInline(ReadOnlyInline):
    model = PreemptionIntent
    fk_name = "gpu"
    fields = ["waiting_replica", "needed_bytes", "status", "victim", "created_at", "deadline"]
    readonly_fields = fields


@admin.register(GPU)
class GPUAdmin(ReadOnlyAdmin):
    list_display = [
        "__str__",
        "node",
        "index",
        "product",
        "virtual",
        "total",
        "available",
        "version",
        "health",
        "wake_lock",
    ]
    list_filter = ["health", "virtual", "node"]
    search_fields = ["uuid", "product", "node__name"]
    list_select_related = ["node", "wake_lock_holder__deployment"]
    fields = [
        "node",
        "index",
        "uuid",
        "product",
        "virtual",
        "health",
        "total_bytes",
        "available_bytes",
        "available",
        "version",
        "wake_lock_holder",
        "wake_lock_expires_at",
        "updated_at",
    ]
    # Inventory comes from the node agent and bytes, version and wake lock from the ledger.
    readonly_fields = fields
    inlines = [OccupantInline, IntentInline]

    @admin.display(description="total", ordering="total_bytes")
    def total(self, obj: GPU) -> str:
        return gib(obj.total_bytes)

    @admin.display(description="available", ordering="available_bytes")
    def available(self, obj: GPU) -> str:
        return gib(obj.available_bytes)

    @admin.display(description="wake lock")
    def wake_lock(self, obj: GPU) -> str:
        holder = obj.wake_lock_holder
        return "-" if holder is None else str(holder)


@admin.display(description="GPU memory", ordering="gpu_memory_fraction")
def gpu_share(obj: Replica) -> str:
    """The replica's cap as a share of its GPU, as an operator reads one (4.9 %, not 0.0488481053)."""
    fraction = obj.gpu_memory_fraction
    return "-" if fraction is None else f"{100 * fraction:.1f} %"


class ReplicaInline(ReadOnlyInline):
    model = Replica
    fields = ["id", "node", "role", "state", "failover_state", gpu_share, "last_accessed"]
    readonly_fields = fields


class ObservedInline(ViewOnly, admin.StackedInline):
    """What the portal measured or decided about the deployment, beside its settings: read-only,
    as everything here (the services write it)."""

    model = DeploymentObserved
    can_delete = False
    fields = [
        "memory_estimate_bytes",
        "memory_measured_bytes",
        "memory_measured_context_bytes",
        "weight_bytes",
        "measured_load_s",
        "measured_wake_s",
        "load_failures",
        "failed_reason",
        "retry_at",
    ]
    readonly_fields = fields


@admin.display(description="changes")
def revision_changes(obj: DeploymentRevision) -> str:
    """What the revision changed from the one kept before it, as `gpuportal history` says it."""
    before = getattr(obj, "before_settings", None)
    if before is None:
        return "-"
    return revisions.described(revisions.changes_between(before, obj.settings))


class RevisionInline(ReadOnlyInline):
    """Its settings' history, newest first; the action "Roll back…" returns to the one before."""

    model = DeploymentRevision
    fields = ["number", "at", "by", "cause", revision_changes]
    readonly_fields = fields
    show_change_link = False

    def get_queryset(self, request: HttpRequest) -> QuerySet[DeploymentRevision]:
        # Each row's predecessor read in the same query: the page costs one query however many
        # revisions are kept (it was one more per row).
        kept_before = DeploymentRevision.objects.filter(
            deployment=OuterRef("deployment"), number__lt=OuterRef("number")
        ).order_by("-number")
        return super().get_queryset(request).annotate(before_settings=Subquery(kept_before.values("settings")[:1]))


@admin.register(Deployment)
class DeploymentAdmin(ReadOnlyAdmin):
    """No edit form: a change here would bypass placement and the Event trail. Controls are
    the actions below (and the REST API), which go through the services."""

    actions = [
        admin_actions.edit_settings,
        admin_actions.scale_deployments,
        admin_actions.evict_deployments,
        admin_actions.sleep_deployments,
        admin_actions.wake_deployments,
        admin_actions.switch_over_deployments,
        admin_actions.retry_deployments,
        admin_actions.restart_deployments,
        admin_actions.roll_back_deployments,
    ]

    list_display = [
        "name",
        "status",
        "loader",
        "dtype",
        "replicas_wanted",
        "replica_count",
        "dedicated",
        "popular",
        "memory_need",
        "failover_standby",
        "updated_at",
    ]
    list_filter = ["loader", "dtype", "dedicated", "popular", "failover_standby"]
    search_fields = ["name", "model_source"]
    inlines = [ObservedInline, ReplicaInline, RevisionInline]

    def get_queryset(self, request: HttpRequest) -> QuerySet[Deployment]:
        # With the observed record: the list's status and memory need read it; and the GPUs'
        # largest contexts, which the need counts, in the same query.
        def largest(field: str) -> Subquery:
            return Subquery(GPU.objects.order_by(f"-{field}").values(field)[:1])

        return (
            super()
            .get_queryset(request)
            .select_related("observed")
            .annotate(
                # Those that hold or will hold something: the ended ones are the last hour's history.
                replica_count=Count("replicas", filter=~Q(replicas__state__in=states.ENDED)),
                largest_context=largest("context_bytes"),
                largest_standby_context=largest("standby_context_bytes"),
            )
        )

    @admin.display(description="replicas", ordering="replica_count")
    def replica_count(self, obj: Deployment) -> int:
        return obj.replica_count

    @admin.display(description="memory need")
    def memory_need(self, obj: Deployment) -> str:
        """What placement reserves for one replica (as the API's need_bytes), contexts included."""
        if obj.memory_need_bytes is None:
            return gib(None)
        # Annotated by get_queryset, which the changelist reads.
        found = getattr(obj, "largest_context", None), getattr(obj, "largest_standby_context", None)
        try:
            return gib(need_with(obj, largest_contexts(*found)).bytes)
        except ValueError:
            return gib(None)  # its policy cannot size it (ndif without the weights' size)

    @admin.display(description="status")
    def status(self, obj: Deployment) -> str:
        return obj.status_text


class ReplicaOccupantInline(ReadOnlyInline):
    model = Occupant
    fields = ["gpu", "reserved", "since"]
    readonly_fields = fields

    def get_queryset(self, request: HttpRequest) -> QuerySet[Occupant]:
        return super().get_queryset(request).select_related("gpu__node")

    @admin.display(description="reserved")
    def reserved(self, obj: Occupant) -> str:
        return gib(obj.reserved_bytes)


@admin.register(Replica)
class ReplicaAdmin(ReadOnlyAdmin):
    actions = [admin_actions.evict_replicas, admin_actions.sleep_replicas, admin_actions.wake_replicas]
    list_display = [
        "short_id",
        "deployment",
        "node",
        "role",
        "state",
        "failover_state",
        gpu_share,
        "kv_blocks",
        "pid",
        "epoch",
        "last_accessed",
    ]
    list_filter = ["state", "role", "failover_state", "node", "deployment"]
    search_fields = ["id", "deployment__name", "node__name"]
    list_select_related = ["deployment", "node"]
    inlines = [ReplicaOccupantInline]

    @admin.display(description="id", ordering="id")
    def short_id(self, obj: Replica) -> str:
        return short_id(obj.id)

    def get_changelist_instance(self, request: HttpRequest):
        # The page's KV figures in one Redis round trip, rather than one per row.
        changelist = super().get_changelist_instance(request)
        found = selectors.kv_figures(changelist.result_list)
        for replica in changelist.result_list:
            replica.kv_figures = found.get(replica.id)
        return changelist

    @admin.display(description="KV blocks used")
    def kv_blocks(self, obj: Replica) -> str:
        # Set for a whole page by get_changelist_instance; read alone elsewhere.
        stats = obj.kv_figures if hasattr(obj, "kv_figures") else selectors.kv_figures([obj]).get(obj.id)
        if stats is None:
            return "–"
        used = f"{stats.get('blocks_used', 0)} / {stats.get('blocks_total', 0)} (peak {stats.get('blocks_peak', 0)})"
        cached = stats.get("blocks_cached", 0)
        return f"{used}, {cached} cached" if cached else used


@admin.register(Occupant)
class OccupantAdmin(ReadOnlyAdmin):
    list_display = ["gpu", "replica_short", "deployment", "reserved", "since"]
    list_filter = ["gpu__node"]
    search_fields = ["replica__id", "replica__deployment__name", "gpu__uuid"]
    list_select_related = ["gpu__node", "replica__deployment"]

    @admin.display(description="replica", ordering="replica_id")
    def replica_short(self, obj: Occupant) -> str:
        return short_id(obj.replica_id)

    @admin.display(description="deployment", ordering="replica__deployment__name")
    def deployment(self, obj: Occupant) -> str:
        return obj.replica.deployment.name

    @admin.display(description="reserved", ordering="reserved_bytes")
    def reserved(self, obj: Occupant) -> str:
        return gib(obj.reserved_bytes)


@admin.register(PreemptionIntent)
class PreemptionIntentAdmin(ReadOnlyAdmin):
    list_display = ["gpu", "waiting", "needed", "status", "victim_short", "created_at", "deadline"]
    list_filter = ["status"]
    search_fields = ["waiting_replica__id", "waiting_replica__deployment__name", "victim__id"]
    list_select_related = ["gpu__node", "waiting_replica__deployment"]

    @admin.display(description="waiting replica", ordering="waiting_replica_id")
    def waiting(self, obj: PreemptionIntent) -> str:
        return str(obj.waiting_replica)

    @admin.display(description="needed", ordering="needed_bytes")
    def needed(self, obj: PreemptionIntent) -> str:
        return gib(obj.needed_bytes)

    @admin.display(description="victim", ordering="victim_id")
    def victim_short(self, obj: PreemptionIntent) -> str:
        return short_id(obj.victim_id)


@admin.register(FailoverLease)
class FailoverLeaseAdmin(ReadOnlyAdmin):
    list_display = ["deployment", "slot", "holder_short", "epoch", "granted_at", "closed_at"]
    search_fields = ["deployment__name", "holder__id"]
    list_select_related = ["deployment"]

    @admin.display(description="holder", ordering="holder_id")
    def holder_short(self, obj: FailoverLease) -> str:
        return short_id(obj.holder_id)


@admin.register(Event)
class EventAdmin(ReadOnlyAdmin):
    list_display = ["when", "kind", "subject", "reason"]
    list_filter = ["kind"]
    search_fields = ["subject", "reason", "node", "gpu", "deployment", "replica"]
    date_hierarchy = "time"
    # The trail grows without bound; counting all of it on every page view is wasted work.
    show_full_result_count = False

    @admin.display(description="time", ordering="time")
    def when(self, event: Event) -> str:
        # To the second (the admin's default format stops at minutes): a wake, a failover or a
        # restart is a matter of seconds, and events of one minute must be told apart.
        return timezone.localtime(event.time).strftime("%Y-%m-%d %H:%M:%S")


@admin.register(UserLimits)
class UserLimitsAdmin(admin.ModelAdmin):
    """Edited here, by any staff user, as the controls are: these rows are no ledger's, only the
    limits a user's requests meet (scheduling.services.user_limits)."""

    list_display = ["user", "concurrent", "per_minute"]
    search_fields = ["user__username"]
    list_select_related = ["user"]
    fields = ["user", "max_concurrent", "max_per_minute"]

    def has_view_permission(self, request: HttpRequest, obj: object = None) -> bool:
        return request.user.is_active and request.user.is_staff

    has_add_permission = has_change_permission = has_delete_permission = has_view_permission

    def has_module_permission(self, request: HttpRequest) -> bool:
        return self.has_view_permission(request)

    @admin.display(description="requests in flight at once", ordering="max_concurrent")
    def concurrent(self, obj: UserLimits) -> str:
        return _limit(obj.max_concurrent, settings.GPUPORTAL_USER_MAX_CONCURRENT)

    @admin.display(description="requests per minute", ordering="max_per_minute")
    def per_minute(self, obj: UserLimits) -> str:
        return _limit(obj.max_per_minute, settings.GPUPORTAL_USER_MAX_PER_MINUTE)


def _limit(own: int | None, default: int) -> str:
    """A limit as it holds: the user's own, or the setting's (empty field)."""
    value = default if own is None else own
    text = str(value) if value else "no limit"
    return f"{text} (the default)" if own is None else text


def _fewest(policy: dict) -> str:
    """A plan's answer for one policy: its fewest GPUs, and where the target holds from when later."""
    fewest, steady = policy["fewest_gpus"], policy.get("holds_from", policy["fewest_gpus"])
    if fewest is None:
        return "-"
    return str(fewest) if steady == fewest else f"{fewest} (holds from {steady if steady is not None else '-'})"


@admin.register(CapacityPlan)
class CapacityPlanAdmin(ReadOnlyAdmin):
    """Plans asked for through `POST /api/plan/`: the table and the plot, as the API shows them."""

    list_display = ["id", "state", "percent", "requested_by", "answer", "created_at", "elapsed"]
    list_filter = ["state"]
    fields = [
        *("state", "percent", "requested_by", "since", "options", "error"),
        *("plan_table", "plan_plot", "skipped_rows"),
    ]
    readonly_fields = fields

    @admin.display(description="fewest GPUs")
    def answer(self, obj: CapacityPlan) -> str:
        policies = (obj.result or {}).get("policies", [])
        return ", ".join(f"{p['policy']} {_fewest(p)}" for p in policies)

    @admin.display(description="took")
    def elapsed(self, obj: CapacityPlan) -> str:
        return "-" if obj.elapsed_s is None else f"{obj.elapsed_s:.1f} s"

    @admin.display(description="table")
    def plan_table(self, obj: CapacityPlan) -> str:
        return format_html('<pre style="white-space: pre; overflow-x: auto">{}</pre>', obj.table or "-")

    @admin.display(description="plot")
    def plan_plot(self, obj: CapacityPlan) -> str:
        if not obj.plot_png:
            return "-"
        encoded = base64.b64encode(bytes(obj.plot_png)).decode()
        return format_html('<img alt="attainment against GPU count" src="data:image/png;base64,{}">', encoded)


@admin.register(RequestRecord)
class RequestRecordAdmin(ReadOnlyAdmin):
    """The recorded traffic the planner reads (`manage.py export_trace`)."""

    list_display = ["created_at", "deployment", "status", "prompt_tokens", "output_tokens", "request_id"]
    list_filter = ["status"]
    search_fields = ["deployment", "request_id"]
    date_hierarchy = "created_at"


# The dashboard lives under /admin/dashboard/ with its names in the admin namespace
# ("admin:scheduling_dashboard"), so the admin's templates, login and messages apply to it.
# Prepended, because the admin's catch-all would otherwise answer the path.
_admin_urls = admin.site.get_urls


def _urls_with_dashboard() -> list:
    from django.urls import include, path

    from scheduling.web import urls as dashboard_urls

    return [path("dashboard/", include(dashboard_urls.urls())), *_admin_urls()]


admin.site.get_urls = _urls_with_dashboard
# The product's name where Django's would show ("Django administration").
admin.site.site_header = admin.site.site_title = "gpuportal administration"
admin.site.index_title = "Deployments, replicas, nodes and their events"

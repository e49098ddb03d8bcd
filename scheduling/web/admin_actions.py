"""Admin actions: controls that go through the services (so each is planned, committed and
recorded as an Event), with the outcome reported as a message per item."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from django import forms
from django.conf import settings
from django.contrib import admin, messages
from django.core.validators import MaxValueValidator
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse

from gpuportal.wire import deployment_spec
from scheduling.models import Deployment, Node, NodeCredential, Replica
from scheduling.services import deployments as deployment_services
from scheduling.services import failover as failover_services
from scheduling.services import node_credentials, revisions, rollouts
from scheduling.services import nodes as node_services
from scheduling.services import replicas as replica_services
from scheduling.services import sleep as sleep_services
from scheduling.services.errors import ServiceError


def report_each(
    admin_view: admin.ModelAdmin, request: HttpRequest, items: Iterable[str], act: Callable[[str], str]
) -> None:
    """Run `act` on each item: one failure does not stop the others, and each outcome is shown."""
    for item in items:
        try:
            admin_view.message_user(request, act(item), messages.SUCCESS)
        except ServiceError as err:
            admin_view.message_user(request, f"{item}: {err}", messages.ERROR)


class ScaleForm(forms.Form):
    replicas = forms.IntegerField(min_value=deployment_spec.BY_NAME["replicas"].min, label="Replicas wanted")

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        # The API's own cap (GPUPORTAL_MAX_REPLICAS), read per form as the API reads it per request.
        cap = getattr(settings, deployment_spec.BY_NAME["replicas"].max_setting)
        field = self.fields["replicas"]
        field.max_value = cap
        field.validators.append(MaxValueValidator(cap))
        field.widget.attrs["max"] = cap


def form_page(
    admin_view: admin.ModelAdmin, request: HttpRequest, form: forms.Form, names: list[str], *, action: str, title: str,
    intro: str, submit: str,
) -> TemplateResponse:  # fmt: skip
    """The intermediate page of an action that needs input; it posts back to the same action."""
    return TemplateResponse(
        request,
        "admin/scheduling/action_form.html",
        {
            **admin_view.admin_site.each_context(request),
            "title": title,
            "intro": intro,
            "submit": submit,
            "form": form,
            "names": names,
            "selected": request.POST.getlist(admin.helpers.ACTION_CHECKBOX_NAME),
            "opts": admin_view.model._meta,
            "action": action,
        },
    )


@admin.action(description="Scale selected deployments…")
def scale_deployments(admin_view: admin.ModelAdmin, request: HttpRequest, queryset: QuerySet[Deployment]):
    names = list(queryset.values_list("name", flat=True))
    form = ScaleForm(request.POST if "apply" in request.POST else None)
    if "apply" in request.POST and form.is_valid():
        wanted = form.cleaned_data["replicas"]

        def act(name: str) -> str:
            deployment_services.scale(name, wanted, reason=f"scaled by {request.user} (admin)")
            return f"{name}: scaled to {wanted} replica(s)"

        report_each(admin_view, request, names, act)
        return None
    return form_page(
        admin_view, request, form, names, action="scale_deployments", title="Scale deployments", submit="Scale",
        intro="Cached replicas are promoted before new ones are created; scaling down stops replicas. Scale",
    )  # fmt: skip


def _setting_field(name: str, label: str) -> forms.Field:
    """A form field for a setting, bounded as the spec says; blank leaves it as it is."""
    setting = deployment_spec.BY_NAME[name]
    if setting.type is bool:
        return forms.NullBooleanField(required=False, label=label)
    if setting.type is int:
        cap = getattr(settings, setting.max_setting) if setting.max_setting else setting.max
        return forms.IntegerField(required=False, min_value=setting.min, max_value=cap, label=label)
    return forms.FloatField(required=False, min_value=setting.min, max_value=setting.max, label=label)


class SettingsForm(forms.Form):
    """Fairness, sleep and autoscale settings; a blank field leaves the setting as it is."""

    min_runtime_s = _setting_field("min_runtime_s", "Min runtime (s)")
    max_wait_s = _setting_field("max_wait_s", "Max wait (s)")
    popular = _setting_field("popular", "Popular (never preempted, never idle-slept)")
    idle_timeout_s = _setting_field("idle_timeout_s", "Idle timeout (s)")
    deep_after_s = _setting_field("deep_after_s", "Deep sleep after (s asleep; 0: never)")
    drain_timeout_s = _setting_field("drain_timeout_s", "Drain timeout (s)")
    autoscale_max_replicas = _setting_field("autoscale_max_replicas", "Autoscale up to (replicas; 0: off)")
    autoscale_min_replicas = _setting_field("autoscale_min_replicas", "Autoscale down to (replicas)")
    autoscale_target_in_flight = _setting_field("autoscale_target_in_flight", "Requests in flight per replica")
    autoscale_down_after_s = _setting_field("autoscale_down_after_s", "Scale down after (s of less load)")


@admin.action(description="Edit fairness, sleep and autoscale settings…")
def edit_settings(admin_view: admin.ModelAdmin, request: HttpRequest, queryset: QuerySet[Deployment]):
    names = list(queryset.values_list("name", flat=True))
    form = SettingsForm(request.POST if "apply" in request.POST else None)
    if "apply" in request.POST and form.is_valid():
        changes = {k: v for k, v in form.cleaned_data.items() if v is not None}

        def act(name: str) -> str:
            deployment_services.update(name, changes, by=request.user.get_username())
            return f"{name}: settings saved" if changes else f"{name}: nothing to change"

        report_each(admin_view, request, names, act)
        for warning in deployment_services.popular_warnings():
            admin_view.message_user(request, warning, messages.WARNING)
        return None
    return form_page(
        admin_view, request, form, names, action="edit_settings", title="Edit fairness, sleep and autoscale settings",
        submit="Save", intro="Blank fields stay as they are. Change",
    )  # fmt: skip


@admin.action(description="Evict selected deployments to the CPU cache")
def evict_deployments(admin_view: admin.ModelAdmin, request: HttpRequest, queryset: QuerySet[Deployment]) -> None:
    def act(name: str) -> str:
        evicted = deployment_services.evict(name, reason=f"evicted by {request.user} (admin)")
        return f"{name}: {len(evicted)} serving replica(s) going to sleep"

    report_each(admin_view, request, queryset.values_list("name", flat=True), act)


@admin.action(description="Retry selected deployments (clear failed loads and start what they lack)")
def retry_deployments(admin_view: admin.ModelAdmin, request: HttpRequest, queryset: QuerySet[Deployment]) -> None:
    def act(name: str) -> str:
        deployment = deployment_services.retry(name, reason=f"retried by {request.user} (admin)")
        return f"{name}: load failures cleared; {deployment.replicas_wanted} replica(s) wanted"

    report_each(admin_view, request, queryset.values_list("name", flat=True), act)


@admin.action(description="Restart selected deployments (every replica replaced, one at a time)")
def restart_deployments(admin_view: admin.ModelAdmin, request: HttpRequest, queryset: QuerySet[Deployment]) -> None:
    def act(name: str) -> str:
        rollouts.restart(name, by=f"{request.user} (admin)")
        return f"{name}: rolling restart under way; the dashboard and the events show each step"

    report_each(admin_view, request, queryset.values_list("name", flat=True), act)


@admin.action(description="Roll back selected deployments' settings to the revision before")
def roll_back_deployments(admin_view: admin.ModelAdmin, request: HttpRequest, queryset: QuerySet[Deployment]) -> None:
    def act(name: str) -> str:
        done = deployment_services.rollback(name, by=f"{request.user} (admin)")
        if done.revision is None:
            return f"{name}: its settings are revision {done.to.number}'s already"
        changed = revisions.described(done.changes)
        return f"{name}: rolled back to revision {done.to.number} (now revision {done.revision.number}): {changed}"

    report_each(admin_view, request, queryset.values_list("name", flat=True), act)


@admin.action(description="Switch over selected failover deployments (standby takes over)")
def switch_over_deployments(admin_view: admin.ModelAdmin, request: HttpRequest, queryset: QuerySet[Deployment]) -> None:
    def act(name: str) -> str:
        stepping_down = failover_services.switchover(name, reason=f"planned switchover by {request.user} (admin)")
        return f"{name}: {len(stepping_down)} active replica(s) draining; their standbys take over"

    report_each(admin_view, request, queryset.values_list("name", flat=True), act)


@admin.action(description="Evict selected replicas to the CPU cache")
def evict_replicas(
    admin_view: admin.ModelAdmin, request: HttpRequest, queryset: QuerySet[Replica]
) -> HttpResponse | None:
    def act(replica_id: str) -> str:
        replica = replica_services.evict(replica_id, reason=f"evicted by {request.user} (admin)")
        return f"{replica}: going to sleep"

    report_each(admin_view, request, queryset.values_list("id", flat=True), act)
    return None


@admin.action(description="Put selected deployments to sleep")
def sleep_deployments(admin_view: admin.ModelAdmin, request: HttpRequest, queryset: QuerySet[Deployment]) -> None:
    def act(name: str) -> str:
        slept = sleep_services.sleep_deployment(name, reason=f"put to sleep by {request.user} (admin)")
        return f"{name}: {len(slept)} serving replica(s) going to sleep"

    report_each(admin_view, request, queryset.values_list("name", flat=True), act)


@admin.action(description="Wake selected deployments")
def wake_deployments(admin_view: admin.ModelAdmin, request: HttpRequest, queryset: QuerySet[Deployment]) -> None:
    def act(name: str) -> str:
        woken = sleep_services.wake_deployment(name, reason=f"woken by {request.user} (admin)")
        if woken:
            return f"{name}: waking {len(woken)} replica(s)"
        if sleep_services.awake_enough(name):
            return f"{name}: already awake"
        # Nothing placed and not awake: another wake holds the lock of the GPU it needs.
        return f"{name}: waiting for another wake's lock on the GPU it needs; it retries by itself"

    report_each(admin_view, request, queryset.values_list("name", flat=True), act)


@admin.action(description="Put selected replicas to sleep")
def sleep_replicas(admin_view: admin.ModelAdmin, request: HttpRequest, queryset: QuerySet[Replica]) -> None:
    def act(replica_id: str) -> str:
        replica = sleep_services.sleep_replica(replica_id, reason=f"put to sleep by {request.user} (admin)")
        return f"{replica}: going to sleep"

    report_each(admin_view, request, queryset.values_list("id", flat=True), act)


@admin.action(description="Wake selected replicas")
def wake_replicas(admin_view: admin.ModelAdmin, request: HttpRequest, queryset: QuerySet[Replica]) -> None:
    def act(replica_id: str) -> str:
        replica = sleep_services.wake_replica(replica_id, reason=f"woken by {request.user} (admin)")
        return f"{replica}: waking on {replica.node}"

    report_each(admin_view, request, queryset.values_list("id", flat=True), act)


def issue_and_show(admin_view: admin.ModelAdmin, request: HttpRequest, node: str) -> NodeCredential:
    """The node's credential issued, and its token shown in a message: the only time it is."""
    token = node_credentials.issue(node, f"{request.user} (admin)")
    admin_view.message_user(
        request,
        f"node {node}'s token, shown only this once: {token} (pass it to its agent in a 0600 file named by "
        "GPUPORTAL_NODE_TOKEN_FILE; a previous token of the node is refused from now on)",
        messages.WARNING,
    )
    return NodeCredential.objects.get(node=node)


@admin.action(description="Issue a new token for selected nodes (their current one is refused from then on)")
def issue_node_credentials(
    admin_view: admin.ModelAdmin, request: HttpRequest, queryset: QuerySet[NodeCredential]
) -> None:
    for node in queryset.values_list("node", flat=True):
        try:
            issue_and_show(admin_view, request, node)
        except ServiceError as err:
            admin_view.message_user(request, f"{node}: {err}", messages.ERROR)


@admin.action(description="Revoke selected credentials (their nodes are written off)")
def revoke_node_credentials(
    admin_view: admin.ModelAdmin, request: HttpRequest, queryset: QuerySet[NodeCredential]
) -> None:
    def act(node: str) -> str:
        node_credentials.revoke(node, f"{request.user} (admin)", "revoked from the admin")
        return f"{node}: credential revoked; its calls are refused and its replicas are replaced elsewhere"

    report_each(admin_view, request, queryset.values_list("node", flat=True), act)


@admin.action(description="Remove selected offline nodes (retired hosts): their GPUs leave the books")
def remove_nodes(admin_view: admin.ModelAdmin, request: HttpRequest, queryset: QuerySet[Node]) -> None:
    def act(node: str) -> str:
        gpus = node_services.remove(node, by=f"{request.user} (admin)")
        return f"{node}: removed, with its {gpus} GPU(s)"

    report_each(admin_view, request, queryset.order_by("name").values_list("name", flat=True), act)

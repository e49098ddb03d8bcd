"""The dashboard's controls: each beside what it acts on, each a POST (CSRF-protected)
that calls a service, which plans, commits and records the Event; the outcome comes back as an
admin message after a redirect. Destructive ones ask first (a confirmation page when the form did
not say `confirm=yes`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.shortcuts import render
from django.urls import reverse
from django.views.decorators.http import require_POST

from gpuportal.wire import deployment_spec, node_labels
from scheduling.api.inputs import DeploymentInput
from scheduling.models import Deployment
from scheduling.services import deployments as deployment_services
from scheduling.services import failover as failover_services
from scheduling.services import node_marks, rollouts
from scheduling.services import nodes as node_services
from scheduling.services import replicas as replica_services
from scheduling.services import requests as request_services
from scheduling.services import sleep as sleep_services
from scheduling.services.errors import InvalidInput, ServiceError
from scheduling.web.dashboard import render_page, staff_only


def _confirmed(request: HttpRequest) -> bool:
    return request.POST.get("confirm") == "yes"


def _confirm_page(request: HttpRequest, question: str) -> HttpResponse:
    """Server-side confirmation of a destructive control (the JS confirm() skips it by sending
    confirm=yes): the same form again, with the answer."""
    fields = [(k, v) for k, v in request.POST.items() if k not in ("csrfmiddlewaretoken", "confirm")]
    ctx = {**admin.site.each_context(request), "title": "Confirm", "question": question, "fields": fields}
    return render(request, "admin/scheduling/dashboard_confirm.html", ctx)


def _run(request: HttpRequest, act: Callable[[], str]) -> HttpResponse:
    try:
        messages.success(request, act())
    except ServiceError as err:
        messages.error(request, f"Refused: {err}")
    return HttpResponseRedirect(reverse("admin:scheduling_dashboard"))


def _who(request: HttpRequest) -> str:
    return f"{request.user} (dashboard)"


REPLICA_ACTIONS = {"sleep", "wake", "evict"}


@require_POST
@staff_only
def replica(request: HttpRequest, replica_id: str, action: str) -> HttpResponse:
    if action not in REPLICA_ACTIONS:
        raise PermissionDenied(f"no replica control named {action!r}")
    if action == "evict" and not _confirmed(request):
        return _confirm_page(request, f"Evict replica {replica_id[:8]} to the CPU cache?")

    def act() -> str:
        if action == "sleep":
            replica = sleep_services.sleep_replica(replica_id, reason=f"put to sleep by {_who(request)}")
            return f"{replica}: going to sleep"
        if action == "wake":
            replica = sleep_services.wake_replica(replica_id, reason=f"woken by {_who(request)}")
            return f"{replica}: waking on {replica.node}"
        replica = replica_services.evict(replica_id, reason=f"evicted by {_who(request)}")
        return f"{replica}: evicted, going to sleep"

    return _run(request, act)


@require_POST
@staff_only
def cancel_request(request: HttpRequest, request_id: str) -> HttpResponse:
    if not _confirmed(request):
        return _confirm_page(request, f"Cancel request {request_id[:12]}? Its answer so far is kept; no more is made.")

    def act() -> str:
        ended = request_services.cancel(request_id, user_id=str(request.user.pk), staff=True)
        if ended.status != "cancelled":
            return f"request {request_id[:12]}: asked to stop; still {ended.status}"
        usage = ended.output.get("usage") if isinstance(ended.output, dict) else None
        if usage:
            return f"request {request_id[:12]}: stopped after {usage.get('completion_tokens', 0)} token(s)"
        return f"request {request_id[:12]}: cancelled before it ran"

    return _run(request, act)


@require_POST
@staff_only
def scale(request: HttpRequest, name: str) -> HttpResponse:
    try:
        wanted = int(request.POST.get("replicas", ""))
    except ValueError:
        messages.error(request, f"{name}: replicas must be a whole number")
        return HttpResponseRedirect(reverse("admin:scheduling_dashboard"))
    current = Deployment.objects.filter(name=name).values_list("replicas_wanted", flat=True).first()
    if current is not None and wanted < current and not _confirmed(request):
        return _confirm_page(request, f"Scale {name} down from {current} to {wanted} replica(s)? Replicas stop.")

    def act() -> str:
        deployment_services.scale(name, wanted, reason=f"scaled by {_who(request)}")
        return f"{name}: scaled to {wanted} replica(s)"

    return _run(request, act)


@require_POST
@staff_only
def switchover(request: HttpRequest, name: str) -> HttpResponse:
    if not _confirmed(request):
        return _confirm_page(request, f"Switch over {name}? Its active replicas drain and their standbys take over.")

    def act() -> str:
        stepping_down = failover_services.switchover(name, reason=f"planned switchover by {_who(request)}")
        return f"{name}: {len(stepping_down)} active replica(s) draining; their standbys take over"

    return _run(request, act)


@require_POST
@staff_only
def restart(request: HttpRequest, name: str) -> HttpResponse:
    if not _confirmed(request):
        return _confirm_page(
            request,
            f"Restart {name}? Each replica is replaced by a new one, one at a time, serving throughout; "
            "sleepers are parked and load anew at their next wake.",
        )

    def act() -> str:
        rollouts.restart(name, by=_who(request))
        return f"{name}: rolling restart under way; the deployment shows how far it is and the events each step"

    return _run(request, act)


@require_POST
@staff_only
def drain(request: HttpRequest, name: str) -> HttpResponse:
    move = request.POST.get("move") == "yes"
    if not _confirmed(request):
        if move:
            question = "each serving replica is replaced on another node, then stops"
        else:
            question = "its serving replicas go to sleep"
        return _confirm_page(request, f"Drain node {name}? No new placements; {question}.")

    def act() -> str:
        done = node_services.drain(name, reason=f"drained by {_who(request)}", move=move)
        moving = f"{len(done.moving)} moving to other nodes, " if move else ""
        return f"node {name}: draining; {moving}{len(done.asleep)} serving replica(s) going to sleep"

    return _run(request, act)


@require_POST
@staff_only
def undrain(request: HttpRequest, name: str) -> HttpResponse:
    def act() -> str:
        node_services.undrain(name, reason=f"returned to service by {_who(request)}")
        return f"node {name}: back in service"

    return _run(request, act)


@require_POST
@staff_only
def marks(request: HttpRequest, name: str) -> HttpResponse:
    """The labels and taints operators set on a node, as its form lists them: those it leaves out
    are removed (the agent's own stay)."""

    def act() -> str:
        wanted = {}
        for what in node_marks.MARKS:
            try:
                wanted[what] = node_labels.parse(request.POST.get(what, ""), taints=what == "taints")
            except ValueError as err:
                raise InvalidInput(what, str(err)) from None
        node = node_marks.change(name, **wanted, by=_who(request), whole=True)
        shown = (f"{what} {node_labels.text(getattr(node, what)) or 'none'}" for what in node_marks.MARKS)
        return f"node {name}: " + ", ".join(shown)

    return _run(request, act)


MiB = 1024**2
# The form's fields: the name and the settings it offers (by spec name, the override in MiB),
# and its checkboxes, each a boolean setting.
DEPLOY_FIELDS = ("name", "source", "loader", "dtype", "replicas", "max_tokens", "override_mib")
DEPLOY_FLAGS = ("dedicated", "spread", "standby")


@require_POST
@staff_only
def deploy(request: HttpRequest) -> HttpResponse:
    """A deploy from the page's form, validated by the API's own serializer (the same 400s, named
    the same way) and made by the same service; a refusal shows the form again as it was typed."""
    typed = {key: request.POST.get(key, "").strip() for key in DEPLOY_FIELDS}
    typed.update({flag: "on" for flag in DEPLOY_FLAGS if request.POST.get(flag)})
    body, errors = _deploy_body(typed)
    if not errors:
        data = DeploymentInput(data=body)
        if data.is_valid():
            try:
                deployment = deployment_services.create(data.to_spec(), by=request.user.get_username())
            except ServiceError as err:
                errors = [f"Refused: {err}"]
            else:
                messages.success(request, f"{deployment.name}: deployed, {deployment.replicas_wanted} replica(s)")
                return HttpResponseRedirect(reverse("admin:scheduling_dashboard"))
        else:
            errors = _named(data.errors)
    return render_page(request, deploy_form=typed, deploy_errors=errors)


def _deploy_body(typed: dict[str, str]) -> tuple[dict[str, Any], list[str]]:
    """The form as the API's JSON body, each setting where the spec puts it; the errors of what
    the form alone can tell (a size in MiB)."""
    body: dict[str, Any] = {"name": typed["name"]}
    errors = []

    def put(name: str, value: Any) -> None:
        setting = deployment_spec.BY_NAME[name]
        (body.setdefault(setting.group, {}) if setting.group else body)[setting.key] = value

    for name in ("source", "loader", "dtype"):
        put(name, typed[name])
    for name in ("replicas", "max_tokens"):
        if typed[name]:  # left empty: the default
            put(name, typed[name])
    if typed["override_mib"]:
        try:
            put("override_bytes", int(float(typed["override_mib"]) * MiB))
        except ValueError:
            errors.append(
                f"{deployment_spec.BY_NAME['override_bytes'].path}: a number of MiB, or empty to use the estimate"
            )
    for flag in DEPLOY_FLAGS:
        put(flag, flag in typed)
    return body, errors


def _named(errors: Any, prefix: str = "") -> list[str]:
    """DRF's nested errors as "model.source: message" lines, as the API names them."""
    if isinstance(errors, dict):
        return [line for key, value in errors.items() for line in _named(value, f"{prefix}{key}.")]
    if isinstance(errors, list):
        return [line for value in errors for line in _named(value, prefix)]
    return [f"{prefix.rstrip('.')}: {errors}"]


@require_POST
@staff_only
def delete(request: HttpRequest, name: str) -> HttpResponse:
    if not _confirmed(request):
        return _confirm_page(request, f"Delete {name}? Its replicas stop and its reservations are released.")

    def act() -> str:
        deployment_services.delete(name, reason=f"deleted by {_who(request)}")
        return f"{name}: deleted"

    return _run(request, act)

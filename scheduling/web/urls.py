"""The dashboard's pages and its controls, in one URL list (the controls build on the pages'
module for their access check, so neither module lists the other's views)."""

from __future__ import annotations

from django.urls import path

from scheduling.web import controls
from scheduling.web.dashboard import fragment, page


def urls() -> list:
    """Mounted under /admin/dashboard/ by scheduling.admin (before the admin's own catch-all), so
    the names are in the admin namespace."""
    return [
        path("", page, name="scheduling_dashboard"),
        path("fragment/", fragment, name="scheduling_dashboard_fragment"),
        path("replicas/<str:replica_id>/<slug:action>/", controls.replica, name="scheduling_dashboard_replica"),
        path("requests/<str:request_id>/cancel/", controls.cancel_request, name="scheduling_dashboard_cancel"),
        path("deployments/", controls.deploy, name="scheduling_dashboard_deploy"),
        path("deployments/<slug:name>/scale/", controls.scale, name="scheduling_dashboard_scale"),
        path("deployments/<slug:name>/delete/", controls.delete, name="scheduling_dashboard_delete"),
        path("deployments/<slug:name>/switchover/", controls.switchover, name="scheduling_dashboard_switchover"),
        path("deployments/<slug:name>/restart/", controls.restart, name="scheduling_dashboard_restart"),
        # A node's name may hold dots (a host's, `ip-10-0-1-2.ec2.internal`), which a slug does not.
        path("nodes/<str:name>/drain/", controls.drain, name="scheduling_dashboard_drain"),
        path("nodes/<str:name>/undrain/", controls.undrain, name="scheduling_dashboard_undrain"),
        path("nodes/<str:name>/marks/", controls.marks, name="scheduling_dashboard_marks"),
    ]

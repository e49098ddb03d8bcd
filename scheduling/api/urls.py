"""Routes under /api/ (mounted by gpuportal.urls)."""

from django.urls import path
from rest_framework.routers import DefaultRouter

from scheduling.api import plans, pulls, requests, traffic, views

router = DefaultRouter()
router.register("nodes", views.NodeViewSet, basename="node")
router.register("gpus", views.GPUViewSet, basename="gpu")
router.register("deployments", views.DeploymentViewSet, basename="deployment")
router.register("replicas", views.ReplicaViewSet, basename="replica")
router.register("events", views.EventViewSet, basename="event")

urlpatterns = [
    path("auth/token/", views.ObtainTokenView.as_view(), name="auth-token"),
    path("deployments/<slug:name>/infer/", requests.InferView.as_view(), name="deployment-infer"),
    path("requests/", requests.RequestListView.as_view(), name="request-list"),
    path("requests/<str:pk>/", requests.RequestDetailView.as_view(), name="request-detail"),
    path("traffic/", traffic.TrafficView.as_view(), name="traffic"),
    path("plan/", plans.PlanView.as_view(), name="plan"),
    path("plan/<int:pk>/", plans.PlanDetailView.as_view(), name="plan-detail"),
    path("models/pull/", pulls.PullView.as_view(), name="model-pull"),
    path("models/pulls/<slug:pk>/", pulls.PullDetailView.as_view(), name="model-pull-detail"),
    *router.urls,
]

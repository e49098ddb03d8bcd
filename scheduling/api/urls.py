"""Routes under /api/ (mounted by gpuportal.urls)."""

from django.urls import path
from rest_framework.routers import DefaultRouter

from scheduling.api import views

router = DefaultRouter()
router.register("nodes", views.NodeViewSet, basename="node")
router.register("gpus", views.GPUViewSet, basename="gpu")
router.register("deployments", views.DeploymentViewSet, basename="deployment")
router.register("replicas", views.ReplicaViewSet, basename="replica")
router.register("events", views.EventViewSet, basename="event")

urlpatterns = [
    path("auth/token/", views.ObtainTokenView.as_view(), name="auth-token"),
    *router.urls,
]

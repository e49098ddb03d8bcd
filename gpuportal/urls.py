from django.contrib import admin
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView
from rest_framework.permissions import IsAuthenticated

from gpuportal import health, metrics
from scheduling.api import openai_compat

# drf-spectacular serves the schema to anyone by default; here it sits behind the API's own
# auth like the rest of /api/ (a logged-in admin session is enough for the docs page).
api_docs_auth = {"permission_classes": [IsAuthenticated]}

urlpatterns = [
    path("admin/", admin.site.urls),
    path("api/schema/", SpectacularAPIView.as_view(**api_docs_auth), name="schema"),
    path("api/docs/", SpectacularSwaggerView.as_view(url_name="schema", **api_docs_auth), name="docs"),
    path("api/", include("scheduling.api.urls")),
    path("v1/models", openai_compat.ModelsView.as_view(), name="openai-models"),
    path("v1/completions", openai_compat.CompletionsView.as_view(), name="openai-completions"),
    path("v1/chat/completions", openai_compat.ChatCompletionsView.as_view(), name="openai-chat"),
    path("healthz", health.healthz, name="healthz"),
    path("readyz", health.readyz, name="readyz"),
    path("metrics", metrics.metrics, name="metrics"),
]

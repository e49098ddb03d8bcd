from collections.abc import Callable
from typing import Any

from django.contrib import admin
from django.contrib.auth.views import redirect_to_login
from django.http import HttpRequest, HttpResponse
from django.urls import include, path, reverse
from django.views.generic import RedirectView
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView
from rest_framework.permissions import IsAuthenticated

from gpuportal import health
from scheduling import gauges
from scheduling.api import (
    lora_adapters,
    messages,
    ollama,
    ollama_models,
    openai_compat,
    rerank,
    response_detail,
    response_items,
    responses,
    tokens,
)

# drf-spectacular serves the schema to anyone by default; here it sits behind the API's own
# auth like the rest of /api/ (a logged-in admin session is enough for the docs page).
api_docs_auth = {"permission_classes": [IsAuthenticated]}


def login_first_in_a_browser(view: Callable[..., HttpResponse]) -> Callable[..., HttpResponse]:
    """A browser with no session is sent to the admin's login and back, not shown a JSON 401;
    an API client (a token, or no HTML in Accept) still gets the 401."""

    def browsing(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        wants_html = "text/html" in request.headers.get("Accept", "")
        if wants_html and "Authorization" not in request.headers and not request.user.is_authenticated:
            return redirect_to_login(request.get_full_path(), reverse("admin:login"))
        return view(request, *args, **kwargs)

    return browsing


# A GPU chip, drawn once: what a browser's tab shows, and what it asks /favicon.ico for on every
# first visit (a 404 each time, logged as a warning in up's console).
FAVICON = (
    '<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 16 16">'
    '<rect x="3" y="3" width="10" height="10" rx="1" fill="#2f6f4f"/>'
    '<path d="M5 1v2M8 1v2M11 1v2M5 13v2M8 13v2M11 13v2M1 5h2M1 8h2M1 11h2M13 5h2M13 8h2M13 11h2" '
    'stroke="#2f6f4f" stroke-width="1.2"/></svg>'
)


def favicon(request: HttpRequest) -> HttpResponse:
    response = HttpResponse(FAVICON, content_type="image/svg+xml")
    response["Cache-Control"] = "public, max-age=86400"
    return response


urlpatterns = [
    path("favicon.ico", favicon, name="favicon"),
    # A browser's first page: the dashboard (the admin sends one without a session to its login).
    path("", RedirectView.as_view(pattern_name="admin:scheduling_dashboard"), name="home"),
    path("admin/", admin.site.urls),
    path("api/schema/", login_first_in_a_browser(SpectacularAPIView.as_view(**api_docs_auth)), name="schema"),
    path(
        "api/docs/",
        login_first_in_a_browser(SpectacularSwaggerView.as_view(url_name="schema", **api_docs_auth)),
        name="docs",
    ),
    # Ollama's own API, beside the portal's under /api/ (none of its paths is one of the portal's).
    path("api/chat", ollama.OllamaChatView.as_view(), name="ollama-chat"),
    path("api/generate", ollama.OllamaGenerateView.as_view(), name="ollama-generate"),
    path("api/embed", ollama_models.EmbedView.as_view(), name="ollama-embed"),
    path("api/embeddings", ollama_models.LegacyEmbeddingsView.as_view(), name="ollama-embeddings"),
    path("api/tags", ollama_models.TagsView.as_view(), name="ollama-tags"),
    path("api/ps", ollama_models.RunningView.as_view(), name="ollama-ps"),
    path("api/show", ollama_models.ShowView.as_view(), name="ollama-show"),
    path("api/version", ollama_models.VersionView.as_view(), name="ollama-version"),
    path("api/", include("scheduling.api.urls")),
    path("v1/models", openai_compat.ModelsView.as_view(), name="openai-models"),
    path("v1/load_lora_adapter", lora_adapters.LoadLoraAdapterView.as_view(), name="vllm-load-lora"),
    path("v1/unload_lora_adapter", lora_adapters.UnloadLoraAdapterView.as_view(), name="vllm-unload-lora"),
    # A path, not a slug: a name with a slash (`org/name`) gets OpenAI's 404, not Django's page.
    path("v1/models/<path:model>", openai_compat.ModelView.as_view(), name="openai-model"),
    path("v1/completions", openai_compat.CompletionsView.as_view(), name="openai-completions"),
    path("v1/chat/completions", openai_compat.ChatCompletionsView.as_view(), name="openai-chat"),
    path("v1/embeddings", openai_compat.EmbeddingsView.as_view(), name="openai-embeddings"),
    # Jina's and vLLM's path, and Cohere's (its client posts to /v2/rerank), in one shape.
    path("v1/rerank", rerank.RerankView.as_view(), name="rerank"),
    path("v2/rerank", rerank.RerankView.as_view(), name="rerank-v2"),
    path("rerank", rerank.RerankView.as_view(), name="rerank-unversioned"),
    path("v1/score", rerank.ScoreView.as_view(), name="score"),
    path("score", rerank.ScoreView.as_view(), name="score-unversioned"),
    path("v1/responses", responses.ResponsesView.as_view(), name="openai-responses"),
    path("v1/messages", messages.MessagesView.as_view(), name="anthropic-messages"),
    path("v1/messages/count_tokens", messages.CountTokensView.as_view(), name="anthropic-count-tokens"),
    path("tokenize", tokens.TokenizeView.as_view(), name="tokenize"),
    path("detokenize", tokens.DetokenizeView.as_view(), name="detokenize"),
    path("v1/responses/<str:response_id>", response_detail.ResponseDetailView.as_view(), name="openai-response"),
    path(
        "v1/responses/<str:response_id>/cancel",
        response_detail.ResponseCancelView.as_view(),
        name="openai-response-cancel",
    ),
    path(
        "v1/responses/<str:response_id>/input_items",
        response_items.InputItemsView.as_view(),
        name="openai-response-input-items",
    ),
    path("healthz", health.healthz, name="healthz"),
    path("readyz", health.readyz, name="readyz"),
    path("metrics", gauges.metrics, name="metrics"),
]

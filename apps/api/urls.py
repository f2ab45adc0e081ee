from django.urls import path, re_path

from apps.api import model_views, views
from apps.api.responses.views import response_detail
from apps.api.schemas import openapi
from apps.api.tokenize import views as tokenize_views

urlpatterns = [
    path("health", views.health),
    path("openapi.json", openapi.openapi_view),
    path("v1/models", views.models_list),
    path("v1/tokenize", tokenize_views.tokenize),
    path("v1/detokenize", tokenize_views.detokenize),
    path("v1/models/switch", model_views.models_switch),
    path("v1/models/<path:model_id>", views.model_detail),
    path("v1/config", model_views.config_view),
    path("v1/catalog", model_views.catalog_list),
    path("v1/catalog/download", model_views.catalog_download),
    path("v1/catalog/import", model_views.catalog_import),
    path("v1/responses/<str:response_id>", response_detail),
    re_path(r"^(?P<path>v1/.*)$", views.not_found),
]

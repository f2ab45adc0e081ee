from django.urls import path, re_path

from apps.api import views

urlpatterns = [
    path("health", views.health),
    path("v1/models", views.models_list),
    path("v1/tokenize", views.tokenize),
    path("v1/detokenize", views.detokenize),
    re_path(r"^(?P<path>v1/.*)$", views.not_found),
]

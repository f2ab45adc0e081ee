from django.urls import path
from django.views.generic import RedirectView
from django.views.static import serve

from apps.playground import views

urlpatterns = [
    path("", RedirectView.as_view(url="/ui/")),
    path("ui", RedirectView.as_view(url="/ui/")),
    path("ui/", views.index, name="playground"),
    path("ui/api/monitor", views.monitor),
    path("ui/static/<path:path>", serve, {"document_root": views.STATIC_DIR}),
]

from django.contrib import admin
from django.urls import include, path

urlpatterns = [
    path("admin/", admin.site.urls),
    path("", include("apps.api.urls")),
    path("", include("apps.playground.urls")),
]

handler404 = "apps.api.views.handler404"
handler500 = "apps.api.views.handler500"

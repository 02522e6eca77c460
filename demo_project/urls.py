"""URLs of the demo site: the admin, and the demo pages of the ``shop`` app."""

from __future__ import annotations

from django.contrib import admin
from django.urls import include, path

urlpatterns = [
    path("admin/", admin.site.urls),
    path("", include("demo_project.shop.urls")),
]

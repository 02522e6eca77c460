from __future__ import annotations

from django.urls import path

from demo_project.shop import views

app_name = "shop"

urlpatterns = [
    path("", views.index, name="index"),
    path("invoices/", views.invoice_list, name="invoices"),
    path("invoices/new/", views.invoice_create, name="invoice_create"),
    path("invoices/<int:pk>/", views.invoice_detail, name="invoice"),
    path("invoices/<int:pk>/charge/", views.invoice_charge, name="invoice_charge"),
    path("invoices/<int:pk>/reset/", views.invoice_reset, name="invoice_reset"),
    path("locks/", views.locks, name="locks"),
    path("locks/table/", views.locks_table, name="locks_table"),
    path("locks/hold/", views.locks_hold, name="locks_hold"),
    path("fencing/", views.fencing, name="fencing"),
    path("lock-many/", views.lock_many_view, name="lock_many"),
    path("fenced/", views.fenced, name="fenced"),
    path("celery/", views.celery_page, name="celery"),
    path("celery/table/", views.celery_table, name="celery_table"),
    path("celery/imports/", views.celery_imports, name="celery_imports"),
    path("celery/import/", views.celery_import, name="celery_import"),
]

"""The Celery app: downloads and imports run here, never on the request path."""

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "ignis_site.settings")

app = Celery("ignis")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()

"""The Celery app: downloads and imports run here, never on the request path.

The worker logs through Django's ``LOGGING`` (the same JSON or text stream as
the server) instead of setting up its own: ``setup_logging`` has a receiver, so
Celery leaves logging alone. ``serve`` starts it with ``--quiet`` (no banner);
``worker_ready`` says the one line the banner would have.
"""

import logging
import logging.config
import os

from celery import Celery
from celery.signals import setup_logging, worker_ready

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "ignis_site.settings")

app = Celery("ignis")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


@setup_logging.connect
def _logging_from_django(**kwargs) -> None:
    from django.conf import settings

    logging.config.dictConfig(settings.LOGGING)


@worker_ready.connect
def _ready(sender=None, **kwargs) -> None:
    hostname = getattr(getattr(sender, "controller", None), "hostname", None) or getattr(sender, "hostname", None)
    logging.getLogger("ignis.celery").info(
        "ignis.celery.ready", extra={"worker": str(hostname), "broker": app.conf.broker_url.split("://", 1)[0]}
    )

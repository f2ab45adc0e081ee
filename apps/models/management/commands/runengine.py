"""Run the engine in its own process against the Redis channel layer (scaled mode)."""

import asyncio
import logging

from channels.layers import get_channel_layer
from django.core.management.base import BaseCommand

from apps.models.management.commands._options import add_config_flags, apply_config_flags
from apps.models.services import served_model
from engine.config import EngineConfig
from engine.worker import EngineWorker
from ignis_site.config import engine_config_dict, worker_options

log = logging.getLogger("ignis.engine")


class Command(BaseCommand):
    help = "Run the ignis engine loop (one per GPU) against the configured Channels layer."

    def add_arguments(self, parser):
        add_config_flags(parser)

    def handle(self, *args, **options):
        values = apply_config_flags(options)
        served = served_model()
        worker = EngineWorker(
            get_channel_layer(),
            EngineConfig.from_dict(engine_config_dict(values)),
            served.path,
            served.served_id,
            **worker_options(values),
        )
        # Not "serving" yet: the load runs inside worker.run(); it logs ignis.model.loaded when done.
        log.info("ignis.engine.starting", extra={"model": served.served_id, "path": str(served.path)})
        try:
            asyncio.run(worker.run())
        except KeyboardInterrupt:
            pass

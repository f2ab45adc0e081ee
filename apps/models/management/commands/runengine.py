"""Run the engine in its own process against the Redis channel layer (scaled mode).

With ``--worker-id ID`` (IGNIS_SERVER_WORKER_ID) the worker is one of a fleet
(docs/FLEET.md): it takes its messages from ``ignis.engine.<ID>`` and front ends
route to it by the model it announces. Pick the GPU per process with
``CUDA_VISIBLE_DEVICES``. SIGTERM (or Ctrl-C) drains: nothing new is admitted,
running requests get ``switch.drain_timeout`` seconds to finish, then it exits.
"""

import asyncio
import logging
import signal

from channels.layers import get_channel_layer
from django.core.management.base import BaseCommand, CommandError

from apps.models.management.commands._options import (
    add_config_flags,
    apply_config_flags,
    gc_freeze,
    switch_interval,
)
from apps.models.services import served_model
from engine.config import EngineConfig
from engine.messages import worker_id_check
from engine.worker import EngineWorker
from ignis_site.config import engine_config_dict, worker_options

log = logging.getLogger("ignis.engine")


class Command(BaseCommand):
    help = "Run the ignis engine loop (one per GPU) against the configured Channels layer."

    def add_arguments(self, parser):
        parser.add_argument(
            "--worker-id",
            dest="server.worker_id",
            default=None,
            metavar="STR",
            help="alias of --server-worker-id: this worker's id in a fleet [IGNIS_SERVER_WORKER_ID]",
        )
        add_config_flags(parser, skip=("server.worker_id",))

    def handle(self, *args, **options):
        values = apply_config_flags(options)
        switch_interval(values)
        if values["server.worker_id"]:
            try:
                worker_id_check(values["server.worker_id"])
            except ValueError as exc:
                raise CommandError(str(exc)) from None
        served = served_model()
        worker = EngineWorker(
            get_channel_layer(),
            EngineConfig.from_dict(engine_config_dict(values)),
            served.path,
            served.served_id,
            beats_before_first_tokens=True,  # its own process: front ends may outlive it
            **worker_options(values),
        )
        # Not "serving" yet: the load runs inside worker.run(); it logs ignis.model.loaded when done.
        log.info(
            "ignis.engine.starting",
            extra={"model": served.served_id, "path": str(served.path), "worker_id": worker.worker_id},
        )
        gc_freeze(values)  # and again once the model is loaded (engine/gc_pause.py)
        asyncio.run(serve_until_drained(worker))
        log.info("ignis.engine.stopped", extra={"worker_id": worker.worker_id})


EXIT_GRACE = 10.0  # seconds the interpreter gets to wind down after a drain before the process ends anyway


def _exit_soon() -> None:
    """A drained worker exits: should tearing down the loop, the layer or the step thread hang
    (a step still running on a starved machine), the process ends after EXIT_GRACE seconds anyway."""
    import os
    import threading

    def force() -> None:
        log.warning("ignis.engine.forced_exit", extra={"after": EXIT_GRACE})
        logging.shutdown()
        os._exit(0)

    timer = threading.Timer(EXIT_GRACE, force)
    timer.daemon = True
    timer.start()


async def serve_until_drained(worker: EngineWorker) -> None:
    """Run ``worker`` until SIGTERM or SIGINT has drained it (a second signal ends it at once). The drain
    gets ``switch.drain_timeout`` as it is then (a PATCH changes it live: ``engine.configure``).

    ``drain`` returns once every request the worker took has had its last message sent, so cancelling
    the loop then drops nothing a client waits for."""
    loop = asyncio.get_running_loop()
    run = asyncio.ensure_future(worker.run())
    draining: list[asyncio.Task] = []

    def on_signal() -> None:
        if draining:  # asked twice: stop now
            run.cancel()
            return
        draining.append(loop.create_task(worker.drain(worker.host.drain_timeout)))
        draining[0].add_done_callback(lambda _t: (_exit_soon(), run.cancel()))

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    try:
        await run
    except asyncio.CancelledError:
        pass

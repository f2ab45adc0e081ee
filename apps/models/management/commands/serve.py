"""Serve the API, the Playground and the engine from one process (the embedded mode).

Daphne serves the ASGI application; the engine loop runs as a task on
Daphne's own asyncio loop, talking to the API only through the Channels layer.
With ``--server-redis-url`` (or IGNIS_SERVER_REDIS_URL) the engine runs in
``manage.py runengine`` instead, unless ``--with-engine`` is given.
"""

import logging
import os
import sys

from django.conf import settings
from django.core.management.base import BaseCommand

from apps.models.management.commands._options import add_config_flags, apply_config_flags

log = logging.getLogger("ignis.server")


class Command(BaseCommand):
    help = "Serve ignis on --server-host/--server-port (default http://127.0.0.1:8080)."

    def add_arguments(self, parser):
        parser.add_argument("--host", dest="server.host", default=None, help="alias of --server-host")
        parser.add_argument("--port", dest="server.port", default=None, help="alias of --server-port")
        parser.add_argument("--with-engine", action="store_true", help="host the engine here even with Redis")
        parser.add_argument("--no-download", action="store_true", help="fail instead of fetching the default model")
        add_config_flags(parser, skip=("server.host", "server.port"))

    def handle(self, *args, **options):
        from channels.layers import get_channel_layer
        from channels.routing import get_default_application
        from daphne.endpoints import build_endpoint_description_strings
        from daphne.server import Server, twisted_loop
        from twisted.internet import reactor

        from apps.models.catalog import artifact_sync
        from apps.models.config_service import config_listen, config_snapshot
        from apps.models.download import DEFAULT_MODEL, ensure_default_model
        from apps.models.engine_state import engine_state_listen
        from apps.models.services import served_model
        from engine.config import EngineConfig
        from engine.worker import EngineWorker
        from ignis_site.config import engine_config_dict, worker_options

        values = apply_config_flags(options)
        if values["model.id"] == DEFAULT_MODEL.served_id and not values["model.path"] and not options["no_download"]:
            self.stdout.write(f"fetching {DEFAULT_MODEL.served_id} into {settings.MODELS_DIR} if absent ...")
            ensure_default_model(settings.MODELS_DIR)
        served = served_model()
        artifact_sync()
        config_snapshot()
        host, port = values["server.host"], values["server.port"]
        embedded = not settings.REDIS_URL or options["with_engine"]
        tasks = []

        def start_engine():
            worker = EngineWorker(
                get_channel_layer(),
                EngineConfig.from_dict(engine_config_dict(values)),
                served.path,
                served.served_id,
                **worker_options(values),
                on_progress=ProgressBar(self.stdout),
            )
            tasks.append(twisted_loop.create_task(worker.run()))

        def ready():
            shown = f"[{host}]" if ":" in host else host
            self.stdout.write(
                f"ignis serving {served.served_id} at http://{shown}:{port}/ "
                f"(engine: {'embedded' if embedded else 'runengine over Redis'})"
            )
            sys.stdout.flush()

        if embedded:
            reactor.callWhenRunning(start_engine)
        # Live config changes other front ends take (scaled mode) reach this one's settings.IGNIS.
        reactor.callWhenRunning(lambda: tasks.append(twisted_loop.create_task(config_listen())))
        # The engine's pushed status (and its heartbeats) feed this front end's cache.
        reactor.callWhenRunning(lambda: tasks.append(twisted_loop.create_task(engine_state_listen())))
        if values["server.celery_worker"]:
            celery = celery_worker_start()
            reactor.addSystemEventTrigger("before", "shutdown", celery_worker_stop, celery)
        from ignis_site.metrics import start_listener  # /metrics on its own loopback listener

        start_listener(values["server.metrics_bind"], twisted_loop, public_port=int(port))
        server = Server(
            application=get_default_application(),
            endpoints=build_endpoint_description_strings(host=host, port=port),
            signal_handlers=True,
            server_name="ignis",
            verbosity=0,
            http_timeout=None,
            websocket_timeout=86400,
            application_close_timeout=10,
            ready_callable=ready,
        )
        server.run()


class ProgressBar:
    """The serve command's load progress bar (tensors of the total), one line per model load."""

    def __init__(self, out, width: int = 30):
        self.out, self.width, self.last = out, width, None

    def __call__(self, served_id: str, done: int, total: int) -> None:
        filled = self.width * done // max(total, 1)
        key = (served_id, filled, done == total)
        if key == self.last:
            return
        self.last = key
        bar = "#" * filled + "." * (self.width - filled)
        self.out.write(f"\rloading {served_id} [{bar}] {done}/{total} tensors", ending="\n" if done == total else "")
        self.out.flush()


def celery_worker_start():
    """The embedded Celery worker (solo pool) that runs downloads and imports; a child of this process."""
    import subprocess

    cmd = [
        sys.executable,
        "-m",
        "celery",
        "-A",
        "ignis_site",
        "worker",
        "--pool=solo",
        "--concurrency=1",
        "--loglevel=WARNING",
        "--without-heartbeat",
        "--without-gossip",
        "--without-mingle",
        "-n",
        f"ignis-embedded-{os.getpid()}@%h",
    ]
    return subprocess.Popen(cmd, cwd=settings.BASE_DIR, env=os.environ.copy())


def celery_worker_stop(proc) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except Exception:
            proc.kill()

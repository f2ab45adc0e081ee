"""Serve the API, the Playground and the engine from one process (the embedded mode).

Daphne serves the ASGI application on the main thread's asyncio loop; the engine
loop runs on a thread and event loop of its own (``EngineThread``), so SSE writes,
detokenizing and JSON for every stream never sit between two engine rounds. The two
talk only through the Channels layer, which embedded is
``ignis_site.channel_layer.CrossLoopChannelLayer`` (safe across the two loops).
With ``--server-redis-url`` (or IGNIS_SERVER_REDIS_URL) the engine runs in
``manage.py runengine`` instead, unless ``--with-engine`` is given.
"""

import asyncio
import logging
import os
import sys
import threading

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from apps.models.management.commands import _front_ends as front_ends
from apps.models.management.commands._options import (
    add_config_flags,
    apply_config_flags,
    config_flags,
    gc_freeze,
    switch_interval,
)
from ignis_site import config

log = logging.getLogger("ignis.server")


class Command(BaseCommand):
    help = "Serve ignis on --server-host/--server-port (default http://127.0.0.1:8080)."

    def add_arguments(self, parser):
        host, port = config.FIELDS["server.host"].default, config.FIELDS["server.port"].default
        parser.add_argument(
            "--host", dest="server.host", default=None, metavar="STR", help=f"alias of --server-host (default: {host})"
        )
        parser.add_argument(
            "--port", dest="server.port", default=None, metavar="INT", help=f"alias of --server-port (default: {port})"
        )
        parser.add_argument("--with-engine", action="store_true", help="host the engine here even with Redis")
        parser.add_argument("--no-download", action="store_true", help="fail instead of fetching the default model")
        add_config_flags(parser, skip=("server.host", "server.port"))

    def handle(self, *args, **options):
        from channels.layers import channel_layers, get_channel_layer
        from channels.routing import get_default_application
        from daphne.endpoints import build_endpoint_description_strings
        from daphne.server import twisted_loop
        from twisted.internet import reactor

        from apps.core.engine_state import engine_state_listen
        from apps.models.catalog import artifact_sync
        from apps.models.config_service import config_listen, config_snapshot
        from apps.models.download import DEFAULT_MODEL, artifact_path, ensure_default_model
        from apps.models.services import served_model
        from engine.config import EngineConfig
        from engine.worker import EngineWorker
        from ignis_site.channel_layer import CrossLoopChannelLayer
        from ignis_site.config import engine_config_dict, worker_options
        from ignis_site.daphne_gate import IgnisServer

        values = apply_config_flags(options)
        switch_interval(values)
        import engine.chat_template  # noqa: F401  (jinja2: imported now, not by the first request)

        if values["model.id"] == DEFAULT_MODEL.served_id and not values["model.path"] and not options["no_download"]:
            if not artifact_path(settings.MODELS_DIR, DEFAULT_MODEL).exists():
                log.info("ignis.server.fetching", extra={"model": DEFAULT_MODEL.served_id, "into": settings.MODELS_DIR})
            ensure_default_model(settings.MODELS_DIR)
        served = served_model()
        artifact_sync()
        config_snapshot()
        host, port = values["server.host"], values["server.port"]
        if values["server.front_ends"] > 1:  # this process only starts and watches the others
            flags = config_flags(options)
            try:
                front_ends.check(values)
            except (ValueError, OSError) as exc:
                raise CommandError(str(exc)) from None
            code = front_ends.run(
                values,
                flags,
                with_engine=options["with_engine"],
                var_dir=settings.VAR_DIR,
                celery=(celery_worker_start, celery_worker_stop),
            )
            if code:
                raise SystemExit(code)
            return
        gc_freeze(values)  # set up: what the process holds now is not the collector's business any more
        endpoints = build_endpoint_description_strings(host=host, port=port)
        if values["server.reuse_port"]:
            try:
                # Daphne adopts the descriptor and closes it itself: detached, Python never closes it twice.
                endpoints = [f"fd:fileno={front_ends.reuse_port_socket(host, port).detach()}"]
            except (ValueError, OSError) as exc:
                raise CommandError(f"server.reuse_port: {exc}") from None
        embedded = not (settings.REDIS_URL or settings.CHANNEL_HUB) or options["with_engine"]
        tasks = []
        layer = get_channel_layer()  # made here, on this thread, before any other thread asks for it

        def make_worker():
            # The in-process layer bridges the two loops; a Redis layer (--with-engine) is one per loop,
            # the engine's own as runengine's is its own process's.
            engine_layer = layer if isinstance(layer, CrossLoopChannelLayer) else channel_layers.make_backend("default")
            return EngineWorker(
                engine_layer,
                EngineConfig.from_dict(engine_config_dict(values)),
                served.path,
                served.served_id,
                **worker_options(values),
                on_progress=ProgressBar(self.stdout) if self.stdout.isatty() else None,
            )

        engine_thread = EngineThread(make_worker, server_loop=twisted_loop)

        def ready():
            # The listener is up; the URL is announced once the model serves (announce_when_serving),
            # by one front end of several.
            if front_ends.front_end_index():
                return
            shown = f"[{host}]" if ":" in host else host
            url = f"http://{shown}:{port}/"
            engine = "embedded" if embedded else "runengine over Redis" if settings.REDIS_URL else "its own process"
            tasks.append(twisted_loop.create_task(announce_when_serving(self.stdout, url, engine)))

        if embedded:
            reactor.callWhenRunning(engine_thread.start)
            # After Daphne's own "before" trigger has ended the open requests (their aborts reach the engine).
            reactor.addSystemEventTrigger("during", "shutdown", engine_thread.stop)
        # Live config changes other front ends take (scaled mode) reach this one's settings.IGNIS.
        reactor.callWhenRunning(lambda: tasks.append(twisted_loop.create_task(config_listen())))
        # The engine's pushed status (and its heartbeats) feed this front end's cache.
        reactor.callWhenRunning(lambda: tasks.append(twisted_loop.create_task(engine_state_listen())))
        if values["server.celery_worker"]:
            celery = celery_worker_start()
            reactor.addSystemEventTrigger("before", "shutdown", celery_worker_stop, celery)
        from apps.core.metrics import start_listener  # /metrics on its own loopback listener

        start_listener(values["server.metrics_bind"], twisted_loop, public_port=int(port))
        from ignis_site import daphne_ws

        daphne_ws.install()  # an oversized WebSocket frame is closed with a reason, not dropped
        ws_limit = daphne_ws.max_message_bytes(settings.IGNIS["server.body_limit"])
        server = IgnisServer(
            application=get_default_application(),
            endpoints=endpoints,
            signal_handlers=True,
            server_name="ignis",
            verbosity=0,
            http_timeout=None,
            websocket_timeout=86400,
            websocket_max_message_size=ws_limit,
            websocket_max_frame_size=ws_limit,
            application_close_timeout=10,
            ready_callable=ready,
        )
        server.run()


class EngineThread:
    """The embedded engine loop on a thread and asyncio loop of its own (docs/ARCHITECTURE.md, Hosting).

    ``make_worker`` builds the EngineWorker on that thread, so everything the worker
    makes belongs to the engine's loop; the worker's step thread stays inside it, as in
    ``runengine``. ``stop`` cancels ``worker.run()`` (whose ``finally`` ends its receive
    and heartbeat tasks and the step thread) and waits for the thread, at most
    ``timeout`` seconds: a step still running holds the process's exit, as it always did.
    """

    NAME = "ignis-engine"

    def __init__(self, make_worker, *, server_loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.make_worker = make_worker
        self.server_loop = server_loop  # Daphne's: said in the start log, to show they differ
        self.loop: asyncio.AbstractEventLoop | None = None
        self.task: asyncio.Task | None = None
        self.thread = threading.Thread(target=self._run, name=self.NAME, daemon=True)
        self._ready = threading.Event()

    def start(self) -> None:
        self.thread.start()
        self._ready.wait()

    def stop(self, timeout: float = 10.0) -> None:
        if self.loop is not None and self.task is not None and not self.loop.is_closed():
            try:
                self.loop.call_soon_threadsafe(self.task.cancel)
            except RuntimeError:  # the loop closed meanwhile: nothing left to cancel
                pass
        if self.thread.is_alive():
            self.thread.join(timeout)

    def _run(self) -> None:
        try:
            asyncio.run(self._serve())  # its end cancels what the worker left and closes the loop
        except asyncio.CancelledError:  # stop()
            pass
        except Exception:
            log.exception("ignis.server.engine_loop_failed")
        finally:
            self._ready.set()

    async def _serve(self) -> None:
        self.loop, self.task = asyncio.get_running_loop(), asyncio.current_task()
        self._ready.set()
        log.info(
            "ignis.server.engine_loop",
            extra={
                "engine_thread": threading.current_thread().name,
                "server_thread": threading.main_thread().name,
                "own_loop": self.loop is not self.server_loop,
            },
        )
        await self.make_worker().run()


async def announce_when_serving(out, url: str, engine: str, interval: float = 0.25) -> None:
    """Print ``ignis serving <model> at <url>`` once the engine says it serves (not when the port opens).

    A failed load is said too (the server stays up: /health answers 503 and the
    next request tries again); an engine that does not answer (scaled mode,
    ``runengine`` not started yet) is waited for, said once.
    """
    import asyncio

    from apps.core.engine_client import engine_status
    from engine.status import EngineState

    said_waiting = said_failed = False
    started = asyncio.get_running_loop().time()
    while True:
        status = await engine_status(timeout=2.0)
        state = status.status if status is not None else None
        if state == EngineState.SERVING:
            log.info("ignis.server.serving", extra={"url": url, "model": status.model, "engine": engine})
            out.write(f"ignis serving {status.model} at {url} (engine: {engine})")
            out.flush()
            return
        if state == EngineState.FAILED and not said_failed:
            said_failed = True
            log.error("ignis.server.model_failed", extra={"url": url, "error": status.error})
        if state is None and not said_waiting and asyncio.get_running_loop().time() - started > 10:
            said_waiting = True
            log.warning("ignis.server.waiting_for_engine", extra={"url": url, "engine": engine})
        await asyncio.sleep(interval)


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
        "--quiet",  # no banner: the worker logs through the server's logging (ignis_site/celery.py)
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
    # Its log goes to stderr through Django's LOGGING; stdout carries only Celery's own prints
    # ("worker: Warm shutdown" at stop), which are not part of the one log stream.
    return subprocess.Popen(cmd, cwd=settings.BASE_DIR, env=os.environ.copy(), stdout=subprocess.DEVNULL)


def celery_worker_stop(proc) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except Exception:
            proc.kill()

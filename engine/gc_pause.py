"""The interpreter's cyclic garbage collector in a serving process (``server.gc_freeze``).

A server process holds some hundred thousand long-lived objects (Django, the URL conf, the
serializers, the tokenizer, the engine's books) and allocates fast while it serves. Python's
collector then runs its oldest generation every so often over all of them: on the 2-core VM a
burst of 8 requests on the tiny model saw full collections of 45 ms, with every thread of the
process (the event loop, the engine's step thread launching a prefill) stopped meanwhile, and
the younger generations' collections scanning objects that will never be garbage.

``freeze()`` collects once, then moves every object left into the permanent generation
(``gc.freeze``): later collections never scan them, so they cost what the objects made since
take. ``serve`` and ``runengine`` call it as they start (``enable``), and the engine after each
model load (``after_load``), when a load has just made the model's long-lived objects. Objects
frozen and later dropped are freed by their reference counts as ever, but a cycle among them
would stay: so an unload (``after_unload``) hands the frozen objects back to the collector,
collects the whole heap once (the model's cycles with it) and freezes what is left again.
"""

from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger("ignis.engine")

_enabled = False


def enable(on: bool = True) -> None:
    """Freeze now and after each model load (``on``), or neither (the default, and in tests)."""
    global _enabled
    _enabled = on
    if on:
        freeze("start")


def after_load() -> None:
    """A model was loaded: freeze what it left, when enabled."""
    if _enabled:
        freeze("model loaded")


def freeze(reason: str) -> float:
    """Collect, then freeze every object left; returns (and logs) the seconds it took."""
    t0 = time.perf_counter()
    gc.collect()
    gc.freeze()
    seconds = time.perf_counter() - t0
    log.info(
        "ignis.gc.frozen", extra={"reason": reason, "objects": gc.get_freeze_count(), "seconds": round(seconds, 4)}
    )
    return seconds


def after_unload() -> None:
    """A model was unloaded: collect everything, the frozen objects too (the model's cycles among
    them), then freeze again when enabled; without freezing, one full collection as before."""
    if gc.get_freeze_count():
        gc.unfreeze()
        if _enabled:
            freeze("model unloaded")
            return
    gc.collect()

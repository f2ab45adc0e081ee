"""engine/gc_pause.py: the serving process's objects frozen out of the collector's passes
(``server.gc_freeze``), and an unload that still frees a model caught in a reference cycle."""

from __future__ import annotations

import gc
import weakref

import pytest

from engine import gc_pause


@pytest.fixture(autouse=True)
def thawed():
    """Each test starts and ends with nothing frozen and the freezing off (the process's default)."""
    gc.unfreeze()
    gc_pause._enabled = False
    yield
    gc.unfreeze()
    gc_pause._enabled = False


class Model:
    """Something a load keeps, in a cycle with itself (a bound callback, a parent link)."""

    def __init__(self) -> None:
        self.me = self


def test_enabled_it_freezes_at_start_and_after_each_load():
    gc_pause.enable(False)
    assert gc.get_freeze_count() == 0
    gc_pause.after_load()
    assert gc.get_freeze_count() == 0  # off: a load leaves the heap alone
    gc_pause.enable(True)
    started = gc.get_freeze_count()
    assert started > 1000  # the test process's modules, classes, fixtures
    loaded = [Model() for _ in range(100)]
    gc_pause.after_load()
    assert gc.get_freeze_count() >= started + 100
    del loaded


def test_an_unload_frees_a_frozen_model_in_a_cycle_and_freezes_the_rest_again():
    gc_pause.enable(True)
    model = Model()
    gc_pause.after_load()
    alive = weakref.ref(model)
    del model
    gc.collect()
    assert alive() is not None  # frozen: a plain collection never looks at it
    gc_pause.after_unload()
    assert alive() is None
    assert gc.get_freeze_count() > 0  # what is left is frozen again


def test_off_an_unload_is_one_full_collection():
    model = Model()
    alive = weakref.ref(model)
    del model
    gc_pause.after_unload()
    assert alive() is None and gc.get_freeze_count() == 0


def test_the_commands_take_server_gc_freeze():
    from apps.models.management.commands._options import gc_freeze
    from ignis_site import config

    assert config.load()["server.gc_freeze"] is True
    assert "server.gc_freeze" in config.START_ONLY_KEYS
    gc_freeze(config.load({"server.gc_freeze": "false"}))
    assert gc.get_freeze_count() == 0 and not gc_pause._enabled
    gc_freeze(config.load())
    assert gc.get_freeze_count() > 0 and gc_pause._enabled

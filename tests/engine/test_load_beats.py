"""A model load on the step thread leaves the engine loop free: the heartbeat keeps going.

The worker beats from its event loop every second and a front end that hears nothing for
``server.engine_timeout`` (5 s) drops the engine, so nothing a load runs may hold the GIL for
long. These tests load through the model host (engine/host.py: ``_on_thread`` ->
``load_model``) while a ticker on the loop measures its longest gap; the first shows the
measure sees a GIL held on the step thread (a C call made through ctypes.PyDLL, which keeps it).
bench/bench_load_beats.py names what holds it, for bigger checkpoints too.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

DEFAULT_GGUF = Path(__file__).resolve().parents[2] / "models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf"
TICK = 0.01
BEAT = 1.0  # engine/worker.py's heartbeat


async def longest_gap(work) -> float:
    """Await ``work()`` (a coroutine function) while the loop ticks every TICK; the longest gap
    past TICK between two ticks, from before the work starts until it ends."""
    done, longest = False, 0.0

    async def tick() -> None:
        nonlocal longest
        last = time.perf_counter()
        while not done:
            await asyncio.sleep(TICK)
            now = time.perf_counter()
            longest = max(longest, now - last - TICK)
            last = now

    ticker = asyncio.create_task(tick())
    await asyncio.sleep(TICK)
    try:
        await work()
    finally:
        done = True
        await ticker
    return longest


def test_the_measure_sees_a_gil_held_on_the_step_thread():
    libc = ctypes.PyDLL(None)  # PyDLL: the call keeps the GIL (CDLL releases it)

    async def main() -> float:
        with ThreadPoolExecutor(1) as step:
            loop = asyncio.get_running_loop()
            return await longest_gap(lambda: loop.run_in_executor(step, libc.usleep, 600_000))

    assert asyncio.run(main()) >= 0.5


@pytest.mark.skipif(not DEFAULT_GGUF.exists(), reason="the default GGUF is not in models/")
def test_the_loop_ticks_while_the_default_gguf_loads_on_numpy():
    from engine.config import EngineConfig
    from engine.host import ModelHost
    from engine.status import EngineState

    async def nothing(*args) -> None:
        pass

    async def main() -> tuple[float, ModelHost]:
        with ThreadPoolExecutor(1, thread_name_prefix="ignis-step") as step:
            host = ModelHost(EngineConfig(backend="numpy", max_context=2048), DEFAULT_GGUF, "smollm2",
                             step_thread=step, send=nothing, end_requests=nothing, wake=lambda: None,
                             ram_budget=4 << 30)  # fmt: skip
            gap = await longest_gap(host.start)
            await host.unload()
        return gap, host

    gap, host = asyncio.run(main())
    assert host.error is None and host.state == EngineState.UNLOADED
    # Loads here take 3-10 s; measured gaps 0.1-0.3 s, up to ~0.8 s on a loaded 2-core machine.
    assert gap < 1.5 * BEAT


def test_a_load_runs_with_the_heap_it_started_with_frozen_and_hands_it_back(tmp_path):
    """engine.loading.frozen_heap: full collections during a load skip the objects alive before it."""
    from engine.config import EngineConfig
    from engine.loading import load_model
    from tests.engine.fake_backend import FakeModels

    models, seen = FakeModels(tmp_path), []

    def loader(path, progress):
        seen.append(gc.get_freeze_count())
        return models.load(path, progress)

    object_count = len(gc.get_objects())
    assert gc.get_freeze_count() == 0
    load_model(EngineConfig(backend="numpy"), models.model("m"), served_id="m", max_context=64, ram_budget=1 << 30,
               progress=lambda d, t: None, on_context=lambda n: None, loader=loader,
               backend_factory=models.create_backend)  # fmt: skip
    assert seen and seen[0] >= object_count * 0.9 and gc.get_freeze_count() == 0
    # A failing load hands the heap back too.
    models.failing.add(models.model("bad"))
    with pytest.raises(RuntimeError):
        load_model(EngineConfig(backend="numpy"), models.model("bad"), served_id="bad", max_context=64,
                   ram_budget=1 << 30, progress=lambda d, t: None, on_context=lambda n: None, loader=loader,
                   backend_factory=models.create_backend)  # fmt: skip
    assert gc.get_freeze_count() == 0

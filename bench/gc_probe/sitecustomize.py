"""bench/bench_gc_pause.py's probe: put this directory on a server's PYTHONPATH with IGNIS_GC_PROBE
set to a file, and every garbage collection the process runs is timed (``gc.callbacks``); the
pauses (wall clock at the start, generation, seconds) are written to that file as JSON lines every
half second and at exit. Without IGNIS_GC_PROBE it does nothing."""

import os

if os.environ.get("IGNIS_GC_PROBE"):
    import atexit
    import gc
    import json
    import threading
    import time

    _path, _start, _pauses, _lock = os.environ["IGNIS_GC_PROBE"], {}, [], threading.Lock()

    def _timed(phase, info):
        g = info["generation"]
        if phase == "start":
            _start[g] = (time.time(), time.perf_counter())
        elif g in _start:
            wall, t0 = _start.pop(g)
            with _lock:
                _pauses.append((wall, g, time.perf_counter() - t0))

    def _flush():
        with _lock:
            taken = _pauses[:]
            del _pauses[:]
        if taken:
            with open(_path, "a") as f:
                f.writelines(json.dumps(p) + "\n" for p in taken)

    def _every():
        while True:
            time.sleep(0.5)
            _flush()

    gc.callbacks.append(_timed)
    atexit.register(_flush)
    threading.Thread(target=_every, name="gc-probe", daemon=True).start()

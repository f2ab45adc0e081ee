"""Device plumbing for the cuda backend: the primary context, pinned staging
buffers mirrored on the device, and CUDA graphs captured on a PyCUDA stream
through ``cuda.bindings``. Imports PyCUDA lazily (only when called)."""

from __future__ import annotations

import contextlib
import threading

import numpy as np

_lock = threading.Lock()
_ctx = None


def primary_context():
    """Retain device 0's primary context once per process (``pycuda.autoprimaryctx``
    semantics, never ``pycuda.autoinit``); it stays retained for the process's life so
    compiled modules remain valid across model loads."""
    global _ctx
    with _lock:
        if _ctx is None:
            import pycuda.driver as cuda

            cuda.init()
            _ctx = cuda.Device(0).retain_primary_context()
        return _ctx


@contextlib.contextmanager
def current():
    """Make the primary context current on this thread for the duration."""
    ctx = primary_context()
    ctx.push()
    try:
        yield ctx
    finally:
        import pycuda.driver as cuda

        cuda.Context.pop()


class Staging:
    """Named arrays in pinned host memory and one device buffer of the same layout.

    The host writes the views, then ``upload`` copies (a byte range of) the buffer on
    the stream; kernels and graphs read the device copies through ``ptr[name]``.
    With ``sets=2`` the host side is two buffers used in turn (``flip``), so the host may
    write one round's inputs while the round before still uploads from the other; ``mark``
    records when the current set's copies (both ways) are done, and ``flip`` waits for that
    on the set it turns to (at once, when the round that used it has long ended).
    """

    def __init__(self, fields: dict[str, tuple[type, int]], sets: int = 1) -> None:
        import pycuda.driver as cuda

        self.offsets: dict[str, tuple[int, int]] = {}
        off = 0
        for name, (dtype, count) in fields.items():
            nbytes = np.dtype(dtype).itemsize * count
            self.offsets[name] = (off, nbytes)
            off += (nbytes + 255) // 256 * 256
        self.nbytes = off
        self._hosts = [cuda.pagelocked_empty(off, np.uint8) for _ in range(sets)]
        for h in self._hosts:
            h[:] = 0
        self._views = [{n: h[o : o + b].view(fields[n][0]) for n, (o, b) in self.offsets.items()} for h in self._hosts]
        self._marks: list = [None] * sets  # the event after each set's last copies
        self.set = 0
        self.host, self.view = self._hosts[0], self._views[0]
        self.dev = cuda.mem_alloc(off)
        cuda.memcpy_htod(self.dev, self.host)
        self.ptr = {n: int(self.dev) + o for n, (o, _) in self.offsets.items()}

    def flip(self) -> int:
        """Turn to the next host set (waiting until the copies ``mark`` recorded on it are done); returns it."""
        self.set = (self.set + 1) % len(self._hosts)
        ev = self._marks[self.set]
        if ev is not None:
            ev.synchronize()
        self.host, self.view = self._hosts[self.set], self._views[self.set]
        return self.set

    def mark(self, stream) -> None:
        """Record, on ``stream``, the point after which the current set's host bytes are free again."""
        import pycuda.driver as cuda

        if self._marks[self.set] is None:
            self._marks[self.set] = cuda.Event(cuda.event_flags.DISABLE_TIMING)
        self._marks[self.set].record(stream)

    def upload(self, stream, first: str, last: str | None = None, nbytes: int | None = None) -> None:
        """Copy fields ``first``..``last`` (declaration order), or ``nbytes`` from ``first``."""
        import pycuda.driver as cuda

        o0, b0 = self.offsets[first]
        end = o0 + (nbytes if nbytes is not None else b0)
        if last is not None:
            o1, b1 = self.offsets[last]
            end = o1 + b1
        cuda.memcpy_htod_async(int(self.dev) + o0, self.host[o0:end], stream)

    def free(self) -> None:
        self.dev.free()


def _check(res):
    from cuda.bindings import driver as drv

    err = res[0] if isinstance(res, tuple) else res
    if err != drv.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"CUDA driver error {err!r}")
    return res[1] if isinstance(res, tuple) and len(res) == 2 else res


class Graph:
    """A CUDA graph captured from whatever ``body()`` launches on ``stream``."""

    def __init__(self, stream, body) -> None:
        from cuda.bindings import driver as drv

        self._drv = drv
        self._stream = drv.CUstream(stream.handle)
        mode = drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED
        _check(drv.cuStreamBeginCapture(self._stream, mode))
        try:
            body()
        finally:
            graph = _check(drv.cuStreamEndCapture(self._stream))
        self.graph = graph
        try:
            res = drv.cuGraphGetNodes(graph, 0)
            self.num_nodes = int(res[-1])
        except Exception:  # only informational
            self.num_nodes = -1
        self.exec = _check(drv.cuGraphInstantiate(graph, 0))

    def launch(self) -> None:
        _check(self._drv.cuGraphLaunch(self.exec, self._stream))

    def destroy(self) -> None:
        _check(self._drv.cuGraphExecDestroy(self.exec))
        _check(self._drv.cuGraphDestroy(self.graph))


class Allocations:
    """Device allocations made during a load, freed together at unload."""

    def __init__(self) -> None:
        self._allocs: list = []

    def alloc(self, nbytes: int) -> int:
        """``nbytes`` of device memory (at least 256, so an empty tensor still has an address)."""
        import pycuda.driver as cuda

        a = cuda.mem_alloc(max(int(nbytes), 256))
        self._allocs.append((a, int(nbytes)))
        return int(a)

    @property
    def nbytes(self) -> int:
        return sum(n for _, n in self._allocs)

    def __bool__(self) -> bool:
        return bool(self._allocs)

    def free(self) -> None:
        for a, _ in self._allocs:
            a.free()
        self._allocs = []

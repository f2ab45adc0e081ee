"""A stand-in for ``pycuda.driver`` on a machine without a card: device memory is numpy byte
buffers keyed by their address, copies copy (so a copy reads every source byte, as the real one
does), streams and events do nothing. Enough for the weight uploader (engine/backends/cuda/weights.py)
and its pinned staging; ``installed()`` puts it in ``sys.modules`` for the length of a block.
"""

from __future__ import annotations

import bisect
import contextlib
import sys
import time
import types

import numpy as np


class Device:
    """Device memory: every allocation a zeroed uint8 buffer, found by any address inside it."""

    def __init__(self, arena: np.ndarray | None = None, packed: bool = False) -> None:
        """``arena`` (uint8, reusable): allocations are slices of it, not zeroed (a benchmark's
        copies then land in memory already in place instead of fresh pages). ``packed``: each
        allocation starts at the next 256-byte boundary after the one before, as the driver may
        place small allocations (a copy spanning two of them is refused there, and here); by
        default a gap follows each one (a copy past the end is caught)."""
        self.buffers: dict[int, np.ndarray] = {}
        self._starts: list[int] = []
        self._next = 1 << 32
        self.arena, self.packed = arena, packed
        self.copies = 0  # host-to-device copies made
        self.async_copies = 0  # of them through memcpy_htod_async
        self.copy_seconds = 0.0  # spent in them (on a card the DMA engine's time, not the host's)

    def alloc(self, nbytes: int) -> int:
        ptr = self._next
        if self.packed:
            self._next += -(-max(nbytes, 1) // 256) * 256
        else:
            self._next += -(-max(nbytes, 1) // 4096) * 4096 + 4096
        if self.arena is None:
            self.buffers[ptr] = np.zeros(nbytes, np.uint8)
        else:
            off = ptr - (1 << 32)
            self.buffers[ptr] = self.arena[off : off + nbytes]
            if self.buffers[ptr].nbytes < nbytes:
                raise MemoryError(f"the arena of {self.arena.nbytes} bytes is full")
        self._starts.append(ptr)
        return ptr

    def view(self, ptr: int, nbytes: int) -> np.ndarray:
        """The bytes ``ptr .. ptr + nbytes``; IndexError unless one allocation holds them."""
        ptr = int(ptr)
        i = bisect.bisect_right(self._starts, ptr) - 1
        start = self._starts[i] if i >= 0 else None
        if start is None or ptr + nbytes > start + len(self.buffers[start]):
            raise IndexError(f"{nbytes} bytes at {ptr:#x} are outside every allocation")
        return self.buffers[start][ptr - start : ptr - start + nbytes]

    def write(self, ptr: int, src) -> None:
        t = time.perf_counter()
        a = np.ascontiguousarray(src).reshape(-1).view(np.uint8)
        self.view(ptr, a.nbytes)[:] = a
        self.copies += 1
        self.copy_seconds += time.perf_counter() - t

    def contents(self) -> dict[int, bytes]:
        return {p: b.tobytes() for p, b in self.buffers.items()}


class _Alloc(int):
    def free(self) -> None:
        pass


class _Stream:
    """Asynchronous copies run when something waits for them (an event after them, or the stream),
    reading their source then: a host write into a pinned buffer before its copies were waited
    for shows on the device, as it can on a card."""

    def __init__(self, flags: int = 0) -> None:
        self.pending: list = []  # callables, in issue order
        self.issued = self.done = 0

    def add(self, copy) -> None:
        self.pending.append(copy)
        self.issued += 1

    def run_until(self, n: int) -> None:
        while self.done < n:
            self.pending.pop(0)()
            self.done += 1

    def synchronize(self) -> None:
        self.run_until(self.issued)


class _Event:
    def __init__(self, flags: int = 0) -> None:
        self.stream, self.upto = None, 0

    def record(self, stream=None) -> _Event:
        self.stream, self.upto = stream, stream.issued if stream is not None else 0
        return self

    def synchronize(self) -> None:
        if self.stream is not None:
            self.stream.run_until(self.upto)

    def query(self) -> bool:
        return self.stream is None or self.stream.done >= self.upto


class _Context:
    @staticmethod
    def synchronize() -> None:
        pass


def driver(device: Device) -> types.ModuleType:
    """A ``pycuda.driver`` module over ``device``."""
    m = types.ModuleType("pycuda.driver")
    m.mem_alloc = lambda n: _Alloc(device.alloc(int(n)))
    m.memcpy_htod = lambda dst, src: device.write(dst, src)

    def memcpy_htod_async(dst, src, stream=None) -> None:
        device.async_copies += 1
        if stream is None:
            device.write(dst, src)
        else:
            stream.add(lambda: device.write(dst, src))

    m.memcpy_htod_async = memcpy_htod_async
    m.memcpy_dtod = lambda dst, src, n: device.view(dst, n).__setitem__(slice(None), device.view(src, n))
    m.pagelocked_empty = lambda shape, dtype: np.empty(shape, dtype)
    m.Stream, m.Event, m.Context = _Stream, _Event, _Context
    m.mem_get_info = lambda: (1 << 40, 1 << 40)

    def to_device(a):
        ptr = _Alloc(device.alloc(np.asarray(a).nbytes))
        device.write(ptr, a)
        return ptr

    m.to_device = to_device
    return m


@contextlib.contextmanager
def installed(device: Device | None = None):
    """``pycuda`` and ``pycuda.driver`` (over ``device``, a fresh one by default) in ``sys.modules``."""
    device = device or Device()
    saved = {k: sys.modules.get(k) for k in ("pycuda", "pycuda.driver")}
    pkg = types.ModuleType("pycuda")
    pkg.driver = driver(device)
    sys.modules["pycuda"], sys.modules["pycuda.driver"] = pkg, pkg.driver
    try:
        yield device
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v

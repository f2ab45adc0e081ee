"""Weight copies to the device through pinned staging buffers: the cold load's bf16 path.

A bf16 tensor kept as stored (engine/loaders/bf16.py; from a Hugging Face checkpoint, a view of
the mmapped safetensors file) is read once: its rows are written straight into their device
layout (the uploader's row permutations, ``interleave_rope`` and ``interleave_gate_up``, done as
copies between reshaped views: no intermediate array) in one of two pinned buffers, and a full
buffer goes up with ``memcpy_htod_async`` on a copy stream while the other one fills (an event
per buffer says when it may be filled again). A thread pool fills a buffer's chunks at once
(numpy copies release the GIL). The bytes that land, and where, are the direct path's (permute,
then ``memcpy_htod`` from pageable memory); tests/kernels/test_cuda_upload_host.py checks it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from engine.loaders.bf16 import is_bf16

BUFFER_BYTES = 256 << 20  # each of the two pinned buffers
CHUNK_BYTES = 8 << 20  # one fill task (a buffer is 32 of them, spread over the pool)
ALIGN = 256  # where a tensor starts in a buffer (device allocations are 256-byte aligned too)


@dataclass(frozen=True)
class Run:
    """Consecutive destination bytes: ``units`` units of ``unit_bytes`` each (a row, a head, a
    group of 8 gate and 8 up rows); ``write(u0, u1, out)`` writes units ``u0 .. u1`` into ``out``
    (uint16, ``(u1 - u0) * unit_bytes // 2`` elements)."""

    units: int
    unit_bytes: int
    write: Callable[[int, int, np.ndarray], None]


def runs(parts: list, interleave: bool = False, rope_dim: int = 0, rotary_dim: int | None = None) -> list[Run] | None:
    """The ``Run``s putting bf16 ``parts`` on the device as ``_Uploader.__call__`` lays them out
    (concatenated along dim 0; ``interleave``: gate and up in 8-row groups; ``rope_dim``: each
    head rope-interleaved over its first ``rotary_dim`` rows). None where this path does not take
    them (a part not bf16 kept as stored, or rope and interleave at once): the direct path does."""
    if not all(is_bf16(p) for p in parts) or (interleave and rope_dim):
        return None
    bits = [p.view(np.uint16).reshape(p.shape[0], -1) if p.ndim else p.view(np.uint16).reshape(1, 1) for p in parts]
    if interleave:
        return [_gate_up(*bits)]
    if rope_dim:
        return [_rope(b, rope_dim, rotary_dim) for b in bits]
    return [_rows(b) for b in bits]


def _view(a: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """A destination ``a`` reshaped without a copy (ValueError where that takes one: a write into a
    copy would be lost). ``copy=False``, not an assignment to ``.shape``, which NumPy 2.5 deprecates."""
    return np.reshape(a, shape, copy=False)


def _rows(b: np.ndarray) -> Run:
    k = b.shape[1]

    def write(u0: int, u1: int, out: np.ndarray) -> None:
        np.copyto(_view(out, (u1 - u0, k)), b[u0:u1])

    return Run(b.shape[0], 2 * k, write)


def _rope(b: np.ndarray, head_dim: int, rotary_dim: int | None) -> Run:
    """``interleave_rope`` as a copy: unit = one head; the rotated rows of head h in the order
    (dims 8j + r, then R/2 + 8j + r for each group j), the rest in place."""
    n, k = b.shape
    rd = head_dim if rotary_dim is None else rotary_dim
    if head_dim % 16 or n % head_dim or rd % 16 or not 0 <= rd <= head_dim:
        raise ValueError(f"{n} rows are not whole heads of {head_dim} rotating {rd} (multiples of 16)")
    heads = b.reshape(n // head_dim, head_dim, k)  # sources may be copies (a strided view's reshape)
    rot = heads[:, :rd].reshape(n // head_dim, 2, rd // 16, 8, k).swapaxes(1, 2)

    def write(u0: int, u1: int, out: np.ndarray) -> None:
        o = _view(out, (u1 - u0, head_dim, k))
        np.copyto(_view(o[:, :rd], (u1 - u0, rd // 16, 2, 8, k)), rot[u0:u1])
        if rd < head_dim:
            np.copyto(o[:, rd:], heads[u0:u1, rd:])

    return Run(n // head_dim, 2 * head_dim * k, write)


def _gate_up(gate: np.ndarray, up: np.ndarray) -> Run:
    """``interleave_gate_up`` as a copy: unit = gate rows 8j..8j+7 then up rows 8j..8j+7."""
    i, k = gate.shape
    g, u = gate.reshape(i // 8, 8, k), up.reshape(i // 8, 8, k)

    def write(u0: int, u1: int, out: np.ndarray) -> None:
        o = _view(out, (u1 - u0, 2, 8, k))
        np.copyto(o[:, 0], g[u0:u1])
        np.copyto(o[:, 1], u[u0:u1])

    return Run(i // 8, 2 * 16 * k, write)


class PinnedCopier:
    """Copies ``Run``s to device addresses through ``buffers`` pinned buffers used in turn.

    ``put`` only plans; a buffer is filled (by the pool) and sent when the next run does not fit,
    and ``close`` sends the last one and waits for every copy. Until ``close`` the device bytes
    are not all there."""

    def __init__(self, buffer_bytes: int | None = None, buffers: int = 2, threads: int | None = None) -> None:
        import pycuda.driver as cuda

        self.cuda = cuda
        size = buffer_bytes or BUFFER_BYTES
        self.buffers = [cuda.pagelocked_empty(size, np.uint8) for _ in range(buffers)]
        self.sent = [None] * buffers  # the event after each buffer's last copies
        self.stream = cuda.Stream()
        self.pool = ThreadPoolExecutor(threads or min(8, os.cpu_count() or 1))
        self.cur, self.used = 0, 0
        self.tasks: list[tuple[Callable, int, int, int, int]] = []  # write, u0, u1, buffer start, bytes
        self.copies: list[list[int]] = []  # [device address, buffer start, bytes]

    def fits(self, runs: list[Run]) -> bool:
        """Whether every unit fits a buffer (a longer unit goes the direct path)."""
        return all(r.unit_bytes <= len(self.buffers[0]) for r in runs)

    def put(self, dst: int, runs: list[Run]) -> None:
        """Plan ``runs`` to ``dst`` onwards, one after another."""
        size, off = len(self.buffers[0]), 0
        self.used = -(-self.used // ALIGN) * ALIGN  # each tensor's copy from an aligned host address
        first = len(self.copies)  # this tensor's copies start here (0 again after a send)
        for run in runs:
            step = max(1, CHUNK_BYTES // run.unit_bytes)
            for u0 in range(0, run.units, step):
                u1 = min(run.units, u0 + step)
                n = (u1 - u0) * run.unit_bytes
                if self.used + n > size:
                    self._send()
                    first = 0
                self.tasks.append((run.write, u0, u1, self.used, n))
                # One copy for a tensor's chunks, never across tensors: the driver may place two
                # allocations back to back, and a copy spanning both is refused (invalid argument).
                last = self.copies[-1] if len(self.copies) > first else None
                if last and last[0] + last[2] == dst + off and last[1] + last[2] == self.used:
                    last[2] += n
                else:
                    self.copies.append([dst + off, self.used, n])
                self.used += n
                off += n

    def _send(self) -> None:
        if not self.tasks:
            return
        buf = self.buffers[self.cur]
        if self.sent[self.cur] is not None:
            self.sent[self.cur].synchronize()  # its last copies are done: it may be overwritten

        def fill(task) -> None:
            write, u0, u1, start, n = task
            write(u0, u1, buf[start : start + n].view(np.uint16))

        for _ in self.pool.map(fill, self.tasks):
            pass
        for dst, start, n in self.copies:
            self.cuda.memcpy_htod_async(dst, buf[start : start + n], self.stream)
        event = self.cuda.Event()
        event.record(self.stream)
        self.sent[self.cur] = event
        self.tasks, self.copies, self.used = [], [], 0
        self.cur = (self.cur + 1) % len(self.buffers)

    def close(self, send: bool = True) -> None:
        """Send what is planned (unless ``send`` is False: a failed load) and wait for every copy;
        the buffers may be freed after."""
        try:
            if send:
                self._send()
        finally:
            self.stream.synchronize()
            self.pool.shutdown()
            for b in self.buffers:  # now, in the load's context, not whenever they are collected
                free = getattr(b.base, "free", None)
                if free is not None:
                    free()
            self.buffers = []

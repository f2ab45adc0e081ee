"""A stand-in for ``pycuda.compiler`` and the module side of ``pycuda.driver`` on a machine without a
card or PyCUDA: ``Nvcc.compile`` has ``pycuda.compiler.compile``'s signature and on-disk cache (a
cubin file per source + options + arch under ``cache_dir``; a hit reads it and runs nothing), and
records every run (its thread, how many ran at once). ``gate`` = N: each of the first N runs waits
until N run at once, and raises after ``timeout`` seconds otherwise (a compile path that runs them
one after the other fails instead of hanging). ``fail`` = a substring of the source that makes a run
raise ``CompileError``. ``installed(nvcc)`` adds ``pycuda.compiler`` and, to the fake driver of
tests/kernels/fake_pycuda.py, ``module_from_buffer`` (modules and functions that record the thread
of every call), an sm_90 device and ``memset_d32``.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
import threading
import types
from types import SimpleNamespace

from tests.kernels import fake_pycuda


class CompileError(Exception):
    pass


class Nvcc:
    def __init__(self, gate: int = 0, timeout: float = 20.0, fail: str | None = None) -> None:
        self.gate, self.timeout, self.fail = gate, timeout, fail
        self.lock = threading.Lock()
        self.opened = threading.Event()  # set once ``gate`` runs were running together
        self.runs: list[tuple[str, tuple[str, ...], str]] = []  # (source digest, options, arch) of each run
        self.sources: list[str] = []  # of each run
        self.hits: list[tuple[str, tuple[str, ...], str]] = []  # of each cache hit
        self.run_threads: set[int] = set()
        self.running = self.most_running = 0

    def compile(self, source, nvcc="nvcc", options=None, keep=False, no_extern_c=False, arch=None, code=None,
                cache_dir=None, include_dirs=()) -> bytes:  # fmt: skip
        job = (hashlib.sha256(source.encode()).hexdigest()[:16], tuple(options or ()), arch)
        path = os.path.join(cache_dir, hashlib.sha256(repr(job).encode()).hexdigest() + ".cubin")
        if os.path.exists(path):
            with self.lock:
                self.hits.append(job)
            with open(path, "rb") as f:
                return f.read()
        with self.lock:
            self.runs.append(job)
            self.sources.append(source)
            self.run_threads.add(threading.get_ident())
            self.running += 1
            self.most_running = max(self.most_running, self.running)
            gated = len(self.runs) <= self.gate
            if self.running >= self.gate:
                self.opened.set()
        try:
            if gated and not self.opened.wait(self.timeout):
                raise RuntimeError(f"{self.gate} compiles never ran at once (at most {self.most_running})")
            if self.fail is not None and self.fail in source:
                raise CompileError(f"nvcc failed on a source with {self.fail!r}")
            cubin = b"CUBIN " + repr(job).encode()
            with open(path, "wb") as f:
                f.write(cubin)
            return cubin
        finally:
            with self.lock:
                self.running -= 1


class Calls:
    """What the fake driver's modules were asked, each with the asking thread."""

    def __init__(self) -> None:
        self.loads: list[tuple[bytes, int]] = []  # (cubin, thread) of each module_from_buffer
        self.calls: list[tuple[str, str, tuple, int]] = []  # (function, method, args, thread)


class _Function:
    def __init__(self, calls: Calls, cubin: bytes, name: str) -> None:
        self.calls, self.key = calls, f"{hashlib.sha256(cubin).hexdigest()[:12]}:{name}"

    def _note(self, method: str, args: tuple) -> None:
        self.calls.calls.append((self.key, method, args, threading.get_ident()))

    def prepare(self, arg_types) -> _Function:
        self._note("prepare", (arg_types,))
        return self

    def set_attribute(self, attr, value) -> None:
        self._note("set_attribute", (attr, value))

    def prepared_async_call(self, grid, block, stream, *args, shared_size=0) -> None:
        self._note("launch", (grid, block))


class _Module:
    def __init__(self, calls: Calls, cubin: bytes) -> None:
        self.calls, self.cubin = calls, cubin

    def get_function(self, name: str) -> _Function:
        f = _Function(self.calls, self.cubin, name)
        f._note("get_function", ())
        return f


@contextlib.contextmanager
def installed(nvcc: Nvcc, device: fake_pycuda.Device | None = None):
    """fake_pycuda's ``pycuda`` with ``pycuda.compiler`` = ``nvcc`` and a driver that loads modules;
    yields the driver's ``Calls``."""
    calls = Calls()
    with fake_pycuda.installed(device):
        drv = sys.modules["pycuda.driver"]

        def module_from_buffer(cubin: bytes) -> _Module:
            calls.loads.append((cubin, threading.get_ident()))
            return _Module(calls, cubin)

        dev = SimpleNamespace(compute_capability=lambda: (9, 0), get_attribute=lambda attr: 132)
        drv.module_from_buffer = module_from_buffer
        drv.Context = type("Context", (), {"synchronize": staticmethod(lambda: None),
                                           "get_device": staticmethod(lambda: dev)})  # fmt: skip
        drv.device_attribute = SimpleNamespace(MULTIPROCESSOR_COUNT="sms")
        drv.function_attribute = SimpleNamespace(MAX_DYNAMIC_SHARED_SIZE_BYTES="max_dynamic_shared",
                                                 PREFERRED_SHARED_MEMORY_CARVEOUT="carveout")  # fmt: skip
        drv.memset_d32 = drv.memset_d8 = lambda ptr, value, count: None
        drv.CompileError = CompileError
        compiler = types.ModuleType("pycuda.compiler")
        compiler.compile = nvcc.compile
        saved = sys.modules.get("pycuda.compiler")
        sys.modules["pycuda"].compiler = compiler
        sys.modules["pycuda.compiler"] = compiler
        try:
            yield calls
        finally:
            if saved is None:
                sys.modules.pop("pycuda.compiler", None)
            else:
                sys.modules["pycuda.compiler"] = saved

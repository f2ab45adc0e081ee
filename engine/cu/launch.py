"""Compiling engine/cu/*.cu and launching its kernels through declared parameter lists.

``module(name, defines, cache_dir)`` compiles ``common.cuh`` + ``<name>.cu`` once per
process and set of compile-time constants (``functools.cache`` around
``SourceModule(..., no_extern_c=True)``; PyCUDA's on-disk cache under ``cache_dir``).
``Kernel`` wraps one ``__global__`` function: its parameters are declared once, as
``"name:type"`` pairs in the order of the C signature, and every launch passes them by
name; the declaration gives PyCUDA's ``prepare()`` string and checks each launch's
names, count and types (a wrong or missing value raises before anything reaches the
device). Launches are ``prepared_async_call`` on the caller's non-default stream, so a
sequence of them can be captured into a CUDA graph.
"""

from __future__ import annotations

import functools
import operator
import os
from pathlib import Path

import numpy as np

CU_DIR = Path(__file__).resolve().parent
ARCH = "sm_90"
# The default kernel cache: <models dir>/.cache/pycuda with the default models dir (./models);
# the server passes its own through CudaTuning.kernel_cache_dir.
DEFAULT_CACHE_DIR = str(CU_DIR.parent.parent / "models" / ".cache" / "pycuda")


def _ptr(v) -> int:
    return int(v)  # a device address (int) or a DeviceAllocation


def _i32(v) -> np.int32:
    return np.int32(operator.index(v))  # numpy refuses values out of range


def _i64(v) -> np.int64:
    return np.int64(operator.index(v))


def _f32(v) -> np.float32:
    return np.float32(float(v))


# type -> (PyCUDA prepare() letter, conversion and check of a launch's value)
TYPES = {"ptr": ("P", _ptr), "i32": ("i", _i32), "i64": ("q", _i64), "f32": ("f", _f32)}


@functools.cache
def module(name: str, defines: tuple[tuple[str, int], ...] = (), cache_dir: str = "", after: tuple[str, ...] = ()):
    """Compile ``engine/cu/<name>.cu`` (once per process, set of ``defines`` and cache dir), after
    ``common.cuh`` and the sources named in ``after`` (``gemv_q`` reuses ``gemv``'s epilogues)."""
    from pycuda.compiler import SourceModule

    cache = cache_dir or DEFAULT_CACHE_DIR
    os.makedirs(cache, exist_ok=True)
    src = "\n".join((CU_DIR / f).read_text() for f in ("common.cuh", *(a + ".cu" for a in after), name + ".cu"))
    options = ["-O3", "-std=c++17"] + [f"-D{k}={v}" for k, v in defines]
    return SourceModule(src, options=options, no_extern_c=True, arch=ARCH, cache_dir=cache)


class Kernel:
    """One prepared kernel of ``mod`` with its parameters declared once.

    ``params``: ``"name:type ..."`` in signature order, types ``ptr`` / ``i32`` / ``i64`` /
    ``f32``. ``threads``: the block size, fixed per kernel (sources that depend on it get
    the same number as a define). Call as ``kernel(stream, grid, **values)``.
    """

    def __init__(self, mod, name: str, params: str, threads: int, shared: int = 0) -> None:
        self.name, self.threads, self.shared = name, threads, shared
        self.params: tuple[tuple[str, str], ...] = tuple(tuple(p.split(":")) for p in params.split())  # type: ignore[misc]
        bad = [t for _, t in self.params if t not in TYPES]
        if bad:
            raise ValueError(f"{name}: unknown parameter types {bad}")
        self._convert = [(n, TYPES[t][1]) for n, t in self.params]
        self.fn = mod.get_function(name)
        self.fn.prepare("".join(TYPES[t][0] for _, t in self.params))

    def __call__(self, stream, grid: tuple[int, ...], **values) -> None:
        args = []
        for n, conv in self._convert:
            try:
                args.append(conv(values.pop(n)))
            except KeyError:
                raise TypeError(f"{self.name}: missing parameter {n!r}") from None
            except (TypeError, ValueError, OverflowError) as e:
                raise TypeError(f"{self.name}: parameter {n!r}: {e}") from None
        if values:
            raise TypeError(f"{self.name}: unknown parameters {sorted(values)}")
        grid3 = tuple(grid) + (1,) * (3 - len(grid))
        self.fn.prepared_async_call(grid3, (self.threads, 1, 1), stream, *args, shared_size=self.shared)

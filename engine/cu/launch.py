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

Programmatic dependent launch (``cuda.pdl``, docs/CUDA.md): ``pdl_module`` compiles the same
source with ``PDL=1`` (common.cuh's ``pdl_wait`` / ``pdl_launch_dependents`` become
``griddepcontrol`` instructions) and loads it through ``cuda.bindings``; a ``Kernel`` of such a
module launches with ``cuLaunchKernelEx`` and the programmatic stream serialization attribute, so
it may start while the kernel before it on the stream finishes (a captured graph keeps the edge).
"""

from __future__ import annotations

import ctypes
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

    src, options, cache = _build(name, defines, cache_dir, after)
    return SourceModule(src, options=options, no_extern_c=True, arch=ARCH, cache_dir=cache)


def _build(name: str, defines, cache_dir: str, after=()) -> tuple[str, list[str], str]:
    """(source, nvcc options, cache dir) of ``module``'s compilation."""
    cache = cache_dir or DEFAULT_CACHE_DIR
    os.makedirs(cache, exist_ok=True)
    src = "\n".join((CU_DIR / f).read_text() for f in ("common.cuh", *(a + ".cu" for a in after), name + ".cu"))
    return src, ["-O3", "-std=c++17"] + [f"-D{k}={v}" for k, v in defines], cache


class PdlModule:
    """A module compiled with ``PDL=1`` and loaded by the driver API (``cuda.bindings``), whose
    kernels launch with programmatic stream serialization (``Kernel`` sees the type)."""

    def __init__(self, cubin: bytes) -> None:
        from cuda.bindings import driver as drv

        self._drv = drv
        self.handle = _check(drv.cuModuleLoadData(cubin))  # into the current (primary) context

    def get_function(self, name: str):
        return _check(self._drv.cuModuleGetFunction(self.handle, name.encode()))


@functools.cache
def pdl_module(name: str, defines: tuple[tuple[str, int], ...] = (), cache_dir: str = "") -> PdlModule:
    """``module(name, defines, cache_dir)`` compiled with ``PDL=1`` (PyCUDA's compiler and on-disk
    cache; the cubin loaded by ``cuda.bindings``, so its functions have driver handles)."""
    from pycuda.compiler import compile as nvcc

    src, options, cache = _build(name, (*defines, ("PDL", 1)), cache_dir)
    return PdlModule(nvcc(src, options=options, no_extern_c=True, arch=ARCH, cache_dir=cache))


def _check(res):
    """The value of a ``cuda.bindings`` call's (error, value) result; raises on an error."""
    from cuda.bindings import driver as drv

    err, *rest = res
    if err != drv.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"CUDA driver error {err!r}")
    return rest[0] if rest else None


# type -> the ctypes slot a cuLaunchKernelEx parameter is written into
CTYPES = {"ptr": ctypes.c_uint64, "i32": ctypes.c_int32, "i64": ctypes.c_int64, "f32": ctypes.c_float}


class ParamSlots:
    """A kernel's parameters as ``cuLaunchKernelEx`` reads them: one ctypes value per parameter
    and the ``void*`` array of their addresses (``address``). ``fill`` writes one launch's
    (converted) values; the driver copies them at the launch, so the slots are reused."""

    def __init__(self, types: tuple[str, ...]) -> None:
        self.slots = [CTYPES[t]() for t in types]
        self.array = (ctypes.c_void_p * max(1, len(self.slots)))(*(ctypes.addressof(v) for v in self.slots))
        self._float = [t == "f32" for t in types]

    def fill(self, args) -> int:
        """Write ``args`` (``TYPES``' conversions of one launch's values) and return ``address``."""
        for slot, is_float, v in zip(self.slots, self._float, args, strict=True):
            slot.value = float(v) if is_float else int(v)
        return self.address

    @property
    def address(self) -> int:
        return ctypes.addressof(self.array)


PDL_ATTRIBUTE = "CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION"
MAX_CONFIGS = 256  # launch configs a PDL kernel keeps (decode widths 1..64, a few prefill grids)


def launch_config(drv, grid: tuple[int, int, int], block: tuple[int, int, int], shared: int, stream: int,
                  pdl: bool = True):  # fmt: skip
    """The ``CUlaunchConfig`` of one launch on ``stream`` (a handle), with the programmatic stream
    serialization attribute set to 1 when ``pdl``. ``drv``: ``cuda.bindings.driver`` (or a stand-in)."""
    cfg = drv.CUlaunchConfig()
    cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = (int(v) for v in grid)
    cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = (int(v) for v in block)
    cfg.sharedMemBytes = int(shared)
    cfg.hStream = drv.CUstream(int(stream))
    attrs = []
    if pdl:
        attr = drv.CUlaunchAttribute()
        attr.id = getattr(drv.CUlaunchAttributeID, PDL_ATTRIBUTE)
        attr.value.programmaticStreamSerializationAllowed = 1
        attrs.append(attr)
    cfg.attrs = attrs
    cfg.numAttrs = len(attrs)
    return cfg


class Kernel:
    """One prepared kernel of ``mod`` with its parameters declared once.

    ``params``: ``"name:type ..."`` in signature order, types ``ptr`` / ``i32`` / ``i64`` /
    ``f32``. ``threads``: the block size, fixed per kernel (sources that depend on it get
    the same number as a define). Call as ``kernel(stream, grid, **values)``. A kernel of a
    ``PdlModule`` (``pdl``) launches through ``cuLaunchKernelEx`` with programmatic stream
    serialization; any other through PyCUDA's ``prepared_async_call``.
    """

    def __init__(self, mod, name: str, params: str, threads: int, shared: int = 0) -> None:
        self.name, self.threads, self.shared = name, threads, shared
        self.params: tuple[tuple[str, str], ...] = tuple(tuple(p.split(":")) for p in params.split())  # type: ignore[misc]
        bad = [t for _, t in self.params if t not in TYPES]
        if bad:
            raise ValueError(f"{name}: unknown parameter types {bad}")
        self._convert = [(n, TYPES[t][1]) for n, t in self.params]
        self.fn = mod.get_function(name)
        self.pdl = isinstance(mod, PdlModule)
        if self.pdl:
            self._slots = ParamSlots(tuple(t for _, t in self.params))
            self._configs: dict = {}  # (grid, stream handle) -> CUlaunchConfig
        else:
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
        if self.pdl:
            self._launch_pdl(stream, grid3, args)
        else:
            self.fn.prepared_async_call(grid3, (self.threads, 1, 1), stream, *args, shared_size=self.shared)

    def _launch_pdl(self, stream, grid3: tuple[int, ...], args: list) -> None:
        from cuda.bindings import driver as drv

        key = (grid3, stream.handle)
        cfg = self._configs.get(key)
        if cfg is None:
            if len(self._configs) >= MAX_CONFIGS:  # prefill grids vary with the chunk: keep a bounded few
                self._configs.clear()
            cfg = self._configs[key] = launch_config(drv, grid3, (self.threads, 1, 1), self.shared, stream.handle)
        _check(drv.cuLaunchKernelEx(cfg, self.fn, self._slots.fill(args), 0))

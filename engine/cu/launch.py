"""Compiling engine/cu/*.cu and launching its kernels through declared parameter lists.

``module(name, defines, cache_dir)`` compiles ``common.cuh`` + ``<name>.cu`` once per
process and set of compile-time constants (``compiled``: PyCUDA's ``compile`` with its on-disk
cache under ``cache_dir``, then ``module_from_buffer``). Inside a ``compiling()`` block the compiles
run on a pool of threads (nvcc is a subprocess; no context needed) while the caller goes on (the
backend uploads the weights), and the modules are loaded and their functions bound on the
caller's thread when the block binds them (``Compiling``, ``LazyFunction``).
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
import operator
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np

CU_DIR = Path(__file__).resolve().parent
ARCH = "sm_90"
# The default kernel cache: <models dir>/.cache/pycuda with the default models dir (./models);
# the server passes its own through CudaTuning.kernel_cache_dir.
DEFAULT_CACHE_DIR = str(CU_DIR.parent.parent / "models" / ".cache" / "pycuda")


def _ptr(v) -> int:
    p = int(v)  # a device address (int) or a DeviceAllocation
    if not 0 <= p <= 0xFFFFFFFFFFFFFFFF:
        raise ValueError(f"{p} is not a 64-bit address")
    return p


def _i32(v) -> np.int32:
    return np.int32(operator.index(v))  # numpy refuses values out of range


def _i64(v) -> np.int64:
    return np.int64(operator.index(v))


def _f32(v) -> np.float32:
    return np.float32(float(v))


# type -> (PyCUDA prepare() letter, conversion and check of a launch's value)
TYPES = {"ptr": ("P", _ptr), "i32": ("i", _i32), "i64": ("q", _i64), "f32": ("f", _f32)}

# type -> the expression a binder (``binder``) passes for parameter ``{n}``: a plain int or float
# within the type's range as it is (struct packs a Python int or float to the same bytes as the
# numpy scalar), anything else through ``TYPES``' conversion (which raises for a bad value)
_FAST = {
    "ptr": "{n} if {n}.__class__ is int and 0 <= {n} <= 0xFFFFFFFFFFFFFFFF else _ptr({n})",
    "i32": "{n} if {n}.__class__ is int and -0x80000000 <= {n} <= 0x7FFFFFFF else _i32({n})",
    "i64": "{n} if {n}.__class__ is int and -0x8000000000000000 <= {n} <= 0x7FFFFFFFFFFFFFFF else _i64({n})",
    "f32": "{n} if {n}.__class__ is float else _f32({n})",
}


def binder(params: tuple[tuple[str, str], ...]):
    """A function of keyword-only ``params`` (name, type) returning their launch values in order:
    what ``Kernel`` does a launch, bound by the interpreter instead of a loop over a dict (a prefill
    pass of the 8B shape makes 257-417 launches on the step thread; 2-3x less host time a launch).
    A missing or unknown name raises TypeError, a value out of its type's range what ``TYPES``'
    conversion raises (``Kernel`` then says which parameter)."""
    names = [n for n, _ in params]
    if any(not n.isidentifier() or n.startswith("_") for n in names):
        raise ValueError(f"parameter names must be identifiers without a leading underscore: {names}")
    values = ", ".join("(" + _FAST[t].format(n=n) + ")" for n, t in params)
    src = f"def bind({'*, ' + ', '.join(names) if names else ''}):\n    return ({values}{',' if names else ''})\n"
    scope = {"_ptr": _ptr, "_i32": _i32, "_i64": _i64, "_f32": _f32}
    exec(compile(src, "<kernel binder>", "exec"), scope)  # noqa: S102 (names checked above)
    return scope["bind"]


def module(name: str, defines: tuple[tuple[str, int], ...] = (), cache_dir: str = "", after: tuple[str, ...] = ()):
    """``engine/cu/<name>.cu`` compiled (once per process, set of ``defines`` and cache dir), after
    ``common.cuh`` and the sources named in ``after`` (``gemv_q`` reuses ``gemv``'s epilogues): a
    ``Module``, loaded now, or inside ``compiling()`` once its cubin is there."""
    return compiled(("module", name, defines, cache_dir, after), lambda: _build(name, defines, cache_dir, after))


def _build(name: str, defines, cache_dir: str, after=()) -> tuple[str, list[str], str]:
    """(source, nvcc options, cache dir) of ``module``'s compilation."""
    cache = cache_dir or DEFAULT_CACHE_DIR
    os.makedirs(cache, exist_ok=True)
    src = "\n".join((CU_DIR / f).read_text() for f in ("common.cuh", *(a + ".cu" for a in after), name + ".cu"))
    return src, ["-O3", "-std=c++17"] + [f"-D{k}={v}" for k, v in defines], cache


class Module:
    """One compiled source: its cubin (``cubin()``; a pool's future inside ``compiling()``), loaded into
    the current context by the first ``get_function`` outside ``compiling()`` or by its ``bind``."""

    def __init__(self, cubin) -> None:
        self._cubin, self._mod = cubin, None  # a Future of the cubin's bytes; the loaded module

    def cubin(self) -> bytes:
        return self._cubin.result()

    @property
    def loaded(self) -> bool:
        return self._mod is not None

    def failed(self) -> bool:
        """Whether its compile ended in an error or was cancelled (then it is compiled again when asked)."""
        f = self._cubin
        return f.done() and (f.cancelled() or f.exception() is not None)

    def load(self):
        if self._mod is None:
            self._mod = self._load(self.cubin())
        return self._mod

    def _load(self, cubin: bytes):
        import pycuda.driver as cuda

        return cuda.module_from_buffer(cubin)

    def function(self, name: str):
        """The loaded module's function ``name`` (loads it first)."""
        return self.load().get_function(name)

    def get_function(self, name: str):
        """``function(name)``; inside ``compiling()`` with the module not loaded yet, a ``LazyFunction``
        that records ``prepare`` / ``set_attribute`` until the block binds it."""
        c = _current()
        if c is not None and self._mod is None:
            return c.lazy(self, name)
        return self.function(name)


class PdlModule(Module):
    """A module compiled with ``PDL=1`` and loaded by the driver API (``cuda.bindings``), whose
    kernels launch with programmatic stream serialization (``Kernel`` sees the type)."""

    def _load(self, cubin: bytes):
        from cuda.bindings import driver as drv

        return _check(drv.cuModuleLoadData(cubin))  # into the current (primary) context

    @property
    def handle(self):
        return self.load()

    def function(self, name: str):
        from cuda.bindings import driver as drv

        return _check(drv.cuModuleGetFunction(self.load(), name.encode()))


def pdl_module(name: str, defines: tuple[tuple[str, int], ...] = (), cache_dir: str = "") -> PdlModule:
    """``module(name, defines, cache_dir)`` compiled with ``PDL=1`` (PyCUDA's compiler and on-disk
    cache; the cubin loaded by ``cuda.bindings``, so its functions have driver handles)."""
    build = lambda: _build(name, (*defines, ("PDL", 1)), cache_dir)  # noqa: E731
    return compiled(("pdl", name, defines, cache_dir), build, kind=PdlModule)


# --- compiling: nvcc runs on a pool while the load goes on ----------------------------------------

_MODULES: dict[tuple, Module] = {}  # key -> its Module, for the process (the context is the primary one)
_local = threading.local()  # .compiling: the Compiling block this thread is in


def _current() -> Compiling | None:
    return getattr(_local, "compiling", None)


def _nvcc(src: str, options: list[str], arch: str, cache: str) -> bytes:
    from pycuda.compiler import compile as nvcc

    return nvcc(src, options=options, no_extern_c=True, arch=arch, cache_dir=cache)


def compiled(key: tuple, build, *, arch: str = ARCH, kind=Module) -> Module:
    """The ``kind`` module ``build()`` = (source, options, cache dir) gives, compiled for ``arch`` (PyCUDA's
    compiler and on-disk cache), once per process and ``key``. Outside ``compiling()``: compiled and
    loaded now (a compile error raises here). Inside: the compile is submitted to the block's pool
    and the module is loaded when the block binds it (or a function of it is first called)."""
    mod = _MODULES.get(key)
    if mod is not None and not mod.failed():
        return mod
    src, options, cache = build()
    c = _current()
    if c is None:
        done: Future = Future()
        done.set_result(_nvcc(src, options, arch, cache))
        mod = kind(done)
        mod.load()
    else:
        mod = kind(c.submit(_nvcc, src, options, arch, cache))
        c.modules.append(mod)
    _MODULES[key] = mod
    return mod


def compile_workers() -> int:
    """The pool's size: the machine's CPUs, at most 16 (one nvcc process each)."""
    return max(1, min(16, os.cpu_count() or 1))


class LazyFunction:
    """A function of a module still compiling (``Module.get_function`` inside ``compiling()``): ``prepare``
    and ``set_attribute`` are recorded, as are ``when_bound`` callbacks; ``bind`` (on the thread that
    holds the context) loads the module, fetches the function and replays them. Anything else asked
    of it binds it first, then goes to the function."""

    def __init__(self, mod: Module, name: str) -> None:
        self.module, self.name, self.target, self._calls = mod, name, None, []

    def prepare(self, *args, **kw) -> None:
        self._record(lambda f: f.prepare(*args, **kw))

    def set_attribute(self, *args) -> None:
        self._record(lambda f: f.set_attribute(*args))

    def _record(self, call) -> None:
        if self.target is None:
            self._calls.append(call)
        else:
            call(self.target)

    def bind(self):
        if self.target is None:
            fn = self.module.function(self.name)
            for call in self._calls:
                call(fn)
            self.target, self._calls = fn, []
        return self.target

    def __getattr__(self, attr: str):
        if attr.startswith("_") or attr in ("module", "name", "target"):
            raise AttributeError(attr)  # not set yet (a copy being made): never bind for these
        return getattr(self.bind(), attr)


def when_bound(fn, call) -> None:
    """``call(function)`` once ``fn`` (a function or a ``LazyFunction``) is bound: now, or at its bind."""
    if isinstance(fn, LazyFunction):
        fn._record(call)
    else:
        call(fn)


def bound(fn):
    """The function behind ``fn`` (a ``LazyFunction`` is bound now)."""
    return fn.bind() if isinstance(fn, LazyFunction) else fn


class Compiling:
    """A block (``compiling()``) whose compiles run on a pool of ``workers`` threads: ``module`` /
    ``pdl_module`` / ``compiled`` return at once, nvcc runs meanwhile, and ``bind`` (on this thread,
    which holds the context) loads each module as its cubin arrives and binds every ``LazyFunction``
    the block handed out. ``bind`` runs again at the block's end; an exception from the block (a
    compile error from ``bind`` among them) cancels the compiles not started and waits for the
    running ones before it propagates. ``workers`` 0: no pool, every compile runs where it is asked
    (the order of loads before this existed)."""

    def __init__(self, workers: int | None = None) -> None:
        self.workers = compile_workers() if workers is None else workers
        self.pool: ThreadPoolExecutor | None = None
        self.pending: list[LazyFunction] = []
        self.modules: list[Module] = []  # those it compiles
        self.submitted = 0  # compiles sent to the pool

    def submit(self, fn, *args) -> Future:
        if self.pool is None:
            self.pool = ThreadPoolExecutor(self.workers, thread_name_prefix="nvcc")
        self.submitted += 1
        return self.pool.submit(fn, *args)

    def lazy(self, mod: Module, name: str) -> LazyFunction:
        f = LazyFunction(mod, name)
        self.pending.append(f)
        return f

    def bind(self) -> None:
        """Load every module the block asked for and bind its functions, in the order they were asked."""
        while self.pending:
            self.pending.pop(0).bind()
        for mod in self.modules:
            mod.load()

    def __enter__(self) -> Compiling:
        self._outer = _current()  # a block inside another (a load inside a load) has its own pool
        _local.compiling = self if self.workers > 0 else None  # 0: compiles where asked, in this block too
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is None:
                self.bind()
        finally:
            _local.compiling = self._outer
            if self.pool is not None:
                self.pool.shutdown(wait=True, cancel_futures=True)
            mine = {id(m) for m in self.modules if not m.loaded}
            for key in [k for k, m in _MODULES.items() if id(m) in mine]:
                del _MODULES[key]  # cancelled or failed, or never bound: compiled again when next asked
            self.pending, self.modules = [], []


def compiling(workers: int | None = None) -> Compiling:
    """``Compiling(workers)``: ``with compiling() as c: ...; c.bind()``."""
    return Compiling(workers)


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
        self._bind = binder(self.params)
        self._block = (threads, 1, 1)
        self._fn = mod.get_function(name)  # a LazyFunction inside compiling(), until the block binds it
        self.pdl = isinstance(mod, PdlModule)
        if self.pdl:
            self._slots = ParamSlots(tuple(t for _, t in self.params))
            self._configs: dict = {}  # (grid, stream handle) -> CUlaunchConfig
        else:
            self.fn.prepare("".join(TYPES[t][0] for _, t in self.params))

    @property
    def fn(self):
        """The function (a ``LazyFunction`` until bound: ``set_attribute`` on it is recorded)."""
        f = self._fn
        if isinstance(f, LazyFunction) and f.target is not None:
            self._fn = f = f.target
        return f

    def __call__(self, stream, grid: tuple[int, ...], **values) -> None:
        try:
            args = self._bind(**values)
        except (TypeError, ValueError, OverflowError):
            args = self._checked(values)  # raises, naming the parameter
        grid3 = grid if grid.__class__ is tuple and len(grid) == 3 else tuple(grid) + (1,) * (3 - len(grid))
        if self.pdl:
            self._launch_pdl(stream, grid3, args)
        else:
            self._fn_bound.prepared_async_call(grid3, self._block, stream, *args, shared_size=self.shared)

    def _checked(self, values: dict) -> list:
        """The launch values, converted one by one: a bad one raises TypeError naming its parameter."""
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
        return args

    @property
    def _fn_bound(self):
        """The function, bound (a ``LazyFunction`` binds at its first launch), kept once it is."""
        f = self._fn
        if isinstance(f, LazyFunction):
            f = f.bind()
            self._fn = f
        return f

    def _launch_pdl(self, stream, grid3: tuple[int, ...], args: list) -> None:
        from cuda.bindings import driver as drv

        key = (grid3, stream.handle)
        cfg = self._configs.get(key)
        if cfg is None:
            if len(self._configs) >= MAX_CONFIGS:  # prefill grids vary with the chunk: keep a bounded few
                self._configs.clear()
            cfg = self._configs[key] = launch_config(drv, grid3, (self.threads, 1, 1), self.shared, stream.handle)
        _check(drv.cuLaunchKernelEx(cfg, bound(self.fn), self._slots.fill(args), 0))

"""Compile kernels.c through cffi (API mode) once per source, flags and instruction set; cache the module.

The extension is built by the system C compiler into ``<cache_dir>/`` under a
name carrying a hash of the source and the flags, so an edit or a different
instruction set builds a new module and a warm cache imports in milliseconds.
A build goes to a private temporary directory first and the finished module is
moved into place, so two processes compiling at once never see half a file.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import sys
import tempfile
import threading
from pathlib import Path

HERE = Path(__file__).resolve().parent
# -O3 (vectorised loops); OpenMP for the threads and the simd reductions.
BASE_FLAGS = ("-O3", "-std=gnu11", "-fopenmp")
_VNNI = ("-mavx2", "-mfma", "-mf16c", "-mavxvnni")
ISA_FLAGS = {
    # avx2vnni plus AMX-INT8 tile products for prefill chunks (kernels_amx.c: the bits of
    # avx2vnni's tiled products); AVX-512 for their epilogue only: the compiler's own vectors stay
    # 256 bits wide, so what it vectorises adds in the same order as in the other builds
    "amx": (*_VNNI, "-mamx-tile", "-mamx-int8", "-mavx512f", "-mavx512bw", "-mprefer-vector-width=256"),
    # avx2 plus AVX-VNNI: the prefill products' multiply-adds accumulate in one instruction
    # (vpdpwssd); every other path is avx2's, with the same bits (integer sums are exact)
    "avx2vnni": _VNNI,
    "avx2": ("-mavx2", "-mfma", "-mf16c"),  # the intrinsics path (IG_AVX2 in kernels.c)
    "portable": (),  # plain C; what the compiler does with the baseline ISA
}
_lock = threading.Lock()
log = logging.getLogger("ignis.engine")
_loaded: dict[tuple[str, str], object] = {}


def cpu_flags() -> set[str]:
    """The processor's feature flags (Linux's /proc/cpuinfo; empty elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


ISA_NEEDS = {
    "amx": {"avx2", "fma", "f16c", "avx_vnni", "amx_tile", "amx_int8", "avx512f", "avx512bw"},
    "avx2vnni": {"avx2", "fma", "f16c", "avx_vnni"},
    "avx2": {"avx2", "fma", "f16c"},
    "portable": set(),
}


def runnable_isas(flags: set[str] | None = None) -> list[str]:
    """The builds this processor runs, best first (``portable`` always)."""
    flags = cpu_flags() if flags is None else flags
    return [isa for isa in ISA_FLAGS if ISA_NEEDS[isa] <= flags]


def best_isa(flags: set[str] | None = None) -> str:
    """``amx`` where it also has AMX-INT8 and AVX-512 BW (the kernel must still allow the tiles:
    load_kernels asks), ``avx2vnni`` where the processor also has AVX-VNNI, ``avx2`` where it has AVX2, FMA and F16C;
    else ``portable``."""
    return runnable_isas(flags)[0]


def default_cache_dir() -> Path:
    """``<repo>/models/.cache/cpu-kernels`` (the models directory the server uses by default)."""
    return HERE.parents[2] / "models" / ".cache" / "cpu-kernels"


def load_kernels(isa: str | None = None, cache_dir: str | Path | None = None):
    """The compiled module for ``isa`` (None: the best this processor runs): ``.lib`` and ``.ffi``.

    Raises whatever the compiler or cffi raise when it cannot be built (no compiler,
    no OpenMP): the backend factory turns that into a fallback to numpy.
    """
    isa = isa or best_isa()
    if isa not in ISA_FLAGS:
        raise ValueError(f"cpu backend: unknown instruction set {isa!r} ({' | '.join(ISA_FLAGS)})")
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    key = (isa, str(cache))
    with _lock:
        if key not in _loaded:
            module = _build(isa, cache)
            if isa == "amx" and module.lib.ig_amx_init() != 0:
                # the processor has the tiles but the kernel (arch_prctl) does not lend them
                log.warning("ignis.cpu.amx_refused", extra={"reason": "arch_prctl(ARCH_REQ_XCOMP_PERM) refused"})
                raise RuntimeError("cpu backend: the kernel refuses AMX tiles (arch_prctl ARCH_REQ_XCOMP_PERM)")
            _loaded[key] = module
        return _loaded[key]


def _build(isa: str, cache: Path):
    import cffi

    header = (HERE / "kernels.h").read_text()
    source = (HERE / "kernels.c").read_text()
    flags = [*BASE_FLAGS, *ISA_FLAGS[isa]]
    included = [p.read_text() for p in sorted(HERE.glob("kernels_*.c"))]  # #included by kernels.c
    digest = hashlib.sha256(
        "\0".join([header, source, *included, *flags, cffi.__version__, sys.version]).encode()
    ).hexdigest()
    name = f"_ignis_cpu_{isa}_{digest[:16]}"
    cache.mkdir(parents=True, exist_ok=True)
    found = [p for p in cache.glob(name + ".*") if p.suffix in (".so", ".pyd")]
    if not found:
        ffi = cffi.FFI()
        ffi.cdef(header)
        ffi.set_source(name, source, include_dirs=[str(HERE)], extra_compile_args=flags,
                       extra_link_args=["-fopenmp"])  # fmt: skip
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            built = Path(ffi.compile(tmpdir=tmp, verbose=False))
            target = cache / built.name
            part = f"{target}.{os.getpid()}.part"  # servers starting together each build, one wins
            shutil.move(str(built), part)
            os.replace(part, target)
            found = [target]
    spec = importlib.util.spec_from_file_location(name, found[0])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

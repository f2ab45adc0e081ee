"""Backends behind the step interface, chosen by name."""

from __future__ import annotations

import logging

from engine.backend import Backend
from engine.config import EngineConfig

log = logging.getLogger("ignis.engine")


def create_backend(name: str, config: EngineConfig | None = None) -> Backend:
    """The backend called ``name``, with its knobs from ``config`` (defaults when None).

    ``cpu`` compiles its kernels here; where that fails (no C compiler, no OpenMP)
    the numpy backend stands in, and one log line says why.
    """
    config = config or EngineConfig()
    if name == "cpu":
        try:
            from engine.backends.cpu import CpuBackend

            return CpuBackend(threads=config.cpu_threads, cache_dir=config.cpu_kernel_cache_dir or None)
        except Exception as exc:  # any build failure: the reference backend still serves
            log.warning(
                "ignis.backend.fallback",
                extra={"wanted": "cpu", "using": "numpy", "reason": f"{type(exc).__name__}: {exc}"[:500]},
            )
            name = "numpy"
    if name == "numpy":
        from engine.backends.numpy import NumpyBackend

        return NumpyBackend(blas_threads=config.blas_threads)
    if name == "cuda":
        from engine.backends.cuda import CudaBackend

        return CudaBackend(config.cuda)
    raise ValueError(f"unknown backend {name!r} (numpy | cpu | cuda)")
